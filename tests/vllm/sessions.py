"""A server's whole process tree by its session: CPU seconds and liveness.

Each server is started as a session leader (``start_new_session``), so its
engine core, worker and any helper it forks stay in its session even when
reparented; the session id is the leader's pid. Read from ``/proc``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Final

__all__ = ["session_alive", "session_cpu_seconds"]

_TICK: Final = os.sysconf("SC_CLK_TCK")


def _session_stats(sid: int) -> Iterator[list[bytes]]:
    """The ``/proc/PID/stat`` fields after the command name (``fields[0]`` is
    field 3, the state) of every process in session ``sid``; a process that
    exits while being read is skipped."""
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
                yield fields


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds (user + system) of every live process in session ``sid``."""
    ticks = sum(int(f[11]) + int(f[12]) for f in _session_stats(sid))  # utime, stime
    return ticks / _TICK


def session_alive(sid: int) -> bool:
    """Whether any process of session ``sid`` is still running (not a zombie)."""
    return any(f[0] != b"Z" for f in _session_stats(sid))
