"""CompletionGuard and ``guarded``: every worker exit path ends terminal (I3).

Each test also checks that the exception leaving the guard is the very
object the worker raised: the guard records, it never swallows or wraps.
"""

from __future__ import annotations

import asyncio
import builtins
import collections.abc
import gc
import sys
import threading
import warnings
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, NoReturn

import pytest

from lifecycle import (
    CompletionGuard,
    Event,
    FailureReason,
    InvalidTransition,
    RequestLifecycle,
    TransferState,
    exit_reason,
    guarded,
)

S = TransferState
R = FailureReason


class ReasonedError(Exception):
    def __init__(self, reason: object) -> None:
        super().__init__(f"failed: {reason}")
        self.reason = reason


class MyInterrupt(KeyboardInterrupt):
    pass


def started(request_id: str = "g", max_attempts: int = 1) -> RequestLifecycle:
    lc = RequestLifecycle(request_id, max_attempts=max_attempts)
    lc.start()
    return lc


def run_guarded(lc: RequestLifecycle, exc: BaseException | None) -> BaseException | None:
    """Leave a ``with CompletionGuard`` block by raising ``exc`` (or normally)."""
    try:
        with CompletionGuard(lc) as got:
            assert got is lc
            if exc is not None:
                raise exc
    except BaseException as caught:
        return caught
    return None


# (exception factory, expected reason) for every raising exit path.
RAISING_EXITS: list[tuple[Callable[[], BaseException], FailureReason]] = [
    (lambda: RuntimeError("boom"), R.WORKER_CRASHED),
    (lambda: ValueError("bad"), R.WORKER_CRASHED),
    (lambda: InvalidTransition("g", S.PENDING, Event.COMPLETE), R.WORKER_CRASHED),
    (lambda: ReasonedError("timeout"), R.WORKER_CRASHED),  # reason that is no FailureReason
    (lambda: asyncio.CancelledError(), R.ABORTED),
    (lambda: GeneratorExit(), R.ABORTED),
    (lambda: KeyboardInterrupt(), R.SHUTDOWN),
    (lambda: MyInterrupt(), R.SHUTDOWN),
    (lambda: SystemExit(3), R.SHUTDOWN),
    *[(lambda r=r: ReasonedError(r), r) for r in R],
    # An explicit reason wins over the exception's type.
    (lambda: _with_reason(asyncio.CancelledError(), R.TIMEOUT), R.TIMEOUT),
    (lambda: _with_reason(KeyboardInterrupt(), R.PEER_LOST), R.PEER_LOST),
]


def _with_reason(exc: BaseException, reason: FailureReason) -> BaseException:
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def _exit_id(case: tuple[Callable[[], BaseException], FailureReason]) -> str:
    exc = case[0]()
    return f"{type(exc).__name__}-{getattr(exc, 'reason', '')}->{case[1].name}"


# -- with: every exit path -----------------------------------------------------


@pytest.mark.parametrize("state", [S.PENDING, S.TRANSFERRING])
def test_normal_exit_without_completing_is_worker_exited(state: TransferState) -> None:
    lc = RequestLifecycle("g")
    if state is S.TRANSFERRING:
        lc.start()
    assert run_guarded(lc, None) is None
    assert lc.state is S.FAILED
    assert lc.reason is R.WORKER_EXITED
    assert lc.error is None
    rec = lc.history[-1]
    assert (rec.event, rec.source, rec.dest) == (Event.FAIL, state, S.FAILED)


@pytest.mark.parametrize("case", RAISING_EXITS, ids=_exit_id)
@pytest.mark.parametrize("state", [S.PENDING, S.TRANSFERRING])
def test_raising_exit_fails_with_reason_and_propagates_same_object(
    case: tuple[Callable[[], BaseException], FailureReason], state: TransferState
) -> None:
    make, expected = case
    lc = RequestLifecycle("g")
    if state is S.TRANSFERRING:
        lc.start()
    exc = make()
    args_before = exc.args
    caught = run_guarded(lc, exc)
    assert caught is exc
    assert type(caught) is type(exc) and caught.args == args_before
    assert caught.__cause__ is None and caught.__context__ is None
    assert lc.state is S.FAILED
    assert lc.reason is expected
    assert lc.error is exc
    assert exit_reason(exc) is expected


def test_exit_reason_of_no_exception_is_worker_exited() -> None:
    assert exit_reason(None) is R.WORKER_EXITED


@pytest.mark.parametrize("exc", [None, RuntimeError("late"), KeyboardInterrupt(), GeneratorExit()])
def test_completed_request_stays_done(exc: BaseException | None) -> None:
    lc = started()
    try:
        with CompletionGuard(lc):
            lc.complete()
            if exc is not None:
                raise exc
    except BaseException as caught:
        assert caught is exc
    else:
        assert exc is None
    assert lc.state is S.DONE
    assert lc.reason is None
    assert lc.error is None
    assert [r.event for r in lc.history] == [Event.START, Event.COMPLETE]


def test_failure_inside_the_block_is_the_first_cause() -> None:
    lc = started()
    inner = ConnectionResetError("peer")
    outer = RuntimeError("then the worker crashed")
    caught = None
    try:
        with CompletionGuard(lc):
            lc.fail(R.PEER_LOST, inner)
            raise outer
    except RuntimeError as e:
        caught = e
    assert caught is outer
    assert lc.reason is R.PEER_LOST
    assert lc.error is inner


def test_watchdog_failure_during_the_block_wins() -> None:
    lc = started()
    with CompletionGuard(lc):
        lc.fail(R.TIMEOUT)  # the watchdog, from the worker's point of view
    assert lc.reason is R.TIMEOUT
    assert len([r for r in lc.history if r.dest is S.FAILED]) == 1


def test_retried_to_pending_request_exiting_the_guard_is_failed() -> None:
    lc = RequestLifecycle("g", max_attempts=3)
    with CompletionGuard(lc):
        lc.start()
        lc.retry()
    assert lc.state is S.FAILED
    assert lc.reason is R.WORKER_EXITED
    rec = lc.history[-1]
    assert (rec.event, rec.source, rec.dest) == (Event.FAIL, S.PENDING, S.FAILED)


def test_retry_loop_inside_one_guarded_scope() -> None:
    lc = RequestLifecycle("g", max_attempts=3)
    tries = 0
    with CompletionGuard(lc):
        while True:
            lc.start()
            tries += 1
            if tries < 3:
                lc.retry()
                continue
            lc.complete()
            break
    assert lc.state is S.DONE
    assert lc.attempt == 3


def test_invalid_event_inside_block_crashes_the_worker() -> None:
    lc = RequestLifecycle("g")
    caught: InvalidTransition | None = None
    try:
        with CompletionGuard(lc):
            lc.complete()  # PENDING -> complete is not in the table
    except InvalidTransition as e:
        caught = e
    assert isinstance(caught, InvalidTransition)
    assert lc.reason is R.WORKER_CRASHED
    assert lc.error is caught


def test_guard_requires_a_lifecycle() -> None:
    with pytest.raises(TypeError, match="RequestLifecycle"):
        CompletionGuard("req-1")  # type: ignore[arg-type]


def test_nested_guards_make_one_terminal_transition() -> None:
    lc = started()
    exc = ValueError("x")
    assert run_guarded(lc, None) is None  # fails it WORKER_EXITED
    with pytest.raises(ValueError) as info, CompletionGuard(lc), CompletionGuard(lc):
        raise exc
    assert info.value is exc
    assert lc.reason is R.WORKER_EXITED
    assert len([r for r in lc.history if r.dest is S.FAILED]) == 1


# -- async with and real cancellation --------------------------------------------------


def test_async_with_normal_exit_and_exception() -> None:
    async def main() -> tuple[RequestLifecycle, RequestLifecycle, BaseException | None]:
        a = started("a")
        async with CompletionGuard(a) as got:
            assert got is a
        b = started("b")
        exc = OSError("io")
        caught = None
        try:
            async with CompletionGuard(b):
                await asyncio.sleep(0)
                raise exc
        except OSError as e:
            caught = e
        assert caught is exc
        return a, b, caught

    a, b, caught = asyncio.run(main())
    assert (a.state, a.reason, a.error) == (S.FAILED, R.WORKER_EXITED, None)
    assert (b.state, b.reason, b.error) == (S.FAILED, R.WORKER_CRASHED, caught)


def test_async_with_completed_request_stays_done() -> None:
    async def main() -> RequestLifecycle:
        lc = started()
        async with CompletionGuard(lc):
            await asyncio.sleep(0)
            lc.complete()
        return lc

    lc = asyncio.run(main())
    assert (lc.state, lc.reason) == (S.DONE, None)


@pytest.mark.parametrize("form", ["async_with", "decorator"])
def test_cancelling_a_real_task_is_aborted(form: str) -> None:
    inside: list[BaseException] = []

    async def body(lc: RequestLifecycle) -> None:
        lc.start()
        try:
            await asyncio.Event().wait()  # blocks until cancelled
        except BaseException as e:
            inside.append(e)
            raise

    async def with_guard(lc: RequestLifecycle) -> None:
        async with CompletionGuard(lc):
            await body(lc)

    worker = with_guard if form == "async_with" else guarded(body)

    async def main() -> tuple[RequestLifecycle, asyncio.Task[None]]:
        lc = RequestLifecycle("c")
        task = asyncio.ensure_future(worker(lc))
        await asyncio.sleep(0)  # the worker starts and blocks
        assert lc.state is S.TRANSFERRING
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return lc, task

    lc, task = asyncio.run(main())
    assert task.cancelled()
    assert lc.state is S.FAILED
    assert lc.reason is R.ABORTED
    assert len(inside) == 1 and isinstance(inside[0], asyncio.CancelledError)
    assert lc.error is inside[0]


def test_wait_for_timeout_cancels_the_worker_as_aborted() -> None:
    @guarded
    async def worker(lc: RequestLifecycle) -> None:
        lc.start()
        await asyncio.sleep(30)

    async def main() -> RequestLifecycle:
        lc = RequestLifecycle("wf")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(worker(lc), 0.01)
        return lc

    lc = asyncio.run(main())
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert isinstance(lc.error, asyncio.CancelledError)


# -- generators ---------------------------------------------------------------------------


def test_generator_close_inside_guard_is_aborted() -> None:
    def worker(lc: RequestLifecycle) -> Generator[int, object, None]:
        with CompletionGuard(lc):
            lc.start()
            yield 1
            yield 2

    lc = RequestLifecycle("gen")
    gen = worker(lc)
    assert next(gen) == 1
    gen.close()
    assert lc.state is S.FAILED
    assert lc.reason is R.ABORTED
    assert isinstance(lc.error, GeneratorExit)


def test_generator_garbage_collected_is_aborted() -> None:
    def worker(lc: RequestLifecycle) -> Generator[int, object, None]:
        with CompletionGuard(lc):
            lc.start()
            yield 1

    lc = RequestLifecycle("gen")
    gen = worker(lc)
    next(gen)
    del gen  # CPython closes it at once
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)


# -- the guarded decorator -----------------------------------------------------------------


def test_guarded_sync_returns_value_and_keeps_metadata() -> None:
    @guarded
    def transfer(lc: RequestLifecycle, n: int, *, scale: int = 1) -> int:
        """Docstring."""
        lc.start()
        lc.complete()
        return n * scale

    lc = RequestLifecycle("d")
    assert transfer(lc, 3, scale=2) == 6
    assert transfer.__name__ == "transfer"
    assert transfer.__doc__ == "Docstring."
    assert (lc.state, lc.reason) == (S.DONE, None)


@pytest.mark.parametrize("case", RAISING_EXITS, ids=_exit_id)
def test_guarded_sync_every_exit(case: tuple[Callable[[], BaseException], FailureReason]) -> None:
    make, expected = case
    exc = make()

    @guarded
    def worker(lc: RequestLifecycle) -> NoReturn:
        lc.start()
        raise exc

    lc = RequestLifecycle("d")
    with pytest.raises(BaseException) as info:
        worker(lc)
    assert info.value is exc
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, expected, exc)


def test_guarded_sync_return_without_completing() -> None:
    @guarded
    def worker(lc: RequestLifecycle) -> str:
        lc.start()
        return "early"

    lc = RequestLifecycle("d")
    assert worker(lc) == "early"
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_EXITED, None)


def test_guarded_async() -> None:
    @guarded
    async def ok(lc: RequestLifecycle, x: int) -> int:
        lc.start()
        await asyncio.sleep(0)
        lc.complete()
        return x + 1

    exc = ReasonedError(R.PEER_LOST)

    @guarded
    async def bad(lc: RequestLifecycle) -> None:
        lc.start()
        await asyncio.sleep(0)
        raise exc

    @guarded
    async def early(lc: RequestLifecycle) -> None:
        await asyncio.sleep(0)

    assert asyncio.iscoroutinefunction(ok)
    # Only coroutine workers are marked: the others return (async) generators.
    assert not asyncio.iscoroutinefunction(guarded(_gen_worker))
    assert not asyncio.iscoroutinefunction(guarded(_agen_worker))
    assert not asyncio.iscoroutinefunction(guarded(lambda lc: None))
    a, b, c = RequestLifecycle("a"), RequestLifecycle("b"), RequestLifecycle("c")
    assert asyncio.run(ok(a, 1)) == 2
    with pytest.raises(ReasonedError) as info:
        asyncio.run(bad(b))
    assert info.value is exc
    asyncio.run(early(c))
    assert (a.state, a.reason) == (S.DONE, None)
    assert (b.state, b.reason, b.error) == (S.FAILED, R.PEER_LOST, exc)
    assert (c.state, c.reason, c.error) == (S.FAILED, R.WORKER_EXITED, None)


def test_guarded_generator() -> None:
    @guarded
    def chunks(lc: RequestLifecycle, n: int) -> Generator[int, object, str]:
        lc.start()
        for i in range(n):
            got = yield i
            assert got in (None, "ack")
        lc.complete()
        return "sent"

    assert isinstance(chunks(RequestLifecycle("probe"), 0), collections.abc.Generator)
    lc = RequestLifecycle("gen")
    gen = chunks(lc, 3)
    assert lc.state is S.PENDING  # nothing runs before the first next()
    assert next(gen) == 0
    assert gen.send("ack") == 1  # send() reaches the worker
    assert next(gen) == 2
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "sent"
    assert (lc.state, lc.reason) == (S.DONE, None)

    # Closed by the consumer mid-way: ABORTED.
    lc2 = RequestLifecycle("gen2")
    gen2 = chunks(lc2, 3)
    next(gen2)
    gen2.close()
    assert (lc2.state, lc2.reason) == (S.FAILED, R.ABORTED)
    assert isinstance(lc2.error, GeneratorExit)

    # An exception thrown in by the consumer propagates unchanged.
    lc3 = RequestLifecycle("gen3")
    gen3 = chunks(lc3, 3)
    next(gen3)
    exc = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as info:
        gen3.throw(exc)
    assert info.value is exc
    assert (lc3.state, lc3.reason, lc3.error) == (S.FAILED, R.SHUTDOWN, exc)


def test_guarded_generator_exhausted_without_completing() -> None:
    @guarded
    def worker(lc: RequestLifecycle) -> Generator[int, object, None]:
        lc.start()
        yield 1

    lc = RequestLifecycle("gen")
    assert list(worker(lc)) == [1]
    assert (lc.state, lc.reason) == (S.FAILED, R.WORKER_EXITED)


def test_guarded_async_generator() -> None:
    @guarded
    async def stream(lc: RequestLifecycle, n: int) -> AsyncGenerator[int, None]:
        lc.start()
        for i in range(n):
            await asyncio.sleep(0)
            yield i
        lc.complete()

    assert isinstance(stream(RequestLifecycle("probe"), 0), collections.abc.AsyncGenerator)

    async def main() -> tuple[list[int], RequestLifecycle, RequestLifecycle, RequestLifecycle]:
        full = RequestLifecycle("full")
        got = [i async for i in stream(full, 3)]
        closed = RequestLifecycle("closed")
        agen = stream(closed, 3)
        assert await agen.__anext__() == 0
        await agen.aclose()
        cancelled = RequestLifecycle("cancelled")

        async def consume() -> None:
            async for _ in stream(cancelled, 10**9):
                await asyncio.Event().wait()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got, full, closed, cancelled

    got, full, closed, cancelled = asyncio.run(main())
    assert got == [0, 1, 2]
    assert (full.state, full.reason) == (S.DONE, None)
    assert (closed.state, closed.reason) == (S.FAILED, R.ABORTED)
    assert isinstance(closed.error, GeneratorExit)
    # The consumer was cancelled while holding the generator: the generator
    # is finalized by the loop (aclose), which ends the request.
    assert cancelled.is_terminal
    assert cancelled.reason is R.ABORTED


def test_guarded_async_generator_raises_unchanged() -> None:
    exc = ReasonedError(R.TRANSFER_ERROR)

    @guarded
    async def stream(lc: RequestLifecycle) -> AsyncGenerator[int, None]:
        lc.start()
        yield 1
        raise exc

    async def main(lc: RequestLifecycle) -> list[int]:
        return [i async for i in stream(lc)]

    lc = RequestLifecycle("ag")
    with pytest.raises(ReasonedError) as info:
        asyncio.run(main(lc))
    assert info.value is exc
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.TRANSFER_ERROR, exc)


# -- known gap: a decorated worker that never got to run -------------------------------------


def test_guarded_task_cancelled_before_it_runs_is_terminal() -> None:
    @guarded
    async def worker(lc: RequestLifecycle) -> None:
        lc.start()
        await asyncio.sleep(30)

    async def main() -> RequestLifecycle:
        lc = RequestLifecycle("pre")
        task = asyncio.ensure_future(worker(lc))
        task.cancel()  # before the task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        return lc

    assert asyncio.run(main()).is_terminal


def test_guarded_generator_closed_before_it_runs_is_terminal() -> None:
    @guarded
    def worker(lc: RequestLifecycle) -> Generator[int, object, None]:
        lc.start()
        yield 1

    lc = RequestLifecycle("pre")
    worker(lc).close()
    assert lc.is_terminal


# -- issue 10 item 6: edge cases found in review ------------------------------------------


def _gen_worker(lc: RequestLifecycle) -> Generator[int, object, None]:
    lc.start()
    yield 1


async def _coro_worker(lc: RequestLifecycle) -> None:
    lc.start()


async def _agen_worker(lc: RequestLifecycle) -> AsyncGenerator[int, None]:
    lc.start()
    yield 1


WORKER_KINDS = {"generator": _gen_worker, "coroutine": _coro_worker, "async_gen": _agen_worker}


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_a_dropped_never_started_worker_is_worker_dropped(kind: str) -> None:
    # 6d: no frame of the worker ever ran, so no guard inside it can; the
    # wrapper's finalizer ends the request instead of leaving it PENDING.
    worker = guarded(WORKER_KINDS[kind])
    lc = RequestLifecycle(f"drop-{kind}")
    w = worker(lc)
    assert lc.state is S.PENDING  # armed, not yet run
    del w
    gc.collect()
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_DROPPED, None)
    assert [rec.event for rec in lc.history] == [Event.FAIL]


def test_a_dropped_started_generator_is_aborted_not_dropped() -> None:
    lc = RequestLifecycle("drop-started")
    w = guarded(_gen_worker)(lc)
    assert next(w) == 1
    del w
    gc.collect()
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert isinstance(lc.error, GeneratorExit)


def test_a_dropped_finished_worker_changes_nothing() -> None:
    lc = RequestLifecycle("drop-done")

    @guarded
    def worker(lc: RequestLifecycle) -> Generator[int, object, None]:
        lc.start()
        lc.complete()
        yield 1

    w = worker(lc)
    assert list(w) == [1]
    del w
    gc.collect()
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)
    assert [rec.event for rec in lc.history] == [Event.START, Event.COMPLETE]


def test_a_worker_dropped_while_its_lifecycle_is_locked_does_not_deadlock() -> None:
    # The garbage collector may run the finalizer in a thread that holds the
    # request's lock up-stack (in the middle of an event): it must not block.
    lc = RequestLifecycle("drop-locked")
    w = guarded(_gen_worker)(lc)
    ran_in: list[tuple[str, bool]] = []
    lc.add_done_callback(
        lambda _: ran_in.append(
            (threading.current_thread().name, threading.current_thread().daemon)
        )
    )
    with lc._lock:
        del w
        gc.collect()
        assert lc.state is S.PENDING  # handed to another thread, not blocked on
    assert lc.wait(5) is S.FAILED
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_DROPPED, None)
    # A named daemon thread: it never holds up interpreter exit.
    assert ran_in == [("kvguard-finalize", True)]


def test_a_worker_dropped_unlocked_fails_in_the_dropping_thread() -> None:
    lc = RequestLifecycle("drop-here")
    ran_in: list[str] = []
    lc.add_done_callback(lambda _: ran_in.append(threading.current_thread().name))
    w = guarded(_gen_worker)(lc)
    del w
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_DROPPED, None)
    assert ran_in == [threading.current_thread().name]


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_a_guarded_worker_given_no_lifecycle_raises_and_leaves_nothing_behind(
    kind: str,
) -> None:
    unraisable: list[object] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with pytest.raises(TypeError, match="CompletionGuard needs a RequestLifecycle"):
            guarded(WORKER_KINDS[kind])("not a lifecycle")  # type: ignore[arg-type]
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert unraisable == []


def test_a_dropped_worker_of_a_terminal_request_changes_nothing() -> None:
    lc = RequestLifecycle("drop-aborted")
    w = guarded(_gen_worker)(lc)
    lc.fail(R.TIMEOUT)
    del w
    gc.collect()
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.TIMEOUT, None)
    assert len(lc.history) == 1


def test_guarded_sync_function_returning_an_awaitable_guards_the_awaitable() -> None:
    # 6e: the guard used to exit when the function returned its coroutine,
    # failing the request WORKER_EXITED before the coroutine ever ran.
    async def body(lc: RequestLifecycle, n: int) -> int:
        lc.start()
        await asyncio.sleep(0)
        lc.complete()
        return n * 2

    @guarded
    def worker(lc: RequestLifecycle, n: int) -> collections.abc.Awaitable[int]:
        return body(lc, n)

    lc = RequestLifecycle("awaitable")
    aw = worker(lc, 21)
    assert (lc.state, lc.reason) == (S.PENDING, None)  # not failed before it runs
    assert asyncio.run(aw) == 42  # type: ignore[arg-type]
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)


@pytest.mark.parametrize("case", RAISING_EXITS[:5])
def test_guarded_sync_function_returning_an_awaitable_every_exit(
    case: tuple[Callable[[], BaseException], FailureReason],
) -> None:
    make_exc, reason = case
    exc = make_exc()

    async def body(lc: RequestLifecycle) -> None:
        lc.start()
        raise exc

    @guarded
    def worker(lc: RequestLifecycle) -> collections.abc.Awaitable[None]:
        return body(lc)

    lc = RequestLifecycle("awaitable-raise")

    async def main() -> None:
        await worker(lc)

    with pytest.raises(type(exc)) as info:
        asyncio.run(main())
    assert info.value is exc
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, reason, exc)


def test_guarded_sync_function_returning_an_awaitable_that_never_completes() -> None:
    async def body(lc: RequestLifecycle) -> str:
        lc.start()
        return "forgot"

    lc = RequestLifecycle("awaitable-exit")
    assert asyncio.run(guarded(lambda lc: body(lc))(lc)) == "forgot"
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_EXITED, None)


def test_guarded_sync_function_returning_a_plain_value_is_unchanged() -> None:
    lc = RequestLifecycle("plain")
    sentinel = object()
    assert guarded(lambda lc: sentinel)(lc) is sentinel
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_EXITED, None)


class _Spy(collections.abc.Generator[int, object, None]):
    """A worker that records how it is thrown into."""

    def __init__(self) -> None:
        self.thrown: list[tuple[object, ...]] = []

    def send(self, value: object) -> int:
        return 1

    def throw(self, *args: object) -> int:
        self.thrown.append(args)
        raise args[0]  # type: ignore[misc]


class _ASpy(collections.abc.AsyncGenerator[int, None]):
    def __init__(self) -> None:
        self.thrown: list[tuple[object, ...]] = []

    async def asend(self, value: object) -> int:
        return 1

    async def athrow(self, *args: object) -> int:
        self.thrown.append(args)
        raise args[0]  # type: ignore[misc]


def test_throw_forwards_the_one_argument_form() -> None:
    # 6f: the wrapper used to call throw(typ, None, None), deprecated since
    # 3.12: under -W error the DeprecationWarning replaced the cancellation
    # and the request was recorded WORKER_CRASHED instead of ABORTED.
    from lifecycle._guard import _GuardedAsyncGenerator, _GuardedCoroutine

    lc = RequestLifecycle("throw")
    spy = _Spy()
    w = _GuardedCoroutine(lc, spy)
    cancel = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError) as info:
        w.throw(cancel)
    assert info.value is cancel
    assert spy.thrown == [(cancel,)]
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.ABORTED, cancel)

    lc = RequestLifecycle("athrow")
    aspy = _ASpy()
    aw = _GuardedAsyncGenerator(lc, aspy)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(aw.athrow(cancel))
    assert aspy.thrown == [(cancel,)]
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.ABORTED, cancel)


def test_throw_forwards_a_legacy_call_as_given() -> None:
    from lifecycle._guard import _GuardedGenerator

    lc = RequestLifecycle("throw3")
    spy = _Spy()
    exc = ValueError("x")
    with pytest.raises(ValueError):
        _GuardedGenerator(lc, spy).throw(ValueError, exc, None)
    assert spy.thrown == [(ValueError, exc, None)]


def test_cancelling_a_guarded_task_under_warnings_as_errors_is_aborted() -> None:
    @guarded
    async def worker(lc: RequestLifecycle) -> None:
        lc.start()
        await asyncio.sleep(30)

    async def main(lc: RequestLifecycle) -> None:
        task = asyncio.ensure_future(worker(lc))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    lc = RequestLifecycle("werror")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main(lc))
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert isinstance(lc.error, asyncio.CancelledError)


# Exception groups and TaskGroup are Python >= 3.11 (the package supports 3.10).
ExceptionGroup: Any = getattr(builtins, "ExceptionGroup", None)
BaseExceptionGroup: Any = getattr(builtins, "BaseExceptionGroup", None)
needs_groups = pytest.mark.skipif(ExceptionGroup is None, reason="needs Python >= 3.11")


def _typed(reason: FailureReason) -> BaseException:
    return ReasonedError(reason)


@needs_groups
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        # Every leaf typed and agreeing: that reason.
        (lambda: ExceptionGroup("g", [_typed(R.PEER_LOST)]), R.PEER_LOST),
        (lambda: ExceptionGroup("g", [_typed(R.PEER_LOST), _typed(R.PEER_LOST)]), R.PEER_LOST),
        (
            lambda: ExceptionGroup("g", [ExceptionGroup("inner", [_typed(R.TIMEOUT)])]),
            R.TIMEOUT,
        ),
        (lambda: BaseExceptionGroup("g", [KeyboardInterrupt()]), R.SHUTDOWN),
        (lambda: BaseExceptionGroup("g", [asyncio.CancelledError()]), R.ABORTED),
        # Typed leaves that disagree: the first leaf, depth first (first cause wins).
        (lambda: ExceptionGroup("g", [_typed(R.TIMEOUT), _typed(R.PEER_LOST)]), R.TIMEOUT),
        (
            lambda: ExceptionGroup(
                "g", [ExceptionGroup("inner", [_typed(R.PEER_LOST)]), _typed(R.TIMEOUT)]
            ),
            R.PEER_LOST,
        ),
        (lambda: BaseExceptionGroup("g", [SystemExit(1), _typed(R.ABORTED)]), R.SHUTDOWN),
        # Any untyped leaf: a crash, wherever it is.
        (lambda: ExceptionGroup("g", [_typed(R.PEER_LOST), RuntimeError("bug")]), R.WORKER_CRASHED),
        (lambda: ExceptionGroup("g", [RuntimeError("bug"), _typed(R.PEER_LOST)]), R.WORKER_CRASHED),
        (
            lambda: ExceptionGroup(
                "g", [_typed(R.PEER_LOST), ExceptionGroup("inner", [ValueError()])]
            ),
            R.WORKER_CRASHED,
        ),
        # The group's own reason wins over its leaves.
        (
            lambda: _with_reason(ExceptionGroup("g", [_typed(R.PEER_LOST)]), R.INVALID_REQUEST),
            R.INVALID_REQUEST,
        ),
    ],
)
def test_exit_reason_of_an_exception_group(
    make: Callable[[], BaseException], reason: FailureReason
) -> None:
    # 6g: a group used to be WORKER_CRASHED whatever it held.
    exc = make()
    assert exit_reason(exc) is reason
    lc = started()
    assert run_guarded(lc, exc) is exc
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, reason, exc)


@needs_groups
def test_a_task_group_failing_with_peer_lost_is_peer_lost() -> None:
    @guarded
    async def worker(lc: RequestLifecycle) -> None:
        lc.start()

        async def push() -> None:
            await asyncio.sleep(0)
            raise ReasonedError(R.PEER_LOST)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(push())
            tg.create_task(asyncio.sleep(30))  # cancelled by the group: not a leaf

    lc = RequestLifecycle("tg")
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(worker(lc))
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.PEER_LOST, info.value)


# -- every argument and value reaches the worker ------------------------------------------


def test_guarded_generator_passes_sent_values_and_kwargs() -> None:
    @guarded
    def worker(lc: RequestLifecycle, a: int, *, b: int) -> Generator[int, int, int]:
        lc.start()
        got = yield a + b
        lc.complete()
        return got * 10

    lc = RequestLifecycle("send")
    gen = worker(lc, 1, b=2)
    assert next(gen) == 3
    with pytest.raises(StopIteration) as info:
        gen.send(7)
    assert info.value.value == 70
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)


def test_guarded_async_generator_passes_sent_values_and_kwargs() -> None:
    @guarded
    async def worker(lc: RequestLifecycle, a: int, *, b: int) -> AsyncGenerator[int, int]:
        lc.start()
        got = yield a + b
        lc.complete()
        yield got * 10

    async def main(lc: RequestLifecycle) -> list[int]:
        agen = worker(lc, 1, b=2)
        return [await agen.__anext__(), await agen.asend(7)]

    lc = RequestLifecycle("asend")
    assert asyncio.run(main(lc)) == [3, 70]
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)


def test_guarded_coroutine_passes_kwargs() -> None:
    @guarded
    async def worker(lc: RequestLifecycle, a: int, *, b: int) -> int:
        lc.start()
        lc.complete()
        return a + b

    lc = RequestLifecycle("kw")
    assert asyncio.run(worker(lc, 1, b=2)) == 3
    assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)


def test_athrow_forwards_a_legacy_call_as_given() -> None:
    from lifecycle._guard import _GuardedAsyncGenerator

    lc = RequestLifecycle("athrow3")
    aspy = _ASpy()
    exc = ValueError("x")
    with pytest.raises(ValueError):
        asyncio.run(_GuardedAsyncGenerator(lc, aspy).athrow(ValueError, exc, None))
    assert aspy.thrown == [(ValueError, exc, None)]
    assert (lc.state, lc.reason) == (S.FAILED, R.WORKER_CRASHED)
    assert isinstance(lc.error, ValueError)


def test_closing_a_never_started_worker_is_aborted_exactly() -> None:
    lc = RequestLifecycle("close-pre")
    guarded(_gen_worker)(lc).close()
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert type(lc.error) is GeneratorExit

    lc = RequestLifecycle("aclose-pre")
    asyncio.run(guarded(_agen_worker)(lc).aclose())
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert type(lc.error) is GeneratorExit
    assert [rec.event for rec in lc.history] == [Event.FAIL]


def test_guarded_async_generator_receives_thrown_exceptions() -> None:
    # The worker itself sees athrow(): it may handle the error and go on.
    seen: list[str] = []

    @guarded
    async def worker(lc: RequestLifecycle) -> AsyncGenerator[str, None]:
        lc.start()
        try:
            yield "first"
        except ConnectionResetError as exc:
            seen.append(f"handled {exc}")
            lc.retry()
            lc.start()
        lc.complete()
        yield "after"

    async def main(lc: RequestLifecycle) -> list[str]:
        agen = worker(lc)
        first = await agen.__anext__()
        after = await agen.athrow(ConnectionResetError("blip"))
        await agen.aclose()
        return [first, after]

    lc = RequestLifecycle("athrow-handled", max_attempts=2)
    assert asyncio.run(main(lc)) == ["first", "after"]
    assert seen == ["handled blip"]
    assert (lc.state, lc.reason, lc.error, lc.attempt) == (S.DONE, None, None, 2)


def test_closing_a_started_guarded_async_generator_runs_its_finally() -> None:
    events: list[str] = []

    @guarded
    async def worker(lc: RequestLifecycle) -> AsyncGenerator[int, None]:
        lc.start()
        try:
            yield 1
            yield 2
        finally:
            events.append("finally")

    async def main(lc: RequestLifecycle) -> None:
        agen = worker(lc)
        assert await agen.__anext__() == 1
        await agen.aclose()
        events.append("closed")

    lc = RequestLifecycle("aclose-started")
    asyncio.run(main(lc))
    assert events == ["finally", "closed"]
    assert (lc.state, lc.reason) == (S.FAILED, R.ABORTED)
    assert type(lc.error) is GeneratorExit


def test_an_unhandled_athrow_fails_the_request_with_that_error() -> None:
    @guarded
    async def worker(lc: RequestLifecycle) -> AsyncGenerator[int, None]:
        lc.start()
        yield 1

    async def main(lc: RequestLifecycle, exc: BaseException) -> None:
        agen = worker(lc)
        await agen.__anext__()
        with pytest.raises(ConnectionResetError) as info:
            await agen.athrow(exc)
        assert info.value is exc

    lc = RequestLifecycle("athrow-unhandled")
    exc = ConnectionResetError("peer")
    asyncio.run(main(lc, exc))
    assert (lc.state, lc.reason, lc.error) == (S.FAILED, R.WORKER_CRASHED, exc)
