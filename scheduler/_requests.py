"""The request table: every request from submit() until its release.

``RequestRecord`` is one request's record. ``RequestTable`` is the scheduler's
only thread-safe state, under one lock: the ids in use (so that submit()
can answer DuplicateRequest at once), the peers (so that peer changes are
atomic with submit), the inbox through which other threads hand inputs to
the core, the waiters of wait()/wait_async(), and a bounded memory of
released requests. Everything else about a request belongs to the core,
which alone runs step().
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, NamedTuple

from lifecycle import DoneCallback, FailureReason, Journal, RequestLifecycle, TransferState
from transfer import PeerInfo, PeerUnreachable, TransferOp, TransferPlan

from ._peers import Peers
from ._phase import Phase
from ._records import Finished, ReleaseCallback
from .errors import DuplicateRequest, SchedulerClosed, UnknownPeer

__all__ = [
    "RECENT",
    "RequestRecord",
    "RequestTable",
    "ScheduledLifecycle",
    "Tombstone",
    "fail_all",
    "settle",
]

RECENT = 4096  # released requests remembered for wait()/abort()/get()


class ScheduledLifecycle(RequestLifecycle):
    """A RequestLifecycle whose done-callbacks run on the callback thread.

    The core makes terminal transitions inside step(); a slow or raising
    done-callback run there would delay every other request's deadline.
    ``add_done_callback`` therefore defers the call: still exactly once,
    after the terminal transition, but on the scheduler's callback thread.
    """

    __slots__ = ("_defer", "_request")

    _defer: Callable[[Callable[[], object]], None]
    # Set by RequestRecord.__init__; taken (and cleared) by the scheduler's hook at
    # the terminal transition, so no cycle outlives the request: a caller
    # holding the lifecycle does not pin the plan, ops and error.
    _request: RequestRecord | None

    def __init__(
        self,
        request_id: str,
        defer: Callable[[Callable[[], object]], None],
        ended: DoneCallback,
        *,
        max_attempts: int,
        journal: Journal | None,
    ) -> None:
        """``ended(lc)``: the scheduler's own done-callback, shared by every
        request; it runs first and inline, in the thread that ended it."""
        super().__init__(request_id, max_attempts=max_attempts, journal=journal)
        self._defer = defer
        super().add_done_callback(ended)  # the base class: inline, not deferred

    def take_request(self) -> RequestRecord | None:
        """The request, the first time only (the scheduler's hook calls it)."""
        req, self._request = self._request, None
        return req

    def add_done_callback(self, fn: DoneCallback) -> None:
        defer = self._defer
        super().add_done_callback(lambda lc: defer(lambda: fn(lc)))


class RequestRecord:
    """What the scheduler keeps of one request, from submit() until its release.

    Fields marked (core) are read and written by step() only.
    """

    __slots__ = (
        "deadline",
        "finished",
        "lc",
        "op",
        "ops",
        "peer",
        "phase",
        "plan",
        "priority",
        "release",
        "reported",
        "request_id",
        "submitted",
        "unquiesced",
        "wakers",
    )

    request_id: str
    lc: ScheduledLifecycle  # one terminal transition, under its lock: the first ending wins
    plan: TransferPlan  # validated against the peer's advertisement at admission
    peer: str
    deadline: float  # absolute, core clock: terminal at the first step at or after it
    submitted: float  # core clock
    priority: int  # higher first; FIFO among equals
    release: ReleaseCallback | None
    phase: Phase  # (core) changed by _phase.move only, along its EDGES
    op: TransferOp | None  # (core) the op of the current attempt, until its result is read
    ops: list[TransferOp]  # (core) every op submitted for it; at most max_attempts
    unquiesced: int  # (core) ops not yet quiesced; its blocks are released only at 0
    finished: Finished | None  # (core) set once, when the core sees it terminal
    reported: bool  # (table lock) the core has seen it terminal; waiters return
    wakers: list[Callable[[], object]] | None  # (table lock) called once when reported

    def __init__(
        self,
        lc: ScheduledLifecycle,
        plan: TransferPlan,
        now: float,
        deadline_s: float,
        priority: int,
        release: ReleaseCallback | None,
    ) -> None:
        self.request_id = lc.request_id
        self.lc = lc
        lc._request = self
        self.plan = plan
        self.peer = plan.peer
        self.deadline = now + deadline_s
        self.submitted = now
        self.priority = priority
        self.release = release
        self.phase = Phase.NEW
        self.op = None
        self.ops = []
        self.unquiesced = 0
        self.finished = None
        self.reported = False
        self.wakers = None


class Tombstone(NamedTuple):
    """What is remembered of a released request: no plan, no error, no lifecycle."""

    state: TransferState
    reason: FailureReason | None
    lifecycle: weakref.ref[RequestLifecycle]  # get() answers while the caller holds it


Input = tuple[Callable[..., object], tuple[Any, ...]]


class RequestTable:
    """Ids in use, peers, inbox and waiters, under one lock."""

    __slots__ = (
        "_by_id",
        "_recent",
        "closed",
        "idle",
        "inbox",
        "lock",
        "peers",
        "released",
        "wake",
    )

    lock: threading.Lock
    idle: threading.Condition  # on lock; notified when _by_id empties
    closed: bool  # no submit is accepted once True
    _by_id: dict[str, RequestRecord]  # submit() .. release callback returned; ids unique
    _recent: OrderedDict[str, Tombstone]  # the last RECENT released, oldest first
    peers: Peers[RequestRecord]
    inbox: deque[Input]  # inputs for the core, in arrival order; drained by step()
    wake: Callable[[], None]  # tells the driver the inbox has something
    released: int  # release callbacks that returned (or raised)

    def __init__(self, peers: Peers[RequestRecord]) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.closed = False
        self._by_id = {}
        self._recent = OrderedDict()
        self.peers = peers
        self.inbox = deque()
        self.wake = _nothing
        self.released = 0

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Any thread: hand the core an input; step() will call fn(*args)."""
        self.inbox.append((fn, args))
        self.wake()

    def __len__(self) -> int:
        return len(self._by_id)

    # -- admission ---------------------------------------------------------------

    def peer_info(self, session_id: str) -> PeerInfo:
        with self.lock:
            peer = self.peers.get(session_id)
            if peer is None:
                raise UnknownPeer(f"unknown peer {session_id!r}; call add_peer() first")
            return peer.info

    def admit(
        self,
        req: RequestRecord,
        info: PeerInfo,
        on_new: Callable[[RequestRecord], object],
        settle: Callable[[RequestRecord, bool], object],
    ) -> None:
        """Accept ``req`` atomically with peer changes.

        ``settle(req, peer_alive)`` runs under the lock before the core hears
        of the request: it may end it at once (an empty plan, a dead peer),
        so the core sees it terminal from the start.

        Raises SchedulerClosed, DuplicateRequest, UnknownPeer (removed since
        its plan was built), or LookupError when the peer was replaced since
        (the caller builds the plan again).
        """
        rid = req.request_id
        with self.lock:
            if self.closed:
                raise SchedulerClosed(f"scheduler is closed; cannot submit {rid!r}")
            if rid in self._by_id:
                raise DuplicateRequest(f"request id {rid!r} is already in use")
            peer = self.peers.get(req.peer)
            if peer is None:
                raise UnknownPeer(f"unknown peer {req.peer!r}; call add_peer() first")
            if peer.info is not info:
                raise LookupError(req.peer)
            self._by_id[rid] = req
            self._recent.pop(rid, None)
            peer.live.add(req)
            settle(req, peer.alive)
            self.inbox.append((on_new, (req,)))

    def find(self, request_id: str) -> RequestRecord | Tombstone | None:
        with self.lock:
            return self._by_id.get(request_id) or self._recent.get(request_id)

    def requests(self) -> list[RequestRecord]:
        with self.lock:
            return list(self._by_id.values())

    def close(self) -> list[RequestRecord]:
        with self.lock:
            self.closed = True
            return list(self._by_id.values())

    # -- waiters -------------------------------------------------------------------

    def add_waker(self, req: RequestRecord, fn: Callable[[], object]) -> bool:
        """Call ``fn`` once the core has seen ``req`` terminal; False if it has."""
        with self.lock:
            if req.reported:
                return False
            if req.wakers is None:
                req.wakers = []
            req.wakers.append(fn)
            return True

    def report(self, reqs: list[RequestRecord]) -> list[Callable[[], object]]:
        """Mark reported; returns the wakers to call (outside the lock)."""
        out: list[Callable[[], object]] = []
        with self.lock:
            for req in reqs:
                req.reported = True
                if req.wakers:
                    out.extend(req.wakers)
                req.wakers = None
        return out

    def wakers_of_all(self) -> list[Callable[[], object]]:
        """Every waiter's waker (the driver died: nobody will report)."""
        with self.lock:
            return [fn for r in self._by_id.values() for fn in (r.wakers or ())]

    # -- release ---------------------------------------------------------------------

    def holds(self, req: RequestRecord) -> bool:
        """Under ``lock``: is ``req`` the request its id stands for?"""
        return self._by_id.get(req.request_id) is req

    def forget(self, req: RequestRecord, releasing: set[RequestRecord]) -> bool:
        """The release callback returned: free the id. False if it was not held."""
        rid = req.request_id
        with self.lock:
            releasing.discard(req)
            if self._by_id.get(rid) is not req:
                return False
            del self._by_id[rid]
            self.released += 1
            peer = self.peers.get(req.peer)
            if peer is not None:
                peer.live.discard(req)
            lc = req.lc
            self._recent[rid] = Tombstone(lc.state, lc.reason, weakref.ref(lc))
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            if not self._by_id:
                self.idle.notify_all()
            return True

    def wait_idle(self, timeout: float | None) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: not self._by_id, timeout)


def settle(req: RequestRecord, alive: bool) -> None:
    # Under the table lock, before the core sees the request.
    lc = req.lc
    if not req.plan.batches:
        # Nothing to send (a full prefix-cache hit): DONE at once, never
        # "pending forever because no transfer will report it".
        lc.start()
        lc.complete()
    elif not alive:
        lc.fail(
            FailureReason.PEER_LOST,
            PeerUnreachable(f"peer {req.peer} is marked lost; not sending", peer=req.peer),
        )


def fail_all(reqs: list[RequestRecord], reason: FailureReason, err: BaseException | None) -> int:
    return sum(r.lc.fail(reason, err) for r in reqs)


def _nothing() -> None:
    pass
