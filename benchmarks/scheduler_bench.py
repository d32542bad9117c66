"""Scheduler overhead: requests/s through the Scheduler vs the backend alone.

Both sides move the same tiny transfer (one 64-byte block, one layer) on the
in-process LocalBackend, so the figure is bookkeeping, not bytes: lifecycle,
the core's steps, hand-offs to the driver and callback threads, release.

The bare-backend side does what an application without the scheduler must
do per request: build (validate) the plan, submit it, wait for the result
and for quiescence. ``direct_prebuilt_requests_per_s`` reuses one prebuilt
plan instead, the bound no real caller reaches; both are reported. Runs are
paired (direct, scheduler, direct, ...) and medians compared, because the
machines are noisy. structlog is configured as in production (loggers cached
on first use; see ``lifecycle_bench``), as the journal runs per transition.

    python -m benchmarks.scheduler_bench [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler import Scheduler
from transfer import KVCache, KVLayout, LocalBackend, TransferOp, build_plan

from .lifecycle_bench import _production_logging

__all__ = ["run"]


def _setup() -> tuple[LocalBackend, KVCache, KVCache]:
    layout = KVLayout(num_layers=1, num_blocks=64, block_bytes=64, kv_split=False)
    src, dst = KVCache(layout), KVCache(layout)
    backend = LocalBackend(workers=4)
    backend.register_source(src)
    backend.register_peer("decode", dst)
    return backend, src, dst


def _direct(n: int, prebuilt: bool = False) -> float:
    backend, src, dst = _setup()
    try:
        peer = dst.peer_info("decode")
        plan = build_plan(src, peer, [1], [2])
        t0 = time.perf_counter()
        ops: list[TransferOp] = [
            backend.submit(plan if prebuilt else build_plan(src, peer, [1], [2])) for _ in range(n)
        ]
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
    n, reps = (2_000, 3) if quick else (20_000, 5)
    direct: list[float] = []
    prebuilt: list[float] = []
    sched: list[float] = []
    with _production_logging():
        for _ in range(reps):  # paired: each scheduler run next to its baselines
            direct.append(_direct(n))
            sched.append(_scheduled(n))
            prebuilt.append(_direct(n, prebuilt=True))
    return {
        "scheduler_requests_per_s": round(statistics.median(sched), 1),
        "direct_requests_per_s": round(statistics.median(direct), 1),
        "direct_prebuilt_requests_per_s": round(statistics.median(prebuilt), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    r = run(parser.parse_args().quick)
    sched, direct = r["scheduler_requests_per_s"], r["direct_requests_per_s"]
    prebuilt = r["direct_prebuilt_requests_per_s"]
    print(
        f"scheduler {sched:,.0f} req/s, bare backend {direct:,.0f} req/s "
        f"(prebuilt plan {prebuilt:,.0f}): ratio {sched / direct:.2f} "
        f"({sched / prebuilt:.2f} against the prebuilt plan)"
    )


if __name__ == "__main__":
    main()
