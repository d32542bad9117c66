"""Hypothesis stateful test of the Scheduler over FaultInjectingBackend(LocalBackend),
and the same machine over FaultInjectingBackend(MooncakeBackend), the real engine
with a decode process on loopback (``TestSchedulerMooncake``, marker ``mooncake``).

Hypothesis interleaves submits (some invalid, some duplicates, some empty),
aborts, peer deaths and returns, hung engine calls and their release, worker
crashes, deadline expiries and waits, over real threads (the scheduler's
driver, prober and callback threads, the backend's workers). Each request
carries its own fault script, one fault per attempt (``Recorder`` hands the
fault injector the submitting request's next one), so what happens to a
request does not depend on which worker reached the backend first.

A model predicts, for every request, the exact state, reason, error type and
attempt its script and the rules must produce: a retryable fault retries
until the third attempt; a hang holds its slot until released, aborted, lost
or its deadline; a queued request is admitted by priority, then FIFO, when a
slot frees. After every rule the machine waits until the scheduler has
settled -- every request the model ended is terminal, every one it left
hung or queued is so, the peer's liveness agrees -- and then checks each
request exactly (I3, I5), the live and quarantine counts, every release
(terminal and quiesced, exactly once: I6), each terminal record (exactly one,
the last: I2) and the faults drawn. Deadlines are a minute, except the
``expire`` rule's: its waiter must come back TIMEOUT, within a bound (I4).
At teardown, hangs are released until nothing is live: every request is
terminal, reported once by poll() and by the observer, released once (I8),
and each DONE request's blocks hold its source's bytes (I7).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvguard.decode.service import ReceiverProcess
from lifecycle import TERMINAL, FailureReason, RequestLifecycle, TransferState
from scheduler import (
    DuplicateRequest,
    Finished,
    InvalidRequest,
    RetryPolicy,
    Scheduler,
    UnknownPeer,
    UnknownRequest,
)
from transfer import (
    EngineError,
    Fault,
    FaultInjectingBackend,
    FaultKind,
    FaultPlan,
    InvalidPlan,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerInfo,
    PeerLost,
    PeerUnreachable,
    TransferBackend,
    TransferOp,
    TransferPlan,
    TransferTimeout,
)
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests
from transfer.regions import RegionIndex

S = TransferState
R = FailureReason
K = FaultKind
LAYOUT = KVLayout(num_layers=1, num_blocks=32, block_bytes=32)
PEER = "decode-0"
ATTEMPTS = 3
LONG_S = 60.0  # no deadline but the expire rule's fires within an example
SHORT_S = 0.3  # the expire rule's deadline
# How long the expire rule's waiter may block: its deadline, plus the 1 s that
# wait() allows a late driver, plus a 10 s hang guard for threads descheduled
# on a loaded 2-core machine. What it catches is a waiter held to the
# scheduler's 60 s deadline or forever, not a slow step (speed is
# `kvguard bench`'s).
WAIT_BOUND_S = SHORT_S + 1.0 + 10.0
# How long the scheduler may take to settle after a rule before it counts as
# stuck: settling is milliseconds of work; the bound only ends a hang.
SETTLE_S = 30.0
CRASH = "crash"  # a script item: Recorder.submit raises (a buggy backend)
LOST = "lost"  # what an attempt meets while the injector has lost the peer
Item = FaultKind | str
RETRYABLE = frozenset({K.ERROR_CODE, K.RAISE, K.FAIL_BATCH})  # EngineError each
Want = tuple[S, R | None, type[BaseException] | None, int]  # state, reason, error type, attempt


class ScriptedFaults(FaultPlan):
    """A FaultPlan that returns the fault Recorder offered for this submit."""

    __slots__ = ("_local",)

    def __init__(self) -> None:  # no seed: nothing here is random
        self._local = threading.local()

    def offer(self, fault: Fault) -> None:
        self._local.fault, self._local.taken = fault, False

    def next(self, num_batches: int = 1) -> Fault:
        self._local.taken = True
        fault: Fault = self._local.fault
        return fault

    def taken(self) -> bool:
        """Did the injector draw the offered fault (it does not for a lost peer)?"""
        return bool(self._local.taken)


@dataclass(eq=False)
class Req:
    rid: str
    srcs: list[int]
    dsts: list[int]
    priority: int
    seq: int  # acceptance order: FIFO among equal priorities
    script: deque[Item]  # the model's copy: faults of the attempts to come
    pending: deque[Item]  # Recorder's copy, consumed as the backend is called
    lc: RequestLifecycle | None = None  # set once accepted
    tries: list[tuple[Item, TransferOp | None]] = field(default_factory=list)  # per attempt
    released: int = 0
    # The model.
    status: str = "queued"  # queued | hung | ended
    attempts: int = 0
    want: Want | None = None  # once ended
    hung_op: bool = False  # an injected hang not yet released: blocks are not free

    @property
    def live(self) -> bool:
        return self.status != "ended"


class Recorder(TransferBackend):
    """Attributes every op to the request holding its destination blocks, and
    hands the fault injector that request's next scripted fault."""

    name = "recorder"

    def __init__(self, inner: FaultInjectingBackend, plan: ScriptedFaults) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self.owner: dict[int, Req] = {}  # destination address -> request holding it
        self.lock = threading.Lock()

    def submit(self, plan: TransferPlan) -> TransferOp:
        with self.lock:
            req = self.owner[plan.batches[0].dst[0]]
            item = req.pending[0] if req.pending else K.NONE
            if item == CRASH:
                req.pending.popleft()
                req.tries.append((CRASH, None))
        if item == CRASH:
            raise RuntimeError("injected backend crash")
        assert isinstance(item, FaultKind)
        self.plan.offer(Fault(item))
        op = self.inner.submit(plan)
        taken = self.plan.taken()
        with self.lock:
            if taken and req.pending:
                req.pending.popleft()
            req.tries.append((item if taken else LOST, op))
        return op

    def probe(self, peer: str) -> None:
        self.inner.probe(peer)

    def add_peer(self, info: PeerInfo) -> None:
        self.inner.add_peer(info)

    def remove_peer(self, session_id: str) -> None:
        self.inner.remove_peer(session_id)

    def advertised_regions(self, session_id: str) -> RegionIndex | None:
        return self.inner.advertised_regions(session_id)

    def close(self) -> None:
        self.inner.close()


# A fault script per valid request: mostly clean; LOSE_PEER only from its own
# rule (it fails every live request, so where it lands must be known).
SCRIPT_ITEMS: list[Item] = [*[K.NONE] * 4, K.ERROR_CODE, K.RAISE, K.FAIL_BATCH, K.HANG, CRASH]
SCRIPT = st.one_of(
    st.lists(st.sampled_from(SCRIPT_ITEMS), max_size=3),
    # every attempt fails retryably: FAILED on the third (rare above)
    st.lists(st.sampled_from([K.ERROR_CODE, K.RAISE, K.FAIL_BATCH]), min_size=3, max_size=3),
)
EVENTS = ["lose_peer", "restore_peer", "restore_peer", "mark_peer_lost", "release_hangs"]
SUBMIT_KINDS = [
    *["valid"] * 5,
    "empty",
    "src_out_of_range",
    "dst_duplicate",
    "mismatched",
    "bad_deadline",
    "unknown_peer",
    "duplicate_id",
    "reuse_id",
]


class SchedulerMachine(RuleBasedStateMachine):
    """Over the in-process LocalBackend; MooncakeSchedulerMachine below swaps
    in the real engine by overriding the three backend hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # the release thread and observers write below
        self.src, inner, info = self._backend()
        self.peer = info.session_id
        self.faults_plan = ScriptedFaults()
        self.faults = FaultInjectingBackend(inner, self.faults_plan)
        self.backend = Recorder(self.faults, self.faults_plan)
        self.free: set[int] = set(range(LAYOUT.num_blocks))  # destination blocks nobody holds
        self.accepted: list[Req] = []
        self.by_lc: dict[int, Req] = {}  # id(lifecycle) -> request
        self.submitting: dict[str, Req] = {}  # rid -> request whose submit() is running
        self.current: dict[str, Req] = {}  # rid -> its latest accepted request
        self.observed: Counter[int] = Counter()  # id(lifecycle) -> observer calls
        self.polled: Counter[int] = Counter()
        self.violations: list[str] = []
        self.n = 0
        self.info = info
        self.workers = 1
        self.injector_lost = False  # the model: the fault injector has lost the peer
        self.peer_alive = True  # the model: the scheduler thinks the peer alive
        self.drawn: Counter[FaultKind] = Counter()  # the model: faults the injector drew
        self._sched: Scheduler | None = None  # built by the initialize rule

    def _backend(self) -> tuple[KVCache, TransferBackend, PeerInfo]:
        """The source cache, the backend to wrap in faults, the decode peer."""
        src = KVCache(LAYOUT)
        src.fill_seeded(99)
        self.dst = KVCache(LAYOUT)
        local = LocalBackend(workers=2)
        local.register_source(src)
        return src, local, local.register_peer(PEER, self.dst)

    def _intact(self, srcs: list[int], dsts: list[int]) -> bool:
        return self.src.blocks_equal(self.dst, srcs, dsts) == []

    def _close_backend(self) -> None:
        self.faults.close()

    @property
    def sched(self) -> Scheduler:
        assert self._sched is not None, "initialize rule has not run"
        return self._sched

    @initialize(workers=st.integers(1, 3), scripts=st.lists(SCRIPT, max_size=4))
    def start(self, workers: int, scripts: list[list[Item]]) -> None:
        # One worker makes queues (priorities, FIFO) likely; more make
        # workers race each other.
        self.workers = workers
        self._sched = Scheduler(
            self.backend,
            self.src,
            workers=workers,
            retry=RetryPolicy(max_attempts=ATTEMPTS, backoff_s=0.005),
            release=self._release,
            probe_interval_s=0.05,
            default_deadline_s=LONG_S,
        )
        self.sched.add_peer(self.info)
        self.sched.add_observer(self._observe)
        # Hypothesis disables a random subset of rules in each example (swarm
        # testing): start with some traffic whatever it leaves enabled.
        for i, script in enumerate(scripts):
            self._submit("valid", [i * 7], [i, 5, 11, 17], 0, 0, script, 0)
        self.settle()

    # -- the model -------------------------------------------------------------------

    def end(self, req: Req, state: S, reason: R | None, error: type[BaseException] | None) -> None:
        if req.live:
            req.status, req.want = "ended", (state, reason, error, req.attempts)

    def live(self) -> list[Req]:
        return [r for r in self.accepted if r.live]

    def admit(self) -> None:
        """Queued requests take the free slots, highest priority first, then FIFO."""
        while True:
            queued = [r for r in self.accepted if r.status == "queued"]
            if not queued or sum(r.status == "hung" for r in self.accepted) >= self.workers:
                return
            self.run(min(queued, key=lambda r: (-r.priority, r.seq)))

    def run(self, req: Req) -> None:
        """The request holds a slot: its attempts, until it hangs or ends."""
        while req.live:
            req.attempts += 1
            if self.injector_lost:  # the attempt meets a lost peer: no fault is drawn
                self.lose_everything(req, PeerLost)
                return
            item = req.script.popleft() if req.script else K.NONE
            if isinstance(item, FaultKind):
                self.drawn[item] += 1
            if item == CRASH:
                self.end(req, S.FAILED, R.WORKER_CRASHED, RuntimeError)
            elif item is K.NONE:
                self.end(req, S.DONE, None, None)
            elif item is K.HANG:
                req.status, req.hung_op = "hung", True
                return
            elif item is K.LOSE_PEER:
                self.injector_lost = True
                self.lose_everything(req, PeerLost)
            elif item in RETRYABLE and req.attempts == ATTEMPTS:
                self.end(req, S.FAILED, R.TRANSFER_ERROR, EngineError)
            # else: retryable with attempts left: the next attempt, same slot

    def lose_everything(self, first: Req | None, error: type[BaseException]) -> None:
        """The scheduler loses the peer: ``first``, then every live request, PEER_LOST."""
        if first is not None:
            self.end(first, S.FAILED, R.PEER_LOST, error)
        for r in self.live():
            self.end(r, S.FAILED, R.PEER_LOST, error)
        self.peer_alive = False

    def release_model(self) -> None:
        """Every injected hang ends with EngineError: a retry, or the last attempt's failure."""
        for r in self.accepted:
            r.hung_op = False
        for r in [r for r in self.accepted if r.status == "hung"]:
            if r.attempts == ATTEMPTS:
                self.end(r, S.FAILED, R.TRANSFER_ERROR, EngineError)
            else:
                r.status = "running"
                self.run(r)
        self.admit()

    # -- settling and the exact checks --------------------------------------------------

    def settle(self) -> None:
        """Wait until the scheduler is where the model says, then check it exactly."""
        end = time.monotonic() + SETTLE_S
        while True:
            gap = self._gap()
            if gap is None:
                break
            assert time.monotonic() < end, f"not settled after {SETTLE_S}s: {gap}"
            time.sleep(0.002)
        m = self.sched.metrics()
        live = Counter(r.status for r in self.accepted)
        assert m.live_by_state == {"PENDING": live["queued"], "TRANSFERRING": live["hung"]}, m
        quarantined = [r.rid for r in self.accepted if not r.live and r.hung_op]
        assert m.quarantined == len(quarantined), (m, quarantined)
        drawn = {k: v for k, v in self.faults.stats.items() if v}
        assert drawn == dict(self.drawn), (drawn, self.drawn)

    def _gap(self) -> str | None:
        """What still differs from the model; raises if it can no longer agree."""
        hung = 0
        for r in self.accepted:
            lc = r.lc
            assert lc is not None
            if r.status == "ended":
                if not lc.is_terminal:
                    return f"{r.rid} not ended yet ({lc.state.name})"
                got = (lc.state, lc.reason, type(lc.error) if lc.error else None, lc.attempt)
                assert got == r.want, f"{r.rid}: {got} != {r.want}; tries {r.tries}"
                want_released = 0 if r.hung_op else 1
                with self.lock:
                    released, observed = r.released, self.observed[id(lc)]
                if (released, observed) != (want_released, 1):
                    return f"{r.rid} released {released}, observed {observed}"
                continue
            assert not lc.is_terminal, f"{r.rid} ended early: {lc.outcome}; tries {r.tries}"
            if r.status == "hung":
                with self.backend.lock:
                    last = r.tries[-1] if r.tries else None
                if last is None or last[0] is not K.HANG or lc.attempt != r.attempts:
                    return f"{r.rid} not hung yet (attempt {lc.attempt}, tries {r.tries})"
                assert last[1] is not None and not last[1].done, (r.rid, r.tries)
                hung += 1
            elif lc.state is not S.PENDING or lc.attempt != 0:
                return f"{r.rid} should wait for a slot, is {lc.state.name} #{lc.attempt}"
        queued = sum(r.status == "queued" for r in self.accepted)
        if queued and hung < self.workers:
            return f"{queued} queued while only {hung} of {self.workers} slots hang"
        if self.sched.peer_alive(self.peer) != self.peer_alive:
            return f"the scheduler's peer_alive is not {self.peer_alive} yet"
        # Our release callback returns before the scheduler frees the id.
        releasing = self.sched.metrics().releasing
        if releasing:
            return f"{releasing} release(s) not yet done"
        return None

    # -- callbacks (scheduler threads) -------------------------------------------------

    def _req_of(self, lc: RequestLifecycle) -> Req:
        # Called under self.lock. A release or outcome may come before submit()
        # returned (empty requests, dead peer): the request is still "submitting".
        req = self.by_lc.get(id(lc))
        if req is None:
            req = self.submitting[lc.request_id]
            req.lc = lc
            self.by_lc[id(lc)] = req
        return req

    def _release(self, rid: str, fin: Finished) -> None:
        lc = self.sched.get(rid)  # known until its release returns
        with self.lock:
            req = self._req_of(lc)
            req.released += 1
            if not lc.is_terminal or fin.state not in TERMINAL:
                self.violations.append(f"{rid} released while {lc.state.name}")
            with self.backend.lock:
                busy = [op for _, op in req.tries if op is not None and not op.quiesced]
            if busy:
                self.violations.append(f"{rid} released with {len(busy)} op(s) not quiesced")
            if req.released > 1:
                self.violations.append(f"{rid} released {req.released} times")
            self.free.update(req.dsts)  # blocks back to the pool, as a server would

    def _observe(self, fin: Finished) -> None:
        lc = self.sched.get(fin.request_id)
        with self.lock:
            self.observed[id(self._req_of(lc).lc)] += 1

    # -- rules ---------------------------------------------------------------------------

    # Every rule draws the same data whatever the scheduler did so far (the
    # free blocks depend on release timing): picks index into the state.
    @rule(
        kind=st.sampled_from(SUBMIT_KINDS),
        picks=st.lists(st.integers(0, LAYOUT.num_blocks - 1), min_size=1, max_size=4),
        src_blocks=st.lists(st.integers(0, LAYOUT.num_blocks - 1), min_size=4, max_size=4),
        bad_deadline=st.sampled_from([0, -1.0, math.nan, math.inf, True]),
        pick=st.integers(0, 1000),
        script=SCRIPT,
        priority=st.integers(0, 2),
    )
    def submit(
        self,
        kind: str,
        picks: list[int],
        src_blocks: list[int],
        bad_deadline: float,
        pick: int,
        script: list[Item],
        priority: int,
    ) -> None:
        self._submit(kind, picks, src_blocks, bad_deadline, pick, script, priority)
        self.settle()

    @rule(scripts=st.lists(SCRIPT, min_size=2, max_size=6), priority=st.integers(0, 2))
    def submit_burst(self, scripts: list[list[Item]], priority: int) -> None:
        # Valid requests back to back: workers, faults and retries interleave.
        # One priority: the core may see them in one step or several, and
        # FIFO admits them in the same order either way.
        for i, script in enumerate(scripts):
            self._submit("valid", [i * 5 + 3], [i, 2 * i, 3 * i, 31 - i], 0, i, script, priority)
            if self.injector_lost:  # this one's attempt loses the peer: the next
                self.settle()  # one fails at submit, in the queue or at its attempt
        self.settle()

    def _submit(
        self,
        kind: str,
        picks: list[int],
        src_blocks: list[int],
        bad_deadline: float,
        pick: int,
        script: list[Item],
        priority: int,
        deadline_s: float = LONG_S,
    ) -> Req | None:
        self.n += 1
        rid = f"r{self.n}"
        with self.lock:
            free = sorted(self.free)
        dsts: list[int] = []
        for p in picks:  # distinct free blocks
            if free:
                dsts.append(free.pop(p % len(free)))
        if kind == "empty" or len(dsts) < len(picks):
            kind, dsts = "empty", []  # every block is held: a prefix-cache hit still works
        srcs = src_blocks[: len(dsts)]
        peer = self.peer
        expect: type[Exception] | None = None
        if kind == "src_out_of_range":
            srcs[-1] = LAYOUT.num_blocks + pick % 6
            expect = InvalidPlan
        elif kind == "dst_duplicate":
            dsts, srcs = [*dsts, dsts[0]], [*srcs, 0]
            expect = InvalidPlan
        elif kind == "mismatched":
            srcs = [*srcs, 0]
            expect = InvalidPlan
        elif kind == "bad_deadline":
            deadline_s = bad_deadline
            expect = InvalidRequest
        elif kind == "unknown_peer":
            peer = "nobody:1"
            expect = UnknownPeer
        elif kind == "duplicate_id":
            # Settled: an id is held exactly until its request is released.
            held = [r for r in self.current.values() if not r.released]
            if held:
                rid = held[pick % len(held)].rid
                expect = DuplicateRequest
        elif kind == "reuse_id":
            gone = [r for r in self.current.values() if r.released]
            if gone:  # released and forgotten: the id is free again
                rid = gone[pick % len(gone)].rid
        req = Req(rid, srcs, dsts, priority, len(self.accepted), deque(script), deque(script))
        with self.lock:
            self.free.difference_update(dsts)
            self.submitting[rid] = req
        with self.backend.lock:
            for d in set(dsts):
                self.backend.owner[self.info.block_base[0] + d * LAYOUT.block_bytes] = req
        try:
            lc = self.sched.submit(
                rid, srcs, dsts, peer=peer, deadline_s=deadline_s, priority=priority
            )
        except (InvalidPlan, InvalidRequest, UnknownPeer, DuplicateRequest) as exc:
            assert expect is not None and type(exc) is expect, (kind, exc)
            with self.lock:
                del self.submitting[rid]
                self.free.update(dsts)
            if expect is not DuplicateRequest:  # a fresh id left no trace
                _assert_unknown(self.sched, rid)
            return None
        assert expect is None, f"{kind} was accepted"
        with self.lock:
            req = self._req_of(lc)
            assert req.lc is lc
            del self.submitting[rid]
        self.accepted.append(req)
        self.current[rid] = req
        if kind == "empty":  # DONE at once, never pending, whatever the peer
            assert lc.state is S.DONE
            req.attempts = 1
            self.end(req, S.DONE, None, None)
        elif not self.peer_alive:  # known lost: fails at once, never sent
            self.end(req, S.FAILED, R.PEER_LOST, PeerUnreachable)
        else:
            self.admit()
        return req

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        req = self._choose(pick)
        if req is None:
            return
        assert req.lc is not None
        try:
            won = self.sched.abort(req.rid)
        except UnknownRequest:
            assert not req.live and req.released, req.rid  # released and forgotten
            return
        assert won is req.live, (req.rid, won, req.status)
        assert req.lc.is_terminal
        if won:
            self.end(req, S.FAILED, R.ABORTED, None)
            self.admit()  # a hung request's slot is free (its op is still hung)
        self.settle()

    def _choose(self, pick: int) -> Req | None:
        # A live request if there is one, else any current one.
        live = [r for r in self.accepted if r.live and self.current[r.rid] is r]
        pool = live or [r for r in self.accepted if self.current[r.rid] is r]
        return pool[pick % len(pool)] if pool else None

    @rule()
    def lose_peer_in_a_transfer(self) -> None:
        """A transfer finds the peer dead (LOSE_PEER): it and every live request
        fail PEER_LOST. Only when it runs at once, so that its effect is known."""
        hung = sum(r.status == "hung" for r in self.accepted)
        if hung >= self.workers or not self.peer_alive or self.injector_lost:
            return
        self._submit("valid", [1, 2], [3, 4, 5, 6], 0, 0, [K.LOSE_PEER], 3)
        self.settle()

    # Rules are drawn uniformly: the rare events share one, so that most
    # steps submit, abort or wait.
    @rule(event=st.sampled_from(EVENTS))
    def event(self, event: str) -> None:
        if event == "lose_peer":
            # Probes now fail: with requests live the prober loses the peer
            # and fails them; with none, nobody probes an alive peer, and the
            # next attempt finds it lost.
            self.faults.lose_peer(self.peer)
            self.injector_lost = True
            if self.live() and self.peer_alive:
                self.lose_everything(None, PeerLost)
        elif event == "restore_peer":
            self.faults.restore_peer(self.peer)
            self.injector_lost = False
            self.peer_alive = True  # the prober probes a lost peer and revives it
            self.admit()
        elif event == "mark_peer_lost":
            live = self.live()
            assert self.sched.mark_peer_lost(self.peer) == len(live)
            self.lose_everything(None, PeerLost)
            # A false alarm when the peer still answers: the prober revives it.
            self.peer_alive = not self.injector_lost
        elif event == "release_hangs":
            self.faults.release_hangs()
            self.release_model()
        else:
            raise AssertionError(event)
        self.settle()

    @rule(pick=st.integers(0, 1000), use_async=st.booleans())
    def wait(self, pick: int, use_async: bool) -> None:
        """A waiter with a timeout comes back with the state the model says."""
        req = self._choose(pick)
        if req is None:
            return
        assert req.lc is not None
        if use_async:
            state = asyncio.run(self.sched.wait_async(req.rid, timeout=0.01))
        else:
            state = self.sched.wait(req.rid, timeout=0.01)
        want = {"queued": S.PENDING, "hung": S.TRANSFERRING}
        assert req.want is not None or req.status in want
        assert state is (req.want[0] if req.want else want[req.status]), (req.rid, state)

    @rule(use_async=st.booleans(), priority=st.integers(0, 2))
    def expire(self, use_async: bool, priority: int) -> None:
        """I4: a request that hangs (or waits for a slot) past its deadline
        fails TIMEOUT there, and its waiter comes back with it in time."""
        t0 = time.monotonic()
        req = self._submit("valid", [0], [8], 0, 0, [K.HANG], priority, SHORT_S)
        assert req is not None and req.lc is not None
        if use_async:
            state = asyncio.run(self.sched.wait_async(req.rid))
        else:
            state = self.sched.wait(req.rid)
        waited = time.monotonic() - t0
        assert waited <= WAIT_BOUND_S, f"the waiter of {req.rid} blocked {waited:.2f}s"
        if req.live:  # what the deadline ends: hung (its op stays hung) or queued
            assert state is S.FAILED, (req.rid, state)
            self.end(req, S.FAILED, R.TIMEOUT, TransferTimeout)
            self.admit()
        self.settle()

    @rule()
    def poll(self) -> None:
        for fin in self.sched.poll():
            self._count_polled(fin)

    def _count_polled(self, fin: Finished) -> None:
        # Outcomes come in terminal order, and an id is reused only after its
        # request was released: the report is the oldest unreported one's.
        with self.lock:
            matches = [r for r in self.accepted if r.rid == fin.request_id]
            assert matches, f"poll() reported {fin.request_id!r}, never accepted"
            unreported = [r for r in matches if self.polled[id(r.lc)] == 0]
            target = unreported[0] if unreported else matches[-1]  # a repeat: counted 2
            assert target.lc is not None and fin.state is target.lc.state
            assert (fin.reason, fin.attempt) == (target.lc.reason, target.lc.attempt), fin
            self.polled[id(target.lc)] += 1

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        with self.lock:
            assert not self.violations, self.violations
            reqs = list(self.accepted)
        m = self.sched.metrics()
        assert (m.released_before_quiesce, m.double_releases) == (0, 0), m
        for req in reqs:
            lc = req.lc
            assert lc is not None
            history = lc.history
            terminal = [h for h in history if h.dest in TERMINAL]
            assert len(terminal) == (1 if lc.is_terminal else 0), (req.rid, history)
            assert not terminal or history[-1] is terminal[0], (req.rid, history)
            assert lc.is_terminal or req.released == 0, f"{req.rid} released while live"

    def teardown(self) -> None:
        if self._sched is None:
            self._close_backend()
            return
        try:
            # Hangs end until nothing is live: each release is one more attempt.
            while self.live() or any(r.hung_op for r in self.accepted):
                self.faults.release_hangs()
                self.release_model()
                self.settle()
            assert self.sched.drain(timeout=SETTLE_S), f"not drained: {self.sched.metrics()}"
            self.invariants_hold()
            m = self.sched.metrics()
            assert sum(m.live_by_state.values()) == 0, m
            assert m.quarantined == 0 and m.oldest_live_age_s == 0.0, m
            assert m.released == len(self.accepted), (m.released, len(self.accepted))
            done = [r for r in self.accepted if r.want is not None and r.want[0] is S.DONE]
            assert m.done == len(done), (m.done, len(done))
            failed = Counter(r.want[1].name for r in self.accepted if r.want and r.want[1])
            assert m.failed_by_reason == dict(failed), (m.failed_by_reason, failed)
            for fin in self.sched.poll():
                self._count_polled(fin)
            for req in self.accepted:
                assert req.lc is not None and req.lc.is_terminal, req.rid
                assert req.released == 1, (req.rid, req.released)
                assert self.observed[id(req.lc)] == 1, req.rid
                assert self.polled[id(req.lc)] == 1, req.rid
            # I7 on whatever is still where its DONE request put it: the last
            # DONE request on each block wrote it, and nothing wrote it since.
            last: dict[int, Req] = {}
            for req in self.accepted:
                for d in req.dsts:
                    last[d] = req
            for d, req in last.items():
                if req.lc is not None and req.lc.state is S.DONE:
                    s = req.srcs[req.dsts.index(d)]
                    assert self._intact([s], [d]), (req.rid, d)
        finally:
            self.sched.close(timeout=1.0)
            self._close_backend()


def _assert_unknown(sched: Scheduler, rid: str) -> None:
    try:
        sched.get(rid)
    except UnknownRequest:
        return
    raise AssertionError(f"rejected submit of {rid!r} left state behind")


SchedulerMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestScheduler = SchedulerMachine.TestCase


# -- the same machine over the real Mooncake engine ------------------------------------
#
# One decode process and one engine serve every example (starting them costs
# seconds); each example gets its own fault wrapper and scheduler. A fresh
# engine per example would also leave its registrations behind.


class _SharedMooncake:
    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.decode = self.stack.enter_context(ReceiverProcess(LAYOUT))
        self.backend = self.stack.enter_context(MooncakeBackend(transfer_timeout_s=5))
        self.src = KVCache(LAYOUT)
        self.src.fill_seeded(99)
        self.backend.register(self.src)


_shared: _SharedMooncake | None = None


class MooncakeSchedulerMachine(SchedulerMachine):
    def _backend(self) -> tuple[KVCache, TransferBackend, PeerInfo]:
        assert _shared is not None, "the mooncake_shared fixture starts it"
        return _shared.src, _shared.backend, _shared.decode.peer

    def _intact(self, srcs: list[int], dsts: list[int]) -> bool:
        assert _shared is not None
        return _shared.decode.checksums(dsts) == block_digests(self.src, srcs)

    def _close_backend(self) -> None:
        self.faults.release_hangs()  # the shared engine stays open


MooncakeSchedulerMachine.TestCase.settings = settings(
    max_examples=10,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def mooncake_shared() -> Iterator[None]:
    global _shared
    _shared = _SharedMooncake()
    try:
        yield
    finally:
        _shared.stack.close()  # kills and reaps the decode process by pid
        _shared = None


@pytest.mark.mooncake
@pytest.mark.usefixtures("mooncake_shared")
class TestSchedulerMooncake(MooncakeSchedulerMachine.TestCase):  # type: ignore[misc,valid-type]
    pass
