"""Hypothesis stateful test of the Scheduler over FaultInjectingBackend(LocalBackend),
and the same machine over FaultInjectingBackend(MooncakeBackend), the real engine
with a decode process on loopback (``TestSchedulerMooncake``, marker ``mooncake``).

Hypothesis interleaves submits (some invalid, some duplicates, some empty),
aborts, peer deaths and returns, hung engine calls and their release, worker
crashes, deadline expiries and waits. It also picks every fault: the
``QueuedFaults`` plan hands the backend whatever the ``push_fault`` rule
queued, so a failing example replays exactly.

Checked after every step: each request made at most one terminal transition
(exactly one once terminal, and it is the last record) (I2); a request is
released at most once, and only terminal with every op quiesced (I6); no
request stays live past its deadline (I4). At teardown, after the hangs are
released and the scheduler drained: nothing is live or quarantined, every
accepted request is terminal, reported exactly once by poll() and by the
observer, and released exactly once (I8).
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
    Fault,
    FaultInjectingBackend,
    FaultKind,
    FaultPlan,
    InvalidPlan,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerInfo,
    TransferBackend,
    TransferError,
    TransferOp,
    TransferPlan,
)
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests

LAYOUT = KVLayout(num_layers=1, num_blocks=32, block_bytes=32)
PEER = "decode-0"
TOL = 0.3  # a waiter may outlive its deadline by this much
LATE = 0.5  # a request seen live this long after its deadline is a bug (I4)
DRAIN_S = 5.0


class QueuedFaults(FaultPlan):
    """A FaultPlan that draws what the state machine queued, then NONE."""

    __slots__ = ("queue",)

    queue: deque[Fault]

    def __init__(self) -> None:  # no seed: nothing here is random
        self._lock = threading.Lock()
        self.queue = deque()

    def next(self, num_batches: int = 1) -> Fault:
        with self._lock:
            return self.queue.popleft() if self.queue else Fault(FaultKind.NONE)

    def push(self, fault: Fault) -> None:
        with self._lock:
            self.queue.append(fault)

    def clear(self) -> None:
        with self._lock:
            self.queue.clear()


@dataclass(eq=False)
class Req:
    rid: str
    srcs: list[int]
    dsts: list[int]
    deadline: float  # absolute, time.monotonic()
    lc: RequestLifecycle | None = None  # set once accepted
    ops: list[TransferOp] = field(default_factory=list)
    released: int = 0


class Recorder(TransferBackend):
    """Attributes every op to the request holding its destination blocks.

    ``crashes``: how many of the next submits raise (a buggy backend: the
    worker crashes and its guard must fail the request).
    """

    name = "recorder"

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.owner: dict[int, Req] = {}  # destination address -> request holding it
        self.crashes = 0
        self.lock = threading.Lock()

    def submit(self, plan: TransferPlan) -> TransferOp:
        with self.lock:
            req = self.owner[plan.batches[0].dst[0]]
            crash = self.crashes > 0
            self.crashes -= crash
        if crash:
            raise RuntimeError("injected backend crash")
        op = self.inner.submit(plan)
        with self.lock:
            req.ops.append(op)
        return op

    def probe(self, peer: str) -> None:
        self.inner.probe(peer)

    def close(self) -> None:
        self.inner.close()


# Mostly clean transfers: LOSE_PEER is sticky until a restore_peer event, so
# a uniform choice would leave the peer dead for most of an example.
FAULTS = [
    *[FaultKind.NONE] * 5,
    FaultKind.ERROR_CODE,
    FaultKind.RAISE,
    FaultKind.HANG,
    FaultKind.FAIL_BATCH,
    FaultKind.LOSE_PEER,
]
EVENTS = [
    "lose_peer",
    "restore_peer",
    "restore_peer",
    "mark_peer_lost",
    "release_hangs",
    "crash_next_submit",
]
SUBMIT_KINDS = [
    "valid",
    "valid",
    "valid",
    "valid",
    "valid",
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
        self.faults_plan = QueuedFaults()
        self.faults = FaultInjectingBackend(inner, self.faults_plan)
        self.backend = Recorder(self.faults)
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

    @initialize(workers=st.integers(1, 3), faults=st.lists(st.sampled_from(FAULTS), max_size=4))
    def start(self, workers: int, faults: list[FaultKind]) -> None:
        # One worker makes queues (PENDING deadlines, priorities) likely; more
        # make workers race each other.
        self._sched = Scheduler(
            self.backend,
            self.src,
            workers=workers,
            retry=RetryPolicy(max_attempts=3, backoff_s=0.005),
            release=self._release,
            probe_interval_s=0.05,
            default_deadline_s=0.5,
        )
        self.sched.add_peer(self.info)
        self.sched.add_observer(self._observe)
        # Hypothesis disables a random subset of rules in each example (swarm
        # testing): start with some traffic whatever it leaves enabled.
        for i, fault in enumerate(faults):
            self._submit("valid", [i * 7], [i, 5, 11, 17], 0.5, 0, 0, fault, i % 3)  # 1 block

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
                busy = [op for op in req.ops if not op.quiesced]
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
        deadline_s=st.sampled_from([0.2, 0.3, 0.5, 1.5]),
        bad_deadline=st.sampled_from([0, -1.0, math.nan, math.inf, True]),
        pick=st.integers(0, 1000),
        fault=st.sampled_from(FAULTS),
        priority=st.integers(0, 2),
    )
    def submit(
        self,
        kind: str,
        picks: list[int],
        src_blocks: list[int],
        deadline_s: float,
        bad_deadline: float,
        pick: int,
        fault: FaultKind,
        priority: int,
    ) -> None:
        self._submit(kind, picks, src_blocks, deadline_s, bad_deadline, pick, fault, priority)

    @rule(
        faults=st.lists(st.sampled_from(FAULTS), min_size=2, max_size=6),
        deadline_s=st.sampled_from([0.2, 0.3, 0.5, 1.5]),
    )
    def submit_burst(self, faults: list[FaultKind], deadline_s: float) -> None:
        # Valid requests back to back: workers, faults and retries interleave.
        for i, fault in enumerate(faults):
            self._submit(
                "valid", [i * 5 + 3], [i, 2 * i, 3 * i, 31 - i], deadline_s, 0, i, fault, i % 3
            )

    def _submit(
        self,
        kind: str,
        picks: list[int],
        src_blocks: list[int],
        deadline_s: float,
        bad_deadline: float,
        pick: int,
        fault: FaultKind,
        priority: int,
    ) -> None:
        if fault is not FaultKind.NONE:  # the next transfer attempt gets it
            self.faults_plan.push(Fault(fault))
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
            live = [r for r in self.current.values() if r.lc is not None and _holds_id(self, r)]
            if live:
                rid = live[pick % len(live)].rid
                expect = DuplicateRequest
        elif kind == "reuse_id":
            gone = [r for r in self.current.values() if r.released and not _holds_id(self, r)]
            if gone:  # released and forgotten: the id is free again
                rid = gone[pick % len(gone)].rid
        req = Req(rid, srcs, dsts, time.monotonic() + (deadline_s if expect is None else 0))
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
            assert expect is not None and isinstance(exc, expect), (kind, exc)
            with self.lock:
                del self.submitting[rid]
                self.free.update(dsts)
            if expect is not DuplicateRequest:  # a fresh id left no trace
                _assert_unknown(self.sched, rid)
            return
        if expect is DuplicateRequest:
            # The live one was released between our check and submit(): a plain accept.
            expect = None
        assert expect is None, f"{kind} was accepted"
        with self.lock:
            req = self._req_of(lc)
            assert req.lc is lc
            del self.submitting[rid]
        self.accepted.append(req)
        self.current[rid] = req
        if kind == "empty":
            assert lc.state is TransferState.DONE  # at once, never pending

    @rule(kind=st.sampled_from(FAULTS))
    def push_fault(self, kind: FaultKind) -> None:
        self.faults_plan.push(Fault(kind))

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        req = self._choose(pick)
        if req is None:
            return
        if self.current.get(req.rid) is not req:
            return
        assert req.lc is not None
        try:
            won = self.sched.abort(req.rid)
        except UnknownRequest:
            assert req.lc.is_terminal  # released, so terminal
            return
        assert req.lc.is_terminal
        if won:
            assert req.lc.reason is FailureReason.ABORTED

    def _choose(self, pick: int) -> Req | None:
        # A live request if there is one (which ones are live depends on timing;
        # what hypothesis draws does not), else any accepted one.
        live = [r for r in self.accepted if r.lc is not None and not r.lc.is_terminal]
        pool = live or self.accepted
        return pool[pick % len(pool)] if pool else None

    # Rules are drawn uniformly: the rare events share one, so that most
    # steps submit, abort or wait.
    @rule(event=st.sampled_from(EVENTS))
    def event(self, event: str) -> None:
        if event == "lose_peer":
            self.faults.lose_peer(self.peer)  # probes and transfers now fail
        elif event == "restore_peer":
            self.faults.restore_peer(self.peer)
            self._await_alive()
        elif event == "mark_peer_lost":
            # A false alarm: what is in flight fails, and the prober revives
            # the peer, which still answers.
            self.sched.mark_peer_lost(self.peer)
            if not self.faults_lost():
                self._await_alive()
        elif event == "release_hangs":
            self.faults.release_hangs()
        elif event == "crash_next_submit":
            with self.backend.lock:
                self.backend.crashes += 1
        else:
            raise AssertionError(event)

    def faults_lost(self) -> bool:
        try:
            self.faults.probe(self.peer)
        except TransferError:
            return True
        return False

    def _await_alive(self) -> None:
        # The prober (every 0.05 s) must see an answering peer alive again, soon.
        end = time.monotonic() + 2.0
        while not self.sched.peer_alive(self.peer):
            assert time.monotonic() < end, "the prober never revived an answering peer"
            time.sleep(0.005)

    @rule(pick=st.integers(0, 1000), use_async=st.booleans())
    def wait(self, pick: int, use_async: bool) -> None:
        req = self._choose(pick)
        if req is None:
            return
        if self.current.get(req.rid) is not req:
            return
        lc = req.lc
        assert lc is not None
        t0 = time.monotonic()
        try:
            if use_async:
                state = asyncio.run(self.sched.wait_async(req.rid))
            else:
                state = self.sched.wait(req.rid)
        except UnknownRequest:
            state = lc.state  # released already: terminal
            assert lc.is_terminal
        if state not in TERMINAL:  # back at the deadline: the watchdog is a hair late
            state = lc.wait(TOL)
        waited = time.monotonic() - t0
        assert state in TERMINAL, f"{req.rid} still {state.name} after its deadline"
        assert waited <= max(0.0, req.deadline - t0) + TOL, (
            f"waiter of {req.rid} outlived its deadline by {waited - (req.deadline - t0):.3f}s"
        )

    @rule()
    def poll(self) -> None:
        for fin in self.sched.poll():
            self._count_polled(fin)

    @rule(pause=st.sampled_from([0.0, 0.02, 0.1, 0.25]))
    def pause(self, pause: float) -> None:
        time.sleep(pause)  # lets deadlines, probes and retries interleave

    def _count_polled(self, fin: Finished) -> None:
        # Outcomes come in terminal order, and an id is reused only after its
        # request was released: the report is the oldest unreported one's.
        with self.lock:
            matches = [r for r in self.accepted if r.rid == fin.request_id]
            assert matches, f"poll() reported {fin.request_id!r}, never accepted"
            unreported = [r for r in matches if self.polled[id(r.lc)] == 0]
            target = unreported[0] if unreported else matches[-1]  # a repeat: counted 2
            assert target.lc is not None and fin.state is target.lc.state
            self.polled[id(target.lc)] += 1

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        with self.lock:
            assert not self.violations, self.violations
            reqs = list(self.accepted)
        m = self.sched.metrics()
        assert m.released_before_quiesce == 0
        assert m.double_releases == 0
        now = time.monotonic()
        for req in reqs:
            lc = req.lc
            assert lc is not None
            history = lc.history
            terminal = [h for h in history if h.dest in TERMINAL]
            assert len(terminal) <= 1, (req.rid, history)
            if lc.is_terminal:
                assert len(terminal) == 1 and history[-1] is terminal[0], (req.rid, history)
                late = terminal[0].at - req.deadline
                assert late <= LATE, f"{req.rid} ended {late:.2f}s after its deadline"
            else:
                assert req.released == 0, f"{req.rid} released while live"
                assert now <= req.deadline + LATE, f"{req.rid} live {now - req.deadline:.2f}s late"

    def teardown(self) -> None:
        if self._sched is None:
            self._close_backend()
            return
        try:
            self.faults_plan.clear()
            with self.backend.lock:
                self.backend.crashes = 0
            drained = False
            end = time.monotonic() + DRAIN_S
            while not drained and time.monotonic() < end:
                self.faults.release_hangs()  # an op may hang until released
                drained = self.sched.drain(timeout=0.1)
            assert drained, f"not drained: {self.sched.metrics()}"
            self.invariants_hold()
            m = self.sched.metrics()
            assert sum(m.live_by_state.values()) == 0, m
            assert m.quarantined == 0 and m.oldest_live_age_s == 0.0, m
            assert m.released == len(self.accepted), (m.released, len(self.accepted))
            assert m.done + m.failed == len(self.accepted), m
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
                if req.lc is not None and req.lc.state is TransferState.DONE:
                    s = req.srcs[req.dsts.index(d)]
                    assert self._intact([s], [d]), (req.rid, d)
        finally:
            self.sched.close(timeout=1.0)
            self._close_backend()


def _holds_id(machine: SchedulerMachine, req: Req) -> bool:
    try:
        return machine.sched.get(req.rid) is req.lc
    except UnknownRequest:
        return False


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
