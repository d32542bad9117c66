"""``kvguard bench``: every figure against its baseline, measured in one run.

Runs the lifecycle, scheduler and real-Mooncake benchmarks, describes the
machine, prints each budget line of docs/performance.md with its verdict and
optionally writes the JSON. ``--quick`` is CI's smoke test: fewer repetitions,
and no verdict is enforced (a loaded CI machine says nothing about speed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from . import lifecycle_bench, machine, mooncake_bench, scheduler_bench

__all__ = ["BUDGET", "Budget", "describe_machine", "main", "run"]


class Budget(NamedTuple):
    key: str
    limit: float
    ok: Callable[[float, float], bool]
    text: str


def _le(v: float, lim: float) -> bool:
    return v <= lim


def _ge(v: float, lim: float) -> bool:
    return v >= lim


# The performance budget (issue 6). One row per line.
BUDGET: tuple[Budget, ...] = (
    Budget("lifecycle_us", 15.0, _le, "<= 15 us per full lifecycle"),
    Budget("lifecycle_flatness", 1.5, _le, "<= 1.5 from 1k to 1M live requests"),
    Budget("bytes_per_live_request", 2048, _le, "<= 2048 bytes per live request"),
    Budget("mooncake_ratio_contiguous", 0.95, _ge, ">= 0.95 of raw engine, 64 MiB"),
    Budget("mooncake_ratio_fragmented", 1.0, _ge, ">= 1.0 of naive per-block engine path"),
    Budget("scheduler_ratio", 0.8, _ge, ">= 0.8 of the bare backend, tiny requests"),
    Budget("dead_peer_detect_ms", 100.0, _le, "<= 100 ms from SIGKILL to all FAILED"),
    Budget("frozen_peer_overshoot_ms", 100.0, _le, "<= 100 ms past the deadline"),
)

KEYS = (
    "lifecycle_us",
    "lifecycle_baseline_us",
    "lifecycle_flatness",
    "bytes_per_live_request",
    "scheduler_requests_per_s",
    "direct_requests_per_s",
    "scheduler_ratio",
    "mooncake_ratio_contiguous",
    "mooncake_ratio_fragmented",
    "dead_peer_detect_ms",
    "frozen_peer_overshoot_ms",
)


def describe_machine() -> dict[str, Any]:
    return machine.describe_machine(
        {
            "torch": "torch",
            "mooncake": "mooncake-transfer-engine-non-cuda",
            "transitions": "transitions",
        }
    )


def run(quick: bool = False) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    print("== lifecycle", flush=True)
    figures.update(lifecycle_bench.run(quick))
    print("== scheduler overhead (local backend, tiny transfers)", flush=True)
    figures.update(scheduler_bench.run(quick))
    # Same run, paired medians: the scheduler's requests/s over the bare backend's.
    figures["scheduler_ratio"] = round(
        figures["scheduler_requests_per_s"] / figures["direct_requests_per_s"], 3
    )
    # Where the gap comes from: per-request CPU on one thread (no hand-offs).
    split = scheduler_bench.breakdown(5_000 if quick else 20_000)
    figures.update({f"one_thread_{k}": v for k, v in split.items()})
    print("== real Mooncake, two processes on loopback", flush=True)
    figures.update(mooncake_bench.run(quick))
    missing = [k for k in KEYS if k not in figures]
    if missing:
        raise RuntimeError(f"benchmarks did not report {missing}")
    return {**{k: figures[k] for k in KEYS}, "extra": figures, "machine": describe_machine()}


def verdicts(result: dict[str, Any]) -> list[tuple[Budget, float, bool]]:
    return [(b, float(result[b.key]), b.ok(float(result[b.key]), b.limit)) for b in BUDGET]


def main(json_path: Path | None = None, quick: bool = False, vllm: bool = False) -> int:
    if vllm:  # two real vLLM servers per connector; re-executed in .venv-vllm if need be
        from . import vllm_pd

        return vllm_pd.main(
            [*(["--quick"] if quick else []), *(["--json", str(json_path)] if json_path else [])]
        )
    result = run(quick)
    print("\n== budget" + (" (--quick: reported, not enforced)" if quick else ""))
    failed = 0
    for b, value, ok in verdicts(result):
        failed += not ok
        print(f"  {b.key:28} {value:>12,.3f}   {b.text:42} {'ok' if ok else 'MISSED'}")
    extra = result["extra"]
    print(
        f"  scheduler / bare backend requests per second (tiny requests): "
        f"{result['scheduler_ratio']:.2f} "
        f"({result['scheduler_requests_per_s']:,.0f} vs {result['direct_requests_per_s']:,.0f}; "
        f"{result['scheduler_requests_per_s'] / extra['direct_prebuilt_requests_per_s']:.2f} "
        f"against a prebuilt plan; the same hand-offs without bookkeeping: "
        f"{extra['handoffs_only_requests_per_s'] / result['direct_requests_per_s']:.2f})"
    )
    print(
        f"  per request on one thread: scheduler {extra['one_thread_scheduler_us']:.1f} us "
        f"(submit beyond the plan {extra['one_thread_submit_beyond_plan_us']:.1f}, "
        f"steps {extra['one_thread_step_us']:.1f}, release {extra['one_thread_release_us']:.1f}) "
        f"vs bare backend {extra['one_thread_bare_us']:.1f} us"
    )
    for name in ("contiguous", "fragmented"):  # same plan, MooncakeBackend vs raw sync call
        ours, raw = extra[f"cpu_s_per_gb_{name}"], extra[f"cpu_s_per_gb_{name}_raw"]
        print(f"  CPU s per GB moved, {name}: {ours:.3f} backend vs {raw:.3f} raw sync call")
    print(f"  machine: {json.dumps(result['machine'])}")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0 if quick or not failed else 1


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv[1:], vllm="--vllm" in sys.argv[1:]))
