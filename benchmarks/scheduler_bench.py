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

``--breakdown`` measures where the scheduler's time goes, on one thread
with nothing else running: each op completes inside ``submit`` and the
callbacks run inline, so the figures are CPU microseconds per request of
``submit`` (beyond the plan both sides build), of the core's steps, and of
the release, next to the whole bare-backend request. The thread hand-offs
themselves cost next to nothing (a pipeline through the same three threads
that does no bookkeeping matches the bare backend's requests/s); what
separates the two figures is this per-request Python work, all under the GIL.

    python -m benchmarks.scheduler_bench [--quick] [--breakdown]
"""

from __future__ import annotations

import argparse
import gc
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from scheduler import Scheduler
from transfer import KVCache, KVLayout, LocalBackend, TransferOp, TransferPlan, build_plan

from .lifecycle_bench import _production_logging

__all__ = ["run"]


def _setup(backend: LocalBackend | None = None) -> tuple[LocalBackend, KVCache, KVCache]:
    layout = KVLayout(num_layers=1, num_blocks=64, block_bytes=64, kv_split=False)
    src, dst = KVCache(layout), KVCache(layout)
    backend = backend or LocalBackend(workers=4)
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


def _handoffs_only(n: int, in_flight: int = 64) -> float:
    """The scheduler's thread shape with none of its bookkeeping: the caller
    posts plans to a stepping thread, which submits up to ``in_flight`` and
    hands each quiesced op to a callback thread. No lifecycle, deadline,
    record or check: the cost of the hand-offs alone (see ``--breakdown``)."""
    backend, src, dst = _setup()
    inbox: deque[tuple[str, object]] = deque()
    wake, stop = threading.Event(), threading.Event()
    released: queue.SimpleQueue[object] = queue.SimpleQueue()
    done = threading.Event()

    def post(kind: str, item: object) -> None:
        inbox.append((kind, item))
        wake.set()

    def stepper() -> None:
        waiting: deque[TransferPlan] = deque()
        running = 0
        while not stop.is_set():
            wake.wait()
            wake.clear()
            while inbox:
                kind, item = inbox.popleft()
                if kind == "new":
                    waiting.append(item)  # type: ignore[arg-type]
                else:
                    running -= 1
                    released.put(item)
            while waiting and running < in_flight:
                running += 1
                backend.submit(waiting.popleft()).add_quiesce_callback(
                    lambda op: post("quiesced", op)
                )

    def releaser() -> None:
        for _ in range(n):
            released.get()
        done.set()

    threads = [threading.Thread(target=f, daemon=True) for f in (stepper, releaser)]
    for t in threads:
        t.start()
    try:
        peer = dst.peer_info("decode")
        t0 = time.perf_counter()
        for _ in range(n):
            post("new", build_plan(src, peer, [1], [2]))
        if not done.wait(60):
            raise RuntimeError("hand-off pipeline did not finish")
        return n / (time.perf_counter() - t0)
    finally:
        stop.set()
        wake.set()
        backend.close()


def run(quick: bool = False) -> dict[str, float]:
    n, reps = (2_000, 3) if quick else (20_000, 5)
    direct: list[float] = []
    prebuilt: list[float] = []
    sched: list[float] = []
    handoffs: list[float] = []
    with _production_logging():
        for _ in range(reps):  # paired: each scheduler run next to its baselines
            direct.append(_direct(n))
            sched.append(_scheduled(n))
            prebuilt.append(_direct(n, prebuilt=True))
            handoffs.append(_handoffs_only(n))
    return {
        "scheduler_requests_per_s": round(statistics.median(sched), 1),
        "direct_requests_per_s": round(statistics.median(direct), 1),
        "direct_prebuilt_requests_per_s": round(statistics.median(prebuilt), 1),
        "handoffs_only_requests_per_s": round(statistics.median(handoffs), 1),
    }


class _InlineBackend(LocalBackend):
    """Completes and quiesces every op inside submit(): no thread, no copy."""

    def submit(self, plan: TransferPlan) -> TransferOp:
        op = TransferOp(plan)
        op._resolve(None)
        op._quiesce()
        return op


def breakdown(n: int = 20_000, batch: int = 64) -> dict[str, float]:
    """CPU us per request, one thread, garbage collector paused (see module doc)."""
    backend, src, dst = _setup(_InlineBackend(workers=1))
    sched = Scheduler(backend, src, workers=batch, default_deadline_s=60.0, driver="external")
    jobs: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
    sched._callbacks.extend = jobs.extend  # type: ignore[method-assign,assignment]
    sched.add_peer(dst.peer_info("decode"))
    peer = dst.peer_info("decode")
    t = dict.fromkeys(("plan", "submit", "step", "release", "bare"), 0.0)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with _production_logging():
            for k in range(n // batch):
                t0 = time.perf_counter()
                for i in range(batch):
                    sched.submit(f"r{k}-{i}", [1], [2], peer="decode")
                t1 = time.perf_counter()
                sched.step()
                t2 = time.perf_counter()
                for fn, args in jobs:
                    fn(*args)
                jobs.clear()
                t3 = time.perf_counter()
                for _ in range(batch):
                    build_plan(src, peer, [1], [2])
                t4 = time.perf_counter()
                for _ in range(batch):
                    op = backend.submit(build_plan(src, peer, [1], [2]))
                    op.result(timeout=1)
                    op.wait_quiesced(1)
                t5 = time.perf_counter()
                for key, dt in zip(t, (t4 - t3, t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
                    t[key] += dt
    finally:
        if gc_was:
            gc.enable()
        sched.close()
        backend.close()
    done = (n // batch) * batch
    us = {key: 1e6 * v / done for key, v in t.items()}
    return {
        "submit_beyond_plan_us": round(us["submit"] - us["plan"], 2),
        "step_us": round(us["step"], 2),
        "release_us": round(us["release"], 2),
        "scheduler_us": round(us["submit"] + us["step"] + us["release"], 2),
        "bare_us": round(us["bare"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    if args.breakdown:
        b = breakdown()
        print(
            f"one thread, per request: scheduler {b['scheduler_us']:.1f} us "
            f"(submit beyond the plan {b['submit_beyond_plan_us']:.1f}, steps {b['step_us']:.1f}, "
            f"release {b['release_us']:.1f}); bare backend {b['bare_us']:.1f} us"
        )
        return
    r = run(args.quick)
    sched, direct = r["scheduler_requests_per_s"], r["direct_requests_per_s"]
    prebuilt = r["direct_prebuilt_requests_per_s"]
    handoffs = r["handoffs_only_requests_per_s"]
    print(
        f"scheduler {sched:,.0f} req/s, bare backend {direct:,.0f} req/s "
        f"(prebuilt plan {prebuilt:,.0f}): ratio {sched / direct:.2f} "
        f"({sched / prebuilt:.2f} against the prebuilt plan); the same thread hand-offs "
        f"without bookkeeping {handoffs:,.0f} req/s ({handoffs / direct:.2f})"
    )


if __name__ == "__main__":
    main()
