"""The hand-off's sans-I/O cores and tables, one documented behaviour each.

No socket, thread or clock: each test feeds ``PrefillCore`` or ``DecodeCore``
events with an explicit ``now`` and asserts the exact actions they return
(the whole list: what is sent, to whom, with which reason). The randomized
search over both cores together is tests/test_handoff_sim.py.
"""

from __future__ import annotations

import enum

import pytest

from kvguard.vllm.actions import (
    AbortTransfer,
    Close,
    ForgetPeer,
    LoadOutcome,
    Open,
    Probe,
    Release,
    Reply,
    Report,
    Send,
    Submit,
    Unfence,
)
from kvguard.vllm.decode_core import DecodeCore
from kvguard.vllm.prefill_core import PrefillCore
from kvguard.vllm.protocol import Abort, Push, Renew, Result
from kvguard.vllm.ranks import RankHeads
from kvguard.vllm.states import (
    HOLD,
    LINK,
    LOAD,
    PUSH,
    REQUEST,
    TABLES,
    HoldState,
    LinkEvent,
    LoadEnd,
    LoadState,
)
from lifecycle import Edge, FailureReason, StateTable, TableError
from transfer import KVCache, KVLayout
from transfer.peer_protocol import peer_info_of, peer_message_of
from transfer.plan import BlockSlice

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_bytes=256, kv_split=False)
PEER = peer_message_of(KVCache(LAYOUT).peer_info("decode:1"))
INFO = peer_info_of(PEER)
EP = "tcp://127.0.0.1:7000"
D = b"decode-1"  # a decode's ROUTER identity


def push(rid: str = "r", load: str = "d", blocks: list[int] | None = None, **kw: object) -> Push:
    args: dict[str, object] = dict(
        request_id=rid, load_id=load, blocks=blocks or [5], peer=PEER, expires_at=110.0
    )
    args.update(kw)
    return Push(**args)  # type: ignore[arg-type]


def answer(rid: str, load: str, end: LoadEnd, detail: str = "") -> Reply:
    return Reply(D, Result(rid, load, end.ok, end.reason, detail))


# -- tables ------------------------------------------------------------------------------------


class _S(enum.Enum):
    A = 1
    B = 2
    C = 3


@pytest.mark.parametrize(
    ("edges", "terminal", "message"),
    [
        ([Edge(_S.A, "x", _S.C), Edge(_S.C, "y", _S.B)], [_S.C], "t: terminal state C has an edge"),
        ([Edge(_S.A, "x", _S.C)], [_S.C], "t: unreachable from A: ['B']"),
        ([Edge(_S.A, "x", _S.B), Edge(_S.B, "y", _S.A)], [_S.C], "t: unreachable from A: ['C']"),
        (
            [Edge(_S.A, "x", _S.B), Edge(_S.A, "y", _S.C), Edge(_S.B, "z", _S.B)],
            [_S.C],
            "t: cannot reach a terminal state: ['B']",
        ),
        ([Edge(_S.A, "x", _S.B), Edge(_S.B, "y", _S.C)], [], "t: no terminal state"),
    ],
)
def test_a_bad_table_fails_at_import_naming_the_fault(
    edges: list[Edge[_S]], terminal: list[_S], message: str
) -> None:
    with pytest.raises(TableError) as info:
        StateTable("t", "T", _S, edges, _S.A, terminal)
    assert str(info.value).startswith(message)


def test_every_hand_off_table_has_absorbing_terminals_and_no_stranded_state() -> None:
    assert [t.name for t in TABLES] == ["hold", "push", "load", "link", "request"]
    for table in TABLES:
        for s in table.states:
            ends = {e.dest for e in table.edges if e.source is s}
            assert (s in table.terminal) == (not ends), (table.name, s)


def test_move_refuses_an_edge_the_table_lacks_and_leaves_the_state() -> None:
    class Rec:
        state = LoadState.OVER

    rec = Rec()
    with pytest.raises(TableError, match="load d1: cannot go from OVER to ASKED"):
        LOAD.move(rec, LoadState.ASKED, "d1")
    assert rec.state is LoadState.OVER
    assert HOLD.allows(HoldState.LOADING, HoldState.HELD)
    assert not HOLD.allows(HoldState.RELEASED, HoldState.HELD)


def test_the_diagram_draws_each_table_from_its_edges() -> None:
    text = LINK.render_markdown("kvguard/vllm/states.py")
    assert "title: Decode: the link to a prefill" in text
    assert "  DIALING --> UP: handshake" in text
    assert "  CLOSED --> [*]" in text
    assert text.count("\n| ") == len(LINK.edges) + 1  # a row an edge, and the header
    assert "  [*] --> NEW" in PUSH.render_mermaid()
    assert "  FINISHED --> [*]" in REQUEST.render_mermaid()


# -- reasons ---------------------------------------------------------------------------------


def test_a_prefill_reason_maps_once_and_never_to_success() -> None:
    assert LoadEnd.of_result(True, "anything") is LoadEnd.LOADED
    assert LoadEnd.of_result(False, "peer_lost") is LoadEnd.PEER_LOST
    assert LoadEnd.of_result(False, "loaded") is LoadEnd.PREFILL_ERROR  # ok False wins
    assert LoadEnd.of_result(False, "from a newer prefill") is LoadEnd.PREFILL_ERROR
    assert LoadEnd.of_failure(None) is LoadEnd.LOADED
    assert {LoadEnd.of_failure(r).value for r in FailureReason} == {r.value for r in FailureReason}
    assert (LoadEnd.LOADED.reason, LoadEnd.TIMEOUT.reason) == ("", "timeout")


# -- the prefill -------------------------------------------------------------------------------


def held(rid: str = "r", blocks: list[int] | None = None, deadline: float = 130.0) -> PrefillCore:
    core = PrefillCore(renew_s=30.0, max_hold_s=60.0, block_bytes=LAYOUT.block_bytes)
    assert core.hold(rid, blocks or [1, 2], deadline, now=100.0) == []
    return core


def submit(rid: str, load: str, n: int, src: list[int], dst: list[int], **kw: object) -> Submit:
    args: dict[str, object] = dict(
        request_id=rid,
        load_id=load,
        transfer=f"kvguard-push-{n}",
        src=src,
        dst=dst,
        peer=INFO,
        new_peer=True,
        deadline_s=10.0,
        part=None,
    )
    args.update(kw)
    return Submit(**args)  # type: ignore[arg-type]


def test_a_push_moves_the_tail_blocks_and_its_release_frees_the_hold() -> None:
    core = held(blocks=[1, 2, 3])
    acts = core.receive(D, push(blocks=[7, 8]), now=100.0, wall=100.0)
    assert acts == [submit("r", "d", 0, [2, 3], [7, 8])]
    assert core.released("r", "d", LoadEnd.LOADED, "", now=101.0) == [
        answer("r", "d", LoadEnd.LOADED),
        Release("r"),
    ]
    assert core.drained() and (core.stats.done, core.stats.loads) == (1, 1)
    late = core.receive(D, push(load="d2"), now=102.0, wall=102.0)
    assert late == [answer("r", "d2", LoadEnd.UNKNOWN_REQUEST, "request done")]


def test_a_group_holds_until_every_child_settled() -> None:
    core = held()
    assert len(core.receive(D, push(load="a", group=3), 100.0, 100.0)) == 1
    assert core.released("r", "a", LoadEnd.LOADED, "", 101.0) == [answer("r", "a", LoadEnd.LOADED)]
    assert core.holding() == 1  # two more children may push
    assert core.receive(D, Abort("r"), 101.0, 101.0) == []  # one will never push
    assert core.receive(D, Abort("r", "c"), 102.0, 102.0) == [
        answer("r", "c", LoadEnd.ABORTED, "no transfer started"),
        Release("r"),
    ]
    assert core.stats.aborted == 1


def test_a_refused_push_settles_nothing_and_its_copy_starts_nothing() -> None:
    core = held()
    bad = core.receive(D, push(compat="float16/x"), 100.0, 100.0)
    assert bad == [
        answer("r", "d", LoadEnd.INCOMPATIBLE, "KV layouts differ: decode 'float16/x', prefill ''")
    ]
    assert core.receive(D, push(), 100.5, 100.5) == []  # the same load again
    assert core.holding() == 1 and core.stats.refused == 1
    assert len(core.receive(D, push(load="d2"), 101.0, 101.0)) == 1  # another may still ask


@pytest.mark.parametrize(
    ("kw", "end", "detail"),
    [
        ({"blocks": [1, 2, 3]}, LoadEnd.BAD_REQUEST, "decode asks for 3 blocks, request r has 2"),
        ({"expires_at": 99.0}, LoadEnd.TIMEOUT, "the hold or the push deadline has passed"),
        (
            {"first_head": 4, "head_count": 4},
            LoadEnd.INCOMPATIBLE,
            "the decode rank holds KV heads [4, 8), this prefill rank [0, 4): none in common",
        ),
        (
            {"first_head": 2, "head_count": 4},
            LoadEnd.INCOMPATIBLE,
            "the decode rank holds KV heads [2, 6), this prefill rank [0, 4): a share of a "
            "block needs heads outermost",
        ),
    ],
)
def test_a_push_that_cannot_start_is_answered_at_once(
    kw: dict[str, object], end: LoadEnd, detail: str
) -> None:
    core = PrefillCore(heads=RankHeads(0, 2, 8), block_bytes=LAYOUT.block_bytes)
    core.hold("r", [1, 2], 130.0, now=100.0)
    assert core.receive(D, push(**kw), 100.0, 100.0) == [answer("r", "d", end, detail)]
    assert core.holding() == 1 and core.stats.refused == 1


def test_a_rank_holding_part_of_the_decodes_heads_writes_that_slice() -> None:
    core = PrefillCore(heads=RankHeads(1, 2, 8), head_major=True, block_bytes=256)
    core.hold("r", [1, 2], 130.0, now=100.0)
    (sub,) = core.receive(D, push(first_head=0, head_count=8), 100.0, 100.0)
    assert isinstance(sub, Submit) and sub.part == BlockSlice(0, 4 * 64, 4 * 64)


def test_a_push_before_its_hold_waits_for_it_then_expires_unanswered_by_the_engine() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    assert core.receive(D, push(), 100.0, 100.0) == []
    assert core.next_wake() == 110.0  # its own expiry, under EARLY_WAIT_S
    assert core.step(109.9) == []
    assert core.step(110.0) == [answer("r", "d", LoadEnd.UNKNOWN_REQUEST, "never held here")]
    assert core.drained()
    early = PrefillCore(block_bytes=LAYOUT.block_bytes)
    early.receive(D, push(), 100.0, 100.0)
    acts = early.hold("r", [1], 130.0, 101.0)
    assert acts == [submit("r", "d", 0, [1], [5], deadline_s=9.0)]


def test_a_forget_read_before_its_hold_is_counted_in_it() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    assert core.receive(D, Abort("r"), 100.0, 100.0) == []
    assert core.hold("r", [1], 130.0, 101.0) == [Release("r")]
    assert core.stats.aborted == 1


def test_an_abort_in_flight_waits_for_the_release_and_a_later_push_is_refused() -> None:
    core = held()
    core.receive(D, push(), 100.0, 100.0)
    assert core.receive(D, Abort("r", "d"), 100.5, 100.5) == [AbortTransfer("kvguard-push-0")]
    assert core.holding() == 1  # the transfer may still write
    assert core.released("r", "d", LoadEnd.ABORTED, "x", 101.0) == [
        answer("r", "d", LoadEnd.ABORTED, "x"),
        Release("r"),
    ]
    other = held("s")
    assert other.receive(D, Abort("s", "e"), 100.0, 100.0)[0] == answer(
        "s", "e", LoadEnd.ABORTED, "no transfer started"
    )
    assert other.receive(D, push("s", "e"), 100.1, 100.1) == [
        answer("s", "e", LoadEnd.ABORTED, "the decode gave this load up before")
    ]


def test_a_hold_expires_at_its_deadline_only_with_nothing_in_flight() -> None:
    core = held(deadline=105.0)
    core.receive(D, push(), 100.0, 100.0)
    assert core.step(106.0) == []  # LOADING: its release ends it
    assert core.released("r", "d", LoadEnd.TRANSFER_ERROR, "e", 107.0) == [
        answer("r", "d", LoadEnd.TRANSFER_ERROR, "e"),
        Release("r"),
    ]
    assert core.stats.by_reason == {"transfer_error": 1}
    idle = held(deadline=105.0)
    assert idle.step(104.9) == [] and idle.step(105.0) == [Release("r")]
    assert idle.stats.expired == 1


def test_renewals_extend_a_hold_up_to_its_maximum_only() -> None:
    core = held(deadline=130.0)  # max_hold_s 60: never past 160
    core.receive(D, Renew("r"), 120.0, 120.0)
    assert core.next_wake() == 150.0
    core.receive(D, Renew("r"), 145.0, 145.0)
    assert core.next_wake() == 160.0 and core.stats.renewed == 2
    assert core.step(159.9) == [] and core.step(160.0) == [Release("r")]


def test_a_failed_submit_is_refused_and_the_peer_told_again_next_time() -> None:
    core = held()
    core.receive(D, push(), 100.0, 100.0)
    assert core.submit_failed("r", "d", "boom", 100.125) == [
        answer("r", "d", LoadEnd.REFUSED, "boom")
    ]
    assert (core.stats.pushed, core.stats.refused) == (0, 1)
    again = core.receive(D, push(load="d2"), 100.25, 100.25)
    assert again == [submit("r", "d2", 1, [2], [5], deadline_s=9.75)]  # new_peer again


def test_an_idle_peer_is_forgotten() -> None:
    core = held()
    core.receive(D, push(), 100.0, 100.0)
    core.released("r", "d", LoadEnd.LOADED, "", 101.0)
    assert core.peers() == 1 and core.next_wake() == 400.0
    assert core.step(399.0) == [] and core.step(400.0) == [ForgetPeer("decode:1")]
    assert core.peers() == 0


# -- the decode --------------------------------------------------------------------------------


def decode() -> DecodeCore:
    return DecodeCore(PEER, stall_s=3.0, margin_s=0.25)


def expect(core: DecodeCore, rid: str = "d", deadline: float = 110.0) -> Push:
    """Expect ``rid`` on a new link; the push it sends once the link opens."""
    assert core.expect(rid, EP, "r", [5], deadline, 1, now=100.0, wall=1000.0) == [Open(EP, 1)]
    return Push("r", rid, [5], PEER, 1000.0 + deadline - 100.0 - 0.25)


def up(core: DecodeCore) -> Push:
    p = expect(core)
    assert core.opened(EP, 1, 100.0) == [Send(EP, p)]
    assert core.link_event(EP, 1, LinkEvent.HANDSHAKE, 100.01) == []
    return p


def test_a_result_reports_the_load_once_unfenced() -> None:
    core = decode()
    up(core)
    assert core.result(EP, Result("r", "d", True), 100.2) == [
        Report(LoadOutcome("d", LoadEnd.LOADED, "", 100.2 - 100.0))
    ]
    assert core.result(EP, Result("r", "d", True), 100.3) == []  # once
    assert core.drained()


def test_bad_input_fails_the_load_at_once_and_sends_nothing() -> None:
    core = decode()
    assert core.expect("d", "ipc://x", "r", [1], 110.0, 1, 100.0, 1000.0) == [
        Report(
            LoadOutcome(
                "d",
                LoadEnd.BAD_ENDPOINT,
                "'ipc://x': expected tcp://HOST:PORT or HOST:PORT, got 'ipc://x'",
                0.0,
            )
        )
    ]
    (bad,) = core.expect("e", EP, "", [1], 110.0, 1, 100.0, 1000.0)
    assert isinstance(bad, Report) and bad.outcome.end is LoadEnd.BAD_REQUEST
    assert core.expect("f", EP, "r", [1], 100.2, 1, 100.0, 1000.0) == [
        Report(LoadOutcome("f", LoadEnd.TIMEOUT, "deadline passed before asking", 0.0))
    ]
    assert core.links() == 0


def test_a_dropped_link_fences_until_a_probe_finds_nothing_listening() -> None:
    core = decode()
    up(core)
    what = f"prefill {EP}: connection dropped"
    assert core.link_event(EP, 1, LinkEvent.DROPPED, 101.0) == [
        Report(LoadOutcome("d", LoadEnd.PEER_LOST, what, 1.0, True))
    ]
    assert core.step(101.0) == [Probe(EP)]
    assert core.probed(EP, False, 101.0) == []  # something listens: a frozen prefill
    assert core.step(101.4) == [] and core.step(101.5) == [Probe(EP)]
    assert core.probed(EP, True, 101.5) == [Unfence("d"), Close(EP)]
    assert core.drained() and core.links() == 0


def test_a_link_that_never_came_up_and_is_refused_fails_unfenced() -> None:
    core = decode()
    expect(core)
    core.opened(EP, 1, 100.0)
    assert core.link_event(EP, 1, LinkEvent.CONNECTED, 100.0) == []  # noted only
    assert core.link_event(EP, 1, LinkEvent.REFUSED, 100.125) == [
        Report(LoadOutcome("d", LoadEnd.PEER_LOST, f"prefill {EP}: connection refused", 0.125)),
        Close(EP),
    ]


def test_the_deadline_fences_and_asks_for_the_verdict_until_it_comes() -> None:
    core = decode()
    up(core)
    why = "no verdict from the prefill by the deadline"
    assert core.step(110.0) == [
        Send(EP, Abort("r", "d")),
        Report(LoadOutcome("d", LoadEnd.TIMEOUT, why, 10.0, True)),
    ]
    assert core.step(112.9) == [] and core.step(113.0) == [Send(EP, Abort("r", "d"))]
    assert core.result(EP, Result("r", "d", False, "aborted"), 113.1) == [Unfence("d")]


def test_a_cancel_is_reported_with_the_verdict_not_before() -> None:
    core = decode()
    up(core)
    assert core.cancel("d", 101.0) == [Send(EP, Abort("r", "d"))]
    assert core.step(111.0) == [Send(EP, Abort("r", "d"))]  # re-asked, not timed out
    assert core.result(EP, Result("r", "d", False, "aborted"), 111.5) == [
        Report(LoadOutcome("d", LoadEnd.ABORTED, "", 11.5))
    ]


def test_a_stalled_link_is_remade_backing_off_and_asks_again() -> None:
    core = decode()
    p = expect(core, deadline=200.0)
    core.opened(EP, 1, 100.0)
    assert core.step(102.5) == [] and core.step(103.0) == [Open(EP, 2)]
    assert core.opened(EP, 2, 103.0) == [Send(EP, p)]
    assert core.step(108.5) == [] and core.step(109.0) == [Open(EP, 3)]  # twice as long
    assert core.open_failed(EP, 3, "EMFILE", 109.0) == []  # the old socket stays
    assert core.link_event(EP, 2, LinkEvent.DROPPED, 110.0) == [
        Report(LoadOutcome("d", LoadEnd.PEER_LOST, f"prefill {EP}: connection dropped", 10.0, True))
    ]  # a remade link's drop proves nothing: fenced
    assert core.link_event(EP, 1, LinkEvent.HANDSHAKE, 110.1) == []  # the old socket's
    assert core.link_event(EP, 2, LinkEvent.HANDSHAKE, 110.2) == [Send(EP, Abort("r", "d"))]


def test_a_first_socket_that_cannot_be_made_fails_its_loads_as_bad_endpoints() -> None:
    core = decode()
    expect(core)
    assert core.open_failed(EP, 1, "EINVAL", 100.0) == [
        Report(LoadOutcome("d", LoadEnd.BAD_ENDPOINT, f"{EP!r}: EINVAL", 0.0))
    ]
    assert core.links() == 0


def test_our_own_push_come_back_is_proof_nothing_listens() -> None:
    core = decode()
    up(core)
    what = f"prefill {EP}: connected to itself, nothing listens there"
    assert core.echoed(EP, 1, 100.1) == [
        Report(LoadOutcome("d", LoadEnd.PEER_LOST, what, 100.1 - 100.0)),
        Close(EP),
    ]


def test_an_idle_link_closes_and_renewals_and_forgets_reach_the_prefill() -> None:
    core = decode()
    assert core.renew(EP, "r", 100.0) == [Open(EP, 1)]
    assert core.opened(EP, 1, 100.0) == [Send(EP, Renew("r"))]
    assert core.forget(EP, "r", 101.0) == [Send(EP, Abort("r"))]
    assert core.step(160.9) == [] and core.step(161.0) == [Close(EP)]


def test_a_result_for_another_link_or_request_marks_nothing() -> None:
    core = decode()
    up(core)
    assert core.result("tcp://127.0.0.1:7001", Result("r", "d", True), 100.1) == []
    assert core.result(EP, Result("other", "d", True), 100.1) == []
    unknown = core.result(EP, Result("r", "d", False, "from the future", "x"), 100.2)
    assert unknown == [
        Report(LoadOutcome("d", LoadEnd.PREFILL_ERROR, "from the future: x", 100.2 - 100.0))
    ]


def test_a_forget_that_declares_its_group_does_not_end_the_hold_its_siblings_load() -> None:
    """A declared group's first request leaves before any sibling pushed:
    its forget names the group, so the hold waits for the others."""
    core = held()
    assert core.receive(D, Abort("r", group=2), 100.0, 100.0) == []
    assert core.holding() == 1
    assert len(core.receive(D, push(load="b"), 100.5, 100.5)) == 1
    assert core.released("r", "b", LoadEnd.LOADED, "", 101.0) == [
        answer("r", "b", LoadEnd.LOADED),
        Release("r"),
    ]
    early = PrefillCore(block_bytes=LAYOUT.block_bytes)
    early.receive(D, Abort("r", group=3), 100.0, 100.0)
    early.receive(D, Abort("r", group=2), 100.0, 100.0)
    assert early.hold("r", [1], 130.0, 101.0) == []  # two of three said so
    assert early.receive(D, Abort("r"), 101.5, 101.5) == [Release("r")]


def test_a_malformed_message_is_answered_only_when_its_ids_parse() -> None:
    core = PrefillCore()
    assert core.malformed(D, None, "garbage") == []
    assert core.malformed(D, ("r", "d"), "bad message from decode: x") == [
        answer("r", "d", LoadEnd.BAD_REQUEST, "bad message from decode: x")
    ]


def test_late_or_stray_engine_events_change_nothing() -> None:
    """A release or a failed submit for a load not in flight (unknown, or
    already answered) is stale: no answer, no release, no count."""
    core = held()
    assert core.released("r", "nope", LoadEnd.LOADED, "", 100.0) == []
    assert core.submit_failed("nope", "d", "x", 100.0) == []
    core.receive(D, push(), 100.0, 100.0)
    assert core.released("r", "d", LoadEnd.LOADED, "", 101.0)[-1] == Release("r")
    assert core.released("r", "d", LoadEnd.LOADED, "", 101.5) == []
    assert core.submit_failed("r", "d", "x", 101.5) == []
    refused = held("s")
    refused.receive(D, push("s", "e", compat="x"), 100.0, 100.0)
    assert refused.submit_failed("s", "e", "x", 100.5) == []  # refused, not in flight
    assert (core.stats.done, core.stats.refused, refused.stats.refused) == (1, 0, 1)


def test_a_renewal_never_shortens_a_hold_and_an_unknown_one_is_ignored() -> None:
    core = held(deadline=130.0)
    assert core.receive(D, Renew("r"), 90.0, 90.0) == []  # 120 < 130: kept
    assert core.next_wake() == 130.0 and core.stats.renewed == 0
    assert core.receive(D, Renew("other"), 100.0, 100.0) == []
    assert core.stats.renewed == 0 and core.holding() == 1
