"""kvguard's figures in vLLM's stats API and its Prometheus ``/metrics``.

vLLM carries a connector's figures in three hops, and each class here is one:

* the worker, once per step: ``KVGuardConnector.get_kv_connector_stats``
  asks ``WorkerStats.sample`` for what changed since the last step, a
  ``KVGuardConnectorStats`` (or None: nothing changed);
* the engine core sums the workers' and the steps' stats with ``aggregate``
  and ships ``data`` (plain dicts, lists and numbers) to the API server;
* the API server logs ``reduce()`` each logging interval and records every
  step's ``data`` in ``KVGuardPromMetrics`` (per engine label, as vLLM's own
  connectors do).

Counters (transfers by outcome and reason, bytes) and the transfer-time
samples are deltas: aggregating adds them. Gauges (held and quarantined
blocks, the oldest live transfer's age) are the latest reading: aggregating
keeps the newer one. That is exact across steps. Across tensor parallel
ranks (vLLM aggregates their stats each step) counters add up per rank: a
prefill of TP 2 counts each request's push twice, one per rank; gauges keep
one rank's reading, which for blocks is every rank's (vLLM's block ids are
the same on all ranks).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lifecycle import FailureReason, TransferState
from scheduler import Finished
from scheduler.metrics import LATENCY_BUCKETS
from transfer import KVLayout

from .decode_loads import LoadOutcome
from .prefill_pushes import PrefillSender, SenderStats

__all__ = [
    "GAUGES",
    "OUTCOMES",
    "KVGuardConnectorStats",
    "KVGuardPromMetrics",
    "PrefillSample",
    "WorkerStats",
]

# What ends a transfer, per role. Prefill: a held request's push (done or
# failed by kvguard), or its hold ending without one. Decode: a load.
OUTCOMES: Final[Mapping[str, tuple[str, ...]]] = {
    "prefill": ("done", "failed", "expired", "aborted", "refused"),
    "decode": ("loaded", "failed"),
}
# Only a failure has a reason; every other outcome's reason is "".
_FAILED: Final = "failed"
_DONE: Final = {"prefill": "done", "decode": "loaded"}  # the outcome that moved bytes
GAUGES: Final = ("held_blocks", "quarantined_blocks", "oldest_live_load_seconds")
_KEYS: Final = ("transfers", "bytes", "seconds", "gauges")
_SEP: Final = "/"  # transfers: "role/outcome/reason"; seconds: "role/outcome"


class _Outcomes(Protocol):
    """A decode's loads as vLLM hears of them (``DecodeLegs``, ``DecodeReceiver``)."""

    def recent_outcomes(self) -> list[LoadOutcome]: ...


def _number(where: str, value: object, *, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 <= value < math.inf:
        kind = "int" if integer else "number"
        raise ValueError(f"kvguard stats: {where} must be a finite {kind} >= 0, got {value!r}")


def _outcome(where: str, role: str, outcome: str) -> None:
    if outcome not in OUTCOMES.get(role, ()):
        raise ValueError(f"kvguard stats: {where}: no outcome {outcome!r} for role {role!r}")


def _validate(data: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first bad key or value of a stats payload."""
    if not isinstance(data, Mapping) or sorted(data) != sorted(_KEYS):
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"kvguard stats: keys must be {list(_KEYS)}, got {got!r}")
    for key in _KEYS:
        if not isinstance(data[key], dict):
            raise ValueError(f"kvguard stats: {key} must be a dict, got {data[key]!r}")
    for name, count in data["transfers"].items():
        parts = str(name).split(_SEP, 2)
        if not isinstance(name, str) or len(parts) != 3:
            raise ValueError(f"kvguard stats: transfers key {name!r} is not role/outcome/reason")
        role, outcome, reason = parts
        _outcome(f"transfers {name!r}", role, outcome)
        if (outcome == _FAILED) != (reason != ""):
            raise ValueError(f"kvguard stats: transfers {name!r}: only a failure has a reason")
        _number(f"transfers {name!r}", count, integer=True)
    for role, nbytes in data["bytes"].items():
        if role not in OUTCOMES:
            raise ValueError(f"kvguard stats: bytes of unknown role {role!r}")
        _number(f"bytes {role!r}", nbytes, integer=True)
    for name, samples in data["seconds"].items():
        role, _, outcome = str(name).partition(_SEP)
        _outcome(f"seconds {name!r}", role, outcome)
        if not isinstance(samples, list):
            raise ValueError(f"kvguard stats: seconds {name!r} must be a list, got {samples!r}")
        for s in samples:
            _number(f"seconds {name!r}", s, integer=False)
    for gauge, value in data["gauges"].items():
        if gauge not in GAUGES:
            raise ValueError(f"kvguard stats: unknown gauge {gauge!r}")
        _number(f"gauge {gauge!r}", value, integer=gauge != "oldest_live_load_seconds")


@dataclass
class KVGuardConnectorStats(KVConnectorStats):
    """One interval's kvguard figures; ``data`` is what crosses processes::

        {"transfers": {"decode/loaded/": 3, "decode/failed/timeout": 1},  # counts
         "bytes":     {"decode": 3145728},                     # moved by done transfers
         "seconds":   {"decode/loaded": [0.012, ...]},         # transfer times
         "gauges":    {"held_blocks": 2, ...}}                 # latest; {} if none read

    A payload that does not have this shape raises ValueError on construction.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            _validate(self.data)

    def reset(self) -> None:
        self.data: dict[str, Any] = {key: {} for key in _KEYS}

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters and samples to these; keep its gauges if it has any."""
        if not isinstance(other, KVGuardConnectorStats):
            raise TypeError(f"kvguard stats cannot aggregate {type(other).__name__}")
        mine, theirs = self.data, other.data
        for key in ("transfers", "bytes"):
            for name, n in theirs[key].items():
                mine[key][name] = mine[key].get(name, 0) + n
        for name, samples in theirs["seconds"].items():
            mine["seconds"].setdefault(name, []).extend(samples)
        if theirs["gauges"]:
            mine["gauges"] = dict(theirs["gauges"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's log line."""
        out: dict[str, int | float] = {}
        for name, n in sorted(self.data["transfers"].items()):
            out[" ".join(p for p in name.split(_SEP) if p)] = n
        for role, nbytes in sorted(self.data["bytes"].items()):
            out[f"{role} MB"] = round(nbytes / 2**20, 3)
        for name, samples in sorted(self.data["seconds"].items()):
            label = name.replace(_SEP, " ")
            ordered = sorted(samples)
            out[f"{label} avg ms"] = round(sum(ordered) / len(ordered) * 1e3, 3)
            p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank
            out[f"{label} p90 ms"] = round(p90 * 1e3, 3)
        for gauge, value in self.data["gauges"].items():
            out[gauge.replace("_", " ")] = value
        return out


class KVGuardPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvguard_*`` metrics, one labelled series set per engine.

    This engine's role comes from its ``kv_role``; every (outcome, "") series
    and its bytes and time series exist from the start, at zero, so a first
    failure is a rate and not a new series.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kv_role = getattr(self._kv_transfer_config, "kv_role", None)
        role = "prefill" if kv_role == "kv_producer" else "decode"
        self._transfers = self._counter_cls(
            name="vllm:kvguard_transfers",
            documentation="kvguard transfers that ended, by role, outcome and failure reason "
            '(reason="" unless failed). Prefill: a held request\'s push ended done or '
            "failed, or its hold ended expired (no decode asked), aborted (the decode "
            "will not ask) or refused (a push that could not start). Decode: a load "
            "ended loaded or failed.",
            labelnames=[*labelnames, "role", "outcome", "reason"],
        )
        self._bytes = self._counter_cls(
            name="vllm:kvguard_transfer_bytes",
            documentation="KV bytes moved by kvguard transfers that ended done (prefill) "
            "or loaded (decode).",
            labelnames=[*labelnames, "role"],
        )
        self._seconds = self._histogram_cls(
            name="vllm:kvguard_transfer_seconds",
            documentation="kvguard transfer time by role and outcome. Prefill: a push's "
            "submit to kvguard's terminal state (done or failed). Decode: asking the "
            "prefill to the load's outcome (loaded or failed).",
            buckets=list(LATENCY_BUCKETS),
            labelnames=[*labelnames, "role", "outcome"],
        )
        self._gauges = {
            "held_blocks": "KV blocks kvguard keeps for transfers: prefill, finished "
            "requests' blocks waiting for or in a push; decode, blocks of loads in flight.",
            "quarantined_blocks": "KV blocks kept out of use because a peer may still write "
            "them: prefill, blocks of pushes that ended before their engine writes quiesced; "
            "decode, blocks of loads that failed without the prefill's word (fenced) until "
            "it lets go or is known gone.",
            "oldest_live_load_seconds": "Age of the oldest transfer in flight (prefill: a "
            "push kvguard has not ended; decode: a load with no outcome); 0 when none.",
        }
        self._gauge_metrics = {
            name: self._gauge_cls(
                name=f"vllm:kvguard_{name}",
                documentation=doc,
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            for name, doc in self._gauges.items()
        }
        # kvguard's own failure reasons are known; a decode also reports the
        # prefill's refusals and its own (timeout, peer_lost, ...) as they come.
        failed = [r.value for r in FailureReason] if role == "prefill" else []
        for values in per_engine_labelvalues.values():
            for outcome in OUTCOMES[role]:
                for reason in failed if outcome == _FAILED else [""]:
                    self._transfers.labels(*values, role, outcome, reason)
            self._bytes.labels(*values, role)
            self._seconds.labels(*values, role, _DONE[role])
            for gauge in self._gauge_metrics.values():
                gauge.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Checked whole first: a bad payload raises before any metric moved.
        data = KVGuardConnectorStats(data=transfer_stats_data).data
        engine = self.per_engine_labelvalues[engine_idx]
        for name, n in data["transfers"].items():
            self._transfers.labels(*engine, *name.split(_SEP, 2)).inc(n)
        for role, nbytes in data["bytes"].items():
            self._bytes.labels(*engine, role).inc(nbytes)
        for name, samples in data["seconds"].items():
            series = self._seconds.labels(*engine, *name.split(_SEP, 1))
            for s in samples:
                series.observe(s)
        for gauge, value in data["gauges"].items():
            self._gauge_metrics[gauge].labels(*engine).set(value)


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One reading of the prefill side; counters cumulative since start."""

    stats: SenderStats
    bytes_done: int  # kvguard's bytes moved by pushes that ended done
    held_blocks: int
    quarantined_blocks: int
    oldest_live_s: float

    @classmethod
    def of(cls, sender: PrefillSender, block_bytes: int) -> PrefillSample:
        """Read ``sender``; ``block_bytes``: one block over every layer."""
        stats, held = sender.snapshot()
        m = sender.scheduler.metrics()
        return cls(
            stats, m.bytes_done, held, m.quarantined_bytes // block_bytes, m.oldest_live_age_s
        )


class WorkerStats:
    """The worker side: turns the sender's or receiver's state into per-step deltas.

    Not thread-safe: vLLM calls ``get_kv_connector_stats`` from the worker's
    step, one at a time.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.block_bytes = layout.num_buffers * layout.block_bytes  # one block, every layer
        self._prefill: PrefillSample | None = None  # the last reading: counter baseline
        self._gauges: dict[str, int | float] | None = None  # the last gauges reported
        # Decode: loads without an outcome yet, id -> (blocks, first seen at).
        self._live: dict[str, tuple[int, float]] = {}
        self._fenced: set[str] = set()  # decode: failed fenced, blocks not yet back
        self._last: LoadOutcome | None = None  # the newest outcome already counted
        # Prefill: (outcome, seconds) of pushes kvguard ended; its callback
        # thread appends, the step drains (deque appends and pops are atomic).
        self._times: deque[tuple[str, float]] = deque()
        self._observed: PrefillSender | None = None

    def sample(
        self,
        sender: PrefillSender | None,
        receiver: _Outcomes | None,
        loads: Iterable[tuple[str, int]],
        in_use: Mapping[str, int],
        now: float,
    ) -> KVGuardConnectorStats | None:
        """This step's stats; the decode's ``loads`` and ``in_use`` as ``decode``'s."""
        if sender is not None:
            if self._observed is not sender:
                # From the first step on: a hold, hence a push, comes a step later.
                sender.scheduler.add_observer(self._on_finished)
                self._observed = sender
            times = [self._times.popleft() for _ in range(len(self._times))]
            return self.prefill(PrefillSample.of(sender, self.block_bytes), times)
        if receiver is not None:
            return self.decode(loads, receiver.recent_outcomes(), in_use, now)
        return None

    def _on_finished(self, fin: Finished) -> None:
        self._times.append(("done" if fin.state is TransferState.DONE else _FAILED, fin.latency_s))

    def prefill(
        self, cur: PrefillSample, times: Iterable[tuple[str, float]] = ()
    ) -> KVGuardConnectorStats | None:
        """The change since the last reading (the first is against zero);
        ``times``: (done or failed, seconds) of the pushes ended since."""
        last = self._prefill or PrefillSample(SenderStats(), 0, 0, 0, 0.0)
        self._prefill = cur
        out = KVGuardConnectorStats()
        a, b = last.stats, cur.stats
        counts = {
            "done": b.done - a.done,
            "expired": b.expired - a.expired,
            "aborted": b.aborted - a.aborted,
            "refused": b.refused - a.refused,
        }
        for outcome, n in counts.items():
            if n:
                out.data["transfers"][f"prefill/{outcome}/"] = n
        for reason, n in b.by_reason.items():
            if n != a.by_reason.get(reason, 0):
                out.data["transfers"][f"prefill/failed/{reason or 'unknown'}"] = (
                    n - a.by_reason.get(reason, 0)
                )
        if cur.bytes_done != last.bytes_done:
            out.data["bytes"]["prefill"] = cur.bytes_done - last.bytes_done
        for outcome, seconds in times:
            out.data["seconds"].setdefault(f"prefill/{outcome}", []).append(max(0.0, seconds))
        gauges = {
            "held_blocks": cur.held_blocks,
            "quarantined_blocks": cur.quarantined_blocks,
            "oldest_live_load_seconds": cur.oldest_live_s,
        }
        return self._finish(out, gauges)

    def decode(
        self,
        loads: Iterable[tuple[str, int]],
        outcomes: Sequence[LoadOutcome],
        in_use: Mapping[str, int],
        now: float,
    ) -> KVGuardConnectorStats | None:
        """``loads``: the step's new loads (id, blocks). ``outcomes``: the
        receiver's recent outcomes, oldest first; those after the newest one
        already counted are new (more than it keeps between two steps would be
        undercounted). ``in_use``: the loads whose blocks vLLM has not got
        back (id, blocks): in flight, or failed fenced (the prefill may still
        write them)."""
        for rid, blocks in loads:
            self._live.setdefault(rid, (blocks, now))
        fresh: list[LoadOutcome] = []
        for o in reversed(outcomes):
            if o is self._last:
                break
            fresh.append(o)
        if outcomes:
            self._last = outcomes[-1]
        out = KVGuardConnectorStats()
        d = out.data
        for o in reversed(fresh):
            blocks, _ = self._live.pop(o.request_id, (0, now))
            if o.fenced:
                self._fenced.add(o.request_id)
            outcome = "loaded" if o.ok else _FAILED
            key = f"decode/{outcome}/{'' if o.ok else o.reason or 'unknown'}"
            d["transfers"][key] = d["transfers"].get(key, 0) + 1
            d["seconds"].setdefault(f"decode/{outcome}", []).append(max(0.0, o.latency_s))
            if o.ok and blocks:
                d["bytes"]["decode"] = d["bytes"].get("decode", 0) + blocks * self.block_bytes
        # What vLLM got back is neither held nor quarantined any more.
        self._fenced &= in_use.keys()
        for rid in self._live.keys() - in_use.keys():
            del self._live[rid]
        oldest = max((now - t for _, t in self._live.values()), default=0.0)
        gauges = {
            "held_blocks": sum(n for rid, n in in_use.items() if rid not in self._fenced),
            "quarantined_blocks": sum(in_use[rid] for rid in self._fenced),
            "oldest_live_load_seconds": max(0.0, oldest),
        }
        return self._finish(out, gauges)

    def _finish(
        self, out: KVGuardConnectorStats, gauges: dict[str, int | float]
    ) -> KVGuardConnectorStats | None:
        # Gauges go out when they changed, so an idle step costs nothing and
        # the last step before idling still reports where they settled.
        if gauges != self._gauges:
            self._gauges = gauges
            out.data["gauges"] = dict(gauges)
        return None if out.is_empty() else out
