"""Stateful and concurrent tests: actors race to end requests, workers leave by
every exit path, and after every step: an event on a terminal request changes
nothing and returns False, each request makes exactly one terminal transition
(the first cause wins), and every way out of a worker leaves its request
terminal.

The expected behaviour comes from ``Shadow``, a hand-written model of the
issue-2 contract, independent of ``lifecycle.DISPATCH``; the history is also
checked to be a path through DISPATCH.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from lifecycle import (
    DISPATCH,
    CompletionGuard,
    Event,
    FailureReason,
    InvalidTransition,
    Journal,
    RequestLifecycle,
    TransferState,
    guarded,
)

S = TransferState
R = FailureReason
TERMINAL_STATES = (S.DONE, S.FAILED)


class Shadow:
    """The contract of issue 2, written by hand: what the request must do."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.state = S.PENDING
        self.attempt = 0
        self.reason: FailureReason | None = None
        self.error: BaseException | None = None

    def outcome(self, event: Event) -> str:
        if self.state in TERMINAL_STATES:
            return "ignored"
        allowed = {
            Event.START: self.state is S.PENDING,
            Event.COMPLETE: self.state is S.TRANSFERRING,
            Event.RETRY: self.state is S.TRANSFERRING and self.attempt < self.max_attempts,
            Event.FAIL: True,
        }[event]
        return "ok" if allowed else "invalid"

    def apply(
        self,
        event: Event,
        reason: FailureReason | None = None,
        error: BaseException | None = None,
    ) -> str:
        outcome = self.outcome(event)
        if outcome == "ok":
            if event is Event.START:
                self.state = S.TRANSFERRING
                self.attempt += 1
            elif event is Event.COMPLETE:
                self.state = S.DONE
            elif event is Event.RETRY:
                self.state = S.PENDING
            else:
                self.state = S.FAILED
                self.reason = reason
                self.error = error
        return outcome


@dataclass(eq=False)
class Tracked:
    lc: RequestLifecycle
    shadow: Shadow
    callbacks: list[list[RequestLifecycle]] = field(default_factory=list)
    first_terminal: TransferState | None = None

    def add_callback(self) -> None:
        calls: list[RequestLifecycle] = []
        self.callbacks.append(calls)
        self.lc.add_done_callback(calls.append)


def snapshot(lc: RequestLifecycle) -> tuple[Any, ...]:
    return (lc.state, lc.attempt, lc.reason, lc.error, tuple(lc.history))


def fire(
    t: Tracked,
    event: Event,
    reason: FailureReason | None = None,
    error: BaseException | None = None,
) -> None:
    """Fire one event and check its return value against the shadow model."""
    lc = t.lc
    expected = t.shadow.outcome(event)
    before = snapshot(lc)
    try:
        if event is Event.FAIL:
            assert reason is not None
            got: object = lc.fail(reason, error)
        else:
            got = getattr(lc, event.value)()
    except InvalidTransition as e:
        assert expected == "invalid", (event, before, e)
        assert e.request_id == lc.request_id and e.state is before[0] and e.event is event
        assert lc.request_id in str(e) and before[0].name in str(e) and event.value in str(e)
        assert snapshot(lc) == before  # an invalid event changes nothing
        return
    if expected == "ok":
        assert got is True, (event, before)
    else:
        assert expected == "ignored", (event, before)
        assert got is False
        assert snapshot(lc) == before  # I1: absorbing
    t.shadow.apply(event, reason, error)
    if lc.state in TERMINAL_STATES and t.first_terminal is None:
        t.first_terminal = lc.state


# -- guarded workers -----------------------------------------------------------

# How a guarded worker leaves, per flavour of worker function.
SYNC_EXITS = ["return", "complete", "error", "reasoned", "keyboard", "sysexit"]
EXITS: dict[str, list[str]] = {
    "sync": SYNC_EXITS,
    "async": [*SYNC_EXITS, "cancel"],
    "gen": [*SYNC_EXITS, "close"],
    "agen": [*SYNC_EXITS, "cancel", "close"],
}
_PLAIN_STEP = st.sampled_from([Event.START, Event.COMPLETE, Event.RETRY]).map(lambda e: (e, None))
# Mostly start/complete/retry: a worker that fails its own request on every
# other step would leave the guard little to do.
STEP = st.one_of(
    _PLAIN_STEP,
    _PLAIN_STEP,
    _PLAIN_STEP,
    st.sampled_from(list(R)).map(lambda r: (Event.FAIL, r)),
)


class ReasonedError(Exception):
    def __init__(self, reason: FailureReason) -> None:
        super().__init__(reason.name)
        self.reason = reason


@dataclass
class Exit:
    """One planned exit: what the worker raises and what the guard must record."""

    kind: str
    reason: FailureReason  # what a non-terminal request must end with
    exc: BaseException | None  # what the worker raises (None: returns or is closed)
    seen: list[BaseException] = field(default_factory=list)  # caught inside the body

    def finish(self, t: Tracked) -> None:
        """The synchronous exits: return normally or raise the planned exception."""
        if self.kind == "complete":
            fire(t, Event.COMPLETE)
        if self.exc is not None:
            raise self.exc


def plan_exit(kind: str, reason: FailureReason) -> Exit:
    table: dict[str, tuple[FailureReason, BaseException | None]] = {
        "return": (R.WORKER_EXITED, None),
        "complete": (R.WORKER_EXITED, None),
        "error": (R.WORKER_CRASHED, RuntimeError("worker bug")),
        "reasoned": (reason, ReasonedError(reason)),
        "keyboard": (R.SHUTDOWN, KeyboardInterrupt()),
        "sysexit": (R.SHUTDOWN, SystemExit(2)),
        "cancel": (R.ABORTED, None),
        "close": (R.ABORTED, None),
    }
    expected, exc = table[kind]
    return Exit(kind, expected, exc)


class LifecycleMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.tracked: list[Tracked] = []
        self.loop = asyncio.new_event_loop()

    def teardown(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    @rule(target=requests, max_attempts=st.integers(1, 4), n_callbacks=st.integers(0, 2))
    def create(self, max_attempts: int, n_callbacks: int) -> Tracked:
        return self._new(max_attempts, n_callbacks)

    def _new(self, max_attempts: int, n_callbacks: int) -> Tracked:
        lc = RequestLifecycle(f"req-{len(self.tracked)}", max_attempts=max_attempts)
        t = Tracked(lc, Shadow(max_attempts))
        for _ in range(n_callbacks):
            t.add_callback()
        self.tracked.append(t)
        return t

    # -- actors ----------------------------------------------------------------

    @rule(t=requests, event=st.sampled_from([Event.START, Event.COMPLETE, Event.RETRY]))
    def worker_step(self, t: Tracked, event: Event) -> None:
        fire(t, event)

    @rule(t=requests, reason=st.sampled_from(list(R)), with_error=st.booleans())
    def worker_fails(self, t: Tracked, reason: FailureReason, with_error: bool) -> None:
        fire(t, Event.FAIL, reason, RuntimeError("engine -1") if with_error else None)

    @rule(t=requests)
    def watchdog(self, t: Tracked) -> None:
        fire(t, Event.FAIL, R.TIMEOUT, TimeoutError("deadline passed"))

    @rule(t=requests)
    def aborter(self, t: Tracked) -> None:
        fire(t, Event.FAIL, R.ABORTED)

    @rule(t=requests)
    def add_callback(self, t: Tracked) -> None:
        t.add_callback()
        if t.lc.is_terminal:
            assert t.callbacks[-1] == [t.lc]  # runs at once on a terminal request

    @rule(t=requests)
    def poll(self, t: Tracked) -> None:
        assert t.lc.wait(0) is t.shadow.state

    @rule(
        t=requests,
        flavor=st.sampled_from(sorted(EXITS)),
        decorate=st.booleans(),
        steps=st.lists(STEP, max_size=5),
        data=st.data(),
    )
    def guarded_worker(
        self,
        t: Tracked,
        flavor: str,
        decorate: bool,
        steps: list[tuple[Event, FailureReason | None]],
        data: st.DataObject,
    ) -> None:
        self._guarded(t, flavor, decorate, steps, data)

    @rule(
        target=requests,
        max_attempts=st.integers(1, 4),
        flavor=st.sampled_from(sorted(EXITS)),
        decorate=st.booleans(),
        steps=st.lists(STEP, max_size=5),
        data=st.data(),
    )
    def guarded_worker_on_a_new_request(
        self,
        max_attempts: int,
        flavor: str,
        decorate: bool,
        steps: list[tuple[Event, FailureReason | None]],
        data: st.DataObject,
    ) -> Tracked:
        # The usual case: a worker owns its request from the start, so the
        # request is often still live when the worker leaves.
        t = self._new(max_attempts, 1)
        self._guarded(t, flavor, decorate, steps, data)
        return t

    def _guarded(
        self,
        t: Tracked,
        flavor: str,
        decorate: bool,
        steps: list[tuple[Event, FailureReason | None]],
        data: st.DataObject,
    ) -> None:
        # The fault strikes at a drawn step: the worker runs the steps before it.
        fault_at = data.draw(st.integers(0, len(steps)), label="fault_at")
        kind = data.draw(st.sampled_from(EXITS[flavor]), label="exit")
        plan = plan_exit(kind, data.draw(st.sampled_from(list(R)), label="reason"))

        def run_steps() -> None:
            for event, reason in steps[:fault_at]:
                fire(t, event, reason, RuntimeError(f"step {event.value}") if reason else None)

        was_terminal = t.lc.is_terminal
        caught = getattr(self, f"_run_{flavor}")(t, plan, run_steps, decorate)
        if isinstance(caught, AssertionError):
            raise caught  # a check inside the worker failed: report it as is

        # The exception always propagates unchanged.
        if plan.exc is not None:
            assert caught is plan.exc
        elif kind == "cancel":
            assert isinstance(caught, asyncio.CancelledError)
        else:
            assert caught is None

        # I3: whatever the exit, the request is terminal now.
        assert t.lc.is_terminal
        if t.shadow.state not in TERMINAL_STATES:
            # The guard made the terminal transition with the exit's reason.
            assert t.lc.state is S.FAILED
            assert t.lc.reason is plan.reason
            if plan.exc is not None:
                assert t.lc.error is plan.exc
            elif kind == "cancel":
                assert isinstance(t.lc.error, asyncio.CancelledError)
                if plan.seen:
                    assert t.lc.error is plan.seen[0]
            elif kind == "close":
                assert isinstance(t.lc.error, GeneratorExit)
            else:
                assert t.lc.error is None
            t.shadow.apply(Event.FAIL, plan.reason, t.lc.error)
            t.first_terminal = S.FAILED
        else:
            # Terminal before the exit (completed or failed inside): unchanged.
            assert t.lc.state is t.shadow.state
            assert t.lc.reason is t.shadow.reason
        assert was_terminal <= t.lc.is_terminal

    # One runner per flavour; each returns what escaped the worker (or None).

    def _run_sync(
        self, t: Tracked, plan: Exit, run_steps: Callable[[], None], decorate: bool
    ) -> BaseException | None:
        def body(lc: RequestLifecycle) -> None:
            run_steps()
            plan.finish(t)

        def manual(lc: RequestLifecycle) -> None:
            with CompletionGuard(lc) as got:
                assert got is lc
                body(lc)

        worker = guarded(body) if decorate else manual
        try:
            worker(t.lc)
        except BaseException as e:
            return e
        return None

    def _run_async(
        self, t: Tracked, plan: Exit, run_steps: Callable[[], None], decorate: bool
    ) -> BaseException | None:
        reached: list[bool] = []

        async def body(lc: RequestLifecycle) -> None:
            run_steps()
            await asyncio.sleep(0)
            if plan.kind == "cancel":
                reached.append(True)
                try:
                    await asyncio.Event().wait()
                except BaseException as e:
                    plan.seen.append(e)
                    raise
            plan.finish(t)

        async def manual(lc: RequestLifecycle) -> None:
            async with CompletionGuard(lc):
                await body(lc)

        worker = guarded(body) if decorate else manual

        async def drive() -> BaseException | None:
            try:
                if plan.kind != "cancel":
                    await worker(t.lc)
                    return None
                task = asyncio.ensure_future(worker(t.lc))
                for _ in range(100):
                    if reached or task.done():
                        break
                    await asyncio.sleep(0)
                task.cancel()
                await task
            except BaseException as e:
                return e
            return None

        return self.loop.run_until_complete(drive())

    def _run_gen(
        self, t: Tracked, plan: Exit, run_steps: Callable[[], None], decorate: bool
    ) -> BaseException | None:
        def body(lc: RequestLifecycle) -> Generator[str, object, None]:
            run_steps()
            if plan.kind == "close":
                try:
                    yield "suspended"
                except BaseException as e:
                    plan.seen.append(e)
                    raise
            plan.finish(t)

        def manual(lc: RequestLifecycle) -> Generator[str, object, None]:
            with CompletionGuard(lc):
                yield from body(lc)

        worker = guarded(body) if decorate else manual
        gen = worker(t.lc)
        try:
            assert next(gen) == "suspended"
            gen.close()  # the consumer goes away mid-transfer
        except StopIteration:
            pass
        except BaseException as e:
            return e
        return None

    def _run_agen(
        self, t: Tracked, plan: Exit, run_steps: Callable[[], None], decorate: bool
    ) -> BaseException | None:
        reached: list[bool] = []

        async def body(lc: RequestLifecycle) -> AsyncGenerator[str, None]:
            run_steps()
            await asyncio.sleep(0)
            if plan.kind == "close":
                yield "suspended"
            elif plan.kind == "cancel":
                reached.append(True)
                try:
                    await asyncio.Event().wait()
                except BaseException as e:
                    plan.seen.append(e)
                    raise
            plan.finish(t)

        async def manual(lc: RequestLifecycle) -> AsyncGenerator[str, None]:
            async with CompletionGuard(lc):
                async for item in body(lc):
                    yield item

        worker = guarded(body) if decorate else manual

        async def drive() -> BaseException | None:
            agen = worker(t.lc)

            async def first() -> str:
                return await agen.__anext__()

            try:
                if plan.kind == "cancel":
                    task = asyncio.ensure_future(first())
                    for _ in range(100):
                        if reached or task.done():
                            break
                        await asyncio.sleep(0)
                    task.cancel()
                    await task
                else:
                    assert await first() == "suspended"
                    await agen.aclose()
            except StopAsyncIteration:
                pass
            except BaseException as e:
                return e
            finally:
                await agen.aclose()
            return None

        return self.loop.run_until_complete(drive())

    # -- invariants ------------------------------------------------------------

    @invariant()
    def matches_the_contract(self) -> None:
        for t in self.tracked:
            lc, sh = t.lc, t.shadow
            assert lc.state is sh.state
            assert lc.is_terminal is (sh.state in TERMINAL_STATES)
            assert lc.attempt == sh.attempt
            assert lc.reason is sh.reason
            assert lc.error is sh.error
            assert (lc.reason is not None) is (lc.state is S.FAILED)
            # One snapshot of all three, equal to the separate views.
            assert tuple(lc.outcome) == (sh.state, sh.reason, sh.error)

    @invariant()
    def terminal_is_forever(self) -> None:
        for t in self.tracked:
            if t.first_terminal is None:
                assert not t.lc.is_terminal
            else:
                assert t.lc.state is t.first_terminal

    @invariant()
    def attempts_never_exceed_the_maximum(self) -> None:
        for t in self.tracked:
            assert 0 <= t.lc.attempt <= t.lc.max_attempts

    @invariant()
    def history_is_a_path_through_the_table(self) -> None:
        for t in self.tracked:
            lc = t.lc
            hist = lc.history
            terminal_records = [r for r in hist if r.dest in TERMINAL_STATES]
            assert len(terminal_records) == (1 if lc.is_terminal else 0)
            expected_source = S.PENDING
            for rec in hist:
                assert rec.source is expected_source  # consecutive records chain
                assert (rec.source, rec.event) in DISPATCH
                assert DISPATCH[(rec.source, rec.event)][0] is rec.dest
                assert (rec.reason is not None) is (rec.event is Event.FAIL)
                expected_source = rec.dest
            assert expected_source is lc.state  # the path ends where the request is
            assert sum(r.event is Event.START for r in hist) == lc.attempt
            ats = [r.at for r in hist]
            assert ats == sorted(ats)
            if lc.is_terminal:
                assert hist[-1].dest is lc.state
                assert hist[-1].reason is lc.reason

    @invariant()
    def done_callbacks_fire_exactly_once_for_terminal_requests(self) -> None:
        for t in self.tracked:
            want = [t.lc] if t.lc.is_terminal else []
            for calls in t.callbacks:
                assert calls == want


LifecycleMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30)
TestLifecycleStateful = LifecycleMachine.TestCase


# -- a real threaded race ----------------------------------------------------------


class _Sink:
    """A thread-safe (list.append under the GIL) logger for a custom Journal."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def _log(self, event: str, **kw: Any) -> None:
        self.records.append((event, kw))

    debug = info = warning = _log


def _count(counter: Counter[str], key: str, _: RequestLifecycle) -> None:
    counter[key] += 1


ROLES = ("worker", "watchdog", "aborter", "peer", "late_complete", "late_fail", "waiter", "cb")
FAIL_ROLES = {"watchdog": R.TIMEOUT, "aborter": R.ABORTED, "peer": R.PEER_LOST}


def test_threaded_race_makes_exactly_one_terminal_transition() -> None:
    n = 300
    sinks = [_Sink() for _ in range(n)]
    lcs = [
        RequestLifecycle(f"race-{i}", max_attempts=1 + i % 3, journal=Journal(sinks[i]))
        for i in range(n)
    ]
    for i, lc in enumerate(lcs):
        if i % 2:
            lc.start()  # half start in TRANSFERRING, half race the worker's start
    callback_calls: list[Counter[str]] = [Counter() for _ in range(n)]
    for i, lc in enumerate(lcs):
        lc.add_done_callback(functools.partial(_count, callback_calls[i], "early"))
    errors = {role: [TimeoutError(f"{role}-{i}") for i in range(n)] for role in FAIL_ROLES}
    # results[i][role] = what that actor's call(s) returned
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    crashes: list[BaseException] = []
    barrier = threading.Barrier(len(ROLES))

    def actor(role: str) -> None:
        try:
            for i, lc in enumerate(lcs):
                barrier.wait(timeout=10)
                out: Any
                if role == "worker":
                    out = (lc.start() if lc.state is S.PENDING else None, lc.complete())
                elif role in FAIL_ROLES:
                    out = lc.fail(FAIL_ROLES[role], errors[role][i])
                elif role == "late_complete":
                    try:
                        out = lc.complete()
                    except InvalidTransition as e:
                        assert e.state is S.PENDING  # only invalid before the start
                        out = "invalid"
                elif role == "late_fail":
                    out = lc.fail(R.TRANSFER_ERROR)
                elif role == "waiter":
                    out = lc.wait(timeout=10)
                else:
                    lc.add_done_callback(functools.partial(_count, callback_calls[i], "racing"))
                    out = None
                results[i][role] = out
        except BaseException as e:
            crashes.append(e)
            barrier.abort()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=actor, args=(role,)) for role in ROLES]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        sys.setswitchinterval(old)
    assert crashes == [], crashes[:3]
    assert not any(th.is_alive() for th in threads)

    winners: Counter[str] = Counter()
    for i, lc in enumerate(lcs):
        res = results[i]
        assert lc.is_terminal
        terminal = [r for r in lc.history if r.dest in TERMINAL_STATES]
        assert len(terminal) == 1  # I2: exactly one terminal transition
        # Exactly one actor's call returned True for a terminal event.
        won = [role for role in FAIL_ROLES if res[role] is True]
        if res["worker"][1] is True:
            won.append("worker")
        if res["late_complete"] is True:
            won.append("late_complete")
        if res["late_fail"] is True:
            won.append("late_fail")
        assert len(won) == 1, (lc, res)
        winner = won[0]
        winners[winner] += 1
        # The first cause is kept and agrees with the history.
        if winner in ("worker", "late_complete"):
            assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)
            assert terminal[0].event is Event.COMPLETE
        else:
            reason = FAIL_ROLES.get(winner, R.TRANSFER_ERROR)
            assert (lc.state, lc.reason) == (S.FAILED, reason)
            assert lc.error is (errors[winner][i] if winner in FAIL_ROLES else None)
            assert (terminal[0].event, terminal[0].reason) == (Event.FAIL, reason)
        assert res["waiter"] is lc.state
        assert callback_calls[i] == Counter({"early": 1, "racing": 1})
        # The journal: one terminal record, and one ignored record per
        # call that returned False.
        recs = sinks[i].records
        live = [kw for _, kw in recs if not kw.get("ignored")]
        assert [kw["dest"] for kw in live].count(lc.state.name) == 1
        assert len(live) == len(lc.history)
        falses = sum(res[r] is False for r in (*FAIL_ROLES, "late_complete", "late_fail"))
        falses += sum(x is False for x in res["worker"])
        assert sum(1 for _, kw in recs if kw.get("ignored")) == falses
    assert sum(winners.values()) == n
    # The race is real: different actors won on different requests.
    assert len(winners) >= 3, winners
