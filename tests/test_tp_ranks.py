"""Tensor parallel rank mapping (kvguard.vllm.ranks) and a decode request's
legs (kvguard.vllm.decode_legs): no vLLM needed."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.vllm.decode_legs import DecodeLegs, Verdict
from kvguard.vllm.decode_loads import LoadOutcome
from kvguard.vllm.params import Source
from kvguard.vllm.ranks import Leg, Pairing, RankHeads, block_slice, legs, rank_endpoint, spares
from kvguard.vllm.states import LoadEnd
from transfer.plan import BlockSlice

# -- ranks ----------------------------------------------------------------------


def test_vllm_head_split() -> None:
    assert [(r.first, r.count) for r in map(lambda i: RankHeads(i, 4, 8), range(4))] == [
        (0, 2),
        (2, 2),
        (4, 2),
        (6, 2),
    ]
    replicated = RankHeads(3, 4, 2)  # more ranks than heads: vLLM replicates them
    assert (replicated.splits, replicated.first, replicated.count) == (False, 0, 2)


@pytest.mark.parametrize(("rank", "size", "heads"), [(2, 2, 4), (-1, 2, 4), (0, 0, 4), (0, 1, 0)])
def test_no_such_rank(rank: int, size: int, heads: int) -> None:
    with pytest.raises(ValueError, match="no such rank: RankHeads"):
        RankHeads(rank, size, heads)


def test_the_three_pairings_the_docs_name() -> None:
    # equal sizes: rank r to rank r, whole blocks (any layout)
    assert legs(RankHeads(1, 2, 2), 2, head_major=False) == [Leg(1, 0, 0, 1, 1, True)]
    # prefill 2, decode 1: two halves from two ranks
    assert legs(RankHeads(0, 1, 2), 2, head_major=True) == [
        Leg(0, 0, 0, 1, 1, False),
        Leg(1, 0, 1, 1, 1, False),
    ]
    # prefill 1, decode 2: one leg each to rank 0, which two decode ranks ask
    assert legs(RankHeads(1, 2, 2), 1, head_major=True) == [Leg(0, 1, 0, 1, 2, False)]


@pytest.mark.parametrize(
    ("decode", "prefill_size", "head_major", "match"),
    [
        (RankHeads(0, 1, 2), 2, False, "differ: that needs a rank's KV heads to be one run"),
        (RankHeads(0, 4, 2), 2, True, "one does not divide the 2 KV heads"),
        (RankHeads(0, 2, 6), 4, True, "prefill tensor parallel size 4 and decode size 2"),
    ],
)
def test_pairings_that_cannot_work_name_both_sizes(
    decode: RankHeads, prefill_size: int, head_major: bool, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        legs(decode, prefill_size, head_major)


_NOT_ONE_RUN = (
    "prefill tensor parallel size 2 and decode size 1 differ: that needs a rank's KV heads "
    "to be one run inside a block, and they are not in the {} KV cache layout (they are in "
    "LBHNC and BHLNC without kernel blocks)"
)


@pytest.mark.parametrize(("layout", "named"), [("", "resolved"), ("LHBNC", "LHBNC")])
def test_a_layout_without_head_runs_is_refused_by_name(layout: str, named: str) -> None:
    """The whole message, the layout named when known (the `Pairing` passes its own)."""
    with pytest.raises(ValueError) as exc:
        legs(RankHeads(0, 1, 2), 2, False, layout) if layout else legs(RankHeads(0, 1, 2), 2, False)
    assert str(exc.value) == _NOT_ONE_RUN.format(named)
    pairing = (
        Pairing(RankHeads(0, 1, 2), False, layout) if layout else Pairing(RankHeads(0, 1, 2), False)
    )
    with pytest.raises(ValueError) as exc:
        pairing.legs(Source("tcp://h:1", "p", 2))
    assert str(exc.value) == _NOT_ONE_RUN.format(named)


def test_a_prefill_ranks_block_slice() -> None:
    """What prefill rank 1 of 2 (heads [2, 4) of 4) writes of each 4096-byte
    block to a decode rank, by the heads the decode rank holds."""
    mine = RankHeads(1, 2, 4)
    for first, count in ((2, 2), (0, 0)):  # the same heads, or whatever it holds: whole
        assert block_slice(mine, first, count, True, 4096) is None
    assert block_slice(None, 0, 4, True, 4096) is None  # the decode's own side: whole
    got = block_slice(mine, 0, 4, True, 4096)  # the decode holds all 4: its heads 2-3
    assert got == BlockSlice(0, 4096, 4096)
    assert got is not None and all(
        type(v) is int for v in (got.src_offset, got.dst_offset, got.length)
    )
    assert block_slice(mine, 3, 1, True, 4096) == BlockSlice(2048, 0, 2048)
    cases = [
        (
            (4, 2, True),
            "the decode rank holds KV heads [4, 6), this prefill rank [2, 4): none in common",
        ),
        (
            (0, 2, True),
            "the decode rank holds KV heads [0, 2), this prefill rank [2, 4): none in common",
        ),
        (
            (0, 4, False),
            "the decode rank holds KV heads [0, 4), this prefill rank [2, 4): "
            "a share of a block needs heads outermost",
        ),
    ]
    for (first, count, head_major), why in cases:
        with pytest.raises(ValueError) as exc:
            block_slice(mine, first, count, head_major, 4096)
        assert str(exc.value) == why


def test_a_decode_ranks_part_of_a_block_is_in_whole_bytes() -> None:
    """(offset, length) go to the engine: ints, also where heads do not divide the block."""
    pairing = Pairing(RankHeads(0, 1, 2), True, block_bytes=1000)
    parts = [pairing.part(leg) for leg in pairing.legs(Source("tcp://h:1", "p", 2))]
    assert parts == [(0, 500), (500, 500)]
    assert all(type(v) is int for part in parts if part for v in part)
    odd = Pairing(RankHeads(0, 1, 3), True, block_bytes=1000)
    assert [odd.part(leg) for leg in odd.legs(Source("tcp://h:1", "p", 3))] == [
        (0, 333),
        (333, 333),
        (666, 333),
    ]


@given(
    st.sampled_from([1, 2, 4, 6, 8, 12]).flatmap(
        lambda h: st.tuples(
            st.just(h),
            st.sampled_from([d for d in (1, 2, 3, 4, 6, 8, 12) if h % d == 0]),
            st.sampled_from([p for p in (1, 2, 3, 4, 6, 8, 12) if h % p == 0]),
        )
    )
)
def test_legs_cover_every_head_exactly_once(case: tuple[int, int, int]) -> None:
    """Every decode rank's heads come from exactly one prefill rank each, from
    that rank's own heads, and each prefill rank's fan-in is the number of
    decode ranks that ask it."""
    heads, decode_size, prefill_size = case
    asked: Counter[int] = Counter()
    fan_in: dict[int, int] = {}
    for d in range(decode_size):
        rank = RankHeads(d, decode_size, heads)
        got: list[int] = []
        for leg in legs(rank, prefill_size, head_major=True):
            p = RankHeads(leg.prefill_rank, prefill_size, heads)
            assert leg.src_head >= 0 and leg.src_head + leg.count <= p.count
            assert p.first + leg.src_head == rank.first + leg.dst_head  # the same heads
            got += range(rank.first + leg.dst_head, rank.first + leg.dst_head + leg.count)
            asked[leg.prefill_rank] += 1
            assert fan_in.setdefault(leg.prefill_rank, leg.fan_in) == leg.fan_in
            assert leg.whole == (prefill_size == decode_size)
        assert got == list(range(rank.first, rank.first + rank.count))
    assert dict(asked) == fan_in  # what the prefill waits for is what comes
    assert set(asked) == set(range(prefill_size))  # every prefill rank is asked


def test_rank_endpoints() -> None:
    assert rank_endpoint("tcp://10.0.0.1:17600", 0) == "tcp://10.0.0.1:17600"
    assert rank_endpoint("tcp://10.0.0.1:17600", 3) == "tcp://10.0.0.1:17603"
    assert rank_endpoint("h:1", 0) == "tcp://h:1"  # the lowest port there is
    assert rank_endpoint("h:65534", 1) == "tcp://h:65535"
    with pytest.raises(ValueError, match="not a tcp://host:port endpoint for rank 0: 'h:0'"):
        rank_endpoint("h:0", 0)
    for bad in ("tcp://10.0.0.1", "tcp://h:x1", "tcp://h:65535"):
        with pytest.raises(ValueError, match="not a tcp://host:port endpoint for rank 1"):
            rank_endpoint(bad, 1)


# -- legs -------------------------------------------------------------------------


def _ok(leg: str, latency: float = 0.1) -> LoadOutcome:
    return LoadOutcome(leg, LoadEnd.LOADED, "", latency)


def _failed(leg: str, fenced: bool = False) -> LoadOutcome:
    return LoadOutcome(leg, LoadEnd.PEER_LOST, "gone", 0.2, fenced=fenced)


def test_one_leg_is_the_receivers_outcome_unchanged() -> None:
    legs_ = DecodeLegs()
    assert legs_.start("r", [4, 5], ["r"])
    v = legs_.reported(_ok("r"))
    assert v is not None and v.final and v.outcome == _ok("r") and v.blocks == [4, 5]
    assert legs_.in_use() == {}
    assert legs_.recent_outcomes() == [_ok("r")]


def test_loaded_only_when_every_leg_loaded() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [1], ["r#0.0", "r#0.1"])
    assert legs_.reported(_ok("r#0.1", 0.3)) is None
    assert legs_.in_use() == {"r": 1}
    v = legs_.reported(_ok("r#0.0", 0.1))
    assert v is not None and v.final and v.outcome == LoadOutcome("r", LoadEnd.LOADED, "", 0.3)


def test_a_failed_leg_fails_the_request_once_no_leg_may_write() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [7, 8], ["a", "b"])
    early = legs_.reported(_failed("a", fenced=True))
    # vLLM hears of it now, as load errors on the blocks: not finished
    assert early is not None and not early.final and early.outcome.reason == "peer_lost"
    assert legs_.reported(_ok("b")) is None  # still fenced: nothing more to say
    assert legs_.recent_outcomes() == [LoadOutcome("r", LoadEnd.PEER_LOST, "gone", 0.2, True)]
    assert legs_.in_use() == {"r": 2}
    assert legs_.released("b") is None  # not a fenced leg
    final = legs_.released("a")
    assert final is not None and final.final and not final.outcome.ok
    assert final.outcome.reason == "peer_lost" and final.blocks == [7, 8]
    assert legs_.in_use() == {} and legs_.released("a") is None


def test_a_release_taken_before_its_fenced_report_ends_the_load_with_it() -> None:
    """The worker takes the receiver's reports, then its releases: a load
    fenced and released between the two takes comes as its release first.
    Its report then finishes it (seen in CI: the load was lost for good and
    its request never finished)."""
    legs_ = DecodeLegs()
    legs_.start("r", [7, 8], ["r"])
    assert legs_.released("r") is None  # kept for its report
    assert legs_.in_use() == {"r": 2}
    final = legs_.reported(_failed("r", fenced=True))
    gone = LoadOutcome("r", LoadEnd.PEER_LOST, "gone", 0.2, fenced=True)
    assert final == Verdict("r", [7, 8], gone, True)
    assert legs_.in_use() == {} and legs_.released("r") is None
    # Never quarantined: vLLM has the blocks back with its first word of the load.
    assert legs_.recent_outcomes() == [LoadOutcome("r", LoadEnd.PEER_LOST, "gone", 0.2)]


def test_an_early_release_of_one_leg_waits_for_the_others() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [3], ["a", "b"])
    assert legs_.released("b") is None
    early = legs_.reported(_failed("a", fenced=True))
    assert early is not None and not early.final  # load errors now: a may still write
    assert legs_.reported(_failed("b", fenced=True)) is None  # b is over, a is still fenced
    assert legs_.released("b") is None  # its release was spent
    final = legs_.released("a")
    assert final is not None and final.final and final.outcome.reason == "peer_lost"
    assert legs_.in_use() == {}


def test_a_fenced_leg_reported_again_changes_nothing() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [3], ["a", "b"])
    first = legs_.reported(_failed("a", fenced=True))
    assert first is not None and not first.final  # its load errors, once
    assert legs_.reported(_failed("a", fenced=True)) is None
    assert legs_.reported(_ok("b")) is None  # a still fenced
    final = legs_.released("a")
    assert final is not None and final.final and final.outcome.reason == "peer_lost"
    assert legs_.reported(_failed("a", fenced=True)) is None and legs_.in_use() == {}


def test_the_recent_outcomes_keep_the_newest_4096() -> None:
    legs_ = DecodeLegs()
    for i in range(4097):
        legs_.start(f"r{i}", [1], [f"r{i}"])
        legs_.reported(_ok(f"r{i}"))
    recent = legs_.recent_outcomes()
    assert len(recent) == 4096
    assert (recent[0].request_id, recent[-1].request_id) == ("r1", "r4096")


def test_an_unfenced_failure_still_waits_for_the_other_legs() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [3], ["a", "b"])
    early = legs_.reported(_failed("a"))
    assert early is not None and not early.final
    final = legs_.reported(_ok("b"))
    assert final is not None and final.final and final.outcome.reason == "peer_lost"


def test_duplicates_and_strays_change_nothing() -> None:
    legs_ = DecodeLegs()
    assert legs_.start("r", [1], ["a", "b"])
    assert not legs_.start("r", [2], ["c"])  # the first load stands
    assert not legs_.start("s", [2], [])
    assert legs_.legs("r") == ["a", "b"] and legs_.legs("s") == []
    assert legs_.reported(_ok("c")) is None
    assert legs_.reported(_ok("a")) is None
    assert legs_.reported(_ok("a")) is None  # reported twice
    assert legs_.legs("r") == ["b"]
    assert legs_.in_use() == {"r": 1}


def test_blocks_and_drop() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [5, 6], ["a", "b"])
    assert legs_.blocks("r") == [5, 6] and legs_.blocks("x") == []
    assert legs_.drop("r") == [5, 6] and legs_.drop("r") == []
    assert legs_.reported(_ok("a")) is None and legs_.in_use() == {}


def test_the_first_failure_names_the_request_and_the_slowest_leg_its_latency() -> None:
    legs_ = DecodeLegs()
    legs_.start("r", [1], ["a", "b", "c"])
    early = legs_.reported(LoadOutcome("a", LoadEnd.TIMEOUT, "late", 0.5, fenced=True))
    assert early == Verdict("r", [1], LoadOutcome("r", LoadEnd.TIMEOUT, "late", 0.5, True), False)
    assert legs_.reported(LoadOutcome("b", LoadEnd.PEER_LOST, "gone", 0.9)) is None
    assert legs_.reported(_ok("c", 0.2)) is None
    assert legs_.recent_outcomes() == [LoadOutcome("r", LoadEnd.TIMEOUT, "late", 0.9, True)]
    final = legs_.released("a")
    assert final == Verdict("r", [1], LoadOutcome("r", LoadEnd.TIMEOUT, "late", 0.9, True), True)


MLA_PAIRS = [(1, 2), (1, 4), (2, 4), (3, 4), (2, 2), (2, 1), (4, 1), (4, 2), (3, 2), (8, 3)]


@pytest.mark.parametrize(("prefill_size", "decode_size"), MLA_PAIRS)
def test_mla_each_decode_rank_loads_whole_blocks_from_one_prefill_rank(
    prefill_size: int, decode_size: int
) -> None:
    """Each decode rank loads from one prefill rank; every other prefill rank
    is told to let go by exactly one decode rank, so every rank hears of
    every request (vLLM frees its blocks only once all ranks reported it)."""
    asked: Counter[int] = Counter()
    told: Counter[int] = Counter()
    for d in range(decode_size):
        rank = RankHeads(d, decode_size, 1)
        (leg,) = legs(rank, prefill_size, head_major=False)
        fan_in = len([x for x in range(decode_size) if x % prefill_size == d % prefill_size])
        assert leg == Leg(d % prefill_size, 0, 0, 1, fan_in, True)  # whole blocks, head 0
        asked[leg.prefill_rank] += 1
        mine = spares(rank, prefill_size)
        assert all(p % decode_size == d for p in mine)
        told.update(mine)
    assert set(asked) == set(range(min(prefill_size, decode_size)))
    assert not set(asked) & set(told) and set(told.values()) <= {1}  # each told once
    assert set(asked) | set(told) == set(range(prefill_size))


@pytest.mark.parametrize(
    ("heads", "prefill_size", "decode_size"),
    [(1, 2, 2), (1, 1, 4), (4, 4, 2), (8, 4, 1), (2, 4, 4)],
)
def test_only_mla_with_a_larger_prefill_has_spare_ranks(
    heads: int, prefill_size: int, decode_size: int
) -> None:
    assert all(
        spares(RankHeads(d, decode_size, heads), prefill_size) == [] for d in range(decode_size)
    )
    assert spares(RankHeads(1, 2, 1), 7) == [3, 5]
