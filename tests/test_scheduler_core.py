"""The sans-I/O scheduler core under a hypothesis state machine, on a simulated clock.

``CoreMachine`` is the core's only driver: it calls ``step(now)`` with a
clock it advances itself, runs (or holds back) the callbacks and releases a
step hands out, and feeds probe results. ``SimBackend`` completes, fails
(with every typed reason), hangs, loses its peer, quiesces late or never,
raises from submit (a crash, SystemExit), or fails inside submit at once,
all as the rules say. No thread, no sleep.

An independent model of the request table predicts, for every request, the
exact state and FailureReason each exit cause must produce, in the order the
core applies them (calls from other threads at once; op results and probe
results at the next step, in arrival order; then deadlines, backoffs,
admission by priority). Checked after every rule, each check raising
``InvariantViolated`` with the name of the property it guards (``CHECKS``):

* I2: at most one terminal record per request, and it is the last; each
  request is reported at most once.
* I3 / I5: the core's state, reason and error equal the model's, exactly.
* I4: after step(now), no request with deadline <= now is live or unreported.
* I6: a release only of a terminal request whose ops all quiesced, at most
  once; and every request that was terminal and quiesced before a step is
  handed out by that step.
* I8: every container of the core is bounded by the live requests, and
  after a drain (a rule, like any other) nothing is left.

Nothing fixes a scenario: the peers are set up, and every request (the
first few in the initializer), op result, abort, peer change, clock move and
drain is drawn by the search, through one rule (``ACTIONS``).
``test_the_search_catches_each_seeded_bug_on_every_seed`` patches three bugs
into the core, one at a time, and asserts that on each of 10 seeds the
search finds it within ``SEARCH_EXAMPLES`` examples by the check of the
invariant the bug breaks; the clean core runs the same seeds and budget.
``python -m tests.seeded_report`` prints how many examples each catch took.
"""

from __future__ import annotations

import heapq
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import structlog
from hypothesis import HealthCheck, Verbosity, seed, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from lifecycle import (
    TERMINAL,
    Event,
    FailureReason,
    Journal,
    RequestLifecycle,
    TransferState,
    TransitionRecord,
)
from scheduler import _core, _lazyheap, _peer_changes
from scheduler._core import SchedulerCore
from scheduler._drivers import _contained
from scheduler._records import Finished, RetryPolicy
from scheduler._release import ReleaseQuarantine, run_release
from scheduler._requests import RECENT, RequestRecord, Tombstone
from scheduler.errors import DuplicateRequest, SchedulerClosed, UnknownPeer
from transfer import (
    BackendClosed,
    Backpressure,
    Batch,
    EngineError,
    KVLayout,
    PeerInfo,
    PeerLost,
    PeerUnreachable,
    Region,
    RemoteRangeRejected,
    TransferBackend,
    TransferCancelled,
    TransferError,
    TransferOp,
    TransferPlan,
    TransferTimeout,
)


@pytest.fixture(autouse=True, scope="module")
def _quiet_logs() -> Iterator[None]:
    """The rules make callbacks raise on purpose; their logged tracebacks are noise."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    yield
    structlog.configure(**old)


R = FailureReason
S = TransferState
LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=8)
PEERS = ("p0", "p1")
IDS = tuple(f"r{i}" for i in range(8))
MAX_IN_FLIGHT = 2
LOST_AFTER = 2
PROBE_S = 0.5
# Deadlines (s): the short ones meet their deadline in a few ticks, the long
# ones live long enough for an op's result to decide them.
DEADLINES = (0.1, 0.3, 0.7, 2.0, 5.0)
RETRY = RetryPolicy(max_attempts=3, backoff_s=0.05, backoff_factor=2.0, backoff_max_s=0.2)

# Outcome name -> (error or None, FailureReason, retryable).
OUTCOMES: dict[str, tuple[Callable[[str], TransferError] | None, R | None, bool]] = {
    "ok": (None, None, False),
    "engine": (lambda p: EngineError("engine -1", peer=p, code=-1), R.TRANSFER_ERROR, True),
    "backpressure": (lambda p: Backpressure("full", peer=p), R.TRANSFER_ERROR, True),
    "error": (lambda p: TransferError("boom", peer=p), R.TRANSFER_ERROR, False),
    "lost": (lambda p: PeerLost("gone", peer=p), R.PEER_LOST, False),
    "unreachable": (lambda p: PeerUnreachable("refused", peer=p), R.PEER_LOST, False),
    "cancelled": (lambda p: TransferCancelled("cancelled", peer=p), R.ABORTED, False),
    "invalid": (lambda p: RemoteRangeRejected("outside", peer=p), R.INVALID_REQUEST, False),
    "closed": (lambda p: BackendClosed("closed", peer=p), R.SHUTDOWN, False),
    "timeout": (lambda p: TransferTimeout("engine timeout", peer=p), R.TIMEOUT, False),
}
# What backend.submit does on an attempt: hold the op for a later rule, raise,
# or finish the op inside submit (as FaultInjectingBackend does).
BEHAVIOURS = (
    "hold",
    "hold",
    "hold",
    "crash",
    "exit",
    "race_abort",  # hold, and another thread aborts the newest other live request meanwhile
    "instant:engine",
    *(f"instant:{o}" for o in OUTCOMES),
)
SUBMIT_RAISES = {"crash": (RuntimeError, R.WORKER_CRASHED), "exit": (SystemExit, R.SHUTDOWN)}


def peer_info(sid: str, variant: int = 0) -> PeerInfo:
    return PeerInfo(sid, (Region(0x1000 * (variant + 1), 4096),), LAYOUT)


@dataclass(eq=False)
class Op:
    rid: str
    op: TransferOp
    outcome: str = ""
    resolved: bool = False
    quiesced: bool = False
    never: bool = False  # never quiesces until teardown


COMPACT_MIN = 2  # compaction thresholds in the machine: 8 ids must exercise them


class LogRecorder:
    """Stands in for the core's structlog logger: what it logs is checked."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        def log(event: str, **kw: object) -> None:
            self.records.append((level, event, kw))

        return log


class CountingJournal(Journal):
    """Counts the transition records the lifecycles hand the journal."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def transition(self, request_id: str, rec: TransitionRecord) -> None:
        self.count += 1


class SimBackend(TransferBackend):
    """Ops are resolved and quiesced only by the machine's rules."""

    name = "sim"

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}  # id(plan) -> request id
        self.script: dict[str, deque[str]] = {}  # per request: behaviour of each attempt
        self.ops: list[Op] = []
        self.submits: list[tuple[str, str, Op | None]] = []  # in call order
        self.lifecycles: list[RequestLifecycle] = []  # every accepted request's, in order
        self.raced: dict[int, str] = {}  # submits index -> the request aborted during it

    def submit(self, plan: TransferPlan) -> TransferOp:
        rid = self.owner[id(plan)]
        script = self.script[rid]
        behaviour = script.popleft() if script else "hold"
        if behaviour in SUBMIT_RAISES:
            self.submits.append((rid, behaviour, None))
            raise SUBMIT_RAISES[behaviour][0](f"backend.submit {behaviour} (simulated)")
        op = Op(rid, TransferOp(plan))
        self.ops.append(op)
        self.submits.append((rid, behaviour, op))
        if behaviour == "race_abort":
            # Another thread's abort() lands while the core is in its step.
            racer = threading.Thread(target=self._race_abort, args=(rid,))
            racer.start()
            racer.join()
        if behaviour.startswith("instant:"):
            self.resolve(op, behaviour.split(":", 1)[1])
            self.quiesce(op)
        return op.op

    def _race_abort(self, rid: str) -> None:
        for lc in reversed(self.lifecycles):
            if lc.request_id != rid and lc.fail(R.ABORTED):
                self.raced[len(self.submits) - 1] = lc.request_id
                return

    def resolve(self, op: Op, outcome: str) -> None:
        make = OUTCOMES[outcome][0]
        op.outcome = outcome
        op.resolved = True
        op.op._resolve(None if make is None else make(op.op.plan.peer))

    def quiesce(self, op: Op) -> None:
        op.quiesced = True
        op.op._quiesce()

    def probe(self, peer: str) -> None:  # the machine feeds probe results itself
        raise AssertionError("the core never probes by itself")

    def close(self) -> None:
        pass


ErrSpec = BaseException | tuple[type[BaseException], str | None] | None


@dataclass(eq=False)
class M:
    """The model of one accepted request."""

    rid: str
    peer: str
    deadline: float
    priority: int
    order: int  # acceptance order: FIFO among equal priorities
    script: list[str]
    req: RequestRecord
    state: S = S.PENDING
    reason: R | None = None
    phase: str = "queued"  # queued | running | backoff | done (terminal)
    attempt: int = 0
    op: Op | None = None
    retry_at: float = 0.0
    retry_seq: int = 0
    released: int = 0
    reported: int = 0
    forgotten: bool = False
    plan: TransferPlan | None = None
    ops: list[Op] = field(default_factory=list)
    error: ErrSpec = None  # what lc.error must be: None, that object, or (type, peer)
    submitted: float = 0.0
    mpeer: MPeer | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass
class MPeer:
    info: PeerInfo
    variant: int = 0
    live: set[int] = field(default_factory=set)  # orders of its requests not yet released
    alive: bool = True
    failures: int = 0


# The properties the machine checks, by the name its InvariantViolated carries.
# A seeded bug counts as caught only by the check of the property it breaks;
# any other exception is the harness failing, never a catch.
CHECKS = {
    "I1": "an event on a terminal request changes nothing and returns False",
    "I2": "one terminal transition, the last, and one report per request",
    "I3": "every worker exit leaves its request terminal",
    "I4": "no request is live or unreported after the first step at or after its "
    "deadline; next_at is no later than any deadline or backoff",
    "I5": "each ending has the state, reason and error the model predicts",
    "I6": "a release only of a terminal, quiesced request, exactly once, and as soon as it is both",
    "I8": "every container is bounded by the live requests; a drain leaves nothing",
    "admission": "the core submits exactly what the model admits, in priority order",
    "counters": "done, failed and byte counters equal the reported outcomes",
    "records": "each Finished names its request's attempt, peer, bytes and latency",
    "peers": "peer changes fail exactly the peer's live requests, logged once",
    "callbacks": "user callbacks run outside step(), once; waiters are woken once",
    "sans-io": "a backend thread's report only posts to the inbox",
    "submit": "submit refuses with the typed error of its cause",
}


class InvariantViolated(AssertionError):
    """The core broke the property ``CHECKS[invariant]``."""

    def __init__(self, invariant: str, detail: object) -> None:
        assert invariant in CHECKS, invariant
        super().__init__(f"{invariant} ({CHECKS[invariant]}): {detail}")
        self.invariant = invariant


@dataclass
class Tally:
    """What one search saw: examples started, and its first violation."""

    examples: int = 0
    first: tuple[str, int, int] | None = None  # (invariant, example, rule step)


PICK = st.integers(0, 100)
Act = tuple[str, tuple[object, ...]]
# Everything the machine's one rule may do: action -> (weight, its arguments).
# One rule, not one per action: hypothesis's swarm testing enables a random
# subset of the rules in each example, and exposing a bug takes several
# actions together (a submit, a step, a backend result, time passing), which
# with one rule each were all enabled in few examples. The weights favour the
# actions every story needs; the ones that end everything are rarer still
# inside (close, remove_peer, mark_peer_lost, drain return at once unless go == 0).
REQUEST = st.tuples(  # id, peer, plan (0: empty), deadline, priority, submit behaviours
    st.sampled_from(IDS),
    st.sampled_from(PEERS),
    st.integers(0, 9),
    st.sampled_from(DEADLINES),
    st.integers(0, 2),
    st.lists(st.sampled_from(BEHAVIOURS), max_size=3),
)
ACTIONS: dict[str, tuple[int, st.SearchStrategy[tuple[object, ...]]]] = {
    "submit": (
        3,
        st.tuples(
            st.lists(REQUEST, min_size=1, max_size=4),
            # a removal racing the submit strands the peer until add_peer: rare
            st.sampled_from(["none"] * 6 + ["remove", "replace", "same"]),
        ),
    ),
    # the backend's threads
    "resolve": (
        3,
        st.tuples(
            PICK,
            st.sampled_from(["ok", "engine", "backpressure", "error", *OUTCOMES]),
            st.sampled_from(["now", "now", "later", "never"]),
        ),
    ),
    "quiesce_late": (2, st.tuples(PICK)),
    # the users' threads
    "abort": (1, st.tuples(st.sampled_from(IDS))),
    "wait": (1, st.tuples(st.sampled_from(IDS))),
    "close": (1, st.tuples(st.integers(0, 9))),
    # peer changes
    "add_peer": (1, st.tuples(st.sampled_from(PEERS), st.integers(0, 1))),
    "remove_peer": (1, st.tuples(st.sampled_from(PEERS), st.integers(0, 3))),
    "mark_peer_lost": (1, st.tuples(st.sampled_from(PEERS), st.integers(0, 3))),
    "probe_result": (
        1,
        # mostly alive: two failures in a row lose the peer and all its requests
        st.tuples(
            st.sampled_from(PEERS),
            st.lists(st.sampled_from([True, True, False]), min_size=1, max_size=3),
        ),
    ),
    # the driver
    "tick": (3, st.tuples(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25, 0.5]))),
    "advance": (2, st.tuples(st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0]))),
    "step": (1, st.just(())),
    "hold_or_run_releases": (1, st.tuples(st.booleans())),
    "run_callbacks": (1, st.tuples(st.integers(1, 5))),
    "release_again": (1, st.tuples(PICK)),
    "drain": (1, st.tuples(st.integers(0, 4))),
}
ACT = st.one_of(
    *(st.tuples(st.just(name), args) for name, (w, args) in ACTIONS.items() for _ in range(w))
)


class CoreMachine(RuleBasedStateMachine):
    tally = Tally()  # a search gives each run's subclass its own

    def __init__(self) -> None:
        super().__init__()
        self.tally.examples += 1
        self.example = self.tally.examples
        self.steps = 0  # rules run so far in this example
        self.now = 0.0
        self.backend = SimBackend()
        self.deferred: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self.journal = CountingJournal()
        self.core = SchedulerCore(
            self.backend,
            max_in_flight=MAX_IN_FLIGHT,
            retry=RETRY,
            probe_interval_s=PROBE_S,
            peer_lost_after_probes=LOST_AFTER,
            journal=self.journal,
            defer=lambda fn: self.deferred.append((fn, ())),
        )
        self.reqs: list[M] = []  # every accepted request, in acceptance order
        self.by_id: dict[str, M] = {}  # ids in use (accepted, not yet forgotten)
        self.peers: dict[str, MPeer] = {}
        self.inbox: list[tuple[str, object, object]] = []  # model of the core's inbox
        self.closed = False
        self.drained = False
        self.in_step = False
        self.hold_releases = False
        self.held: deque[RequestRecord] = deque()
        self.retry_seq = 0
        self.cursor = 0  # backend.submits the model has accounted for
        self.waiters: dict[str, int] = {}  # request#order -> waiters registered
        self.wakes: dict[str, int] = {}  # request#order -> waiters woken
        self.double_expected = 0  # releases replayed on purpose (the detector must count them)
        # Small compaction thresholds, so that 8 ids exercise the compaction.
        self._threshold = _lazyheap._COMPACT_MIN
        _lazyheap._COMPACT_MIN = COMPACT_MIN
        # Found inside callbacks, which must not raise: (invariant, detail).
        self.violations: list[tuple[str, str]] = []
        self.done_calls: dict[int, int] = {}  # id(lifecycle) -> user done-callback calls
        self.crashes: list[M] = []  # requests whose backend.submit raised
        self.expected_logs: list[tuple[str, str, tuple[tuple[str, object], ...]]] = []
        self.logs = LogRecorder()
        self._saved_logs = _core._log, _peer_changes._log  # the core logs from both modules
        _core._log = _peer_changes._log = self.logs
        self.reported: list[M] = []

    def check(self, ok: bool, invariant: str, *detail: object) -> None:
        """The core's side of ``invariant`` holds; else the run fails by its name."""
        if ok:
            return
        if self.tally.first is None:
            self.tally.first = (invariant, self.example, self.steps)
        raise InvariantViolated(invariant, detail)

    @initialize(reqs=st.lists(REQUEST, max_size=8))
    def start(self, reqs: list[tuple[str, str, int, float, int, list[str]]]) -> None:
        # Both peers, and the requests the search draws live from the start
        # (which ones, and whatever follows, is the search's).
        for sid in PEERS:
            self.core.add_peer(peer_info(sid))
            self.peers[sid] = MPeer(peer_info(sid))
        self.submit(reqs, "none")

    # -- the model ------------------------------------------------------------------

    def live(self) -> list[M]:
        return [m for m in self.reqs if not m.terminal]

    def end(self, m: M, state: S, reason: R | None, error: ErrSpec = None) -> None:
        if not m.terminal:
            m.state, m.reason, m.phase, m.op, m.error = state, reason, "done", None, error

    def lose(self, sid: str, error: ErrSpec) -> None:
        peer = self.peers.get(sid)
        if peer is None:
            return
        if peer.alive:
            self.expect_log("warning", "peer_lost", peer=sid, live_requests=len(peer.live))
        peer.alive = False
        for m in self.live():
            if m.peer == sid:
                self.end(m, S.FAILED, R.PEER_LOST, error)

    def expect_log(self, level: str, event: str, **kw: object) -> None:
        self.expected_logs.append((level, event, tuple(sorted(kw.items()))))

    def attempt(self, m: M, round_done: list[M]) -> None:
        """The model of _start_attempt, for a queued or backing-off request."""
        behaviour = m.script.pop(0) if m.script else "hold"
        self.check(self.cursor < len(self.backend.submits), "admission", m.rid, "not started")
        rid, done_by_core, op = self.backend.submits[self.cursor]
        self.check((rid, done_by_core) == (m.rid, behaviour), "admission", rid, "not", m.rid)
        raced = self.backend.raced.get(self.cursor)
        self.cursor += 1
        if raced is not None:
            victim = self.by_id[raced]
            self.check(not victim.terminal, "I1", raced, "aborted twice")
            self.end(victim, S.FAILED, R.ABORTED, None)
        m.attempt += 1
        m.state = S.TRANSFERRING
        if behaviour in SUBMIT_RAISES:
            self.end(m, S.FAILED, SUBMIT_RAISES[behaviour][1], (SUBMIT_RAISES[behaviour][0], None))
            self.crashes.append(m)
            return
        assert op is not None  # the sim records an op for every submit that returns
        m.phase = "running"
        m.op = op
        m.ops.append(op)
        if behaviour.startswith("instant:"):
            round_done.append(m)  # its op_done is in the inbox, for the next round

    def conclude(self, m: M) -> None:
        """The model of _conclude: the op of the current attempt has its result."""
        assert m.op is not None
        outcome = m.op.outcome
        error = m.op.op.error
        _, reason, retryable = OUTCOMES[outcome]
        m.op = None
        if reason is None:
            self.end(m, S.DONE, None)
        elif reason is R.PEER_LOST:
            self.end(m, S.FAILED, R.PEER_LOST, error)
            self.lose(m.peer, error)
        elif retryable and m.attempt < RETRY.max_attempts:
            m.state, m.phase = S.PENDING, "backoff"
            m.retry_at = self.now + RETRY.delay(m.attempt)
            self.retry_seq += 1
            m.retry_seq = self.retry_seq
        else:
            self.end(m, S.FAILED, reason, error)

    def model_step(self) -> None:
        now = self.now
        events, self.inbox = self.inbox, []
        while True:
            for kind, a, b in events:
                if kind == "op":
                    m = a
                    assert isinstance(m, M)
                    if m.phase == "running" and m.op is b:
                        self.conclude(m)
                elif kind == "probe":
                    self.model_probe(str(a), bool(b))
            for m in self.live():
                if m.deadline <= now:
                    self.end(m, S.FAILED, R.TIMEOUT, (TransferTimeout, m.peer))
            round_done: list[M] = []
            due = sorted(
                (m for m in self.live() if m.phase == "backoff" and m.retry_at <= now),
                key=lambda m: (m.retry_at, m.retry_seq),
            )
            for m in due:
                if not m.terminal:
                    self.attempt(m, round_done)
            running = sum(m.phase in ("running", "backoff") for m in self.live())
            queue = [(-m.priority, m.order, m) for m in self.live() if m.phase == "queued"]
            heapq.heapify(queue)
            while running < MAX_IN_FLIGHT and queue:
                m = heapq.heappop(queue)[2]
                if m.terminal:
                    continue
                self.attempt(m, round_done)
                running = sum(x.phase in ("running", "backoff") for x in self.live())
            if not round_done:
                more = self.backend.submits[self.cursor :]
                self.check(not more, "admission", "the core started more", more)
                return
            events = [("op", m, m.op) for m in round_done]

    def model_probe(self, sid: str, ok: bool) -> None:
        peer = self.peers.get(sid)
        if peer is None:
            return
        if ok:
            peer.failures = 0
            if not peer.alive:
                self.expect_log("info", "peer_alive", peer=sid)
            peer.alive = True
            return
        peer.failures += 1
        if peer.alive and peer.failures >= LOST_AFTER:
            self.lose(sid, (PeerLost, sid))

    # -- submit ----------------------------------------------------------------------

    def submit(self, reqs: list[tuple[str, str, int, float, int, list[str]]], race: str) -> None:
        """A few submits; peer changes may race the first one."""
        for i, (rid, peer, empty, deadline_s, priority, script) in enumerate(reqs):
            self._submit(rid, peer, empty, deadline_s, priority, script, race if i == 0 else "none")

    def _submit(
        self,
        rid: str,
        peer: str,
        empty: int,
        deadline_s: float,
        priority: int,
        script: list[str],
        race: str,
    ) -> None:
        table, core = self.core.table, self.core
        try:
            info = table.peer_info(peer)
        except UnknownPeer:
            self.check(peer not in self.peers, "submit", "UnknownPeer for a known peer", peer)
            return
        batches = () if empty == 0 else (Batch((0x10,), (0x1000,), (8,)),)
        plan = TransferPlan(peer, batches, 8 * len(batches), len(batches))
        req = core.new_request(rid, plan, self.now, deadline_s, priority, self.on_release)
        # Peer changes racing this submit, between validation and admission.
        if race == "remove":
            self.remove_peer(peer, 0)
        elif race in ("replace", "same"):
            variant = self.peers[peer].variant
            self.add_peer(peer, 1 - variant if race == "replace" else variant)
        try:
            core.accept(req, info)
        except SchedulerClosed:
            self.check(self.closed, "submit", "SchedulerClosed while open", rid)
            return
        except DuplicateRequest:
            self.check(rid in self.by_id, "submit", "DuplicateRequest for a free id", rid)
            return
        except UnknownPeer:
            self.check(race == "remove" and peer not in self.peers, "submit", "UnknownPeer", rid)
            return
        except LookupError:
            ok = race == "replace" and self.peers[peer].info != info
            self.check(ok, "submit", "LookupError without a replaced peer", rid)
            return
        ok = not self.closed and rid not in self.by_id and peer in self.peers
        self.check(ok, "submit", "accepted", rid, "closed" if self.closed else "taken or gone")
        self.check(self.peers[peer].info == info, "submit", "accepted for a replaced peer", rid)
        self.backend.owner[id(plan)] = rid
        self.backend.script[rid] = deque(script)
        self.backend.lifecycles.append(req.lc)
        m = M(rid, peer, self.now + deadline_s, priority, len(self.reqs), list(script), req)
        m.plan, m.submitted, m.mpeer = plan, self.now, self.peers[peer]
        m.mpeer.live.add(m.order)
        self.reqs.append(m)
        self.by_id[rid] = m
        if not batches:
            m.attempt = 1
            self.end(m, S.DONE, None)
        elif not self.peers[peer].alive:
            self.end(m, S.FAILED, R.PEER_LOST, (PeerUnreachable, peer))
        # A user's done-callback: deferred, never run inside step().
        req.lc.add_done_callback(self.user_done_callback)

    def user_done_callback(self, lc: RequestLifecycle) -> None:
        if self.in_step or not lc.is_terminal:
            self.violations.append(("callbacks", f"done-callback of {lc!r} inside step or early"))
        self.done_calls[id(lc)] = self.done_calls.get(id(lc), 0) + 1
        if lc.request_id in ("r1", "r5"):
            raise SystemExit("a done-callback raising SystemExit")
        if lc.request_id == "r2":
            raise KeyboardInterrupt("a done-callback raising KeyboardInterrupt")

    def on_release(self, rid: str, fin: Finished) -> None:
        m = self.by_id[rid]
        if self.in_step:
            self.violations.append(("callbacks", f"release of {rid} ran inside step()"))
        if not (m.terminal and fin.state is m.state and fin.reason is m.reason):
            self.violations.append(("I6", f"release of {rid}: not terminal as modelled: {fin}"))
        if not all(op.quiesced for op in m.ops):
            self.violations.append(("I6", f"{rid} released before quiesce"))
        if m.released:
            self.violations.append(("I6", f"{rid} released twice"))
        m.released += 1
        if rid in ("r3", "r6"):
            raise SystemExit("a release callback raising SystemExit")

    @rule(act=ACT)
    def act(self, act: Act) -> None:
        name, args = act
        getattr(self, name)(*args)

    # -- the backend ------------------------------------------------------------------

    def _pick(self, pick: int, ops: list[Op]) -> Op | None:
        return ops[pick % len(ops)] if ops else None

    def resolve(self, pick: int, outcome: str, quiesce: str) -> None:
        op = self._pick(pick, [o for o in self.backend.ops if not o.resolved])
        if op is None:
            return
        self._from_another_thread(lambda: self.backend.resolve(op, outcome))
        m = next(x for x in self.reqs if op in x.ops)
        self.inbox.append(("op", m, op))
        if quiesce == "now":
            self._from_another_thread(lambda: self.backend.quiesce(op))
        elif quiesce == "never":
            op.never = True

    def quiesce_late(self, pick: int) -> None:
        ops = [o for o in self.backend.ops if o.resolved and not o.quiesced]
        op = self._pick(pick, [o for o in ops if not o.never])
        if op is not None:
            self._from_another_thread(lambda: self.backend.quiesce(op))

    def _from_another_thread(self, report: Callable[[], None]) -> None:
        """A backend thread reports an op's result or quiescence: it may only
        post to the inbox; the core's state changes in the next step alone."""
        before, posted = self._core_state(), len(self.core.table.inbox)
        report()
        self.check(self._core_state() == before, "sans-io", "state changed outside step()")
        self.check(len(self.core.table.inbox) == posted + 1, "sans-io", "not one post")

    def _core_state(self) -> tuple[object, ...]:
        core = self.core
        reqs = sorted(core.table.requests(), key=lambda r: r.request_id)
        return (
            [(r.request_id, r.phase, r.unquiesced, r.op is None, len(r.ops)) for r in reqs],
            core.quarantine(),
            (core.done, dict(core.failed), core._running, len(core._releases)),
        )

    # -- other threads ----------------------------------------------------------------

    def abort(self, rid: str) -> None:
        m = self.by_id.get(rid)
        if m is None:
            return
        won = m.req.lc.fail(R.ABORTED)
        self.check(won == (not m.terminal), "I1", rid, "abort won" if won else "abort lost")
        self.end(m, S.FAILED, R.ABORTED, None)

    def remove_peer(self, peer: str, go: int) -> None:
        if go:
            return  # rarer than the other rules: it ends every request to the peer
        failed = self.core.remove_peer(peer)
        if peer not in self.peers:
            self.check(failed is None, "peers", "removed an unknown peer", peer, failed)
            return
        victims = [m for m in self.live() if m.peer == peer]
        self.check(failed == len(victims), "peers", "removal failed", failed, len(victims))
        self.expect_log("info", "peer_removed", peer=peer, live_requests=len(self.peers[peer].live))
        for m in victims:
            self.end(m, S.FAILED, R.PEER_LOST, (PeerLost, peer))
        del self.peers[peer]

    def add_peer(self, peer: str, variant: int) -> None:
        info = peer_info(peer, variant)
        failed = self.core.add_peer(info)
        old = self.peers.get(peer)
        if old is None:
            self.peers[peer] = MPeer(info, variant)
            self.check(failed == 0, "peers", "a new peer failed requests", peer, failed)
            return
        victims = [m for m in self.live() if m.peer == peer] if old.info != info else []
        self.check(failed == len(victims), "peers", "re-adding failed", failed, len(victims))
        for m in victims:
            self.end(m, S.FAILED, R.PEER_LOST, (PeerLost, peer))
        old.info, old.variant, old.alive, old.failures = info, variant, True, 0

    def mark_peer_lost(self, peer: str, go: int) -> None:
        if go:
            return
        error = PeerLost("by hand", peer=peer)
        failed = self.core.lose_peer(peer, error)
        if peer not in self.peers:
            self.check(failed is None, "peers", "lost an unknown peer", peer, failed)
            return
        victims = sum(m.peer == peer for m in self.live())
        self.check(failed == victims, "peers", "losing failed", failed, victims)
        self.lose(peer, error)

    def probe_result(self, peer: str, results: list[bool]) -> None:
        for ok in results:
            self.core.probe_result(peer, None if ok else PeerUnreachable("no", peer=peer))
            self.inbox.append(("probe", peer, ok))

    def close(self, go: int = 0) -> None:
        if go or self.closed:
            return
        live = [m for m in self.reqs if not m.forgotten]
        self.core.shutdown()
        self.closed = True
        for m in live:
            self.end(m, S.FAILED, R.SHUTDOWN, None)

    # -- the driver -------------------------------------------------------------------------

    def advance(self, dt: float) -> None:
        self.now += dt

    def tick(self, dt: float) -> None:
        """The usual driver: time passes, then a step."""
        self.now += dt
        self.step()

    def step(self) -> None:
        quiesced = {m.rid for m in self.reqs if m.terminal and not m.released}
        quiesced = {r for r in quiesced if all(o.quiesced for o in self.by_id[r].ops)}
        self.in_step = True
        try:
            res = self.core.step(self.now)
        finally:
            self.in_step = False
        # I4 on the core's own evidence, before the model's view of the step:
        # nothing is live past its deadline, nor started at or after it.
        for m in self.reqs:
            if m.deadline <= self.now and not m.forgotten:
                self.check(m.req.lc.is_terminal, "I4", m.rid, "live after its deadline")
        for rid, _, _ in self.backend.submits[self.cursor :]:
            m = self.by_id[rid]
            self.check(m.deadline > self.now, "I4", rid, "started after its deadline")
        self.model_step()
        for fin in res.finished:
            m = self.by_id[fin.request_id]
            m.reported += 1
            self.check(m.reported == 1, "I2", m.rid, "reported twice")
            got, want = (fin.state, fin.reason), (m.state, m.reason)
            self.check(got == want, "I5", m.rid, got, want)
            self.check(fin.error is None or fin.error.__traceback__ is None, "records", m.rid)
            self.check(fin.error is m.req.lc.error, "records", m.rid, "error", fin.error)
            self.check(fin.attempt == m.attempt == m.req.lc.attempt, "records", m.rid, fin.attempt)
            nbytes = m.plan.nbytes if m.plan else -1
            self.check((fin.peer, fin.nbytes) == (m.peer, nbytes), "records", fin)
            self.check(fin.latency_s == pytest.approx(self.now - m.submitted), "records", fin)
            self.reported.append(m)
        out = {r.request_id for r in res.releases} | {r.request_id for r in self.held}
        self.check(quiesced <= out, "I6", "terminal and quiesced, not released", quiesced - out)
        for r in res.releases:
            if self.hold_releases:
                self.held.append(r)
            else:
                self.run_release(r)
        for wake in res.wakers:
            wake()
        done = [m for m in self.reported if m.state is S.DONE]
        nbytes = sum(m.plan.nbytes for m in done if m.plan is not None)
        got_done = (self.core.done, self.core.bytes_done)
        self.check(got_done == (len(done), nbytes), "counters", got_done, (len(done), nbytes))
        failed: dict[str, int] = {}
        for m in self.reported:
            if m.reason is not None:
                failed[m.reason.name] = failed.get(m.reason.name, 0) + 1
        got_failed = {k: v for k, v in self.core.failed.items() if v}
        self.check(got_failed == failed, "counters", got_failed, failed)
        # The core says when it next needs a step: no later than any deadline
        # or backoff of a live request.
        due = [m.deadline for m in self.live()]
        due += [m.retry_at for m in self.live() if m.phase == "backoff"]
        if due:
            ok = res.next_at is not None and self.now < res.next_at <= min(due)
            self.check(ok, "I4", "next_at", res.next_at, "now", self.now, "due", min(due))
        # I4 exactly: reported by the first step at or after its deadline.
        for m in self.reqs:
            if m.deadline <= self.now and not m.forgotten:
                self.check(m.reported == 1, "I4", m.rid, "not reported by its deadline")
        self.check_sizes()

    def run_release(self, r: RequestRecord) -> None:
        run_release(r, self.core.table, self.core.checks)
        m = self.by_id[r.request_id]
        m.forgotten = True
        del self.by_id[r.request_id]
        assert m.mpeer is not None
        m.mpeer.live.discard(m.order)

    def hold_or_run_releases(self, hold: bool) -> None:
        """A blocked release callback: later ones wait; the core goes on."""
        self.hold_releases = hold
        while not hold and self.held:
            self.run_release(self.held.popleft())

    def run_callbacks(self, n: int) -> None:
        for _ in range(min(n, len(self.deferred))):
            fn, args = self.deferred.popleft()
            _contained(fn, args)

    def wait(self, rid: str) -> None:
        """A waiter (wait() in another thread): woken once, by the step that ends it."""
        m = self.by_id.get(rid)
        if m is None:
            return
        key = f"{rid}#{m.order}"
        if self.core.table.add_waker(m.req, lambda: self._woken(key)):
            self.check(m.reported == 0, "callbacks", rid, "a waiter registered after the report")
            self.waiters[key] = self.waiters.get(key, 0) + 1
        else:
            self.check(m.reported == 1, "callbacks", rid, "a waiter refused before the report")

    def _woken(self, key: str) -> None:
        self.wakes[key] = self.wakes.get(key, 0) + 1

    def release_again(self, pick: int) -> None:
        """A broken release path hands out a released request again: the
        detector counts it and does not call the callback."""
        gone = [m for m in self.reqs if m.forgotten]
        if gone:
            m = gone[pick % len(gone)]
            run_release(m.req, self.core.table, self.core.checks)
            self.double_expected += 1
            self.check(m.released == 1, "I6", m.rid, "released", m.released)

    def drain(self, go: int) -> None:
        """Every deadline passes, the core closes, every op ends: nothing is left (I8)."""
        if go or self.drained:
            return  # rare: once drained, an example has little left to explore
        self.drained = True
        # Every deadline passes (I4 for every request still live) ...
        self.advance(max(DEADLINES) + 1.0)
        self.step()
        # ... then close with whatever is still quarantined: nothing is
        # released before its ops quiesce, even at shutdown ...
        self.hold_releases = False
        self.close()
        self.step()
        # ... then the hung ops return and quiesce late, after close: each
        # request is still released exactly once, and the core forgets it (I8).
        for op in self.backend.ops:
            if not op.resolved:
                self.backend.resolve(op, "ok")
                m = next(x for x in self.reqs if op in x.ops)
                self.inbox.append(("op", m, op))
            if not op.quiesced:
                self.backend.quiesce(op)
        self.step()
        self.hold_or_run_releases(False)
        self.step()
        while self.deferred:
            self.run_callbacks(len(self.deferred))
        self.model_agrees()
        for m in self.reqs:
            self.check(m.terminal and m.reported == 1, "I2", m.rid, m.state, m.reported)
            self.check(m.released == 1, "I6", m.rid, "released", m.released)
            calls = self.done_calls.get(id(m.req.lc))
            self.check(calls == 1, "callbacks", m.rid, "done-callback calls", calls)
        crashed = [kw for _, event, kw in self.logs.records if event == "worker_crashed"]
        self.check(len(crashed) == len(self.crashes), "records", "crash logs", crashed)
        for m, kw in zip(self.crashes, crashed, strict=True):
            info = kw["exc_info"]
            assert isinstance(info, tuple)
            exc_type, exc, tb = info
            ok = kw["request_id"] == m.rid and exc is m.req.lc.error
            self.check(ok and exc_type is type(exc) and tb is not None, "records", m.rid, kw)
        sizes = self.core.sizes()
        self.check(len(self.core.table) == 0, "I8", "table", len(self.core.table))
        self.check(sizes == dict.fromkeys(sizes, 0), "I8", sizes)
        last = {m.rid: m for m in self.reqs}
        for m in last.values():  # what is remembered holds no plan, error or lifecycle
            tomb = self.core.table.find(m.rid)
            self.check(isinstance(tomb, Tombstone), "I8", m.rid, tomb)
            assert isinstance(tomb, Tombstone)
            self.check((tomb.state, tomb.reason) == (m.state, m.reason), "I5", m.rid, tomb)
        self.check(len(self.core.table._recent) <= RECENT, "I8", len(self.core.table._recent))

    # -- checks --------------------------------------------------------------------

    @invariant()
    def model_agrees(self) -> None:
        self.steps += 1
        for m in self.reqs:
            lc = m.req.lc
            got = (lc.state, lc.reason)
            if got != (m.state, m.reason):
                # A live request the model ended: an exit path left it live (I3);
                # any other difference is a wrong outcome (I5).
                gap = "I3" if m.terminal and lc.state not in TERMINAL else "I5"
                self.check(False, gap, m.rid, got, (m.state, m.reason))
            terminal = [h for h in lc.history if h.dest in TERMINAL]
            self.check(len(terminal) == (1 if m.terminal else 0), "I2", m.rid, lc.history)
            self.check(not terminal or lc.history[-1] is terminal[0], "I2", m.rid, lc.history)
        for m in self.reqs:
            err, want = m.req.lc.error, m.error
            if isinstance(want, tuple):
                self.check(isinstance(err, want[0]), "I5", m.rid, err, want)
                ok = want[1] is None or getattr(err, "peer", None) == want[1]
                self.check(ok, "I5", m.rid, err, want)
            else:
                self.check(err is want, "I5", m.rid, err, want)
        transitions = sum(len(m.req.lc.history) for m in self.reqs)
        self.check(self.journal.count == transitions, "records", "journal", self.journal.count)
        logged = sorted(
            (level, event, tuple(sorted(kw.items())))
            for level, event, kw in self.logs.records
            if event in ("peer_lost", "peer_removed", "peer_alive")
        )
        self.check(logged == sorted(self.expected_logs), "peers", logged, self.expected_logs)
        self.check(self.core.checks.before_quiesce == 0, "I6", "released before quiesce")
        self.check(self.core.checks.double == self.double_expected, "I6", "double release")
        for name, detail in self.violations:
            self.check(False, name, detail)
        for m in self.reqs:
            key = f"{m.rid}#{m.order}"
            woken = self.wakes.get(key, 0)
            want_woken = self.waiters.get(key, 0) if m.reported else 0
            self.check(woken == want_woken, "callbacks", key, "woken", woken, want_woken)

    def check_sizes(self) -> None:
        live = len(self.by_id)
        sizes = self.core.sizes()
        self.check(sizes["table"] == live, "I8", sizes, live)
        self.check(sizes["inbox"] == 0, "I8", sizes)
        for name in ("queue", "deadlines", "backoffs"):
            self.check(sizes[name] <= 2 * live + 64, "I8", name, sizes, live)
        self.check(sizes["quarantine"] <= live, "I8", sizes, live)
        with self.core.lock:
            count, nbytes = self.core.quarantine()
        ok = count == sizes["quarantine"] and nbytes == 8 * count
        self.check(ok, "I8", "quarantine", count, nbytes, sizes)

    def teardown(self) -> None:
        # Only restores what __init__ patched: every check is a rule's or an invariant's.
        _lazyheap._COMPACT_MIN = self._threshold
        _core._log, _peer_changes._log = self._saved_logs


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=200, stateful_step_count=60)


# -- seeded bugs ------------------------------------------------------------------------


def _bug_exit_without_terminal(mp: pytest.MonkeyPatch) -> None:
    """A worker exit path (a non-retryable error) returns without failing."""
    original = SchedulerCore._conclude

    def buggy(self: SchedulerCore, req: RequestRecord, op: TransferOp) -> bool:
        err = op.error
        if err is not None and not err.retryable and err.reason is not R.PEER_LOST:
            return False
        return original(self, req, op)

    mp.setattr(SchedulerCore, "_conclude", buggy)


def _bug_release_before_quiesce(mp: pytest.MonkeyPatch) -> None:
    """A terminal request is handed out while an op may still touch its blocks."""
    mp.setattr(ReleaseQuarantine, "ready", staticmethod(lambda req: True))


def _bug_deadline_ignores_pending(mp: pytest.MonkeyPatch) -> None:
    """A request still PENDING (queued, or backing off) outlives its deadline."""
    original = SchedulerCore._expire

    def buggy(self: SchedulerCore, req: RequestRecord) -> None:
        if req.lc.state is S.PENDING:
            return
        original(self, req)

    mp.setattr(SchedulerCore, "_expire", buggy)


class SeededBug(NamedTuple):
    plant: Callable[[pytest.MonkeyPatch], None]
    invariant: str  # the check that must catch it: CHECKS' key


SEEDED_BUGS = {
    # The guard ends the request WORKER_EXITED: terminal, with the wrong reason.
    "exit_without_terminal": SeededBug(_bug_exit_without_terminal, "I5"),
    "release_before_quiesce": SeededBug(_bug_release_before_quiesce, "I6"),
    "deadline_ignores_pending": SeededBug(_bug_deadline_ignores_pending, "I4"),
}
SEEDS = range(1, 11)  # every seeded bug and the clean control run exactly these
SEARCH_EXAMPLES = 30  # the search's budget per seed: a catch must come within it
SEARCH = settings(
    max_examples=SEARCH_EXAMPLES,
    stateful_step_count=60,
    derandomize=False,  # the seed decides
    database=None,  # nothing replayed from an earlier run
    deadline=None,
    phases=[HPhase.explicit, HPhase.generate],  # the first catch is enough: no shrinking
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
    verbosity=Verbosity.quiet,
)


class HarnessFailure(Exception):
    """The machine failed by something other than one of its checks: no verdict."""


class Search(NamedTuple):
    seed: int
    examples: int  # examples the search started
    caught: str | None  # the invariant whose check failed first; None: none did
    example: int | None  # the example that failed it, counted from 1
    step: int | None  # the rule step in that example


def search(seed_value: int, machine: type[CoreMachine] = CoreMachine) -> Search:
    """One search of ``SEARCH_EXAMPLES`` examples on ``seed_value``, stopping at
    the first failure. Only an InvariantViolated is a verdict; any other
    exception raises HarnessFailure."""
    tally = Tally()
    run = seed(seed_value)(type(f"Search{seed_value}", (machine,), {"tally": tally}))
    try:
        run_state_machine_as_test(run, settings=SEARCH)
    except InvariantViolated as exc:
        assert tally.first is not None and tally.first[0] == exc.invariant, (tally, exc)
        return Search(seed_value, tally.examples, exc.invariant, *tally.first[1:])
    except Exception as exc:
        raise HarnessFailure(
            f"seed {seed_value}: the harness raised {type(exc).__name__}: {exc}"
        ) from exc
    return Search(seed_value, tally.examples, None, None, None)


def report_line(name: str, runs: list[Search]) -> str:
    examples = [r.example for r in runs if r.example is not None]
    steps = [r.step for r in runs if r.step is not None]
    caught = {r.caught for r in runs}
    return (
        f"{name:26} caught {sum(r.caught is not None for r in runs):2}/{len(runs)}"
        f" by {','.join(sorted(c for c in caught if c)) or '-':4}"
        f" median examples {statistics.median(examples) if examples else '-':>4}"
        f" (max {max(examples) if examples else '-'})"
        f" median step {statistics.median(steps) if steps else '-':>5}"
        f" examples run {sum(r.examples for r in runs)}"
    )


@pytest.mark.parametrize("bug", list(SEEDED_BUGS))
def test_the_search_catches_each_seeded_bug_on_every_seed(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    SEEDED_BUGS[bug].plant(monkeypatch)
    runs = [search(n) for n in SEEDS]
    print(report_line(bug, runs))
    assert [r.caught for r in runs] == [SEEDED_BUGS[bug].invariant] * len(SEEDS), runs


def test_the_clean_core_passes_the_same_seeds_and_budget() -> None:
    runs = [search(n) for n in SEEDS]
    print(report_line("clean core (control)", runs))
    assert [r.caught for r in runs] == [None] * len(SEEDS), runs
    assert all(r.examples >= SEARCH_EXAMPLES for r in runs), runs


class _BrokenHarness(CoreMachine):
    @rule()
    def divide(self) -> None:
        self.now = 1 / (self.now - self.now)  # a harness bug, not the core's


def test_a_harness_error_is_reported_as_such_never_as_a_catch() -> None:
    with pytest.raises(HarnessFailure, match=r"^seed 1: the harness raised ZeroDivisionError"):
        search(1, _BrokenHarness)


def test_a_catch_names_the_invariant_whose_check_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    SEEDED_BUGS["release_before_quiesce"].plant(monkeypatch)
    got = search(1)
    assert got.caught == "I6" and got.example is not None and got.step is not None
    assert 1 <= got.example <= got.examples <= SEARCH_EXAMPLES + 1
    with pytest.raises(AssertionError, match="no such"):
        InvariantViolated("no such", "")


# -- exact counters, queue bookkeeping, retries and probes, one scenario each -----------


class Core:
    """A core on SimBackend, stepped by hand on a simulated clock."""

    def __init__(self, max_in_flight: int = 1, retry: RetryPolicy = RETRY) -> None:
        self.now = 0.0
        self.backend = SimBackend()
        self.released: list[str] = []
        self.core = SchedulerCore(
            self.backend,
            max_in_flight=max_in_flight,
            retry=retry,
            probe_interval_s=PROBE_S,
            peer_lost_after_probes=1,
            journal=None,
            defer=lambda fn: fn(),
        )
        self.core.add_peer(peer_info("p0"))

    def submit(
        self,
        rid: str,
        *script: str,
        priority: int = 0,
        deadline_s: float = 10.0,
        peer: str = "p0",
    ) -> RequestRecord:
        plan = TransferPlan(peer, (Batch((0x10,), (0x1000,), (8,)),), 8, 1)
        req = self.core.new_request(rid, plan, self.now, deadline_s, priority, None)
        self.backend.owner[id(plan)] = rid
        self.backend.script[rid] = deque(script)
        self.core.accept(req, self.core.table.peer_info(peer))
        return req

    def step(self, dt: float = 0.0) -> _core.StepResult:
        self.now += dt
        res = self.core.step(self.now)
        self.released += [r.request_id for r in res.releases]
        return res

    def op_of(self, rid: str, n: int = -1) -> Op:
        return [o for o in self.backend.ops if o.rid == rid][n]

    def finish(self, rid: str, outcome: str = "ok", quiesce: bool = True) -> None:
        op = self.op_of(rid)
        self.backend.resolve(op, outcome)
        if quiesce:
            self.backend.quiesce(op)


def test_done_and_failed_counters_add_up_over_requests() -> None:
    c = Core(max_in_flight=4)
    for rid in ("a", "b", "c", "d"):
        c.submit(rid)
    c.step()
    c.finish("a")
    c.finish("b")
    c.finish("c", "error")
    c.finish("d", "invalid")
    res = c.step()
    assert [f.request_id for f in res.finished] == ["a", "b", "c", "d"]
    assert (c.core.done, c.core.bytes_done) == (2, 16)
    assert c.core.failed == {"TRANSFER_ERROR": 1, "INVALID_REQUEST": 1}
    assert c.released == ["a", "b", "c", "d"]
    assert c.core._running == 0


def test_in_flight_counter_admits_exactly_up_to_the_limit() -> None:
    c = Core(max_in_flight=2)
    reqs = [c.submit(f"r{i}") for i in range(5)]
    c.step()
    assert [s[0] for s in c.backend.submits] == ["r0", "r1"]
    assert c.core._running == 2
    c.finish("r0")
    c.step()
    assert [s[0] for s in c.backend.submits] == ["r0", "r1", "r2"]
    assert c.core._running == 2
    reqs[1].lc.fail(R.ABORTED)  # ended from another thread while running
    c.step()
    assert [s[0] for s in c.backend.submits] == ["r0", "r1", "r2", "r3"]
    assert c.core._running == 2
    reqs[4].lc.fail(R.ABORTED)  # ended while queued: frees no slot
    c.step()
    assert c.core._running == 2
    assert len(c.backend.submits) == 4
    c.finish("r2")
    c.finish("r3")
    c.step()
    assert c.core._running == 0
    assert c.core.sizes()["queue"] == 0


def test_queue_stale_count_and_compaction_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lazyheap, "_COMPACT_MIN", 4)
    c = Core(max_in_flight=1)
    c.submit("run")
    c.step()
    queued = [c.submit(f"q{i}") for i in range(4)]
    c.step()
    assert (len(c.core._queue), c.core._queue._stale) == (4, 0)
    sizes = []
    for req in queued[:3]:
        req.lc.fail(R.ABORTED)
        c.step()
        sizes.append((len(c.core._queue), c.core._queue._stale))
    # 2 * stale must exceed the size (2 of 4 is not enough); 4 items is enough to compact.
    assert sizes == [(4, 1), (4, 2), (1, 0)]
    assert c.core.sizes()["queue"] == 1


def test_admission_skips_stale_queue_items_and_counts_them_off() -> None:
    c = Core(max_in_flight=1)
    c.submit("run")
    c.step()
    first = c.submit("q0")
    c.submit("q1")
    c.submit("q2")
    c.step()
    first.lc.fail(R.ABORTED)
    c.step()
    assert (len(c.core._queue), c.core._queue._stale) == (3, 1)
    c.finish("run")
    c.step()
    assert [s[0] for s in c.backend.submits] == ["run", "q1"]
    assert (len(c.core._queue), c.core._queue._stale) == (1, 0)


def test_three_retryable_failures_in_a_row_fail_on_the_third_attempt() -> None:
    c = Core()
    req = c.submit("r", "hold", "hold", "hold")
    res = c.step()
    assert res.next_at == 10.0  # the deadline; no backoff yet
    c.finish("r", "engine")
    res = c.step()
    assert res.finished == []
    assert res.next_at == pytest.approx(0.05)  # backoff 1: 0.05 s
    assert c.core._running == 1
    assert len(c.core._backoffs) == 1
    res = c.step(0.049)
    assert len(c.backend.submits) == 1
    res = c.step(0.001)
    assert len(c.backend.submits) == 2
    assert req.lc.attempt == 2
    c.finish("r", "engine")
    res = c.step()
    assert res.next_at == pytest.approx(0.05 + 0.1)  # backoff 2: 0.1 s
    c.step(0.1)
    assert len(c.backend.submits) == 3
    assert req.lc.attempt == 3
    c.finish("r", "engine")
    res = c.step()
    assert [(f.state, f.reason, f.attempt) for f in res.finished] == [
        (S.FAILED, R.TRANSFER_ERROR, 3)
    ]
    assert len(c.backend.submits) == 3
    assert c.core._running == 0
    assert c.core.failed == {"TRANSFER_ERROR": 1}
    assert res.next_at is None


def test_two_retryable_failures_then_success_is_done_on_the_third_attempt() -> None:
    c = Core()
    req = c.submit("r")
    c.step()
    for _ in range(2):
        c.finish("r", "backpressure")
        c.step()
        c.step(0.2)
    c.finish("r")
    res = c.step()
    assert [(f.state, f.attempt) for f in res.finished] == [(S.DONE, 3)]
    assert req.lc.attempt == 3
    assert (c.core.done, c.core.bytes_done, c.core._running) == (1, 8, 0)


def test_abort_in_backoff_frees_the_slot_and_the_backoff_timer() -> None:
    c = Core(max_in_flight=1)
    req = c.submit("r")
    c.submit("next")
    c.step()
    c.finish("r", "engine")
    c.step()
    assert c.core._running == 1 and len(c.core._backoffs) == 1
    req.lc.fail(R.ABORTED)
    c.step()
    assert c.core._running == 1  # "next" took the slot
    assert [s[0] for s in c.backend.submits] == ["r", "next"]
    c.step(1.0)  # the backoff's time passes: no second attempt of "r"
    assert [s[0] for s in c.backend.submits] == ["r", "next"]


def test_a_retry_while_the_previous_op_is_unquiesced_waits_for_both() -> None:
    c = Core()
    req = c.submit("r")
    c.step()
    first = c.op_of("r")
    c.backend.resolve(first, "engine")  # failed, but the engine still holds the blocks
    c.step()
    c.step(0.05)
    assert len(req.ops) == 2 and req.unquiesced == 2
    c.finish("r")  # the retry succeeds and quiesces
    res = c.step()
    assert [(f.state, f.attempt) for f in res.finished] == [(S.DONE, 2)]
    assert req.unquiesced == 1
    assert res.releases == [] and c.released == []
    assert c.core.quarantine() == (1, 8)
    c.backend.quiesce(first)
    res = c.step()
    assert res.finished == [] and res.releases == [req]
    assert req.unquiesced == 0
    assert c.core.quarantine() == (0, 0)


def test_probes_are_listed_once_per_interval_while_requests_are_live() -> None:
    c = Core()
    c.submit("r")
    res = c.step(1.0)
    assert res.probes == ["p0"]
    assert res.next_at == 10.0  # the deadline; the probe is out
    res = c.step(0.1)
    assert res.probes == []
    c.core.probe_result("p0", None)
    res = c.step(0.1)
    assert res.probes == []
    assert res.next_at == pytest.approx(1.2 + PROBE_S)
    res = c.step(PROBE_S - 0.01)
    assert res.probes == []
    res = c.step(0.01)
    assert res.probes == ["p0"]
    c.core.probe_result("p0", RuntimeError("down"))
    res = c.step()
    assert [(f.request_id, f.reason) for f in res.finished] == [("r", R.PEER_LOST)]
    assert res.next_at == pytest.approx(1.7 + PROBE_S)  # a lost peer is still probed
    c.finish("r")
    res = c.step(PROBE_S)
    assert res.probes == ["p0"]
    c.core.probe_result("p0", None)
    c.step()
    assert c.core.table.peers.get("p0").alive  # type: ignore[union-attr]


def test_no_peer_is_probed_without_live_requests() -> None:
    c = Core()
    res = c.step(5.0)
    assert (res.probes, res.next_at) == ([], None)


def test_errors_name_the_cause_exactly() -> None:
    c = Core(max_in_flight=3)
    c.core.add_peer(peer_info("p1"))
    late = c.submit("late", deadline_s=1.0)
    c.step()
    c.step(1.0)
    assert late.lc.reason is R.TIMEOUT
    assert (
        str(late.lc.error)
        == "request 'late' missed its deadline (in state TRANSFERRING, attempt 1)"
    )
    assert c.core._deadlines._stale == 0  # a fired deadline is popped, not discarded
    probed = c.submit("probed")
    c.step()
    c.core.probe_result("p0", RuntimeError("refused"))
    c.step()
    assert probed.lc.reason is R.PEER_LOST
    assert str(probed.lc.error) == "probe failed: refused"
    c.core.probe_result("p0", None)
    c.step()
    removed = c.submit("removed")
    c.step()
    assert c.core.remove_peer("p0") == 1
    assert str(removed.lc.error) == "peer p0 was removed"


def test_a_request_ended_elsewhere_finishes_where_the_core_first_sees_it() -> None:
    c = Core(max_in_flight=3)
    c.core.add_peer(peer_info("p1"))
    lost = c.submit("lost")
    ended = c.submit("ended", peer="p1")
    c.submit("other", peer="p1")
    c.step()
    # Inbox: p0's probe fails, "ended" gets its result, "other" its, then two aborts.
    c.core.probe_result("p0", RuntimeError("down"))
    c.finish("ended")
    c.finish("other")
    ended.lc.fail(R.ABORTED)
    lost.lc.fail(R.ABORTED)
    res = c.step()
    # "lost" ends where the lost peer is seen (not at its abort, last in the
    # inbox); "ended" at its op result (the result is moot: it was aborted).
    assert [(f.request_id, f.reason) for f in res.finished] == [
        ("lost", R.ABORTED),
        ("ended", R.ABORTED),
        ("other", None),
    ]


def test_timer_stale_counts_are_exact() -> None:
    c = Core(max_in_flight=3)
    c.submit("first", deadline_s=5.0)  # stays live: its deadline keeps the heap's top live
    c.submit("a", deadline_s=20.0)
    b = c.submit("b")
    c.step()
    c.finish("a")  # finished while RUNNING: its deadline goes stale, no backoff does
    c.step()
    assert (len(c.core._deadlines), c.core._deadlines._stale) == (3, 1)
    assert (len(c.core._backoffs), c.core._backoffs._stale) == (0, 0)
    c.finish("b", "engine")
    c.step()
    assert (len(c.core._backoffs), c.core._backoffs._stale) == (1, 0)
    b.lc.fail(R.ABORTED)  # finished in BACKOFF: both its timers go stale
    c.step()
    assert (len(c.core._deadlines), c.core._deadlines._stale) == (3, 2)
    assert (len(c.core._backoffs), c.core._backoffs._stale) == (0, 0)  # dropped from the top


def test_a_worker_body_that_returns_without_an_ending_fails_worker_exited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SchedulerCore, "_work", lambda self, req: False)
    c = Core()
    req = c.submit("r")
    res = c.step()
    assert [(f.request_id, f.state, f.reason) for f in res.finished] == [
        ("r", S.FAILED, R.WORKER_EXITED)
    ]
    assert req.lc.reason is R.WORKER_EXITED
    assert c.core._running == 0


def test_the_core_posts_nothing_for_its_own_endings_and_forgets_their_deadlines() -> None:
    c = Core()
    c.core.add_peer(peer_info("p1"))
    req = c.submit("r")
    c.step()
    c.backend.resolve(c.op_of("r"), "ok")  # done, not quiesced: quarantined
    wakes: list[int] = []
    c.core.table.wake = lambda: wakes.append(1)
    res = c.step()
    assert [f.request_id for f in res.finished] == ["r"] and res.releases == []
    assert wakes == [] and len(c.core.table.inbox) == 0  # ended inside the step: no post
    assert len(c.core._deadlines) == 0  # a quarantined request's deadline is no timer
    assert res.next_at is None  # no timer left; its peer's probe is out
    other = c.submit("other", peer="p1")
    c.step()
    c.core.add_peer(peer_info("p1", variant=1))
    assert str(other.lc.error) == "peer p1 was replaced"
    assert req.lc.state is S.DONE


class _AbortOnStart(Journal):
    """A journal sink that, on the core's own thread, aborts another request."""

    def __init__(self) -> None:
        super().__init__(structlog.get_logger("test.abort-on-start"))
        self.victim: RequestLifecycle | None = None

    def transition(self, request_id: str, rec: TransitionRecord) -> None:
        if rec.event is Event.START and self.victim is not None:
            victim, self.victim = self.victim, None
            victim.fail(R.ABORTED)


def test_a_request_ended_by_user_code_on_the_stepping_thread_is_still_finished() -> None:
    # User code running inside a step (a journal sink) ends a queued request.
    # On the core's own thread nothing is posted to the inbox (the core's own
    # endings are finished where they happen), so admission must notice the
    # request is already terminal and finish it, not leave it RUNNING forever.
    c = Core(max_in_flight=2)
    journal = _AbortOnStart()
    c.core.journal = journal
    c.submit("a")
    b = c.submit("b")
    journal.victim = b.lc
    res = c.step()
    assert [(f.request_id, f.state, f.reason) for f in res.finished] == [("b", S.FAILED, R.ABORTED)]
    assert [r.request_id for r in res.releases] == ["b"]
    assert [op.rid for op in c.backend.ops] == ["a"]  # b never reached the backend
    assert c.core._running == 1  # only a holds a slot
