"""MooncakeBackend against the real engine: two processes on 127.0.0.1.

The prefill side is a backend in this process; each decode peer is a
receiver child (``tests/mooncake_helpers.py``) that the tests kill, freeze
and ask for per-block sha256 digests. No engine call is mocked.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from mooncake_helpers import (
    PREFILL_TRANSFER_TIMEOUT_S,
    assert_intact,
    free_port,
    http_metadata_server,
    prefill_backend,
    receiver,
    requires_mooncake,
    wait_until,
    zero_digest,
)
from structlog.testing import capture_logs

from kvguard.decode.service import ReceiverProcess
from lifecycle import FailureReason
from transfer import (
    Batch,
    EngineError,
    InvalidPlan,
    KVCache,
    KVLayout,
    PeerLost,
    PeerUnreachable,
    RegistrationError,
    RemoteRangeRejected,
    TransferCancelled,
    TransferTimeout,
    build_plan,
    plan_entries_naive,
)
from transfer.backend import PeerInfo
from transfer.errors import BackendClosed, PeerProtocolError
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests, peer_info_from_message, peer_info_to_message
from transfer.regions import Region

pytestmark = [pytest.mark.mooncake, requires_mooncake]

# 2 layers x K/V = 4 buffers of 16 MiB: 64 MiB a side.
LAYOUT = KVLayout(num_layers=2, num_blocks=4096, block_bytes=4096)
# For peers a test kills, freezes or overloads: 2 buffers of 16 MiB.
ONE_LAYER = KVLayout(num_layers=1, num_blocks=4096, block_bytes=4096)
WAIT = 30.0  # generous bound on any op that should succeed
# A hang guard, not a speed figure: how long past the moment it is due an
# outcome may come on a loaded 2-core machine. Each bound it sets stays below
# the slower path it rules out (the engine's own 30 s timeout, say); the
# speeds themselves are `kvguard bench`'s.
HANG_S = 10.0


@pytest.fixture(scope="module")
def backend() -> Iterator[MooncakeBackend]:
    with prefill_backend() as b:
        yield b


@pytest.fixture(scope="module")
def src(backend: MooncakeBackend) -> KVCache:
    cache = KVCache(LAYOUT)
    cache.fill_seeded(7)
    backend.register(cache)
    return cache  # the backend unregisters it when it closes


@pytest.fixture(scope="module")
def src1(backend: MooncakeBackend) -> KVCache:
    cache = KVCache(ONE_LAYER)
    cache.fill_seeded(8)
    backend.register(cache)
    return cache


@pytest.fixture(scope="module")
def shared_peer(backend: MooncakeBackend) -> Iterator[ReceiverProcess]:
    with receiver(LAYOUT, backend) as proc:
        yield proc


@pytest.fixture
def peer(shared_peer: ReceiverProcess) -> ReceiverProcess:
    shared_peer.zero()
    return shared_peer


def run(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess, s: list[int], d: list[int]
) -> None:
    plan = build_plan(src, peer.peer, s, d)
    op = backend.submit(plan)
    op.result(timeout=WAIT)
    assert op.wait_quiesced(1.0)


# -- integrity -----------------------------------------------------------------


def test_single_block_is_byte_exact(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    run(backend, src, peer, [5], [9])
    assert_intact(src, peer, [5], [9])
    assert peer.checksums([8, 10]) == [zero_digest(LAYOUT)] * 2  # neighbours untouched


def test_many_permuted_blocks_are_byte_exact(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    rng = random.Random(1)
    s = rng.sample(range(LAYOUT.num_blocks), 512)
    d = rng.sample(range(LAYOUT.num_blocks), 512)
    run(backend, src, peer, s, d)
    assert_intact(src, peer, s, d)


def test_fragmented_plan_is_coalesced_and_byte_exact(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    # Runs of 1..16 blocks separated by gaps, shifted by a constant offset.
    rng = random.Random(2)
    s: list[int] = []
    b = 0
    while b < 2048:
        n = rng.randint(1, 16)
        s.extend(range(b, min(b + n, 2048)))
        b += n + rng.randint(1, 4)
    d = [x + 2048 for x in s]
    plan = build_plan(src, peer.peer, s, d)
    naive = plan_entries_naive(src, peer.peer, s, d)
    assert naive.num_entries == len(s) * LAYOUT.num_buffers
    assert plan.num_entries < naive.num_entries / 4
    op = backend.submit(plan)
    op.result(timeout=WAIT)
    assert_intact(src, peer, s, d)


def test_64_mib_transfer_is_byte_exact(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    blocks = list(range(LAYOUT.num_blocks))
    plan = build_plan(src, peer.peer, blocks, blocks)
    assert plan.nbytes == 64 << 20
    assert plan.num_entries == LAYOUT.num_buffers  # one entry per contiguous buffer
    op = backend.submit(plan)
    op.result(timeout=WAIT)
    assert op.wait_quiesced(1.0)
    assert_intact(src, peer, blocks, blocks)


def test_thousands_of_blocks_go_in_legal_batches(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    s = list(range(LAYOUT.num_blocks))
    d = s[::-1]  # nothing coalesces: one entry per block per buffer
    plan = plan_entries_naive(src, peer.peer, s, d)
    assert plan.num_entries == 4 * 4096
    assert len(plan.batches) == 32
    assert max(len(b.lengths) for b in plan.batches) <= 512
    op = backend.submit(plan)
    op.result(timeout=WAIT)
    assert_intact(src, peer, s, d)


def test_concurrent_ops_to_one_peer_are_all_byte_exact(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    # 8 x 1024 entries at once would overflow the engine's ~2048-transfer
    # queue for the peer and fail every call; the per-peer budget holds back.
    chunks = [list(range(i * 256, (i + 1) * 256)) for i in range(8)]
    dst = [[x ^ 1 for x in c] for c in chunks]  # pairwise swapped: coalesces nothing
    ops = [
        backend.submit(build_plan(src, peer.peer, c, d)) for c, d in zip(chunks, dst, strict=True)
    ]
    for op in ops:
        op.result(timeout=WAIT)
    assert_intact(src, peer, [x for c in chunks for x in c], [x for c in dst for x in c])


# -- failures become typed errors ---------------------------------------------------


def test_oversized_batch_is_held_to_the_engine_budget_and_byte_exact(
    backend: MooncakeBackend, src1: KVCache
) -> None:
    # 8192 entries in one batch: one sync call failed outright (the TCP
    # transport holds 1024 queued + 1024 pending per peer); the engine loop
    # hands them over within that budget, entry by entry.
    with receiver(ONE_LAYER, backend) as proc:
        blocks = list(range(ONE_LAYER.num_blocks))
        legal = plan_entries_naive(src1, proc.peer, blocks, blocks[::-1])
        merged = Batch(
            sum((b.src for b in legal.batches), ()),
            sum((b.dst for b in legal.batches), ()),
            sum((b.lengths for b in legal.batches), ()),
        )
        assert len(merged.lengths) == 8192
        op = backend.submit(dataclasses.replace(legal, batches=(merged,)))
        op.result(timeout=WAIT)
        assert op.wait_quiesced(1.0)
        assert_intact(src1, proc, blocks, blocks[::-1])


def test_engine_refusing_entries_fails_engine_error_and_keeps_what_it_holds(
    src1: KVCache, all_levels: None
) -> None:
    # A budget above the engine's limits lets the TCP transport refuse
    # entries (queue full): the op fails EngineError while the peer answers,
    # with thousands of accepted entries still with the engine. Measured: the
    # overflowed engine then either leaves ~1024 of them without a final status
    # for good or ends them all within 2 s, run to run. Freezing the peer at
    # the error holds what is left with the engine either way, so the op stays
    # quarantined and close() keeps the memory instead of freeing it.
    with (
        prefill_backend(close_timeout_s=0.5) as b,
        receiver(ONE_LAYER, b) as proc,
        capture_logs() as logs,
    ):
        b._loop._budget = 8192  # what a wrong budget would do
        b.register(src1)
        blocks = list(range(ONE_LAYER.num_blocks))
        op = b.submit(plan_entries_naive(src1, proc.peer, blocks, blocks[::-1]))
        with pytest.raises(EngineError) as info:
            op.result(timeout=WAIT)
        proc.freeze()  # no more acks: the engine keeps what it holds now
        assert type(info.value) is EngineError
        assert info.value.retryable and info.value.reason is FailureReason.TRANSFER_ERROR
        assert "an entry's transfer_check_status returned -1" in str(info.value), info.value
        assert "probe: alive (0 OK)" in str(info.value), info.value
        if op.inflight == 0:
            # The engine ended every entry between the error and the freeze
            # (about 1 run in 6 here): nothing left with it, nothing held.
            assert op.wait_quiesced(1.0) and b.quarantined() == (0, 0), b.quarantined()
            b.close()
            assert "engine_memory_kept" not in [e["event"] for e in logs]
            return
        assert not op.quiesced, (op.inflight, op.completed)
        assert b.quarantined() == (1, op.nbytes)
        b.close()
        assert "engine_memory_kept" in [e["event"] for e in logs]
        assert not op.quiesced


def test_unknown_peer_is_unreachable(
    backend: MooncakeBackend, src: KVCache, shared_peer: ReceiverProcess
) -> None:
    nobody = dataclasses.replace(shared_peer.peer, session_id=f"127.0.0.1:{free_port()}")
    backend.add_peer(nobody)
    op = backend.submit(build_plan(src, nobody, [0], [0]))
    with pytest.raises(PeerUnreachable) as info:
        op.result(timeout=WAIT)
    assert info.value.reason is FailureReason.PEER_LOST
    assert info.value.peer == nobody.session_id
    assert op.quiesced or op.wait_quiesced(1.0)
    with pytest.raises(PeerUnreachable) as probe:
        backend.probe(nobody.session_id)
    assert probe.value.code == -102  # ERR_SOCKET: connection refused


def test_killed_peer_surfaces_in_milliseconds(backend: MooncakeBackend, src1: KVCache) -> None:
    with receiver(ONE_LAYER, backend) as proc:
        run(backend, src1, proc, [0], [0])  # connected and known alive
        s = list(range(ONE_LAYER.num_blocks))
        submitted = time.monotonic()
        op = backend.submit(plan_entries_naive(src1, proc.peer, s, s[::-1]))
        # Killed with entries in the engine's hands (before, a probe would
        # refuse the op as PeerUnreachable with nothing sent).
        assert wait_until(lambda: op.inflight > 0 or op.done, WAIT)
        assert not op.done, "transfer finished before the kill: test is vacuous"
        killed = time.monotonic()  # SIGKILL and reaping count too
        proc.kill()
        with pytest.raises(PeerLost) as info:
            op.result(timeout=WAIT)
        surfaced = time.monotonic() - killed
        assert info.value.reason is FailureReason.PEER_LOST
        assert "transfer_check_status returned -1" in str(info.value), info.value
        # Not the engine's own transfer timeout (it runs from the submit): the
        # dead peer surfaced first (in milliseconds; `kvguard bench` says how many).
        assert surfaced < PREFILL_TRANSFER_TIMEOUT_S, f"dead peer took {surfaced:.3f}s"
        # The engine fails what it still holds after its lane reconnect fails (~1 s).
        assert op.wait_quiesced(PREFILL_TRANSFER_TIMEOUT_S + HANG_S)
        assert op.quiesced_at is not None
        assert op.quiesced_at - submitted < PREFILL_TRANSFER_TIMEOUT_S
        # Known dead: the next plan fails on a probe, before the engine sees it.
        again = backend.submit(build_plan(src1, proc.peer, [1], [1]))
        with pytest.raises(PeerUnreachable) as refused:
            again.result(timeout=WAIT)
        assert "nothing sent; probe: refused (-102 ERR_SOCKET)" in str(refused.value)


def test_frozen_peer_caller_deadline_fires_and_quiesce_waits_for_the_engine(
    backend: MooncakeBackend, src1: KVCache
) -> None:
    with receiver(ONE_LAYER, backend) as proc:
        run(backend, src1, proc, [0], [0])
        proc.freeze()
        blocks = list(range(64))
        op = backend.submit(build_plan(src1, proc.peer, blocks, blocks))
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as info:
            op.result(timeout=0.5)
        assert 0.45 < time.monotonic() - t0 < 0.5 + HANG_S  # our deadline, not Mooncake's 30 s
        assert info.value.reason is FailureReason.TIMEOUT
        # The engine holds the entries: the buffers stay quarantined (I6).
        assert not op.done and not op.quiesced
        assert not op.wait_quiesced(1.0)
        proc.thaw()
        assert op.wait_quiesced(5.0)
        assert op.done
        assert op.error is None, op.error  # thawed before the engine's timeout: all landed
        assert_intact(src1, proc, blocks, blocks)


def test_frozen_peer_fails_peer_lost_at_the_engine_timeout_and_stays_quarantined(
    backend: MooncakeBackend, src1: KVCache
) -> None:
    with receiver(ONE_LAYER, backend) as proc:
        run(backend, src1, proc, [0], [0])
        proc.freeze()
        op = backend.submit(build_plan(src1, proc.peer, [1, 2, 3], [1, 2, 3]))
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            op.result(timeout=0.5)
        # MC_TRANSFER_TIMEOUT, then a bounded probe that gets no answer.
        with pytest.raises(PeerLost) as info:
            op.result(timeout=PREFILL_TRANSFER_TIMEOUT_S + 10)
        elapsed = time.monotonic() - t0
        assert PREFILL_TRANSFER_TIMEOUT_S - 0.5 < elapsed < PREFILL_TRANSFER_TIMEOUT_S + HANG_S
        assert info.value.reason is FailureReason.PEER_LOST
        assert "silent" in str(info.value)
        # The engine still holds the entries: quarantined, not released (I6).
        assert op.quarantined and not op.quiesced
        assert backend.quarantined() == (1, op.nbytes)
        with pytest.raises(PeerUnreachable):
            backend.probe(proc.peer.session_id, timeout=0.2)
        proc.thaw()
        assert op.wait_quiesced(5.0)
        assert backend.quarantined() == (0, 0)
        assert op.quiesced_at is not None and op.resolved_at is not None
        assert op.quiesced_at - op.resolved_at > 0.1


def test_close_with_a_call_stuck_on_a_frozen_peer_keeps_the_op_unquiesced(
    src1: KVCache, all_levels: None
) -> None:
    with (
        prefill_backend(close_timeout_s=0.3) as b,
        receiver(ONE_LAYER, b) as proc,
        capture_logs() as logs,
    ):
        b.register(src1)
        run(b, src1, proc, [0], [0])
        proc.freeze()
        op = b.submit(build_plan(src1, proc.peer, [1], [1]))
        time.sleep(0.1)  # let the loop hand the entries over
        t0 = time.monotonic()
        b.close()  # bounded: it keeps the engine and memory instead of waiting
        assert time.monotonic() - t0 < 0.5 + HANG_S  # its close_timeout_s, not the peer's
        assert not op.quiesced  # the engine may still read src1 and write the peer
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["engine_memory_kept"]
        # Killed while stopped (kill() would SIGCONT first, and the peer could
        # ack the write in between): it never answers, and the engine fails
        # the entry at once, on a refused connection.
        os.kill(proc.pid, signal.SIGKILL)  # not reaped yet: the pid is still the child's
        proc.kill()  # reaps it
        assert op.wait_quiesced(PREFILL_TRANSFER_TIMEOUT_S + 5)
        assert op.done
        assert isinstance(op.error, PeerLost), op.error
        assert op.error.reason is FailureReason.PEER_LOST
        assert "0/2 entries done, 0 still with the engine; probe: refused" in str(op.error)


def test_remote_range_outside_peer_region_is_rejected_before_sending(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    # The peer advertises only the first half of each buffer.
    half = LAYOUT.buffer_bytes // 2
    shrunk = dataclasses.replace(
        peer.peer, regions=tuple(Region(r.base, half) for r in peer.peer.regions)
    )
    last = LAYOUT.num_blocks - 1
    with pytest.raises(RemoteRangeRejected) as info:
        build_plan(src, shrunk, [0, 1], [0, last])
    assert info.value.reason is FailureReason.INVALID_REQUEST
    assert peer.checksums([0, last]) == [zero_digest(LAYOUT)] * 2  # nothing was sent


def test_hand_made_plan_outside_the_peer_regions_is_rejected_by_submit(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    # TransferPlan is a public dataclass: a plan need not come from build_plan.
    good = build_plan(src, peer.peer, [0], [0])
    end = max(r.end for r in peer.peer.regions)
    for dst in (end, end - 1, peer.peer.regions[0].base - 4096):
        batch = good.batches[0]
        bad = dataclasses.replace(
            good, batches=(Batch(batch.src, (dst, *batch.dst[1:]), batch.lengths),)
        )
        op = backend.submit(bad)
        with pytest.raises(RemoteRangeRejected, match=f"{dst:#x}") as info:
            op.result(timeout=1.0)
        assert info.value.reason is FailureReason.INVALID_REQUEST
        assert op.quiesced
    stranger = dataclasses.replace(good, peer=f"127.0.0.1:{free_port()}")
    with pytest.raises(RemoteRangeRejected, match="add_peer"):
        backend.submit(stranger).result(timeout=1.0)
    assert peer.checksums([0]) == [zero_digest(LAYOUT)]  # nothing was sent


def test_unregistered_source_is_rejected_and_nothing_sent(
    backend: MooncakeBackend, peer: ReceiverProcess
) -> None:
    stray = KVCache(LAYOUT)  # never registered: the engine would read it anyway
    stray.fill_seeded(3)
    op = backend.submit(build_plan(stray, peer.peer, [4], [4]))
    with pytest.raises(InvalidPlan, match="not in memory registered"):
        op.result(timeout=WAIT)
    assert peer.checksums([4]) == [zero_digest(LAYOUT)]


def test_registration_errors_are_typed(backend: MooncakeBackend) -> None:
    small = KVLayout(num_layers=1, num_blocks=4, block_bytes=4096)
    cache = KVCache(small)
    backend.register(cache)
    try:
        with pytest.raises(RegistrationError, match="already registered"):
            backend.register(cache)
        # Another cache over the same memory: the engine itself says overlapped.
        alias = KVCache(small, tensors=cache.tensors)
        with pytest.raises(RegistrationError) as info:
            backend.register(alias)
        assert info.value.code == -7
        assert f"{cache.buffer_bases()[0]:#x}" in str(info.value)
        with pytest.raises(RegistrationError, match="not registered"):
            backend.unregister(alias)
    finally:
        backend.unregister(cache)
    with pytest.raises(RegistrationError, match="not registered"):
        backend.unregister(cache)


def test_cancel_stops_between_batches(
    backend: MooncakeBackend, src: KVCache, peer: ReceiverProcess
) -> None:
    s = list(range(LAYOUT.num_blocks))
    plan = plan_entries_naive(src, peer.peer, s, s[::-1])
    op = backend.submit(plan)
    op.cancel()
    with pytest.raises(TransferCancelled) as info:
        op.result(timeout=WAIT)
    assert info.value.reason is FailureReason.ABORTED
    assert op.wait_quiesced(1.0)


def test_closed_backend_fails_fast_and_close_is_idempotent(
    src: KVCache, shared_peer: ReceiverProcess
) -> None:
    with prefill_backend() as b:
        assert b.session_id.startswith("127.0.0.1:")
        b.probe(shared_peer.peer.session_id)
        b.close()
        b.close()
        assert b.closed and b.engine is None
        op = b.submit(build_plan(src, shared_peer.peer, [0], [0]))
        with pytest.raises(BackendClosed) as info:
            op.result(timeout=1.0)
        assert info.value.reason is FailureReason.SHUTDOWN
        assert op.quiesced
        with pytest.raises(PeerUnreachable):
            b.probe(shared_peer.peer.session_id)


def test_metadata_server_mode_transfers(src: KVCache) -> None:
    # The wheel's HTTP metadata server needs aiohttp, a runtime dependency here.
    with (
        http_metadata_server() as url,
        receiver(LAYOUT, ip=f"127.0.0.1:{free_port()}", metadata=url) as proc,
        prefill_backend(local_ip=f"127.0.0.1:{free_port()}", metadata=url) as b,
    ):
        b.add_peer(proc.peer)
        assert proc.peer.session_id.startswith("127.0.0.1:")
        cache = KVCache(LAYOUT)
        cache.fill_seeded(5)
        b.register(cache)
        op = b.submit(build_plan(cache, proc.peer, [1, 2, 3], [7, 8, 9]))
        op.result(timeout=WAIT)
        assert_intact(cache, proc, [1, 2, 3], [7, 8, 9])


# -- the peer message and the receiver's command line --------------------------------


def _good_message(peer: PeerInfo) -> dict[str, object]:
    return dict(msgspec.msgpack.decode(peer_info_to_message(peer)))


BAD_MESSAGES: dict[str, dict[str, object]] = {
    "session id not a str": {"session_id": 12345},
    "session id empty": {"session_id": ""},
    "session id with space": {"session_id": "127.0.0.1 :1"},
    "session id too long": {"session_id": "h" * 300},
    "bool as block count": {"layout": {"num_layers": 2, "num_blocks": True, "block_bytes": 4096}},
    "region not a pair": {"regions": [[1, 2, 3]]},
    "negative region length": {"regions": [[4096, -1]]},
    "float address": {"block_base": [1.5, 2, 3, 4]},
    "too many bases": {"block_base": list(range(1, 70000))},
    "wrong version": {"kvguard": 2},
    "bool version": {"kvguard": True},
    "base outside every region": {"block_base": [4096, 8192, 12288, 16384]},
    "no regions": {"regions": []},
    "wrong type": {"type": "command"},
    "extra key": {"extra": 1},
}


@pytest.mark.parametrize("case", sorted(BAD_MESSAGES))
def test_malformed_peer_message_is_a_typed_error(case: str, shared_peer: ReceiverProcess) -> None:
    msg = {**_good_message(shared_peer.peer), **BAD_MESSAGES[case]}
    with pytest.raises(PeerProtocolError) as info:
        peer_info_from_message(msgspec.msgpack.encode(msg))
    assert info.value.reason is FailureReason.INVALID_REQUEST


def test_peer_message_structure_is_checked(shared_peer: ReceiverProcess) -> None:
    good = _good_message(shared_peer.peer)
    assert peer_info_from_message(msgspec.msgpack.encode(good)) == shared_peer.peer
    regions = list(good["regions"])  # type: ignore[call-overload]
    for bad in (
        b"not msgpack",
        b"\x90",  # []
        msgspec.msgpack.encode({**good, "regions": [*regions, regions[0]]}),  # overlap
        msgspec.msgpack.encode({k: v for k, v in good.items() if k != "layout"}),
        msgspec.msgpack.encode({**good, "kvguard": float("nan")}),
        b"x" * (1 << 21),
    ):
        with pytest.raises(PeerProtocolError):
            peer_info_from_message(bad)


def test_receiver_answers_malformed_commands_with_typed_errors(peer: ReceiverProcess) -> None:
    for frame in (
        b"not msgpack",
        msgspec.msgpack.encode({"cmd": "rm -rf"}),
        msgspec.msgpack.encode({"cmd": "checksum", "blocks": [4096]}),
        msgspec.msgpack.encode({"cmd": "checksum", "blocks": "all"}),
        msgspec.msgpack.encode({"cmd": "zero", "force": True}),
        b"\xff\xfe",
    ):
        with pytest.raises(PeerProtocolError, match="PeerProtocolError"):
            peer.send_raw(frame)
    # Past MAXMSGSIZE the service drops the connection unread: no reply, a deadline.
    with pytest.raises(TimeoutError):
        peer.send_raw(msgspec.msgpack.encode({"cmd": "ping", "pad": "x" * (1 << 21)}), 1.0)
    assert peer.request({"cmd": "ping"})["pid"] == peer.pid  # still serving


def test_receiver_that_cannot_start_reports_a_typed_error() -> None:
    proc = ReceiverProcess(ONE_LAYER, metadata="http://127.0.0.1:1/metadata")
    # The engine refuses the metadata URL, or the receiver finds it dead first.
    with pytest.raises(PeerProtocolError, match=r"RegistrationError|URLError"), proc:
        pytest.fail("a receiver whose engine cannot initialize started")
    assert not proc.alive


def test_receiver_exits_when_its_stdin_closes() -> None:
    with receiver(KVLayout(1, 4, 64)) as proc:
        stdin = proc._proc.stdin if proc._proc is not None else None
        assert stdin is not None
        stdin.close()
        assert wait_until(lambda: not proc.alive, 15.0)


def test_receiver_is_killed_even_when_frozen() -> None:
    with receiver(KVLayout(1, 4, 64)) as proc:
        proc.freeze()
        assert proc.frozen
        with pytest.raises(TimeoutError):
            proc.request({"cmd": "ping"}, timeout=0.3)
    assert not proc.alive


def test_late_reply_is_not_taken_for_the_next_one(peer: ReceiverProcess) -> None:
    peer.freeze()
    with pytest.raises(TimeoutError):
        peer.request({"cmd": "checksum", "blocks": [0]}, timeout=0.2)
    peer.thaw()
    assert peer.request({"cmd": "ping"})["pid"] == peer.pid


# -- release after quiesce on the real engine (I6, issue 10) --------------------------


def test_frozen_peer_blocks_are_released_only_after_the_engine_is_done(
    backend: MooncakeBackend,
) -> None:
    """Freeze the peer, give up at a 1 s deadline, stay frozen past the engine's
    own timeout, refill the source at release, thaw: nothing may move after release."""
    cache = KVCache(ONE_LAYER)
    cache.fill_seeded(11)
    backend.register(cache)
    blocks = list(range(64))
    try:
        with receiver(ONE_LAYER, backend) as proc:
            run(backend, cache, proc, [100], [100])  # connected and known alive
            before = block_digests(cache, blocks)
            timeline: dict[str, float] = {}
            refilled = threading.Event()

            def refill(op: object) -> None:
                timeline["released"] = time.monotonic()
                cache.fill_seeded(99)  # the blocks are reused at once
                refilled.set()

            proc.freeze()
            op = backend.submit(plan_entries_naive(cache, proc.peer, blocks, blocks))
            op.add_quiesce_callback(refill)
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                op.result(timeout=1.0)
            time.sleep(PREFILL_TRANSFER_TIMEOUT_S + 1.5)  # past the engine's own timeout
            assert "released" not in timeline, (
                f"released {timeline['released'] - t0:.2f}s after submit, peer still frozen"
            )
            assert not op.quiesced
            thawed = time.monotonic()
            proc.thaw()
            assert op.wait_quiesced(10.0)
            assert refilled.wait(5.0)  # wait_quiesced returns before the callbacks end
            assert timeline["released"] >= thawed
            after = block_digests(cache, blocks)
            assert not set(after) & set(before)
            landed = proc.checksums(blocks)
            time.sleep(0.5)
            assert proc.checksums(blocks) == landed, "destination changed after release"
            leaked = [b for b, d, a in zip(blocks, landed, after, strict=True) if d == a]
            assert not leaked, f"post-release source bytes reached blocks {leaked[:10]}"
            stray = [b for b, d, w in zip(blocks, landed, before, strict=True) if d != w]
            assert not stray or op.error is not None, f"op succeeded, blocks {stray[:10]} differ"
    finally:
        assert wait_until(lambda: backend.in_flight == 0, 10.0)
        backend.unregister(cache)


def test_killed_frozen_peer_releases_within_seconds_of_the_kill(
    backend: MooncakeBackend, src1: KVCache
) -> None:
    with receiver(ONE_LAYER, backend) as proc:
        run(backend, src1, proc, [100], [100])
        proc.freeze()
        blocks = list(range(64))
        submitted = time.monotonic()
        op = backend.submit(plan_entries_naive(src1, proc.peer, blocks, blocks))
        with pytest.raises(TransferTimeout):
            op.result(timeout=1.0)
        assert not op.quiesced
        proc.kill()
        assert op.wait_quiesced(PREFILL_TRANSFER_TIMEOUT_S + HANG_S), "the blocks stay held"
        # Before the engine's own transfer timeout (it runs from the submit)
        # would have ended the entries: the kill did.
        assert op.quiesced_at is not None
        assert op.quiesced_at - submitted < PREFILL_TRANSFER_TIMEOUT_S
        assert isinstance(op.error, PeerLost), op.error
        assert op.done and op.error.reason is FailureReason.PEER_LOST
        assert "probe: refused (-102 ERR_SOCKET)" in str(op.error), op.error


# -- the engine's own log lines ---------------------------------------------------------


@pytest.mark.parametrize(("flag", "loud"), [(None, False), ("1", True)])
def test_engine_info_lines_are_quiet_unless_asked_for(flag: str | None, loud: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "KVGUARD_ENGINE_LOG")}
    if flag is not None:
        env["KVGUARD_ENGINE_LOG"] = flag
    code = "from transfer.mooncake import MooncakeBackend; MooncakeBackend().close()"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = [line for line in proc.stderr.splitlines() if line.startswith("I")]
    assert bool(info) is loud, proc.stderr[-2000:]
    # Quiet: not even glog's preamble or the engine's ERROR-level start-up note.
    assert (proc.stderr == "") is not loud, proc.stderr[-2000:]


def test_a_refused_start_keeps_the_engines_own_words() -> None:
    from transfer.errors import RegistrationError
    from transfer.mooncake import MooncakeBackend

    with pytest.raises(RegistrationError, match="returned") as info:
        MooncakeBackend("127.0.0.1:1", metadata="http://127.0.0.1:9/metadata")
    assert "the engine said" in str(info.value)
