"""Cost of one request's lifecycle bookkeeping, against a plain enum+lock baseline.

    python -m benchmarks.lifecycle_bench [--quick]

Measures, each as the median of several repetitions in the same run:

- one full lifecycle (create, start, complete) of ``RequestLifecycle`` in
  microseconds, next to ``_Baseline`` (an enum state behind a
  ``threading.Lock`` doing the same three steps with the same checks), and
  their ratio;
- the same with 1k, 10k, 100k (and 1M unless ``--quick``) live requests held
  in a dict, and the flatness (slowest / fastest) over those sizes;
- the memory of one live request (created, started, kept in a dict), via
  tracemalloc.

The journal runs at its production level: this script is an application, so
it configures structlog (a filtering bound logger at INFO, output to
/dev/null); the library itself never does.
"""

from __future__ import annotations

import argparse
import enum
import gc
import logging
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import structlog

from lifecycle import RequestLifecycle

__all__ = ["main", "run"]


class _State(enum.Enum):
    PENDING = 0
    TRANSFERRING = 1
    DONE = 2


class _Baseline:
    """The least a thread-safe lifecycle can do: an enum behind a lock."""

    __slots__ = ("_lock", "_state", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._lock = threading.Lock()
        self._state = _State.PENDING

    def start(self) -> bool:
        with self._lock:
            if self._state is not _State.PENDING:
                raise RuntimeError(f"{self.request_id}: start in {self._state.name}")
            self._state = _State.TRANSFERRING
        return True

    def complete(self) -> bool:
        with self._lock:
            if self._state is _State.DONE:
                return False
            if self._state is not _State.TRANSFERRING:
                raise RuntimeError(f"{self.request_id}: complete in {self._state.name}")
            self._state = _State.DONE
        return True


Factory = Callable[[str], Any]


def _full_lifecycles(factory: Factory, ids: Sequence[str]) -> float:
    """Seconds for create + start + complete of one request per id."""
    t0 = time.perf_counter()
    for rid in ids:
        r = factory(rid)
        r.start()
        r.complete()
    return time.perf_counter() - t0


def _paired_median_us(ids: Sequence[str], reps: int) -> tuple[float, float, float]:
    """Median us per lifecycle of RequestLifecycle, of the baseline, and of their ratio.

    The two alternate rep by rep, so a burst of load on a shared machine
    hits both rather than one of them; the per-rep ratio cancels most of it.
    """
    # Warm up with full passes: the first ones also grow the allocator's
    # arenas and would inflate whichever figure is measured first.
    for _ in range(2):
        _full_lifecycles(RequestLifecycle, ids)
        _full_lifecycles(_Baseline, ids)
    ours: list[float] = []
    base: list[float] = []
    for _ in range(reps):
        gc.collect()
        ours.append(_full_lifecycles(RequestLifecycle, ids) / len(ids) * 1e6)
        gc.collect()
        base.append(_full_lifecycles(_Baseline, ids) / len(ids) * 1e6)
    ratio = statistics.median(o / b for o, b in zip(ours, base, strict=True))
    return statistics.median(ours), statistics.median(base), ratio


def _grow(live: dict[str, Any], factory: Factory, size: int) -> None:
    """Add started requests to ``live`` until it holds ``size`` of them."""
    for i in range(len(live), size):
        rid = f"live-{i}"
        r = factory(rid)
        r.start()
        live[rid] = r


def _bytes_per_live(factory: Factory, n: int) -> float:
    ids = [f"mem-{i}" for i in range(n)]  # the ids exist before the measurement
    live: dict[str, Any] = {}
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for rid in ids:
            r = factory(rid)
            r.start()
            live[rid] = r
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / n


@contextmanager
def _production_logging() -> Iterator[None]:
    """structlog as a production application sets it up; restored afterwards."""
    was_configured = structlog.is_configured()
    old = structlog.get_config()
    # Left open: loggers cached on first use keep writing here after the
    # configuration is restored (later benchmarks in the same process).
    devnull = open(os.devnull, "w")  # noqa: SIM115
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        processors=[
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=devnull),
        # structlog's own production advice: resolve each logger once.
        cache_logger_on_first_use=True,
    )
    try:
        yield
    finally:
        if was_configured:
            structlog.configure(**old)
        else:
            structlog.reset_defaults()


def run(quick: bool) -> dict[str, float]:
    """Measure and print; return the headline figures (plus two extras)."""
    n_ops = 10_000 if quick else 20_000
    reps = 9 if quick else 15
    sizes = [1_000, 10_000, 100_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
    ids = [f"req-{i}" for i in range(n_ops)]

    with _production_logging():
        lc_us, base_us, ratio = _paired_median_us(ids, reps)
        print(f"one full lifecycle (create, start, complete), median of {reps} x {n_ops:,}:")
        print(f"  RequestLifecycle  {lc_us:8.2f} us")
        print(f"  enum+lock         {base_us:8.2f} us")
        print(f"  ratio             {ratio:8.2f} x  (median of per-rep ratios)")

        print("with live requests held in a dict (created and started):")
        live: dict[str, Any] = {}
        live_base: dict[str, Any] = {}
        at_size: list[float] = []
        ratio_at_size: list[float] = []
        for size in sizes:
            _grow(live, RequestLifecycle, size)
            _grow(live_base, _Baseline, size)
            us, b_us, r = _paired_median_us(ids, reps)
            at_size.append(us)
            ratio_at_size.append(r)
            print(f"  {size:>9,} live: {us:8.2f} us  (enum+lock {b_us:6.2f} us, ratio {r:5.2f} x)")
        flatness = max(at_size) / min(at_size)
        print(f"  flatness (slowest / fastest): {flatness:.2f}")
        ratio_flatness = max(ratio_at_size) / min(ratio_at_size)
        print(f"  flatness of the ratio to enum+lock: {ratio_flatness:.2f}")
        del live, live_base
        gc.collect()

        n_mem = 20_000 if quick else 100_000
        per_live = _bytes_per_live(RequestLifecycle, n_mem)
        per_base = _bytes_per_live(_Baseline, n_mem)
        print(f"memory per live request (tracemalloc, {n_mem:,} live, dict slot included):")
        print(f"  RequestLifecycle  {per_live:8.0f} B")
        print(f"  enum+lock         {per_base:8.0f} B")

    return {
        "lifecycle_us": lc_us,
        "lifecycle_baseline_us": base_us,
        "lifecycle_flatness": flatness,
        "bytes_per_live_request": per_live,
        # Extras, steadier on a shared machine: the baseline in the same
        # rep cancels most of the load noise.
        "lifecycle_ratio": ratio,
        "lifecycle_flatness_vs_baseline": ratio_flatness,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lifecycle_bench")
    parser.add_argument("--quick", action="store_true", help="smaller runs, no 1M population")
    args = parser.parse_args(argv)
    run(quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
