"""The raw engine on the same entries, in the same run: ``kvguard run``'s baseline.

After the run, the plans of its DONE requests are replayed straight through
the engine's own ``batch_transfer_sync_write``, with as many threads as the
run had workers and no scheduler, no lifecycle, no verification. The run's
GB/s divided by this one is what kvguard costs on this machine, measured on
the same entries minutes apart rather than against a figure from elsewhere.
Every return code is checked: a replay that fails is reported, not averaged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transfer import TransferPlan

__all__ = ["RawResult", "replay_raw"]


@dataclass(frozen=True, slots=True)
class RawResult:
    nbytes: int
    wall_s: float
    cpu_s: float  # process CPU time (every thread) during the replay
    failed_calls: int  # calls that returned non-zero; their bytes are not counted

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / 1e9) if self.nbytes else 0.0


def replay_raw(engine: Any, plans: Sequence[TransferPlan], threads: int) -> RawResult:
    """Push ``plans`` again through ``engine`` with ``threads`` sync callers."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads!r}")
    calls = [(p.peer, b) for p in plans for b in p.batches]
    lock = threading.Lock()
    next_call = 0
    moved = failed = 0

    def caller() -> None:
        nonlocal next_call, moved, failed
        while True:
            with lock:
                if next_call >= len(calls):
                    return
                peer, batch = calls[next_call]
                next_call += 1
            rc = engine.batch_transfer_sync_write(
                peer, list(batch.src), list(batch.dst), list(batch.lengths)
            )
            with lock:
                if rc == 0:
                    moved += batch.nbytes
                else:
                    failed += 1

    workers = [threading.Thread(target=caller, name=f"kvguard-raw-{i}") for i in range(threads)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return RawResult(nbytes=moved, wall_s=wall, cpu_s=cpu, failed_calls=failed)
