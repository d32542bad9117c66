"""Cost of journaling one transition to a JSON-lines file, against journaling off.

    python -m benchmarks.journal_bench [--quick]

Each rep runs N full lifecycles (create, start, complete: two transitions)
twice, alternating: with the default journal under a production structlog
setup (filtering at INFO, so transition records are dropped: "off") and
with a ``JsonlJournal`` writing and flushing every record to a file in a
temporary directory ("on"). The cost per transition is the median over reps
of (on - off) / 2 per lifecycle: same process, same run, interleaved, so a
burst of load on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from lifecycle import Journal, RequestLifecycle
from scheduler.journal import JsonlJournal

__all__ = ["main", "measure"]

_TRANSITIONS_PER_LIFECYCLE = 2


def _lifecycles(ids: Sequence[str], journal: Journal | None) -> float:
    """Seconds per lifecycle (create, start, complete)."""
    t0 = time.perf_counter()
    for rid in ids:
        lc = RequestLifecycle(rid, journal=journal)
        lc.start()
        lc.complete()
    return (time.perf_counter() - t0) / len(ids)


def measure(n: int, reps: int, directory: Path) -> dict[str, float]:
    """Median microseconds per transition: journal off, on, and the difference."""
    ids = [f"req-{i:06d}" for i in range(n)]
    off: list[float] = []
    on: list[float] = []
    with JsonlJournal(directory / "bench.jsonl") as journal:
        _lifecycles(ids, None), _lifecycles(ids, journal)  # warm-up
        for _ in range(reps):
            gc.collect()
            off.append(_lifecycles(ids, None))
            gc.collect()
            on.append(_lifecycles(ids, journal))
    per = 1e6 / _TRANSITIONS_PER_LIFECYCLE
    return {
        "off_us": statistics.median(off) * per,
        "on_us": statistics.median(on) * per,
        "cost_us": statistics.median(b - a for a, b in zip(off, on, strict=True)) * per,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.journal_bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n, reps = (5_000, 5) if args.quick else (20_000, 11)
    # An application's production setup: transition records (debug) dropped.
    with open(os.devnull, "w") as devnull:
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=structlog.PrintLoggerFactory(file=devnull),
        )
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(n, reps, Path(tmp))
    print(
        f"per transition, median of {reps} x {n:,} lifecycles ({_TRANSITIONS_PER_LIFECYCLE} each):"
    )
    print(f"  journal off (records filtered)   {r['off_us']:7.2f} us")
    print(f"  JsonlJournal (write + flush)     {r['on_us']:7.2f} us")
    print(f"  cost of journaling               {r['cost_us']:7.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
