"""RequestLifecycle: one request's position in the transition table.

Thread-safe and cheap: no per-request ``transitions.Machine`` (it costs
~100 us and ~9 KB); events dispatch through the plain dict ``DISPATCH``.
Nothing here does I/O except the journal call and the done-callbacks, which
run outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final, NamedTuple

import structlog

from ._journal import DEFAULT_JOURNAL, LOGGER_NAME, Journal, TransitionRecord
from ._table import DISPATCH, GUARDS, TERMINAL, Event, FailureReason, TransferState

__all__ = ["DoneCallback", "InvalidTransition", "Outcome", "RequestLifecycle"]

DoneCallback = Callable[["RequestLifecycle"], object]


class InvalidTransition(RuntimeError):
    """An event the table does not allow from a non-terminal state."""

    def __init__(
        self, request_id: str, state: TransferState, event: Event, detail: str = ""
    ) -> None:
        self.request_id: Final = request_id
        self.state: Final = state
        self.event: Final = event
        msg = f"request {request_id!r}: event {event.value!r} is not allowed in state {state.name}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class Outcome(NamedTuple):
    """Where a request stands, published as one immutable record.

    A reader takes the whole record in one attribute read, so it can never
    see FAILED without its reason and error (they used to be three stores).
    """

    state: TransferState
    reason: FailureReason | None = None  # not None exactly when state is FAILED
    error: BaseException | None = None  # only with FAILED: the winning fail()'s error


# Outcomes without a reason are the same every time: share them.
_PLAIN: dict[TransferState, Outcome] = {s: Outcome(s) for s in TransferState}

# Reading a member off an Enum class is a Python-level lookup (~150 ns on
# 3.11); the hot path reads these module constants instead.
_START, _COMPLETE, _RETRY, _FAIL = Event.START, Event.COMPLETE, Event.RETRY, Event.FAIL
_FAILED = TransferState.FAILED
_PENDING_OUTCOME = _PLAIN[TransferState.PENDING]
# TransitionRecord(...) runs a Python-level __new__; this builds the same
# tuple in C, once per transition.
_record: Callable[[tuple[object, ...]], TransitionRecord] = partial(tuple.__new__, TransitionRecord)


class RequestLifecycle:
    """PENDING -> TRANSFERRING -> DONE | FAILED, with bounded retries.

    Every event returns True when it changed the state. On a terminal request
    every event is a no-op that returns False (terminal is absorbing): late
    completions and duplicate failures are normal races.
    """

    __slots__ = (
        "__weakref__",
        "_attempt",
        "_callbacks",
        "_done",
        "_history",
        "_journal",
        "_lock",
        "_outcome",
        "_settled",
        "_settler",
        "max_attempts",
        "request_id",
    )

    request_id: str
    max_attempts: int  # >= 1; retry() is allowed only while _attempt < max_attempts
    _lock: threading.Lock  # guards every field below that an event mutates
    _outcome: Outcome  # replaced whole, never mutated; once terminal, never replaced
    _attempt: int  # number of start() calls; 0 <= _attempt <= max_attempts
    _history: list[TransitionRecord]  # a path through DISPATCH; exactly one terminal record
    _callbacks: list[DoneCallback] | None  # pending done-callbacks; None once they have run
    _settled: bool  # terminal AND its done-callbacks have run; wait() returns from here
    _settler: int | None  # thread running the done-callbacks: its own wait() must not block
    _done: threading.Event | None  # created lazily by a blocking wait(); set once settled
    _journal: Journal

    def __init__(
        self, request_id: str, *, max_attempts: int = 1, journal: Journal | None = None
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if type(max_attempts) is not int or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self.request_id = request_id
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._outcome = _PENDING_OUTCOME
        self._attempt = 0
        self._history = []
        self._callbacks = []
        self._settled = False
        self._settler = None
        self._done = None
        self._journal = journal if journal is not None else DEFAULT_JOURNAL

    # -- read-only views --------------------------------------------------

    @property
    def outcome(self) -> Outcome:
        """State, reason and error as one consistent snapshot."""
        return self._outcome

    @property
    def state(self) -> TransferState:
        return self._outcome.state

    @property
    def is_terminal(self) -> bool:
        return self._outcome.state in TERMINAL

    @property
    def reason(self) -> FailureReason | None:
        return self._outcome.reason

    @property
    def error(self) -> BaseException | None:
        return self._outcome.error

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def history(self) -> Sequence[TransitionRecord]:
        return tuple(self._history)

    def __repr__(self) -> str:
        state, reason, _ = self._outcome
        extra = f" reason={reason.name}" if reason is not None else ""
        return (
            f"<RequestLifecycle {self.request_id!r} {state.name} "
            f"attempt={self._attempt}/{self.max_attempts}{extra}>"
        )

    # -- events -----------------------------------------------------------

    def start(self) -> bool:
        return self._fire(_START, None, None)

    def complete(self) -> bool:
        return self._fire(_COMPLETE, None, None)

    def retry(self) -> bool:
        return self._fire(_RETRY, None, None)

    def fail(self, reason: FailureReason, error: BaseException | None = None) -> bool:
        if not isinstance(reason, FailureReason):
            raise TypeError(f"reason must be a FailureReason, got {reason!r}")
        return self._fire(_FAIL, reason, error)

    def _fire(
        self, event: Event, reason: FailureReason | None, error: BaseException | None
    ) -> bool:
        with self._lock:
            source = self._outcome.state
            ignored = source in TERMINAL
            callbacks: list[DoneCallback] | None = None
            if not ignored:
                try:
                    dest, guard = DISPATCH[(source, event)]
                except KeyError:
                    raise InvalidTransition(self.request_id, source, event) from None
                if guard is not None and not GUARDS[guard].allows(self._attempt, self.max_attempts):
                    raise InvalidTransition(
                        self.request_id,
                        source,
                        event,
                        f"guard {guard} ({GUARDS[guard].text}) is false: "
                        f"{self._attempt} of {self.max_attempts} attempts used",
                    )
                self._attempt += event is _START  # counts start() calls
                rec = _record((event, source, dest, time.monotonic(), reason, self._attempt))
                self._history.append(rec)
                if dest is _FAILED:
                    self._outcome = Outcome(dest, reason, error)  # one store: atomic
                else:
                    self._outcome = _PLAIN[dest]
                if dest in TERMINAL:
                    callbacks, self._callbacks = self._callbacks, None
            attempt = self._attempt
        if ignored:
            self._journal.ignored(self.request_id, event, source, attempt, reason)
            return False
        interrupt: BaseException | None = None
        try:
            self._journal.transition(self.request_id, rec)  # contains its own errors
        except BaseException as exc:  # Ctrl-C in a sink: settle first, then raise it
            interrupt = exc
        if callbacks is not None:
            interrupt = self._settle(callbacks, interrupt)
        if interrupt is not None:
            raise interrupt
        return True

    def _settle(
        self, callbacks: list[DoneCallback], interrupt: BaseException | None
    ) -> BaseException | None:
        """Run every done-callback exactly once, then release the waiters.

        Callbacks first, then waiters: a waiter that returns sees their
        effects (e.g. the scheduler's poll() already has the request). A
        BaseException from one callback does not skip the next: the first
        one (``interrupt`` if already set) is returned for the caller to
        raise once the request is settled; later ones are logged.
        """
        self._settler = threading.get_ident()
        for fn in callbacks:
            try:
                _run_callback(fn, self)  # logging its error may raise too (a failing sink)
            except BaseException as exc:
                if interrupt is None:
                    interrupt = exc
                else:
                    _log_callback_error(fn, self)
        with self._lock:
            self._settled = True
            done = self._done
        if done is not None:
            done.set()
        return interrupt

    def _fail_nowait(self, reason: FailureReason) -> None:
        """fail() for finalizers: never blocks this thread.

        The garbage collector runs finalizers wherever it runs, possibly in
        a thread that holds this request's lock up-stack, where a blocking
        fail() would deadlock. When the lock is busy, another thread waits.
        """
        if self._lock.acquire(blocking=False):
            self._lock.release()
            self.fail(reason)
        else:
            threading.Thread(
                target=self.fail, args=(reason,), name="kvguard-finalize", daemon=True
            ).start()

    # -- completion ---------------------------------------------------------

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(self)`` exactly once, after the terminal transition.

        Runs at once (in this thread) if the request is already terminal,
        otherwise in the thread that makes the terminal transition. An
        Exception it raises is logged; a BaseException (KeyboardInterrupt,
        SystemExit) reaches the thread that ran it, after the other
        callbacks have run and the request is settled.
        """
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until terminal or until ``timeout`` seconds; return the state.

        Returns only once the done-callbacks of the terminal transition have
        run, even to a waiter that arrives while they run.
        """
        if self._settled or self._settler == threading.get_ident():
            return self._outcome.state  # a done-callback waiting on its own request
        with self._lock:
            if self._settled:
                return self._outcome.state
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        done.wait(timeout)
        return self._outcome.state


def _log_callback_error(fn: DoneCallback, lc: RequestLifecycle) -> None:
    structlog.get_logger(LOGGER_NAME).exception(
        "done_callback_failed", request_id=lc.request_id, callback=repr(fn)
    )


def _run_callback(fn: DoneCallback, lc: RequestLifecycle) -> None:
    # One raising callback must not rob the others of their exactly-once call.
    try:
        fn(lc)
    except Exception:
        _log_callback_error(fn, lc)
