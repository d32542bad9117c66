"""Scheduler overhead: requests/s through the Scheduler vs the backend alone.

Both sides move the same tiny plan (one 64-byte block, one layer) on the
in-process LocalBackend, so the figure is bookkeeping, not bytes: lifecycle,
deadline heap, worker slot, done/quiesce callbacks and release.

    python -m benchmarks.scheduler_bench [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import structlog

from scheduler import Scheduler
from transfer import KVCache, KVLayout, LocalBackend, TransferOp, build_plan

__all__ = ["run"]


def _setup() -> tuple[LocalBackend, KVCache, KVCache]:
    layout = KVLayout(num_layers=1, num_blocks=64, block_bytes=64, kv_split=False)
    src, dst = KVCache(layout), KVCache(layout)
    backend = LocalBackend(workers=4)
    backend.register_source(src)
    backend.register_peer("decode", dst)
    return backend, src, dst


def _direct(n: int) -> float:
    backend, src, dst = _setup()
    try:
        plan = build_plan(src, dst.peer_info("decode"), [1], [2])
        t0 = time.perf_counter()
        ops: list[TransferOp] = [backend.submit(plan) for _ in range(n)]
        for op in ops:
            op.result(timeout=30)
            op.wait_quiesced(30)
        return n / (time.perf_counter() - t0)
    finally:
        backend.close()


def _scheduled(n: int) -> float:
    backend, src, dst = _setup()
    released = 0

    def release(_rid: str, _fin: object) -> None:
        nonlocal released
        released += 1

    sched = Scheduler(backend, src, workers=64, default_deadline_s=60.0, release=release)
    try:
        sched.add_peer(dst.peer_info("decode"))
        t0 = time.perf_counter()
        for i in range(n):
            sched.submit(f"r{i}", [1], [2], peer="decode")
        if not sched.drain(timeout=60):
            raise RuntimeError("scheduler did not drain")
        rate = n / (time.perf_counter() - t0)
        if released != n or sched.metrics().done != n:
            raise RuntimeError(f"expected {n} DONE and released, got {sched.metrics()}")
        return rate
    finally:
        sched.close()
        backend.close()


def run(quick: bool = False) -> dict[str, float]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(20))
    n, reps = (2_000, 3) if quick else (20_000, 5)
    direct = statistics.median(_direct(n) for _ in range(reps))
    sched = statistics.median(_scheduled(n) for _ in range(reps))
    return {
        "scheduler_requests_per_s": round(sched, 1),
        "direct_requests_per_s": round(direct, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args().quick)
    ratio = r["scheduler_requests_per_s"] / r["direct_requests_per_s"]
    print(
        f"scheduler {r['scheduler_requests_per_s']:,.0f} req/s, "
        f"direct backend {r['direct_requests_per_s']:,.0f} req/s, ratio {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
