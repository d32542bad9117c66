"""The decode core's edges: stale socket events, timers at their boundaries.

Each test feeds ``DecodeCore`` events with an explicit ``now`` and asserts
the whole action list and ``next_wake``: what tests/test_handoff_cores.py
shows once, here where a timer's exact time, a stale socket number or a
second link decides what happens.
"""

from __future__ import annotations

from test_handoff_cores import EP, PEER, decode, expect, up

from kvguard.vllm.actions import Close, LoadOutcome, Open, Probe, Report, Send, Unfence
from kvguard.vllm.decode_core import DecodeCore
from kvguard.vllm.protocol import Abort, Push, Result
from kvguard.vllm.states import LinkEvent, LoadEnd

EP2 = "tcp://127.0.0.1:7001"
STRANGER = "tcp://127.0.0.1:7009"


def test_the_defaults_stall_after_three_seconds_and_keep_a_quarter_second_margin() -> None:
    core = DecodeCore(PEER)
    assert core.expect("d", EP, "r", [5], 110.0, 1, now=100.0, wall=1000.0) == [Open(EP, 1)]
    assert core.opened(EP, 1, 100.0) == [Send(EP, Push("r", "d", [5], PEER, 1009.75))]
    assert core.step(102.9) == [] and core.step(103.0) == [Open(EP, 2)]


def test_a_push_carries_the_layout_the_heads_and_the_group() -> None:
    core = DecodeCore(PEER, compat="bf16/x", heads=(2, 4))
    core.expect("d", EP, "r", [5], 110.0, 3, now=100.0, wall=1000.0)
    sent = Push("r", "d", [5], PEER, 1009.75, "bf16/x", 3, 2, 4)
    assert core.opened(EP, 1, 100.0) == [Send(EP, sent)]


def test_a_deadline_inside_the_margin_is_not_asked_and_one_just_past_it_is() -> None:
    core = decode()
    assert core.expect("d", EP, "r", [5], 100.25, 1, now=100.0, wall=1000.0) == [
        Report(LoadOutcome("d", LoadEnd.TIMEOUT, "deadline passed before asking", 0.0))
    ]
    assert core.expect("e", EP, "r", [5], 100.75, 1, now=100.0, wall=1000.0) == [Open(EP, 1)]


def test_a_push_that_fails_the_prefills_checks_is_reported_with_why() -> None:
    core = decode()
    detail = "bad message from decode: Expected `str` of length >= 1 - at `$.request_id`"
    assert core.expect("e", EP, "", [1], 110.0, 1, 100.0, 1000.0) == [
        Report(LoadOutcome("e", LoadEnd.BAD_REQUEST, detail, 0.0))
    ]


def test_a_second_load_on_an_open_link_is_sent_at_once() -> None:
    core = decode()
    up(core)
    assert core.expect("e", EP, "s", [6], 120.0, 1, now=101.0, wall=1001.0) == [
        Send(EP, Push("s", "e", [6], PEER, 1001.0 + 19.0 - 0.25))
    ]
    assert core.forget(EP, "t", 101.0, group=3) == [Send(EP, Abort("t", group=3))]


def test_a_cancel_of_an_unknown_or_cancelled_load_sends_nothing() -> None:
    core = decode()
    up(core)
    assert core.cancel("nope", 101.0) == []
    assert core.cancel("d", 101.0) == [Send(EP, Abort("r", "d"))]
    assert core.cancel("d", 101.5) == []


def test_a_verdict_is_asked_for_with_the_group_every_stall_period() -> None:
    core = decode()
    core.expect("d", EP, "r", [5], 110.0, 2, now=100.0, wall=1000.0)
    core.opened(EP, 1, 100.0)
    core.link_event(EP, 1, LinkEvent.HANDSHAKE, 100.0)
    assert core.cancel("d", 101.0) == [Send(EP, Abort("r", "d", 2))]
    assert core.step(103.9) == [] and core.step(104.0) == [Send(EP, Abort("r", "d", 2))]
    assert core.next_wake() == 107.0


def test_a_verdict_due_while_the_link_is_down_is_asked_on_the_remade_link() -> None:
    core = decode()
    expect(core)
    core.opened(EP, 1, 100.0)  # never answered
    assert core.cancel("d", 100.5) == [Send(EP, Abort("r", "d"))]
    assert core.step(103.0) == [Open(EP, 2)]  # stalled: remade
    assert core.step(103.5) == []  # not up: its handshake asks
    assert core.next_wake() == 106.5
    assert core.opened(EP, 2, 104.0) == [Send(EP, Abort("r", "d"))]
    assert core.link_event(EP, 2, LinkEvent.HANDSHAKE, 105.0) == [Send(EP, Abort("r", "d"))]
    assert core.result(EP, Result("r", "d", False, "aborted"), 105.5) == [
        Report(LoadOutcome("d", LoadEnd.ABORTED, "", 5.5))
    ]


def test_a_reask_made_stale_by_a_new_handshake_does_not_fire() -> None:
    core = decode()
    up(core)
    core.cancel("d", 101.0)  # asks again at 104
    assert core.link_event(EP, 1, LinkEvent.DROPPED, 102.0) == []  # cancelled: not fenced
    assert core.link_event(EP, 1, LinkEvent.HANDSHAKE, 102.5) == [Send(EP, Abort("r", "d"))]
    assert core.step(104.0) == []  # asked at 102.5: next at 105.5
    assert core.step(105.5) == [Send(EP, Abort("r", "d"))]


def test_a_load_over_before_its_deadline_leaves_the_link_to_close_idle() -> None:
    core = decode()
    up(core)
    core.result(EP, Result("r", "d", True), 100.2)
    assert core.next_wake() == 160.0  # idle since its last expect
    assert core.step(110.0) == []  # its deadline: over already
    assert core.step(159.9) == [] and core.step(160.0) == [Close(EP)] and core.links() == 0


def test_a_link_with_loads_wakes_for_their_deadline_only() -> None:
    core = decode()
    p = expect(core, deadline=200.0)
    assert core.opened(EP, 1, 100.0) == [Send(EP, p)]
    assert core.link_event(EP, 1, LinkEvent.HANDSHAKE, 100.0) == []
    assert core.next_wake() == 103.0  # the stall check armed at the open fires once, idle
    assert core.step(103.0) == [] and core.next_wake() == 200.0
    idle = decode()
    idle.renew(EP, "r", 100.0)
    idle.opened(EP, 1, 100.0)
    idle.forget(EP, "r", 101.0)
    assert idle.next_wake() == 161.0


def test_events_for_another_endpoint_or_socket_are_ignored() -> None:
    core = decode()
    p = expect(core)
    assert core.opened(STRANGER, 1, 100.0) == []
    assert core.opened(EP, 9, 100.0) == []  # not the socket asked for
    assert core.open_failed(STRANGER, 1, "x", 100.0) == []
    assert core.open_failed(EP, 9, "x", 100.0) == []
    assert core.echoed(STRANGER, 1, 100.0) == []
    assert core.link_event(STRANGER, 1, LinkEvent.DROPPED, 100.0) == []
    assert core.probed(STRANGER, True, 100.0) == []
    assert core.opened(EP, 1, 100.0) == [Send(EP, p)]
    assert core.echoed(EP, 2, 100.0) == []  # not the open socket
    assert core.probed(EP, True, 100.0) == []  # not lost: a probe's answer proves nothing
    assert core.waiting() == 1


def test_a_failed_remake_backs_off_twice_as_long_again() -> None:
    core = decode()
    p = expect(core, deadline=200.0)
    core.opened(EP, 1, 100.0)
    assert core.step(103.0) == [Open(EP, 2)]
    assert core.opened(EP, 2, 103.0) == [Send(EP, p)]
    assert core.step(109.0) == [Open(EP, 3)]
    assert core.open_failed(EP, 3, "EMFILE", 109.0) == []
    assert core.step(120.9) == [] and core.step(121.0) == [Open(EP, 4)]  # 3 s * 2**2


def test_a_handshake_resets_the_backoff() -> None:
    core = decode()
    p = expect(core, deadline=200.0)
    core.opened(EP, 1, 100.0)
    assert core.step(103.0) == [Open(EP, 2)]
    assert core.opened(EP, 2, 103.0) == [Send(EP, p)]
    assert core.link_event(EP, 2, LinkEvent.HANDSHAKE, 103.5) == []
    what = f"prefill {EP}: connection dropped"
    assert core.link_event(EP, 2, LinkEvent.DROPPED, 104.0) == [
        Report(LoadOutcome("d", LoadEnd.PEER_LOST, what, 4.0, True))
    ]
    assert core.step(104.0) == [Probe(EP)]
    assert core.step(108.0) == [Probe(EP)]  # a probe first, then the stall due at 107
    assert core.step(108.0) == [Open(EP, 3)]


def test_one_probe_a_step_the_next_link_probed_the_step_after() -> None:
    core = decode()
    up(core)
    core.expect("e", EP2, "s", [6], 110.0, 1, now=100.0, wall=1000.0)
    core.opened(EP2, 2, 100.0)
    core.link_event(EP2, 2, LinkEvent.HANDSHAKE, 100.0)
    assert len(core.link_event(EP, 1, LinkEvent.DROPPED, 101.0)) == 1
    assert len(core.link_event(EP2, 2, LinkEvent.DROPPED, 101.0)) == 1
    assert core.step(101.0) == [Probe(EP)]
    assert core.step(101.0) == [Probe(EP2)]
    assert core.step(101.0) == []
    assert core.next_wake() == 101.5


def test_a_probe_finding_nothing_ends_fenced_and_asked_loads_alike() -> None:
    core = decode()
    up(core)
    core.link_event(EP, 1, LinkEvent.DROPPED, 101.0)
    assert core.expect("e", EP, "s", [6], 120.0, 1, now=101.5, wall=1001.5) == [
        Send(EP, Push("s", "e", [6], PEER, 1001.5 + 18.5 - 0.25))
    ]
    what = f"prefill {EP}: connection refused"
    assert core.probed(EP, True, 102.0) == [
        Unfence("d"),
        Report(LoadOutcome("e", LoadEnd.PEER_LOST, what, 0.5)),
        Close(EP),
    ]
    assert core.drained()


def test_a_lost_link_remade_stays_lost_and_a_probe_still_ends_its_loads() -> None:
    core = decode()
    up(core)
    core.link_event(EP, 1, LinkEvent.DROPPED, 101.0)
    assert core.step(101.0) == [Probe(EP)]
    assert core.step(104.0) == [Probe(EP)]
    assert core.step(104.0) == [Open(EP, 2)]  # stalled since the drop
    assert core.opened(EP, 2, 104.1) == [Send(EP, Abort("r", "d"))]
    assert core.probed(EP, True, 104.2) == [Unfence("d"), Close(EP)]


def test_a_link_that_came_up_late_keeps_its_loads_past_the_idle_time() -> None:
    core = decode()
    p = expect(core, deadline=300.0)
    core.opened(EP, 1, 100.0)
    assert core.step(103.0) == [Open(EP, 2)]
    assert core.opened(EP, 2, 170.0) == [Send(EP, p)]  # a slow remake
    assert core.link_event(EP, 2, LinkEvent.HANDSHAKE, 171.0) == []
    assert core.step(176.0) == [] and core.links() == 1  # its stall check, now moot


def test_a_probe_due_at_one_second_of_the_clock_is_still_made() -> None:
    core = decode()
    assert core.expect("d", EP, "r", [5], 10.0, 1, now=0.0, wall=1000.0) == [Open(EP, 1)]
    core.opened(EP, 1, 0.0)
    core.link_event(EP, 1, LinkEvent.HANDSHAKE, 0.0)
    assert len(core.link_event(EP, 1, LinkEvent.DROPPED, 0.5)) == 1
    assert core.step(0.5) == [Probe(EP)]
    assert core.next_wake() == 1.0 and core.step(1.0) == [Probe(EP)]


def test_a_push_asks_for_a_digest_when_the_decode_verifies() -> None:
    core = DecodeCore(PEER, verify=True)
    core.expect("d", EP, "r", [5], 110.0, 1, now=100.0, wall=1000.0)
    sent = Push("r", "d", [5], PEER, 1009.75, verify=True)
    assert core.opened(EP, 1, 100.0) == [Send(EP, sent)]


def test_a_denied_handshake_ends_every_load_of_a_new_link_at_once_unfenced() -> None:
    """CURVE: the prefill refused this decode's key. Nothing was delivered
    (frames flow only after a handshake): every load over, ``denied``, and
    the link closed; a later load dials afresh."""
    core = decode()
    p = expect(core)
    assert core.opened(EP, 1, 100.0) == [Send(EP, p)]
    what = f"prefill {EP}: {LinkEvent.DENIED.value}"
    assert core.link_event(EP, 1, LinkEvent.DENIED, 100.5) == [
        Report(LoadOutcome("d", LoadEnd.DENIED, what, 0.5)),
        Close(EP),
    ]
    assert core.links() == 0 and core.drained()
    assert core.expect("e", EP, "r", [6], 120.0, 1, now=101.0, wall=1001.0) == [Open(EP, 2)]


def test_a_denial_on_a_link_that_was_up_changes_nothing() -> None:
    """A key revoked while loads run: what was sent may still be written,
    so those loads wait for a Result, a probe or their deadline."""
    core = decode()
    up(core)
    assert core.link_event(EP, 1, LinkEvent.DENIED, 100.5) == []
    assert core.waiting() == 1
