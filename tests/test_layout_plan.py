"""KVLayout, KVCache and build_plan: validation, coalescing, exact coverage."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transfer import (
    DEFAULT_MAX_BATCH_ENTRIES,
    MAX_BATCH_ENTRIES_LIMIT,
    BlockSlice,
    InvalidPlan,
    KVCache,
    KVLayout,
    PeerInfo,
    Region,
    RemoteRangeRejected,
    TransferPlan,
    build_plan,
    plan_entries_naive,
)

# -- KVLayout -------------------------------------------------------------------


def test_layout_geometry() -> None:
    split = KVLayout(num_layers=3, num_blocks=10, block_bytes=16)
    assert (split.buffers_per_layer, split.num_buffers) == (2, 6)
    assert split.buffer_bytes == 160
    assert split.total_bytes == 960
    mla = KVLayout(3, 10, 16, kv_split=False)
    assert (mla.buffers_per_layer, mla.num_buffers, mla.total_bytes) == (1, 3, 480)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "block_bytes"])
@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4", None])
def test_layout_rejects_bad_ints(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"num_layers": 2, "num_blocks": 4, "block_bytes": 8}
    kwargs[field] = bad
    with pytest.raises(ValueError, match=rf"{field} must be a positive int, got {bad!r}"):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_layout_rejects_non_bool_kv_split() -> None:
    with pytest.raises(ValueError, match="kv_split must be a bool, got 1"):
        KVLayout(2, 4, 8, kv_split=1)  # type: ignore[arg-type]


def test_layout_dict_round_trip() -> None:
    layout = KVLayout(4, 100, 4096, kv_split=False)
    assert layout.to_dict() == {
        "num_layers": 4,
        "num_blocks": 100,
        "block_bytes": 4096,
        "kv_split": False,
    }
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert KVLayout.from_dict({"num_layers": 1, "num_blocks": 2, "block_bytes": 3}).kv_split


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            {"num_layers": 1, "num_blocks": 2, "block_bytes": 3, "extra": 1},
            r"unknown keys \['extra'\]",
        ),
        ({"num_layers": 1, "num_blocks": 2}, r"missing keys \['block_bytes'\]"),
        (
            {"num_layers": "1", "num_blocks": 2, "block_bytes": 3},
            "num_layers must be an int, got '1'",
        ),
        (
            {"num_layers": 1, "num_blocks": True, "block_bytes": 3},
            "num_blocks must be an int, got True",
        ),
        (
            {"num_layers": 1, "num_blocks": 2, "block_bytes": 0},
            "block_bytes must be a positive int, got 0",
        ),
        (
            {"num_layers": 1, "num_blocks": 2, "block_bytes": 3, "kv_split": "yes"},
            "kv_split must be a bool, got 'yes'",
        ),
        ([("num_layers", 1)], "must be a mapping, got list"),
    ],
)
def test_layout_from_dict_is_strict(message: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVLayout.from_dict(message)  # type: ignore[arg-type]


# -- KVCache --------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_bytes=32)


def test_cache_allocates_zeroed_contiguous_buffers() -> None:
    cache = KVCache(LAYOUT)
    assert len(cache.tensors) == LAYOUT.num_buffers
    assert cache.device == torch.device("cpu")
    for t, base, region in zip(cache.tensors, cache.buffer_bases(), cache.regions(), strict=True):
        assert t.dtype == torch.uint8 and t.numel() == LAYOUT.buffer_bytes
        assert not t.any()
        assert region == Region(base, LAYOUT.buffer_bytes) and base == t.data_ptr()


def test_cache_wraps_any_dtype_as_bytes_without_copying() -> None:
    # 16 blocks x 32 bytes = 256 float16 values per buffer, shaped like a real cache.
    raw = [torch.zeros(16, 2, 8, dtype=torch.float16) for _ in range(LAYOUT.num_buffers)]
    cache = KVCache(LAYOUT, tensors=raw)
    assert cache.buffer_bases() == tuple(t.data_ptr() for t in raw)
    cache.block(3, 5).fill_(0xFF)
    assert raw[3][5].view(torch.uint8).eq(0xFF).all()
    assert not raw[3][4].any() and not raw[2].any()


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([torch.zeros(512, dtype=torch.uint8)] * 3, "needs 4 tensors"),
        (
            [torch.zeros(512, dtype=torch.uint8) for _ in range(3)]
            + [torch.zeros(1024, dtype=torch.uint8)[::2]],
            "buffer 3 is not contiguous",
        ),
        (
            [torch.zeros(512, dtype=torch.uint8) for _ in range(3)]
            + [torch.zeros(511, dtype=torch.uint8)],
            "buffer 3 holds 511 bytes, layout needs 512",
        ),
        ([torch.zeros(512, dtype=torch.uint8)] * 4, "buffers 0 and 1 overlap"),
        (
            [torch.zeros(512, dtype=torch.uint8) for _ in range(3)] + [[0] * 512],
            "not a tensor: list",
        ),
    ],
)
def test_cache_rejects_bad_tensors(tensors: list[torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVCache(LAYOUT, tensors=tensors)


def test_cache_rejects_device_mismatch() -> None:
    tensors = [torch.zeros(512, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(ValueError, match="tensors are on cpu, device=meta"):
        KVCache(LAYOUT, tensors=tensors, device="meta")
    tensors[2] = torch.zeros(512, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="buffer 2 is on meta"):
        KVCache(LAYOUT, tensors=tensors)


def test_block_addresses_and_views() -> None:
    cache = KVCache(LAYOUT)
    assert cache.block_addr(3, 5) == cache.buffer_bases()[3] + 5 * 32
    assert cache.block(3, 5).data_ptr() == cache.block_addr(3, 5)
    assert cache.block(3, 5).numel() == 32
    for buffer, block, match in [(4, 0, "buffer 4"), (0, 16, "block 16"), (-1, 0, "buffer -1")]:
        with pytest.raises(IndexError, match=match):
            cache.block_addr(buffer, block)
    with pytest.raises(IndexError, match="block True"):
        cache.block(0, True)


def test_fill_seeded_is_deterministic_and_seed_dependent() -> None:
    a, b, c = KVCache(LAYOUT), KVCache(LAYOUT), KVCache(LAYOUT)
    a.fill_seeded(7)
    b.fill_seeded(7)
    c.fill_seeded(8)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    assert not torch.equal(a.tensors[0], c.tensors[0])
    # Buffers get different bytes, so a block landing in the wrong buffer is caught.
    assert not torch.equal(a.tensors[0], a.tensors[1])


def test_fill_seeded_handles_odd_sizes_and_unaligned_tensors() -> None:
    layout = KVLayout(1, 3, 5)  # 15 bytes per buffer: not a multiple of 8
    backing = torch.zeros(64, dtype=torch.uint8)
    cache = KVCache(layout, tensors=[backing[1:16], backing[17:32]])  # offsets not 8-aligned
    cache.fill_seeded(1)
    assert backing[1:16].any() and backing[17:32].any()
    assert backing[0] == 0 and backing[16] == 0 and not backing[32:].any()


def test_blocks_equal_reports_differing_destination_blocks() -> None:
    src = KVCache(LAYOUT)
    src.fill_seeded(3)
    dst = KVCache(dataclasses.replace(LAYOUT, num_blocks=20))
    pairs = [(1, 10), (2, 11), (7, 19)]
    for buffer in range(LAYOUT.num_buffers):
        for s, d in pairs:
            dst.block(buffer, d).copy_(src.block(buffer, s))
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    assert src.blocks_equal(dst, srcs, dsts) == []
    dst.block(3, 19)[31] ^= 1  # one bit, in the last V buffer
    dst.block(0, 10)[0] ^= 1
    assert src.blocks_equal(dst, srcs, dsts) == [10, 19]
    assert src.blocks_equal(dst, [], []) == []


def test_blocks_equal_rejects_bad_arguments() -> None:
    a = KVCache(LAYOUT)
    with pytest.raises(ValueError, match="incompatible layouts"):
        a.blocks_equal(KVCache(dataclasses.replace(LAYOUT, block_bytes=16)), [0], [0])
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        a.blocks_equal(a, [0, 1], [0])
    with pytest.raises(ValueError, match="destination block 16 out of range"):
        a.blocks_equal(a, [0], [16])


def test_peer_info_advertises_buffers() -> None:
    cache = KVCache(LAYOUT)
    info = cache.peer_info("10.0.0.1:1234")
    assert info == PeerInfo("10.0.0.1:1234", cache.regions(), LAYOUT, cache.buffer_bases())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cache_on_cuda() -> None:
    src = KVCache(LAYOUT, device="cuda")
    src.fill_seeded(1)
    wrapped = KVCache(LAYOUT, tensors=[t.clone() for t in src.tensors])
    assert wrapped.device.type == "cuda"
    assert src.blocks_equal(wrapped, list(range(16)), list(range(16))) == []
    plan = build_plan(src, wrapped.peer_info("p"), [0, 1], [2, 3])
    assert plan.batches[0].src[0] == src.block_addr(0, 0)


# -- build_plan: validation ------------------------------------------------------


def _pair(src_blocks: int = 16, dst_blocks: int = 16, **kw: object) -> tuple[KVCache, PeerInfo]:
    src = KVCache(dataclasses.replace(LAYOUT, num_blocks=src_blocks, **kw))  # type: ignore[arg-type]
    dst = KVCache(dataclasses.replace(LAYOUT, num_blocks=dst_blocks, **kw))  # type: ignore[arg-type]
    return src, dst.peer_info("peer:1")


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "match"),
    [
        ([0, 1], [0], "2 source blocks but 1 destination blocks"),
        ([], [], "empty plan"),
        ([0, True], [0, 1], "source block True at index 1 is not an int"),
        ([0, 1], [0, 1.0], "destination block 1.0 at index 1 is not an int"),
        ([0, 16], [0, 1], r"source block 16 at index 1 out of range \[0, 16\)"),
        ([-1], [0], r"source block -1 at index 0 out of range"),
        ([0], [20], r"destination block 20 at index 0 out of range \[0, 20\)"),
        ([0, 1, 2], [5, 6, 5], r"destination block 5 is written twice \(indices 0 and 2\)"),
    ],
)
def test_plan_rejects_bad_blocks(src_blocks: list[int], dst_blocks: list[int], match: str) -> None:
    src, peer = _pair(dst_blocks=20)
    for planner in (build_plan, plan_entries_naive):
        with pytest.raises(InvalidPlan, match=match):
            planner(src, peer, src_blocks, dst_blocks)


@pytest.mark.parametrize("bad", [0, -1, MAX_BATCH_ENTRIES_LIMIT + 1, True, 8.0])
def test_plan_rejects_bad_batch_limit(bad: object) -> None:
    src, peer = _pair()
    with pytest.raises(InvalidPlan, match=rf"max_batch_entries .* got {bad!r}"):
        build_plan(src, peer, [0], [0], max_batch_entries=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_layers": 3}, "num_layers is 2 on the source, 3 on peer peer:1"),
        ({"block_bytes": 64}, "block_bytes is 32 on the source, 64 on peer peer:1"),
        ({"kv_split": False}, "kv_split is True on the source, False on peer peer:1"),
    ],
)
def test_plan_rejects_incompatible_layouts(change: dict[str, object], match: str) -> None:
    src = KVCache(LAYOUT)
    peer = KVCache(dataclasses.replace(LAYOUT, **change)).peer_info("peer:1")  # type: ignore[arg-type]
    with pytest.raises(InvalidPlan, match=match):
        build_plan(src, peer, [0], [0])


def test_plan_rejects_malformed_peer_info() -> None:
    src, peer = _pair()
    with pytest.raises(InvalidPlan, match="advertised 3 buffer bases, its layout has 4"):
        build_plan(src, dataclasses.replace(peer, block_base=peer.block_base[:3]), [0], [0])
    with pytest.raises(InvalidPlan, match="advertised no KVLayout: 'junk'"):
        build_plan(src, dataclasses.replace(peer, layout="junk"), [0], [0])  # type: ignore[arg-type]
    with pytest.raises(InvalidPlan, match="source must be a KVCache, got str"):
        build_plan("cache", peer, [0], [0])  # type: ignore[arg-type]


def test_plan_rejects_ranges_outside_peer_regions() -> None:
    src, peer = _pair()
    # The peer advertises only the first 8 blocks of each buffer.
    short = tuple(Region(r.base, 8 * 32) for r in peer.regions)
    narrowed = dataclasses.replace(peer, regions=short)
    plan = build_plan(src, narrowed, [0, 1], [6, 7])
    assert plan.nbytes == 2 * 32 * 4
    with pytest.raises(RemoteRangeRejected, match=r"destination block 8 of buffer 0 at \[0x"):
        build_plan(src, narrowed, [0, 1], [7, 8])
    # No regions at all: every range is rejected, and the error is an InvalidPlan.
    with pytest.raises(InvalidPlan, match="outside the regions peer peer:1 advertised"):
        build_plan(src, dataclasses.replace(peer, regions=()), [0], [0])


def test_plan_accepts_blocks_spread_over_several_regions() -> None:
    # Each block of the peer registered separately, except block 5: the span
    # check fails and the exact per-block check decides.
    src, peer = _pair()
    per_block = tuple(
        Region(base + b * 32, 32) for base in peer.block_base for b in range(16) if b != 5
    )
    holey = dataclasses.replace(peer, regions=per_block)
    assert build_plan(src, holey, [0, 1, 2], [4, 6, 9]).num_blocks == 3
    with pytest.raises(RemoteRangeRejected, match="destination block 5 of buffer 0"):
        build_plan(src, holey, [0, 1], [4, 5])


# -- build_plan: construction ----------------------------------------------------


def test_contiguous_blocks_coalesce_to_one_entry_per_buffer() -> None:
    src, peer = _pair(src_blocks=64, dst_blocks=128)
    plan = build_plan(src, peer, list(range(64)), list(range(64, 128)))
    assert isinstance(plan, TransferPlan)
    assert plan.peer == "peer:1" and plan.num_blocks == 64
    assert plan.num_entries == LAYOUT.num_buffers
    (batch,) = plan.batches
    assert batch.lengths == (64 * 32,) * LAYOUT.num_buffers
    assert batch.src == src.buffer_bases()
    assert batch.dst == tuple(base + 64 * 32 for base in peer.block_base)
    assert plan.nbytes == batch.nbytes == 64 * 32 * LAYOUT.num_buffers


def test_order_of_pairs_does_not_matter() -> None:
    src, peer = _pair()
    pairs = [(i, i + 2) for i in range(10)]
    random.Random(0).shuffle(pairs)
    plan = build_plan(src, peer, [s for s, _ in pairs], [d for _, d in pairs])
    assert plan.num_entries == LAYOUT.num_buffers


def test_scattered_runs_coalesce_per_run() -> None:
    layout = KVLayout(num_layers=4, num_blocks=4096, block_bytes=16)
    src, dst = KVCache(layout), KVCache(dataclasses.replace(layout, num_blocks=8192))
    # 512 runs of 8 blocks in shuffled order, a gap after each so none can merge.
    runs = list(range(512))
    random.Random(1).shuffle(runs)
    dst_blocks = [r * 16 + k for r in runs for k in range(8)]
    plan = build_plan(src, dst.peer_info("p"), list(range(4096)), dst_blocks)
    assert plan.num_entries == 512 * layout.num_buffers
    naive = plan_entries_naive(src, dst.peer_info("p"), list(range(4096)), dst_blocks)
    assert naive.num_entries == 4096 * layout.num_buffers
    assert plan.nbytes == naive.nbytes == 4096 * 16 * layout.num_buffers


def test_batches_respect_the_entry_limit() -> None:
    src, peer = _pair(dst_blocks=64)
    dst = list(range(0, 32, 2))  # no run longer than one block: 16 runs x 4 buffers
    plan = build_plan(src, peer, list(range(16)), dst, max_batch_entries=10)
    assert [len(b.lengths) for b in plan.batches] == [10] * 6 + [4]
    assert DEFAULT_MAX_BATCH_ENTRIES == 512
    big = build_plan(src, peer, list(range(16)), dst)
    assert len(big.batches) == 1


def test_source_block_may_feed_several_destinations() -> None:
    src, peer = _pair()
    plan = build_plan(src, peer, [3, 3, 3], [0, 1, 2])
    assert plan.num_entries == 3 * LAYOUT.num_buffers
    assert plan.num_blocks == 3


def test_planning_a_large_cache_makes_one_entry_per_run_and_buffer() -> None:
    # 4096 blocks x 32 layers x K/V in shuffled runs of 16: each entry is one
    # run of one buffer, exactly the 16 per-block entries it replaces. (How
    # fast it plans is `kvguard bench`'s build_plan_ms, not a unit test's.)
    layout = KVLayout(num_layers=32, num_blocks=4096, block_bytes=16)
    src, dst = KVCache(layout), KVCache(dataclasses.replace(layout, num_blocks=8192))
    runs = list(range(256))
    random.Random(2).shuffle(runs)
    dst_blocks = [r * 32 + k for r in runs for k in range(16)]
    peer = dst.peer_info("p")
    plan = build_plan(src, peer, list(range(4096)), dst_blocks)
    assert plan.num_entries == 256 * layout.num_buffers
    naive = plan_entries_naive(src, peer, list(range(4096)), dst_blocks)
    per_block = {
        d: (s, n) for b in naive.batches for s, d, n in zip(b.src, b.dst, b.lengths, strict=True)
    }
    assert len(per_block) == 4096 * layout.num_buffers
    covered = 0
    for batch in plan.batches:
        for s, d, n in zip(batch.src, batch.dst, batch.lengths, strict=True):
            assert n == 16 * layout.block_bytes, n
            for k in range(16):
                step = k * layout.block_bytes
                assert per_block[d + step] == (s + step, layout.block_bytes), (d, k)
            covered += 16
    assert covered == len(per_block)


# -- properties ------------------------------------------------------------------


@st.composite
def plan_inputs(draw: st.DrawFn) -> tuple[KVLayout, int, list[int], list[int], int]:
    layout = KVLayout(
        num_layers=draw(st.integers(1, 3)),
        num_blocks=draw(st.integers(1, 24)),
        block_bytes=draw(st.integers(1, 24)),
        kv_split=draw(st.booleans()),
    )
    dst_num_blocks = draw(st.integers(1, 24))
    n = draw(st.integers(1, min(layout.num_blocks * 2, dst_num_blocks)))
    # Runs are likely: draw a permutation-ish sequence with many consecutive ids.
    dst_blocks = draw(
        st.one_of(
            st.permutations(range(dst_num_blocks)).map(lambda p: list(p[:n])),
            st.integers(0, dst_num_blocks - n).map(lambda s: list(range(s, s + n))),
        )
    )
    src_blocks = draw(
        st.one_of(
            st.lists(st.integers(0, layout.num_blocks - 1), min_size=n, max_size=n),
            st.just([i % layout.num_blocks for i in range(n)]),
        )
    )
    limit = draw(st.sampled_from([1, 2, 3, 7, MAX_BATCH_ENTRIES_LIMIT]))
    return layout, dst_num_blocks, src_blocks, dst_blocks, limit


def _byte_map(plan: TransferPlan) -> dict[int, int]:
    """Destination byte address -> source byte address; fails on any overlap."""
    mapping: dict[int, int] = {}
    for batch in plan.batches:
        for s, d, n in zip(batch.src, batch.dst, batch.lengths, strict=True):
            assert n > 0
            for k in range(n):
                assert d + k not in mapping, "two entries write the same destination byte"
                mapping[d + k] = s + k
    return mapping


@given(plan_inputs())
def test_plan_covers_exactly_the_requested_bytes(
    case: tuple[KVLayout, int, list[int], list[int], int],
) -> None:
    layout, dst_num_blocks, src_blocks, dst_blocks, limit = case
    src = KVCache(layout)
    dst = KVCache(dataclasses.replace(layout, num_blocks=dst_num_blocks))
    peer = dst.peer_info("p")
    size = layout.block_bytes
    expected = {
        dst.block_addr(i, d) + k: src.block_addr(i, s) + k
        for i in range(layout.num_buffers)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
        for k in range(size)
    }
    for planner in (build_plan, plan_entries_naive):
        plan = planner(src, peer, src_blocks, dst_blocks, max_batch_entries=limit)
        assert _byte_map(plan) == expected
        assert all(1 <= len(b.lengths) <= limit for b in plan.batches)
        assert plan.nbytes == sum(b.nbytes for b in plan.batches) == len(expected)
        assert plan.num_blocks == len(src_blocks)
        for batch in plan.batches:  # every entry inside one source and one peer region
            for s, d, n in zip(batch.src, batch.dst, batch.lengths, strict=True):
                assert any(r.contains(s, n) for r in src.regions())
                assert any(r.contains(d, n) for r in peer.regions)
    coalesced = build_plan(src, peer, src_blocks, dst_blocks, max_batch_entries=limit)
    assert coalesced.num_entries <= len(src_blocks) * layout.num_buffers


_CORRUPTIONS = ("length", "src_range", "dst_range", "dup_dst", "bool", "empty", "limit")


@given(plan_inputs(), st.sampled_from(_CORRUPTIONS), st.integers(0, 1000))
def test_invalid_inputs_always_raise(
    case: tuple[KVLayout, int, list[int], list[int], int], corruption: str, salt: int
) -> None:
    layout, dst_num_blocks, src_blocks, dst_blocks, limit = case
    src = KVCache(layout)
    peer = KVCache(dataclasses.replace(layout, num_blocks=dst_num_blocks)).peer_info("p")
    srcs: list[object] = list(src_blocks)
    dsts: list[object] = list(dst_blocks)
    i = salt % len(srcs)
    if corruption == "length":
        dsts.append(dsts[0])
    elif corruption == "src_range":
        srcs[i] = layout.num_blocks + salt
    elif corruption == "dst_range":
        dsts[i] = -1 - salt
    elif corruption == "dup_dst":
        srcs.append(srcs[0])
        dsts.append(dsts[i])
    elif corruption == "bool":
        srcs[i] = bool(salt % 2)
    elif corruption == "empty":
        srcs, dsts = [], []
    else:
        limit = MAX_BATCH_ENTRIES_LIMIT + 1 + salt
    for planner in (build_plan, plan_entries_naive):
        with pytest.raises(InvalidPlan):
            planner(src, peer, srcs, dsts, max_batch_entries=limit)  # type: ignore[arg-type]


# -- slices of blocks (tensor parallel ranks of different sizes) -------------------


@st.composite
def slice_inputs(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, list[int], list[int], BlockSlice]:
    """Two caches whose blocks hold different head ranges: ``unit`` bytes a
    head, ``hs`` heads a source block, ``hd`` a destination block."""
    unit, hs, hd = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    count = draw(st.integers(1, min(hs, hd)))
    src_head, dst_head = draw(st.integers(0, hs - count)), draw(st.integers(0, hd - count))
    layers, split = draw(st.integers(1, 3)), draw(st.booleans())
    src = KVLayout(layers, draw(st.integers(1, 12)), hs * unit, kv_split=split)
    dst = KVLayout(layers, draw(st.integers(1, 12)), hd * unit, kv_split=split)
    n = draw(st.integers(1, dst.num_blocks))
    dst_blocks = draw(
        st.one_of(
            st.permutations(range(dst.num_blocks)).map(lambda p: list(p[:n])),
            st.integers(0, dst.num_blocks - n).map(lambda s: list(range(s, s + n))),
        )
    )
    src_blocks = draw(st.lists(st.integers(0, src.num_blocks - 1), min_size=n, max_size=n))
    part = BlockSlice(src_head * unit, dst_head * unit, count * unit)
    return src, dst, src_blocks, dst_blocks, part


@given(slice_inputs(), st.sampled_from([1, 3, MAX_BATCH_ENTRIES_LIMIT]))
def test_a_slice_plan_copies_exactly_that_slice_of_each_block(
    case: tuple[KVLayout, KVLayout, list[int], list[int], BlockSlice], limit: int
) -> None:
    src_layout, dst_layout, src_blocks, dst_blocks, part = case
    src, dst = KVCache(src_layout), KVCache(dst_layout)
    peer = dst.peer_info("p")
    expected = {
        dst.block_addr(i, d) + part.dst_offset + k: src.block_addr(i, s) + part.src_offset + k
        for i in range(src_layout.num_buffers)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
        for k in range(part.length)
    }
    for planner in (build_plan, plan_entries_naive):
        plan = planner(src, peer, src_blocks, dst_blocks, max_batch_entries=limit, part=part)
        assert _byte_map(plan) == expected
        assert plan.nbytes == len(expected)
        assert plan.num_blocks == len(src_blocks)
        assert all(1 <= len(b.lengths) <= limit for b in plan.batches)


def test_a_whole_block_slice_coalesces_like_no_slice() -> None:
    src, peer = _pair()
    whole = build_plan(src, peer, [0, 1, 2], [4, 5, 6], part=BlockSlice(0, 0, 32))
    assert whole == build_plan(src, peer, [0, 1, 2], [4, 5, 6])
    assert whole.num_entries == LAYOUT.num_buffers
    half = build_plan(src, peer, [0, 1, 2], [4, 5, 6], part=BlockSlice(16, 0, 16))
    assert half.num_entries == 3 * LAYOUT.num_buffers  # slices of neighbours are not contiguous
    assert half.nbytes == 3 * 16 * LAYOUT.num_buffers


def test_slices_may_join_blocks_of_different_sizes_only() -> None:
    src = KVCache(dataclasses.replace(LAYOUT, block_bytes=16))
    peer = KVCache(LAYOUT).peer_info("peer:1")
    with pytest.raises(InvalidPlan, match="block_bytes is 16 on the source, 32 on peer peer:1"):
        build_plan(src, peer, [0], [0])
    plan = build_plan(src, peer, [0], [3], part=BlockSlice(0, 16, 16))
    assert plan.batches[0].dst[0] == peer.block_base[0] + 3 * 32 + 16
    other = KVCache(dataclasses.replace(LAYOUT, block_bytes=16, num_layers=3))
    with pytest.raises(InvalidPlan, match="num_layers is 3 on the source, 2 on peer peer:1"):
        build_plan(other, peer, [0], [0], part=BlockSlice(0, 16, 16))


@pytest.mark.parametrize(
    ("part", "match"),
    [
        (BlockSlice(0, 0, 0), r"BlockSlice\(src_offset=0, dst_offset=0, length=0\) needs int"),
        (BlockSlice(0, 1.0, 4), "needs int offsets"),  # type: ignore[arg-type]
        (BlockSlice(0, True, 4), "needs int offsets"),
        (BlockSlice(17, 0, 16), "does not fit the source's 32-byte blocks"),
        (BlockSlice(-1, 0, 16), "does not fit the source's 32-byte blocks"),
        (BlockSlice(0, 20, 16), "does not fit the destination's 32-byte blocks"),
        (BlockSlice(0, -4, 16), "does not fit the destination's 32-byte blocks"),
        ((0, 0, 16), "part must be a BlockSlice, got tuple"),
    ],
)
def test_plan_rejects_bad_slices(part: BlockSlice, match: str) -> None:
    src, peer = _pair()
    for planner in (build_plan, plan_entries_naive):
        with pytest.raises(InvalidPlan, match=match):
            planner(src, peer, [0], [0], part=part)
    assert build_plan(src, peer, [0], [0], part=BlockSlice(16, 16, 16)).nbytes == 16 * 4
