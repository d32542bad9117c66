"""Region containment has one owner, ``RegionIndex``, and every caller agrees with it.

A range lies inside a set of regions when one region holds all of it. Each
property is checked against a brute-force reference written here, over random
region sets with nested, adjacent, overlapping, empty and negative regions,
and queries that are empty, negative, straddling or out of range. The call
sites are the plan builder (``build_plan``), the backends' destination check
(``add_peer`` + ``submit``) and the peer-message parser.
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import (
    Batch,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerInfo,
    PeerProtocolError,
    RemoteRangeRejected,
    TransferPlan,
    build_plan,
    peer_info_from_message,
    peer_info_to_message,
)
from transfer.backend import check_destinations
from transfer.regions import Region, RegionIndex


def holds(regions: list[Region], addr: int, length: int) -> bool:
    """The reference: a non-empty range inside one region, by trying every region."""
    return length > 0 and any(
        r.base <= addr and addr + length <= r.base + r.length for r in regions
    )


COORD = st.integers(-8, 160)


@st.composite
def region_sets(draw: st.DrawFn) -> list[Region]:
    """Random regions, then some derived from earlier ones so that nesting,
    adjacency and partial overlap come up in most examples."""
    regions = draw(st.lists(st.builds(Region, COORD, st.integers(-4, 96)), max_size=6))
    for _ in range(draw(st.integers(0, 4))):
        if not regions:
            break
        p = draw(st.sampled_from(regions))
        how = draw(st.sampled_from(["nested", "adjacent", "overlap", "same", "empty"]))
        cut = draw(st.integers(0, max(p.length, 0)))
        if how == "nested":
            regions.append(Region(p.base + cut, max(p.length - cut - draw(st.integers(0, 4)), 0)))
        elif how == "adjacent":
            regions.append(Region(p.base + p.length, draw(st.integers(1, 40))))
        elif how == "overlap":
            regions.append(Region(p.base + cut, p.length))
        elif how == "same":
            regions.append(p)
        else:
            regions.append(Region(p.base + cut, 0))
    return draw(st.permutations(regions))


QUERY = st.tuples(st.integers(-20, 280), st.integers(-3, 120))


@settings(max_examples=500)
@given(regions=region_sets(), queries=st.lists(QUERY, max_size=12))
def test_index_answers_like_brute_force(
    regions: list[Region], queries: list[tuple[int, int]]
) -> None:
    index = RegionIndex(regions)
    assert len(index) == sum(1 for r in regions if r.length > 0)
    for addr, length in queries:
        want = holds(regions, addr, length)
        assert index.contains(addr, length) is want, (addr, length)
        k = index.find(addr, length)
        if want:
            assert k is not None and regions[k].length > 0
            assert regions[k].base <= addr and addr + length <= regions[k].end
        else:
            assert k is None
        # One region alone answers the same way the set of that one region does.
        assert any(r.contains(addr, length) for r in regions) is want
        # The plan check's inlined loop answers each pair as ``find`` does.
        assert index.first_outside([addr], [length]) == (None if want else (addr, length))
    outside = [q for q in queries if not holds(regions, *q)]
    expected = outside[0] if outside else None
    assert index.first_outside([a for a, _ in queries], [n for _, n in queries]) == expected


def test_index_finds_a_region_nested_inside_another() -> None:
    # Issue 21: [0, 100) holds [50, 60) even though [10, 20) starts nearer to it.
    index = RegionIndex([Region(0, 100), Region(10, 20)])
    assert index.contains(50, 10) and index.find(50, 10) == 0
    assert index.find(12, 5) in (0, 1) and index.contains(0, 100)
    assert not index.contains(95, 10)  # past the outer end
    assert not index.contains(50, 0) and not index.contains(50, -1)  # empty ranges
    assert not index.contains(-1, 2)  # before every region
    # Adjacent regions are not merged: a range across the seam is outside.
    seam = RegionIndex([Region(0, 10), Region(10, 10)])
    assert seam.contains(0, 10) and seam.contains(10, 10) and not seam.contains(5, 10)
    assert seam.first_outside([0, 5, 10], [10, 10, 10]) == (5, 10)
    assert len(RegionIndex([])) == 0 and not RegionIndex([]).contains(0, 1)


def test_first_outside_refuses_an_empty_range_and_takes_a_one_byte_one() -> None:
    index = RegionIndex([Region(0, 10)])
    assert index.first_outside([3, 4], [1, 0]) == (4, 0)
    assert index.first_outside([0, 9], [1, 1]) is None
    assert index.first_outside([3], [-1]) == (3, -1)


def test_first_outside_refuses_address_and_length_lists_of_unequal_length() -> None:
    # A plan's addresses and lengths come in pairs: a missing length is a bug
    # upstream, not a range that is inside.
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        RegionIndex([Region(0, 10)]).first_outside([0, 1], [1])


def test_a_region_ending_at_or_below_zero_is_found_like_any_other() -> None:
    index = RegionIndex([Region(-8, 4), Region(0, 10)])
    assert (index.find(-8, 4), index.find(-6, 2), index.find(0, 10)) == (0, 0, 1)
    assert index.find(-4, 2) is None  # the gap between them


# -- every call site agrees -------------------------------------------------------

# Two buffers of 8 blocks of 8 bytes; the peer's buffers sit at these (synthetic)
# addresses, which only plans compute with: nothing is written to them.
LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=8)
BASES = (16, 96)
SID = "peer:1"
SRC = KVCache(LAYOUT)


def _raw_plan(dst_blocks: list[int]) -> TransferPlan:
    """What build_plan would build, made by hand: one entry per block per buffer."""
    size = LAYOUT.block_bytes
    src = [b + i * size for b in SRC.buffer_bases() for i in range(len(dst_blocks))]
    dst = [b + d * size for b in BASES for d in dst_blocks]
    batch = Batch(tuple(src), tuple(dst), (size,) * len(dst))
    return TransferPlan(SID, (batch,), batch.nbytes, len(dst_blocks))


@settings(max_examples=400)
@given(
    regions=region_sets(),
    dst_blocks=st.lists(st.integers(0, LAYOUT.num_blocks - 1), min_size=1, max_size=4, unique=True),
)
def test_plan_builder_and_backend_check_agree_with_the_reference(
    regions: list[Region], dst_blocks: list[int]
) -> None:
    size = LAYOUT.block_bytes
    want = all(holds(regions, b + d * size, size) for b in BASES for d in dst_blocks)
    peer = PeerInfo(SID, tuple(regions), LAYOUT, block_base=BASES)
    src_blocks = list(range(len(dst_blocks)))
    if want:
        plan = build_plan(SRC, peer, src_blocks, dst_blocks)
        assert plan.num_blocks == len(dst_blocks)
    else:
        with pytest.raises(RemoteRangeRejected, match="lies outside the regions peer peer:1"):
            build_plan(SRC, peer, src_blocks, dst_blocks)
    # The backends' check, on the same ranges planned by hand (a public
    # TransferPlan need not come from build_plan).
    raw = _raw_plan(dst_blocks)
    if want:
        check_destinations(raw, RegionIndex(regions))
    else:
        with pytest.raises(RemoteRangeRejected, match="is outside every region peer peer:1"):
            check_destinations(raw, RegionIndex(regions))


@settings(max_examples=300)
@given(regions=region_sets())
def test_peer_message_parser_agrees_with_the_reference(regions: list[Region]) -> None:
    # The wire format refuses overlapping, empty and non-positive regions
    # outright; among the rest a buffer must lie inside one region.
    usable = [r for r in regions if r.base >= 1 and r.length > 0]
    spans = sorted((r.base, r.end) for r in usable)
    disjoint = all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans))
    peer = PeerInfo(SID, tuple(usable), LAYOUT, block_base=BASES)
    message = peer_info_to_message(peer)
    if not usable:
        with pytest.raises(PeerProtocolError, match=r"length >= 1 - at `\$\.regions`"):
            peer_info_from_message(message)
        return
    if not disjoint:
        with pytest.raises(PeerProtocolError, match="overlap"):
            peer_info_from_message(message)
        return
    if all(holds(usable, b, LAYOUT.buffer_bytes) for b in BASES):
        assert peer_info_from_message(message) == peer
    else:
        with pytest.raises(PeerProtocolError, match="lies in no advertised region"):
            peer_info_from_message(message)


def test_nested_regions_are_answered_the_same_by_plan_and_backend() -> None:
    """End to end on real memory: the peer advertises each buffer whole plus a
    nested sub-region near its start; a block past the sub-region is inside the
    outer one, for build_plan and for the backend's own check alike."""
    dst = KVCache(LAYOUT)
    backend = LocalBackend(workers=1)
    try:
        backend.register_source(SRC)
        info = backend.register_peer(SID, dst)
        nested = tuple(Region(r.base + 8, 8) for r in info.regions)
        peer = dataclasses.replace(info, regions=info.regions + nested)
        backend.add_peer(peer)
        SRC.fill_seeded(7)
        plan = build_plan(SRC, peer, [0, 1], [5, 6])  # past the nested [block 1, block 2)
        backend.submit(plan).result(timeout=10.0)
        assert SRC.blocks_equal(dst, [0, 1], [5, 6]) == []
        # Advertise only the nested regions: both refuse the same blocks.
        only_nested = dataclasses.replace(info, regions=nested)
        with pytest.raises(RemoteRangeRejected, match="destination block 5 of buffer 0"):
            build_plan(SRC, only_nested, [0], [5])
        backend.add_peer(only_nested)
        op = backend.submit(plan)
        with pytest.raises(RemoteRangeRejected, match=r"batch 0: destination \[0x"):
            op.result(timeout=10.0)
        assert op.quiesced
    finally:
        backend.close()
