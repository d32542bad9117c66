"""The Scheduler over the real Mooncake engine: two processes on 127.0.0.1.

The prefill side (this process) is a MooncakeBackend, optionally wrapped by
a FaultInjectingBackend; the decode peer is a ``kvguard.decode.service`` child
that the tests kill (SIGKILL) or freeze (SIGSTOP), and that answers
per-block sha256 digests for the integrity checks (I7). A ``Recorder``
outermost backend attributes every op to its request, so that the release
callback can check each op had quiesced (I6).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence

import pytest
from mooncake_helpers import prefill_backend, receiver, requires_mooncake, wait_until

from kvguard.decode.service import ReceiverProcess
from lifecycle import TERMINAL, FailureReason, RequestLifecycle, TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from transfer import (
    FaultInjectingBackend,
    FaultKind,
    FaultPlan,
    KVCache,
    KVLayout,
    PeerInfo,
    TransferBackend,
    TransferOp,
    TransferPlan,
)
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests

pytestmark = [pytest.mark.mooncake, requires_mooncake]

# 2 layers x K/V = 4 buffers of 1 MiB a side.
LAYOUT = KVLayout(num_layers=2, num_blocks=256, block_bytes=4096)
# For the kill test: larger plans, so some are in flight when the peer dies.
BIG = KVLayout(num_layers=1, num_blocks=4096, block_bytes=4096)
# A hang guard, not a speed figure: how long past the moment it is due an
# outcome may come on a loaded 2-core machine; each bound it sets stays below
# the slower path it rules out (the speeds are `kvguard bench`'s).
HANG_S = 5.0
WAIT = 30.0


class Recorder(TransferBackend):
    """Outermost backend: every op, by the request whose blocks it writes."""

    name = "recorder"

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.owner: dict[int, str] = {}  # destination address (any buffer) -> request id
        self.ops: defaultdict[str, list[TransferOp]] = defaultdict(list)
        self.lock = threading.Lock()

    def submit(self, plan: TransferPlan) -> TransferOp:
        op = self.inner.submit(plan)
        with self.lock:
            self.ops[self.owner[plan.batches[0].dst[0]]].append(op)
        return op

    def probe(self, peer: str) -> None:
        self.inner.probe(peer)

    # A wrapper forwards peer changes: the engine writes only inside regions
    # it was told about, and refuses plans to any other peer.
    def add_peer(self, info: PeerInfo) -> None:
        self.inner.add_peer(info)

    def remove_peer(self, session_id: str) -> None:
        self.inner.remove_peer(session_id)

    def close(self) -> None:  # the inner backends are closed by their owners
        pass


class Rig:
    """A scheduler sending from ``src`` to ``peer``; counts releases and checks I6."""

    def __init__(
        self, inner: TransferBackend, src: KVCache, peer: ReceiverProcess, **kwargs: object
    ) -> None:
        self.src = src
        self.peer = peer
        self.backend = Recorder(inner)
        self.releases: Counter[str] = Counter()
        self.unquiesced: list[str] = []  # released with an op still running: must stay empty
        self.released_at: dict[str, float] = {}
        self.lock = threading.Lock()
        kwargs.setdefault("retry", RetryPolicy(backoff_s=0.001))
        self.sched = Scheduler(self.backend, src, release=self._release, **kwargs)  # type: ignore[arg-type]
        self.sched.add_peer(peer.peer)

    def _release(self, rid: str, fin: Finished) -> None:
        with self.backend.lock:
            ops = list(self.backend.ops[rid])
        with self.lock:
            self.releases[rid] += 1
            self.released_at[rid] = time.monotonic()
            if fin.state not in TERMINAL or not all(op.quiesced for op in ops):
                self.unquiesced.append(rid)

    def submit(
        self, rid: str, srcs: Sequence[int], dsts: Sequence[int], **kw: object
    ) -> RequestLifecycle:
        layout = self.peer.layout
        for d in dsts:
            for buf in range(layout.num_buffers):
                self.backend.owner[self.peer.peer.block_base[buf] + d * layout.block_bytes] = rid
        return self.sched.submit(rid, srcs, dsts, peer=self.peer.peer.session_id, **kw)  # type: ignore[arg-type]

    def check_i6(self, accepted: int) -> None:
        m = self.sched.metrics()
        assert (m.released_before_quiesce, m.double_releases) == (0, 0)
        assert self.unquiesced == []
        assert len(self.releases) == accepted and set(self.releases.values()) == {1}

    def close(self) -> None:
        self.sched.close(timeout=WAIT)


@pytest.fixture(scope="module")
def backend() -> Iterator[MooncakeBackend]:
    with prefill_backend() as b:  # MC_TRANSFER_TIMEOUT=5: a frozen call returns in ~5 s
        yield b


@pytest.fixture(scope="module")
def src(backend: MooncakeBackend) -> KVCache:
    cache = KVCache(LAYOUT)
    cache.fill_seeded(2024)
    backend.register(cache)
    return cache


@pytest.fixture(scope="module")
def big_src(backend: MooncakeBackend) -> KVCache:
    cache = KVCache(BIG)
    cache.fill_seeded(2025)
    backend.register(cache)
    return cache


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(*args: object, **kwargs: object) -> Rig:
        rig = Rig(*args, **kwargs)  # type: ignore[arg-type]
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def requests(n: int, per: int, num_blocks: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` requests of ``per`` blocks: random sources, disjoint destinations."""
    rng = random.Random(seed)
    dsts = rng.sample(range(num_blocks), n * per)
    return [
        ([rng.randrange(num_blocks) for _ in range(per)], dsts[i * per : (i + 1) * per])
        for i in range(n)
    ]


def intact(rig: Rig, reqs: Sequence[tuple[list[int], list[int]]]) -> list[int]:
    """Destination blocks whose receiver digest differs from the source block's."""
    srcs = [s for r in reqs for s in r[0]]
    dsts = [d for r in reqs for d in r[1]]
    if not dsts:
        return []
    want = block_digests(rig.src, srcs)
    got = rig.peer.checksums(dsts)
    return [d for d, w, g in zip(dsts, want, got, strict=True) if w != g]


def terminal_at(lc: RequestLifecycle) -> float:
    return next(h.at for h in lc.history if h.dest in TERMINAL)


def test_fifty_requests_are_done_and_byte_exact(
    backend: MooncakeBackend, src: KVCache, make_rig: Callable[..., Rig]
) -> None:
    with receiver(LAYOUT) as peer:
        rig = make_rig(backend, src, peer, workers=4)
        reqs = requests(50, 4, LAYOUT.num_blocks, seed=1)
        lcs = [rig.submit(f"r{i}", s, d) for i, (s, d) in enumerate(reqs)]
        for lc in lcs:
            assert lc.wait(WAIT) is TransferState.DONE, lc
        assert intact(rig, reqs) == []
        got: list[Finished] = []

        def polled_all() -> bool:
            got.extend(rig.sched.poll())
            return len(got) >= 50

        assert wait_until(polled_all, WAIT)
        assert sorted(f.request_id for f in got) == sorted(f"r{i}" for i in range(50))
        assert rig.sched.drain(timeout=WAIT)
        m = rig.sched.metrics()
        assert m.done == 50 and m.failed == 0
        assert m.bytes_done == 50 * 4 * LAYOUT.num_buffers * LAYOUT.block_bytes
        rig.check_i6(50)


def test_seeded_faults_over_the_real_engine_end_terminal_and_intact(
    backend: MooncakeBackend, src: KVCache, make_rig: Callable[..., Rig]
) -> None:
    faults = FaultInjectingBackend(backend, FaultPlan(seed=11, rate=0.3))
    with receiver(LAYOUT) as peer:
        rig = make_rig(faults, src, peer, workers=4, default_deadline_s=1.0)
        reqs = requests(50, 4, LAYOUT.num_blocks, seed=2)
        lcs = [rig.submit(f"r{i}", s, d) for i, (s, d) in enumerate(reqs)]
        for lc in lcs:
            lc.wait(WAIT)
        assert all(lc.is_terminal for lc in lcs)
        states = Counter((lc.state.name, lc.reason.name if lc.reason else None) for lc in lcs)
        stats = faults.stats
        assert sum(stats.values()) - stats[FaultKind.NONE] > 0, stats  # faults were injected
        assert states[("DONE", None)] > 0, states
        # Retries hide most faults; a HANG runs into the deadline.
        assert set(states) <= {("DONE", None), ("FAILED", "TIMEOUT"), ("FAILED", "TRANSFER_ERROR")}
        done = [r for r, lc in zip(reqs, lcs, strict=True) if lc.state is TransferState.DONE]
        assert intact(rig, done) == []
        # A timed-out request whose (hung) op has not returned keeps its blocks (I6).
        with rig.backend.lock:
            stuck = {r for r, ops in rig.backend.ops.items() if not all(o.quiesced for o in ops)}
        assert stuck or not stats[FaultKind.HANG]
        assert all(rig.releases[r] == 0 for r in stuck)
        assert wait_until(lambda: rig.sched.metrics().quarantined == len(stuck), 5.0)
        faults.release_hangs()  # not close(): that would close the shared backend
        assert rig.sched.drain(timeout=WAIT)
        rig.check_i6(50)


def test_killed_decode_fails_in_flight_requests_peer_lost_at_once(
    backend: MooncakeBackend, big_src: KVCache, make_rig: Callable[..., Rig]
) -> None:
    with receiver(BIG) as peer:
        rig = make_rig(backend, big_src, peer, workers=4, default_deadline_s=20.0)
        killed: list[float] = []
        done: list[str] = []

        def kill_after_ten(fin: Finished) -> None:
            # In the thread that ended the 10th request: the others are in
            # flight or queued right now.
            done.append(fin.request_id)
            if len(done) == 10 and not killed:
                peer.kill()
                killed.append(time.monotonic())

        rig.sched.add_observer(kill_after_ten)
        reqs = requests(60, 64, BIG.num_blocks, seed=3)
        lcs = [rig.submit(f"r{i}", s, d) for i, (s, d) in enumerate(reqs)]
        for lc in lcs:
            lc.wait(WAIT)
        assert killed, "the decode process was never killed"
        assert all(lc.is_terminal for lc in lcs)
        lost = [lc for lc in lcs if lc.state is TransferState.FAILED]
        assert len(lost) >= 10, f"only {len(lost)} requests outlived the kill: vacuous"
        assert {lc.reason for lc in lost} == {FailureReason.PEER_LOST}
        # Some were inside an engine call when the peer died, not only queued.
        assert any(rig.backend.ops[lc.request_id] for lc in lost)
        # Found dead and failed together, not at the 20 s deadline (PEER_LOST,
        # not TIMEOUT, above), and on one notice of the loss.
        last = max(terminal_at(lc) for lc in lost)
        assert last - killed[0] < 1.0 + HANG_S, f"last PEER_LOST {last - killed[0]:.2f}s after kill"
        assert rig.sched.peer_alive(peer.peer.session_id) is False
        assert rig.sched.metrics().peers_lost == 1
        late = rig.submit("late", [0], [0])  # known lost: failed when submit returns
        assert late.state is TransferState.FAILED
        assert late.reason is FailureReason.PEER_LOST
        assert rig.backend.ops["late"] == []  # never sent
        assert rig.sched.drain(timeout=WAIT)
        rig.check_i6(61)


def test_frozen_decode_times_out_at_the_deadline_and_release_waits_for_the_engine(
    backend: MooncakeBackend, src: KVCache, make_rig: Callable[..., Rig]
) -> None:
    with receiver(LAYOUT) as peer:
        # No prober: a frozen peer's probe would turn it into PEER_LOST first.
        # Six workers: every request below is in an engine call when it times out.
        rig = make_rig(backend, src, peer, workers=6, probe_interval_s=60.0)
        assert rig.submit("warm", [0], [0]).wait(WAIT) is TransferState.DONE
        peer.freeze()
        reqs = requests(6, 4, LAYOUT.num_blocks, seed=4)
        t0 = time.monotonic()
        lcs = [rig.submit(f"r{i}", s, d, deadline_s=1.0) for i, (s, d) in enumerate(reqs)]
        for lc in lcs:
            assert lc.wait(WAIT) is TransferState.FAILED
            assert lc.reason is FailureReason.TIMEOUT
            # At its deadline, never before; the engine's own 5 s timeout is not it.
            assert 1.0 - 0.05 <= terminal_at(lc) - t0 < 5.0, terminal_at(lc) - t0
        # The engine calls are still running: the blocks stay quarantined (I6).
        time.sleep(0.3)
        m = rig.sched.metrics()
        assert m.quarantined == 6 and sum(m.live_by_state.values()) == 0
        assert all(rig.releases[f"r{i}"] == 0 for i in range(6))
        running = [op for i in range(6) for op in rig.backend.ops[f"r{i}"] if not op.quiesced]
        assert running, "no engine call was still running: test is vacuous"
        # Past the engine's own MC_TRANSFER_TIMEOUT (5 s) the engine may still
        # write: a returned or timed-out call says nothing (issue 10). The
        # blocks stay quarantined for as long as the peer is frozen...
        assert not rig.sched.drain(timeout=6.0)
        assert all(rig.releases[f"r{i}"] == 0 for i in range(6))
        thawed = time.monotonic()
        peer.thaw()  # ...and go back once the engine gives every entry its final status.
        assert rig.sched.drain(timeout=15.0)
        for i in range(6):
            held = rig.released_at[f"r{i}"] - thawed
            assert held >= 0.0, (
                f"r{i} released {-held:.2f}s before the thaw: the engine was not done"
            )
        rig.check_i6(7)
        peer.kill()
