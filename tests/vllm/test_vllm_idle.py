"""An engine step with nothing to run waits on the doorbell only while the
workers hold or load KV, and only as long as ``kvguard_idle_wait_ms``
(``kvguard.vllm.idle``). The scheduler-side connector is the real one; the
requests are the fields vLLM's scheduler hands it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

import kvguard.vllm.connector as connector_module
import kvguard.vllm.worker as worker_module
from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.idle import Bell, Doorbell, bell_endpoint
from kvguard.vllm.metadata import KVGuardMetadata, LoadMeta, Source
from kvguard.vllm.settings import Settings
from kvguard.vllm.worker import KVGuardWorker
from tests.mooncake_helpers import requires_mooncake
from tests.vllm.layout_peer import vllm_views
from tests.vllm.ports import free_port
from tests.vllm.test_vllm_worker_layouts import BLOCKS, HEADS, LAYERS, _config

pytestmark = [pytest.mark.vllm]


class Recorder:
    """Stands in for the doorbell: what the connector waited for."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.closed = False

    def wait(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return False

    def close(self) -> None:
        self.closed = True


def connector(role: str, pipeline: int = 1, **extra: Any) -> KVGuardConnector:
    kv = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path="kvguard.vllm.connector",
        kv_role=role,
        kv_connector_extra_config=extra,
    )
    parallel = ParallelConfig(pipeline_parallel_size=pipeline)
    config = VllmConfig(kv_transfer_config=kv, parallel_config=parallel)
    return KVGuardConnector(config, KVConnectorRole.SCHEDULER)


def recorded(c: KVGuardConnector) -> Recorder:
    assert isinstance(c._doorbell, Doorbell)
    c._doorbell.close()
    c._doorbell = rec = Recorder()  # type: ignore[assignment]
    return rec


def step(c: KVGuardConnector, tokens: int = 0) -> None:
    c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens))  # type: ignore[arg-type]


def decode_request(rid: str) -> Any:
    params = {
        "do_remote_prefill": True,
        "kvguard_endpoint": "tcp://127.0.0.1:17600",
        "kvguard_request_id": f"p-{rid}",
        "kvguard_deadline_s": 10.0,
    }
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=list(range(40)),
        status=RequestStatus.WAITING,
    )


def output(**ids: set[str]) -> Any:
    return SimpleNamespace(finished_recving=ids.get("recving"), finished_sending=ids.get("sending"))


def test_a_decode_waits_only_in_steps_with_nothing_to_run_while_a_load_runs() -> None:
    c = connector("kv_consumer", kvguard_idle_wait_ms=7)
    rec = recorded(c)
    step(c)
    assert rec.waits == []  # nothing loads: vLLM would not even step
    req = decode_request("d1")
    c.on_new_request(req)
    step(c)
    assert rec.waits == []  # arrived, blocks not allocated: no load to wait for yet
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[1, 2, 3]])
    c.update_state_after_alloc(req, blocks, 40)
    step(c)
    assert rec.waits == []  # the load goes to the workers first, undelayed
    step(c, tokens=12)
    assert rec.waits == []  # a forward runs: never delayed
    step(c)
    step(c)
    assert rec.waits == [0.007, 0.007]
    late = decode_request("d2")
    c.on_new_request(late)
    step(c)  # not allocated in its first step: it renews its prefill's hold at once
    assert rec.waits == [0.007, 0.007]  # the renewal goes first
    late.status = RequestStatus.FINISHED_ABORTED
    c.request_finished(late, [])  # left before its blocks: the prefill is told to forget
    step(c)
    assert rec.waits == [0.007, 0.007]
    c.request_finished(req, [1, 2, 3])  # aborted while loading: the cancel goes first
    step(c)
    assert rec.waits == [0.007, 0.007]
    step(c)
    assert rec.waits == [0.007, 0.007, 0.007]  # the cancelled load is not over yet
    c.update_connector_output(output(recving={"d1"}))
    step(c)
    assert len(rec.waits) == 3  # over: nothing to wait for
    c.shutdown()
    assert rec.closed and c._doorbell is None


def test_a_prefill_waits_while_it_holds_blocks_for_a_decode() -> None:
    c = connector("kv_producer", kvguard_control_port=17999)
    rec = recorded(c)
    req = SimpleNamespace(
        request_id="p1",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=list(range(40)),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    held, _ = c.request_finished(req, [4, 5])  # type: ignore[arg-type]
    assert held is True
    step(c)
    assert rec.waits == []  # the hold goes to the workers first
    step(c)
    assert rec.waits == [0.005]  # the default
    c.update_connector_output(output(sending={"p1"}))
    step(c)
    assert rec.waits == [0.005]
    c.shutdown()


def test_no_doorbell_when_turned_off_and_bad_waits_are_refused() -> None:
    c = connector("kv_consumer", kvguard_idle_wait_ms=0)
    assert c._doorbell is None
    c.shutdown()
    for bad in (-1, 101):
        message = f"kvguard_idle_wait_ms must be >= 0 and <= 100.0, got {float(bad)}"
        with pytest.raises(ValueError, match=message):
            connector("kv_consumer", kvguard_idle_wait_ms=bad)


@pytest.mark.usefixtures("all_levels")
def test_no_doorbell_where_vllm_reads_a_steps_output_a_step_later() -> None:
    """Pipeline parallel (and async scheduling, on GPUs) run vLLM's batch
    queue: a step with nothing scheduled may have a forward in flight."""
    with capture_logs() as logs:
        c = connector("kv_consumer", pipeline=2)
    assert c._doorbell is None
    off = [e for e in logs if e["event"] == "idle_doorbell_off"]
    assert off == [
        {
            "event": "idle_doorbell_off",
            "why": "vLLM's batch queue reads a step's output late",
            "log_level": "info",
        }
    ]
    c.shutdown()


@pytest.mark.usefixtures("all_levels")
def test_an_engine_core_that_cannot_make_its_doorbell_steps_as_vllm_steps_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    where = f"ipc://{tmp_path}/file/bell"  # under a file: no socket can be made there
    monkeypatch.setattr(connector_module, "doorbell_route", lambda *_: (where, ""))
    with capture_logs() as logs:
        c = connector("kv_consumer")
    assert c._doorbell is None
    (event,) = [e for e in logs if e["event"] == "idle_doorbell_unavailable"]
    assert event["error"].startswith(f"kvguard doorbell cannot listen on {where}: ")
    req = decode_request("d1")
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[1]])
    c.update_state_after_alloc(req, blocks, 40)
    step(c)
    step(c)  # nothing to wait on: returns at once
    c.shutdown()


def test_the_workers_ring_the_engine_cores_own_doorbell() -> None:
    """The worker side finds the scheduler side's doorbell by the engine id
    both read from vLLM's config."""
    c = connector("kv_consumer")
    assert isinstance(c._doorbell, Doorbell)
    engine_id = c._kv_transfer_config.engine_id
    assert engine_id
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    bell = Bell(ctx, bell_endpoint(engine_id, producer=False))
    try:
        bell.ring()
        assert c._doorbell.wait(30.0) is True
    finally:
        bell.close()
        ctx.term()
        c.shutdown()


@requires_mooncake
def test_a_real_decode_worker_rings_its_engine_core_when_a_load_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's receiver rings the doorbell the engine core listens on
    (named by the engine id in both processes' config) once a load can be
    taken: here one whose prefill nobody listens for, which fails at once."""
    monkeypatch.setattr(worker_module, "get_tensor_model_parallel_rank", lambda: 0)
    _, views = vllm_views("LBHNC", LAYERS, BLOCKS, HEADS)
    config = _config("LBHNC", 1)
    door = Doorbell(bell_endpoint(config.kv_transfer_config.engine_id, producer=False))
    w = KVGuardWorker(config, Settings.of({}), producer=False)
    try:
        w.register_kv_caches({f"model.layers.{i}.attn": v for i, v in enumerate(views)})
        nobody = f"tcp://127.0.0.1:{free_port()}"
        due = time.monotonic() + 30
        w.bind(KVGuardMetadata(loads=[LoadMeta("d1", [1, 2], Source(nobody, "p1", 1), due, 1)]))
        assert door.wait(30.0) is True
        results = w.get_transfer_results(set())
        assert (results.finished_recving, results.failed_recving) == ({"d1"}, {"d1"})
    finally:
        w.shutdown()
        door.close()
