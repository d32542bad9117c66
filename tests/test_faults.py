"""FaultInjectingBackend and FaultPlan: each fault keeps the op contract."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import FailureReason
from transfer import (
    DEFAULT_FAULT_KINDS,
    EngineError,
    Fault,
    FaultInjectingBackend,
    FaultKind,
    FaultPlan,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerLost,
    PeerUnreachable,
    RemoteRangeRejected,
    TransferBackend,
    TransferError,
    TransferOp,
    TransferPlan,
    TransferTimeout,
    build_plan,
)
from transfer.errors import BackendClosed
from transfer.regions import Region

# One buffer and no runs: every block is one entry, so batch k holds block k
# when max_batch_entries == 1.
LAYOUT = KVLayout(num_layers=1, num_blocks=16, block_bytes=32, kv_split=False)
SRCS, DSTS = [0, 1, 2, 3], [0, 2, 4, 6]
PEER = "decode:1"
TIMEOUT = 10.0


@pytest.fixture
def caches() -> tuple[KVCache, KVCache]:
    src, dst = KVCache(LAYOUT), KVCache(LAYOUT)
    src.fill_seeded(21)
    return src, dst


def _local(src: KVCache, dst: KVCache) -> LocalBackend:
    inner = LocalBackend({PEER: dst}, workers=2)
    inner.register_source(src)
    return inner


@pytest.fixture
def plan(caches: tuple[KVCache, KVCache]) -> TransferPlan:
    src, dst = caches
    p = build_plan(src, dst.peer_info(PEER), SRCS, DSTS, max_batch_entries=1)
    assert len(p.batches) == 4
    return p


def _wrapped(caches: tuple[KVCache, KVCache], *faults: Fault | FaultKind) -> FaultInjectingBackend:
    return FaultInjectingBackend(_local(*caches), FaultPlan.script(faults))


@pytest.fixture
def closer() -> Iterator[list[TransferBackend]]:
    backends: list[TransferBackend] = []
    yield backends
    for b in backends:
        b.close()


def _settled(op: TransferOp) -> TransferOp:
    assert op.wait_quiesced(TIMEOUT)
    assert op.done
    return op


def _arrived(caches: tuple[KVCache, KVCache]) -> list[int]:
    """Destination blocks of the plan that hold their source's bytes."""
    src, dst = caches
    bad = src.blocks_equal(dst, SRCS, DSTS)
    return [d for d in DSTS if d not in bad]


# -- one test per fault kind ---------------------------------------------------------


def test_none_delegates_and_transfers(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches, FaultKind.NONE)
    closer.append(backend)
    op = _settled(backend.submit(plan))
    assert op.error is None
    assert _arrived(caches) == DSTS
    assert backend.stats[FaultKind.NONE] == 1


def test_error_code(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches, FaultKind.ERROR_CODE)
    closer.append(backend)
    op = backend.submit(plan)
    assert op.done and op.quiesced
    assert isinstance(op.error, EngineError) and op.error.code == -1
    assert op.error.peer == PEER and op.error.retryable
    assert _arrived(caches) == []


def test_raise_keeps_the_engine_exception_as_cause(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches, FaultKind.RAISE)
    closer.append(backend)
    op = backend.submit(plan)
    assert op.done and op.quiesced
    assert isinstance(op.error, EngineError)
    assert isinstance(op.error.__cause__, RuntimeError)
    assert op.error.__cause__.__traceback__ is not None  # really raised
    with pytest.raises(EngineError) as info:
        op.result(timeout=0)
    assert info.value.reason is FailureReason.TRANSFER_ERROR


def test_hang_needs_the_callers_deadline_until_released(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches, FaultKind.HANG, FaultKind.HANG)
    closer.append(backend)
    first, second = backend.submit(plan), backend.submit(plan)
    with pytest.raises(TransferTimeout):
        first.result(timeout=0.02)
    assert not first.done and not first.quiesced and not second.done
    backend.release_hangs()
    for op in (first, second):
        _settled(op)
        assert isinstance(op.error, EngineError)
    assert _arrived(caches) == []
    assert backend.stats[FaultKind.HANG] == 2


def test_close_releases_hangs_and_later_submits_cannot_hang(
    caches: tuple[KVCache, KVCache], plan: TransferPlan
) -> None:
    backend = _wrapped(caches, FaultKind.HANG, FaultKind.HANG)
    op = backend.submit(plan)
    backend.close()
    backend.close()  # idempotent
    assert isinstance(_settled(op).error, EngineError)
    # After close no fault is drawn: the closed inner backend answers.
    late = _settled(backend.submit(plan))
    assert isinstance(late.error, BackendClosed) and "closed" in str(late.error)


def test_lose_peer_is_sticky_until_restored(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches, FaultKind.LOSE_PEER, FaultKind.NONE)
    closer.append(backend)
    backend.probe(PEER)
    op = backend.submit(plan)
    assert op.done and op.quiesced and isinstance(op.error, PeerLost)
    assert op.error.reason is FailureReason.PEER_LOST
    with pytest.raises(PeerUnreachable, match="lost"):
        backend.probe(PEER)
    # While lost, submits fail without consuming the script.
    assert isinstance(_settled(backend.submit(plan)).error, PeerLost)
    backend.restore_peer(PEER)
    backend.probe(PEER)
    assert _settled(backend.submit(plan)).error is None  # the scripted NONE
    assert _arrived(caches) == DSTS


def test_lose_peer_by_hand(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    backend = _wrapped(caches)
    closer.append(backend)
    backend.lose_peer(PEER)
    assert isinstance(_settled(backend.submit(plan)).error, PeerLost)
    assert backend.stats == dict.fromkeys(FaultKind, 0)


@pytest.mark.parametrize(("batch", "failed"), [(0, 0), (2, 2), (3, 3), (99, 3)])
def test_fail_batch_transfers_every_other_batch(
    caches: tuple[KVCache, KVCache],
    plan: TransferPlan,
    closer: list[TransferBackend],
    batch: int,
    failed: int,
) -> None:
    backend = _wrapped(caches, Fault(FaultKind.FAIL_BATCH, batch=batch))
    closer.append(backend)
    op = _settled(backend.submit(plan))
    assert isinstance(op.error, EngineError)
    assert f"batch {failed} of 4" in str(op.error)
    assert _arrived(caches) == [d for i, d in enumerate(DSTS) if i != failed]


def test_fail_batch_of_a_single_batch_plan_sends_nothing(
    caches: tuple[KVCache, KVCache], closer: list[TransferBackend]
) -> None:
    src, dst = caches
    single = build_plan(src, dst.peer_info(PEER), SRCS, DSTS)
    assert len(single.batches) == 1
    manual = ManualBackend()
    backend = FaultInjectingBackend(manual, FaultPlan.script([FaultKind.FAIL_BATCH]))
    op = backend.submit(single)
    assert op.done and op.quiesced and isinstance(op.error, EngineError)
    assert manual.ops == []


class ManualBackend(TransferBackend):
    """Inner backend whose ops the test completes by hand."""

    name = "manual"

    def __init__(self) -> None:
        self.ops: list[TransferOp] = []
        self.closed = False

    def submit(self, plan: TransferPlan) -> TransferOp:
        op = TransferOp(plan)
        self.ops.append(op)
        return op

    def probe(self, peer: str) -> None:
        if peer != PEER:
            raise PeerUnreachable(peer)

    def close(self) -> None:
        self.closed = True


def test_fail_batch_quiesces_only_after_the_inner_op(plan: TransferPlan) -> None:
    manual = ManualBackend()
    backend = FaultInjectingBackend(manual, FaultPlan.script([Fault(FaultKind.FAIL_BATCH, 1)]))
    outer = backend.submit(plan)
    (inner,) = manual.ops
    assert inner.plan.batches == plan.batches[:1] + plan.batches[2:]
    assert inner.plan.nbytes == plan.nbytes - plan.batches[1].nbytes
    outer.cancel()  # reaches the op that does the work
    assert inner.cancelled
    inner._resolve(None)
    assert not outer.done and not outer.quiesced  # inner writes may still land
    inner._quiesce()
    assert outer.quiesced and isinstance(outer.error, EngineError)
    backend.close()
    assert manual.closed


def test_fail_batch_reports_a_real_inner_failure_first(plan: TransferPlan) -> None:
    manual = ManualBackend()
    backend = FaultInjectingBackend(manual, FaultPlan.script([Fault(FaultKind.FAIL_BATCH, 0)]))
    outer = backend.submit(plan)
    real = PeerLost("connection reset", peer=PEER)
    manual.ops[0]._resolve(real)
    manual.ops[0]._quiesce()
    assert outer.error is real


def test_none_returns_the_inner_op_itself(plan: TransferPlan) -> None:
    manual = ManualBackend()
    backend = FaultInjectingBackend(manual, FaultPlan(seed=0, rate=0.0))
    op = backend.submit(plan)
    assert manual.ops == [op]  # result, quiescence and cancel are the real ones
    backend.probe(PEER)
    with pytest.raises(PeerUnreachable):
        backend.probe("elsewhere")
    assert backend.name == "faults(manual)"


def test_an_inner_submit_that_raises_still_yields_a_settled_op(plan: TransferPlan) -> None:
    class Raising(ManualBackend):
        def submit(self, plan: TransferPlan) -> TransferOp:
            raise OSError("binding exploded")

    backend = FaultInjectingBackend(Raising(), FaultPlan(seed=0, rate=0.0))
    op = backend.submit(plan)
    assert op.done and op.quiesced
    assert isinstance(op.error, EngineError) and isinstance(op.error.__cause__, OSError)


# -- FaultPlan ---------------------------------------------------------------------


def _draws(plan: FaultPlan, n: int = 300, num_batches: int = 5) -> list[Fault]:
    return [plan.next(num_batches) for _ in range(n)]


def test_fault_plan_is_deterministic_by_seed() -> None:
    assert _draws(FaultPlan(42)) == _draws(FaultPlan(42))
    assert _draws(FaultPlan(42)) != _draws(FaultPlan(43))
    # The kinds depend on the seed alone, not on the plans' sizes.
    kinds = [f.kind for f in _draws(FaultPlan(7), num_batches=1)]
    assert kinds == [f.kind for f in _draws(FaultPlan(7), num_batches=50)]


def test_fault_plan_rate_and_kinds() -> None:
    draws = _draws(FaultPlan(1, rate=0.3), n=2000)
    injected = [f for f in draws if f.kind is not FaultKind.NONE]
    assert 0.25 < len(injected) / len(draws) < 0.35
    assert {f.kind for f in injected} == set(DEFAULT_FAULT_KINDS)
    assert FaultKind.LOSE_PEER not in DEFAULT_FAULT_KINDS  # sticky: opt in only
    assert all(0 <= f.batch < 5 for f in draws)
    assert {f.kind for f in _draws(FaultPlan(1, rate=0.0))} == {FaultKind.NONE}
    only = _draws(FaultPlan(1, rate=1.0, kinds=[FaultKind.FAIL_BATCH]), num_batches=3)
    assert {f.kind for f in only} == {FaultKind.FAIL_BATCH}
    assert {f.batch for f in only} == {0, 1, 2}


def test_fault_plan_script_then_no_faults() -> None:
    plan = FaultPlan.script([FaultKind.HANG, Fault(FaultKind.FAIL_BATCH, 2)])
    assert [plan.next(), plan.next(), plan.next(), plan.next()] == [
        Fault(FaultKind.HANG),
        Fault(FaultKind.FAIL_BATCH, 2),
        Fault(FaultKind.NONE),
        Fault(FaultKind.NONE),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": "1"}, "seed must be an int, got '1'"),
        ({"seed": 1, "rate": 1.5}, r"rate must be in \[0, 1\], got 1.5"),
        ({"seed": 1, "rate": True}, "rate must be in"),
        ({"seed": 1, "kinds": []}, "non-empty sequence of FaultKind"),
        ({"seed": 1, "kinds": ["hang"]}, "non-empty sequence of FaultKind"),
    ],
)
def test_fault_plan_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultPlan(**kwargs)  # type: ignore[arg-type]


def test_fault_validation() -> None:
    with pytest.raises(ValueError, match="batch must be a non-negative int, got -1"):
        Fault(FaultKind.FAIL_BATCH, -1)
    with pytest.raises(ValueError, match="kind must be a FaultKind, got 'hang'"):
        Fault("hang")  # type: ignore[arg-type]


# -- property: every op settles with its fault's exact error, and success means intact blocks

# What each drawn fault ends its op with: (error type, message pattern).
FAULT_ERRORS: dict[FaultKind, tuple[type[TransferError] | None, str]] = {
    FaultKind.NONE: (None, ""),
    FaultKind.ERROR_CODE: (EngineError, rf"^transfer to {PEER} returned -1 \(injected\)$"),
    FaultKind.RAISE: (
        EngineError,
        r"^engine raised: RuntimeError\('engine binding raised \(injected\)'\)$",
    ),
    FaultKind.HANG: (EngineError, r"^injected hang released$"),
    FaultKind.FAIL_BATCH: (EngineError, rf"^batch (\d) of 2 to {PEER} failed \(injected\)$"),
    FaultKind.LOSE_PEER: (PeerLost, rf"^peer {PEER} lost \(injected\)$"),
}


def test_every_op_settles_with_its_faults_error_and_success_means_integrity() -> None:
    seen: set[FaultKind] = set()

    @settings(max_examples=20)
    @given(seed=st.integers(0, 2**32), rate=st.floats(0.0, 1.0))
    def run(seed: int, rate: float) -> None:
        _six_faulty_submits(seed, rate, seen)

    run()
    assert seen == set(FAULT_ERRORS), f"no example drew {set(FAULT_ERRORS) - seen}"


def _six_faulty_submits(seed: int, rate: float, seen: set[FaultKind]) -> None:
    kinds = (*DEFAULT_FAULT_KINDS, FaultKind.LOSE_PEER)
    layout = KVLayout(num_layers=1, num_blocks=8, block_bytes=16, kv_split=False)
    src = KVCache(layout)
    src.fill_seeded(seed)
    backend = FaultInjectingBackend(
        LocalBackend({PEER: KVCache(layout)}), FaultPlan(seed, rate, kinds)
    )
    try:
        assert isinstance(backend.inner, LocalBackend)
        backend.inner.register_source(src)
        for i in range(6):
            dst = KVCache(layout)
            backend.inner.register_peer(PEER, dst)
            backend.restore_peer(PEER)
            srcs, dsts = [i, (i + 3) % 8], [5, 1]
            before = backend.stats
            info = dst.peer_info(PEER)
            plan = build_plan(src, info, srcs, dsts, max_batch_entries=1)
            op = backend.submit(plan)
            (kind,) = [k for k, n in backend.stats.items() if n > before[k]]  # one per submit
            seen.add(kind)
            if kind is FaultKind.HANG:  # a hang settles only when released
                assert not op.done and not op.quiesced
                backend.release_hangs()
            error = _settled(op).error
            want, message = FAULT_ERRORS[kind]
            assert (None if error is None else type(error)) is want, (kind, error)
            if error is None:  # the only success: every block arrived
                assert src.blocks_equal(dst, srcs, dsts) == []
                continue
            match = re.match(message, str(error))
            assert match, (kind, error)
            if kind is FaultKind.FAIL_BATCH:  # the other batch really arrived
                addr = plan.batches[int(match.group(1))].dst[0]
                failed = (addr - info.block_base[0]) // layout.block_bytes
                assert src.blocks_equal(dst, srcs, dsts) == [failed]
            else:  # nothing was sent: the destination is as it was
                assert src.blocks_equal(dst, srcs, dsts) == sorted(dsts)
        assert sum(backend.stats.values()) == 6
    finally:
        backend.close()


def test_peers_and_quarantine_reach_the_inner_backend(
    caches: tuple[KVCache, KVCache], plan: TransferPlan, closer: list[TransferBackend]
) -> None:
    b = _wrapped(caches)
    closer.append(b)
    info = caches[1].peer_info(PEER)
    base = info.regions[0].base  # advertise blocks 0..5: block 6 is out of bounds
    b.add_peer(dataclasses.replace(info, regions=(Region(base, 6 * LAYOUT.block_bytes),)))
    op = _settled(b.submit(plan))
    assert isinstance(op.error, RemoteRangeRejected)
    assert _arrived(caches) == []
    assert b.quarantined() == (0, 0)
    b.remove_peer(PEER)
    assert _settled(b.submit(plan)).error is None
