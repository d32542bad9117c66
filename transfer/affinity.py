"""Where kvguard's threads run when the host engine pinned its own.

Serving engines pin their compute threads to cores. vLLM's CPU worker binds
each OpenMP thread to one core before it hands a connector its KV caches, and
Linux gives a new thread the CPU mask of the thread that starts it. Every
thread kvguard, ZeroMQ and Mooncake start from that thread would share one
core with a compute thread that spins between steps: on a small machine
heartbeats go unanswered for seconds and a decode's push waits out its
deadline. ``threads_on`` widens the calling thread's mask while kvguard
starts its threads (they inherit it), then puts the caller's mask back, so
the host's own pinning is left exactly as it was.

Linux only (``os.sched_setaffinity``); elsewhere every call is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["INHERIT", "parse_cpus", "process_cpus", "threads_on"]

INHERIT: Final = "inherit"  # the setting that keeps the starting thread's mask
_MAX_CPU: Final = 1 << 16  # far above any machine; bounds a CPU list's size


def process_cpus() -> frozenset[int]:
    """The CPUs some thread of this process may run on: the union of every
    thread's mask (the host narrowed each compute thread to its own core)."""
    cpus: set[int] = set()
    with os.scandir("/proc/self/task") as tasks:
        for task in tasks:
            try:
                cpus |= os.sched_getaffinity(int(task.name))
            except (OSError, ValueError):
                continue  # the thread ended while we looked
    return frozenset(cpus)  # never empty: the calling thread is among the tasks


def parse_cpus(text: str) -> frozenset[int] | None:
    """A CPU list as Linux writes it (``"0-3,6"``); ``""`` means every CPU of
    the process (``process_cpus``), ``"inherit"`` the starting thread's own
    mask (None). ValueError names a list that is not one."""
    text = text.strip()
    if not text:
        return process_cpus()
    if text == INHERIT:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a CPU or a range") from None
        if not 0 <= first <= last < _MAX_CPU:
            raise ValueError(f"bad CPU list {text!r}: range {part!r} is empty or out of bounds")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


@contextmanager
def threads_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started in the body run on ``cpus`` (None: the caller's mask);
    the calling thread's own mask is restored on every exit path. OSError
    (from the kernel) names a set the process may not use."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    if cpus == own:
        yield
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot run kvguard's threads on CPUs {sorted(cpus)}") from exc
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
