"""Journal: one structured record per transition, and per ignored late event.

The journal is a structlog logger. The library never configures structlog:
an embedding application decides where records go (JSON lines, console,
nowhere). The structlog ``event`` key is the lifecycle event itself, so a
record reads ``{"event": "complete", "request_id": ..., "source": ...}``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

import structlog

from ._table import Event, FailureReason, TransferState

__all__ = ["LOGGER_NAME", "Journal", "TransitionRecord"]

LOGGER_NAME = "kvguard.lifecycle"


class TransitionRecord(NamedTuple):
    event: Event
    source: TransferState
    dest: TransferState
    at: float  # time.monotonic() when the transition happened
    reason: FailureReason | None
    attempt: int


# Level per destination state: failures are what operators look for; the
# rest is high-volume and filtered out by any production configuration.
_LEVEL: dict[TransferState, str] = {
    TransferState.PENDING: "info",  # a retry: rare and worth seeing
    TransferState.TRANSFERRING: "debug",
    TransferState.DONE: "debug",
    TransferState.FAILED: "warning",
}

# Enum .name/.value are Python-level properties: look them up in C instead.
_NAME: dict[TransferState | FailureReason | None, str | None] = {
    None: None,
    **{m: m.name for m in TransferState},
    **{m: m.name for m in FailureReason},
}


class Journal:
    """Where transition records go. Share one per scheduler.

    A failing sink (full disk, broken pipe, a raising processor) must not
    break the state machine: the transition has happened, and raising from
    ``complete()`` or from the watchdog thread would strand the request. So
    errors are contained here, counted in ``errors``, and the first one is
    written to stderr, as ``logging.Handler.handleError`` does.
    """

    __slots__ = ("_lock", "_logger", "errors")

    errors: int  # records lost to a failing sink; only ever grows, under _lock
    _lock: threading.Lock  # makes "count, and warn if first" one step

    def __init__(self, logger: Any = None) -> None:
        # A structlog lazy proxy: it honours whatever configuration the
        # application installs later, including after this object exists.
        self._logger: Any = logger if logger is not None else structlog.get_logger(LOGGER_NAME)
        self.errors = 0
        self._lock = threading.Lock()

    def transition(self, request_id: str, rec: TransitionRecord) -> None:
        try:
            getattr(self._logger, _LEVEL[rec.dest])(
                rec.event.value,
                request_id=request_id,
                source=_NAME[rec.source],
                dest=_NAME[rec.dest],
                reason=_NAME[rec.reason],
                attempt=rec.attempt,
                ts=time.time(),
            )
        except Exception:
            self._lost(request_id)

    def ignored(
        self,
        request_id: str,
        event: Event,
        state: TransferState,
        attempt: int,
        reason: FailureReason | None,
    ) -> None:
        # A late completion or a duplicate failure on a terminal request: a
        # normal race, not an error, but worth a record for post-mortems.
        try:
            self._logger.debug(
                event.value,
                request_id=request_id,
                source=state.name,
                dest=state.name,
                reason=reason.name if reason is not None else None,
                attempt=attempt,
                ignored=True,
                ts=time.time(),
            )
        except Exception:
            self._lost(request_id)

    def _lost(self, request_id: str) -> None:
        # Read-after-increment without the lock let two racing losses both
        # read 2, and the only warning was never printed.
        with self._lock:
            self.errors += 1
            first = self.errors == 1
        if first:
            print(
                f"kvguard: journal record for {request_id!r} lost "
                f"(further failures are only counted in Journal.errors):",
                file=sys.stderr,
            )
            traceback.print_exc()  # to sys.stderr


DEFAULT_JOURNAL = Journal()
