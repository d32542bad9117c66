"""A thread's inbox that its ZeroMQ poll wakes on.

The prefill's sender thread and the decode's receiver thread sleep in a
ZeroMQ poll. What other threads hand them (vLLM's holds and loads, kvguard's
releases) used to wait in a queue until the poll timed out: up to 5 ms at
each of a handover's hops (the decode asking, the prefill answering). The
inbox is also an eventfd, readable from the first ``put`` until the owner
``drain``s it, so it sits in the same poll as the sockets and wakes it.

Linux only, as kvguard (eventfd; the Mooncake engine is Linux only too).
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from typing import Generic, TypeVar

__all__ = ["Inbox", "poll_ms"]

T = TypeVar("T")


def poll_ms(wake: float | None, now: float, most_ms: int) -> int:
    """How long a thread may poll: until its core's next ``wake`` (monotonic
    seconds; None: no timer), rounded up, and at most ``most_ms``."""
    if wake is None:
        return most_ms
    return max(0, min(most_ms, math.ceil((wake - now) * 1000)))


class Inbox(Generic[T]):
    """Items for one owner thread, any thread putting; register the inbox
    itself (its ``fileno``) in the owner's ``zmq.Poller``."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[T] = queue.SimpleQueue()
        # Nonzero while something may be queued; the owner zeroes it before
        # draining, so a put racing the drain leaves it readable.
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        # (L) the fd is closed: a write then could land in another file
        # that reused its number, so puts only queue.
        self._closed = False

    def fileno(self) -> int:
        """The eventfd (what ``zmq.Poller.register`` polls)."""
        return self._fd

    def put(self, item: T) -> None:
        """Queue ``item`` and wake the owner's poll."""
        self._queue.put(item)
        self.wake()

    def wake(self) -> None:
        """Wake the owner's poll with nothing queued (to see a stop flag)."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._fd, 1)

    def drain(self) -> list[T]:
        """Everything queued, oldest first; the poll sleeps again until the next put."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # zero: nothing was put
                    os.eventfd_read(self._fd)
        out: list[T] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Close the eventfd, once the owner thread no longer polls it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
