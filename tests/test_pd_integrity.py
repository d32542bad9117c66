"""Loaded KV verified end to end (``kvguard.vllm.integrity``), without vLLM.

PrefillSender and DecodeReceiver over real ZeroMQ on loopback, bytes moved by
an in-process backend that reports success and then leaves the decode's
blocks wrong, as a transfer that "succeeded" can: a flipped byte, a stale
block (the bytes it held before), a half-written block. Each must fail its
load with ``integrity``, unfenced (the prefill released it: nothing writes
the blocks), and the prefill must still count its own part done. With
verification off the same corruption is reported loaded: the check is what
catches it. Tensor parallel legs digest only their slice of each block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

import kvguard.vllm.prefill_pushes as prefill_pushes
from kvguard.vllm.integrity import Verifier
from kvguard.vllm.protocol import Result
from kvguard.vllm.ranks import RankHeads
from kvguard.vllm.states import LoadEnd
from tests.pd_pair import SRC_LAYOUT, Corrupt, Pair, flip, half, stale
from transfer import KVCache, KVLayout
from transfer.checksum import DIGEST_BYTES, region_digest


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_verified_load_lands_and_leaves_no_cover_behind(pair: Pair) -> None:
    out = pair.load("r1", [1, 2, 3], [9, 4, 11])
    assert (out.end, out.detail, out.fenced) == (LoadEnd.LOADED, "", False)
    assert pair.dst.blocks_equal(pair.src, [9, 4, 11], [1, 2, 3]) == []
    assert pair.verifier is not None and pair.verifier.pending() == 0


@pytest.mark.parametrize("corrupt", [flip, stale, half], ids=["flip", "stale", "half"])
def test_bytes_garbled_after_a_successful_transfer_fail_the_load(
    pair: Pair, corrupt: Corrupt
) -> None:
    dst = [9, 4, 11]
    pair.backend.garble = (pair.dst, dst, corrupt)
    out = pair.load("r1", [1, 2, 3], dst)
    mine = region_digest(pair.dst, dst).hex()
    theirs = region_digest(pair.src, [1, 2, 3]).hex()
    assert out.end is LoadEnd.INTEGRITY and out.reason == "integrity"
    assert out.detail == f"digest {theirs} from the prefill, {mine} here"
    assert not out.fenced  # the prefill's Result came: nothing writes the blocks
    stats = pair.sender.stats  # the prefill did its part: the check is the decode's
    assert (stats.done, stats.failed) == (1, 0)
    assert pair.verifier is not None and pair.verifier.pending() == 0


def test_with_verification_off_the_same_garbling_is_reported_loaded() -> None:
    """The negative control: without the check, the wrong bytes pass as loaded."""
    p = Pair(verify=False)
    try:
        p.backend.garble = (p.dst, [9, 4, 11], flip)
        out = p.load("r1", [1, 2, 3], [9, 4, 11])
        assert out.end is LoadEnd.LOADED
        assert p.src.blocks_equal(p.dst, [1, 2, 3], [9, 4, 11]) == [4]
    finally:
        p.close()


def test_a_prefill_that_sends_no_digest_fails_the_load(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefill_pushes, "source_digest", lambda *_: b"")
    out = pair.load("r1", [1, 2], [5, 6])
    assert (out.end, out.detail, out.fenced) == (
        LoadEnd.INTEGRITY,
        "the prefill sent no digest",
        False,
    )


def test_a_hold_is_released_only_once_its_digest_read_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The digest reads the held source on its own thread, maybe after the
    transfer ended: vLLM must not hear the blocks are free (and write them)
    before it finished. The digest here starts only after the sender turned
    the transfer's end into a release, then looks for that release for 40 of
    the sender's turns (it is published in the next one when nothing waits)."""
    seen: list[bool] = []
    ended = threading.Event()
    real_digest = prefill_pushes.source_digest

    def late_digest(*args: object) -> bytes:
        assert ended.wait(10), "the transfer never ended"
        released = False
        until = time.monotonic() + 0.2
        while not released and time.monotonic() < until:
            with pair.sender._lock:
                released = "r1" in pair.sender._released
            time.sleep(0.001)
        seen.append(released)
        return real_digest(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill_pushes, "source_digest", late_digest)
    real_released = prefill_pushes.PrefillCore.released

    def released(core: prefill_pushes.PrefillCore, *args: object) -> object:
        try:
            return real_released(core, *args)  # type: ignore[arg-type]
        finally:
            ended.set()

    monkeypatch.setattr(prefill_pushes.PrefillCore, "released", released)
    pair = Pair()
    try:
        out = pair.load("r1", [1, 2, 3], [9, 4, 11])
        assert (out.end, out.detail) == (LoadEnd.LOADED, "")
        assert seen == [False]  # not released while the digest read the blocks
    finally:
        pair.close()


def test_a_tensor_parallel_leg_digests_only_its_heads() -> None:
    """A prefill of TP 1 (2 KV heads) and decode rank 1 of TP 2: the prefill
    writes its second head, the second half of each of its blocks, into the
    whole of the decode's smaller blocks; both digest exactly those bytes."""
    half_layout = KVLayout(num_layers=2, num_blocks=16, block_bytes=128)
    p = Pair(dst_layout=half_layout, prefill_heads=RankHeads(0, 1, 2), decode_heads=(1, 1))
    try:
        out = p.load("r1", [1, 2, 3], [9, 4, 11], part=(0, 128))
        assert (out.end, out.detail) == (LoadEnd.LOADED, "")
        for b in range(SRC_LAYOUT.num_buffers):
            assert bool((p.dst.rows(b)[[9, 4, 11]] == p.src.rows(b)[[1, 2, 3], 128:]).all())
        # The wrong part on this side (a bug in the head math) is caught.
        out = p.load("r2", [5, 6], [7, 8], part=(0, 64))
        assert out.end is LoadEnd.INTEGRITY, out
    finally:
        p.close()


# -- the verifier alone --------------------------------------------------------


def _cache() -> KVCache:
    cache = KVCache(SRC_LAYOUT)
    cache.fill_seeded(3)
    return cache


def test_the_verifier_passes_what_it_does_not_cover_and_failures_unchanged() -> None:
    cache = _cache()
    v = Verifier(cache)
    good = region_digest(cache, [1, 2])
    v.expect("a", [1, 2], None)
    v.expect("a", [3], None)  # an id still loading keeps its first cover
    assert v.cover("a") == ([1, 2], None)
    ok = Result("r", "a", True, digest=good)
    assert v.checked(ok) is ok
    failed = Result("r", "a", False, "timeout", "late")
    assert v.checked(failed) is failed
    other = Result("r", "b", True)  # not expected here: the core decides
    assert v.checked(other) is other
    v.done("a")
    assert v.cover("a") is None and v.pending() == 0
    assert v.checked(Result("r", "a", True)) == Result("r", "a", True)


def test_the_verifier_fails_a_wrong_or_missing_digest_naming_both() -> None:
    cache = _cache()
    v = Verifier(cache)
    v.expect("a", [1, 2], (16, 32))
    mine = region_digest(cache, [1, 2], (16, 32))
    wrong = bytes(DIGEST_BYTES)
    got = v.checked(Result("r", "a", True, digest=wrong))
    assert got == Result(
        "r",
        "a",
        False,
        "integrity",
        f"digest {wrong.hex()} from the prefill, {mine.hex()} here",
        wrong,
    )
    assert v.checked(Result("r", "a", True)) == Result(
        "r", "a", False, "integrity", "the prefill sent no digest"
    )


def test_the_verifier_names_blocks_it_cannot_digest() -> None:
    v = Verifier(_cache())
    v.expect("a", [99], None)
    got = v.checked(Result("r", "a", True, digest=bytes(DIGEST_BYTES)))
    assert (got.ok, got.reason) == (False, "integrity")
    assert got.detail == "cannot digest the blocks here: blocks[0] = 99 out of range [0, 16)"


def test_a_digest_that_raises_fails_the_load_instead_of_losing_its_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device error while reading the blocks: the Result still reaches the
    core, failed with ``integrity`` and why, not dropped until a deadline."""
    import kvguard.vllm.integrity as integrity

    def broken(*_: object) -> bytes:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(integrity, "region_digest", broken)
    v = Verifier(_cache())
    v.expect("a", [1], None)
    got = v.checked(Result("r", "a", True, digest=bytes(DIGEST_BYTES)))
    assert got == Result(
        "r",
        "a",
        False,
        "integrity",
        "cannot digest the blocks here: CUDA error: an illegal memory access",
        bytes(DIGEST_BYTES),
    )


@pytest.mark.usefixtures("all_levels")
def test_a_digest_the_prefill_cannot_make_is_empty_and_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode then fails the load ("the prefill sent no digest"): never a
    crash of the sender's thread, never a digest of other bytes."""
    import kvguard.vllm.integrity as integrity
    from transfer.plan import BlockSlice

    def broken(cache: KVCache, blocks: list[int], part: tuple[int, int] | None) -> bytes:
        raise RuntimeError(f"blocks {blocks} part {part}")

    monkeypatch.setattr(integrity, "region_digest", broken)
    with capture_logs() as logs:
        got = integrity.source_digest(_cache(), [3, 4], BlockSlice(64, 0, 128))
    assert got == b""
    assert logs == [
        {
            "event": "digest_failed",
            "blocks": 2,
            "part": (64, 128),
            "error": "blocks [3, 4] part (64, 128)",
            "log_level": "error",
        }
    ]
    assert integrity.source_digest(_cache(), [3], None) == b""


@pytest.mark.usefixtures("all_levels")
def test_a_mismatch_is_logged_once_naming_the_load_and_why() -> None:
    cache = _cache()
    v = Verifier(cache)
    v.expect("a", [1], None)
    v.expect("b", [99], None)
    with capture_logs() as logs:
        v.checked(Result("r", "a", True))
        got = v.checked(Result("r", "b", True, digest=bytes(DIGEST_BYTES)))
    assert got.digest == bytes(DIGEST_BYTES)  # the prefill's, kept for the record
    assert logs == [
        {
            "event": "kv_integrity_mismatch",
            "request": "a",
            "detail": "the prefill sent no digest",
            "log_level": "warning",
        },
        {
            "event": "kv_integrity_mismatch",
            "request": "b",
            "detail": "cannot digest the blocks here: blocks[0] = 99 out of range [0, 16)",
            "log_level": "warning",
        },
    ]
    v.done("a")
    v.done("never")  # an id it does not cover: nothing
    assert v.pending() == 1
