"""The scheduler core: single owner of request progress, driven by ``step(now)``.

Sans-I/O in h11's sense for its decisions: the core's time is the ``now``
given to ``step``, it never sleeps or waits on anything but a short lock,
never starts a thread and never runs a user callback (release callbacks,
observers and done-callbacks are deferred to the callback thread; probes
run on the prober thread). Everything that happened since the last step
waits in the inbox. One step:

1. applies the inbox, in arrival order: new requests, terminal transitions
   made elsewhere (abort, peer removal, close), op results, quiescence and
   probe results;
2. fires due deadlines: a request not terminal at the first step at or after
   its deadline becomes FAILED(TIMEOUT) in that step;
3. starts the retries whose backoff ended;
4. admits queued requests, highest priority first, under ``max_in_flight``;
5. hands out the terminal requests whose ops have all quiesced (no engine
   call can touch their blocks any more: only now may they be released);

and repeats 1-5 until the inbox is empty. It returns what became terminal,
what may be released, which peers to probe, and when it next needs a step.
Drivers (``_drivers.py``) and ``Scheduler`` do the rest: run callbacks, probes.

A step does make these calls, none of which blocks, and each for a reason:

* ``backend.submit(plan)``, when an attempt starts. ``TransferBackend``
  promises that submit never blocks on the network and reports failures
  through the op (Mooncake checks the plan and posts it to its engine
  loop; the local backend hands it to its pool). Submitting in the step
  means the op exists in the step that counted the attempt, so the same
  step's deadline or abort can cancel it, at no cost per request; handing
  plans back to the driver instead would add a hop per attempt and leave a
  RUNNING request with no op between two steps.
* ``op.add_done_callback``, ``op.add_quiesce_callback`` and ``op.cancel()``:
  the op's lock, or a flag. A callback on an op that already has its
  result runs at once, and it only posts to the inbox.
* The lifecycle's transitions (start, complete, fail, retry). Each hands
  one record to the journal, and where it goes -- nowhere, a structlog
  sink of the application's, or a ``JsonlJournal``'s flushed line -- is
  the application's choice; a failing sink is contained by the journal.
  The record carries the lifecycle's own ``time.monotonic()`` stamp,
  which no decision of the core reads.
* The core's own structlog events, one per peer change and none per
  request (``_peer_changes``). A crashed worker's traceback is rendered
  on the callback thread, not in the step.
* ``defer(fn)`` (the callback runner's queue) and the driver's ``wake()``.

Who may end a request, exactly once: the core (complete, a typed failure, TIMEOUT,
PEER_LOST, the guard), and any thread through the request's lifecycle
(abort, peer removal, close). The lifecycle's lock makes the first one win;
its done-hook posts to the inbox, so the core learns of every ending.

The guard: each request advances through ``_work`` -- its worker body --
one step at a time, always inside ``_advance``. A body that raises ends its
request with ``exit_reason`` (WORKER_CRASHED for an ordinary exception); a
body that returns without waiting on something (an op, a backoff) and
without a terminal transition ends it with WORKER_EXITED: no way out of a
worker leaves its request live.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, cast

import structlog

from lifecycle import FailureReason, Journal, RequestLifecycle, TransferState, exit_reason
from transfer import PeerInfo, TransferBackend, TransferOp, TransferPlan, TransferTimeout

from ._lazyheap import LazyHeap
from ._peer_changes import PeerChanges
from ._peers import Peers
from ._phase import ENDABLE, Phase, move
from ._records import Finished, ReleaseCallback, RetryPolicy, detach_traceback
from ._release import ReleaseChecks, ReleaseQuarantine
from ._requests import RequestRecord, RequestTable, ScheduledLifecycle, fail_all, settle

__all__ = ["SchedulerCore", "StepResult"]

_log = structlog.get_logger("kvguard.scheduler")
# An Enum class lookup costs ~150 ns: once here.
_DONE = TransferState.DONE
_NEW, _QUEUED, _RUNNING = Phase.NEW, Phase.QUEUED, Phase.RUNNING
_BACKOFF, _FINISHED, _RELEASING = Phase.BACKOFF, Phase.FINISHED, Phase.RELEASING


class StepResult(NamedTuple):
    finished: list[Finished]  # became terminal in this step, in order
    releases: list[RequestRecord]  # terminal and quiesced: run their release, then forget them
    probes: list[str]  # peers to probe now; report with probe_result()
    wakers: list[Callable[[], object]]  # waiters of the finished requests, to wake
    next_at: float | None  # step again by then at the latest (None: only on input)


class SchedulerCore(PeerChanges):
    """Request state and its transitions; driven by ``step(now)``.

    Its peer inputs and their handlers are ``PeerChanges``'s.
    """

    def __init__(
        self,
        backend: TransferBackend,
        *,
        max_in_flight: int,
        retry: RetryPolicy,
        probe_interval_s: float,
        peer_lost_after_probes: int,
        journal: Journal | None,
        defer: Callable[[Callable[[], object]], None],
    ) -> None:
        self.backend = backend
        self.retry = retry
        self.max_in_flight = max_in_flight
        self.probe_interval_s = probe_interval_s
        self.journal = journal
        self.defer = defer  # runs a user callback on the callback thread
        self.table = RequestTable(Peers(peer_lost_after_probes))
        self._ended_hook = self._ended  # bound once: every request shares it
        self.checks = ReleaseChecks()
        # Everything below belongs to the thread inside step(), under _lock;
        # readers (metrics) take _lock too and never see a half-applied step.
        self._lock = threading.Lock()
        self._now = 0.0  # the time step() was given
        self._owner: int | None = None  # the thread inside step(), while it is
        self._running = 0  # requests RUNNING or in BACKOFF; <= max_in_flight
        # Lazy-deletion heaps: an item is wanted while its request is in the
        # phase the heap serves; the core discard()s it when the request leaves.
        # The queue is keyed by -priority: the highest priority pops first.
        self._queue: LazyHeap[int, RequestRecord] = LazyHeap(lambda r: r.phase is _QUEUED)
        self._deadlines: LazyHeap[float, RequestRecord] = LazyHeap(lambda r: r.phase in ENDABLE)
        self._backoffs: LazyHeap[float, RequestRecord] = LazyHeap(lambda r: r.phase is _BACKOFF)
        self._quarantine = ReleaseQuarantine()
        self._finished: list[Finished] = []  # this step's outcomes
        self._reported: list[RequestRecord] = []  # this step's terminal requests
        self._releases: list[RequestRecord] = []  # this step's hand-outs
        self.done = 0
        self.failed: Counter[str] = Counter()
        self.bytes_done = 0

    # -- any thread: inputs ----------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        plan: TransferPlan,
        now: float,
        deadline_s: float,
        priority: int,
        release: ReleaseCallback | None,
    ) -> RequestRecord:
        lc = ScheduledLifecycle(
            request_id,
            self.defer,
            self._ended_hook,
            max_attempts=self.retry.max_attempts,
            journal=self.journal,
        )
        return RequestRecord(lc, plan, now, deadline_s, priority, release)

    def _ended(self, lc: RequestLifecycle) -> None:
        # Every request's first done-callback, once, in the thread that ended it.
        req = cast(ScheduledLifecycle, lc).take_request()
        if req is not None and self._owner != threading.get_ident():
            self.table.post(self._on_terminal, req)  # the core handles its own endings

    def accept(self, req: RequestRecord, info: PeerInfo) -> None:
        """Admit ``req`` (see RequestTable.admit); the caller retries on LookupError."""
        self.table.admit(req, info, self._on_new, settle)
        self.table.wake()

    def shutdown(self) -> list[RequestRecord]:
        """Refuse submits; fail every live request with SHUTDOWN."""
        live = self.table.close()
        fail_all(live, FailureReason.SHUTDOWN, None)
        self.table.wake()
        return live

    # -- the step ------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        table = self.table
        with self._lock:
            self._now = now
            self._owner = threading.get_ident()
            inbox = table.inbox
            while True:
                while inbox:
                    fn, args = inbox.popleft()
                    fn(*args)
                for req in self._deadlines.pop_due(now):
                    self._expire(req)
                for req in self._backoffs.pop_due(now):
                    self._advance(req)
                self._admit()
                if not inbox:
                    break
            with table.lock:
                probes = table.peers.due_probes(now)
                probe_at = table.peers.next_probe_at()
            finished, self._finished = self._finished, []
            releases, self._releases = self._releases, []
            reported, self._reported = self._reported, []
            next_at = probe_at
            for t in (self._deadlines.next_key(), self._backoffs.next_key()):
                if t is not None and (next_at is None or t < next_at):
                    next_at = t
            self._owner = None
        wakers = table.report(reported) if reported else []
        return StepResult(finished, releases, probes, wakers, next_at)

    # -- inbox handlers (step only) -------------------------------------------------

    def _on_new(self, req: RequestRecord) -> None:
        move(req, _QUEUED)
        if req.lc.is_terminal:  # empty plan, dead peer, or ended before we saw it
            self._finish(req)
            return
        self._deadlines.push(req.deadline, req)
        self._queue.push(-req.priority, req)

    def _on_terminal(self, req: RequestRecord) -> None:
        if req.phase is not _NEW:  # NEW: _on_new, later in the inbox, finishes it
            self._finish(req)

    def _on_op_done(self, req: RequestRecord, op: TransferOp) -> None:
        if req.phase is _RUNNING and op is req.op:
            self._advance(req)

    def _on_op_quiesced(self, req: RequestRecord, op: TransferOp) -> None:
        req.unquiesced -= 1
        if req.phase is _FINISHED and self._quarantine.take(req):
            move(req, _RELEASING)
            self._releases.append(req)

    # -- timers and admission (step only) ------------------------------------------------

    def _expire(self, req: RequestRecord) -> None:
        lc = req.lc
        lc.fail(
            FailureReason.TIMEOUT,
            TransferTimeout(
                f"request {req.request_id!r} missed its deadline "
                f"(in state {lc.state.name}, attempt {lc.attempt})",
                peer=req.peer,
            ),
        )
        self._finish(req, expired=True)

    def _admit(self) -> None:
        pop = self._queue.pop
        while self._running < self.max_in_flight:
            req = pop()  # highest priority first, FIFO among equals
            if req is None:
                return
            self._running += 1
            move(req, _RUNNING)
            self._advance(req)

    # -- one request's worker, guarded (step only) -------------------------------------

    def _advance(self, req: RequestRecord) -> None:
        """Run the request's worker body once, inside the guard: every exit ends it or waits."""
        lc = req.lc
        try:
            waiting = self._work(req)
        except BaseException as exc:
            waiting = False
            if lc.fail(exit_reason(exc), exc):
                # Rendering a traceback can take longer than a deadline's
                # slack: it is logged on the callback thread, not in the step.
                self.defer(partial(_crashed, req.request_id, (type(exc), exc, exc.__traceback__)))
        if not waiting:
            if not lc.is_terminal:
                lc.fail(FailureReason.WORKER_EXITED)
            self._finish(req)

    def _work(self, req: RequestRecord) -> bool:
        """The worker body: True while it waits for an op or a backoff."""
        op = req.op
        if op is None:
            return self._start_attempt(req)
        req.op = None
        return self._conclude(req, op)

    def _start_attempt(self, req: RequestRecord) -> bool:
        if not req.lc.start():
            return False  # ended while queued or backing off
        if req.phase is _BACKOFF:
            move(req, _RUNNING)  # a retry (the first attempt runs since admission)
        op = self.backend.submit(req.plan)
        req.op = op
        req.ops.append(op)
        post = self.table.post
        op.add_quiesce_callback(partial(post, self._on_op_quiesced, req))
        req.unquiesced += 1
        op.add_done_callback(partial(post, self._on_op_done, req))
        return True

    def _conclude(self, req: RequestRecord, op: TransferOp) -> bool:
        """The op has its result: complete, fail with its reason, or back off."""
        lc, err = req.lc, op.error
        if lc.is_terminal:
            return False  # ended elsewhere (abort, close) first: the result is moot
        if err is None:
            lc.complete()
            return False
        if err.reason is FailureReason.PEER_LOST:
            lc.fail(err.reason, err)
            self._lose_now(req.peer, err)
            return False
        if not (err.retryable and lc.attempt < lc.max_attempts):
            lc.fail(err.reason, err)
            return False
        if not lc.retry():
            return False
        move(req, _BACKOFF)
        self._backoffs.push(self._now + self.retry.delay(lc.attempt), req)
        return True

    # -- terminal, quarantine, release (step only) -----------------------------------------

    def _finish(self, req: RequestRecord, *, expired: bool = False) -> None:
        phase = req.phase
        if phase not in ENDABLE:
            return  # NEW: _on_new, later in the inbox, finishes it; or finished already
        move(req, _FINISHED)  # first: a compaction drops its items too
        if phase is _QUEUED:
            self._queue.discard()
        else:
            self._running -= 1
            if phase is _BACKOFF:
                self._backoffs.discard()
        if not expired:
            self._deadlines.discard()
        op, req.op = req.op, None
        if op is not None:
            op.cancel()  # no new batches; the running one ends or times out
        lc = req.lc
        state, reason, error = lc.outcome  # one consistent snapshot
        detach_traceback(error)
        nbytes = req.plan.nbytes
        if state is _DONE:
            self.done += 1
            self.bytes_done += nbytes
        else:  # FAILED: its outcome always carries the reason
            self.failed[cast(FailureReason, reason).name] += 1
        fin = Finished(
            req.request_id,
            state,
            reason,
            error,
            lc.attempt,
            req.peer,
            nbytes,
            self._now - req.submitted,
        )
        req.finished = fin
        self._finished.append(fin)
        self._reported.append(req)
        if self._quarantine.enter(req):
            move(req, _RELEASING)
            self._releases.append(req)

    # -- reads (any thread) ------------------------------------------------------------

    def quarantine(self) -> tuple[int, int]:
        """(requests, bytes) terminal but not yet releasable; call under ``lock``."""
        return len(self._quarantine), self._quarantine.nbytes

    def quarantined(self) -> list[RequestRecord]:
        """The quarantined requests, oldest terminal first; call under ``lock``."""
        return self._quarantine.held()

    def sizes(self) -> dict[str, int]:
        """Sizes of every container the core keeps: bounded by live requests, not traffic."""
        with self._lock:
            return {
                "table": len(self.table),
                "queue": len(self._queue),
                "deadlines": len(self._deadlines),
                "backoffs": len(self._backoffs),
                "quarantine": len(self._quarantine),
                "inbox": len(self.table.inbox),
            }

    @property
    def lock(self) -> threading.Lock:
        return self._lock


def _crashed(request_id: str, exc_info: object) -> None:
    _log.error("worker_crashed", request_id=request_id, exc_info=exc_info)
