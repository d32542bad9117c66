"""Unit tests for RequestLifecycle: every rule of the issue-2 contract.

The expected behaviour is written out by hand here (``EXPECTED``), not read
from ``lifecycle.DISPATCH``, so a wrong table cannot make these tests agree
with it.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from lifecycle import (
    REFERENCE_MACHINE,
    Event,
    FailureReason,
    InvalidTransition,
    Journal,
    RequestLifecycle,
    TransferState,
)

S = TransferState

# The contract, written by hand: (state, event) -> destination.
EXPECTED: dict[tuple[TransferState, Event], TransferState] = {
    (S.PENDING, Event.START): S.TRANSFERRING,
    (S.TRANSFERRING, Event.COMPLETE): S.DONE,
    (S.TRANSFERRING, Event.RETRY): S.PENDING,
    (S.PENDING, Event.FAIL): S.FAILED,
    (S.TRANSFERRING, Event.FAIL): S.FAILED,
}
NON_TERMINAL = (S.PENDING, S.TRANSFERRING)
TERMINAL_STATES = (S.DONE, S.FAILED)
# The timeout of a wait() that must not block: a wait that blocks sits all of
# it out, so "returned before HANG_S" tells the paths apart on any machine
# load (how fast wait() returns is `kvguard bench`'s).
HANG_S = 30.0
INVALID = [
    (state, event) for state in NON_TERMINAL for event in Event if (state, event) not in EXPECTED
]


def fire(lc: RequestLifecycle, event: Event, reason: FailureReason | None = None) -> bool:
    if event is Event.START:
        return lc.start()
    if event is Event.COMPLETE:
        return lc.complete()
    if event is Event.RETRY:
        return lc.retry()
    return lc.fail(reason or FailureReason.TRANSFER_ERROR)


def in_state(state: TransferState, request_id: str = "req-1", max_attempts: int = 2) -> Any:
    """A lifecycle driven to ``state`` through public events only."""
    lc = RequestLifecycle(request_id, max_attempts=max_attempts)
    if state is S.TRANSFERRING:
        lc.start()
    elif state is S.DONE:
        lc.start()
        lc.complete()
    elif state is S.FAILED:
        lc.start()
        lc.fail(FailureReason.PEER_LOST, ConnectionResetError("peer gone"))
    assert lc.state is state
    return lc


def snapshot(lc: RequestLifecycle) -> tuple[Any, ...]:
    return (lc.state, lc.is_terminal, lc.reason, lc.error, lc.attempt, tuple(lc.history))


# -- construction -------------------------------------------------------------


def test_initial_state() -> None:
    lc = RequestLifecycle("req-1")
    assert lc.request_id == "req-1"
    assert lc.state is S.PENDING
    assert lc.is_terminal is False
    assert lc.reason is None
    assert lc.error is None
    assert lc.attempt == 0
    assert tuple(lc.history) == ()
    assert lc.max_attempts == 1
    assert RequestLifecycle("r", max_attempts=4).max_attempts == 4


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"request_id": ""}, "request_id must be a non-empty str, got ''"),
        ({"request_id": None}, "request_id must be a non-empty str, got None"),
        ({"request_id": 7}, "request_id must be a non-empty str, got 7"),
        ({"request_id": "r", "max_attempts": 0}, "max_attempts must be an int >= 1, got 0"),
        ({"request_id": "r", "max_attempts": -3}, "max_attempts must be an int >= 1, got -3"),
        ({"request_id": "r", "max_attempts": True}, "max_attempts must be an int >= 1, got True"),
        ({"request_id": "r", "max_attempts": 2.0}, "max_attempts must be an int >= 1, got 2.0"),
        ({"request_id": "r", "max_attempts": "2"}, "max_attempts must be an int >= 1, got '2'"),
    ],
)
def test_constructor_rejects_invalid_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        RequestLifecycle(**kwargs)
    assert str(info.value) == fragment


def test_max_attempts_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        RequestLifecycle("r", 2)  # type: ignore[call-arg]


# -- valid events ---------------------------------------------------------------


@pytest.mark.parametrize(("source", "event"), sorted(EXPECTED, key=str))
def test_each_allowed_event_returns_true_and_moves(source: TransferState, event: Event) -> None:
    lc = in_state(source)
    before = len(lc.history)
    assert fire(lc, event) is True
    assert lc.state is EXPECTED[(source, event)]
    assert lc.is_terminal is (lc.state in TERMINAL_STATES)
    assert len(lc.history) == before + 1
    rec = lc.history[-1]
    assert (rec.event, rec.source, rec.dest) == (event, source, EXPECTED[(source, event)])


def test_full_happy_path() -> None:
    lc = RequestLifecycle("happy")
    assert (lc.start(), lc.state) == (True, S.TRANSFERRING)
    assert (lc.complete(), lc.state) == (True, S.DONE)
    assert lc.is_terminal
    assert lc.reason is None
    assert lc.error is None
    assert lc.attempt == 1


def test_fail_records_reason_and_error() -> None:
    err = TimeoutError("deadline")
    lc = RequestLifecycle("f")
    assert lc.fail(FailureReason.TIMEOUT, err) is True
    assert lc.state is S.FAILED
    assert lc.reason is FailureReason.TIMEOUT
    assert lc.error is err
    assert lc.attempt == 0  # fail is not an attempt


def test_fail_without_error_leaves_error_none() -> None:
    lc = in_state(S.TRANSFERRING)
    assert lc.fail(FailureReason.ABORTED) is True
    assert lc.reason is FailureReason.ABORTED
    assert lc.error is None


def test_fail_rejects_a_non_reason_and_changes_nothing() -> None:
    lc = in_state(S.TRANSFERRING)
    before = snapshot(lc)
    with pytest.raises(TypeError, match="FailureReason"):
        lc.fail("timeout")
    assert snapshot(lc) == before


# -- invalid events -------------------------------------------------------------


@pytest.mark.parametrize(("state", "event"), INVALID)
def test_invalid_event_raises_naming_request_state_and_event(
    state: TransferState, event: Event
) -> None:
    lc = in_state(state, request_id="req-42")
    before = snapshot(lc)
    with pytest.raises(InvalidTransition) as info:
        fire(lc, event)
    msg = str(info.value)
    assert "req-42" in msg
    assert state.name in msg
    assert repr(event.value) in msg
    assert info.value.request_id == "req-42"
    assert info.value.state is state
    assert info.value.event is event
    assert snapshot(lc) == before


def test_invalid_transition_is_a_runtime_error() -> None:
    # Callers that catch RuntimeError around a worker still see it.
    assert issubclass(InvalidTransition, RuntimeError)


def test_the_three_invalid_pairs_are_exactly_these() -> None:
    assert set(INVALID) == {
        (S.PENDING, Event.COMPLETE),
        (S.PENDING, Event.RETRY),
        (S.TRANSFERRING, Event.START),
    }


def test_retry_with_no_attempts_left_raises_and_changes_nothing() -> None:
    lc = RequestLifecycle("r1", max_attempts=1)
    lc.start()
    before = snapshot(lc)
    with pytest.raises(InvalidTransition) as info:
        lc.retry()
    msg = str(info.value)
    assert "r1" in msg and "TRANSFERRING" in msg and "'retry'" in msg
    assert msg == (
        "request 'r1': event 'retry' is not allowed in state TRANSFERRING "
        "(guard attempts_left (attempt < max_attempts) is false: 1 of 1 attempts used)"
    )
    assert (info.value.request_id, info.value.state, info.value.event) == (
        "r1",
        S.TRANSFERRING,
        Event.RETRY,
    )
    assert snapshot(lc) == before
    # The request is still usable: it can complete or fail normally.
    assert lc.complete() is True
    assert lc.state is S.DONE


def test_attempt_counts_starts_and_bounds_retries() -> None:
    lc = RequestLifecycle("r3", max_attempts=3)
    for n in (1, 2, 3):
        assert lc.start() is True
        assert lc.attempt == n
        if n < 3:
            assert lc.retry() is True
            assert lc.state is S.PENDING
            assert lc.attempt == n  # retry does not count as an attempt
    with pytest.raises(InvalidTransition, match="3 of 3"):
        lc.retry()
    assert lc.attempt == 3
    assert lc.state is S.TRANSFERRING
    lc.fail(FailureReason.TRANSFER_ERROR)
    assert lc.attempt == 3
    assert [r.attempt for r in lc.history] == [1, 1, 2, 2, 3, 3]


def test_attempt_is_never_above_max_attempts() -> None:
    for max_attempts in (1, 2, 4):
        lc = RequestLifecycle("r", max_attempts=max_attempts)
        while True:
            lc.start()
            assert lc.attempt <= max_attempts
            try:
                lc.retry()
            except InvalidTransition:
                break
        assert lc.attempt == max_attempts


# -- terminal states are absorbing (I1) ----------------------------------------------

LATE_EVENTS: list[tuple[Event, FailureReason | None]] = [
    (Event.START, None),
    (Event.COMPLETE, None),
    (Event.RETRY, None),
    *[(Event.FAIL, r) for r in FailureReason],
]


@pytest.mark.parametrize("terminal", TERMINAL_STATES)
@pytest.mark.parametrize(("event", "reason"), LATE_EVENTS, ids=str)
def test_terminal_is_absorbing(
    terminal: TransferState, event: Event, reason: FailureReason | None
) -> None:
    lc = in_state(terminal)
    calls: list[RequestLifecycle] = []
    lc.add_done_callback(calls.append)
    before = snapshot(lc)
    if event is Event.FAIL:
        assert reason is not None
        assert lc.fail(reason, RuntimeError("late")) is False
    else:
        assert fire(lc, event) is False
    assert snapshot(lc) == before
    assert calls == [lc]  # the late event did not run callbacks again


def test_every_event_on_terminal_returns_false_repeatedly() -> None:
    lc = in_state(S.DONE)
    for _ in range(3):
        assert lc.start() is False
        assert lc.complete() is False
        assert lc.retry() is False
        assert lc.fail(FailureReason.TIMEOUT) is False
    assert lc.state is S.DONE
    assert lc.reason is None
    assert len(lc.history) == 2


def test_first_cause_wins() -> None:
    first, second = TimeoutError("deadline"), ConnectionResetError("peer")
    lc = in_state(S.TRANSFERRING)
    assert lc.fail(FailureReason.TIMEOUT, first) is True
    assert lc.fail(FailureReason.PEER_LOST, second) is False
    assert lc.fail(FailureReason.ABORTED) is False
    assert lc.complete() is False
    assert lc.reason is FailureReason.TIMEOUT
    assert lc.error is first
    assert [r.dest for r in lc.history].count(S.FAILED) == 1


def test_fail_after_complete_keeps_done_without_reason() -> None:
    lc = in_state(S.DONE)
    assert lc.fail(FailureReason.TIMEOUT, TimeoutError()) is False
    assert lc.state is S.DONE
    assert lc.reason is None
    assert lc.error is None


# -- history -------------------------------------------------------------------


def test_history_records_every_transition_with_monotonic_time() -> None:
    t0 = time.monotonic()
    lc = RequestLifecycle("h", max_attempts=2)
    lc.start()
    lc.retry()
    lc.start()
    lc.fail(FailureReason.TRANSFER_ERROR)
    t1 = time.monotonic()
    hist = lc.history
    assert [(r.event, r.source, r.dest) for r in hist] == [
        (Event.START, S.PENDING, S.TRANSFERRING),
        (Event.RETRY, S.TRANSFERRING, S.PENDING),
        (Event.START, S.PENDING, S.TRANSFERRING),
        (Event.FAIL, S.TRANSFERRING, S.FAILED),
    ]
    ats = [r.at for r in hist]
    assert all(isinstance(a, float) for a in ats)
    assert ats == sorted(ats)
    assert t0 <= ats[0] and ats[-1] <= t1
    assert hist[-1].reason is FailureReason.TRANSFER_ERROR
    assert all(r.reason is None for r in hist[:-1])


def test_history_is_a_snapshot() -> None:
    lc = RequestLifecycle("h")
    before = lc.history
    lc.start()
    assert len(before) == 0
    assert len(lc.history) == 1
    with pytest.raises((TypeError, AttributeError)):
        lc.history.append(lc.history[0])  # type: ignore[attr-defined]


def test_ignored_and_invalid_events_leave_no_history() -> None:
    lc = RequestLifecycle("h")
    with pytest.raises(InvalidTransition):
        lc.complete()
    lc.start()
    lc.complete()
    lc.fail(FailureReason.TIMEOUT)
    lc.start()
    assert [r.event for r in lc.history] == [Event.START, Event.COMPLETE]


# -- wait ------------------------------------------------------------------------


def test_wait_returns_at_timeout_with_current_state() -> None:
    lc = in_state(S.TRANSFERRING)
    t0 = time.monotonic()
    assert lc.wait(0.05) is S.TRANSFERRING
    elapsed = time.monotonic() - t0
    assert 0.04 <= elapsed < 0.05 + HANG_S  # never before its timeout; a hang guard after
    assert RequestLifecycle("p").wait(0) is S.PENDING


def test_wait_on_terminal_returns_at_once() -> None:
    for state in TERMINAL_STATES:
        lc = in_state(state)
        t0 = time.monotonic()
        assert lc.wait() is state
        assert lc.wait(HANG_S) is state
        assert time.monotonic() - t0 < HANG_S


@pytest.mark.parametrize("finish", ["complete", "fail"])
def test_wait_returns_promptly_when_another_thread_terminates(finish: str) -> None:
    lc = in_state(S.TRANSFERRING)
    results: list[tuple[TransferState, float]] = []

    def waiter() -> None:
        t0 = time.monotonic()
        results.append((lc.wait(HANG_S), time.monotonic() - t0))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # let the waiters block
    assert results == []
    if finish == "complete":
        lc.complete()
    else:
        lc.fail(FailureReason.ABORTED)
    for t in threads:
        t.join(HANG_S + 5)
        assert not t.is_alive()
    expected = S.DONE if finish == "complete" else S.FAILED
    assert [state for state, _ in results] == [expected] * 4
    assert all(elapsed < HANG_S for _, elapsed in results)  # woken, not timed out


def test_wait_without_timeout_is_woken_by_terminal_transition() -> None:
    lc = RequestLifecycle("w")
    done = threading.Event()
    got: list[TransferState] = []

    def waiter() -> None:
        got.append(lc.wait())
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    time.sleep(0.02)
    lc.fail(FailureReason.SHUTDOWN)
    assert done.wait(5), "wait() was not woken by the terminal transition"
    assert got == [S.FAILED]


def test_wait_is_not_woken_by_a_retry() -> None:
    lc = RequestLifecycle("w", max_attempts=2)
    lc.start()
    got: list[TransferState] = []
    t = threading.Thread(target=lambda: got.append(lc.wait(0.3)))
    t.start()
    time.sleep(0.02)
    lc.retry()
    t.join(5)
    assert got == [S.PENDING]


# -- done callbacks ------------------------------------------------------------------


def test_done_callback_runs_once_after_terminal_transition() -> None:
    lc = RequestLifecycle("cb", max_attempts=2)
    seen: list[tuple[RequestLifecycle, TransferState, bool]] = []
    lc.add_done_callback(lambda x: seen.append((x, x.state, x.is_terminal)))
    lc.start()
    lc.retry()
    lc.start()
    assert seen == []
    lc.complete()
    assert seen == [(lc, S.DONE, True)]
    lc.fail(FailureReason.TIMEOUT)
    lc.complete()
    assert len(seen) == 1


def test_done_callback_added_after_terminal_runs_at_once() -> None:
    lc = in_state(S.FAILED)
    seen: list[RequestLifecycle] = []
    lc.add_done_callback(seen.append)
    assert seen == [lc]
    lc.fail(FailureReason.TIMEOUT)
    assert seen == [lc]


def test_every_done_callback_runs_even_if_one_raises() -> None:
    lc = in_state(S.TRANSFERRING)
    calls: list[str] = []

    def boom(_: RequestLifecycle) -> None:
        calls.append("boom")
        raise RuntimeError("callback bug")

    lc.add_done_callback(lambda _: calls.append("a"))
    lc.add_done_callback(boom)
    lc.add_done_callback(lambda _: calls.append("b"))
    with structlog.testing.capture_logs() as logs:
        assert lc.fail(FailureReason.PEER_LOST) is True  # the raise does not escape
    assert calls == ["a", "boom", "b"]
    assert lc.state is S.FAILED
    assert lc.reason is FailureReason.PEER_LOST
    failed = [e for e in logs if e["event"] == "done_callback_failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == lc.request_id
    assert failed[0]["callback"] == repr(boom)
    assert failed[0]["log_level"] == "error" and failed[0]["exc_info"] is True
    # A raising callback added after the fact does not escape either.
    lc.add_done_callback(boom)
    assert calls == ["a", "boom", "b", "boom"]


def test_done_callback_may_use_the_lifecycle() -> None:
    # Callbacks run outside the lock: they may read, wait, add callbacks, fire.
    lc = in_state(S.TRANSFERRING)
    seen: list[object] = []

    def cb(x: RequestLifecycle) -> None:
        seen.append(x.wait(1))
        seen.append(x.fail(FailureReason.TIMEOUT))
        x.add_done_callback(lambda y: seen.append("nested"))

    lc.add_done_callback(cb)
    lc.complete()
    assert seen == [S.DONE, False, "nested"]


def test_done_callbacks_fire_once_under_racing_terminators() -> None:
    for i in range(50):
        lc = in_state(S.TRANSFERRING, request_id=f"r{i}")
        counts: list[str] = []
        lc.add_done_callback(lambda _, counts=counts: counts.append("early"))
        barrier = threading.Barrier(4)
        actions: list[Callable[[], object]] = [
            lc.complete,
            functools.partial(lc.fail, FailureReason.TIMEOUT),
            functools.partial(lc.fail, FailureReason.ABORTED),
            functools.partial(lc.add_done_callback, lambda _, c=counts: c.append("racing")),
        ]

        def go(action: Callable[[], object], barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            action()

        threads = [threading.Thread(target=go, args=(a,)) for a in actions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert lc.is_terminal
        assert sorted(counts) == ["early", "racing"]  # each exactly once


# -- resources ---------------------------------------------------------------------


def test_requests_do_not_register_with_the_reference_machine() -> None:
    models_before = list(REFERENCE_MACHINE.models)
    lcs = [RequestLifecycle(f"m{i}") for i in range(100)]
    for lc in lcs:
        lc.start()
        lc.complete()
    assert list(REFERENCE_MACHINE.models) == models_before


@pytest.mark.parametrize("end", ["complete", "fail", "pending"])
def test_finished_requests_are_not_kept_alive(end: str) -> None:
    lc = RequestLifecycle("gc")
    lc.add_done_callback(lambda _: None)
    lc.wait(0)
    lc.start()
    if end == "complete":
        lc.complete()
    elif end == "fail":
        lc.fail(FailureReason.ABORTED, RuntimeError("x"))
    ref = weakref.ref(lc)
    del lc
    gc.collect()
    assert ref() is None


def test_repr_names_id_state_and_reason() -> None:
    lc = in_state(S.FAILED, request_id="rep")
    assert repr(lc) == "<RequestLifecycle 'rep' FAILED attempt=1/2 reason=PEER_LOST>"
    assert repr(in_state(S.TRANSFERRING, "t")) == "<RequestLifecycle 't' TRANSFERRING attempt=1/2>"
    assert repr(in_state(S.DONE, "d")) == "<RequestLifecycle 'd' DONE attempt=1/2>"


def test_invalid_transition_message_without_detail_is_exact() -> None:
    lc = RequestLifecycle("exact")
    with pytest.raises(InvalidTransition) as info:
        lc.complete()
    assert str(info.value) == "request 'exact': event 'complete' is not allowed in state PENDING"


def test_done_callback_errors_log_through_the_kvguard_logger() -> None:
    factory_args: list[tuple[object, ...]] = []
    old = structlog.get_config()

    def factory(*args: object) -> Any:
        factory_args.append(args)
        return structlog.testing.CapturingLogger()

    def boom(_: RequestLifecycle) -> None:
        raise RuntimeError("callback bug")

    lc = RequestLifecycle("logger", journal=Journal(structlog.testing.CapturingLogger()))
    lc.add_done_callback(boom)
    structlog.configure(logger_factory=factory, cache_logger_on_first_use=False)
    try:
        assert lc.fail(FailureReason.ABORTED) is True
    finally:
        structlog.configure(**old)
    assert factory_args == [("kvguard.lifecycle",)]


class _BrokenLogger:
    """A journal sink whose terminal records fail (a full disk, a bad processor)."""

    def debug(self, *args: object, **kw: object) -> None:
        pass

    info = debug

    def warning(self, *args: object, **kw: object) -> None:
        raise OSError("log disk full")


def test_a_failing_journal_does_not_strand_waiters_or_callbacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    journal = Journal(_BrokenLogger())
    lc = RequestLifecycle("broken-journal", journal=journal)
    lc.start()
    calls: list[RequestLifecycle] = []
    lc.add_done_callback(calls.append)
    got: list[TransferState] = []
    waiter = threading.Thread(target=lambda: got.append(lc.wait()), daemon=True)
    waiter.start()
    time.sleep(0.02)
    # The transition happened: a broken sink must not turn it into an
    # exception (from the watchdog thread that would stop deadlines, I4)...
    assert lc.fail(FailureReason.TIMEOUT) is True
    # ...and the loss is not hidden: counted, and the first one on stderr.
    assert journal.errors == 1
    assert "log disk full" in capsys.readouterr().err
    waiter.join(5)
    assert got == [S.FAILED]  # ...but the waiter is woken
    assert calls == [lc]  # ...and the callback ran exactly once
    assert (lc.state, lc.reason) == (S.FAILED, FailureReason.TIMEOUT)
    assert lc.fail(FailureReason.ABORTED) is False
    assert calls == [lc]


def test_wait_returns_only_after_the_done_callbacks_ran() -> None:
    lc = RequestLifecycle("settle")
    in_callback = threading.Event()
    effects: list[str] = []

    def slow(_lc: RequestLifecycle) -> None:
        in_callback.set()
        time.sleep(0.2)
        effects.append("callback")

    lc.add_done_callback(slow)
    ender = threading.Thread(target=lambda: lc.fail(FailureReason.ABORTED), daemon=True)
    ender.start()
    assert in_callback.wait(5)
    # The state is already terminal, but the callback has not finished: a
    # waiter arriving now must not return before it has.
    assert lc.is_terminal
    assert lc.wait(5) is S.FAILED
    assert effects == ["callback"]
    ender.join(5)


def test_a_done_callback_may_wait_on_its_own_request() -> None:
    lc = RequestLifecycle("reentrant")
    seen: list[TransferState] = []
    lc.add_done_callback(lambda x: seen.append(x.wait(HANG_S)))  # blocked: all of HANG_S
    t0 = time.monotonic()
    assert lc.fail(FailureReason.ABORTED) is True
    assert seen == [S.FAILED]
    assert time.monotonic() - t0 < HANG_S


# -- issue 10 item 6: edge cases found in review ------------------------------------------


class _InterruptedJournal(Journal):
    """A sink interrupted (Ctrl-C, SystemExit) while writing the terminal record."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(_BrokenLogger())
        self.exc = exc

    def transition(self, request_id: str, rec: Any) -> None:
        if rec.dest in (S.DONE, S.FAILED):
            raise self.exc


@pytest.mark.parametrize("end", ["complete", "fail"])
def test_a_base_exception_in_the_journal_still_settles_then_propagates(end: str) -> None:
    # 6a: the BaseException used to skip the callbacks and never settle, so
    # every later wait() blocked forever.
    interrupt = KeyboardInterrupt("sink interrupted")
    lc = RequestLifecycle("j-base", journal=_InterruptedJournal(interrupt))
    lc.start()
    calls: list[RequestLifecycle] = []
    lc.add_done_callback(calls.append)
    err = TimeoutError("deadline")
    with pytest.raises(KeyboardInterrupt) as info:
        lc.complete() if end == "complete" else lc.fail(FailureReason.TIMEOUT, err)
    assert info.value is interrupt  # never swallowed, never wrapped
    assert calls == [lc]  # the callbacks ran, exactly once
    t0 = time.monotonic()
    expected = S.DONE if end == "complete" else S.FAILED
    assert lc.wait(HANG_S) is expected
    assert time.monotonic() - t0 < HANG_S  # settled: no waiter blocks
    if end == "complete":
        assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)
    else:
        assert (lc.state, lc.reason, lc.error) == (S.FAILED, FailureReason.TIMEOUT, err)
    assert lc.fail(FailureReason.ABORTED) is False  # terminal, absorbing
    assert calls == [lc]


def test_a_base_exception_in_a_done_callback_runs_the_rest_then_propagates() -> None:
    # 6b: every callback runs exactly once; the first BaseException is
    # re-raised to the thread that made the terminal transition once the
    # request is settled; later ones are logged, not lost.
    lc = in_state(S.TRANSFERRING)
    calls: list[str] = []
    first = KeyboardInterrupt("first")
    second = SystemExit(3)

    def raiser(name: str, exc: BaseException) -> Callable[[RequestLifecycle], None]:
        def cb(_: RequestLifecycle) -> None:
            calls.append(name)
            raise exc

        return cb

    lc.add_done_callback(lambda _: calls.append("a"))
    lc.add_done_callback(raiser("interrupt", first))
    lc.add_done_callback(lambda _: calls.append("b"))
    exit_cb = raiser("exit", second)
    bug_cb = raiser("bug", RuntimeError("callback bug"))
    lc.add_done_callback(exit_cb)
    lc.add_done_callback(bug_cb)
    lc.add_done_callback(lambda _: calls.append("c"))
    with structlog.testing.capture_logs() as logs, pytest.raises(KeyboardInterrupt) as info:
        lc.fail(FailureReason.PEER_LOST)
    assert info.value is first
    assert calls == ["a", "interrupt", "b", "exit", "bug", "c"]
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, FailureReason.PEER_LOST, None)
    t0 = time.monotonic()
    assert lc.wait(HANG_S) is S.FAILED
    assert time.monotonic() - t0 < HANG_S  # settled: no waiter blocks
    failed = [e for e in logs if e["event"] == "done_callback_failed"]
    assert [e["request_id"] for e in failed] == [lc.request_id] * 2  # SystemExit and the bug
    assert [e["callback"] for e in failed] == [repr(exit_cb), repr(bug_cb)]
    assert all(e["exc_info"] is True for e in failed)
    # The one callback added after the fact: its BaseException is its caller's.
    with pytest.raises(KeyboardInterrupt):
        lc.add_done_callback(raiser("late", first))
    assert calls[-1] == "late"


def _views(lc: RequestLifecycle) -> tuple[Any, ...]:
    return (lc.state, lc.reason, lc.error)


def _on_every_line(module_file: str, check: Callable[[], None]) -> Any:
    """A tracer that runs ``check`` at every line of ``module_file``: what
    another thread could observe at each point where the GIL can switch."""

    def local(frame: Any, event: str, arg: object) -> Any:
        if event in ("line", "return"):
            check()
        return local

    def tracer(frame: Any, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == module_file else None

    return tracer


def test_state_reason_and_error_publish_atomically() -> None:
    # 6c: a reader never sees FAILED without its reason and error, nor a
    # reason or error on a request that is not FAILED.
    import lifecycle._lifecycle as mod

    lc = in_state(S.TRANSFERRING)
    err = ConnectionResetError("peer gone")
    seen: list[tuple[Any, ...]] = []

    def check() -> None:
        views = _views(lc)
        if views[0] is S.FAILED and views[1:] != (FailureReason.PEER_LOST, err):
            seen.append(views)
        if views[0] is not S.FAILED and views[1:] != (None, None):
            seen.append(views)
        outcome = lc.outcome
        if (outcome.state is S.FAILED) != (outcome.reason is not None):
            seen.append(tuple(outcome))

    old = sys.gettrace()
    sys.settrace(_on_every_line(mod.__file__, check))
    try:
        assert lc.fail(FailureReason.PEER_LOST, err) is True
    finally:
        sys.settrace(old)
    assert seen == []
    assert tuple(lc.outcome) == (S.FAILED, FailureReason.PEER_LOST, err)
    assert _views(lc) == (S.FAILED, FailureReason.PEER_LOST, err)


def test_a_failing_sink_for_a_callback_error_still_settles_the_request() -> None:
    # A done-callback raises, and logging that error raises too (a broken
    # pipe, a bad processor): the next callback still runs, the request is
    # settled, and wait() returns at once instead of blocking forever.
    old = structlog.get_config()

    def refuse(_logger: object, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if event_dict.get("event") == "done_callback_failed":
            raise BrokenPipeError("log pipe closed")
        return event_dict

    ran: list[str] = []

    def boom(_: RequestLifecycle) -> None:
        ran.append("boom")
        raise ValueError("callback bug")

    lc = RequestLifecycle("sink-fails", journal=Journal(structlog.testing.CapturingLogger()))
    lc.add_done_callback(boom)
    lc.add_done_callback(lambda _: ran.append("second"))
    structlog.configure(processors=[refuse], cache_logger_on_first_use=False)
    try:
        lc.start()
        with pytest.raises(BrokenPipeError, match="log pipe closed"):
            lc.complete()  # the first BaseException reaches the caller, once settled
    finally:
        structlog.configure(**old)
    assert ran == ["boom", "second"]
    t0 = time.monotonic()
    assert lc.wait(HANG_S) is S.DONE
    assert time.monotonic() - t0 < HANG_S  # settled: no waiter blocks
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)


def test_a_late_raising_done_callback_is_logged_by_name() -> None:
    # Added after the terminal transition, the callback runs at once; what it
    # raises is logged, naming the callback and the request, not raised.
    lc = in_state(S.DONE)

    def late_bug(_: RequestLifecycle) -> None:
        raise RuntimeError("late bug")

    with structlog.testing.capture_logs() as logs:
        lc.add_done_callback(late_bug)
    assert [(r["event"], r["request_id"], r["callback"]) for r in logs] == [
        ("done_callback_failed", lc.request_id, repr(late_bug))
    ]
