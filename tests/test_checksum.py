"""transfer.checksum: the digest both sides of a load compute, pinned and attacked.

A pure-Python reference (ints, no torch) pins the definition, so a change to
the torch code that changes any digest fails here, whatever device runs it.
Then each corruption a transfer can leave (a flipped byte anywhere, a stale,
swapped or half-written block) must change the digest, and the same bytes
must give the same digest whatever the blocks' ids, sizes or strides.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import KVLayout
from transfer.cache import KVCache
from transfer.checksum import DIGEST_BYTES, region_digest

MASK = (1 << 64) - 1
SEEDS = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)


def splitmix(index: int, seed: int) -> int:
    z = (index * 0x9E3779B97F4A7C15 + seed) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) | 1


def reference(rows: list[bytes]) -> bytes:
    """The module docstring's definition over ``rows``, in plain Python."""
    length = len(rows[0])
    word = 4 if length % 4 == 0 else 1
    words = length // word
    parts = next(n for n in (16, 8, 4, 2, 1) if words % n == 0)
    per = words // parts
    fmt = f"<{words}i" if word == 4 else f"<{words}B"
    sums = []
    for row in rows:
        vals = struct.unpack(fmt, row)
        sums += [sum(vals[p * per : (p + 1) * per]) % (1 << 32) for p in range(parts)]
    out = []
    for seed in SEEDS:
        acc = sum(v * splitmix(k, seed) for k, v in enumerate(sums)) & MASK
        out.append(acc.to_bytes(8, "little"))
    return b"".join(out)


def cache_of(num_blocks: int, block_bytes: int, layers: int = 2, seed: int = 1) -> KVCache:
    layout = KVLayout(num_layers=layers, num_blocks=num_blocks, block_bytes=block_bytes)
    cache = KVCache(layout)
    cache.fill_seeded(seed)
    return cache


def rows_of(cache: KVCache, blocks: list[int], part: tuple[int, int] | None = None) -> list[bytes]:
    off, n = part or (0, cache.layout.block_bytes)
    return [
        bytes(cache.rows(b)[blk, off : off + n].tolist())
        for b in range(cache.layout.num_buffers)
        for blk in blocks
    ]


@pytest.mark.parametrize("block_bytes", [64, 256, 96, 40, 12, 6, 7])
@pytest.mark.parametrize("part", [None, "head", "tail"])
def test_the_digest_is_the_reference_definition(block_bytes: int, part: str | None) -> None:
    cache = cache_of(9, block_bytes)
    cut = {None: None, "head": (0, block_bytes // 2), "tail": (block_bytes // 3, block_bytes // 2)}[
        part
    ]
    blocks = [4, 0, 8, 3]
    got = region_digest(cache, blocks, cut)
    assert len(got) == DIGEST_BYTES
    assert got == reference(rows_of(cache, blocks, cut))


def test_one_known_digest_is_pinned() -> None:
    """Both sides of a deployment may run different builds: the definition
    itself must not drift. Bytes 0..255 in one block of one layer's K, their
    complement in its V: 64 words in 16 runs of 4."""
    layout = KVLayout(num_layers=1, num_blocks=1, block_bytes=256)
    cache = KVCache(layout)
    cache.rows(0)[0] = torch.arange(256, dtype=torch.uint8)
    cache.rows(1)[0] = 255 - torch.arange(256, dtype=torch.uint8)
    assert region_digest(cache, [0]).hex() == reference(rows_of(cache, [0])).hex()
    assert region_digest(cache, [0]).hex() == PINNED


PINNED = "28e248854adeb47900faaaea299f4e84"


def test_the_same_bytes_digest_alike_whatever_holds_them() -> None:
    """Prefill and decode: other block ids, other cache sizes, whole blocks on
    one side and a slice of larger blocks on the other (tensor parallel legs)."""
    src = cache_of(6, 64, seed=3)
    dst = cache_of(20, 128, seed=4)
    src_ids, dst_ids = [5, 1, 2], [17, 0, 9]
    for b in range(src.layout.num_buffers):
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst.rows(b)[d, 32:96] = src.rows(b)[s]
    assert region_digest(dst, dst_ids, (32, 64)) == region_digest(src, src_ids)
    assert region_digest(dst, dst_ids, (0, 64)) != region_digest(src, src_ids)


def test_a_strided_cache_digests_like_a_dense_one() -> None:
    """``KVCache.over``: blocks that are not dense pages (kernel blocks, padding)."""
    dense = cache_of(5, 64, layers=1, seed=7)
    store = [torch.full((5 * 96,), 0xAB, dtype=torch.uint8) for _ in range(2)]  # padded pages
    layout = KVLayout(num_layers=1, num_blocks=5, block_bytes=64, block_stride=96)
    strided = KVCache.over(layout, store, [t.data_ptr() for t in store])
    for b in range(layout.num_buffers):
        strided.rows(b).copy_(dense.rows(b))
    assert region_digest(strided, [4, 2, 0]) == region_digest(dense, [4, 2, 0])


def one_allocation(
    layers: int, num_blocks: int, block_bytes: int, gaps: list[int], stride: int = 0, start: int = 0
) -> KVCache:
    """A cache whose buffers lie in one allocation, ``gaps[i]`` bytes after
    buffer ``i`` (vLLM's layers: one tensor, a constant layer stride), the
    first ``start`` bytes in; every byte of the allocation seeded."""
    layout = KVLayout(layers, num_blocks, block_bytes, block_stride=stride)
    size = start + layout.num_buffers * layout.buffer_bytes + sum(gaps)
    store = torch.empty(size, dtype=torch.uint8)
    store.random_(0, 256, generator=torch.Generator().manual_seed(size))
    bases, at = [], store.data_ptr() + start
    for i in range(layout.num_buffers):
        bases.append(at)
        at += layout.buffer_bytes + (gaps[i] if i < len(gaps) else 0)
    return KVCache.over(layout, [store], bases)


@settings(max_examples=150, deadline=None)
@given(
    layers=st.integers(1, 4),
    block_bytes=st.sampled_from([64, 96, 12, 7, 40]),
    pad=st.sampled_from([0, 4, 3]),
    start=st.integers(0, 5),
    spacing=st.lists(st.sampled_from([0, 0, 0, 8, 5]), min_size=7, max_size=7),
    blocks=st.lists(st.integers(0, 23), min_size=1, max_size=14),
    part=st.sampled_from([None, "head", "tail", "off a word"]),
    rows_at_once=st.sampled_from([None, 1, 5]),
)
def test_buffers_in_one_allocation_digest_as_the_reference(
    layers: int,
    block_bytes: int,
    pad: int,
    start: int,
    spacing: list[int],
    blocks: list[int],
    part: str | None,
    rows_at_once: int | None,
) -> None:
    """Buffers equally far apart are read as one group; a different gap
    starts another; bases and strides off a 4-byte boundary are copied to
    be read as words. More than 8 runs are gathered, ``rows_at_once`` rows
    a chunk. The digest is the reference whatever the grouping."""
    import transfer.checksum as checksum

    stride = block_bytes + pad if pad else 0
    cache = one_allocation(layers, 24, block_bytes, spacing[: 2 * layers - 1], stride, start)
    cut = {
        None: None,
        "head": (0, block_bytes // 2),
        "tail": (block_bytes // 3, block_bytes // 2),
        "off a word": (2, block_bytes // 4 * 4 - 4) if block_bytes >= 8 else (1, 4),
    }
    with pytest.MonkeyPatch.context() as mp:
        if rows_at_once is not None:
            mp.setattr(checksum, "_CHUNK_BYTES", rows_at_once * block_bytes * 2 * layers)
        got = region_digest(cache, blocks, cut[part])
    assert got == reference(rows_of(cache, blocks, cut[part]))
    groups = cache.groups()
    assert sum(len(g) for g in groups) == cache.layout.num_buffers
    gaps = spacing[: 2 * layers - 1]
    if len(set(gaps)) <= 1:  # equally far apart: one group
        assert len(groups) == 1, gaps
    firsts = [g[i] for g in groups for i in range(len(g))]  # every buffer once, in order
    for b, rows in enumerate(firsts):
        assert torch.equal(rows, cache.rows(b))


def test_two_storages_at_one_address_are_not_one_group() -> None:
    """Two wrappers of one buffer, of different sizes: a group over the
    smaller would reach past its storage."""
    size = KVLayout(1, 4, 64).buffer_bytes
    memory = bytearray(2 * size)
    small = torch.frombuffer(memory, dtype=torch.uint8, count=size)
    large = torch.frombuffer(memory, dtype=torch.uint8, count=2 * size)
    cache = KVCache(KVLayout(1, 4, 64), tensors=[small, large[size:]])
    cache.fill_seeded(3)
    assert [len(g) for g in cache.groups()] == [1, 1]
    assert region_digest(cache, [2, 0]) == reference(rows_of(cache, [2, 0]))


def test_separate_allocations_are_a_group_each() -> None:
    cache = cache_of(4, 64, layers=3)
    assert [len(g) for g in cache.groups()] == [1] * 6
    assert [len(g) for g in one_allocation(2, 4, 64, [0, 8, 0]).groups()] == [2, 2]
    assert [len(g) for g in one_allocation(3, 4, 64, [0, 0, 8, 8, 8]).groups()] == [3, 3]
    assert region_digest(cache, [3, 1]) == reference(rows_of(cache, [3, 1]))


def test_torch_calls_do_not_grow_with_the_buffers_in_one_allocation() -> None:
    """Each torch call releases the GIL and must take it back: beside a busy
    thread (vLLM's worker between steps) that is up to 5 ms a call. A digest
    of vLLM's layers, one allocation, costs the same calls for 2 buffers as
    for 64, and a gather the same calls for 2 as for 64 buffers too."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    def calls(layers: int, blocks: list[int]) -> int:
        cache = one_allocation(layers, 40, 256, [0] * (2 * layers))
        region_digest(cache, blocks, (64, 128))  # the weight table made
        Count.calls = 0
        with Count():
            got = region_digest(cache, blocks, (64, 128))
        assert got == reference(rows_of(cache, blocks, (64, 128)))
        return Count.calls

    runs = [*range(2, 9), 20, *range(30, 34)]  # two runs: sliced
    scattered = list(range(0, 40, 3))  # 14 runs of one: gathered
    assert calls(1, runs) == calls(32, runs)
    assert calls(1, scattered) == calls(32, scattered)
    # The per-buffer loop made 94 here (1,706 for 32 layers); weights made
    # per digest, 55; from their table, with views for reshapes, 38.
    assert calls(1, runs) <= 38


def test_weights_come_from_a_table_that_equals_fresh_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's weights are a prefix of a table kept per device: the same
    values as made fresh, at every size the table grows through and past it."""
    from transfer import checksum

    monkeypatch.setattr(checksum, "_tables", {})
    monkeypatch.setattr(checksum, "_TABLE_MAX", 4096)
    cpu = torch.device("cpu")
    for count in (1, 3, 1024, 1025, 5, 2048, 4095, 4096, 4097, 10_000, 7):
        got = checksum._weights(count, cpu)
        assert torch.equal(got, checksum._fresh_weights(count, cpu)), count
    assert checksum._tables[cpu].shape == (2, 4096)  # never past its bound
    assert checksum._weights(9, cpu).data_ptr() == checksum._tables[cpu].data_ptr()
    table = checksum._weights(1500, cpu).tolist()  # the reference's weights, both seeds
    for row, seed in zip(table, checksum._SEEDS, strict=True):
        assert [v % (1 << 64) for v in row] == [splitmix(k, seed) for k in range(1500)]


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    buffer=st.integers(0, 3),
    where=st.integers(0, 10**9),
    flip=st.integers(1, 255),
)
def test_any_flipped_byte_changes_both_halves(
    blocks: list[int], buffer: int, where: int, flip: int
) -> None:
    cache = cache_of(8, 96)
    before = region_digest(cache, blocks)
    blk = blocks[where % len(blocks)]
    pos = where % 96
    row = cache.rows(buffer)
    row[blk, pos] = int(row[blk, pos]) ^ flip
    after = region_digest(cache, blocks)
    assert before[:8] != after[:8] and before[8:] != after[8:]


def test_a_stale_a_swapped_and_a_half_written_block_are_caught() -> None:
    cache = cache_of(8, 256)
    blocks = [1, 2, 3, 4]
    good = region_digest(cache, blocks)
    assert region_digest(cache, [1, 3, 2, 4]) != good  # swapped
    keep = cache.rows(0)[2].clone()
    cache.rows(0)[2] = cache.rows(0)[6]  # stale: another block's bytes
    assert region_digest(cache, blocks) != good
    cache.rows(0)[2] = keep
    assert region_digest(cache, blocks) == good
    cache.rows(1)[3, 128:] = 0  # half written
    assert region_digest(cache, blocks) != good


def test_runs_of_neighbours_are_sliced_and_scattered_blocks_gathered_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transfer.checksum as checksum

    cache = cache_of(64, 128)
    blocks = [*range(10, 20), *range(40, 44), 3]  # three runs: sliced
    sliced = region_digest(cache, blocks, (32, 64))
    monkeypatch.setattr(checksum, "_MAX_RUNS", 0)  # every load gathered
    assert region_digest(cache, blocks, (32, 64)) == sliced
    assert sliced == reference(rows_of(cache, blocks, (32, 64)))


def test_on_a_host_long_scattered_runs_are_summed_in_place_and_short_ones_gathered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gather copies every byte (8x the sum's cost on a host): runs of
    16 KiB or more are summed where they lie, however many; short ones are
    gathered, and the digest is the same either way."""
    cache = cache_of(40, 16 << 10)
    blocks = [37, *range(1, 40, 4), 2]  # 12 runs of one 16 KiB block: more than 8
    want = reference(rows_of(cache, blocks))
    gather = torch.Tensor.index_select

    def no_gather(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("gathered")

    monkeypatch.setattr(torch.Tensor, "index_select", no_gather)
    assert region_digest(cache, blocks) == want  # 16 KiB runs: never copied
    short = (0, (16 << 10) - 4)  # just below: the gather
    with pytest.raises(AssertionError, match="gathered"):
        region_digest(cache, blocks, short)
    monkeypatch.setattr(torch.Tensor, "index_select", gather)
    assert region_digest(cache, blocks, short) == reference(rows_of(cache, blocks, short))


def test_a_load_of_many_blocks_is_digested_in_chunks_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.checksum as checksum

    cache = cache_of(64, 128)
    blocks = list(range(63, -1, -2))
    whole = region_digest(cache, blocks)
    monkeypatch.setattr(checksum, "_CHUNK_BYTES", 3 * 128)  # 3 rows per gather
    assert region_digest(cache, blocks) == whole == reference(rows_of(cache, blocks))


@pytest.mark.parametrize(
    ("blocks", "part", "message"),
    [
        ([0, 8], None, r"blocks\[1\] = 8 out of range \[0, 8\)"),
        ([True], None, r"blocks\[0\] = True out of range"),
        ([-1], None, r"blocks\[0\] = -1 out of range"),
        ([0], (60, 8), r"part \(60, 8\) is not inside a block of 64 bytes"),
        ([0], (0, 0), r"part \(0, 0\) is not inside"),
        ([0], (-4, 8), r"part \(-4, 8\) is not inside"),
    ],
)
def test_bad_blocks_and_parts_are_named(
    blocks: list[int], part: tuple[int, int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        region_digest(cache_of(8, 64), blocks, part)


def test_no_blocks_digest_to_zero() -> None:
    assert region_digest(cache_of(4, 64), []) == bytes(DIGEST_BYTES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_cache_digests_on_the_device_like_the_host() -> None:
    host = cache_of(16, 256)
    dev = KVCache(host.layout, device="cuda")
    for b in range(host.layout.num_buffers):
        dev.rows(b).copy_(host.rows(b))
    blocks = [15, 0, 7, 3]
    assert region_digest(dev, blocks, (64, 128)) == region_digest(host, blocks, (64, 128))
