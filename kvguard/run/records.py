"""What ``kvguard run`` is asked to do and what it reports back.

``RunConfig`` is checked once, before any process starts, so a bad flag
fails fast. ``RunSummary.ok`` is the job's verdict: the exit status and the
printed ``result:`` line both come from it, never from the counts alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from transfer.metadata import mode_of

__all__ = ["RunConfig", "RunSummary", "print_summary"]


@dataclass(frozen=True, slots=True)
class RunConfig:
    """The flags of ``kvguard run``; ``check`` rejects bad ones before any process starts."""

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
    fragmentation: float = 0.0  # see kvguard.run.workload: 0 a serving free list, 1 scattered
    max_attempts: int = 3
    json_path: Path | None = None
    progress: bool = True
    journal_path: Path | None = None  # JSON lines, one per transition (scheduler.journal)
    metrics_port: int | None = None  # serve /metrics on 127.0.0.1 while running; 0: any port
    stuck_after_s: float | None = None  # warn about requests live for longer than this
    decode: str | None = None  # HOST:PORT of a `kvguard decode`; None: start one locally
    # With ``decode``: this client's CURVE key pair and the service's public key (files).
    curve_secret: str | None = None
    curve_server: str | None = None
    metadata: str = "P2PHANDSHAKE"  # the engine's metadata mode (transfer.metadata)
    # How long an alive but unreachable decode side (a cut link) is asked again
    # before its DONE requests count as unverified (kvguard.run.verify).
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
            # Keys are for a service elsewhere: the local child listens on loopback.
            "--curve-secret/--curve-server (with --decode only)": self.decode is not None
            or not (self.curve_secret or self.curve_server),
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
    """What the run counted; ``to_json`` is the ``--json`` file, field for field."""

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
    # The raw engine on the same entries in the same run (kvguard.run.raw_baseline);
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


def print_summary(s: RunSummary, cfg: RunConfig, out: TextIO) -> None:
    """The table a person reads, ending in the ``result:`` line that ``ok`` decides."""
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
