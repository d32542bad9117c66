"""Repeated runs of the vLLM PD benchmark: the order that spreads host load, and the runs' medians.

One run per level cannot tell a regression from noise on a shared host
(the same level's report phase measured 1.6 ms p50 in one run and 31 ms in
another). So each connector runs several times, the connectors interleaved
(``order``), and each level's figure is the median of the runs' figures,
with the runs' own values kept beside it (``combine``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["HEADLINE", "combine", "order"]

# The figures whose every run is kept next to the median: the table's.
HEADLINE: Final = ("handover_p50_ms", "handover_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
# Counts add up over the runs; every other number is the runs' median.
_SUMMED: Final = frozenset(
    {"requests", "errors", "handover_n", "transfers", "kv_bytes", "phases_n"}
)


def order(connectors: Sequence[str], runs: int) -> list[tuple[int, str]]:
    """(run, connector) in the order they are measured: run ``r`` starts at
    the ``r``-th connector, so each takes every place in a round and a load
    that drifts through the invocation falls on each alike."""
    n = len(connectors)
    return [(r, connectors[(r + i) % n]) for r in range(runs) for i in range(n)]


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _median(values: list[Any]) -> Any:
    real = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not real:
        return values[0] if values else None  # None or NaN: no run measured it
    return round(statistics.median(real), 3)


def combine(rows: Sequence[dict[str, Any]], *, top: bool = True) -> dict[str, Any]:
    """One level's row from its runs' rows: each figure the median of the
    runs' figures (a percentile per run, never one of pooled requests),
    counts summed, the headline figures' run values in ``KEY_runs``."""
    if not rows:
        raise ValueError("combine needs at least one run's row")
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r[key] for r in rows if key in r]
        if key in _SUMMED:
            out[key] = sum(values)
        elif all(v is None or _number(v) for v in values):
            out[key] = _median(values)
        elif all(isinstance(v, dict) for v in values):
            out[key] = combine(values, top=False)
        else:  # text (an error sample) or lists: the first run's that has one
            out[key] = next((v for v in values if v), values[0])
    if top:
        for key in HEADLINE:
            if key in out:
                out[f"{key}_runs"] = [r.get(key) for r in rows]
        out["runs"] = len(rows)
    return out
