"""CompletionGuard: a worker may leave only through a terminal transition.

Whatever way the guarded block exits — return, exception, BaseException,
asyncio cancellation, generator close — a request that is still not terminal
is failed with the reason the exit path implies: no exit leaves it live. The
exception itself always propagates unchanged: the guard records, it never
swallows.

A request retried back to PENDING is not terminal, so a retry loop belongs
inside one guarded scope, not around several.

Exception groups (asyncio.TaskGroup): when every leaf maps to a typed reason
(one other than WORKER_CRASHED), the group gets the first leaf's, depth
first, as the first cause wins; a single untyped leaf makes the group
WORKER_CRASHED, since a bug must not hide behind a peer loss.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator, Mapping
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


# BaseExceptionGroup is a builtin from Python 3.11; on 3.10, () matches nothing.
_GROUP: Any = getattr(builtins, "BaseExceptionGroup", ())


def exit_reason(exc: BaseException | None) -> FailureReason:
    """The FailureReason a worker exit implies; see the module docstring."""
    if exc is None:
        return FailureReason.WORKER_EXITED
    reason = getattr(exc, "reason", None)
    if isinstance(reason, FailureReason):
        return reason
    if isinstance(exc, _GROUP):
        leaves = [exit_reason(leaf) for leaf in exc.exceptions]
        if FailureReason.WORKER_CRASHED in leaves:
            return FailureReason.WORKER_CRASHED
        return leaves[0]
    for cls in type(exc).__mro__:
        found = EXIT_REASONS.get(cast(type[BaseException], cls))
        if found is not None:
            return found
    return FailureReason.WORKER_CRASHED


def _end(lc: RequestLifecycle, exc: BaseException | None) -> None:
    """The guard's one rule: a worker leaving a non-terminal request fails it."""
    # fail() is a no-op on a terminal request, so a watchdog racing us
    # cannot make this a second terminal transition; the check only keeps
    # the normal exit of a finished worker out of the journal.
    if not lc.is_terminal:
        lc.fail(exit_reason(exc), exc)


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
        _end(self.lifecycle, exc)  # returning None lets the exception propagate unchanged

    async def __aenter__(self) -> RequestLifecycle:
        return self.lifecycle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _end(self.lifecycle, exc)


class _Guarded:
    """Shared by the wrappers below: the guard is armed when the worker is
    *created*, not when its body first runs, so a coroutine cancelled before
    its first step or a generator closed before its first ``next()`` still
    leaves its request terminal. Every outcome of every call into the
    inner object goes through ``_end``; the first one decides (later ones
    find the request terminal)."""

    __slots__ = ("_lc", "_ran")

    def __init__(self, lc: RequestLifecycle) -> None:
        self._ran = True  # until built: a half-built wrapper has no request to fail
        self._lc = CompletionGuard(lc).lifecycle  # type-checked like the context manager
        self._ran = False  # a call reached the inner worker: its own guard covers a drop

    def __del__(self) -> None:
        # Dropped before anything reached the worker: no frame of it ever
        # ran, so no guard inside it ever will. A started one is finalized
        # right after us and its own guard records ABORTED.
        # pragma: no mutate block (mutmut 3.8's trampoline segfaults in a GC'd __del__)
        if not self._ran and not self._lc.is_terminal:
            self._lc._fail_nowait(FailureReason.WORKER_DROPPED)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._ran = True
        try:
            return fn(*args)
        except StopIteration:
            _end(self._lc, None)
            raise
        except BaseException as exc:
            _end(self._lc, exc)
            raise

    async def _acall(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        self._ran = True
        try:
            return await fn(*args)
        except StopAsyncIteration:
            _end(self._lc, None)
            raise
        except BaseException as exc:
            _end(self._lc, exc)
            raise


class _GuardedGenerator(_Guarded, Generator[Any, Any, Any]):
    __slots__ = ("_gen",)

    def __init__(
        self, lc: RequestLifecycle, gen: Generator[Any, Any, Any] | Coroutine[Any, Any, Any]
    ) -> None:
        super().__init__(lc)
        self._gen = gen

    def send(self, value: Any) -> Any:
        return self._call(self._gen.send, value)

    def throw(self, typ: Any, *legacy: Any) -> Any:
        # Forwarded as given: asyncio's one-argument form must stay one
        # argument (the three-argument form warns since Python 3.12).
        return self._call(self._gen.throw, typ, *legacy)

    def close(self) -> None:
        self._call(self._gen.close)
        _end(self._lc, GeneratorExit())  # closed, maybe before it ever ran


class _GuardedCoroutine(_GuardedGenerator, Coroutine[Any, Any, Any]):
    """A coroutine is driven through the same send/throw/close protocol."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, Any]:
        return self


class _GuardedAsyncGenerator(_Guarded, AsyncGenerator[Any, Any]):
    __slots__ = ("_agen",)

    def __init__(self, lc: RequestLifecycle, agen: AsyncGenerator[Any, Any]) -> None:
        super().__init__(lc)
        self._agen = agen

    async def asend(self, value: Any) -> Any:
        return await self._acall(self._agen.asend, value)

    async def athrow(self, typ: Any, *legacy: Any) -> Any:
        return await self._acall(self._agen.athrow, typ, *legacy)

    async def aclose(self) -> None:
        await self._acall(self._agen.aclose)
        _end(self._lc, GeneratorExit())  # closed, maybe before it ever ran


# What guarded() wraps each kind of worker function's result in.
_WRAPPERS: tuple[tuple[Callable[[Any], bool], Callable[[RequestLifecycle, Any], Any]], ...] = (
    (inspect.iscoroutinefunction, _GuardedCoroutine),
    (inspect.isasyncgenfunction, _GuardedAsyncGenerator),
    (inspect.isgeneratorfunction, _GuardedGenerator),
)


def _native(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its body inside the guard, as the same kind of function.

    This layer covers a worker that started: when the event loop or the
    garbage collector finalizes it, GeneratorExit runs through the guard.
    The wrapper objects above cover the worker that never started.
    """
    if inspect.iscoroutinefunction(fn):

        async def run_coro(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
            async with CompletionGuard(lc):
                return await fn(lc, *args, **kwargs)

        return run_coro
    if inspect.isasyncgenfunction(fn):

        async def run_agen(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
            # ``async for`` would drop asend() values and throw athrow()
            # exceptions here instead of into the worker: delegate the whole
            # protocol, as ``yield from`` does for generators (PEP 380).
            async with CompletionGuard(lc):
                agen = fn(lc, *args, **kwargs)
                try:
                    value = await agen.asend(None)
                    while True:
                        try:
                            sent = yield value
                        except GeneratorExit:
                            await agen.aclose()  # the worker's finally blocks run now
                            raise
                        except BaseException as exc:
                            value = await agen.athrow(exc)
                        else:
                            value = await agen.asend(sent)
                except StopAsyncIteration:
                    return

        return run_agen

    def run_gen(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
        with CompletionGuard(lc):
            return (yield from fn(lc, *args, **kwargs))

    return run_gen


def _factory(fn: Callable[..., Any], wrapper: Callable[[RequestLifecycle, Any], Any]) -> Any:
    body = _native(fn)

    @functools.wraps(fn)
    def make(lc: RequestLifecycle, *args: Any, **kwargs: Any) -> Any:
        return wrapper(lc, body(lc, *args, **kwargs))

    # Still a coroutine function to frameworks that ask (it returns an
    # awaitable coroutine object either way).
    return _mark_coroutine(make) if wrapper is _GuardedCoroutine else make


def _mark_before_312(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return fn


_mark_coroutine: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(
    inspect, "markcoroutinefunction", _mark_before_312
)


def guarded(
    fn: Callable[Concatenate[RequestLifecycle, P], R],
) -> Callable[Concatenate[RequestLifecycle, P], R]:
    """Decorator form: ``fn(lifecycle, ...)`` runs inside a CompletionGuard.

    Works for plain functions, coroutine functions, generator functions and
    async generator functions; the first argument must be the request's
    RequestLifecycle. For the last three the guard covers the worker from
    the moment it is created: closing or cancelling it before it ever ran
    still fails its request (ABORTED), and dropping it unstarted fails it
    WORKER_DROPPED. A plain function that returns an awaitable returns a
    coroutine instead, with the guard around awaiting it.
    """
    for matches, wrapper in _WRAPPERS:
        if matches(fn):
            return cast(Callable[Concatenate[RequestLifecycle, P], R], _factory(fn, wrapper))

    @functools.wraps(fn)
    def run(lc: RequestLifecycle, *args: P.args, **kwargs: P.kwargs) -> R:
        CompletionGuard(lc)  # the same TypeError for a wrong first argument
        try:
            result = fn(lc, *args, **kwargs)
        except BaseException as exc:
            _end(lc, exc)
            raise
        if inspect.isawaitable(result):
            # The real worker is the awaitable (a callable object with an
            # async __call__, a partial...): guard it, not this return.
            return cast(R, _GuardedCoroutine(lc, _await_guarded(lc, result)))
        _end(lc, None)
        return result

    return cast(Callable[Concatenate[RequestLifecycle, P], R], run)


async def _await_guarded(lc: RequestLifecycle, awaitable: Awaitable[Any]) -> Any:
    async with CompletionGuard(lc):
        return await awaitable
