"""CompletionGuard: a worker may leave only through a terminal transition.

Whatever way the guarded block exits — return, exception, BaseException,
asyncio cancellation, generator close — a request that is still not terminal
is failed with the reason the exit path implies (invariant I3). The exception
itself always propagates unchanged: the guard records, it never swallows.

A request retried back to PENDING is not terminal, so a retry loop belongs
inside one guarded scope, not around several.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from ._lifecycle import RequestLifecycle
from ._table import FailureReason

__all__ = ["EXIT_REASONS", "CompletionGuard", "exit_reason", "guarded"]

P = ParamSpec("P")
R = TypeVar("R")

# Exit paths that are not crashes, looked up along the exception's MRO.
# Anything else that escapes is WORKER_CRASHED.
EXIT_REASONS: Mapping[type[BaseException], FailureReason] = {
    asyncio.CancelledError: FailureReason.ABORTED,
    GeneratorExit: FailureReason.ABORTED,  # the consumer closed the worker
    KeyboardInterrupt: FailureReason.SHUTDOWN,
    SystemExit: FailureReason.SHUTDOWN,
}


def exit_reason(exc: BaseException | None) -> FailureReason:
    """The FailureReason a worker exit implies; see the module docstring."""
    if exc is None:
        return FailureReason.WORKER_EXITED
    reason = getattr(exc, "reason", None)
    if isinstance(reason, FailureReason):
        return reason
    for cls in type(exc).__mro__:
        found = EXIT_REASONS.get(cast(type[BaseException], cls))
        if found is not None:
            return found
    return FailureReason.WORKER_CRASHED


class CompletionGuard:
    """Context manager (sync and async) that makes every exit terminal."""

    __slots__ = ("lifecycle",)

    def __init__(self, lifecycle: RequestLifecycle) -> None:
        if not isinstance(lifecycle, RequestLifecycle):
            raise TypeError(f"CompletionGuard needs a RequestLifecycle, got {lifecycle!r}")
        self.lifecycle = lifecycle

    def __enter__(self) -> RequestLifecycle:
        return self.lifecycle

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # fail() is a no-op on a terminal request, so a watchdog racing us
        # cannot make this a second terminal transition; the check only keeps
        # the normal exit of a finished worker out of the journal.
        if not self.lifecycle.is_terminal:
            self.lifecycle.fail(exit_reason(exc), exc)
        # Returning None lets the exception propagate unchanged.

    async def __aenter__(self) -> RequestLifecycle:
        return self.lifecycle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


def guarded(
    fn: Callable[Concatenate[RequestLifecycle, P], R],
) -> Callable[Concatenate[RequestLifecycle, P], R]:
    """Decorator form: ``fn(lifecycle, ...)`` runs inside a CompletionGuard.

    Works for plain functions, coroutine functions, generator functions
    and async generator functions; the first argument must be the request's
    RequestLifecycle.
    """
    if inspect.iscoroutinefunction(fn):
        afn = cast(Callable[..., Awaitable[Any]], fn)

        @functools.wraps(fn)
        async def run_async(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
            async with CompletionGuard(lc):
                return await afn(lc, *args, **kwargs)

        return cast(Callable[Concatenate[RequestLifecycle, P], R], run_async)

    if inspect.isasyncgenfunction(fn):
        agen_fn = cast(Callable[..., Any], fn)

        @functools.wraps(fn)
        async def run_agen(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
            async with CompletionGuard(lc):
                async for item in agen_fn(lc, *args, **kwargs):
                    yield item

        return cast(Callable[Concatenate[RequestLifecycle, P], R], run_agen)

    if inspect.isgeneratorfunction(fn):
        gen_fn = cast(Callable[..., Any], fn)

        @functools.wraps(fn)
        def run_gen(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
            with CompletionGuard(lc):
                return (yield from gen_fn(lc, *args, **kwargs))

        return cast(Callable[Concatenate[RequestLifecycle, P], R], run_gen)

    @functools.wraps(fn)
    def run(lc: RequestLifecycle, *args: P.args, **kwargs: P.kwargs) -> R:
        with CompletionGuard(lc):
            return fn(lc, *args, **kwargs)

    return cast(Callable[Concatenate[RequestLifecycle, P], R], run)
