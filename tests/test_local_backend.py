"""LocalBackend: integrity, the op contract, and every failure path."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import FailureReason
from transfer import (
    EngineError,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerUnreachable,
    RemoteRangeRejected,
    TransferCancelled,
    TransferOp,
    TransferPlan,
    TransferTimeout,
    build_plan,
)
from transfer.backend import Batch
from transfer.errors import BackendClosed
from transfer.regions import Region

LAYOUT = KVLayout(num_layers=2, num_blocks=32, block_bytes=64)
TIMEOUT = 10.0


@pytest.fixture
def src() -> KVCache:
    cache = KVCache(LAYOUT)
    cache.fill_seeded(11)
    return cache


@pytest.fixture
def dst() -> KVCache:
    return KVCache(LAYOUT)


@pytest.fixture
def backend(src: KVCache, dst: KVCache) -> Iterator[LocalBackend]:
    b = LocalBackend({"decode:1": dst}, workers=2)
    b.register_source(src)
    yield b
    b.close()


def _run(backend: LocalBackend, plan: TransferPlan) -> TransferOp:
    op = backend.submit(plan)
    assert op.wait_quiesced(TIMEOUT)
    assert op.done
    return op


def test_transfer_moves_exactly_the_planned_blocks(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    srcs, dsts = [0, 1, 2, 3, 9, 20], [10, 11, 12, 3, 30, 0]
    plan = build_plan(src, dst.peer_info("decode:1"), srcs, dsts, max_batch_entries=3)
    assert len(plan.batches) > 1
    op = _run(backend, plan)
    op.result(timeout=0)
    assert op.error is None
    assert src.blocks_equal(dst, srcs, dsts) == []
    untouched = [b for b in range(32) if b not in dsts]
    assert not any(dst.block(i, b).any() for i in range(4) for b in untouched)


def test_op_result_precedes_or_meets_quiescence_and_callbacks_run_once(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    plan = build_plan(src, dst.peer_info("decode:1"), [1], [2])
    op = backend.submit(plan)
    op.result(timeout=TIMEOUT)  # returns on success
    seen: list[TransferOp] = []
    op.add_quiesce_callback(seen.append)
    assert op.wait_quiesced(TIMEOUT)
    op.add_quiesce_callback(seen.append)  # already quiesced: runs at once
    # wait_quiesced() wakes before the first callback runs, in the worker thread.
    end = time.monotonic() + TIMEOUT
    while len(seen) < 2 and time.monotonic() < end:
        time.sleep(0.001)
    assert seen == [op, op]


def test_unknown_peer_fails_the_op_and_the_probe(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    backend.probe("decode:1")
    with pytest.raises(PeerUnreachable, match="unknown peer 'nobody'"):
        backend.probe("nobody")
    plan = build_plan(src, dst.peer_info("nobody"), [0], [0])
    op = _run(backend, plan)
    assert isinstance(op.error, PeerUnreachable)
    assert op.error.reason is FailureReason.PEER_LOST
    with pytest.raises(PeerUnreachable):
        op.result(timeout=0)


def test_unregistered_peer_is_unknown(backend: LocalBackend, src: KVCache, dst: KVCache) -> None:
    plan = build_plan(src, dst.peer_info("decode:1"), [0], [0])
    backend.unregister_peer("decode:1")
    assert isinstance(_run(backend, plan).error, PeerUnreachable)
    info = backend.register_peer("decode:1", dst)
    assert info == dst.peer_info("decode:1")
    assert _run(backend, plan).error is None


def test_unregistered_source_is_rejected_before_any_write(dst: KVCache) -> None:
    stranger = KVCache(LAYOUT)
    stranger.fill_seeded(5)
    with LocalBackendCtx({"decode:1": dst}) as backend:
        plan = build_plan(stranger, dst.peer_info("decode:1"), [0, 1], [0, 1])
        op = _run(backend, plan)
        assert isinstance(op.error, RemoteRangeRejected)
        assert "source" in str(op.error) and "no registered region" in str(op.error)
        assert not any(t.any() for t in dst.tensors)
        backend.register_source(stranger)
        assert _run(backend, plan).error is None
        backend.unregister_source(stranger)
        assert isinstance(_run(backend, plan).error, RemoteRangeRejected)


def test_destination_must_belong_to_the_named_peer(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    other = KVCache(LAYOUT)
    backend.register_peer("decode:2", other)
    # A plan addressed to decode:1 whose addresses are decode:2's buffers.
    forged = dataclasses.replace(other.peer_info("decode:2"), session_id="decode:1")
    op = _run(backend, build_plan(src, forged, [0], [0]))
    assert isinstance(op.error, RemoteRangeRejected)
    assert "outside peer decode:1" in str(op.error)
    assert not any(t.any() for t in other.tensors)


def test_destination_outside_the_advertised_regions_is_rejected_whole(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    # The peer advertises only the first half of each buffer: a hand-made plan
    # into the second half is rejected before any byte of it is copied.
    info = backend.register_peer("decode:1", dst)
    half = LAYOUT.buffer_bytes // 2
    backend.add_peer(
        dataclasses.replace(info, regions=tuple(Region(r.base, half) for r in info.regions))
    )
    ok = build_plan(src, info, [0], [0])
    last = build_plan(src, info, [LAYOUT.num_blocks - 1], [LAYOUT.num_blocks - 1])
    both = dataclasses.replace(ok, batches=ok.batches + last.batches)
    op = _run(backend, both)
    assert isinstance(op.error, RemoteRangeRejected)
    assert f"{last.batches[0].dst[0]:#x}" in str(op.error)  # names the bad address
    assert op.error.reason is FailureReason.INVALID_REQUEST
    assert not any(t.any() for t in dst.tensors)  # the good batch was not copied either
    assert backend.quarantined() == (0, 0)
    backend.remove_peer("decode:1")  # back to the cache's own bounds
    assert _run(backend, both).error is None


def test_zero_length_entry_is_rejected(backend: LocalBackend, src: KVCache, dst: KVCache) -> None:
    batch = Batch(src=(src.buffer_bases()[0],), dst=(dst.buffer_bases()[0],), lengths=(0,))
    op = _run(backend, TransferPlan(peer="decode:1", batches=(batch,), nbytes=0, num_blocks=0))
    assert isinstance(op.error, RemoteRangeRejected)


def _gate_first_batch(monkeypatch: pytest.MonkeyPatch, at_first: Callable[[], object]) -> None:
    """Run ``at_first()`` on the worker after it resolved batch 0, before copying it."""
    original = LocalBackend._resolve_batch

    def gated(*args: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = original(*args)  # type: ignore[arg-type]
        if args[1] == 0:
            at_first()
        return pairs

    monkeypatch.setattr(LocalBackend, "_resolve_batch", staticmethod(gated))


def _pause(reached: threading.Event, go: threading.Event) -> Callable[[], None]:
    def pause() -> None:
        reached.set()
        assert go.wait(TIMEOUT)

    return pause


PAIRS = ((0, 0), (1, 2), (2, 4))  # no runs: one entry per block per buffer


def _batch_per_buffer(src: KVCache, dst: KVCache) -> TransferPlan:
    # Entries are buffer-major and there are 3 per buffer: batch k is buffer k.
    plan = build_plan(
        src, dst.peer_info("decode:1"), *zip(*PAIRS, strict=True), max_batch_entries=3
    )
    assert len(plan.batches) == LAYOUT.num_buffers
    return plan


def _landed_buffers(src: KVCache, dst: KVCache) -> list[int]:
    """Buffers whose planned blocks all arrived; the others must be untouched."""
    landed = []
    for i in range(LAYOUT.num_buffers):
        if all(torch.equal(src.block(i, s), dst.block(i, d)) for s, d in PAIRS):
            landed.append(i)
        else:
            assert not dst.tensors[i].any(), f"buffer {i} partly written"
    return landed


def test_cancel_stops_between_batches(
    monkeypatch: pytest.MonkeyPatch, backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    on_first, go = threading.Event(), threading.Event()
    _gate_first_batch(monkeypatch, _pause(on_first, go))
    op = backend.submit(_batch_per_buffer(src, dst))
    assert on_first.wait(TIMEOUT)
    op.cancel()
    op.cancel()  # idempotent
    assert op.cancelled and not op.done
    go.set()
    assert op.wait_quiesced(TIMEOUT)
    assert isinstance(op.error, TransferCancelled)
    assert op.error.reason is FailureReason.ABORTED
    assert "before batch 1" in str(op.error)
    assert _landed_buffers(src, dst) == [0]  # batch 0 landed, later ones never started


def test_close_from_a_worker_fails_its_op_at_the_next_batch(
    monkeypatch: pytest.MonkeyPatch, backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    # close() on a pool thread must not wait for the pool (it would wait for itself).
    _gate_first_batch(monkeypatch, backend.close)
    op = _run(backend, _batch_per_buffer(src, dst))
    assert isinstance(op.error, BackendClosed)
    assert op.error.reason is FailureReason.SHUTDOWN
    assert "LocalBackend is closed" in str(op.error)
    assert _landed_buffers(src, dst) == [0]


def test_close_waits_for_in_flight_ops(
    monkeypatch: pytest.MonkeyPatch, backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    on_first, go = threading.Event(), threading.Event()
    _gate_first_batch(monkeypatch, _pause(on_first, go))
    op = backend.submit(_batch_per_buffer(src, dst))
    assert on_first.wait(TIMEOUT)
    closer = threading.Thread(target=backend.close)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # wait until close() has marked the backend
        try:
            backend.probe("decode:1")
        except PeerUnreachable:
            break
        time.sleep(0.001)
    assert closer.is_alive() and not op.done  # close() is waiting for the worker
    go.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert op.quiesced  # close() returned only after the worker finished
    assert "LocalBackend is closed" in str(op.error)
    assert _landed_buffers(src, dst) == [0]


def test_close_from_a_callback_does_not_deadlock(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    plan = build_plan(src, dst.peer_info("decode:1"), [0], [0])
    gate = threading.Event()
    first = backend.submit(plan)
    # Runs on a pool thread if the op is still in flight, here otherwise.

    def close_then_signal(_op: TransferOp) -> None:
        backend.close()
        gate.set()

    first.add_quiesce_callback(close_then_signal)
    assert gate.wait(TIMEOUT)
    assert first.wait_quiesced(TIMEOUT)


def test_submit_after_close_resolves_at_once(
    backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    backend.close()
    backend.close()  # idempotent
    op = backend.submit(build_plan(src, dst.peer_info("decode:1"), [0], [0]))
    assert op.done and op.quiesced
    assert isinstance(op.error, BackendClosed)
    assert op.error.reason is FailureReason.SHUTDOWN
    assert "LocalBackend is closed" in str(op.error)
    with pytest.raises(PeerUnreachable, match="closed"):
        backend.probe("decode:1")


def test_unexpected_copy_failure_becomes_engine_error(
    monkeypatch: pytest.MonkeyPatch, backend: LocalBackend, src: KVCache, dst: KVCache
) -> None:
    def broken(*args: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise MemoryError("simulated")

    monkeypatch.setattr(LocalBackend, "_resolve_batch", staticmethod(broken))
    op = _run(backend, build_plan(src, dst.peer_info("decode:1"), [0], [0]))
    assert isinstance(op.error, EngineError)
    assert isinstance(op.error.__cause__, MemoryError)


def test_bad_worker_count() -> None:
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"workers must be a positive int, got {bad!r}"):
            LocalBackend(workers=bad)  # type: ignore[arg-type]


class LocalBackendCtx:
    """A LocalBackend that is closed on exit, for tests without fixtures."""

    def __init__(self, peers: dict[str, KVCache]) -> None:
        self.backend = LocalBackend(peers, workers=1)

    def __enter__(self) -> LocalBackend:
        return self.backend

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


@settings(max_examples=25)
@given(
    layout=st.builds(
        KVLayout,
        num_layers=st.integers(1, 3),
        num_blocks=st.integers(1, 16),
        block_bytes=st.integers(1, 40),
        kv_split=st.booleans(),
    ),
    data=st.data(),
)
def test_any_valid_plan_arrives_intact(layout: KVLayout, data: st.DataObject) -> None:
    """I7 on the local backend: a successful op means equal blocks."""
    src, dst = KVCache(layout), KVCache(layout)
    src.fill_seeded(data.draw(st.integers(0, 2**32)))
    n = data.draw(st.integers(1, layout.num_blocks))
    dsts = data.draw(st.permutations(range(layout.num_blocks)))[:n]
    srcs = data.draw(st.lists(st.integers(0, layout.num_blocks - 1), min_size=n, max_size=n))
    limit = data.draw(st.integers(1, 8))
    with LocalBackendCtx({"p": dst}) as backend:
        backend.register_source(src)
        op = _run(backend, build_plan(src, dst.peer_info("p"), srcs, dsts, max_batch_entries=limit))
        assert op.error is None
    assert src.blocks_equal(dst, srcs, list(dsts)) == []


def test_waiters_blocked_before_the_result_are_woken_by_it() -> None:
    # TransferOp makes its condition only for a waiter that has to block:
    # waiters that arrive before the result and quiescence must still wake,
    # each at its own event, and a timed-out wait must report False / raise.
    op = TransferOp(TransferPlan("decode:1", (), 0, 0))
    assert not op.wait_quiesced(0.01)
    with pytest.raises(TransferTimeout, match=r"not finished after 0\.010s"):
        op.result(timeout=0.01)
    got: dict[str, object] = {}

    def wait_result() -> None:
        op.result(timeout=TIMEOUT)
        got["result"] = (op.done, op.quiesced)

    def wait_quiesced() -> None:
        got["quiesced"] = op.wait_quiesced(TIMEOUT)

    threads = [threading.Thread(target=f) for f in (wait_result, wait_quiesced)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # both are blocked in the condition by now
    assert got == {} and not op.done and not op.quarantined
    op._resolve(None)
    threads[0].join(TIMEOUT)
    assert got == {"result": (True, False)} and op.quarantined
    op._quiesce()
    threads[1].join(TIMEOUT)
    assert got == {"result": (True, False), "quiesced": True}
    assert op.resolved_at is not None and op.quiesced_at is not None
    assert op.quiesced_at >= op.resolved_at and not op.quarantined
