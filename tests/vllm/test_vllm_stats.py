"""kvguard's figures in vLLM's stats API and Prometheus (``kvguard.vllm.stats*``).

Unit tests drive the stats container, the worker-side sampler and the
Prometheus class through vLLM's own classes (``KVConnectorLogging``,
``KVConnectorProm``, its msgpack encoder) with no engine. One end-to-end
test runs two OpenAI servers (``tests/vllm/servers.py``) and reads the
figures back from each server's ``/metrics`` and stats log line.
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import random
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.decode_loads import LoadOutcome
from kvguard.vllm.prefill_pushes import SenderStats
from kvguard.vllm.states import LoadEnd
from kvguard.vllm.stats import GAUGES, KVGuardConnectorStats
from kvguard.vllm.stats_prometheus import KVGuardPromMetrics
from kvguard.vllm.stats_sampling import PrefillSample, WorkerStats
from lifecycle import FailureReason
from tests.pd_pair import SRC_LAYOUT, Pair
from tests.vllm.client import complete, http_session, pd
from tests.vllm.ports import free_port
from tests.vllm.servers import MODEL, SERVES_KV, Server, kv_config
from transfer import KVLayout
from transfer.faults import FaultInjectingBackend, FaultKind, FaultPlan

pytestmark = [pytest.mark.vllm]

LAYOUT = KVLayout(num_layers=2, num_blocks=64, block_bytes=4096, kv_split=False)
BLOCK = 2 * 4096  # one block over both layers


def stats(**parts: dict[str, Any]) -> KVGuardConnectorStats:
    data: dict[str, Any] = {"transfers": {}, "bytes": {}, "seconds": {}, "gauges": {}}
    data.update(parts)
    return KVGuardConnectorStats(data=data)


GAUGES_A = {"held_blocks": 3, "quarantined_blocks": 1, "oldest_live_load_seconds": 0.5}
GAUGES_B = {"held_blocks": 0, "quarantined_blocks": 0, "oldest_live_load_seconds": 0.0}


# -- the container ------------------------------------------------------------


def test_empty_stats_have_every_key_and_reduce_to_nothing() -> None:
    s = KVGuardConnectorStats()
    assert s.data == {"transfers": {}, "bytes": {}, "seconds": {}, "gauges": {}}
    assert s.is_empty()
    assert s.reduce() == {}
    assert KVGuardConnector.build_kv_connector_stats(None).data == s.data  # type: ignore[union-attr]
    assert KVGuardConnector.build_kv_connector_stats({}).data == s.data  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "part",
    [
        {"transfers": {"decode/loaded/": 1}},
        {"bytes": {"prefill": 0}},
        {"seconds": {"decode/failed": []}},
        {"gauges": GAUGES_B},
    ],
)
def test_any_entry_makes_stats_non_empty(part: dict[str, Any]) -> None:
    assert not stats(**part).is_empty()


def test_aggregate_adds_counters_and_samples_and_keeps_the_newer_gauges() -> None:
    a = stats(
        transfers={"decode/loaded/": 2, "decode/failed/timeout": 1},
        bytes={"decode": 10 * BLOCK},
        seconds={"decode/loaded": [0.25, 0.5]},
        gauges=dict(GAUGES_A),
    )
    b = stats(
        transfers={"decode/loaded/": 3, "decode/failed/peer_lost": 1},
        bytes={"decode": 2 * BLOCK},
        seconds={"decode/loaded": [1.0], "decode/failed": [2.0]},
        gauges=dict(GAUGES_B),
    )
    assert a.aggregate(b) is a
    assert a.data == {
        "transfers": {
            "decode/loaded/": 5,
            "decode/failed/timeout": 1,
            "decode/failed/peer_lost": 1,
        },
        "bytes": {"decode": 12 * BLOCK},
        "seconds": {"decode/loaded": [0.25, 0.5, 1.0], "decode/failed": [2.0]},
        "gauges": GAUGES_B,
    }
    # A step that read no gauges leaves the last ones; an empty one changes nothing.
    a.aggregate(stats(transfers={"decode/loaded/": 1})).aggregate(KVGuardConnectorStats())
    assert a.data["gauges"] == GAUGES_B
    assert a.data["transfers"]["decode/loaded/"] == 6
    assert b.data["transfers"] == {"decode/loaded/": 3, "decode/failed/peer_lost": 1}


def test_reset_empties_what_aggregate_filled() -> None:
    s = stats(transfers={"prefill/done/": 1}, gauges=dict(GAUGES_A))
    s.reset()
    assert s.is_empty()
    assert s.data == KVGuardConnectorStats().data


def test_reduce_summarises_counts_bytes_times_and_gauges() -> None:
    s = stats(
        transfers={"decode/loaded/": 10, "decode/failed/timeout": 2},
        bytes={"decode": 3 * 2**20},
        seconds={"decode/loaded": [i / 1000 for i in range(1, 11)]},  # 1..10 ms
        gauges=dict(GAUGES_A),
    )
    assert s.reduce() == {
        "decode failed timeout": 2,
        "decode loaded": 10,
        "decode MB": 3.0,
        "decode loaded avg ms": 5.5,
        "decode loaded p90 ms": 9.0,
        "held blocks": 3,
        "quarantined blocks": 1,
        "oldest live load seconds": 0.5,
    }
    two = stats(seconds={"prefill/done": [0.004, 0.002]}).reduce()
    assert two == {"prefill done avg ms": 3.0, "prefill done p90 ms": 4.0}


def test_aggregate_of_another_connectors_stats_is_a_type_error_and_changes_nothing() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    s = stats(transfers={"prefill/done/": 1})
    with pytest.raises(TypeError, match="NixlKVConnectorStats"):
        s.aggregate(NixlKVConnectorStats())
    assert s.data["transfers"] == {"prefill/done/": 1}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"transfers": {}}, "keys must be"),
        ({"transfers": {}, "bytes": {}, "seconds": {}, "gauges": {}, "x": {}}, "'x'"),
        ("transfers", "keys must be ['transfers', 'bytes', 'seconds', 'gauges'], got 'str'"),
        ({"transfers": [], "bytes": {}, "seconds": {}, "gauges": {}}, "transfers must be a dict"),
    ],
)
def test_a_payload_of_the_wrong_shape_is_a_value_error_naming_it(data: Any, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        KVGuardConnectorStats(data=data)


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"transfers": {"decode/loaded": 1}}, "'decode/loaded' is not role/outcome/reason"),
        ({"transfers": {"decode/done/": 1}}, "no outcome 'done' for role 'decode'"),
        ({"transfers": {"router/done/": 1}}, "for role 'router'"),
        ({"transfers": {"decode/failed/": 1}}, "only a failure has a reason"),
        ({"transfers": {"decode/loaded/timeout": 1}}, "only a failure has a reason"),
        ({"transfers": {"decode/loaded/": -1}}, "got -1"),
        ({"transfers": {"decode/loaded/": 1.5}}, "got 1.5"),
        ({"transfers": {"decode/loaded/": True}}, "got True"),
        ({"bytes": {"router": 1}}, "unknown role 'router'"),
        ({"bytes": {"decode": "12"}}, "got '12'"),
        ({"seconds": {"decode/loaded": 0.5}}, "must be a list, got 0.5"),
        ({"seconds": {"decode/loaded": [math.nan]}}, "got nan"),
        ({"seconds": {"decode/loaded": [math.inf]}}, "got inf"),
        ({"seconds": {"decode/done": [1.0]}}, "no outcome 'done'"),
        ({"gauges": {"held": 1}}, "unknown gauge 'held'"),
        ({"gauges": {"held_blocks": 0.5}}, "got 0.5"),
        ({"gauges": {"oldest_live_load_seconds": -1.0}}, "got -1.0"),
    ],
)
def test_a_bad_entry_is_a_value_error_naming_it(part: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        stats(**part)


def test_stats_cross_processes_as_vllm_sends_them() -> None:
    # Worker -> engine core: pickled; engine core -> API server: msgpack of data.
    s = stats(
        transfers={"decode/loaded/": 2, "decode/failed/timeout": 1},
        bytes={"decode": 7 * BLOCK},
        seconds={"decode/loaded": [0.125, 0.25]},
        gauges=dict(GAUGES_A),
    )
    assert pickle.loads(pickle.dumps(s)).data == s.data
    wire = MsgpackDecoder().decode(MsgpackEncoder().encode(s.to_dict()))
    assert KVGuardConnector.build_kv_connector_stats(wire).data == s.data  # type: ignore[union-attr]


def test_vllms_logging_accumulates_steps_and_logs_the_reduction() -> None:
    cfg = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path="kvguard.vllm.connector",
        kv_role="kv_consumer",
    )
    logging = KVConnectorLogging(cfg)
    logging.observe(stats(transfers={"decode/loaded/": 1}, gauges=dict(GAUGES_A)).data)
    logging.observe(stats(transfers={"decode/loaded/": 2}, bytes={"decode": 2**20}).data)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == [
        "KV Transfer metrics: decode loaded=3, decode MB=1.0, held blocks=3, "
        "quarantined blocks=1, oldest live load seconds=0.5"
    ]
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after logging: nothing new, nothing logged


# -- Prometheus -----------------------------------------------------------------

LABELS = ["model_name", "engine"]
ENGINES: dict[int, list[object]] = {0: ["m", "0"], 1: ["m", "1"]}


def _prom(role: str) -> tuple[KVGuardPromMetrics, CollectorRegistry]:
    """kvguard's metrics on a registry of this test's own."""
    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_role=role))
    return KVGuardPromMetrics(cfg, types, LABELS, ENGINES), reg


def test_prometheus_series_exist_at_zero_for_this_engines_role() -> None:
    _, reg = _prom("kv_producer")
    for engine in ("0", "1"):
        base = {"model_name": "m", "engine": engine, "role": "prefill"}
        for outcome in ("done", "expired", "aborted", "refused"):
            labels = {**base, "outcome": outcome, "reason": ""}
            assert reg.get_sample_value("vllm:kvguard_transfers_total", labels) == 0.0
        for reason in FailureReason:
            labels = {**base, "outcome": "failed", "reason": reason.value}
            assert reg.get_sample_value("vllm:kvguard_transfers_total", labels) == 0.0
        assert reg.get_sample_value("vllm:kvguard_transfer_bytes_total", base) == 0.0
        done = {**base, "outcome": "done"}
        assert reg.get_sample_value("vllm:kvguard_transfer_seconds_count", done) == 0.0
        for gauge in GAUGES:
            engine_only = {"model_name": "m", "engine": engine}
            assert reg.get_sample_value(f"vllm:kvguard_{gauge}", engine_only) == 0.0
    decode = {"model_name": "m", "engine": "0", "role": "decode"}
    assert reg.get_sample_value("vllm:kvguard_transfer_bytes_total", decode) is None


def test_prometheus_observe_records_one_engines_figures() -> None:
    prom, reg = _prom("kv_consumer")
    step = stats(
        transfers={"decode/loaded/": 2, "decode/failed/peer_lost": 1},
        bytes={"decode": 5 * BLOCK},
        seconds={"decode/loaded": [0.003, 0.2], "decode/failed": [3.0]},
        gauges=dict(GAUGES_A),
    )
    prom.observe(step.data, engine_idx=1)
    prom.observe(stats(transfers={"decode/loaded/": 1}).data, engine_idx=1)
    e1 = {"model_name": "m", "engine": "1", "role": "decode"}
    e0 = {**e1, "engine": "0"}

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, {**e1, **labels})

    assert value("vllm:kvguard_transfers_total", outcome="loaded", reason="") == 3.0
    assert value("vllm:kvguard_transfers_total", outcome="failed", reason="peer_lost") == 1.0
    assert value("vllm:kvguard_transfer_bytes_total") == 5 * BLOCK
    assert value("vllm:kvguard_transfer_seconds_count", outcome="loaded") == 2.0
    assert value("vllm:kvguard_transfer_seconds_sum", outcome="loaded") == pytest.approx(0.203)
    assert value("vllm:kvguard_transfer_seconds_bucket", outcome="loaded", le="0.005") == 1.0
    assert value("vllm:kvguard_transfer_seconds_count", outcome="failed") == 1.0
    engine1 = {"model_name": "m", "engine": "1"}
    assert reg.get_sample_value("vllm:kvguard_held_blocks", engine1) == 3.0
    assert reg.get_sample_value("vllm:kvguard_quarantined_blocks", engine1) == 1.0
    assert reg.get_sample_value("vllm:kvguard_oldest_live_load_seconds", engine1) == 0.5
    # The other engine's series did not move.
    labels0 = {**e0, "outcome": "loaded", "reason": ""}
    assert reg.get_sample_value("vllm:kvguard_transfers_total", labels0) == 0.0
    assert reg.get_sample_value("vllm:kvguard_held_blocks", {"model_name": "m", "engine": "0"}) == 0


def test_prometheus_observe_of_a_bad_payload_raises_before_moving_anything() -> None:
    prom, reg = _prom("kv_consumer")
    bad = stats(transfers={"decode/loaded/": 4}).data
    bad["gauges"] = {"held": 1}
    with pytest.raises(ValueError, match="unknown gauge 'held'"):
        prom.observe(bad, engine_idx=0)
    labels = {"model_name": "m", "engine": "0", "role": "decode", "outcome": "loaded", "reason": ""}
    assert reg.get_sample_value("vllm:kvguard_transfers_total", labels) == 0.0


def test_vllms_prometheus_hook_builds_kvguards_metrics_on_the_global_registry() -> None:
    unregister_vllm_metrics()
    try:
        cfg = SimpleNamespace(
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVGuardConnector",
                kv_connector_module_path="kvguard.vllm.connector",
                kv_role="kv_consumer",
            )
        )
        prom = KVConnectorProm(cfg, LABELS, {0: ["m", "0"]})  # type: ignore[arg-type]
        assert isinstance(prom.prom_metrics, KVGuardPromMetrics)
        prom.observe(stats(transfers={"decode/failed/timeout": 2}).data, 0)
        labels = {
            "model_name": "m",
            "engine": "0",
            "role": "decode",
            "outcome": "failed",
            "reason": "timeout",
        }
        got = prometheus_client.REGISTRY.get_sample_value("vllm:kvguard_transfers_total", labels)
        assert got == 2.0
    finally:
        unregister_vllm_metrics()


# -- the worker-side sampler ------------------------------------------------------


def prefill_sample(
    held: int = 0, q: int = 0, age: float = 0.0, nbytes: int = 0, **counts: Any
) -> PrefillSample:
    return PrefillSample(SenderStats(**counts), nbytes, held, q, age)


def test_prefill_first_reading_is_against_zero_then_each_is_a_delta() -> None:
    w = WorkerStats(LAYOUT)
    assert w.block_bytes == BLOCK
    first = w.prefill(prefill_sample(held=4, done=1, nbytes=BLOCK), [("done", 0.01)])
    assert first is not None and first.data == {
        "transfers": {"prefill/done/": 1},
        "bytes": {"prefill": BLOCK},
        "seconds": {"prefill/done": [0.01]},
        "gauges": {"held_blocks": 4, "quarantined_blocks": 0, "oldest_live_load_seconds": 0.0},
    }
    second = w.prefill(
        prefill_sample(
            held=4,
            nbytes=3 * BLOCK,
            done=3,
            failed=2,
            expired=1,
            aborted=1,
            refused=1,
            by_reason={"timeout": 1, "peer_lost": 1},
        ),
        [("done", 0.02), ("done", 0.03), ("failed", 5.0), ("failed", 1.0)],
    )
    assert second is not None and second.data == {
        "transfers": {
            "prefill/done/": 2,
            "prefill/expired/": 1,
            "prefill/aborted/": 1,
            "prefill/refused/": 1,
            "prefill/failed/timeout": 1,
            "prefill/failed/peer_lost": 1,
        },
        "bytes": {"prefill": 2 * BLOCK},
        "seconds": {"prefill/done": [0.02, 0.03], "prefill/failed": [5.0, 1.0]},
        "gauges": {},  # unchanged: not sent again
    }
    same = prefill_sample(
        held=4,
        nbytes=3 * BLOCK,
        done=3,
        failed=2,
        expired=1,
        aborted=1,
        refused=1,
        by_reason={"timeout": 1, "peer_lost": 1},
    )
    assert w.prefill(same) is None  # an idle step: nothing to send
    moved = w.prefill(replace_gauges(same, held=0, q=2, age=1.5))
    assert moved is not None and moved.data == {
        "transfers": {},
        "bytes": {},
        "seconds": {},
        "gauges": {"held_blocks": 0, "quarantined_blocks": 2, "oldest_live_load_seconds": 1.5},
    }
    more = replace(same.stats, failed=4, by_reason={"timeout": 3, "peer_lost": 1})
    again = w.prefill(PrefillSample(more, 3 * BLOCK, 0, 2, 1.5), [("failed", 5.0)] * 2)
    assert again is not None and again.data == {
        "transfers": {"prefill/failed/timeout": 2},
        "bytes": {},
        "seconds": {"prefill/failed": [5.0, 5.0]},
        "gauges": {},
    }


def replace_gauges(s: PrefillSample, *, held: int, q: int, age: float) -> PrefillSample:
    return PrefillSample(s.stats, s.bytes_done, held, q, age)


def outcome(
    rid: str, ok: bool, reason: str = "", latency: float = 0.1, fenced: bool = False
) -> LoadOutcome:
    end = LoadEnd.LOADED if ok else LoadEnd(reason)
    assert end.ok == ok
    return LoadOutcome(request_id=rid, end=end, detail="", latency_s=latency, fenced=fenced)


def test_decode_counts_each_outcome_once_with_its_blocks_bytes() -> None:
    w = WorkerStats(LAYOUT)
    seen: list[LoadOutcome] = []
    # Step 1 (t=10): two loads start, none ended.
    s1 = w.decode([("a", 3), ("b", 2)], seen, {"a": 3, "b": 2}, now=10.0)
    assert s1 is not None and s1.data == {
        "transfers": {},
        "bytes": {},
        "seconds": {},
        "gauges": {"held_blocks": 5, "quarantined_blocks": 0, "oldest_live_load_seconds": 0.0},
    }
    # Step 2 (t=12): "a" loaded; "c" starts and fails within the step.
    seen += [outcome("a", True, latency=1.5), outcome("c", False, "peer_lost", 0.25)]
    s2 = w.decode([("c", 4)], list(seen), {"b": 2}, now=12.0)
    assert s2 is not None and s2.data == {
        "transfers": {"decode/loaded/": 1, "decode/failed/peer_lost": 1},
        "bytes": {"decode": 3 * BLOCK},
        "seconds": {"decode/loaded": [1.5], "decode/failed": [0.25]},
        "gauges": {"held_blocks": 2, "quarantined_blocks": 0, "oldest_live_load_seconds": 2.0},
    }
    # Step 3: the same outcomes again are not counted twice; the age grows.
    s3 = w.decode([], list(seen), {"b": 2}, now=13.0)
    assert s3 is not None and s3.data["transfers"] == {}
    assert s3.data["gauges"]["oldest_live_load_seconds"] == 3.0
    # Step 4: "b" times out; nothing is left in flight.
    seen.append(outcome("b", False, "timeout", 4.0))
    s4 = w.decode([], list(seen), {}, now=14.0)
    assert s4 is not None and s4.data == {
        "transfers": {"decode/failed/timeout": 1},
        "bytes": {},
        "seconds": {"decode/failed": [4.0]},
        "gauges": {"held_blocks": 0, "quarantined_blocks": 0, "oldest_live_load_seconds": 0.0},
    }
    assert w.decode([], list(seen), {}, now=20.0) is None  # idle: nothing changed


def test_decode_a_fenced_loads_blocks_are_quarantined_until_vllm_gets_them_back() -> None:
    w = WorkerStats(LAYOUT)
    w.decode([("a", 3), ("b", 2)], [], {"a": 3, "b": 2}, now=0.0)
    # "a" failed fenced: counted once now, its blocks stay out of use.
    seen = [outcome("a", False, "peer_lost", 3.0, fenced=True)]
    s = w.decode([], seen, {"a": 3, "b": 2}, now=3.0)
    assert s is not None and s.data == {
        "transfers": {"decode/failed/peer_lost": 1},
        "bytes": {},
        "seconds": {"decode/failed": [3.0]},
        "gauges": {"held_blocks": 2, "quarantined_blocks": 3, "oldest_live_load_seconds": 3.0},
    }
    # The prefill let go: the connector gave "a"'s blocks back; nothing is counted again.
    s = w.decode([], seen, {"b": 2}, now=4.0)
    assert s is not None and s.data == {
        "transfers": {},
        "bytes": {},
        "seconds": {},
        "gauges": {"held_blocks": 2, "quarantined_blocks": 0, "oldest_live_load_seconds": 4.0},
    }


def test_decode_finds_new_outcomes_after_the_receiver_dropped_old_ones() -> None:
    w = WorkerStats(LAYOUT)
    first = [outcome(f"r{i}", True) for i in range(3)]
    w.decode([(f"r{i}", 1) for i in range(6)], first, {f"r{i}": 1 for i in range(3, 6)}, 0.0)
    # The receiver keeps only its most recent outcomes: r0 and r1 fell off.
    later = [*first[2:], *(outcome(f"r{i}", True) for i in range(3, 6))]
    s = w.decode([], later, {}, now=1.0)
    assert s is not None and s.data["transfers"] == {"decode/loaded/": 3}
    assert s.data["bytes"] == {"decode": 3 * BLOCK}
    # An outcome of a load this side never saw start: counted, no bytes to its name.
    s = w.decode([], [*later, outcome("z", True)], {}, now=2.0)
    assert s is not None and s.data == {
        "transfers": {"decode/loaded/": 1},
        "bytes": {},
        "seconds": {"decode/loaded": [0.1]},
        "gauges": {},
    }


def test_the_sampler_reads_a_real_sender_and_receiver() -> None:
    """``sample`` on a real prefill and decode (tests/pd_pair.py): the prefill's
    push counted once, with its bytes and its time, however many steps sampled
    before it; the decode's load the same; a worker that is neither sends nothing.
    The prefill's engine loses the decode at the second push."""
    script = FaultPlan.script([FaultKind.NONE, FaultKind.LOSE_PEER])
    pair = Pair(wrap=lambda backend: FaultInjectingBackend(backend, script))
    try:
        pre, dec = WorkerStats(SRC_LAYOUT), WorkerStats(SRC_LAYOUT)
        block = pre.block_bytes
        assert pre.sample(None, None, [("x", 1)], {"x": 1}, 0.0) is None
        idle = {"held_blocks": 0, "quarantined_blocks": 0, "oldest_live_load_seconds": 0.0}
        first = pre.sample(pair.sender, None, [], {}, 0.0)
        assert first is not None and first.data == {
            "transfers": {},
            "bytes": {},
            "seconds": {},
            "gauges": idle,
        }
        assert type(first.data["gauges"]["quarantined_blocks"]) is int  # blocks, not bytes
        assert pre.sample(pair.sender, None, [], {}, 0.0) is None  # no second observer either
        pair.sender.hold("r1", [1, 2, 3], time.monotonic() + 10)
        pair.until(lambda: pair.sender.holding() == 1)  # the sender thread took it
        held = pre.sample(pair.sender, None, [], {}, 0.0)
        assert held is not None and held.data["gauges"] == {**idle, "held_blocks": 3}
        t0 = time.monotonic()
        pair.receiver.expect("r1", pair.sender.endpoint, "r1", [4, 5, 6], t0 + 10)
        pair.until(lambda: "r1" in pair.outcomes and "r1" in pair.released)
        took = time.monotonic() - t0
        # The push's observer ran before its hold went: one reading has it all.
        done = pre.sample(pair.sender, None, [], {}, 0.0)
        assert done is not None
        [seconds] = done.data["seconds"].pop("prefill/done")
        assert 0.0 < seconds <= took
        assert done.data == {
            "transfers": {"prefill/done/": 1},
            "bytes": {"prefill": 3 * block},
            "seconds": {},
            "gauges": idle,
        }
        assert pre.sample(pair.sender, None, [], {}, 0.0) is None
        loaded = dec.sample(None, pair.receiver, [("r1", 3)], {}, 5.0)
        assert loaded is not None
        assert loaded.data["seconds"] == {"decode/loaded": [pair.outcomes["r1"].latency_s]}
        assert loaded.data["transfers"] == {"decode/loaded/": 1}
        assert loaded.data["bytes"] == {"decode": 3 * block}
        assert dec.sample(None, pair.receiver, [], {}, 6.0) is None
        # The second load: waiting in vLLM one step, then failed.
        pending = dec.sample(None, pair.receiver, [("r2", 2)], {"r2": 2}, 7.0)
        assert pending is not None and pending.data["gauges"] == {**idle, "held_blocks": 2}
        lost = pair.load("r2", [7, 8], [9, 10])
        assert not lost.ok
        failed = pre.sample(pair.sender, None, [], {}, 0.0)
        assert failed is not None
        [seconds] = failed.data["seconds"].pop("prefill/failed")
        assert 0.0 < seconds < 10.0
        assert failed.data == {
            "transfers": {f"prefill/failed/{lost.reason}": 1},
            "bytes": {},
            "seconds": {},
            "gauges": {},
        }
        ended = dec.sample(None, pair.receiver, [], {}, 8.0)
        assert ended is not None and ended.data == {
            "transfers": {f"decode/failed/{lost.reason}": 1},
            "bytes": {},
            "seconds": {"decode/failed": [lost.latency_s]},
            "gauges": idle,
        }
    finally:
        pair.close()


def test_the_scheduler_side_connector_reports_no_stats() -> None:
    w = WorkerStats(LAYOUT)
    assert w.sample(None, None, [("a", 1)], {"a": 1}, now=0.0) is None


# -- end to end: two OpenAI servers ------------------------------------------------------


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    prefill = Server(
        "stats-prefill",
        kv_config("kv_producer", kvguard_control_port=free_port(), kvguard_deadline_s=10.0),
    )
    decode = Server("stats-decode", kv_config("kv_consumer", "fail", kvguard_deadline_s=10.0))
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    total, found = 0.0, False
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if base == name and all(have.get(k) == v for k, v in labels.items()):
            total, found = total + value, True
    if not found:
        raise KeyError(f"no sample {name}{labels}")
    return total


def _bytes_per_block(block_size: int) -> int:
    """One block's K and V over every layer, from the checkpoint (float32)."""
    c = json.loads((MODEL / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_layer = 2 * block_size * c["num_key_value_heads"] * head_dim * 4
    return int(c["num_hidden_layers"] * per_layer)


@pytest.mark.timeout(900)
def test_servers_export_kvguards_figures_on_metrics(servers: tuple[Server, Server]) -> None:
    prefill, decode = servers
    rng = random.Random(7)
    lengths = [40, 70, 90]  # 2, 3 and 3 blocks of 32
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]
    nowhere = free_port()  # nobody listens there: the load fails

    async def run() -> tuple[list[int], int]:
        async with http_session() as http:
            # The longest deadline: vLLM's own stalled steps (docs/vllm.md) must not
            # fail a load whose figures the test counts.
            statuses = [
                (await pd(http, prefill, decode, p, 4, kv=SERVES_KV)).status for p in prompts
            ]
            params = {
                "do_remote_prefill": True,
                "kvguard_endpoint": f"tcp://127.0.0.1:{nowhere}",
                "kvguard_request_id": "never-held",
            }
            failed, _ = await complete(http, decode, prompts[0][:50], 4, params)
            return statuses, failed.status

    statuses, failed_status = asyncio.run(run())
    assert statuses == [200, 200, 200], decode.log_tail()
    assert failed_status != 200

    want_bytes = sum(math.ceil(n / 32) for n in lengths) * _bytes_per_block(32)
    # Each step's stats reach the API server with that step's outputs: wait for the last.
    want_decode = {
        ("vllm:kvguard_transfers_total", "loaded", ""): 3.0,
        ("vllm:kvguard_transfers_total", "failed", "peer_lost"): 1.0,
        ("vllm:kvguard_transfer_seconds_count", "loaded", None): 3.0,
        ("vllm:kvguard_transfer_seconds_count", "failed", None): 1.0,
    }

    def decode_counts(d: dict[str, float]) -> dict[tuple[str, str, str | None], float]:
        out = {}
        for name, outcome, reason in want_decode:
            labels = {"role": "decode", "outcome": outcome}
            if reason is not None:
                labels["reason"] = reason
            out[name, outcome, reason] = _sample(d, name, **labels)
        return out

    end = time.monotonic() + 60
    while True:
        d, p = decode.metrics(), prefill.metrics()
        got_decode = decode_counts(d)
        settled = (
            got_decode == want_decode
            and _sample(d, "vllm:kvguard_held_blocks") == 0
            and _sample(p, "vllm:kvguard_held_blocks") == 0
            and _sample(p, "vllm:kvguard_transfers_total", outcome="done") == 3
            and _sample(p, "vllm:kvguard_transfer_seconds_count", outcome="done") == 3
        )
        if settled or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert got_decode == want_decode, decode.log_tail()
    assert _sample(d, "vllm:kvguard_transfer_bytes_total", role="decode") == want_bytes
    assert _sample(d, "vllm:kvguard_held_blocks") == 0
    assert _sample(d, "vllm:kvguard_oldest_live_load_seconds") == 0
    assert _sample(d, "vllm:kvguard_quarantined_blocks") == 0
    # The prefill: three pushes done, their bytes the same as the decode's.
    assert _sample(p, "vllm:kvguard_transfers_total", role="prefill", outcome="done") == 3
    assert _sample(p, "vllm:kvguard_transfers_total", role="prefill", outcome="failed") == 0
    assert _sample(p, "vllm:kvguard_transfer_bytes_total", role="prefill") == want_bytes
    assert _sample(p, "vllm:kvguard_transfer_seconds_count", role="prefill", outcome="done") == 3
    assert _sample(p, "vllm:kvguard_held_blocks") == 0
    assert _sample(p, "vllm:kvguard_quarantined_blocks") == 0
    assert _sample(p, "vllm:kvguard_oldest_live_load_seconds") == 0
    # vLLM's periodic stats line carries the reduction (every 10 s by default).
    end = time.monotonic() + 30
    while "KV Transfer metrics: decode failed peer_lost=1" not in decode.log.read_text(
        errors="replace"
    ):
        assert time.monotonic() < end, decode.log_tail()
        time.sleep(1.0)
