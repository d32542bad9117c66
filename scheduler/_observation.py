"""What a Scheduler shows of itself: a metrics snapshot, and its live and
quarantined requests (what ``metrics`` exports and ``stuck`` inspects).

``Scheduler`` is an ``Observation``. ``metrics()`` and
``quarantined_entries()`` read under the core's lock, so they never see a
half-applied step; the requests are listed under the request table's.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from lifecycle import RequestLifecycle, TransferState

from ._core import SchedulerCore
from ._drivers import CallbackRunner
from ._phase import LIVE, Phase
from ._records import Finished, MetricsSnapshot
from ._requests import RequestTable

__all__ = ["Observation"]

_LIVE_STATES = (TransferState.PENDING, TransferState.TRANSFERRING)


class Observation:
    """The observation part of ``Scheduler``'s API: metrics, live and quarantined requests."""

    # The Scheduler's own, set by Scheduler.__init__.
    _core: SchedulerCore
    _table: RequestTable
    _callbacks: CallbackRunner
    _unpolled: deque[Finished]
    _unpolled_dropped: int
    _driver_error: BaseException | None

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
