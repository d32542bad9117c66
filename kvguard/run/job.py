"""``kvguard run``: the main job, end to end on real Mooncake over loopback.

A decode process owns a torch KV cache registered with Mooncake; this
process (prefill) fills its own cache with seeded data and pushes N
requests' blocks through the ``Scheduler``. Destination blocks come from a
free list and go back to it only through the scheduler's release callback,
after quiesce, and only after a DONE request's destination blocks were
verified byte for byte against the source. Faults are injected around the
real backend; the decode process can be killed or frozen mid-run.

Exit status 0 when every request ended terminal, integrity held and nothing
was released before quiesce. FAILED requests are a correct outcome.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import threading
import time
from collections import Counter
from typing import TextIO

from prometheus_client import CollectorRegistry

from lifecycle import FailureReason, TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from scheduler.journal import JsonlJournal
from scheduler.metrics import MetricsServer, register_metrics, serve_metrics
from scheduler.stuck import StuckInspector
from scheduler.trace import percentiles
from transfer import KVCache, KVLayout, TransferBackend
from transfer.faults import DEFAULT_FAULT_KINDS, FaultInjectingBackend, FaultPlan
from transfer.plan import build_plan

from .decode import Decode, RegisterSource, make_decode
from .progress import Progress
from .raw_baseline import replay_raw
from .records import RunConfig, RunSummary, print_summary
from .verify import SourceDigests, Verifier
from .workload import BlockAllocator

# RunConfig and RunSummary live in kvguard.run.records; callers import
# them from here, the job's public entry point.
__all__ = ["RunConfig", "RunSummary", "run"]


def run(
    cfg: RunConfig, out: TextIO = sys.stdout, *, registry: CollectorRegistry | None = None
) -> RunSummary:
    """Run the job; always stops the decode process, frozen or not.

    ``registry``: also export the scheduler's metrics there (an embedding
    test reads the final values from it after the run).
    """
    cfg.check()
    layout = KVLayout(cfg.layers, cfg.blocks, cfg.block_bytes)
    rng = random.Random(cfg.seed)
    with contextlib.ExitStack() as closing:  # closes in reverse: decode, inner, journal
        # Opened first: a bad journal path fails before any process starts.
        journal = (
            closing.enter_context(JsonlJournal(cfg.journal_path))
            if cfg.journal_path is not None
            else None
        )
        inner, decode, register_source = make_decode(cfg, layout)
        closing.callback(inner.close)
        closing.callback(decode.close)
        return _run(cfg, layout, rng, inner, decode, register_source, out, journal, registry)


def _run(
    cfg: RunConfig,
    layout: KVLayout,
    rng: random.Random,
    inner: TransferBackend,
    decode: Decode,
    register_source: RegisterSource,
    out: TextIO,
    journal: JsonlJournal | None,
    registry: CollectorRegistry | None,
) -> RunSummary:
    src = KVCache(layout)
    src.fill_seeded(cfg.seed)
    register_source(src)
    backend: TransferBackend = inner
    faults: FaultInjectingBackend | None = None
    if cfg.fault_rate > 0:
        faults = FaultInjectingBackend(
            inner, FaultPlan(cfg.seed, rate=cfg.fault_rate, kinds=DEFAULT_FAULT_KINDS)
        )
        backend = faults

    pool = BlockAllocator(cfg.blocks, fragmentation=cfg.fragmentation, seed=cfg.seed)
    summary = RunSummary(cfg.requests)
    # Set before the run kills or freezes the decode side, so a verification
    # that fails from then on is "decode gone", not a silent pass.
    decode_stopped = threading.Event()

    verifier = Verifier(
        decode, SourceDigests(src), pool.free, decode_stopped, retry_for_s=cfg.verify_retry_s
    )

    def release(request_id: str, fin: Finished) -> None:
        src_blocks, dst_blocks = blocks_of.pop(request_id)
        if fin.state is TransferState.DONE:
            done_blocks.append((src_blocks, dst_blocks))
            verifier.put(src_blocks, dst_blocks)  # frees the blocks after the verdict
        else:
            pool.free(dst_blocks)

    blocks_of: dict[str, tuple[list[int], list[int]]] = {}
    done_blocks: list[tuple[list[int], list[int]]] = []  # for the raw replay
    sched = Scheduler(
        backend,
        src,
        workers=cfg.workers,
        default_deadline_s=cfg.deadline_s,
        retry=RetryPolicy(max_attempts=cfg.max_attempts),
        release=release,
        journal=journal,
    )
    sched.add_peer(decode.peer)
    progressed = threading.Event()
    sched.add_observer(lambda _fin: progressed.set())
    progress = Progress(cfg.requests, sys.stderr, cfg.progress)
    if registry is None and cfg.metrics_port is not None:
        registry = CollectorRegistry()
    if registry is not None:
        register_metrics(sched, registry)
    server: MetricsServer | None = None
    stuck = (
        StuckInspector(sched, cfg.stuck_after_s, logger=progress.logger())
        if cfg.stuck_after_s is not None
        else None
    )
    latencies: list[float] = []
    reasons: Counter[str] = Counter()
    done = failed = submitted = 0
    window = 2 * cfg.workers
    killed = frozen = False
    hang_release_at = time.monotonic() + 2 * cfg.deadline_s
    started = time.monotonic()
    cpu_started = time.process_time()
    try:
        if registry is not None and cfg.metrics_port is not None:
            server = serve_metrics(registry, cfg.metrics_port)
            progress.note(f"kvguard run: serving metrics at {server.url}")
        while done + failed < cfg.requests:
            # Submit while blocks are free; a full pool waits, never forever.
            # A serving loop hands over a few requests per step, not its whole
            # backlog: at most `window` live, so latency is transfer time, not
            # time spent queued behind the backlog.
            while submitted < cfg.requests and submitted - done - failed < window:
                dst = pool.take(cfg.blocks_per_request, timeout=0.0 if submitted else 1.0)
                if dst is None:
                    break
                # A prefill allocates a sequence's blocks mostly contiguously.
                first = rng.randrange(cfg.blocks - cfg.blocks_per_request + 1)
                srcb = list(range(first, first + cfg.blocks_per_request))
                rid = f"req-{submitted:06d}"
                blocks_of[rid] = (srcb, dst)
                sched.submit(rid, srcb, dst, peer=decode.peer.session_id)
                submitted += 1
            for fin in sched.poll():
                latencies.append(fin.latency_s)
                if fin.state is TransferState.DONE:
                    done += 1
                else:
                    failed += 1
                    reasons[(fin.reason or FailureReason.TRANSFER_ERROR).name] += 1
            ended = done + failed
            if cfg.kill_decode_after is not None and not killed and done >= cfg.kill_decode_after:
                decode_stopped.set()
                decode.kill()
                killed = True
            if (
                cfg.freeze_decode_after is not None
                and not frozen
                and done >= cfg.freeze_decode_after
            ):
                decode_stopped.set()
                decode.freeze()
                frozen = True
            if faults is not None and time.monotonic() >= hang_release_at:
                # An injected hang models an engine call stuck until the
                # engine's own timeout: let them end, as the engine would.
                faults.release_hangs()
                hang_release_at = time.monotonic() + 2 * cfg.deadline_s
            progress.show(done, failed, submitted - ended)
            if stuck is not None:
                stuck.check()  # rate-limits its own warnings
            if ended < cfg.requests:
                # Sleep until something ends (or a short step passes).
                progressed.wait(0.05)
                progressed.clear()
        wall = time.monotonic() - started
        cpu = time.process_time() - cpu_started
        progress.show(done, failed, submitted - done - failed, force=True)
    finally:
        if faults is not None:
            faults.release_hangs()
        # Kill before draining: a frozen peer would otherwise hold its ops
        # (and their blocks) until the engine's own timeout.
        if frozen or killed:
            decode.kill()
        sched.drain(timeout=max(10.0, 3 * cfg.deadline_s))
        metrics = sched.metrics()
        sched.close()
        # Every release has queued its request by now; a verifier still busy
        # after this long leaves those requests out of the tally, and the
        # summary shows them as neither verified nor unverified.
        verifier.close(timeout=max(10.0, 3 * cfg.deadline_s) + cfg.verify_retry_s)
        if server is not None:
            server.close()

    summary.done, summary.failed = done, failed
    tally = verifier.tally
    summary.integrity_errors = tally.corrupt
    summary.unverified, summary.unverified_alive = tally.unverified, tally.unverified_alive
    summary.verified = tally.intact
    summary.non_terminal = cfg.requests - done - failed
    summary.by_reason = dict(sorted(reasons.items()))
    summary.released_before_quiesce = metrics.released_before_quiesce + metrics.double_releases
    summary.wall_s = round(wall, 3)
    if latencies:
        pct = percentiles(latencies)
        summary.p50_ms = round(1000 * pct["p50"], 3)
        summary.p99_ms = round(1000 * pct["p99"], 3)
    summary.gbps = round(metrics.bytes_done / wall / 1e9, 3) if wall > 0 else 0.0
    if metrics.bytes_done:
        summary.cpu_s_per_gb = round(cpu / (metrics.bytes_done / 1e9), 3)
    engine = getattr(inner, "engine", None)
    if engine is not None and done_blocks and not decode_stopped.is_set():
        # Every request has been released and verified: the replay writes the
        # same bytes again into blocks no request holds, so a sync call that
        # returns before the engine is done with them can corrupt nothing.
        plans = [build_plan(src, decode.peer, s, d) for s, d in done_blocks]
        raw = replay_raw(engine, plans, cfg.workers)
        if raw.failed_calls == 0:
            summary.raw_gbps = round(raw.gbps, 3)
            summary.raw_cpu_s_per_gb = round(raw.cpu_s_per_gb, 3)
    print_summary(summary, cfg, out)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    return summary
