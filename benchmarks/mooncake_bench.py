"""Data path and failure detection on real Mooncake, through the Scheduler.

Two processes on loopback: a ``kvguard.decode.service`` decode child and this
process's MooncakeBackend. Every ratio compares runs on the same engine and
the same registered memory, interleaved (A B A B ...) so that drift on a noisy
2-core machine hits both sides alike.

* contiguous: one 64 MiB request through the scheduler vs a raw
  ``batch_transfer_sync_write`` of the very same entries;
* fragmented: 4096 blocks in short scattered runs, coalesced through the
  scheduler vs the raw engine sending one entry per block (batches of at most
  ``RAW_BATCH`` entries, under the engine's ~2048 limit);
* CPU: process CPU seconds (every thread: ours, the engine's) per GB moved,
  ``MooncakeBackend.submit`` (engine loop, submit + poll) vs the raw sync
  call, on the very same plan;
* small: many concurrent small requests through the scheduler;
* dead peer: SIGKILL the decode process with requests in flight, time until
  every one of them is FAILED;
* frozen peer: SIGSTOP it, how far past its deadline each request ends.

* timeline (``--timeline`` only): the release-after-quiesce scenario of issue 10 --
  freeze the peer, give up at a 1 s deadline, stay frozen past the engine's timeout,
  refill the source at release, thaw -- and the same with a kill: when the
  op failed, when it was released, and whether any byte moved after release.

    python -m benchmarks.mooncake_bench [--quick] [--timeline]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from kvguard.decode.service import ReceiverProcess
from lifecycle import TERMINAL, TransferState
from scheduler import Scheduler
from transfer import KVCache, KVLayout, TransferPlan, build_plan, plan_entries_naive
from transfer._engine import engine_stderr
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests

__all__ = ["run"]

RAW_BATCH = 1024
ENGINE_TIMEOUT_S = 5  # MC_TRANSFER_TIMEOUT floor: frozen calls return after 5 s


def _raw(backend: MooncakeBackend, plan: TransferPlan) -> None:
    engine = backend.engine
    for b in plan.batches:
        rc = engine.batch_transfer_sync_write(plan.peer, list(b.src), list(b.dst), list(b.lengths))
        if rc != 0:
            raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")


def _direct(backend: MooncakeBackend, plan: TransferPlan) -> None:
    op = backend.submit(plan)
    op.result(timeout=120)
    if not op.wait_quiesced(120):
        raise RuntimeError("op did not quiesce")


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu(fn: Callable[[], None]) -> float:
    """Process CPU seconds, all threads: a spinning sync call shows here."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _cpu_per_gb(backend: MooncakeBackend, plan: TransferPlan, reps: int) -> tuple[float, float]:
    """Median CPU s/GB of the backend and of the raw sync call, same plan, paired."""
    ours, raw = [], []
    gb = plan.nbytes / 1e9
    for i in range(reps):
        a = lambda: _direct(backend, plan)  # noqa: E731
        b = lambda: _raw(backend, plan)  # noqa: E731
        if i % 2:
            raw.append(_cpu(b) / gb)
            ours.append(_cpu(a) / gb)
        else:
            ours.append(_cpu(a) / gb)
            raw.append(_cpu(b) / gb)
    return statistics.median(ours), statistics.median(raw)


def _through(
    sched: Scheduler, src: Sequence[int], dst: Sequence[int], peer: str
) -> Callable[[], None]:
    counter = iter(range(1 << 30))

    def go() -> None:
        rid = f"bench-{next(counter)}"
        sched.submit(rid, src, dst, peer=peer)
        state = sched.wait(rid)
        if state is not TransferState.DONE:
            raise RuntimeError(f"{rid} ended {state.name}: {sched.get(rid).error!r}")

    return go


def _interleaved(
    a: Callable[[], None], b: Callable[[], None], reps: int
) -> tuple[float, float, float]:
    """Median seconds of ``a`` and of ``b``, and the median of the per-pair
    ratios b/a: each pair runs back to back (in alternating order), so
    machine drift cancels within a pair."""
    a()  # warm up connections and caches
    b()
    ta, tb, ratios = [], [], []
    for i in range(reps):
        if i % 2:
            x, y = _timed(b), _timed(a)
            ta.append(y)
            tb.append(x)
        else:
            ta.append(_timed(a))
            tb.append(_timed(b))
        ratios.append(tb[-1] / ta[-1])
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


def _fragmented_blocks(rng: random.Random, num_blocks: int, want: int) -> list[int]:
    # Runs of 1..16 blocks at random places: what a long-running pool looks like.
    chosen: set[int] = set()
    while len(chosen) < want:
        start = rng.randrange(num_blocks)
        for blk in range(start, min(num_blocks, start + rng.randint(1, 16))):
            if len(chosen) < want:
                chosen.add(blk)
    return sorted(chosen)


def _datapath(quick: bool) -> dict[str, float]:
    reps = 3 if quick else 15
    out: dict[str, float] = {}
    # 8 layers x K/V x 256 blocks x 16 KiB = 64 MiB per side, contiguous.
    big = KVLayout(num_layers=8, num_blocks=256, block_bytes=16 * 1024)
    # 4 layers x K/V x 8192 blocks x 2 KiB: 4096 blocks = 64 MiB fragmented.
    frag = KVLayout(num_layers=4, num_blocks=8192, block_bytes=2 * 1024)
    for name, layout in (("contiguous", big), ("fragmented", frag)):
        with ReceiverProcess(layout) as decode, MooncakeBackend() as backend:
            src = KVCache(layout)
            src.fill_seeded(1)
            backend.register(src)
            sched = Scheduler(backend, src, workers=2, default_deadline_s=60.0)
            try:
                backend.add_peer(decode.peer)  # destinations are bounded where plans run
                sched.add_peer(decode.peer)
                if name == "contiguous":
                    blocks = list(range(layout.num_blocks))
                    naive = build_plan(src, decode.peer, blocks, blocks)
                else:
                    blocks = _fragmented_blocks(random.Random(7), layout.num_blocks, 4096)
                    naive = plan_entries_naive(
                        src, decode.peer, blocks, blocks, max_batch_entries=RAW_BATCH
                    )
                    out["fragmented_entries_naive"] = naive.num_entries
                    out["fragmented_entries_coalesced"] = build_plan(
                        src, decode.peer, blocks, blocks
                    ).num_entries
                t_sched, t_raw, ratio = _interleaved(
                    _through(sched, blocks, blocks, decode.peer.session_id),
                    lambda p=naive: _raw(backend, p),  # type: ignore[misc]
                    reps,
                )
                out[f"{name}_gbps"] = round(naive.nbytes / t_sched / 1e9, 3)
                out[f"{name}_raw_gbps"] = round(naive.nbytes / t_raw / 1e9, 3)
                out[f"mooncake_ratio_{name}"] = round(ratio, 3)
                same = build_plan(src, decode.peer, blocks, blocks)
                ours, raw = _cpu_per_gb(backend, same, reps)
                out[f"cpu_s_per_gb_{name}"] = round(ours, 3)
                out[f"cpu_s_per_gb_{name}_raw"] = round(raw, 3)
                if name == "contiguous":
                    out.update(_small_requests(sched, decode.peer.session_id, quick))
            finally:
                sched.close()
    return out


def _small_requests(sched: Scheduler, peer: str, quick: bool) -> dict[str, float]:
    n = 200 if quick else 1000
    t0 = time.perf_counter()
    for i in range(n):
        blk = i % 256
        sched.submit(f"small-{i}", [blk], [blk], peer=peer)
    if not sched.drain(timeout=120):
        raise RuntimeError("small requests did not drain")
    return {"small_requests_per_s": round(n / (time.perf_counter() - t0), 1)}


def _failure_detection() -> dict[str, float]:
    layout = KVLayout(num_layers=8, num_blocks=256, block_bytes=16 * 1024)
    out: dict[str, float] = {}
    for mode in ("kill", "freeze"):
        with (
            ReceiverProcess(layout) as decode,
            MooncakeBackend(transfer_timeout_s=ENGINE_TIMEOUT_S) as backend,
        ):
            src = KVCache(layout)
            backend.register(src)
            deadline = 30.0 if mode == "kill" else 1.0
            sched = Scheduler(backend, src, workers=8, default_deadline_s=deadline)
            ended: dict[str, float] = {}
            try:
                backend.add_peer(decode.peer)
                sched.add_peer(decode.peer)
                peer = decode.peer.session_id
                blocks = list(range(layout.num_blocks))
                # Warm the connection so the first real request is not a handshake.
                sched.submit("warm", blocks, blocks, peer=peer)
                sched.wait("warm")
                ids = [f"{mode}-{i}" for i in range(8)]
                # Each request against its own deadline. submit() reads the
                # clock that starts it before returning, so ``due`` is never
                # before the real deadline: the overshoot is never inflated,
                # and short only by what submit() does after that reading
                # (microseconds). One clock before all 8 charged a slow submit
                # (a GC pass in build_plan) to that request and every later one.
                due: dict[str, float] = {}
                lcs = {}
                for rid in ids:
                    lcs[rid] = sched.submit(rid, blocks, blocks, peer=peer)
                    due[rid] = time.monotonic() + deadline
                time.sleep(0.01)  # let them reach the engine
                t_signal = time.monotonic()
                if mode == "kill":
                    decode.kill()
                else:
                    decode.freeze()
                for rid in ids:
                    sched.wait(rid)
                # Observers run on the scheduler's callback thread, maybe after
                # wait() returned: time the ending from the transition itself.
                for rid, lc in lcs.items():
                    if not lc.is_terminal:
                        raise RuntimeError(f"{rid} not terminal after wait()")
                    ended[rid] = next(h.at for h in lc.history if h.dest in TERMINAL)
                if mode == "kill":
                    failed = [ended[r] for r in ids if lcs[r].state is TransferState.FAILED]
                    out["dead_peer_detect_ms"] = round(1000 * (max(failed) - t_signal), 1)
                    out["dead_peer_failed"] = len(failed)
                else:
                    overshoot = max(ended[r] - due[r] for r in ids)
                    out["frozen_peer_overshoot_ms"] = round(1000 * max(0.0, overshoot), 1)
                decode.kill()  # lets the frozen engine calls return, so close() drains
            finally:
                sched.close(timeout=2 * ENGINE_TIMEOUT_S)
    return out


def timeline(mode: str) -> dict[str, float]:
    """Issue 10's scenario on the backend alone; times in seconds after submit."""
    layout = KVLayout(num_layers=1, num_blocks=4096, block_bytes=4096)
    blocks = list(range(2048))  # 8 MiB a buffer, 4096 entries: one per block
    with (
        ReceiverProcess(layout) as decode,
        MooncakeBackend(transfer_timeout_s=ENGINE_TIMEOUT_S) as backend,
    ):
        src = KVCache(layout)
        src.fill_seeded(1)
        backend.register(src)
        backend.add_peer(decode.peer)
        _direct(backend, build_plan(src, decode.peer, [4000], [4000]))  # connect
        marks: dict[str, float] = {}
        refilled_done = threading.Event()

        def refill(_op: object) -> None:
            marks["released"] = time.monotonic()
            src.fill_seeded(2)  # reuse the blocks the moment they are released
            refilled_done.set()

        decode.freeze()
        plan = plan_entries_naive(src, decode.peer, blocks, blocks[::-1])
        t0 = time.monotonic()
        op = backend.submit(plan)
        op.add_quiesce_callback(refill)
        try:
            op.result(timeout=1.0)
        except Exception:
            marks["deadline"] = time.monotonic()
        if mode == "freeze":
            time.sleep(ENGINE_TIMEOUT_S + 2.0)  # past the engine's own timeout
            marks["terminal"] = op.resolved_at or float("nan")
            marks["thaw"] = time.monotonic()
            decode.thaw()
        else:
            marks["kill"] = time.monotonic()
            decode.kill()
        if not op.wait_quiesced(60) or not refilled_done.wait(10):
            raise RuntimeError("op never quiesced")  # (the event: callbacks end after)
        marks.setdefault("terminal", op.resolved_at or float("nan"))
        out = {f"{k}_s": round(v - t0, 3) for k, v in marks.items()}
        out["quarantined_mib"] = round(plan.nbytes / 2**20, 1)
        if mode == "freeze":
            landed = decode.checksums(blocks[::-1])
            time.sleep(0.5)
            again = decode.checksums(blocks[::-1])
            moved_after = sum(a != b for a, b in zip(landed, again, strict=True))
            refilled = block_digests(src, blocks)
            out["dst_blocks_changed_after_release"] = moved_after
            out["dst_blocks_with_post_release_data"] = sum(
                a == b for a, b in zip(landed, refilled, strict=True)
            )
        return out


def run(quick: bool = False) -> dict[str, float]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    # The peer killed and frozen on purpose makes the engine print its own
    # ERROR lines to fd 2: kept off the terminal, counted (KVGUARD_ENGINE_LOG=1
    # shows them), and anything else written there meanwhile is written back.
    with engine_stderr() as glog:
        figures = {**_datapath(quick), **_failure_detection()}
    if glog:
        print(f"  (the engine logged {len(glog)} lines of its own as its peer died and froze)")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeline", action="store_true", help="the quiesce scenario only")
    args = parser.parse_args()
    if args.timeline:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
        for mode in ("freeze", "kill"):
            for k, v in timeline(mode).items():
                print(f"{mode + ' ' + k:40} {v}")
        return
    for k, v in run(args.quick).items():
        print(f"{k:32} {v}")


if __name__ == "__main__":
    main()
