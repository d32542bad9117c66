"""Who calls step(), and where user code runs.

* ``ThreadDriver``: one thread, ``kvguard-step``, steps the core whenever the
  inbox has something or the core's next time comes. It runs no user code,
  so a deadline is late only by the time a step takes.
* ``run_async``: the same loop as an asyncio task in the caller's loop.
* Or no driver: a host serving loop calls ``Scheduler.step()`` once per
  iteration (vLLM's ``get_finished()``, xLLM's scheduler step).

User code -- release callbacks, observers, lifecycle done-callbacks -- runs
on ``CallbackRunner``'s thread, in order, never on the driver's. Anything a
callback raises (BaseException included) is logged and contained. A callback
that blocks holds up only later callbacks, and only until the stall limit:
then the runner gives up on that thread and carries on with a new one.
Probes (blocking network calls) run on ``Prober``'s thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from transfer import TransferBackend

from ._core import SchedulerCore, StepResult

__all__ = ["CallbackRunner", "Prober", "ThreadDriver", "run_async"]

_log = structlog.get_logger("kvguard.scheduler")

Job = tuple[Callable[..., object], tuple[Any, ...]]


class CallbackRunner:
    """Runs jobs in order on a daemon thread; survives raising and blocking jobs."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self._cv = threading.Condition()
        self._jobs: deque[Job] = deque()  # under _cv
        self._gen = 0  # a thread whose generation is older retires after its job
        self._busy_since: float | None = None  # clock() when the running job started
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.stalled = 0  # jobs given up on (they still finish in their own thread)
        self.idents: set[int] = set()  # threads that run jobs (close() must not join them)

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        self.extend([(fn, args)])

    def extend(self, jobs: list[Job]) -> None:
        with self._cv:
            if not self._stopping:
                self._jobs.extend(jobs)
                if not self._threads:
                    self._start()
                self._cv.notify()
                return
        for fn, args in jobs:  # stopped (after close): run in the posting thread
            _contained(fn, args)

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs) + (self._busy_since is not None)

    def check_stall(self) -> None:
        """Give up on a job that ran past the stall limit while others wait."""
        with self._cv:
            busy = self._busy_since
            if busy is None or not self._jobs or self._clock() - busy < self.stall_s:
                return
            self.stalled += 1
            self._gen += 1
            self._busy_since = None
            self._start()
        _log.warning("callback_stalled", stall_s=self.stall_s, waiting=len(self._jobs))

    def next_check(self) -> float | None:
        """When the driver should call check_stall() next (None: nothing runs)."""
        busy = self._busy_since
        if busy is None and not self._jobs:
            return None
        return (self._clock() if busy is None else busy) + self.stall_s

    def _start(self) -> None:
        # Under _cv.
        t = threading.Thread(
            target=self._run, args=(self._gen,), name="kvguard-callbacks", daemon=True
        )
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _run(self, gen: int) -> None:
        self.idents.add(threading.get_ident())
        cv = self._cv
        ran = False
        while True:
            with cv:  # one acquisition both ends the last job and takes the next
                if ran and gen == self._gen:
                    self._busy_since = None
                while not self._jobs and not self._stopping and gen == self._gen:
                    cv.wait()
                if gen != self._gen or not self._jobs:
                    return
                fn, args = self._jobs.popleft()
                self._busy_since = self._clock()
            _contained(fn, args)
            del fn, args  # pin nothing (a released request) while idle
            ran = True

    def stop(self, timeout: float) -> None:
        """Run what is queued, then stop; never joins the calling thread. Jobs
        posted from then on run in the thread that posts them."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            threads = list(self._threads)
        end = time.monotonic() + timeout
        for t in threads:
            if t.ident != threading.get_ident():
                t.join(max(0.0, end - time.monotonic()))


def _contained(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except BaseException:
        _log.exception("callback_failed", callback=repr(fn))


class Prober:
    """Probes peers on its own thread and reports to the core."""

    def __init__(self, backend: TransferBackend, core: SchedulerCore) -> None:
        self._backend = backend
        self._core = core
        self._runner = CallbackRunner(stall_s=float("inf"))

    def probe(self, peers: list[str]) -> None:
        self._runner.extend([(self._probe, (sid,)) for sid in peers])

    def _probe(self, sid: str) -> None:
        error: BaseException | None = None
        try:
            self._backend.probe(sid)
        except BaseException as exc:
            error = exc
        self._core.probe_result(sid, error)

    def stop(self) -> None:
        self._runner.stop(0.0)


Dispatch = Callable[[StepResult], None]


class ThreadDriver:
    """Steps the core on ``kvguard-step``; reports its own death, never silent."""

    def __init__(
        self,
        core: SchedulerCore,
        dispatch: Dispatch,
        on_death: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        idle_check: Callable[[], float | None] = lambda: None,
    ) -> None:
        self._core = core
        self._dispatch = dispatch
        self._on_death = on_death
        self._clock = clock
        self._idle_check = idle_check  # another time to wake at (callback stall checks)
        self._cv = threading.Condition()
        self._signal = False  # the inbox got something since the driver last looked
        self._stop = False
        self.error: BaseException | None = None
        core.table.wake = self.wake
        self.thread = threading.Thread(target=self._run, name="kvguard-step", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        if self._signal:
            return  # already due: the driver clears it before its next step
        with self._cv:
            self._signal = True
            self._cv.notify()

    def _run(self) -> None:
        core, clock, cv = self._core, self._clock, self._cv
        try:
            while True:
                res = core.step(clock())
                self._dispatch(res)
                with cv:
                    if self._stop:
                        return
                    if not self._signal:
                        times = [t for t in (res.next_at, self._idle_check()) if t is not None]
                        cv.wait(max(0.0, min(times) - clock()) if times else None)
                    self._signal = False
        except BaseException as exc:
            self.error = exc
            _log.critical("driver_died", driver="thread", exc_info=exc)
            self._on_death(exc)

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def stop(self, timeout: float) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self.thread.ident != threading.get_ident():
            self.thread.join(timeout)


async def run_async(
    core: SchedulerCore,
    dispatch: Dispatch,
    stopped: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Step the core from the running asyncio loop until ``stopped()``."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    flag = [False]

    def wake() -> None:
        if not flag[0]:
            flag[0] = True
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(event.set)

    previous, core.table.wake = core.table.wake, wake
    try:
        while not stopped():
            flag[0] = False
            event.clear()
            res = core.step(clock())
            dispatch(res)
            if core.table.inbox:
                continue
            timeout = None if res.next_at is None else max(0.0, res.next_at - clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
    finally:
        if core.table.wake is wake:
            core.table.wake = previous
