"""The run's verifier: batched, exact verdicts, blocks freed exactly once after them."""

from __future__ import annotations

import threading

from kvguard.run.verify import SourceDigests, Verifier
from transfer import KVCache, KVLayout
from transfer.peer_protocol import block_digest_bytes

LAYOUT = KVLayout(2, 16, 256)


class _Decode:
    def __init__(self, cache: KVCache) -> None:
        self.cache, self.calls, self.answer = cache, 0, True

    def digests(self, blocks: list[int]) -> bytes | None:
        self.calls += 1
        return block_digest_bytes(self.cache, blocks) if self.answer else None


def _setup() -> tuple[KVCache, KVCache, list[list[int]], threading.Event]:
    src, dst = KVCache(LAYOUT), KVCache(LAYOUT)
    src.fill_seeded(1)
    return src, dst, [], threading.Event()


def test_intact_corrupt_and_unanswered_are_told_apart() -> None:
    src, dst, freed, stopped = _setup()
    for s, d in ((0, 3), (1, 4)):  # copy two blocks exactly
        for t_src, t_dst in zip(src.tensors, dst.tensors, strict=True):
            t_dst.view(16, 256)[d] = t_src.view(16, 256)[s]
    decode = _Decode(dst)
    v = Verifier(decode, SourceDigests(src), freed.append, stopped)
    v.put([0], [3])
    v.put([1], [5])  # block 5 was never written: corrupt
    assert v.close(timeout=10)
    assert (v.tally.intact, v.tally.corrupt) == (1, 1)
    assert sorted(freed) == [[3], [5]]


def test_unanswered_counts_against_the_run_unless_it_stopped_the_decode() -> None:
    src, dst, freed, stopped = _setup()
    decode = _Decode(dst)
    decode.answer = False
    v = Verifier(decode, SourceDigests(src), freed.append, stopped, retry_for_s=0.3)
    v.put([0, 1], [0, 1])
    assert v.close(timeout=10)
    assert (v.tally.unverified_alive, v.tally.unverified) == (1, 0)
    stopped.set()
    v2 = Verifier(decode, SourceDigests(src), freed.append, stopped)
    v2.put([2], [2])
    assert v2.close(timeout=10)
    assert (v2.tally.unverified_alive, v2.tally.unverified) == (0, 1)
    assert freed == [[0, 1], [2]]  # freed whatever the verdict, exactly once


def test_queued_requests_share_one_round_trip() -> None:
    src, dst, freed, stopped = _setup()
    decode = _Decode(dst)
    gate = threading.Event()
    real = decode.digests

    def slow(blocks: list[int]) -> bytes | None:
        gate.wait(10)  # hold the first batch until the rest is queued
        return real(blocks)

    decode.digests = slow  # type: ignore[method-assign]
    v = Verifier(decode, SourceDigests(src), freed.append, stopped)
    for i in range(10):
        v.put([i], [i])
    gate.set()
    assert v.close(timeout=10)
    assert decode.calls <= 2  # the first request alone, then the other nine together
    assert len(freed) == 10


def test_a_raising_decode_neither_leaks_blocks_nor_passes() -> None:
    src, _dst, freed, stopped = _setup()

    class Broken:
        def digests(self, blocks: list[int]) -> bytes | None:
            raise RuntimeError("bug")

    v = Verifier(Broken(), SourceDigests(src), freed.append, stopped)
    v.put([0], [0])
    assert v.close(timeout=10)
    assert (v.tally.intact, v.tally.unverified_alive) == (0, 1)
    assert freed == [[0]]


def test_an_unreachable_decode_is_asked_again_until_it_answers() -> None:
    src, dst, freed, stopped = _setup()
    for t_src, t_dst in zip(src.tensors, dst.tensors, strict=True):
        t_dst.copy_(t_src)
    decode = _Decode(dst)
    decode.answer = False  # a cut link

    def heal() -> None:
        decode.answer = True

    timer = threading.Timer(0.3, heal)
    timer.start()
    v = Verifier(decode, SourceDigests(src), freed.append, stopped, retry_for_s=30)
    v.put([0], [0])
    assert v.close(timeout=10)
    timer.join()
    assert (v.tally.intact, v.tally.unverified_alive) == (1, 0)
    assert decode.calls >= 2
