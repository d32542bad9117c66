"""The prefill reads a hold's blocks for the digest as the hold begins.

``PrefillSender(sum_early=True)`` (the connector's default with
``kvguard_verify``) reads each hold's whole blocks on its digest thread when
vLLM hands them over, before any decode asks; a verified push of whole
blocks then only weighs those sums, so the engine's transfer does not share
the CPUs with a read of the same bytes. Promised, and checked here over real
ZeroMQ on loopback (``tests.pd_pair``):

* a whole-block load is digested from the sums alone (the blocks are not
  read again), and garbled bytes are still caught;
* a tensor parallel slice, or sums that failed, fall back to reading the
  blocks then, with the same digest;
* a hold is released only after its early read ended, even a hold that no
  decode ever asked for.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from structlog.testing import capture_logs

import kvguard.vllm.integrity as integrity
import kvguard.vllm.prefill_pushes as prefill_pushes
from kvguard.vllm.states import LoadEnd
from tests.pd_pair import Pair, flip
from tests.test_pd_integrity import _cache
from transfer import KVCache
from transfer.checksum import BlockSums, region_digest
from transfer.plan import BlockSlice


def _unread(monkeypatch: pytest.MonkeyPatch, pair: Pair) -> list[object]:
    """Make every read of the prefill's blocks at push time fail (the
    decode's check reads its own); the reads tried."""
    tried: list[object] = []
    real = integrity.region_digest

    def read(cache: KVCache, *args: Any) -> bytes:
        if cache is pair.src:
            tried.append(args)
            raise RuntimeError("the blocks were read again")
        return real(cache, *args)

    monkeypatch.setattr(integrity, "region_digest", read)
    return tried


def _held(pair: Pair, rid: str, blocks: list[int]) -> None:
    """Hold ``blocks`` as ``rid`` and wait until their early read began (one
    still queued when a push needs it is cancelled: the backlog case)."""
    pair.sender.hold(rid, blocks, time.monotonic() + 10)
    pair.until(lambda: rid in pair.sender._sums and not _queued(pair.sender._sums[rid]))


def _queued(made: Future[Any]) -> bool:
    return not (made.running() or made.done())


def test_a_whole_block_load_is_digested_from_the_holds_sums(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pair = Pair()
    tried = _unread(monkeypatch, pair)
    try:
        _held(pair, "r1", [1, 2, 3])
        out = pair.load("r1", [1, 2, 3], [9, 4, 11])
        assert (out.end, out.detail, out.fenced) == (LoadEnd.LOADED, "", False)
        pair.backend.garble = (pair.dst, [5, 6], flip)
        _held(pair, "r2", [7, 8])
        out = pair.load("r2", [7, 8], [5, 6])
        assert out.end is LoadEnd.INTEGRITY and out.detail.startswith("digest ")
        assert tried == []
    finally:
        pair.close()


def test_without_early_sums_the_blocks_are_read_at_push_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: the same load, sums off, reads its blocks (and here,
    where that read fails, sends no digest)."""
    pair = Pair(sum_early=False)
    tried = _unread(monkeypatch, pair)
    try:
        out = pair.load("r1", [1, 2, 3], [9, 4, 11])
        assert (out.end, out.detail) == (LoadEnd.INTEGRITY, "the prefill sent no digest")
        assert tried == [([1, 2, 3], None)]
    finally:
        pair.close()


def _done(sums: BlockSums | Exception) -> Future[BlockSums]:
    made: Future[BlockSums] = Future()
    if isinstance(sums, Exception):
        made.set_exception(sums)
    else:
        made.set_result(sums)
    return made


def test_a_slice_or_a_block_not_summed_reads_the_blocks() -> None:
    cache = _cache()
    early = _done(BlockSums(cache, [1, 2]))
    part = BlockSlice(64, 0, 128)
    assert integrity.source_digest(cache, [1, 2], part, early) == region_digest(
        cache, [1, 2], (64, 128)
    )
    assert integrity.source_digest(cache, [2, 3], None, early) == region_digest(cache, [2, 3])
    assert integrity.source_digest(cache, [2, 1], None, early) == region_digest(cache, [2, 1])


@pytest.mark.usefixtures("all_levels")
def test_sums_that_failed_are_logged_and_the_blocks_read() -> None:
    cache = _cache()
    with capture_logs() as logs:
        got = integrity.source_digest(cache, [4], None, _done(RuntimeError("no memory")))
    assert got == region_digest(cache, [4])
    assert logs == [{"event": "early_sums_failed", "error": "no memory", "log_level": "warning"}]


def test_a_hold_is_released_only_once_its_early_read_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hold no decode asks for ends at its deadline while its blocks are
    still being read: vLLM must not hear they are free before the read ends.
    The read here starts after the deadline and watches for the release."""
    seen: list[bool] = []
    pair: Pair | None = None

    class SlowSums(BlockSums):
        def __init__(self, *args: Any) -> None:
            time.sleep(0.1)  # past the hold's 20 ms deadline
            assert pair is not None
            until = time.monotonic() + 0.2
            released = False
            while not released and time.monotonic() < until:
                with pair.sender._lock:
                    released = "r1" in pair.sender._released
                time.sleep(0.001)
            seen.append(released)
            super().__init__(*args)

    monkeypatch.setattr(prefill_pushes, "BlockSums", SlowSums)
    pair = Pair()
    try:
        pair.sender.hold("r1", [1, 2], time.monotonic() + 0.02)
        pair.until(lambda: "r1" in pair.released)  # type: ignore[union-attr]
        assert seen == [False]
        assert pair.sender._sums == {}  # let go with the hold
    finally:
        pair.close()


def test_a_hold_the_core_ignores_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[list[int]] = []
    gate = threading.Event()

    class Counted(BlockSums):
        def __init__(self, cache: KVCache, blocks: list[int]) -> None:
            reads.append(list(blocks))
            super().__init__(cache, blocks)
            gate.set()

    monkeypatch.setattr(prefill_pushes, "BlockSums", Counted)
    pair = Pair()
    try:
        pair.sender.hold("r0", [5], time.monotonic() + 0.01)
        pair.until(lambda: "r0" in pair.released)
        pair.sender.hold("r0", [5], time.monotonic() + 10)  # just released: ignored
        _held(pair, "r1", [1, 2])
        pair.sender.hold("r1", [3], time.monotonic() + 10)  # held: ignored
        _held(pair, "r2", [4])
        out = pair.load("r2", [4], [6])
        assert out.end is LoadEnd.LOADED and gate.is_set()
        # r0's read may have been cancelled before it began: it expired at once
        assert reads in ([[5], [1, 2], [4]], [[1, 2], [4]])
        assert set(pair.sender._sums) == {"r1"}  # nothing kept for a hold not taken
    finally:
        pair.close()


def test_a_read_still_queued_is_cancelled_and_nobody_waits_for_the_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many holds at once queue their reads. A push whose hold's read has
    not begun reads its blocks itself, and that hold is released without
    waiting for the reads ahead of it: its own read never runs."""
    gate = threading.Event()
    reads: list[list[int]] = []

    class Gated(BlockSums):
        def __init__(self, cache: KVCache, blocks: list[int]) -> None:
            reads.append(list(blocks))
            assert gate.wait(10), "never let go"
            super().__init__(cache, blocks)

    monkeypatch.setattr(prefill_pushes, "BlockSums", Gated)
    pair = Pair()
    tried: list[object] = []
    real = integrity.region_digest

    def read(cache: KVCache, *args: Any) -> bytes:
        if cache is pair.src:
            tried.append(args)
        return real(cache, *args)

    monkeypatch.setattr(integrity, "region_digest", read)
    try:
        _held(pair, "r1", [1, 2])  # its read blocks the reader
        out = pair.load("r2", [3, 4], [9, 4])  # r2's read waits behind it
        assert (out.end, out.detail, out.fenced) == (LoadEnd.LOADED, "", False)
        assert "r2" in pair.released and "r1" not in pair.released
        assert reads == [[1, 2]] and pair.sender._sums.keys() == {"r1"}
        assert tried == [([3, 4], None)]  # read at push time, as without early reads
        gate.set()
        out = pair.load("r1", [1, 2], [5, 6])  # now read early: weighed
        assert out.end is LoadEnd.LOADED and reads == [[1, 2]]
        assert tried == [([3, 4], None)]
    finally:
        gate.set()
        pair.close()
