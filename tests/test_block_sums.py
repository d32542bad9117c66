"""``BlockSums``: a hold's whole blocks read once, digested for any of them later.

The prefill reads a hold's blocks as the hold begins and weighs those sums
when a decode asks for some of them (``kvguard.vllm.integrity``). That is
sound only if it equals reading the asked blocks then: the same digest as
``region_digest`` for any subset, in any order, whatever the buffers'
placement, and no digest at all for a block it never read.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_checksum import cache_of, one_allocation, reference, rows_of
from transfer import KVCache
from transfer.checksum import DIGEST_BYTES, BlockSums, region_digest


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 3),
    block_bytes=st.sampled_from([64, 96, 12, 7, 40]),
    gaps=st.lists(st.sampled_from([0, 0, 8, 5]), min_size=5, max_size=5),
    start=st.integers(0, 3),
    held=st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True),
    data=st.data(),
)
def test_any_asked_blocks_digest_as_if_read_when_asked(
    layers: int,
    block_bytes: int,
    gaps: list[int],
    start: int,
    held: list[int],
    data: st.DataObject,
) -> None:
    """A decode may ask for a suffix (it has the rest cached), all of them,
    or any of them in another order: each digest is ``region_digest``'s."""
    cache = one_allocation(layers, 16, block_bytes, gaps, start=start)
    sums = BlockSums(cache, held)
    asked = data.draw(
        st.one_of(
            st.integers(0, len(held)).map(lambda k: held[k:]),  # a suffix: one run
            st.permutations(held).flatmap(lambda p: st.integers(0, len(p)).map(lambda k: p[:k])),
            st.lists(st.sampled_from(held), max_size=8),  # any, repeated
        )
    )
    assert sums.digest(asked) == region_digest(cache, asked)
    if asked:  # (the reference needs a row)
        assert sums.digest(asked) == reference(rows_of(cache, asked))


def test_sums_are_read_once_and_later_writes_do_not_reach_them() -> None:
    """What makes holding the blocks the caller's duty: the digest is of the
    bytes as they were read, so a block written afterwards is not seen."""
    cache = cache_of(8, 64)
    sums = BlockSums(cache, [2, 3, 5])
    before = region_digest(cache, [3, 5])
    cache.rows(0)[3, 0] = int(cache.rows(0)[3, 0]) ^ 1
    assert sums.digest([3, 5]) == before != region_digest(cache, [3, 5])


def test_a_block_not_read_is_named_and_no_digest_is_made() -> None:
    sums = BlockSums(cache_of(8, 64), [1, 2])
    assert 2 in sums and 3 not in sums and "2" not in sums
    with pytest.raises(KeyError, match="block 3 is not among the blocks summed"):
        sums.digest([1, 3])
    assert sums.digest([]) == bytes(DIGEST_BYTES) == region_digest(cache_of(8, 64), [])


def test_a_repeated_held_block_is_read_at_its_first_place() -> None:
    cache = cache_of(8, 64)
    sums = BlockSums(cache, [4, 6, 4])
    assert sums.digest([6, 4]) == region_digest(cache, [6, 4])
    assert sums.digest([4, 6, 4]) == region_digest(cache, [4, 6, 4])


def test_bad_held_blocks_are_named_as_the_digest_names_them() -> None:
    with pytest.raises(ValueError, match=r"blocks\[1\] = 8 out of range \[0, 8\)"):
        BlockSums(cache_of(8, 64), [0, 8])
    with pytest.raises(ValueError, match=r"blocks\[0\] = True out of range"):
        BlockSums(cache_of(8, 64), [True])  # type: ignore[list-item]


def test_the_sums_stay_on_the_caches_device() -> None:
    cache = cache_of(8, 64)
    assert BlockSums(cache, [1]).device == cache.device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_hold_is_summed_and_weighed_on_the_device() -> None:
    """The weights, the gather of scattered rows and the sums are device
    tensors; only the 16-byte digest reaches the host."""
    host = cache_of(16, 256)
    dev = KVCache(host.layout, device="cuda")
    for b in range(host.layout.num_buffers):
        dev.rows(b).copy_(host.rows(b))
    sums = BlockSums(dev, [15, 0, 7, 3, 4])
    for asked in ([7, 3, 4], [4, 15], [15, 0, 7, 3, 4]):
        assert sums.digest(asked) == region_digest(host, asked)
