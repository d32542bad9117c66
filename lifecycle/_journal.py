"""Journal: one structured record per transition, and per ignored late event.

The journal is a structlog logger. The library never configures structlog:
an embedding application decides where records go (JSON lines, console,
nowhere). The structlog ``event`` key is the lifecycle event itself, so a
record reads ``{"event": "complete", "request_id": ..., "source": ...}``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple, cast

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

_LEVEL_NO = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_UNRESOLVED: Any = object()
_PROXY = type(structlog.get_logger())  # the lazy proxy get_logger() returns
# make_filtering_bound_logger's classes, one per level: their filtering is
# fixed when the class is made (a stdlib-backed logger's is not).
_FIXED_LEVEL = frozenset(
    structlog.make_filtering_bound_logger(n)
    for n in (
        logging.NOTSET,
        logging.DEBUG,
        logging.INFO,
        logging.WARNING,
        logging.ERROR,
        logging.CRITICAL,
    )
)

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

    __slots__ = ("_emitters", "_lock", "_logger", "errors")

    errors: int  # records lost to a failing sink; only ever grows, under _lock
    _lock: threading.Lock  # makes "count, and warn if first" one step
    # level -> the logger's method, or None where the logger drops the level
    # for good. Filled only once structlog has cached the assembled logger of
    # a lazy proxy (its own cache_logger_on_first_use): from then on the proxy
    # itself would answer the same, so this only skips its per-call cost --
    # and, under a fixed-level filtering logger, building records that are
    # thrown away.
    _emitters: dict[str, Callable[..., Any] | None]

    def __init__(self, logger: Any = None) -> None:
        # A structlog lazy proxy: it honours whatever configuration the
        # application installs later, including after this object exists.
        self._logger: Any = logger if logger is not None else structlog.get_logger(LOGGER_NAME)
        self.errors = 0
        self._lock = threading.Lock()
        self._emitters = {}

    def _emitter(self, level: str) -> Callable[..., Any] | None:
        emit: Callable[..., Any] | None = self._emitters.get(level, _UNRESOLVED)
        if emit is not _UNRESOLVED:
            return emit
        logger = self._logger
        if type(logger) is not _PROXY or "bind" not in vars(logger):
            return cast(Callable[..., Any], getattr(logger, level))
        bound = logger.bind()  # structlog's cached logger: the same object every time
        if type(bound) in _FIXED_LEVEL and not bound.is_enabled_for(_LEVEL_NO[level]):
            emit = None  # its level is part of its class: it can never change
        else:
            emit = getattr(bound, level)  # e.g. stdlib's: asks logging on every call
        self._emitters[level] = emit
        return emit

    def transition(self, request_id: str, rec: TransitionRecord) -> None:
        try:
            emit = self._emitter(_LEVEL[rec.dest])
            if emit is None:
                return
            emit(
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
            emit = self._emitter("debug")
            if emit is None:
                return
            emit(
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
