"""Soak: 100k requests with fault injection through real Mooncake.

A ``kvguard.decode.service`` decode child on loopback and, in this process, a
``MooncakeBackend`` wrapped in ``FaultInjectingBackend`` (engine error codes,
raising bindings, hung calls, half-failed plans) under one ``Scheduler``.
Requests are tiny, so the run measures bookkeeping, not bandwidth. Every
``--restart-every`` requests the decode process is SIGKILLed with requests in
flight and a new one takes its place (a new PeerInfo, re-added with
``add_peer``): real PEER_LOST failures through the real engine.

Destination blocks come from a free list and return to it only through the
scheduler's release callback, so a leak starves the run instead of hiding.
One DONE request in ``--verify-every`` is checked byte for byte against the
decode side.

Reported: failures by reason, resident memory (VmRSS) every 10k requests and
its growth from 10k to the end, and after quiesce: live, quarantined and
released counts, releases before quiesce, ops still in the backend, and
``RequestLifecycle`` / ``TransferOp`` objects still alive.

    python -m benchmarks.soak --requests 100000 [--json soak.json]

Exit status 0 when every request ended terminal, every one was released after
quiesce and nothing was left behind.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import threading
import time
import warnings
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import structlog

from kvguard.decode.service import ReceiverProcess
from lifecycle import RequestLifecycle, TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from scheduler.trace import percentiles
from transfer import DEFAULT_FAULT_KINDS, FaultInjectingBackend, FaultPlan, KVCache, KVLayout
from transfer.backend import TransferOp
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests

__all__ = ["SoakConfig", "SoakReport", "main", "soak"]

ENGINE_TIMEOUT_S = 5  # MC_TRANSFER_TIMEOUT floor: a stuck call returns after 5 s
RSS_EVERY = 10_000


@dataclass(frozen=True, slots=True)
class SoakConfig:
    requests: int = 100_000
    seed: int = 0
    fault_rate: float = 0.02
    deadline_s: float = 1.0
    workers: int = 32  # coroutines: a hung call holds one until its deadline
    window: int = 32  # live requests at most, like a serving loop's step
    layers: int = 1
    blocks: int = 4096
    block_bytes: int = 512
    blocks_per_request: int = 2
    restart_every: int = 25_000  # 0: never restart the decode process
    verify_every: int = 100
    max_seconds: float = 1800.0  # stop submitting after this long (a safety net)

    def check(self) -> None:
        if self.requests < 1 or self.workers < 1 or self.window < 1:
            raise ValueError("--requests, --workers and --window must be >= 1")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError("--fault-rate must be in [0, 1]")
        if not 1 <= self.blocks_per_request <= self.blocks:
            raise ValueError("--blocks-per-request must be in [1, --blocks]")
        if self.window * self.blocks_per_request > self.blocks:
            raise ValueError("--window x --blocks-per-request must fit in --blocks")


@dataclass(slots=True)
class SoakReport:
    requests: int
    submitted: int = 0
    done: int = 0
    failed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    faults_injected: dict[str, int] = field(default_factory=dict)
    decode_restarts: int = 0
    verified: int = 0
    integrity_errors: int = 0
    rss_mib: dict[int, float] = field(default_factory=dict)  # ended requests -> VmRSS
    rss_growth_mib: float = 0.0  # from the first sample (10k) to the last
    rss_growth_pct: float = 0.0
    decode_rss_mib: float = 0.0
    drained: bool = False
    live_after: int = 0
    quarantined_after: int = 0
    released: int = 0
    released_before_quiesce: int = 0
    double_releases: int = 0
    backend_in_flight_after: int = 0
    lifecycles_alive_after: int = 0
    ops_alive_after: int = 0
    blocks_free_after: int = 0
    blocks_total: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    wall_s: float = 0.0
    requests_per_s: float = 0.0

    def problems(self) -> list[str]:
        bad = []
        if self.done + self.failed != self.submitted or self.submitted != self.requests:
            bad.append(f"{self.submitted - self.done - self.failed} requests never ended")
        if not self.drained or self.live_after or self.quarantined_after:
            bad.append(f"not quiet: {self.live_after} live, {self.quarantined_after} quarantined")
        if self.released != self.submitted:
            bad.append(f"{self.released} released of {self.submitted}")
        if self.released_before_quiesce or self.double_releases:
            bad.append("a release came before quiesce, or twice")
        if self.backend_in_flight_after or self.lifecycles_alive_after or self.ops_alive_after:
            bad.append("objects left behind after quiesce")
        if self.blocks_free_after != self.blocks_total:
            bad.append(f"{self.blocks_total - self.blocks_free_after} blocks never came back")
        if self.integrity_errors:
            bad.append(f"{self.integrity_errors} DONE requests with corrupt blocks")
        return bad


def _rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Decode:
    """The current receiver child; replaced by a new process on restart."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.lock = threading.Lock()  # one command at a time on its pipe
        self.proc = ReceiverProcess(layout)
        self.proc.start()
        self.generation = 0

    def restart(self) -> None:
        with self.lock:
            self.proc.close()  # SIGKILL: requests in flight see a dead peer
            self.proc = ReceiverProcess(self.layout)
            self.proc.start()
            self.generation += 1

    def digests(self, generation: int, blocks: list[int]) -> list[str] | None:
        with self.lock:
            if generation != self.generation or not self.proc.alive:
                return None
            return self.proc.checksums(blocks)

    def close(self) -> None:
        self.proc.close()


def soak(cfg: SoakConfig, out: TextIO = sys.stderr) -> SoakReport:
    cfg.check()
    layout = KVLayout(cfg.layers, cfg.blocks, cfg.block_bytes)
    rng = random.Random(cfg.seed)
    report = SoakReport(cfg.requests, blocks_total=cfg.blocks)
    decode = _Decode(layout)
    inner: MooncakeBackend | None = None
    try:
        inner = MooncakeBackend(transfer_timeout_s=ENGINE_TIMEOUT_S)
        _soak(cfg, layout, rng, report, decode, inner, out)
    finally:
        decode.close()
        if inner is not None:
            inner.close()
    return report


def _soak(
    cfg: SoakConfig,
    layout: KVLayout,
    rng: random.Random,
    report: SoakReport,
    decode: _Decode,
    inner: MooncakeBackend,
    out: TextIO,
) -> None:
    src = KVCache(layout)
    src.fill_seeded(cfg.seed)
    inner.register(src)
    faults = FaultInjectingBackend(
        inner, FaultPlan(cfg.seed, rate=cfg.fault_rate, kinds=DEFAULT_FAULT_KINDS)
    )
    free = list(range(cfg.blocks))
    free_lock = threading.Lock()
    # request id -> (source blocks, destination blocks, decode generation)
    inflight: dict[str, tuple[list[int], list[int], int]] = {}
    verify_lock = threading.Lock()

    def release(rid: str, fin: Finished) -> None:
        srcb, dstb, generation = inflight.pop(rid)
        if fin.state is TransferState.DONE and int(rid[2:]) % cfg.verify_every == 0:
            theirs = decode.digests(generation, dstb)
            if theirs is not None:
                with verify_lock:
                    report.verified += 1
                    report.integrity_errors += theirs != block_digests(src, srcb)
        with free_lock:
            free.extend(dstb)

    sched = Scheduler(
        faults,
        src,
        workers=cfg.workers,
        default_deadline_s=cfg.deadline_s,
        retry=RetryPolicy(max_attempts=2),
        release=release,
    )
    sched.add_peer(decode.proc.peer)
    peer = decode.proc.peer.session_id
    progressed = threading.Event()
    sched.add_observer(lambda _fin: progressed.set())
    reasons: Counter[str] = Counter()
    # Preallocated: the soak's own bookkeeping must not show up as growth.
    latencies = array("d", bytes(8 * cfg.requests))
    k = cfg.blocks_per_request
    hang_release_at = time.monotonic() + 2 * cfg.deadline_s
    next_rss = RSS_EVERY
    started = time.monotonic()
    last_note = started
    try:
        while report.done + report.failed < cfg.requests:
            ended = report.done + report.failed
            stop = time.monotonic() - started > cfg.max_seconds
            while (
                not stop
                and report.submitted < cfg.requests
                and report.submitted - ended < cfg.window
            ):
                with free_lock:
                    if len(free) < k:
                        break
                    dstb = [free.pop(rng.randrange(len(free))) for _ in range(k)]
                first = rng.randrange(cfg.blocks - k + 1)
                srcb = list(range(first, first + k))
                rid = f"r-{report.submitted:07d}"
                inflight[rid] = (srcb, dstb, decode.generation)
                sched.submit(rid, srcb, dstb, peer=peer)
                report.submitted += 1
                if (
                    cfg.restart_every
                    and report.submitted % cfg.restart_every == 0
                    and report.submitted < cfg.requests
                ):
                    decode.restart()
                    report.decode_restarts += 1
                    sched.add_peer(decode.proc.peer)
                    peer = decode.proc.peer.session_id
            for fin in sched.poll():
                latencies[report.done + report.failed] = fin.latency_s
                if fin.state is TransferState.DONE:
                    report.done += 1
                else:
                    report.failed += 1
                    reasons[fin.reason.name if fin.reason else "UNKNOWN"] += 1
            ended = report.done + report.failed
            if ended >= next_rss:
                gc.collect()
                report.rss_mib[next_rss] = round(_rss_mib(), 1)
                next_rss += RSS_EVERY
            now = time.monotonic()
            if now >= hang_release_at:
                # An injected hang models an engine call stuck until the
                # engine's own timeout: let them end, as the engine would.
                faults.release_hangs()
                hang_release_at = now + 2 * cfg.deadline_s
            if now - last_note >= 10.0:
                last_note = now
                rate = ended / (now - started)
                out.write(f"soak: {ended}/{cfg.requests} ended, {rate:.0f}/s, {dict(reasons)}\n")
                out.flush()
            if stop and report.submitted == ended:
                break
            if ended < cfg.requests:
                progressed.wait(0.05)
                progressed.clear()
        report.wall_s = round(time.monotonic() - started, 2)
    finally:
        faults.release_hangs()
        report.drained = sched.drain(timeout=max(30.0, 3 * ENGINE_TIMEOUT_S))
        metrics = sched.metrics()
        report.decode_rss_mib = round(_rss_mib(decode.proc.pid), 1) if decode.proc.alive else 0.0
        sched.close()
    report.by_reason = dict(sorted(reasons.items()))
    report.faults_injected = {kind.value: n for kind, n in faults.stats.items() if n}
    report.live_after = sum(metrics.live_by_state.values())
    report.quarantined_after = metrics.quarantined
    report.released = metrics.released
    report.released_before_quiesce = metrics.released_before_quiesce
    report.double_releases = metrics.double_releases
    report.backend_in_flight_after = inner.in_flight
    report.blocks_free_after = len(free)
    del sched, faults
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        alive = gc.get_objects()
        report.lifecycles_alive_after = sum(isinstance(o, RequestLifecycle) for o in alive)
        report.ops_alive_after = sum(isinstance(o, TransferOp) for o in alive)
        del alive
    samples = sorted(report.rss_mib.items())
    if len(samples) >= 2:
        rss0, rss1 = samples[0][1], samples[-1][1]
        report.rss_growth_mib = round(rss1 - rss0, 1)
        report.rss_growth_pct = round(100.0 * (rss1 - rss0) / rss0, 2)
    pct = percentiles(latencies[: report.done + report.failed])
    if pct:
        report.p50_ms = round(1000 * pct["p50"], 3)
        report.p99_ms = round(1000 * pct["p99"], 3)
    if report.wall_s:
        report.requests_per_s = round((report.done + report.failed) / report.wall_s, 1)


def main(argv: Sequence[str] | None = None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="Soak: requests with fault injection through real Mooncake.",
    )
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--fault-rate", type=float, default=d.fault_rate)
    p.add_argument("--deadline", type=float, default=d.deadline_s)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--restart-every", type=int, default=d.restart_every)
    p.add_argument("--verify-every", type=int, default=d.verify_every)
    p.add_argument("--max-seconds", type=float, default=d.max_seconds)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)
    # An application: keep per-transition records out of the way.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    cfg = SoakConfig(
        requests=args.requests,
        seed=args.seed,
        fault_rate=args.fault_rate,
        deadline_s=args.deadline,
        workers=args.workers,
        window=args.window,
        restart_every=args.restart_every,
        verify_every=args.verify_every,
        max_seconds=args.max_seconds,
    )
    report = soak(cfg)
    data: dict[str, Any] = {"config": asdict(cfg), "report": asdict(report), "pid": os.getpid()}
    data["problems"] = report.problems()
    text = json.dumps(data, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if not report.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
