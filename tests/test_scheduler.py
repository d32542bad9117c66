"""Scheduler over LocalBackend (and exact scripted faults): invariants I2-I8.

Every request goes through a ``Rig``: a LocalBackend wrapped by a
FaultInjectingBackend (``FaultPlan.script``) wrapped by a ``Recorder`` that
remembers every op the scheduler was handed, by request id, so that the
release callback can check that each of them had quiesced (I6) and count
releases per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from lifecycle import TERMINAL, FailureReason, RequestLifecycle, TransferState
from scheduler import (
    DriverFailed,
    DuplicateRequest,
    Finished,
    InvalidRequest,
    RetryPolicy,
    Scheduler,
    SchedulerClosed,
    StuckInspector,
    UnknownPeer,
    UnknownRequest,
    quarantined_requests,
)
from scheduler._release import run_release
from scheduler._requests import RequestRecord, Tombstone
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
    RemoteRangeRejected,
    TransferBackend,
    TransferCancelled,
    TransferError,
    TransferOp,
    TransferPlan,
    TransferTimeout,
)

LAYOUT = KVLayout(num_layers=2, num_blocks=64, block_bytes=64)
PEER = "decode-0"
LONG = 10.0  # deadline of requests that must not time out
# A hang guard, not a speed figure: how long past its own deadline a waiter may
# come back on a loaded 2-core machine. It still ends a wait held to the LONG
# deadline, to a 30 s blocker or forever; the speed is `kvguard bench`'s.
HANG_S = 5.0
# A hang guard on anything that should happen promptly, waited out only when
# it does not: under load, a raising callback's logged traceback alone can take
# seconds to render.
WAIT = 30.0

HANG, ERR, RAISE, LOSE, NONE = (
    FaultKind.HANG,
    FaultKind.ERROR_CODE,
    FaultKind.RAISE,
    FaultKind.LOSE_PEER,
    FaultKind.NONE,
)
_S = TransferState


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class Recorder(TransferBackend):
    """The outermost backend: records every op by the request that owns its blocks.

    ``errors``: the next submits fail with these instead of reaching ``inner``
    (a TransferError becomes a failed op; anything else is raised, as a buggy
    backend would). ``on_submit(rid, op)`` runs after each submit, before the
    scheduler sees the op: it pins an interleaving.
    """

    name = "recorder"

    def __init__(self, inner: TransferBackend, owner: dict[int, str]) -> None:
        self.inner = inner
        self.owner = owner  # destination block address (any buffer) -> request id
        self.ops: defaultdict[str, list[TransferOp]] = defaultdict(list)
        self.errors: deque[BaseException] = deque()
        self.on_submit: Callable[[str, TransferOp], None] | None = None
        self.lock = threading.Lock()

    def submit(self, plan: TransferPlan) -> TransferOp:
        rid = self.owner[plan.batches[0].dst[0]]
        if self.errors:
            err = self.errors.popleft()
            if not isinstance(err, TransferError):
                raise err
            op = TransferOp(plan)
            op._resolve(err)
            op._quiesce()
        else:
            op = self.inner.submit(plan)
        with self.lock:
            self.ops[rid].append(op)
        if self.on_submit is not None:
            self.on_submit(rid, op)
        return op

    def ops_of(self, rid: str) -> list[TransferOp]:
        with self.lock:
            return list(self.ops.get(rid, ()))

    def probe(self, peer: str) -> None:
        self.inner.probe(peer)

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class Release:
    rid: str
    finished: Finished
    quiesced: bool  # every op of the request had quiesced when the callback ran
    terminal: bool  # the lifecycle was terminal when the callback ran
    at: float


class Rig:
    """Scheduler + Recorder(FaultInjectingBackend(LocalBackend)); closed by the fixture."""

    def __init__(
        self,
        faults: Sequence[FaultKind | Fault] = (),
        *,
        workers: int = 4,
        retry: RetryPolicy | None = None,
        probe_interval_s: float = 0.5,
        default_deadline_s: float = LONG,
        release: Callable[[str, Finished], object] | None = None,
    ) -> None:
        self.src = KVCache(LAYOUT)
        self.src.fill_seeded(1234)
        self.dst = KVCache(LAYOUT)
        self.local = LocalBackend(workers=2)
        self.info: PeerInfo = self.local.register_peer(PEER, self.dst)
        self.local.register_source(self.src)
        self.faults = FaultInjectingBackend(self.local, FaultPlan.script(faults))
        self.owner: dict[int, str] = {}
        self.backend = Recorder(self.faults, self.owner)
        self.releases: list[Release] = []
        self.release_count: Counter[str] = Counter()  # per id, over every reuse
        self.generation: Counter[str] = Counter()  # accepted submits per id
        self.release_per_submit: Counter[tuple[str, int]] = Counter()
        self._user_release = release
        self.close_timeout = WAIT  # for the fixture's close()
        self._rlock = threading.Lock()
        self.sched = Scheduler(
            self.backend,
            self.src,
            workers=workers,
            retry=retry or RetryPolicy(backoff_s=0.001),
            release=self._release,
            probe_interval_s=probe_interval_s,
            default_deadline_s=default_deadline_s,
        )
        self.sched.add_peer(self.info)

    def _release(self, rid: str, fin: Finished) -> None:
        ops = self.backend.ops_of(rid)
        lc = self.sched.get(rid)  # still known while its release runs
        rel = Release(rid, fin, all(op.quiesced for op in ops), lc.is_terminal, time.monotonic())
        with self._rlock:
            self.releases.append(rel)
            self.release_count[rid] += 1
            # A reused id is a new request: count releases per submission.
            self.release_per_submit[(rid, self.generation[rid])] += 1
        if self._user_release is not None:
            self._user_release(rid, fin)

    def submit(
        self, rid: str, srcs: Sequence[int], dsts: Sequence[int], **kw: Any
    ) -> RequestLifecycle:
        for d in dsts:
            for buf in range(LAYOUT.num_buffers):
                self.owner[self.dst.block_addr(buf, d)] = rid
        kw.setdefault("peer", PEER)
        # Counted before: the release may run before submit returns. A new
        # submit under an id can only be accepted after its release returned.
        with self._rlock:
            self.generation[rid] += 1
        try:
            return self.sched.submit(rid, srcs, dsts, **kw)
        except Exception:
            with self._rlock:
                self.generation[rid] -= 1
            raise

    def released(self, rid: str) -> int:
        with self._rlock:
            return self.release_count[rid]

    def wait_released(self, rid: str, timeout: float = WAIT) -> bool:
        """Our callback ran and the scheduler freed the id (it does so after)."""
        return wait_until(lambda: self.released(rid) >= 1 and not self.holds(rid), timeout)

    def holds(self, rid: str) -> bool:
        return any(r.request_id == rid for r in self.sched._table.requests())

    def intact(self, srcs: Sequence[int], dsts: Sequence[int]) -> list[int]:
        return self.src.blocks_equal(self.dst, srcs, dsts)

    def check_i6(self) -> None:
        """Every release so far: once per request, terminal and quiesced."""
        m = self.sched.metrics()
        assert m.released_before_quiesce == 0
        assert m.double_releases == 0
        with self._rlock:
            assert all(r.quiesced for r in self.releases), self.releases
            assert all(r.terminal and r.finished.state in TERMINAL for r in self.releases)
            assert max(self.release_per_submit.values(), default=1) == 1, self.release_per_submit

    def close(self) -> None:
        try:
            self.faults.release_hangs()
            self.sched.close(timeout=self.close_timeout)
        finally:
            self.faults.close()


MakeRig = Callable[..., Rig]


@pytest.fixture
def make_rig() -> Iterator[MakeRig]:
    rigs: list[Rig] = []

    def make(*args: object, **kwargs: object) -> Rig:
        rig = Rig(*args, **kwargs)  # type: ignore[arg-type]
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()


def poll_until(rig: Rig, n: int, timeout: float = WAIT) -> list[Finished]:
    """Poll until ``n`` outcomes came back (or timeout); return them all."""
    out: list[Finished] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out.extend(rig.sched.poll())
        time.sleep(0.005)
    return out


def state_of(rig: Rig, rid: str) -> TransferState:
    return rig.sched.get(rid).state


# -- the happy path -----------------------------------------------------------------


def test_requests_complete_done_with_integrity_and_one_quiesced_release(rig: Rig) -> None:
    reqs = {
        "a": ([0, 1, 2, 3], [10, 11, 12, 13]),  # one coalesced run
        "b": ([7, 5, 9], [20, 30, 25]),  # scattered
        "c": ([40], [63]),
        "d": (list(range(50, 60)), list(range(40, 50))[::-1]),  # reversed
    }
    lcs = {rid: rig.submit(rid, s, d) for rid, (s, d) in reqs.items()}
    for rid, lc in lcs.items():
        assert lc.wait(WAIT) is _S.DONE, (rid, lc)
        assert lc.reason is None and lc.attempt == 1
    for rid, (s, d) in reqs.items():
        assert rig.intact(s, d) == [], rid
    assert wait_until(lambda: all(rig.released(r) for r in reqs))
    rig.check_i6()
    assert sorted(r.rid for r in rig.releases) == sorted(reqs)
    # The destination of a request nobody sent to is still untouched.
    assert rig.dst.block(0, 0).count_nonzero().item() == 0


def test_poll_reports_each_outcome_exactly_once_with_state_and_reason(make_rig: MakeRig) -> None:
    rig = make_rig([NONE, HANG, NONE])
    assert rig.submit("ok", [0], [0]).wait(WAIT) is _S.DONE
    rig.submit("hung", [1], [1])
    assert wait_until(lambda: state_of(rig, "hung") is _S.TRANSFERRING)
    rig.sched.abort("hung")
    rig.backend.errors.append(TransferError("boom"))  # not retryable
    rig.submit("bad", [2], [2])
    got = poll_until(rig, 3)
    by_id = {f.request_id: f for f in got}
    assert len(got) == 3 and len(by_id) == 3, got
    assert (by_id["ok"].state, by_id["ok"].reason) == (_S.DONE, None)
    assert (by_id["hung"].state, by_id["hung"].reason) == (_S.FAILED, FailureReason.ABORTED)
    assert (by_id["bad"].state, by_id["bad"].reason) == (
        _S.FAILED,
        FailureReason.TRANSFER_ERROR,
    )
    assert isinstance(by_id["bad"].error, TransferError)
    assert by_id["ok"].peer == PEER and by_id["ok"].nbytes == LAYOUT.num_buffers * 64
    assert all(f.latency_s >= 0 for f in got)
    time.sleep(0.05)
    assert rig.sched.poll() == []  # never twice
    rig.faults.release_hangs()
    assert rig.wait_released("hung")
    assert rig.sched.poll() == []  # a release is not a second outcome
    rig.check_i6()


def test_wait_and_wait_async_return_terminal_states(make_rig: MakeRig) -> None:
    gate = threading.Event()  # holds releases, so the ids stay known to wait()
    rig = make_rig([NONE, HANG], release=lambda rid, fin: gate.wait(WAIT))
    try:
        rig.submit("ok", [0, 1], [0, 1])
        assert rig.sched.wait("ok", timeout=WAIT) is _S.DONE
        rig.submit("hung", [2], [2])
        assert wait_until(lambda: state_of(rig, "hung") is _S.TRANSFERRING)
        # A timeout shorter than the deadline returns the live state, promptly.
        # (the live state: it came back before the request's deadline ended it).
        assert rig.sched.wait("hung", timeout=0.1) is _S.TRANSFERRING
        threading.Timer(0.1, rig.sched.abort, args=("hung",)).start()
        assert rig.sched.wait("hung") is _S.FAILED

        rig.submit("async", [3], [3])

        async def both() -> tuple[TransferState, TransferState]:
            return (
                await rig.sched.wait_async("async", timeout=WAIT),
                await rig.sched.wait_async("ok"),
            )

        assert asyncio.run(both()) == (_S.DONE, _S.DONE)
        with pytest.raises(UnknownRequest, match="nope"):
            rig.sched.wait("nope")
        with pytest.raises(UnknownRequest, match="nope"):
            asyncio.run(rig.sched.wait_async("nope"))
    finally:
        gate.set()


def test_wait_never_outlives_the_deadline_of_a_hung_request(make_rig: MakeRig) -> None:
    rig = make_rig([HANG, HANG])
    t0 = time.monotonic()
    rig.submit("h1", [0], [0], deadline_s=0.4)
    rig.submit("h2", [1], [1], deadline_s=0.4)
    assert rig.sched.wait("h1") is _S.FAILED
    assert time.monotonic() - t0 < 0.4 + HANG_S
    assert rig.sched.get("h1").reason is FailureReason.TIMEOUT

    async def later() -> TransferState:
        return await rig.sched.wait_async("h2")

    assert asyncio.run(later()) is _S.FAILED
    assert time.monotonic() - t0 < 0.4 + HANG_S
    assert rig.sched.get("h2").reason is FailureReason.TIMEOUT


# -- abort ------------------------------------------------------------------------------


def test_abort_fails_aborted_once_and_unknown_id_is_typed(make_rig: MakeRig) -> None:
    rig = make_rig([HANG])
    lc = rig.submit("r", [0, 1], [4, 5])
    assert wait_until(lambda: lc.state is _S.TRANSFERRING)
    assert rig.sched.abort("r") is True
    assert lc.state is _S.FAILED and lc.reason is FailureReason.ABORTED
    assert rig.sched.abort("r") is False  # already terminal: a no-op (I1)
    assert lc.reason is FailureReason.ABORTED
    terminal = [h for h in lc.history if h.dest in TERMINAL]
    assert len(terminal) == 1
    with pytest.raises(UnknownRequest, match="'ghost'"):
        rig.sched.abort("ghost")
    # The hung op may still write: no release until it returns (I6).
    assert wait_until(lambda: rig.sched.metrics().quarantined == 1)  # the driver's step
    time.sleep(0.2)
    assert rig.released("r") == 0
    assert rig.sched.metrics().quarantined == 1
    rig.faults.release_hangs()
    assert rig.wait_released("r")
    rig.check_i6()


def test_abort_of_a_queued_request_never_starts_it(make_rig: MakeRig) -> None:
    rig = make_rig([HANG], workers=1)
    rig.submit("blocker", [0], [0])
    assert wait_until(lambda: state_of(rig, "blocker") is _S.TRANSFERRING)
    lc = rig.submit("queued", [1], [1])
    assert lc.state is _S.PENDING
    assert rig.sched.abort("queued") is True
    assert rig.wait_released("queued")  # no op was ever submitted for it
    assert rig.backend.ops_of("queued") == []
    assert lc.attempt == 0
    rig.sched.abort("blocker")
    rig.faults.release_hangs()
    assert rig.wait_released("blocker")
    rig.check_i6()


def test_abort_racing_the_backend_submit_releases_only_after_quiesce(make_rig: MakeRig) -> None:
    """The worker has submitted an op but not yet recorded it when abort wins.

    The op (a hang: an engine call still writing) must keep the request's
    blocks quarantined: the release callback waits for it (I6).
    """
    rig = make_rig([HANG])

    def abort_now(rid: str, op: TransferOp) -> None:
        t = threading.Thread(target=rig.sched.abort, args=(rid,))
        t.start()
        t.join()

    rig.backend.on_submit = abort_now
    lc = rig.submit("r", [0, 1], [0, 1])
    assert lc.wait(WAIT) is _S.FAILED and lc.reason is FailureReason.ABORTED
    [op] = rig.backend.ops_of("r")
    assert not op.quiesced
    time.sleep(0.3)
    assert rig.released("r") == 0, "released while an engine call may still write"
    assert rig.sched.metrics().released_before_quiesce == 0
    rig.faults.release_hangs()
    assert rig.wait_released("r")
    rig.check_i6()


# -- rejected submits --------------------------------------------------------------------


def _snapshot(rig: Rig) -> tuple[object, ...]:
    m = rig.sched.metrics()
    return (m.done, m.failed_by_reason, m.live_by_state, m.quarantined, m.released)


BAD_SUBMITS: list[tuple[str, dict[str, object], type[Exception], str]] = [
    ("src-out-of-range", {"srcs": [0, 64]}, InvalidPlan, "64"),
    ("src-negative", {"srcs": [0, -1]}, InvalidPlan, "-1"),
    ("dst-out-of-range", {"dsts": [0, 999]}, InvalidPlan, "999"),
    ("dst-not-int", {"dsts": [1.5, 2]}, InvalidPlan, "1.5"),
    ("dst-duplicate", {"srcs": [0, 1], "dsts": [3, 3]}, InvalidPlan, "3"),
    ("mismatched", {"srcs": [0, 1], "dsts": [0]}, InvalidPlan, "2 source blocks"),
    ("one-side-empty", {"srcs": [], "dsts": [0]}, InvalidPlan, "0 source blocks"),
    ("unknown-peer", {"peer": "nobody:1"}, UnknownPeer, "nobody:1"),
    ("deadline-zero", {"deadline_s": 0}, InvalidRequest, "0"),
    ("deadline-negative", {"deadline_s": -1.0}, InvalidRequest, "-1.0"),
    ("deadline-nan", {"deadline_s": math.nan}, InvalidRequest, "nan"),
    ("deadline-inf", {"deadline_s": math.inf}, InvalidRequest, "inf"),
    ("deadline-bool", {"deadline_s": True}, InvalidRequest, "True"),
    ("deadline-str", {"deadline_s": "1"}, InvalidRequest, "'1'"),
    ("priority-float", {"priority": 1.5}, InvalidRequest, "1.5"),
    ("id-int", {"rid": 42}, InvalidRequest, "42"),
    ("id-empty", {"rid": ""}, InvalidRequest, "''"),
    ("id-none", {"rid": None}, InvalidRequest, "None"),
]


@pytest.mark.parametrize(
    ("case", "bad", "exc", "names"), BAD_SUBMITS, ids=[c[0] for c in BAD_SUBMITS]
)
def test_rejected_submit_is_typed_and_leaves_no_state(
    rig: Rig, case: str, bad: dict[str, object], exc: type[Exception], names: str
) -> None:
    rig.submit("warm", [9], [9])  # a scheduler that has already served
    assert rig.wait_released("warm")
    assert [f.request_id for f in rig.sched.poll()] == ["warm"]
    before = _snapshot(rig)
    args: dict[str, object] = {"rid": "x", "srcs": [0, 1], "dsts": [0, 1], **bad}
    rid, srcs, dsts = args.pop("rid"), args.pop("srcs"), args.pop("dsts")
    with pytest.raises(exc) as info:
        rig.sched.submit(rid, srcs, dsts, **{"peer": PEER, **args})  # type: ignore[arg-type]
    assert names in str(info.value), str(info.value)
    time.sleep(0.02)
    assert _snapshot(rig) == before
    assert rig.sched.poll() == []  # nothing to report
    if isinstance(rid, str) and rid:
        with pytest.raises(UnknownRequest):
            rig.sched.get(rid)
    # The id is free and the scheduler keeps serving.
    lc = rig.submit("x", [5, 6], [7, 8])
    assert lc.wait(WAIT) is _S.DONE
    assert rig.intact([5, 6], [7, 8]) == []
    assert rig.backend.ops_of("x") and len(rig.backend.ops_of("x")) == 1
    assert rig.wait_released("x")
    rig.check_i6()


def test_poll_stays_empty_after_rejected_submits(rig: Rig) -> None:
    for rid, srcs, dsts in [("a", [0], [99]), ("b", [0, 1], [2]), ("c", [70], [1])]:
        with pytest.raises(InvalidPlan):
            rig.sched.submit(rid, srcs, dsts, peer=PEER)
    time.sleep(0.05)
    assert rig.sched.poll() == []
    assert rig.sched.live_requests() == []
    assert rig.sched.drain(timeout=0.1) is True


def test_remote_range_outside_the_peer_is_rejected_before_state(rig: Rig) -> None:
    small = KVCache(KVLayout(LAYOUT.num_layers, 8, LAYOUT.block_bytes))
    info = rig.local.register_peer("small", small)
    rig.sched.add_peer(info)
    with pytest.raises(InvalidPlan, match="40"):
        rig.sched.submit("x", [0], [40], peer="small")
    # A peer advertising less than its layout claims: the region check catches it.
    lying = PeerInfo("lying", info.regions[:1], LAYOUT, block_base=rig.dst.buffer_bases())
    rig.sched.add_peer(lying)
    with pytest.raises(RemoteRangeRejected):
        rig.sched.submit("x", [0], [40], peer="lying")
    with pytest.raises(UnknownRequest):
        rig.sched.get("x")


def test_duplicate_id_is_rejected_and_the_first_request_is_unaffected(make_rig: MakeRig) -> None:
    rig = make_rig([HANG])
    first = rig.submit("dup", [0, 1], [0, 1])
    assert wait_until(lambda: first.state is _S.TRANSFERRING)
    before = _snapshot(rig)
    with pytest.raises(DuplicateRequest, match="'dup'"):
        rig.sched.submit("dup", [2], [2], peer=PEER)
    assert rig.sched.get("dup") is first
    assert first.state is _S.TRANSFERRING and first.attempt == 1
    assert _snapshot(rig) == before
    # Released, the hang ends in a retryable error: the first request retries, completes.
    rig.faults.release_hangs()
    assert first.wait(WAIT) is _S.DONE and first.attempt == 2
    assert rig.intact([0, 1], [0, 1]) == []
    # Duplicate until released; usable again afterwards.
    assert rig.wait_released("dup")
    # Released, it is still remembered (recent requests) until the id is reused.
    assert rig.sched.get("dup") is first
    assert rig.sched.wait("dup") is _S.DONE
    assert rig.sched.abort("dup") is False
    again = rig.submit("dup", [3], [3])
    assert rig.sched.get("dup") is again
    assert again is not first and again.wait(WAIT) is _S.DONE
    rig.check_i6()


def test_submit_after_close_is_typed_and_names_the_id(rig: Rig) -> None:
    assert rig.sched.close() is True
    before = _snapshot(rig)
    with pytest.raises(SchedulerClosed, match="'late'"):
        rig.sched.submit("late", [0], [0], peer=PEER)
    assert _snapshot(rig) == before
    with pytest.raises(UnknownRequest):
        rig.sched.get("late")
    assert rig.sched.close() is True  # idempotent


def test_constructor_rejects_bad_arguments(rig: Rig) -> None:
    for kwargs in ({"workers": 0}, {"workers": 1.0}, {"default_deadline_s": math.inf}):
        with pytest.raises(InvalidRequest):
            Scheduler(rig.backend, rig.src, **kwargs)
    with pytest.raises(InvalidRequest):
        rig.sched.add_peer("decode:1")  # type: ignore[arg-type]
    with pytest.raises(UnknownPeer):
        rig.sched.peer_alive("nobody")


# -- empty requests ------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_empty_request_is_done_at_once_and_reported(rig: Rig, empty: Sequence[int]) -> None:
    lc = rig.sched.submit("empty", empty, empty, peer=PEER)
    assert lc.state is _S.DONE  # before submit returned: nothing can leave it pending
    [fin] = poll_until(rig, 1)
    assert (fin.request_id, fin.state, fin.nbytes) == ("empty", _S.DONE, 0)
    assert rig.wait_released("empty")
    assert rig.backend.ops_of("empty") == []
    assert rig.sched.metrics().done == 1
    assert rig.sched.drain(timeout=WAIT)


# -- retries -------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [ERR, RAISE, Fault(FaultKind.FAIL_BATCH)], ids=str)
def test_retryable_error_then_success_is_done_on_attempt_two(
    make_rig: MakeRig, fault: object
) -> None:
    rig = make_rig([fault])
    lc = rig.submit("r", [0, 1, 2], [10, 20, 30])
    assert lc.wait(WAIT) is _S.DONE
    assert lc.attempt == 2
    assert [h.dest for h in lc.history] == [_S.TRANSFERRING, _S.PENDING, _S.TRANSFERRING, _S.DONE]
    assert rig.intact([0, 1, 2], [10, 20, 30]) == []
    assert len(rig.backend.ops_of("r")) == 2
    assert rig.wait_released("r")
    rig.check_i6()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TransferError("boom"), FailureReason.TRANSFER_ERROR),
        (TransferCancelled("cancelled"), FailureReason.ABORTED),
        (RemoteRangeRejected("outside"), FailureReason.INVALID_REQUEST),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name,
)
def test_non_retryable_error_fails_at_once_with_its_reason(
    rig: Rig, error: TransferError, reason: FailureReason
) -> None:
    rig.backend.errors.append(error)
    lc = rig.submit("r", [0], [0])
    assert lc.wait(WAIT) is _S.FAILED
    assert lc.reason is reason and lc.error is error and lc.attempt == 1
    assert len(rig.backend.ops_of("r")) == 1
    # The scheduler keeps serving.
    assert rig.submit("next", [1], [1]).wait(WAIT) is _S.DONE
    assert rig.wait_released("r")
    rig.check_i6()


def test_retries_exhausted_fail_with_the_last_error(make_rig: MakeRig) -> None:
    rig = make_rig([ERR, ERR, ERR, ERR], retry=RetryPolicy(max_attempts=3, backoff_s=0.001))
    lc = rig.submit("r", [0], [0])
    assert lc.wait(WAIT) is _S.FAILED
    assert lc.reason is FailureReason.TRANSFER_ERROR and lc.attempt == 3
    assert isinstance(lc.error, EngineError)
    assert len(rig.backend.ops_of("r")) == 3
    # The fourth scripted fault was never drawn: no attempt beyond the policy.
    assert rig.faults.stats[ERR] == 3
    assert rig.wait_released("r")
    rig.check_i6()


def test_backoff_never_outlives_the_deadline(make_rig: MakeRig) -> None:
    rig = make_rig(
        [ERR],
        retry=RetryPolicy(max_attempts=3, backoff_s=5.0, backoff_max_s=5.0),
    )
    t0 = time.monotonic()
    lc = rig.submit("r", [0], [0], deadline_s=0.3)
    assert lc.wait(WAIT) is _S.FAILED
    assert lc.reason is FailureReason.TIMEOUT
    assert lc.attempt == 1  # the deadline ended the 5 s backoff: no second attempt
    assert len(rig.backend.ops_of("r")) == 1
    assert time.monotonic() - t0 < 5.0  # before the backoff would have ended


def test_a_crashing_backend_submit_fails_the_request_and_spares_the_scheduler(
    rig: Rig,
) -> None:
    rig.backend.errors.append(RuntimeError("backend bug"))
    lc = rig.submit("r", [0], [0])
    assert lc.wait(WAIT) is _S.FAILED
    assert lc.reason is FailureReason.WORKER_CRASHED
    assert isinstance(lc.error, RuntimeError)
    assert rig.wait_released("r")
    assert rig.submit("next", [1], [1]).wait(WAIT) is _S.DONE
    rig.check_i6()


# -- deadlines and quarantine ---------------------------------------------------------------


def test_hang_times_out_at_the_deadline_and_stays_quarantined_until_release(
    make_rig: MakeRig,
) -> None:
    rig = make_rig([HANG])
    t0 = time.monotonic()
    lc = rig.submit("r", [0, 1], [2, 3], deadline_s=0.5)
    assert rig.sched.wait("r") is _S.FAILED
    took = time.monotonic() - t0
    assert 0.5 - 0.05 <= took <= 0.5 + HANG_S, took  # never before its deadline
    assert lc.reason is FailureReason.TIMEOUT
    [fin] = poll_until(rig, 1)
    assert fin.reason is FailureReason.TIMEOUT
    assert 0.5 - 0.05 <= fin.latency_s <= 0.5 + HANG_S
    # Terminal, but the hung call may still write: quarantined, not released (I6).
    time.sleep(0.3)
    assert rig.released("r") == 0
    m = rig.sched.metrics()
    assert (m.quarantined, m.live_by_state, m.released) == (
        1,
        {"PENDING": 0, "TRANSFERRING": 0},
        0,
    )
    assert rig.sched.drain(timeout=0.1) is False
    rig.faults.release_hangs()
    assert rig.wait_released("r")
    assert rig.sched.drain(timeout=WAIT)
    time.sleep(0.05)
    assert rig.released("r") == 1  # exactly once
    assert rig.sched.metrics().quarantined == 0
    rig.check_i6()


def test_pending_requests_have_deadlines_too(make_rig: MakeRig) -> None:
    rig = make_rig([HANG], workers=1)
    rig.submit("blocker", [0], [0])
    assert wait_until(lambda: state_of(rig, "blocker") is _S.TRANSFERRING)
    lc = rig.submit("queued", [1], [1], deadline_s=0.3)
    assert lc.wait(WAIT) is _S.FAILED  # while the blocker still holds the only worker
    assert lc.reason is FailureReason.TIMEOUT and lc.attempt == 0
    assert state_of(rig, "blocker") is _S.TRANSFERRING
    assert rig.backend.ops_of("queued") == []  # never sent
    assert rig.wait_released("queued")
    rig.sched.abort("blocker")


def test_many_deadlines_fire_in_deadline_order_not_submit_order(make_rig: MakeRig) -> None:
    rig = make_rig([HANG] * 6)
    order: list[str] = []
    rig.sched.add_observer(lambda f: order.append(f.request_id))
    deadlines = {"a": 0.9, "b": 0.3, "c": 0.6, "d": 1.2, "e": 0.45, "f": 0.75}
    t0 = time.monotonic()
    for i, (rid, dl) in enumerate(deadlines.items()):
        rig.submit(rid, [i], [i], deadline_s=dl)
    got = {f.request_id: f for f in poll_until(rig, 6)}
    assert len(got) == 6
    for rid, dl in deadlines.items():
        assert got[rid].reason is FailureReason.TIMEOUT
        assert dl - 0.05 <= got[rid].latency_s <= dl + HANG_S, (rid, got[rid].latency_s)
    assert wait_until(lambda: len(order) == 6)  # observers run on the callback thread
    assert order == sorted(deadlines, key=deadlines.__getitem__)
    assert time.monotonic() - t0 < 1.2 + HANG_S


# -- peer liveness -----------------------------------------------------------------------------


def test_lost_peer_found_by_probe_fails_every_in_flight_request_at_once(make_rig: MakeRig) -> None:
    rig = make_rig([HANG, HANG, HANG], probe_interval_s=0.05)
    lcs = [rig.submit(f"r{i}", [i], [i]) for i in range(3)]
    assert wait_until(lambda: all(lc.state is _S.TRANSFERRING for lc in lcs))
    rig.faults.lose_peer(PEER)
    got = poll_until(rig, 3)
    # PEER_LOST, not TIMEOUT: the probe ended them, not their 10 s deadline,
    # and on one notice of the loss.
    assert [f.reason for f in got] == [FailureReason.PEER_LOST] * 3, got
    assert all(isinstance(lc.error, PeerLost) for lc in lcs), [lc.error for lc in lcs]
    assert all("probe failed" in str(lc.error) for lc in lcs), [lc.error for lc in lcs]
    assert rig.sched.peer_alive(PEER) is False
    assert rig.sched.metrics().peers_lost == 1

    # New submits fail fast, typed, and are reported like any outcome.
    lc = rig.submit("new", [5], [5])  # already failed when submit returns
    assert lc.state is _S.FAILED and lc.reason is FailureReason.PEER_LOST
    assert [f.request_id for f in poll_until(rig, 1)] == ["new"]
    assert rig.backend.ops_of("new") == []

    # Back again: the prober notices, new submits go through.
    rig.faults.restore_peer(PEER)
    assert wait_until(lambda: rig.sched.peer_alive(PEER))
    again = rig.submit("again", [6, 7], [16, 17])
    assert again.wait(WAIT) is _S.DONE
    assert rig.intact([6, 7], [16, 17]) == []
    # The three hung calls still hold their blocks.
    assert all(rig.released(f"r{i}") == 0 for i in range(3))
    rig.faults.release_hangs()
    assert all(rig.wait_released(f"r{i}") for i in range(3))
    rig.check_i6()


def test_lost_peer_found_by_a_transfer_error_fails_the_others_at_once(make_rig: MakeRig) -> None:
    rig = make_rig([HANG, HANG, LOSE], probe_interval_s=60.0)  # no prober help
    pending = [rig.submit(f"r{i}", [i], [i]) for i in range(2)]
    assert wait_until(lambda: all(lc.state is _S.TRANSFERRING for lc in pending))
    trigger = rig.submit("trigger", [2], [2])
    assert trigger.wait(WAIT) is _S.FAILED
    assert trigger.reason is FailureReason.PEER_LOST
    assert trigger.attempt == 1  # a lost peer is not retried
    for lc in pending:  # PEER_LOST, not their 10 s deadline's TIMEOUT
        assert lc.wait(WAIT) is _S.FAILED and lc.reason is FailureReason.PEER_LOST
    assert rig.sched.peer_alive(PEER) is False
    assert rig.submit("late", [3], [3]).reason is FailureReason.PEER_LOST
    rig.check_i6()


def test_mark_peer_lost_and_alive_by_hand(make_rig: MakeRig) -> None:
    rig = make_rig([HANG], probe_interval_s=60.0)
    lc = rig.submit("r", [0], [0])
    assert wait_until(lambda: lc.state is _S.TRANSFERRING)
    assert rig.sched.mark_peer_lost(PEER) == 1
    assert lc.reason is FailureReason.PEER_LOST
    assert rig.sched.mark_peer_lost(PEER) == 0  # nothing live left
    assert rig.sched.metrics().peers_lost == 1  # counted once per loss
    rig.sched.mark_peer_alive(PEER)
    assert rig.submit("ok", [1], [1]).wait(WAIT) is _S.DONE
    with pytest.raises(UnknownPeer):
        rig.sched.mark_peer_lost("nobody")


# -- priorities --------------------------------------------------------------------------------


def test_priority_orders_queued_requests_with_one_worker(make_rig: MakeRig) -> None:
    rig = make_rig([HANG], workers=1)
    order: list[str] = []
    rig.sched.add_observer(lambda f: order.append(f.request_id))
    rig.submit("blocker", [0], [0])
    assert wait_until(lambda: state_of(rig, "blocker") is _S.TRANSFERRING)
    prios = {"low": 0, "high": 10, "mid": 5, "low2": 0, "neg": -3, "high2": 10}
    for i, (rid, p) in enumerate(prios.items(), start=1):
        rig.submit(rid, [i], [i], priority=p)
    assert all(state_of(rig, rid) is _S.PENDING for rid in prios)
    rig.sched.abort("blocker")
    assert len(poll_until(rig, 1 + len(prios))) == 1 + len(prios)
    assert wait_until(lambda: len(order) == 1 + len(prios))  # on the callback thread
    assert order == ["blocker", "high", "high2", "mid", "low", "low2", "neg"]
    assert rig.sched.drain(timeout=0.1) is False  # the blocker's hung call holds it
    rig.faults.release_hangs()
    assert rig.sched.drain(timeout=WAIT)
    assert rig.sched.metrics().done == len(prios)


# -- release callback ----------------------------------------------------------------------------


def test_release_runs_once_per_request_after_quiesce_under_load(make_rig: MakeRig) -> None:
    faults = [HANG if i % 7 == 3 else ERR if i % 5 == 1 else NONE for i in range(60)]
    rig = make_rig(faults, workers=4)
    n = 40
    for i in range(n):
        rig.submit(f"r{i}", [i % 64], [i], deadline_s=0.5 + (i % 3) * 0.2)
        if i % 9 == 0:
            rig.sched.abort(f"r{i}")
    got = poll_until(rig, n)
    assert sorted(f.request_id for f in got) == sorted(f"r{i}" for i in range(n))
    time.sleep(0.2)
    rig.check_i6()
    rig.faults.release_hangs()
    assert rig.sched.drain(timeout=WAIT)
    assert len(rig.releases) == n
    rig.check_i6()
    for rel in rig.releases:
        if rel.finished.state is _S.DONE:
            i = int(rel.rid[1:])
            assert rig.intact([i % 64], [i]) == []


def test_per_request_release_overrides_the_default(rig: Rig) -> None:
    mine: list[str] = []
    rig.submit("own", [0], [0], release=lambda rid, fin: mine.append(rid))
    rig.submit("default", [1], [1])
    assert wait_until(lambda: mine == ["own"])
    assert rig.wait_released("default")
    assert rig.released("own") == 0


def test_a_raising_release_callback_does_not_break_the_scheduler(make_rig: MakeRig) -> None:
    calls: Counter[str] = Counter()

    def bad(rid: str, fin: Finished) -> None:
        calls[rid] += 1
        raise RuntimeError(f"release of {rid} failed")

    rig = make_rig(release=bad)
    for i in range(5):
        rig.submit(f"r{i}", [i], [i])
    assert rig.sched.drain(timeout=WAIT)
    assert calls == Counter({f"r{i}": 1 for i in range(5)})
    assert rig.sched.metrics().released == 5
    # Ids are free again and new work is served.
    assert rig.submit("r0", [9], [9]).wait(WAIT) is _S.DONE
    assert rig.sched.drain(timeout=WAIT)
    rig.check_i6()


def test_observers_see_every_outcome_and_a_raising_one_harms_nothing(make_rig: MakeRig) -> None:
    rig = make_rig([ERR, ERR, ERR, HANG], probe_interval_s=60.0)
    seen: list[Finished] = []

    def broken(fin: Finished) -> None:
        raise RuntimeError("observer bug")

    rig.sched.add_observer(broken)
    rig.sched.add_observer(seen.append)
    # Three retryable errors: exhausted.
    assert rig.submit("failed", [0], [0]).wait(WAIT) is _S.FAILED
    hung = rig.submit("hung", [1], [1], deadline_s=0.3)
    assert wait_until(lambda: hung.state is _S.TRANSFERRING)  # it drew the HANG
    rig.submit("empty", [], [])
    assert rig.submit("ok", [2], [2]).wait(WAIT) is _S.DONE
    rig.sched.mark_peer_lost(PEER)
    rig.submit("dead", [3], [3])
    got = poll_until(rig, 5)
    # Observers run on the callback thread, after the step that ended the request.
    assert wait_until(lambda: len(seen) == 5)
    assert sorted(f.request_id for f in got) == sorted(f.request_id for f in seen)
    assert sorted(f.request_id for f in seen) == ["dead", "empty", "failed", "hung", "ok"]
    assert {f.request_id: f.state for f in seen}["empty"] is _S.DONE
    assert all(f.state in TERMINAL for f in seen)
    rig.sched.mark_peer_alive(PEER)
    assert rig.submit("after", [4], [4]).wait(WAIT) is _S.DONE


# -- metrics, drain, close ----------------------------------------------------------------------


def test_metrics_snapshot_counts_outcomes_live_and_quarantined(make_rig: MakeRig) -> None:
    rig = make_rig([NONE, NONE, HANG, HANG], probe_interval_s=60.0)
    nbytes = 2 * LAYOUT.num_buffers * 64
    for rid, b in (("d1", [0, 1]), ("d2", [2, 3])):
        assert rig.submit(rid, b, b).wait(WAIT) is _S.DONE
    assert rig.submit("timeout", [4], [4], deadline_s=0.2).wait(WAIT) is _S.FAILED
    t_live = time.monotonic()
    rig.submit("live", [5], [5])
    assert wait_until(lambda: state_of(rig, "live") is _S.TRANSFERRING)
    rig.backend.errors.append(TransferError("boom"))
    assert rig.submit("err", [6], [6]).wait(WAIT) is _S.FAILED
    assert rig.wait_released("err")
    assert wait_until(lambda: rig.sched.metrics().released == 3)
    assert wait_until(lambda: rig.sched.metrics().oldest_live_age_s >= 0.1)  # "live" ages
    m = rig.sched.metrics()
    assert m.done == 2 and m.bytes_done == 2 * nbytes
    assert m.failed_by_reason == {"TIMEOUT": 1, "TRANSFER_ERROR": 1}
    assert m.failed == 2
    assert m.live_by_state == {"PENDING": 0, "TRANSFERRING": 1}
    assert m.quarantined == 1  # the timed-out request's call has not returned
    assert m.released == 3
    assert 0.1 <= m.oldest_live_age_s <= time.monotonic() - t_live + 0.05
    assert (m.released_before_quiesce, m.double_releases, m.peers_lost) == (0, 0, 0)
    assert [lc.request_id for lc in rig.sched.live_requests()] == ["live"]

    rig.sched.abort("live")
    rig.faults.release_hangs()
    assert rig.sched.drain(timeout=WAIT)
    m = rig.sched.metrics()
    assert m.live_by_state == {"PENDING": 0, "TRANSFERRING": 0}
    assert (m.quarantined, m.oldest_live_age_s, m.released) == (0, 0.0, 5)
    assert m.failed_by_reason == {"TIMEOUT": 1, "TRANSFER_ERROR": 1, "ABORTED": 1}
    rig.check_i6()


def test_drain_waits_for_every_release(make_rig: MakeRig) -> None:
    rig = make_rig([HANG])
    rig.submit("hung", [0], [0])
    for i in range(1, 21):
        rig.submit(f"r{i}", [i], [i])
    t0 = time.monotonic()
    assert rig.sched.drain(timeout=0.2) is False  # the hung one is live
    assert 0.2 <= time.monotonic() - t0 < 0.2 + HANG_S  # its timeout, not the hung one
    rig.sched.abort("hung")
    assert rig.sched.drain(timeout=0.2) is False  # terminal, still quarantined
    rig.faults.release_hangs()
    assert rig.sched.drain(timeout=WAIT) is True
    m = rig.sched.metrics()
    assert (m.done, m.released, m.quarantined) == (20, 21, 0)
    assert sum(m.live_by_state.values()) == 0
    rig.check_i6()


def test_close_fails_live_requests_with_shutdown_and_returns(make_rig: MakeRig) -> None:
    rig = make_rig([HANG], workers=1)
    hung = rig.submit("hung", [0], [0])
    assert wait_until(lambda: hung.state is _S.TRANSFERRING)
    queued = [rig.submit(f"q{i}", [i], [i]) for i in (1, 2)]
    t0 = time.monotonic()
    assert rig.sched.close(timeout=0.3) is False  # the hung call never quiesced
    rig.close_timeout = 0.1  # its release thread is gone: the hung one stays
    assert time.monotonic() - t0 < 0.3 + HANG_S
    for lc in (hung, *queued):
        assert lc.state is _S.FAILED and lc.reason is FailureReason.SHUTDOWN
    # close() waited a second for the driver and the callbacks: a host stall beats that.
    assert sorted(f.request_id for f in poll_until(rig, 3)) == ["hung", "q1", "q2"]
    # Queued ones had no op: released. The hung one is never released early.
    assert rig.wait_released("q1") and rig.wait_released("q2")
    assert rig.released("q1") == rig.released("q2") == 1
    assert rig.released("hung") == 0
    with pytest.raises(SchedulerClosed):
        rig.sched.submit("x", [3], [3], peer=PEER)
    rig.check_i6()
    driver = rig.sched._driver
    assert driver is not None and not driver.thread.is_alive()


def test_close_with_nothing_stuck_drains_and_is_idempotent(rig: Rig) -> None:
    lcs = [rig.submit(f"r{i}", [i], [i]) for i in range(10)]
    assert rig.sched.close() is True
    assert all(lc.is_terminal for lc in lcs)
    assert rig.sched.metrics().released == 10
    assert rig.sched.close() is True
    rig.check_i6()


def test_context_manager_closes(make_rig: MakeRig) -> None:
    rig = make_rig()
    with rig.sched as s:
        lc = s.submit("r", [0], [0], peer=PEER)
    assert lc.is_terminal
    assert rig.wait_released("r")  # close(5.0)'s wait for it may run out on a stalled host
    assert rig.released("r") == 1
    with pytest.raises(SchedulerClosed):
        rig.sched.submit("r2", [0], [0], peer=PEER)


def test_remove_peer_fails_its_live_requests_and_forgets_it(make_rig: MakeRig) -> None:
    rig = make_rig([HANG, HANG])
    a = rig.submit("ra", [0], [0])
    b = rig.submit("rb", [1], [1])
    assert wait_until(lambda: a.state is _S.TRANSFERRING and b.state is _S.TRANSFERRING)
    assert rig.sched.remove_peer(PEER) == 2
    assert (a.state, a.reason) == (_S.FAILED, FailureReason.PEER_LOST)
    assert (b.state, b.reason) == (_S.FAILED, FailureReason.PEER_LOST)
    with pytest.raises(UnknownPeer, match=PEER):
        rig.sched.submit("rc", [2], [2], peer=PEER)
    with pytest.raises(UnknownPeer):
        rig.sched.remove_peer(PEER)
    # Quarantine still holds: the hung ops have not returned.
    assert wait_until(lambda: rig.sched.metrics().quarantined == 2)
    assert rig.sched.metrics().quarantined_bytes == 2 * LAYOUT.num_buffers * 64
    rig.faults.release_hangs()
    assert rig.sched.drain(WAIT)
    rig.check_i6()


def test_the_release_path_counts_double_and_early_releases(make_rig: MakeRig) -> None:
    """The I6 detectors themselves: feed the release path what a broken core
    would (a released request again; a request whose op still runs) and check
    that each is counted, and the second release not performed."""
    rig = make_rig([HANG])
    hung = rig.submit("early", [0], [0])
    assert wait_until(lambda: hung.state is _S.TRANSFERRING)
    done = rig.submit("twice", [1], [1])
    assert done.wait(WAIT) is _S.DONE
    assert rig.wait_released("twice")
    calls_before = rig.sched.metrics().released
    table, checks = rig.sched._table, rig.sched._core.checks
    twice = _Stale(done, rig.backend.ops_of("twice"))
    run_release(twice, table, checks)  # type: ignore[arg-type]
    early = table.find("early")
    assert isinstance(early, RequestRecord)
    early.finished = Finished("early", _S.FAILED, None, None, 1, PEER, 0, 0.0)
    run_release(early, table, checks)
    m = rig.sched.metrics()
    assert (m.double_releases, m.released_before_quiesce) == (1, 1)
    assert m.released == calls_before + 1
    assert rig.released("twice") == 1
    rig.faults.release_hangs()


class _Stale:
    """Looks like a request, but is not the one the table holds under its id."""

    def __init__(self, lc: RequestLifecycle, ops: list[TransferOp]) -> None:
        self.request_id = lc.request_id
        self.lc = lc
        self.ops = ops
        self.release = None
        self.finished = None


# -- the driver: callbacks off the step, dead drivers, peer races, memory ----------------


def test_a_slow_done_callback_delays_no_other_deadline(make_rig: MakeRig) -> None:
    """A's done-callback blocks for 30 s when A times out; B's 0.3 s deadline
    still fires, and wait(B) returns FAILED, not PENDING (I4)."""
    rig = make_rig([HANG, HANG], workers=1)
    gate = threading.Event()
    a = rig.submit("a", [0], [0], deadline_s=0.2)
    a.add_done_callback(lambda _lc: gate.wait(30.0))
    try:
        t0 = time.monotonic()
        rig.submit("b", [1], [1], deadline_s=0.3)  # queued behind a: PENDING
        assert rig.sched.wait("b") is _S.FAILED
        took = time.monotonic() - t0
        assert took < 0.3 + HANG_S, took  # not behind the 30 s callback
        assert rig.sched.get("b").reason is FailureReason.TIMEOUT
        assert not gate.is_set()  # A's callback was still blocking then
    finally:
        gate.set()


@pytest.mark.parametrize("where", ["observer", "release", "done_callback"])
@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, RuntimeError])
def test_a_callback_raising_anything_stops_nothing(
    make_rig: MakeRig, where: str, exc: type[BaseException]
) -> None:
    def boom(*_args: object) -> None:
        raise exc("from a callback")

    rig = make_rig([HANG, NONE, HANG], release=boom if where == "release" else None)
    if where == "observer":
        rig.sched.add_observer(boom)
    first = rig.submit("first", [0], [0], deadline_s=0.2)
    if where == "done_callback":
        first.add_done_callback(boom)
    assert first.wait(WAIT) is _S.FAILED  # the hang times out: callbacks run
    rig.faults.release_hangs()
    # Work still gets done, and deadlines still fire.
    assert rig.submit("ok", [1], [1]).wait(WAIT) is _S.DONE
    lc = rig.submit("late", [2], [2], deadline_s=0.2)  # hangs
    assert rig.sched.wait("late") is _S.FAILED
    assert (lc.reason, type(lc.error)) == (FailureReason.TIMEOUT, TransferTimeout)
    rig.faults.release_hangs()  # its blocks are released once the hang ends
    assert rig.sched.drain(WAIT)
    m = rig.sched.metrics()
    assert m.driver_alive and m.released == 3


def test_a_blocking_callback_is_given_up_on_and_the_rest_go_on(rig: Rig) -> None:
    gate = threading.Event()
    rig.sched._callbacks.stall_s = 0.2
    released: list[str] = []
    started = threading.Event()

    def stuck(rid: str, fin: Finished) -> None:
        started.set()
        gate.wait(WAIT)

    rig.submit("stuck", [0], [0], release=stuck)
    assert started.wait(WAIT)  # the callback thread is now blocked in it
    for i in range(1, 4):
        rig.submit(f"r{i}", [i], [i], release=lambda rid, fin: released.append(rid))
    assert wait_until(lambda: len(released) == 3), released
    m = rig.sched.metrics()
    assert m.callbacks_stalled >= 1 and m.driver_alive
    assert rig.released("stuck") == 0  # its callback is still running
    gate.set()
    assert rig.sched.drain(WAIT)


def test_a_dead_driver_is_reported_not_silent(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    lc = rig.submit("before", [0], [0])
    assert lc.wait(WAIT) is _S.DONE
    # A bug in the core: its next step raises, and takes the driver down.
    monkeypatch.setattr(rig.sched._core, "step", _raise_system_exit)
    waiting = rig.submit("after", [1], [1], deadline_s=0.3)
    driver = rig.sched._driver
    assert driver is not None
    driver.thread.join(WAIT)
    m = rig.sched.metrics()
    assert m.driver_alive is False
    with pytest.raises(DriverFailed):
        rig.sched.submit("x", [2], [2], peer=PEER)
    with pytest.raises(DriverFailed):
        rig.sched.wait("after")
    assert not waiting.is_terminal
    monkeypatch.undo()
    rig.sched.step()  # the host can still step it by hand
    rig.close_timeout = 0.5


def _raise_system_exit(now: float) -> None:
    raise SystemExit("core bug")


def test_remove_peer_racing_submits_never_writes_to_a_removed_peer(rig: Rig) -> None:
    removed_at: list[float] = []
    sent_at: list[tuple[str, float]] = []
    inner_submit = rig.backend.submit

    def submit(plan: TransferPlan) -> TransferOp:
        sent_at.append((plan.peer, time.monotonic()))
        return inner_submit(plan)

    rig.backend.submit = submit  # type: ignore[method-assign]
    accepted: list[RequestLifecycle] = []
    stop = threading.Event()

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            with contextlib.suppress(UnknownPeer, DuplicateRequest):
                accepted.append(rig.submit(f"h{i}", [i % 64], [i % 64]))
            i += 1

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.05)
    rig.sched.remove_peer(PEER)
    removed_at.append(time.monotonic())
    time.sleep(0.05)
    stop.set()
    t.join()
    assert accepted
    assert rig.sched.drain(WAIT)
    # Every request accepted ended, and nothing was sent after the removal.
    assert all(lc.is_terminal for lc in accepted)
    assert all(at <= removed_at[0] for _, at in sent_at), "sent to a removed peer"


def test_add_peer_replacing_a_peer_fails_requests_planned_for_the_old_one(
    make_rig: MakeRig,
) -> None:
    rig = make_rig([HANG])
    lc = rig.submit("old", [0], [0])
    assert wait_until(lambda: lc.state is _S.TRANSFERRING)
    rig.sched.add_peer(rig.info)  # the same advertisement: nothing changes
    assert lc.state is _S.TRANSFERRING
    moved = PeerInfo(PEER, rig.info.regions[:1], LAYOUT, block_base=rig.info.block_base)
    rig.sched.add_peer(moved)
    assert lc.reason is FailureReason.PEER_LOST
    rig.faults.release_hangs()
    rig.sched.add_peer(rig.info)
    assert rig.submit("new", [1], [1]).wait(WAIT) is _S.DONE


def test_an_op_that_quiesces_after_close_is_released_exactly_once(make_rig: MakeRig) -> None:
    rig = make_rig([HANG])
    lc = rig.submit("hung", [0], [0])
    assert wait_until(lambda: lc.state is _S.TRANSFERRING)
    assert rig.sched.close(timeout=0.2) is False
    assert lc.reason is FailureReason.SHUTDOWN
    assert rig.released("hung") == 0
    m = rig.sched.metrics()
    assert (m.quarantined, m.quarantined_bytes) == (1, LAYOUT.num_buffers * 64)
    rig.faults.release_hangs()  # the engine lets go, after close() returned
    assert rig.wait_released("hung")
    time.sleep(0.05)
    assert rig.released("hung") == 1
    assert rig.sched.metrics().quarantined == 0
    rig.check_i6()


def test_close_from_a_callback_returns_without_joining_itself(make_rig: MakeRig) -> None:
    results: list[object] = []

    def close_here(rid: str, fin: Finished) -> None:
        t0 = time.monotonic()
        try:
            results.append(own.sched.close(timeout=60.0))
        except BaseException as exc:
            results.append(exc)
        results.append(time.monotonic() - t0)

    own = make_rig(release=close_here)
    own.submit("r", [0], [0])
    assert wait_until(lambda: len(results) == 2)
    assert not isinstance(results[0], BaseException), results
    # Joining itself would hold it for the whole 60 s timeout.
    assert isinstance(results[1], float) and results[1] < 60.0, results


def test_memory_follows_live_requests_not_traffic(rig: Rig) -> None:
    """A caller that only waits: the outcomes kept for poll() are capped, and
    after a drain the core keeps nothing per request but bounded tombstones."""
    sched = Scheduler(rig.local, rig.src, workers=8, max_unpolled=50)
    try:
        sched.add_peer(rig.info)
        for i in range(300):
            lc = sched.submit(f"m{i}", [i % 64], [i % 64], peer=PEER)
            assert sched.wait(lc.request_id) is _S.DONE
        assert sched.drain(WAIT)
        m = sched.metrics()
        assert (m.unpolled, m.unpolled_dropped) == (50, 250)
        assert sched._core.sizes() == dict.fromkeys(sched._core.sizes(), 0)
        recent = sched._table._recent
        assert len(recent) == 300 and all(isinstance(t, Tombstone) for t in recent.values())
    finally:
        sched.close()


def test_the_error_of_a_finished_request_pins_no_frames(rig: Rig) -> None:
    rig.backend.errors.append(RuntimeError("backend bug"))  # a crash: raised, with frames
    lc = rig.submit("r", [0], [0])
    assert lc.wait(WAIT) is _S.FAILED and lc.reason is FailureReason.WORKER_CRASHED
    [fin] = poll_until(rig, 1)
    assert fin.error is lc.error and lc.error is not None
    assert lc.error.__traceback__ is None


def test_the_asyncio_driver_and_a_host_loop_drive_the_same_core(rig: Rig) -> None:
    async def serve() -> tuple[TransferState, TransferState]:
        sched = Scheduler(rig.local, rig.src, driver="external")
        sched.add_peer(rig.info)
        task = asyncio.ensure_future(sched.run_async())
        sched.submit("a1", [0], [0], peer=PEER)
        sched.submit("a2", [1], [1], peer=PEER, deadline_s=0.3)
        first = await sched.wait_async("a1", timeout=WAIT)
        second = await sched.wait_async("a2", timeout=WAIT)
        sched.close(timeout=0.5)
        await asyncio.wait_for(task, WAIT)
        return first, second

    assert asyncio.run(serve()) == (_S.DONE, _S.DONE)

    host = Scheduler(rig.local, rig.src, driver="external")
    try:
        host.add_peer(rig.info)
        host.submit("h1", [2], [2], peer=PEER)
        got: list[Finished] = []
        end = time.monotonic() + WAIT
        while not got and time.monotonic() < end:  # the host's serving loop
            host.step()
            got.extend(host.poll())
            time.sleep(0.001)
        assert [(f.request_id, f.state) for f in got] == [("h1", _S.DONE)]
        assert host.drain(WAIT)
    finally:
        host.close()


def test_the_stuck_inspector_reports_long_quarantined_requests(make_rig: MakeRig) -> None:
    rig = make_rig([HANG])
    lc = rig.submit("frozen", [0, 1], [0, 1], deadline_s=0.1)
    assert lc.wait(WAIT) is _S.FAILED and lc.reason is FailureReason.TIMEOUT
    assert wait_until(lambda: rig.sched.metrics().quarantined == 1)
    time.sleep(0.1)
    [q] = quarantined_requests(rig.sched, 0.05)
    assert (q.request_id, q.peer, q.ops_running) == ("frozen", PEER, 1)
    assert q.nbytes == 2 * LAYOUT.num_buffers * 64 and q.quarantined_s >= 0.05
    logs: list[tuple[str, dict[str, object]]] = []

    class Log:
        def warning(self, event: str, **kw: object) -> None:
            logs.append((event, kw))

    inspector = StuckInspector(rig.sched, 0.05, logger=Log())
    assert inspector.check() == []  # nothing live is stuck ...
    assert [q.request_id for q in inspector.last_quarantined] == ["frozen"]
    [(event, kw)] = logs  # ... but the quarantined request is reported
    assert event == "stuck_requests" and kw["quarantined"] == 1
    assert kw["oldest_quarantined"] == "frozen" and kw["count"] == 0
    rig.faults.release_hangs()
    assert rig.wait_released("frozen")
    assert quarantined_requests(rig.sched) == []


def test_peer_changes_reach_a_backend_that_tracks_peers(rig: Rig) -> None:
    calls: list[tuple[str, str]] = []

    class Tracking(Recorder):
        def add_peer(self, info: PeerInfo) -> None:
            calls.append(("add", info.session_id))

        def remove_peer(self, session_id: str) -> None:
            calls.append(("remove", session_id))

    backend = Tracking(rig.faults, rig.owner)
    sched = Scheduler(backend, rig.src)
    try:
        sched.add_peer(rig.info)
        sched.remove_peer(PEER)
        assert calls == [("add", PEER), ("remove", PEER)]
    finally:
        sched.close()


# -- memory of finished requests -------------------------------------------------------


def test_finished_requests_leave_no_cyclic_garbage() -> None:
    # A request and its lifecycle used to point at each other for good: every
    # released request (plan, ops, error) waited for the cyclic collector,
    # and a caller holding the lifecycle pinned all of it. The scheduler's
    # hook now drops the lifecycle's link at the terminal transition.
    src, dst = KVCache(LAYOUT), KVCache(LAYOUT)
    local = LocalBackend(workers=1)
    info = local.register_peer(PEER, dst)
    local.register_source(src)
    sched = Scheduler(local, src, workers=8, default_deadline_s=LONG)
    sched.add_peer(info)
    gc.collect()
    gc.disable()
    try:
        held = sched.submit("held", [0], [0], peer=PEER)
        for i in range(200):
            sched.submit(f"free-{i}", [i % 64], [i % 64], peer=PEER)
        assert sched.drain(WAIT)
        assert sched.metrics().done == 201
        garbage = gc.collect()
    finally:
        gc.enable()
        sched.close()
        local.close()
    assert garbage < 50, f"{garbage} objects needed the cyclic collector"
    assert held._request is None  # type: ignore[attr-defined]
    assert sched.get("held") is held  # the tombstone answers while the caller holds it


def test_default_deadline_is_validated_whenever_it_is_set(make_rig: MakeRig) -> None:
    # submit() trusts the default (checked once per setting, not per request).
    rig = make_rig([FaultKind.HANG])
    for bad in (math.inf, -1.0, 0, None, True, "1"):
        with pytest.raises(InvalidRequest, match="default_deadline_s must be a positive finite"):
            rig.sched.default_deadline_s = bad  # type: ignore[assignment]
    assert rig.sched.default_deadline_s == LONG
    rig.sched.default_deadline_s = 0.05  # a valid new default applies to the next submit
    lc = rig.submit("short", [1], [1])  # hangs: only its deadline can end it
    assert rig.sched.wait("short", WAIT) is TransferState.FAILED
    assert lc.reason is FailureReason.TIMEOUT
    assert 0.04 <= lc.history[-1].at - lc.history[0].at < LONG / 2
