"""Host stalls: spans when a CPU of this machine ran nothing at all.

The VM the suite runs on (2 vCPUs, PREEMPT_NONE kernel) sometimes stops
running one CPU for 30-110 s: the kernel logs "BUG: workqueue lockup - pool
cpus=1 ... stuck for 74s!", and every process that was on that CPU, a server
or this test process, stands still. No bound a test asserts (a 1 s reaction,
a 60 s deadline) can hold across that, so a test failure that overlaps one
is told apart from kvguard's own by evidence that does not come from
kvguard: one tiny process pinned to each CPU wakes every 50 ms and writes
down each wake that came more than ``GAP_S`` late. A CPU that runs
anything, however busy, wakes it within milliseconds (CFS favours a task
back from sleep); a late wake is a CPU that ran nothing.

``tests/stall_reruns.py`` turns a failure that overlaps a stall into
``HostStall`` (raised from the original error, which the report keeps), and
pytest-rerunfailures runs only such a test again (``RERUNS`` times at most).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["GAP_S", "HostStall", "Stall", "StallWatch"]

GAP_S: Final = 2.0  # a wake this late is a stopped CPU, not a busy one

# One per CPU: pinned, it sleeps 50 ms at a time and logs "cpu start gap"
# (wall-clock seconds, as pytest's CallInfo) for each wake GAP_S late. It
# ends with the test process: one killed (a mutation run's timeout) never
# calls ``close``, and its monitors' wakes would load every run after it.
_MONITOR: Final = """
import os, sys, time
cpu, gap, path, parent = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.sched_setaffinity(0, {cpu})
out = open(path, "a", buffering=1)
prev = time.time()
while os.getppid() == parent:
    time.sleep(0.05)
    now = time.time()
    if now - prev > gap:
        out.write(f"{cpu} {prev:.3f} {now - prev:.3f}\\n")
    prev = now
"""


class HostStall(Exception):
    """A test failed while a CPU of the host ran nothing (see the module)."""


@dataclass(frozen=True)
class Stall:
    cpu: int
    start: float  # time.time()
    seconds: float

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def __str__(self) -> str:
        return f"cpu {self.cpu} ran nothing for {self.seconds:.1f} s"


class StallWatch:
    """The monitors (one process per CPU of this process), and what they saw."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-c", _MONITOR, str(cpu), str(GAP_S), str(path), str(os.getpid())],
                stdin=subprocess.DEVNULL,
            )
            for cpu in sorted(os.sched_getaffinity(0))
        ]

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self._procs}

    def stalls(self) -> list[Stall]:
        out = []
        for line in self.path.read_text().splitlines():
            fields = line.split()
            if len(fields) == 3:  # (a line being written is not yet whole)
                out.append(Stall(int(fields[0]), float(fields[1]), float(fields[2])))
        return out

    def during(self, start: float, stop: float) -> list[Stall]:
        """The stalls that overlap [start, stop] (time.time())."""
        return [s for s in self.stalls() if s.start < stop and s.end > start]

    def close(self) -> None:
        for proc in self._procs:
            proc.send_signal(signal.SIGKILL)
        for proc in self._procs:
            proc.wait(10)
