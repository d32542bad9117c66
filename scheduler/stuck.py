"""Stuck-request inspector: which live requests are older than they should be.

Deadlines bound every request, so "stuck" here means "live for longer
than an operator expects", well before the deadline fails it: a frozen
peer, a hung engine call, a starved worker pool. A terminal request whose
blocks an engine call may still touch stays *quarantined* (not released)
until the engine lets go; those older than the threshold are reported too
(``quarantined_requests``). Two ways to use it:

    for s in stuck_requests(scheduler, older_than_s=2.0): ...   # ad hoc

    with StuckInspector(scheduler, older_than_s=2.0):   # a background thread
        ...                                              # logs `stuck_requests`

or call ``inspector.check()`` from your own loop (``kvguard run`` does). The
warning goes to structlog (logger ``kvguard.scheduler`` unless you pass one)
at most once per ``warn_every_s``, however many checks find stuck requests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog

from lifecycle import TransferState

from ._scheduler import Scheduler

__all__ = [
    "QuarantinedRequest",
    "StuckInspector",
    "StuckRequest",
    "quarantined_requests",
    "stuck_requests",
]

# How many stuck ids one warning names; the count covers the rest.
_IDS_PER_WARNING = 10


class StuckRequest(NamedTuple):
    request_id: str
    state: TransferState  # PENDING (queued or backing off) or TRANSFERRING
    age_s: float  # since submit()
    attempt: int  # start() calls so far
    peer: str


class QuarantinedRequest(NamedTuple):
    """Terminal, but an engine call may still touch its blocks (not released)."""

    request_id: str
    peer: str
    quarantined_s: float  # since it became terminal
    nbytes: int
    ops_running: int  # ops not yet quiesced


def quarantined_requests(
    scheduler: Scheduler, older_than_s: float = 0.0, *, now: float | None = None
) -> list[QuarantinedRequest]:
    """Requests quarantined for more than ``older_than_s``, oldest first.

    A frozen peer keeps its requests' blocks here until the engine reports
    the end of every entry; this is where an operator sees them.
    """
    now = time.monotonic() if now is None else now
    out = [
        QuarantinedRequest(rid, peer, now - since, nbytes, ops)
        for rid, peer, since, nbytes, ops in scheduler.quarantined_entries()
        if now - since > older_than_s
    ]
    out.sort(key=lambda q: q.quarantined_s, reverse=True)
    return out


def stuck_requests(
    scheduler: Scheduler, older_than_s: float, *, now: float | None = None
) -> list[StuckRequest]:
    """Live requests submitted more than ``older_than_s`` ago, oldest first."""
    now = time.monotonic() if now is None else now
    out = [
        StuckRequest(lc.request_id, lc.state, now - submitted, lc.attempt, peer)
        for lc, peer, submitted in scheduler.live_entries()
        # A request can turn terminal between the snapshot and here.
        if now - submitted > older_than_s and not lc.is_terminal
    ]
    out.sort(key=lambda s: s.age_s, reverse=True)
    return out


class StuckInspector:
    """Finds stuck requests and warns about them, rate-limited."""

    def __init__(
        self,
        scheduler: Scheduler,
        older_than_s: float,
        *,
        warn_every_s: float = 10.0,
        logger: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not older_than_s > 0 or not warn_every_s >= 0:
            raise ValueError("older_than_s must be > 0 and warn_every_s >= 0")
        self.scheduler = scheduler
        self.older_than_s = older_than_s
        self.warn_every_s = warn_every_s
        self._log: Any = logger if logger is not None else structlog.get_logger("kvguard.scheduler")
        self._clock = clock
        self._lock = threading.Lock()  # guards the two fields below
        self._last_warning: float | None = None  # clock() of the last warning
        self._suppressed = 0  # checks that found stuck requests since that warning
        # What the last check found quarantined longer than older_than_s.
        self.last_quarantined: list[QuarantinedRequest] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[StuckRequest]:
        """List stuck requests now; warn if any and the last warning is old enough."""
        now = self._clock()
        stuck = stuck_requests(self.scheduler, self.older_than_s, now=now)
        held = quarantined_requests(self.scheduler, self.older_than_s, now=now)
        self.last_quarantined = held
        if not stuck and not held:
            return stuck
        with self._lock:
            due = self._last_warning is None or now - self._last_warning >= self.warn_every_s
            if not due:
                self._suppressed += 1
                return stuck
            suppressed, self._suppressed, self._last_warning = self._suppressed, 0, now
        detail: dict[str, Any] = {}
        if stuck:
            oldest = stuck[0]
            detail.update(
                oldest=oldest.request_id,
                oldest_age_s=round(oldest.age_s, 3),
                oldest_state=oldest.state.name,
                oldest_attempt=oldest.attempt,
                oldest_peer=oldest.peer,
                request_ids=[s.request_id for s in stuck[:_IDS_PER_WARNING]],
            )
        if held:
            detail.update(
                quarantined=len(held),
                quarantined_bytes=sum(q.nbytes for q in held),
                oldest_quarantined=held[0].request_id,
                oldest_quarantined_s=round(held[0].quarantined_s, 3),
                quarantined_ids=[q.request_id for q in held[:_IDS_PER_WARNING]],
            )
        self._log.warning(
            "stuck_requests",
            count=len(stuck),
            older_than_s=self.older_than_s,
            checks_since_last_warning=suppressed,
            **detail,
        )
        return stuck

    # -- background thread ------------------------------------------------------

    def start(self, interval_s: float | None = None) -> None:
        """Check every ``interval_s`` (default: half the threshold, at most 1 s)."""
        if self._thread is not None:
            raise RuntimeError("the inspector is already running")
        every = interval_s if interval_s is not None else min(1.0, self.older_than_s / 2)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(every,), name="kvguard-stuck", daemon=True
        )
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.check()
            except Exception:
                # An inspector must never take the process down with it.
                self._log.exception("stuck_inspector_failed")

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5.0)

    def __enter__(self) -> StuckInspector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
