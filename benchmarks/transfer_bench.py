"""MooncakeBackend on loopback: its cost over the raw engine, coalescing, and
how fast failures surface.

    python -m benchmarks.transfer_bench [--quick] [--json]

Every figure is measured in this one run against a baseline from the same
run (the machines are noisy): the backend against a raw
``batch_transfer_sync_write`` of the same entries on the same engine and
peer, reps interleaved, medians compared; the coalesced plan against the
naive one; a killed and a frozen peer against the caller's deadline.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable

import structlog

from kvguard.decode.service import ReceiverProcess
from transfer import (
    KVCache,
    KVLayout,
    PeerLost,
    PeerUnreachable,
    TransferError,
    TransferPlan,
    TransferTimeout,
    build_plan,
    plan_entries_naive,
)
from transfer.mooncake import MooncakeBackend

__all__ = ["compare", "main", "raw_write", "run", "through"]

# 2 layers x K/V = 4 buffers x 4096 blocks x 4 KiB = 64 MiB a side.
LAYOUT = KVLayout(num_layers=2, num_blocks=4096, block_bytes=4096)
# Peers that get killed or frozen.
SMALL = KVLayout(num_layers=1, num_blocks=4096, block_bytes=4096)
TRANSFER_TIMEOUT_S = 5  # the prefill engine's MC_TRANSFER_TIMEOUT (engine minimum)
DEADLINE_S = 0.5  # the caller's own deadline on a frozen peer
WAIT_S = 60.0


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw_write(backend: MooncakeBackend, plan: TransferPlan) -> Callable[[], None]:
    """The baseline: the same entries, straight into the engine, every code checked."""
    write = backend.engine.batch_transfer_sync_write
    peer = plan.peer
    batches = [(list(b.src), list(b.dst), list(b.lengths)) for b in plan.batches]

    def go() -> None:
        for src, dst, lengths in batches:
            rc = write(peer, src, dst, lengths)
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")

    return go


def through(backend: MooncakeBackend, plan: TransferPlan) -> Callable[[], None]:
    def go() -> None:
        backend.submit(plan).result(timeout=WAIT_S)

    return go


def compare(
    base: Callable[[], None], other: Callable[[], None], reps: int
) -> tuple[float, float, float]:
    """(median s of base, median s of other, median of per-rep base/other ratios).

    Reps are interleaved, alternating which goes first, and each ratio pairs
    two adjacent runs: load from other processes on the machine moves both.
    """
    for fn in (base, other):  # warm connections, page mappings and caches
        fn()
    t_base: list[float] = []
    t_other: list[float] = []
    for i in range(reps):
        pairs = ((base, t_base), (other, t_other))
        for fn, out in pairs if i % 2 == 0 else pairs[::-1]:
            out.append(_time(fn))
    ratio = statistics.median(b / o for b, o in zip(t_base, t_other, strict=True))
    return statistics.median(t_base), statistics.median(t_other), ratio


def _fragmented_blocks(n: int, seed: int) -> tuple[list[int], list[int]]:
    """All ``n`` blocks, sent to a shuffle of runs of 1..32 blocks."""
    rng = random.Random(seed)
    runs: list[range] = []
    b = 0
    while b < n:
        size = min(rng.randint(1, 32), n - b)
        runs.append(range(b, b + size))
        b += size
    rng.shuffle(runs)
    dst = [x for r in runs for x in r]
    return list(range(n)), dst


def _bench_data_path(backend: MooncakeBackend, src: KVCache, quick: bool) -> dict[str, object]:
    reps = 7 if quick else 21
    out: dict[str, object] = {}
    with ReceiverProcess(LAYOUT) as peer:
        backend.add_peer(peer.peer)
        blocks = list(range(LAYOUT.num_blocks))
        plan = build_plan(src, peer.peer, blocks, blocks)
        raw_s, ours_s, ratio = compare(raw_write(backend, plan), through(backend, plan), reps)
        gb = plan.nbytes / 1e9
        out["transfer_64mib"] = {
            "bytes": plan.nbytes,
            "entries": plan.num_entries,
            "reps": reps,
            "raw_gbps": gb / raw_s,
            "kvguard_gbps": gb / ours_s,
            "ratio": ratio,  # kvguard throughput / raw throughput, median of paired reps
        }
        one = build_plan(src, peer.peer, [0], [0])
        raw_s, ours_s, _ = compare(raw_write(backend, one), through(backend, one), reps * 20)
        out["per_op_latency_4kib_blocks"] = {
            "raw_us": raw_s * 1e6,
            "kvguard_us": ours_s * 1e6,
            "overhead_us": (ours_s - raw_s) * 1e6,
        }
        s, d = _fragmented_blocks(LAYOUT.num_blocks, seed=1)
        coalesced = build_plan(src, peer.peer, s, d)  # the first call warms torch up
        plan_ms = 1e3 * statistics.median(
            _time(lambda: build_plan(src, peer.peer, s, d)) for _ in range(5)
        )
        naive = plan_entries_naive(src, peer.peer, s, d)
        frag_reps = 3 if quick else 7
        naive_s, coalesced_s, _ = compare(
            through(backend, naive), through(backend, coalesced), frag_reps
        )
        out["fragmented_4096_blocks"] = {
            "bytes": naive.nbytes,
            "naive_entries": naive.num_entries,
            "coalesced_entries": coalesced.num_entries,
            "naive_batches": len(naive.batches),
            "coalesced_batches": len(coalesced.batches),
            "naive_gbps": naive.nbytes / 1e9 / naive_s,
            "coalesced_gbps": coalesced.nbytes / 1e9 / coalesced_s,
            "build_plan_ms": plan_ms,
        }
    return out


def _bench_killed_peer(backend: MooncakeBackend, src: KVCache) -> dict[str, object]:
    with ReceiverProcess(SMALL) as peer:
        backend.add_peer(peer.peer)
        backend.submit(build_plan(src, peer.peer, [0], [0])).result(timeout=WAIT_S)
        blocks = list(range(SMALL.num_blocks))
        op = backend.submit(plan_entries_naive(src, peer.peer, blocks, blocks[::-1]))
        time.sleep(0.02)
        in_flight = not op.done
        killed = time.perf_counter()  # SIGKILL and reaping count too
        peer.kill()
        error = _error_of(lambda: op.result(timeout=WAIT_S))
        surfaced_s = time.perf_counter() - killed
        again = backend.submit(build_plan(src, peer.peer, [1], [1]))
        t0 = time.perf_counter()
        again_error = _error_of(lambda: again.result(timeout=WAIT_S))
        return {
            "killed_mid_transfer": in_flight,
            "error": type(error).__name__,
            "surfaced_ms": surfaced_s * 1e3,
            "next_op_error": type(again_error).__name__,
            "next_op_ms": (time.perf_counter() - t0) * 1e3,
            "typed": isinstance(error, PeerLost | PeerUnreachable),
        }


def _bench_frozen_peer(backend: MooncakeBackend, src: KVCache, quick: bool) -> dict[str, object]:
    with ReceiverProcess(SMALL) as peer:
        backend.add_peer(peer.peer)
        backend.submit(build_plan(src, peer.peer, [0], [0])).result(timeout=WAIT_S)
        peer.freeze()
        op = backend.submit(build_plan(src, peer.peer, list(range(64)), list(range(64))))
        t0 = time.perf_counter()
        error = _error_of(lambda: op.result(timeout=DEADLINE_S))
        deadline_s = time.perf_counter() - t0
        out: dict[str, object] = {
            "deadline_s": DEADLINE_S,
            "error": type(error).__name__,
            "surfaced_s": deadline_s,
            "quiesced_at_deadline": op.quiesced,
            "typed": isinstance(error, TransferTimeout),
        }
        if not quick:  # keep it frozen past MC_TRANSFER_TIMEOUT: the op fails, quarantined
            out["final_error"] = type(
                _error_of(lambda: op.result(TRANSFER_TIMEOUT_S + 10))
            ).__name__
            out["failed_s"] = time.perf_counter() - t0
            out["quarantined_at_failure"] = op.quarantined
            thawed = time.perf_counter()
            peer.thaw()  # the engine finishes the entries: only now are the blocks released
            op.wait_quiesced(WAIT_S)
            out["released_after_thaw_ms"] = (time.perf_counter() - thawed) * 1e3
        else:  # kill it instead: its connection resets and the engine call returns
            killed = time.perf_counter()  # SIGKILL and reaping count too
            peer.kill()
            op.wait_quiesced(WAIT_S)
            out["quiesced_after_kill_ms"] = (time.perf_counter() - killed) * 1e3
        return out


def _error_of(fn: Callable[[], object]) -> TransferError | None:
    try:
        fn()
    except TransferError as exc:
        return exc
    return None


def run(quick: bool = False) -> dict[str, object]:
    """Measure everything on loopback; return the figures as a dict."""
    with MooncakeBackend(transfer_timeout_s=TRANSFER_TIMEOUT_S) as backend:
        src = KVCache(LAYOUT)
        src.fill_seeded(1)
        small = KVCache(SMALL)
        small.fill_seeded(2)
        backend.register(src)
        backend.register(small)
        results = _bench_data_path(backend, src, quick)
        results["killed_peer"] = _bench_killed_peer(backend, small)
        results["frozen_peer"] = _bench_frozen_peer(backend, small, quick)
    results["quick"] = quick
    return results


def _report(r: dict[str, object]) -> str:
    t = r["transfer_64mib"]
    lat = r["per_op_latency_4kib_blocks"]
    f = r["fragmented_4096_blocks"]
    k = r["killed_peer"]
    z = r["frozen_peer"]
    assert isinstance(t, dict) and isinstance(lat, dict) and isinstance(f, dict)
    assert isinstance(k, dict) and isinstance(z, dict)
    lines = [
        f"64 MiB transfer ({t['entries']} entries, median of {t['reps']} interleaved reps):",
        f"  raw batch_transfer_sync_write  {t['raw_gbps']:6.2f} GB/s",
        f"  MooncakeBackend                {t['kvguard_gbps']:6.2f} GB/s",
        f"  throughput ratio kvguard/raw   {t['ratio']:6.3f} (median of paired reps)",
        f"one-block op latency: raw {lat['raw_us']:.0f} us, kvguard {lat['kvguard_us']:.0f} us"
        f" (overhead {lat['overhead_us']:.0f} us)",
        f"fragmented 4096-block plan ({f['bytes'] >> 20} MiB),"
        f" build_plan {f['build_plan_ms']:.1f} ms:",
        f"  naive      {f['naive_entries']:6d} entries {f['naive_batches']:3d} batches"
        f"  {f['naive_gbps']:6.2f} GB/s",
        f"  coalesced  {f['coalesced_entries']:6d} entries {f['coalesced_batches']:3d} batches"
        f"  {f['coalesced_gbps']:6.2f} GB/s",
        f"killed peer: {k['error']} after {k['surfaced_ms']:.1f} ms"
        f" (mid-transfer: {k['killed_mid_transfer']}); next op {k['next_op_error']}"
        f" after {k['next_op_ms']:.1f} ms",
        f"frozen peer: {z['error']} after {z['surfaced_s']:.3f} s (deadline {z['deadline_s']} s,"
        f" quiesced then: {z['quiesced_at_deadline']})",
    ]
    if "failed_s" in z:
        lines.append(
            f"  still frozen: {z['final_error']} after {z['failed_s']:.2f} s"
            f" (quarantined: {z['quarantined_at_failure']}); released"
            f" {z['released_after_thaw_ms']:.0f} ms after the thaw"
        )
    if "quiesced_after_kill_ms" in z:
        lines.append(f"  killed instead: quiesced {z['quiesced_after_kill_ms']:.1f} ms later")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer_bench")
    parser.add_argument("--quick", action="store_true", help="fewer reps, no 5 s frozen wait")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    # An application may configure logging: keep the backend's expected
    # failure warnings (the killed and frozen peers) out of the report.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    results = run(quick=args.quick)
    print(json.dumps(results, indent=2) if args.json else _report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
