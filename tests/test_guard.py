"""CompletionGuard and ``guarded``: every worker exit path ends terminal (I3).

Each test also checks that the exception leaving the guard is the very
object the worker raised: the guard records, it never swallows or wraps.
"""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import AsyncGenerator, Callable, Generator
from typing import NoReturn

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
