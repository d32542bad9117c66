"""kvguard's figures as vLLM's stats API carries them: one payload, checked, added, summed up.

vLLM carries a connector's figures in three hops, each in its own module:

* the worker, once per step: ``KVGuardConnector.get_kv_connector_stats``
  asks ``stats_sampling.WorkerStats.sample`` for what changed since the
  last step, a ``KVGuardConnectorStats`` (or None: nothing changed);
* the engine core sums the workers' and the steps' stats with ``aggregate``
  and ships ``data`` (plain dicts, lists and numbers) to the API server;
* the API server logs ``reduce()`` each logging interval and records every
  step's ``data`` in ``stats_prometheus.KVGuardPromMetrics`` (per engine
  label, as vLLM's own connectors do).

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["DONE", "FAILED", "GAUGES", "OUTCOMES", "SEP", "KVGuardConnectorStats"]

# What ends a transfer, per role. Prefill: a held request's push (done or
# failed by kvguard), or its hold ending without one. Decode: a load.
OUTCOMES: Final[Mapping[str, tuple[str, ...]]] = {
    "prefill": ("done", "failed", "expired", "aborted", "refused"),
    "decode": ("loaded", "failed"),
}
# Only a failure has a reason; every other outcome's reason is "".
FAILED: Final = "failed"
DONE: Final[Mapping[str, str]] = {"prefill": "done", "decode": "loaded"}  # moved bytes
GAUGES: Final = ("held_blocks", "quarantined_blocks", "oldest_live_load_seconds")
_KEYS: Final = ("transfers", "bytes", "seconds", "gauges")
SEP: Final = "/"  # transfers: "role/outcome/reason"; seconds: "role/outcome"


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
        parts = str(name).split(SEP, 2)
        if not isinstance(name, str) or len(parts) != 3:
            raise ValueError(f"kvguard stats: transfers key {name!r} is not role/outcome/reason")
        role, outcome, reason = parts
        _outcome(f"transfers {name!r}", role, outcome)
        if (outcome == FAILED) != (reason != ""):
            raise ValueError(f"kvguard stats: transfers {name!r}: only a failure has a reason")
        _number(f"transfers {name!r}", count, integer=True)
    for role, nbytes in data["bytes"].items():
        if role not in OUTCOMES:
            raise ValueError(f"kvguard stats: bytes of unknown role {role!r}")
        _number(f"bytes {role!r}", nbytes, integer=True)
    for name, samples in data["seconds"].items():
        role, _, outcome = str(name).partition(SEP)
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
            out[" ".join(p for p in name.split(SEP) if p)] = n
        for role, nbytes in sorted(self.data["bytes"].items()):
            out[f"{role} MB"] = round(nbytes / 2**20, 3)
        for name, samples in sorted(self.data["seconds"].items()):
            label = name.replace(SEP, " ")
            ordered = sorted(samples)
            out[f"{label} avg ms"] = round(sum(ordered) / len(ordered) * 1e3, 3)
            p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank
            out[f"{label} p90 ms"] = round(p90 * 1e3, 3)
        for gauge, value in self.data["gauges"].items():
            out[gauge.replace("_", " ")] = value
        return out
