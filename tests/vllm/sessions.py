"""A server's whole process tree by its session: CPU seconds, liveness, exits.

Each server is started as a session leader (``start_new_session``), so its
engine core, worker and any helper it forks stay in its session even when
reparented; the session id is the leader's pid. Read from ``/proc``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Final

__all__ = ["FilesClosed", "session_alive", "session_cpu_seconds", "session_pids"]

_TICK: Final = os.sysconf("SC_CLK_TCK")


def _session_stats(sid: int) -> Iterator[tuple[int, list[bytes]]]:
    """The pid and ``/proc/PID/stat`` fields after the command name
    (``fields[0]`` is field 3, the state) of every process in session
    ``sid``; a process that exits while being read is skipped."""
    with os.scandir("/proc") as entries:  # closed too when a caller stops early
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rindex(b")") + 2 :].split()
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                yield int(entry.name), fields


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds (user + system) of every live process in session ``sid``."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in _session_stats(sid))  # utime, stime
    return ticks / _TICK


def session_alive(sid: int) -> bool:
    """Whether any process of session ``sid`` is still running (not a zombie)."""
    return any(f[0] != b"Z" for _, f in _session_stats(sid))


def session_pids(sid: int) -> list[int]:
    """The pids of every live process in session ``sid``."""
    return [pid for pid, f in _session_stats(sid) if f[0] != b"Z"]


class FilesClosed(threading.Thread):
    """Watches processes from before a kill: the monotonic time each one's
    files were closed (its connections dropped), polled every 2 ms.

    A SIGKILLed vLLM worker (about 60 threads, 1.7 GB) closes its files only
    once its last thread is gone and the kernel took its memory back; its
    main thread is a zombie well before, so the state field tells nothing.
    """

    def __init__(self, pids: Iterable[int]) -> None:
        super().__init__(daemon=True)
        self.pids = list(pids)
        self.closed: dict[int, float] = {}

    def run(self) -> None:
        until = time.monotonic() + 30.0
        while len(self.closed) < len(self.pids) and time.monotonic() < until:
            for pid in self.pids:
                if pid not in self.closed and not _has_files(pid):
                    self.closed[pid] = time.monotonic()
            time.sleep(0.002)

    def last(self) -> float:
        """When the last of them closed its files (waits up to 35 s)."""
        self.join(35.0)
        left = set(self.pids) - set(self.closed)
        if left:
            raise AssertionError(f"processes {sorted(left)} kept their files 30 s")
        return max(self.closed.values())


def _has_files(pid: int) -> bool:
    try:
        return bool(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False
