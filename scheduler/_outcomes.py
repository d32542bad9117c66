"""What the Scheduler tells its callers: outcomes, waits, aborts and metrics.

A mixin of the facade, kept apart so that each module stays small: these
methods only read the request table and the core's counters (under their
locks) and never change a request except through its lifecycle (abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from lifecycle import FailureReason, RequestLifecycle, TransferState

from ._core import SchedulerCore
from ._drivers import CallbackRunner
from ._phase import LIVE, Phase
from ._records import Finished, MetricsSnapshot
from ._requests import Request, RequestTable, Tombstone
from .errors import DriverFailed, UnknownRequest

__all__ = ["Outcomes"]

_LIVE_STATES = (TransferState.PENDING, TransferState.TRANSFERRING)
# A waiter returns at the step that ends its request; this bounds how long it
# waits past the deadline for a driver that is late or gone.
_WAIT_GRACE_S = 1.0


class Outcomes:
    """poll/get/wait/wait_async/abort/metrics over the facade's state."""

    _core: SchedulerCore
    _table: RequestTable
    _callbacks: CallbackRunner
    _unpolled: deque[Finished]
    _unpolled_dropped: int
    _driver_error: BaseException | None

    def _check_driver(self) -> None:
        if self._driver_error is not None:
            raise DriverFailed("the scheduler's driver thread died") from self._driver_error

    # -- outcomes ----------------------------------------------------------------------

    def poll(self) -> list[Finished]:
        """Requests that became terminal since the last poll(); never blocks."""
        out: list[Finished] = []
        pop = self._unpolled.popleft
        with contextlib.suppress(IndexError):
            while True:
                out.append(pop())
        return out

    def _find(self, request_id: str) -> Request | Tombstone:
        found = self._table.find(request_id)
        if found is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        return found

    def get(self, request_id: str) -> RequestLifecycle:
        """The request's lifecycle; for a released one, while the caller still holds it."""
        found = self._find(request_id)
        if isinstance(found, Request):
            return found.lc
        lc = found.lifecycle()
        if lc is None:
            raise UnknownRequest(f"request {request_id!r} was released and forgotten")
        return lc

    def _waitable(self, request_id: str, wake: Callable[[], object]) -> Request | None:
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

    def _state_of(self, request_id: str, req: Request | None) -> TransferState:
        if req is not None:
            return req.lc.state
        found = self._find(request_id)
        return found.lc.state if isinstance(found, Request) else found.state

    def abort(self, request_id: str) -> bool:
        """Fail the request with ABORTED. False if it was already terminal."""
        found = self._find(request_id)
        return isinstance(found, Request) and found.lc.fail(FailureReason.ABORTED)

    # -- observation ---------------------------------------------------------------------

    def metrics(self) -> MetricsSnapshot:
        now = time.monotonic()
        core = self._core
        with core.lock:
            by_state: Counter[str] = Counter()
            oldest = 0.0
            releasing = 0
            for req in self._table.requests():
                if req.phase in LIVE:
                    by_state[req.lc.state.name] += 1
                    oldest = max(oldest, now - req.submitted)
                elif req.phase is Phase.RELEASING:
                    releasing += 1
            quarantined, qbytes = core.quarantine()
            return MetricsSnapshot(
                done=core.done,
                failed_by_reason=dict(core.failed),
                live_by_state={s.name: by_state.get(s.name, 0) for s in _LIVE_STATES},
                quarantined=quarantined,
                oldest_live_age_s=oldest,
                released=self._table.released,
                released_before_quiesce=core.checks.before_quiesce,
                double_releases=core.checks.double,
                peers_lost=self._table.peers.lost_count,
                bytes_done=core.bytes_done,
                quarantined_bytes=qbytes,
                releasing=releasing,
                unpolled=len(self._unpolled),
                unpolled_dropped=self._unpolled_dropped,
                callbacks_pending=self._callbacks.pending(),
                callbacks_stalled=self._callbacks.stalled,
                driver_alive=self._driver_error is None,
            )

    def live_requests(self) -> list[RequestLifecycle]:
        return [lc for lc, _, _ in self.live_entries()]

    def live_entries(self) -> list[tuple[RequestLifecycle, str, float]]:
        """(lifecycle, peer, submitted at on time.monotonic()) of each live request."""
        return [
            (r.lc, r.peer, r.submitted)
            for r in self._table.requests()
            if r.phase in LIVE and not r.lc.is_terminal
        ]

    def quarantined_entries(self) -> list[tuple[str, str, float, int, int]]:
        """(request id, peer, terminal at on time.monotonic(), bytes, ops not
        yet quiesced) of each quarantined request, oldest first."""
        with self._core.lock:
            reqs = self._core.quarantined()
            return [
                (
                    r.request_id,
                    r.peer,
                    r.submitted + (r.finished.latency_s if r.finished else 0.0),
                    r.plan.nbytes,
                    r.unquiesced,
                )
                for r in reqs
            ]


def _bounded(deadline: float, timeout: float | None) -> float:
    left = deadline - time.monotonic() + _WAIT_GRACE_S
    return max(0.0, left if timeout is None else min(timeout, left))
