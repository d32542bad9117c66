"""What a Scheduler's callers are told of each request's end: poll, get,
wait, wait_async, abort.

``Scheduler`` is an ``Outcomes``. A waiter returns at the step that ends its
request, or at its ``timeout``, and never later than the request's deadline
plus a grace (for a driver that is late or gone); one that returns unwoken
raises ``DriverFailed`` if the driver died.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from lifecycle import FailureReason, RequestLifecycle, TransferState

from ._records import Finished
from ._requests import RequestRecord, RequestTable, Tombstone
from .errors import UnknownRequest

__all__ = ["Outcomes"]

# A waiter returns at the step that ends its request; this bounds how long it
# waits past the deadline for a driver that is late or gone.
_WAIT_GRACE_S = 1.0


class Outcomes:
    """The outcomes part of ``Scheduler``'s API: poll, get, wait, wait_async, abort."""

    # The Scheduler's own, set by Scheduler.__init__.
    _table: RequestTable
    _unpolled: deque[Finished]  # outcomes not yet polled, oldest first

    if TYPE_CHECKING:  # the Scheduler's, called from here

        def _check_driver(self) -> None: ...

    def poll(self) -> list[Finished]:
        """Requests that became terminal since the last poll(); never blocks."""
        out: list[Finished] = []
        pop = self._unpolled.popleft
        with contextlib.suppress(IndexError):
            while True:
                out.append(pop())
        return out

    def _find(self, request_id: str) -> RequestRecord | Tombstone:
        found = self._table.find(request_id)
        if found is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        return found

    def get(self, request_id: str) -> RequestLifecycle:
        """The request's lifecycle; for a released one, while the caller still holds it."""
        found = self._find(request_id)
        if isinstance(found, RequestRecord):
            return found.lc
        lc = found.lifecycle()
        if lc is None:
            raise UnknownRequest(f"request {request_id!r} was released and forgotten")
        return lc

    def _waitable(self, request_id: str, wake: Callable[[], object]) -> RequestRecord | None:
        found = self._find(request_id)
        if isinstance(found, Tombstone) or not self._table.add_waker(found, wake):
            return None
        return found

    def wait(self, request_id: str, timeout: float | None = None) -> TransferState:
        """Block until the core has seen the request terminal, ``timeout``
        passes, or its deadline passes (whichever is first); return its state."""
        event = threading.Event()
        req = self._waitable(request_id, event.set)
        if req is not None:
            event.wait(_bounded(req.deadline, timeout))
            if not event.is_set():
                self._check_driver()
        return self._state_of(request_id, req)

    async def wait_async(self, request_id: str, timeout: float | None = None) -> TransferState:
        """asyncio form of wait(); cancelling the await does not abort the request."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(resolve)

        req = self._waitable(request_id, wake)
        if req is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), _bounded(req.deadline, timeout))
            if not fut.done():
                self._check_driver()
        return self._state_of(request_id, req)

    def _state_of(self, request_id: str, req: RequestRecord | None) -> TransferState:
        if req is not None:
            return req.lc.state
        found = self._find(request_id)
        return found.lc.state if isinstance(found, RequestRecord) else found.state

    def abort(self, request_id: str) -> bool:
        """Fail the request with ABORTED. False if it was already terminal."""
        found = self._find(request_id)
        return isinstance(found, RequestRecord) and found.lc.fail(FailureReason.ABORTED)


def _bounded(deadline: float, timeout: float | None) -> float:
    left = deadline - time.monotonic() + _WAIT_GRACE_S
    return max(0.0, left if timeout is None else min(timeout, left))
