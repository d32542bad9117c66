"""Scheduler: owns request lifecycles and guarantees invariants I2-I6.

One ``Scheduler`` per prefill instance. It turns a request (block ids, a
peer, a deadline) into a validated plan, runs it as a worker inside one
``CompletionGuard`` scope per request, and reports outcomes through
``poll()`` (step-based loops), ``wait()`` and ``wait_async()``.

Threads, and what each one owns:

* ``kvguard-loop``: an asyncio loop running the workers, at most ``workers``
  at a time, highest priority first. A worker waiting on a slow or hung
  transfer costs a coroutine, not a thread.
* ``kvguard-watchdog``: fails overdue requests with TIMEOUT. A thread of its
  own, so a deadline fires whatever the loop or the backend is doing (I4).
* ``kvguard-release``: runs the user's release callbacks, in order, off the
  loop and the backend's threads (they may be slow: a checksum, an RPC).
* ``kvguard-prober``: probes peers with live requests, and dead peers until
  they answer again.

Who may end a request, and why exactly one of them wins (I2): the worker
(complete, or fail with the backend's typed reason), the watchdog (TIMEOUT at
the deadline), ``abort()`` (ABORTED), peer loss (PEER_LOST) and ``close()``
(SHUTDOWN) all go through ``RequestLifecycle``, whose terminal transition
happens once under its lock; the others' events are journaled no-ops.

Blocks are released (the user's callback) once per request, after it is
terminal AND every backend op on its blocks has quiesced (I6).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from lifecycle import (
    CompletionGuard,
    FailureReason,
    Journal,
    RequestLifecycle,
    TransferState,
    exit_reason,
)
from transfer import (
    PeerInfo,
    PeerLost,
    PeerUnreachable,
    TransferBackend,
    TransferError,
    TransferOp,
    TransferPlan,
    TransferTimeout,
)
from transfer.layout import KVCache
from transfer.plan import DEFAULT_MAX_BATCH_ENTRIES, build_plan

from .errors import (
    DuplicateRequest,
    InvalidRequest,
    SchedulerClosed,
    UnknownPeer,
    UnknownRequest,
)

__all__ = ["Finished", "MetricsSnapshot", "ReleaseCallback", "RetryPolicy", "Scheduler"]

_log = structlog.get_logger("kvguard.scheduler")

ReleaseCallback = Callable[[str, "Finished"], object]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries of retryable errors, with exponential backoff.

    A retry never outlives the request's deadline: the backoff sleep is cut
    short by it, and by abort().
    """

    max_attempts: int = 3
    backoff_s: float = 0.01
    backoff_factor: float = 2.0
    backoff_max_s: float = 0.5

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * self.backoff_factor ** (attempt - 1)))


@dataclass(frozen=True, slots=True)
class Finished:
    """One request's outcome, as poll() reports it."""

    request_id: str
    state: TransferState
    reason: FailureReason | None
    error: BaseException | None
    attempt: int
    peer: str
    nbytes: int
    latency_s: float  # submit -> terminal


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    done: int
    failed_by_reason: dict[str, int]
    live_by_state: dict[str, int]
    quarantined: int  # terminal, but a backend op may still touch the blocks
    oldest_live_age_s: float
    released: int
    released_before_quiesce: int  # must stay 0 (I6)
    double_releases: int  # must stay 0 (I6)
    peers_lost: int
    bytes_done: int

    @property
    def failed(self) -> int:
        return sum(self.failed_by_reason.values())


class _Entry:
    """Scheduler-side bookkeeping of one request; lives until released."""

    __slots__ = (
        "deadline",
        "lifecycle",
        "ops",
        "peer",
        "plan",
        "priority",
        "release",
        "released",
        "seq",
        "submitted",
        "terminal_at",
        "wake",
        "worker",
    )

    lifecycle: RequestLifecycle
    plan: TransferPlan
    peer: str
    deadline: float  # absolute, time.monotonic(); the watchdog fails the request then
    submitted: float
    priority: int
    release: ReleaseCallback | None
    ops: list[TransferOp]  # every op ever submitted for it; release waits for all to quiesce
    released: bool  # set once, under the scheduler lock (I6: exactly once)
    seq: int  # unique per submit: tells this entry from a later one reusing its id
    terminal_at: float | None
    wake: asyncio.Event | None  # loop thread only: set on terminal transition or op result
    worker: bool  # a worker task owns it and may still submit an op; no release until False

    def __init__(
        self,
        lc: RequestLifecycle,
        plan: TransferPlan,
        deadline: float,
        now: float,
        priority: int,
        release: ReleaseCallback | None,
    ) -> None:
        self.lifecycle = lc
        self.plan = plan
        self.peer = plan.peer
        self.deadline = deadline
        self.submitted = now
        self.priority = priority
        self.release = release
        self.ops = []
        self.released = False
        self.seq = 0
        self.terminal_at = None
        self.wake = None
        self.worker = False


@dataclass(slots=True)
class _Peer:
    info: PeerInfo
    alive: bool = True
    live: set[str] = field(default_factory=set)  # ids of non-released requests to this peer


class Scheduler:
    """Submit KV transfers; every request ends DONE or FAILED by its deadline."""

    def __init__(
        self,
        backend: TransferBackend,
        source: KVCache,
        *,
        workers: int = 4,
        default_deadline_s: float = 30.0,
        retry: RetryPolicy | None = None,
        release: ReleaseCallback | None = None,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        probe_interval_s: float = 0.5,
        journal: Journal | None = None,
    ) -> None:
        if type(workers) is not int or workers < 1:
            raise InvalidRequest(f"workers must be an int >= 1, got {workers!r}")
        _check_deadline("default_deadline_s", default_deadline_s)
        self.backend = backend
        self.source = source
        self.default_deadline_s = default_deadline_s
        self.retry_policy = retry or RetryPolicy()
        self.max_batch_entries = max_batch_entries
        self.probe_interval_s = probe_interval_s
        self._release_default = release
        self._journal = journal

        self._lock = threading.Lock()
        # Every request from submit() until its release; ids are unique here.
        self._entries: dict[str, _Entry] = {}
        self._peers: dict[str, _Peer] = {}
        self._finished: deque[Finished] = deque()  # drained by poll()
        # The last RECENT released requests, oldest first: get()/wait()/abort()
        # still answer for a request that ended before the caller asked.
        self._recent: OrderedDict[str, RequestLifecycle] = OrderedDict()
        # Called with each Finished, in the thread that ended the request
        # (metrics exporters, journals). Must be quick and must not block.
        self._observers: list[Callable[[Finished], object]] = []
        self._closed = False
        self._idle = threading.Condition(self._lock)  # notified when _entries empties

        # Counters for MetricsSnapshot; updated under _lock.
        self._done = 0
        self._failed: Counter[str] = Counter()
        self._released = 0
        self._released_before_quiesce = 0
        self._double_releases = 0
        self._peers_lost = 0
        self._bytes_done = 0

        # Work queue: (-priority, seq, entry), under _lock; _pump() starts the
        # highest-priority entries while fewer than `workers` run.
        self._seq = itertools.count()
        self._queue: list[tuple[int, int, _Entry]] = []
        self._workers = workers
        self._running = 0  # loop thread only
        self._pump_scheduled = False  # under _lock: a _pump call is queued on the loop

        # Deadlines: (deadline, seq, request id). Lazy deletion: an expired
        # item whose entry is gone, reused (other seq) or terminal is skipped,
        # so removal is free and firing is O(log n). Ids, not entries, so a
        # finished request's plan is not kept alive until its deadline.
        self._deadlines: list[tuple[float, int, str]] = []
        self._deadline_cv = threading.Condition(threading.Lock())

        # Releases waiting for the release thread; None stops it.
        self._releases: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()

        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()  # strong refs: the loop keeps weak ones
        self._threads = [
            threading.Thread(target=self._loop.run_forever, name="kvguard-loop", daemon=True),
            threading.Thread(target=self._watchdog_loop, name="kvguard-watchdog", daemon=True),
            threading.Thread(target=self._release_loop, name="kvguard-release", daemon=True),
            threading.Thread(target=self._prober_loop, name="kvguard-prober", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def add_observer(self, fn: Callable[[Finished], object]) -> None:
        """Call ``fn(finished)`` for every request that becomes terminal from now on."""
        self._observers.append(fn)

    # -- peers ----------------------------------------------------------------

    def add_peer(self, info: PeerInfo) -> None:
        """Make a decode peer known (or replace what it advertises)."""
        if not isinstance(info, PeerInfo):
            raise InvalidRequest(f"add_peer needs a PeerInfo, got {info!r}")
        with self._lock:
            peer = self._peers.get(info.session_id)
            if peer is None:
                self._peers[info.session_id] = _Peer(info)
            else:
                peer.info = info
                peer.alive = True

    def peer_alive(self, session_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(session_id)
        if peer is None:
            raise UnknownPeer(f"unknown peer {session_id!r}")
        return peer.alive

    def mark_peer_lost(self, session_id: str, error: TransferError | None = None) -> int:
        """Fail every live request to the peer with PEER_LOST, at once.

        New submits to it fail fast until a probe sees it alive again.
        Returns how many requests this call failed.
        """
        err = error or PeerLost(f"peer {session_id} was lost", peer=session_id)
        failed = self._peer_lost(session_id, err)
        if failed is None:
            raise UnknownPeer(f"unknown peer {session_id!r}")
        return failed

    def _peer_lost(self, session_id: str, err: TransferError) -> int | None:
        # Workers and the prober call this too: a peer removed meanwhile is
        # not their error (None), unlike an unknown id given to the API.
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                return None
            newly = peer.alive
            peer.alive = False
            victims = self._live_to(peer)
            if newly:
                self._peers_lost += 1
        if newly:
            _log.warning("peer_lost", peer=session_id, live_requests=len(victims))
        return sum(e.lifecycle.fail(FailureReason.PEER_LOST, err) for e in victims)

    def _live_to(self, peer: _Peer) -> list[_Entry]:
        # Caller holds _lock.
        return [e for rid in peer.live if not (e := self._entries[rid]).lifecycle.is_terminal]

    def mark_peer_alive(self, session_id: str) -> None:
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                raise UnknownPeer(f"unknown peer {session_id!r}")
            was = peer.alive
            peer.alive = True
        if not was:
            _log.info("peer_alive", peer=session_id)

    def remove_peer(self, session_id: str) -> int:
        """Forget a peer (a decode instance scaled down or replaced).

        Its live requests fail with PEER_LOST at once; later submits to it
        raise UnknownPeer and the prober stops probing it. Blocks of its
        requests are still released only after quiesce. Returns how many
        requests this call failed.
        """
        with self._lock:
            peer = self._peers.pop(session_id, None)
            if peer is None:
                raise UnknownPeer(f"unknown peer {session_id!r}")
            victims = self._live_to(peer)
        _log.info("peer_removed", peer=session_id, live_requests=len(victims))
        err = PeerLost(f"peer {session_id} was removed", peer=session_id)
        return sum(e.lifecycle.fail(FailureReason.PEER_LOST, err) for e in victims)

    # -- submit ---------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        peer: str,
        deadline_s: float | None = None,
        priority: int = 0,
        release: ReleaseCallback | None = None,
    ) -> RequestLifecycle:
        """Queue a transfer and return its lifecycle.

        Raises (leaving no state behind) ``InvalidRequest``, ``UnknownPeer``,
        ``DuplicateRequest``, ``SchedulerClosed`` or ``transfer.InvalidPlan``.
        A submit to a peer known dead is accepted and fails at once with
        PEER_LOST, so it is reported by poll() like any other outcome.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty str, got {request_id!r}")
        if deadline_s is None:
            deadline_s = self.default_deadline_s
        _check_deadline("deadline_s", deadline_s)
        if type(priority) is not int:
            raise InvalidRequest(f"priority must be an int, got {priority!r}")
        with self._lock:
            p = self._peers.get(peer)
        if p is None:
            raise UnknownPeer(f"unknown peer {peer!r}; call add_peer() first")
        # Validation before any state exists: a bad plan raises InvalidPlan here.
        if _is_empty(src_blocks) and _is_empty(dst_blocks):
            # Nothing to send (a full prefix-cache hit): DONE at once below.
            # Never "pending forever because no transfer will report it".
            plan = TransferPlan(peer, (), 0, 0)
        else:
            plan = build_plan(
                self.source,
                p.info,
                src_blocks,
                dst_blocks,
                max_batch_entries=self.max_batch_entries,
            )
        lc = RequestLifecycle(
            request_id, max_attempts=self.retry_policy.max_attempts, journal=self._journal
        )
        now = time.monotonic()
        entry = _Entry(lc, plan, now + deadline_s, now, priority, release or self._release_default)
        entry.seq = next(self._seq)
        with self._lock:
            if self._closed:
                raise SchedulerClosed(f"scheduler is closed; cannot submit {request_id!r}")
            if request_id in self._entries:
                raise DuplicateRequest(f"request id {request_id!r} is already in use")
            self._entries[request_id] = entry
            p.live.add(request_id)
            alive = p.alive
        lc.add_done_callback(lambda _lc, e=entry: self._on_terminal(e))  # type: ignore[misc]
        if not plan.batches:
            lc.start()
            lc.complete()
            return lc
        if not alive:
            lc.fail(
                FailureReason.PEER_LOST,
                PeerUnreachable(f"peer {peer} is marked lost; not sending", peer=peer),
            )
            return lc
        with self._deadline_cv:
            heapq.heappush(self._deadlines, (entry.deadline, entry.seq, request_id))
            if self._deadlines[0][1] == entry.seq:
                self._deadline_cv.notify()
        with self._lock:
            heapq.heappush(self._queue, (-priority, entry.seq, entry))
            # One wake-up of the loop per burst of submits, not per submit:
            # each call_soon_threadsafe is a write to the loop's self-pipe.
            schedule, self._pump_scheduled = not self._pump_scheduled, True
        if schedule:
            # A close() racing us may have closed the loop; it also failed
            # this request with SHUTDOWN, so there is nothing left to pump.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._pump)
        return lc

    # -- outcomes -------------------------------------------------------------

    def poll(self) -> list[Finished]:
        """Requests that became terminal since the last poll(); never blocks."""
        out: list[Finished] = []
        while True:
            try:
                out.append(self._finished.popleft())
            except IndexError:
                return out

    def _find(self, request_id: str) -> tuple[RequestLifecycle, float]:
        """The request's lifecycle and the latest a waiter may wait for it.

        Released requests are still found among the last ``RECENT`` ones, so
        ``submit(); wait(id)`` works however fast the request ended.
        """
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                return entry.lifecycle, entry.deadline
            lc = self._recent.get(request_id)
        if lc is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        return lc, 0.0  # terminal: nothing to wait for

    def get(self, request_id: str) -> RequestLifecycle:
        return self._find(request_id)[0]

    def wait(self, request_id: str, timeout: float | None = None) -> TransferState:
        """Block until the request is terminal, ``timeout`` passes, or its
        deadline passes (whichever is first); return its state."""
        lc, deadline = self._find(request_id)
        return lc.wait(_bounded(deadline, timeout))

    async def wait_async(self, request_id: str, timeout: float | None = None) -> TransferState:
        """asyncio form of wait(); cancelling the await does not abort the request."""
        lc, deadline = self._find(request_id)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake(_lc: RequestLifecycle) -> None:
            loop.call_soon_threadsafe(resolve)

        lc.add_done_callback(wake)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), _bounded(deadline, timeout))
        return lc.state

    def abort(self, request_id: str) -> bool:
        """Fail the request with ABORTED. False if it was already terminal."""
        return self._find(request_id)[0].fail(FailureReason.ABORTED)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every request is terminal and released; True if so."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._entries:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Refuse new submits, fail live requests with SHUTDOWN, stop threads.

        Returns drain()'s answer: False if some op had not quiesced in time
        (its blocks stay unreleased, never released early).
        """
        with self._lock:
            self._closed = True
            live = list(self._entries.values())
        for e in live:
            e.lifecycle.fail(FailureReason.SHUTDOWN)
        drained = self.drain(timeout)
        self._stop.set()
        with self._deadline_cv:
            self._deadline_cv.notify_all()
        self._releases.put(None)
        if not self._loop.is_closed():
            # Workers still pending (a hung op past drain's timeout, or tasks
            # just created) are cancelled and awaited, not destroyed pending.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._cancel_workers(), self._loop).result(1.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
        for t in self._threads:
            t.join(timeout=1.0)
        if not self._threads[0].is_alive() and not self._loop.is_closed():
            self._loop.close()
        return drained

    async def _cancel_workers(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation ------------------------------------------------------------

    def metrics(self) -> MetricsSnapshot:
        now = time.monotonic()
        with self._lock:
            by_state: Counter[str] = Counter()
            oldest = 0.0
            quarantined = 0
            for e in self._entries.values():
                state = e.lifecycle.state
                if e.terminal_at is None:
                    by_state[state.name] += 1
                    oldest = max(oldest, now - e.submitted)
                else:
                    quarantined += 1
            return MetricsSnapshot(
                done=self._done,
                failed_by_reason=dict(self._failed),
                live_by_state={s.name: by_state.get(s.name, 0) for s in _LIVE_STATES},
                quarantined=quarantined,
                oldest_live_age_s=oldest,
                released=self._released,
                released_before_quiesce=self._released_before_quiesce,
                double_releases=self._double_releases,
                peers_lost=self._peers_lost,
                bytes_done=self._bytes_done,
            )

    def live_requests(self) -> list[RequestLifecycle]:
        with self._lock:
            return [e.lifecycle for e in self._entries.values() if e.terminal_at is None]

    def live_entries(self) -> list[tuple[RequestLifecycle, str, float]]:
        """(lifecycle, peer, submitted at on time.monotonic()) of each live request."""
        with self._lock:
            return [
                (e.lifecycle, e.peer, e.submitted)
                for e in self._entries.values()
                if e.terminal_at is None
            ]

    # -- internals: completion and release -------------------------------------

    def _on_terminal(self, entry: _Entry) -> None:
        # Runs once per request (done-callback), in whichever thread won.
        lc = entry.lifecycle
        now = time.monotonic()
        self._wake(entry)
        for op in entry.ops:
            op.cancel()  # no new batches; the one in flight finishes or times out
        with self._lock:
            entry.terminal_at = now
            if lc.state is TransferState.DONE:
                self._done += 1
                self._bytes_done += entry.plan.nbytes
            else:
                assert lc.reason is not None
                self._failed[lc.reason.name] += 1
            ops = list(entry.ops)
        finished = self._outcome(entry)
        self._finished.append(finished)
        for observe in self._observers:
            try:
                observe(finished)
            except Exception:
                _log.exception("observer_failed", request_id=lc.request_id)
        if not ops:
            self._maybe_release(entry)
        for op in ops:
            op.add_quiesce_callback(lambda _op, e=entry: self._maybe_release(e))  # type: ignore[misc]

    def _maybe_release(self, entry: _Entry) -> None:
        with self._lock:
            if entry.terminal_at is None or entry.released or entry.worker:
                return  # a worker that may still submit an op comes back here when it exits
            if not all(op.quiesced for op in entry.ops):
                return  # a later quiesce callback comes back here
            entry.released = True
        self._releases.put(entry)

    def _release_loop(self) -> None:
        while (entry := self._releases.get()) is not None:
            rid = entry.lifecycle.request_id
            # Re-checked right before the callback, independently of how the
            # entry got here: a violation is a bug somewhere, and it is
            # counted (and a second release is not performed).
            with self._lock:
                if self._entries.get(rid) is not entry:
                    self._double_releases += 1
                    continue
                if not all(op.quiesced for op in entry.ops):
                    self._released_before_quiesce += 1
            finished = self._outcome(entry)
            if entry.release is not None:
                try:
                    entry.release(finished.request_id, finished)
                except Exception:
                    _log.exception("release_callback_failed", request_id=finished.request_id)
            # Only now is the id free again: until the blocks are back, a new
            # request under the same id would be ambiguous.
            with self._lock:
                self._released += 1
                del self._entries[rid]
                self._recent[rid] = entry.lifecycle
                self._recent.move_to_end(rid)
                if len(self._recent) > RECENT:
                    self._recent.popitem(last=False)
                peer = self._peers.get(entry.peer)
                if peer is not None:
                    peer.live.discard(rid)
                if not self._entries:
                    self._idle.notify_all()

    def _outcome(self, entry: _Entry) -> Finished:
        lc = entry.lifecycle
        end = entry.terminal_at if entry.terminal_at is not None else time.monotonic()
        return Finished(
            lc.request_id,
            lc.state,
            lc.reason,
            lc.error,
            lc.attempt,
            entry.peer,
            entry.plan.nbytes,
            end - entry.submitted,
        )

    # -- internals: threads ---------------------------------------------------

    def _pump(self) -> None:
        # Loop thread: start queued workers while slots are free.
        with self._lock:
            self._pump_scheduled = False
        if self._stop.is_set():
            return  # closing: queued requests were failed with SHUTDOWN already
        while self._running < self._workers:
            with self._lock:
                if not self._queue:
                    return
                _, _, entry = heapq.heappop(self._queue)
                entry.worker = True
            self._running += 1
            task = self._loop.create_task(self._worker(entry))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._worker_done, entry))

    def _worker_done(self, entry: _Entry, task: asyncio.Task[None]) -> None:
        # Loop thread, once per worker, however it ended.
        self._tasks.discard(task)
        self._running -= 1
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            # The guard already failed the request; this is for the operator.
            _log.error("worker_crashed", request_id=entry.lifecycle.request_id, exc_info=exc)
        if not entry.lifecycle.is_terminal:
            # Only a task cancelled before its first step gets here: its
            # guard never ran (I3).
            cause = asyncio.CancelledError() if task.cancelled() else exc
            entry.lifecycle.fail(exit_reason(cause), cause)
        # An op the worker submitted as the request went terminal (abort,
        # deadline, peer loss between backend.submit() and ops.append())
        # escaped the _on_terminal snapshot: every op is known only now (I6).
        with self._lock:
            entry.worker = False
            ops = list(entry.ops)
        for op in ops:
            op.add_quiesce_callback(lambda _op, e=entry: self._maybe_release(e))  # type: ignore[misc]
        self._maybe_release(entry)
        self._pump()

    def _wake(self, entry: _Entry) -> None:
        # Any thread: wake the entry's worker, if it has one waiting.
        wake = entry.wake
        if wake is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed under us
                self._loop.call_soon_threadsafe(wake.set)

    async def _worker(self, entry: _Entry) -> None:
        """One request, start to terminal, inside one guarded scope."""
        lc = entry.lifecycle
        wake = entry.wake = asyncio.Event()
        async with CompletionGuard(lc):
            while lc.start():  # False: already failed (abort, deadline) while queued
                wake.clear()
                op = self.backend.submit(entry.plan)
                with self._lock:
                    entry.ops.append(op)
                op.add_done_callback(lambda _op: self._wake(entry))
                if lc.is_terminal:
                    op.cancel()  # lost a race with abort/deadline after start()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), entry.deadline - time.monotonic())
                if lc.is_terminal:
                    return
                if not op.done:
                    timeout = TransferTimeout(
                        f"request {lc.request_id!r} missed its deadline", peer=entry.peer
                    )
                    lc.fail(FailureReason.TIMEOUT, timeout)
                    return
                err = op.error
                if err is None:
                    lc.complete()
                    return
                if err.reason is FailureReason.PEER_LOST:
                    self._peer_lost(entry.peer, err)
                    lc.fail(err.reason, err)
                    return
                if not (err.retryable and lc.attempt < lc.max_attempts):
                    lc.fail(err.reason, err)
                    return
                lc.retry()
                wake.clear()
                backoff = min(
                    self.retry_policy.delay(lc.attempt), entry.deadline - time.monotonic()
                )
                if backoff > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), backoff)

    def _watchdog_loop(self) -> None:
        heap = self._deadlines
        while not self._stop.is_set():
            with self._deadline_cv:
                now = time.monotonic()
                expired: list[tuple[int, str]] = []
                while heap and heap[0][0] <= now:
                    _, seq, rid = heapq.heappop(heap)
                    expired.append((seq, rid))
                if not expired:
                    self._deadline_cv.wait(heap[0][0] - now if heap else None)
                    continue
            for seq, rid in expired:
                with self._lock:
                    entry = self._entries.get(rid)
                if entry is None or entry.seq != seq:
                    continue
                lc = entry.lifecycle
                if not lc.is_terminal:
                    lc.fail(
                        FailureReason.TIMEOUT,
                        TransferTimeout(
                            f"request {lc.request_id!r} missed its deadline "
                            f"(in state {lc.state.name}, attempt {lc.attempt})",
                            peer=entry.peer,
                        ),
                    )

    def _prober_loop(self) -> None:
        # Revives dead peers; finds dead ones that have requests in flight.
        while not self._stop.wait(self.probe_interval_s):
            with self._lock:
                targets = [
                    (sid, p.alive) for sid, p in self._peers.items() if p.live or not p.alive
                ]
            for sid, alive in targets:
                try:
                    self.backend.probe(sid)
                except TransferError as exc:
                    if alive:
                        self._peer_lost(sid, PeerLost(f"probe failed: {exc}", peer=sid))
                    continue
                except Exception:
                    _log.exception("probe_crashed", peer=sid)
                    continue
                if not alive:
                    with contextlib.suppress(UnknownPeer):  # removed meanwhile
                        self.mark_peer_alive(sid)


_LIVE_STATES = (TransferState.PENDING, TransferState.TRANSFERRING)

RECENT = 4096  # released requests remembered for get()/wait()/abort()

# Past its deadline the watchdog fails a request; this covers the watchdog's
# own wake-up latency, so a waiter returns a terminal state.
_WAIT_GRACE_S = 0.05


def _bounded(deadline: float, timeout: float | None) -> float:
    left = deadline - time.monotonic() + _WAIT_GRACE_S
    return max(0.0, left if timeout is None else min(timeout, left))


def _is_empty(blocks: object) -> bool:
    return isinstance(blocks, list | tuple | range) and len(blocks) == 0


def _check_deadline(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or value == float("inf")
    ):
        raise InvalidRequest(f"{name} must be a positive finite number of seconds, got {value!r}")
