"""A server's whole process tree by its session (CPU seconds, liveness), and when a port closes.

Each server is started as a session leader (``start_new_session``), so its
engine core, worker and any helper it forks stay in its session even when
reparented; the session id is the leader's pid. Read from ``/proc``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Final

__all__ = ["PortClosed", "session_alive", "session_cpu_seconds"]

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


class PortClosed(threading.Thread):
    """Watches a listening TCP port from before a kill: the monotonic time
    its socket went away (``/proc/net/tcp``), polled every 2 ms.

    A SIGKILLed process's sockets close when its files do, late in its exit:
    a vLLM worker (about 60 threads, 1.7 GB) first gives its memory back,
    which took up to 1.5 s on this host. Its main thread is a zombie, and
    its ``/proc/PID/fd`` unreadable, well before, so neither tells.
    """

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.closed = 0.0
        if not _listening(port):
            raise AssertionError(f"nothing listens on port {port}")

    def run(self) -> None:
        until = time.monotonic() + 30.0
        while time.monotonic() < until:
            if not _listening(self.port):
                self.closed = time.monotonic()
                return
            time.sleep(0.002)

    def at(self) -> float:
        """When the port closed (waits up to 35 s)."""
        self.join(35.0)
        if not self.closed:
            raise AssertionError(f"port {self.port} still listens 30 s after the kill")
        return self.closed


def _listening(port: int) -> bool:
    """Whether a socket on this host listens on ``port`` (IPv4 or IPv6)."""
    want = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and (fields[1] + " ").endswith(want):
                        return True
        except OSError:
            continue
    return False
