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
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import structlog
from prometheus_client import CollectorRegistry

from lifecycle import FailureReason, TransferState
from transfer import KVCache, KVLayout, PeerInfo, TransferBackend
from transfer.faults import DEFAULT_FAULT_KINDS, FaultInjectingBackend, FaultPlan
from transfer.local import LocalBackend
from transfer.metadata import mode_of
from transfer.peer_protocol import block_digest_bytes
from transfer.plan import build_plan

from ._scheduler import Finished, RetryPolicy, Scheduler
from .journal import JsonlJournal
from .metrics import MetricsServer, register_metrics, serve_metrics
from .raw_baseline import replay_raw
from .stuck import StuckInspector
from .trace import percentiles
from .verify import SourceDigests, Verifier
from .workload import BlockAllocator

__all__ = ["RunConfig", "RunSummary", "run"]


@dataclass(frozen=True, slots=True)
class RunConfig:
    requests: int = 200
    backend: str = "mooncake"  # "mooncake" | "local"
    seed: int = 0
    deadline_s: float = 5.0
    workers: int = 4
    fault_rate: float = 0.0
    kill_decode_after: int | None = None
    freeze_decode_after: int | None = None
    layers: int = 8
    blocks: int = 1024  # per side
    block_bytes: int = 8192
    blocks_per_request: int = 16
    fragmentation: float = 0.0  # see scheduler.workload: 0 a serving free list, 1 scattered
    max_attempts: int = 3
    json_path: Path | None = None
    progress: bool = True
    journal_path: Path | None = None  # JSON lines, one per transition (scheduler.journal)
    metrics_port: int | None = None  # serve /metrics on 127.0.0.1 while running; 0: any port
    stuck_after_s: float | None = None  # warn about requests live for longer than this
    decode: str | None = None  # HOST:PORT of a `kvguard decode`; None: start one locally
    metadata: str = "P2PHANDSHAKE"  # the engine's metadata mode (transfer.metadata)
    # How long an alive but unreachable decode side (a cut link) is asked again
    # before its DONE requests count as unverified (scheduler.verify).
    verify_retry_s: float = 30.0

    def check(self) -> None:
        problems = {
            "--requests": self.requests >= 1,
            "--deadline": self.deadline_s > 0,
            "--workers": self.workers >= 1,
            "--fault-rate": 0.0 <= self.fault_rate <= 1.0,
            "--kill-decode-after": self.kill_decode_after is None or self.kill_decode_after >= 0,
            "--freeze-decode-after": self.freeze_decode_after is None
            or self.freeze_decode_after >= 0,
            "--blocks-per-request": 1 <= self.blocks_per_request <= self.blocks,
            "--fragmentation": 0.0 <= self.fragmentation <= 1.0,
            "--metrics-port": self.metrics_port is None or 0 <= self.metrics_port <= 65535,
            "--stuck-after": self.stuck_after_s is None or self.stuck_after_s > 0,
        }
        bad = [name for name, ok in problems.items() if not ok]
        if bad:
            raise ValueError(f"invalid value for {', '.join(bad)}")
        if self.backend not in ("mooncake", "local"):
            raise ValueError(f"--backend must be mooncake or local, got {self.backend!r}")
        mode_of(self.metadata)  # a ValueError naming an unknown scheme
        if self.backend == "local" and self.metadata != "P2PHANDSHAKE":
            raise ValueError("--metadata needs --backend mooncake")
        if self.decode is not None:
            # A remote service is not ours to kill or freeze.
            clash = {
                "--backend local": self.backend == "local",
                "--kill-decode-after": self.kill_decode_after is not None,
                "--freeze-decode-after": self.freeze_decode_after is not None,
            }
            bad = [name for name, on in clash.items() if on]
            if bad:
                raise ValueError(f"--decode cannot be combined with {', '.join(bad)}")


@dataclass(slots=True)
class RunSummary:
    requests: int
    done: int = 0
    failed: int = 0
    non_terminal: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    integrity_errors: int = 0
    # DONE, but the decode side could not answer. Tolerated only after the run
    # itself killed or froze it (`unverified`); while it is alive, an
    # unanswered verification means nothing was checked: the job fails.
    unverified: int = 0
    unverified_alive: int = 0
    verified: int = 0  # DONE and byte-identical to the source
    released_before_quiesce: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    gbps: float = 0.0
    wall_s: float = 0.0
    cpu_s_per_gb: float = 0.0  # this process's CPU seconds (all threads) per GB moved
    # The raw engine on the same entries in the same run (scheduler.raw_baseline);
    # None where there is no engine to compare with (local backend, decode stopped).
    raw_gbps: float | None = None
    raw_cpu_s_per_gb: float | None = None

    def ok(self) -> list[str]:
        """What broke; empty when the run upheld every invariant."""
        broken = []
        if self.non_terminal:
            broken.append(f"{self.non_terminal} requests never reached a terminal state")
        if self.integrity_errors:
            broken.append(f"{self.integrity_errors} DONE requests have corrupt destination blocks")
        lost = self.done - self.verified - self.integrity_errors - self.unverified
        if lost - self.unverified_alive > 0:
            broken.append(f"{lost - self.unverified_alive} DONE requests never got a verdict")
        if self.unverified_alive:
            broken.append(
                f"{self.unverified_alive} DONE requests were not verified"
                " while the decode side was alive"
            )
        if self.released_before_quiesce:
            broken.append(f"{self.released_before_quiesce} releases happened before quiesce")
        return broken

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "done": self.done,
            "failed": self.failed,
            "non_terminal": self.non_terminal,
            "by_reason": self.by_reason,
            "integrity_errors": self.integrity_errors,
            "unverified": self.unverified,
            "unverified_alive": self.unverified_alive,
            "verified": self.verified,
            "released_before_quiesce": self.released_before_quiesce,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "gbps": self.gbps,
            "wall_s": self.wall_s,
            "cpu_s_per_gb": self.cpu_s_per_gb,
            "raw_gbps": self.raw_gbps,
            "raw_cpu_s_per_gb": self.raw_cpu_s_per_gb,
        }


class Decode(Protocol):
    """The decode side as the run sees it: a peer to write to and to verify."""

    peer: PeerInfo

    def digests(self, blocks: list[int]) -> bytes | None:
        """Digests of destination blocks (scheduler.verify); None if it cannot answer."""

    def kill(self) -> None: ...

    def freeze(self) -> None: ...

    def close(self) -> None: ...


class _LocalDecode:
    """Decode side inside this process, on the LocalBackend."""

    def __init__(self, backend: LocalBackend, layout: KVLayout) -> None:
        self._backend = backend
        self._cache = KVCache(layout)
        self.peer = backend.register_peer("local-decode", self._cache)
        self._dead = False

    def digests(self, blocks: list[int]) -> bytes | None:
        return None if self._dead else block_digest_bytes(self._cache, blocks)

    def kill(self) -> None:
        self._dead = True
        self._backend.unregister_peer(self.peer.session_id)

    def freeze(self) -> None:
        raise ValueError("--freeze-decode-after needs --backend mooncake")

    def close(self) -> None:
        pass


class _Progress:
    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.out, self.enabled = total, out, enabled
        self._last = 0.0
        self._drawn = 0  # length of the bar on the current line; 0: none

    def note(self, line: str) -> None:
        """A line above the bar (a warning): blank the bar, print, redraw later."""
        if self._drawn:
            self.out.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        self.out.write(line + "\n")
        self.out.flush()
        self._last = 0.0

    # structlog's logger protocol: it calls the method named after the level.
    msg = debug = info = warning = error = critical = note

    def show(self, done: int, failed: int, live: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        width = 30
        ended = done + failed
        filled = int(width * ended / self.total)
        bar = "#" * filled + "." * (width - filled)
        text = f"[{bar}] {ended}/{self.total}  done {done}  failed {failed}  live {live} "
        self.out.write("\r" + text)
        self._drawn = len(text)
        if force:
            self.out.write("\n")
            self._drawn = 0
        self.out.flush()

    def logger(self) -> Any:
        """A structlog logger printing above the bar, whatever the app configured."""
        return structlog.wrap_logger(
            self,
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            context_class=dict,
            cache_logger_on_first_use=True,
        )


RegisterSource = Callable[[KVCache], None]


def _make_decode(
    cfg: RunConfig, layout: KVLayout
) -> tuple[TransferBackend, Decode, RegisterSource]:
    if cfg.backend == "local":
        local = LocalBackend(workers=cfg.workers)
        return local, _LocalDecode(local, layout), local.register_source
    # Imported here: the local backend must work where Mooncake cannot load.
    from ._mooncake_decode import start_mooncake_decode

    mooncake, decode = start_mooncake_decode(cfg, layout)
    return mooncake, decode, mooncake.register


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
        inner, decode, register_source = _make_decode(cfg, layout)
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
    progress = _Progress(cfg.requests, sys.stderr, cfg.progress)
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
    _print_summary(summary, cfg, out)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    return summary


def _print_summary(s: RunSummary, cfg: RunConfig, out: TextIO) -> None:
    rows = [
        ("backend", cfg.backend),
        ("requests", s.requests),
        ("done", s.done),
        ("failed", s.failed),
        *((f"  {reason}", n) for reason, n in s.by_reason.items()),
        ("non-terminal", s.non_terminal),
        ("verified intact", s.verified),
        ("integrity errors", s.integrity_errors),
        ("unverified (decode gone)", s.unverified),
        ("unverified (decode alive)", s.unverified_alive),
        ("released before quiesce", s.released_before_quiesce),
        ("p50 / p99 latency (ms)", f"{s.p50_ms:.2f} / {s.p99_ms:.2f}"),
        ("throughput (GB/s)", f"{s.gbps:.3f}" + _vs_raw(s)),
        ("CPU s per GB", f"{s.cpu_s_per_gb:.3f}" + _raw_cpu(s)),
        ("wall (s)", f"{s.wall_s:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")
    broken = s.ok()
    out.write("result: " + ("OK" if not broken else "BROKEN: " + "; ".join(broken)) + "\n")
    out.flush()


def _vs_raw(s: RunSummary) -> str:
    if s.raw_gbps is None:
        return ""
    ratio = f", {s.gbps / s.raw_gbps:.2f}x" if s.raw_gbps > 0 else ""
    return f"  (raw engine, same entries: {s.raw_gbps:.3f}{ratio})"


def _raw_cpu(s: RunSummary) -> str:
    return "" if s.raw_cpu_s_per_gb is None else f"  (raw engine: {s.raw_cpu_s_per_gb:.3f})"
