"""The prefill core's edges: stale events, groups of loads, counters, defaults.

Each test feeds ``PrefillCore`` (or one of its records) events with an
explicit ``now`` and asserts the whole action list, the request's state and
the counters: what tests/test_handoff_cores.py shows once, here at the
boundaries (a deadline met exactly, the EARLY table full, a group's second
load, a timer gone stale in the step that pops it).
"""

from __future__ import annotations

import msgspec
import pytest
from test_handoff_cores import INFO, LAYOUT, PEER, D, answer, held, push, submit

from kvguard.vllm.actions import AbortTransfer, Release, Reply, Submit
from kvguard.vllm.admission import Admission, Refusal
from kvguard.vllm.peer_ledger import PeerLedger
from kvguard.vllm.prefill_core import MAX_EARLY, PrefillCore
from kvguard.vllm.prefill_records import Bounded, EarlyPushes, PushRecord
from kvguard.vllm.protocol import Abort, Renew, Result
from kvguard.vllm.ranks import RankHeads
from kvguard.vllm.states import LoadEnd
from transfer.plan import BlockSlice

SID = INFO.session_id

# -- records and the peer ledger ---------------------------------------------------------------


def test_a_bounded_memory_forgets_its_oldest_key_first() -> None:
    memory: Bounded[str, int] = Bounded(2)
    memory["a"], memory["b"] = 1, 2
    assert list(memory.items()) == [("a", 1), ("b", 2)]  # at the limit: all kept
    memory["c"] = 3
    assert list(memory.items()) == [("b", 2), ("c", 3)]


def test_early_pushes_count_each_record_and_give_back_one_or_a_whole_request() -> None:
    early = EarlyPushes()
    a, b, c = (
        PushRecord("r", "a", D, None),
        PushRecord("r", "b", D, None),
        PushRecord("s", "c", D, None),
    )
    for rec in (a, b, c):
        early.add(rec)
    assert early.count == 3
    early.take(a)
    assert (early.count, early.get("r", "a"), early.get("r", "b")) == (2, None, b)
    assert early.take_request("r") == [b] and early.count == 1
    assert early.take_request("r") == [] and early.count == 1
    assert early.get("s", "c") is c


def test_the_ledger_tells_a_peer_once_counts_its_loads_and_forgets_it_when_idle() -> None:
    ledger = PeerLedger()
    assert ledger.admit(INFO, 1.0) is True
    assert ledger.admit(INFO, 2.0) is False  # known, unchanged: not told again
    ledger.done(SID)
    assert ledger.admit(INFO, 2.0) is False  # a load that ended told leaves it known
    ledger.done(SID)
    assert ledger.next_idle(10.0) is None  # one load still in flight
    assert ledger.forget_idle(100.0, 10.0) == [] and len(ledger) == 1
    ledger.done(SID)
    assert ledger.next_idle(10.0) == 12.0
    assert ledger.forget_idle(11.9, 10.0) == []
    assert ledger.forget_idle(12.0, 10.0) == [SID]
    assert len(ledger) == 0 and ledger.next_idle(10.0) is None
    assert not ledger._loads  # nothing of a forgotten peer is kept: decodes churn
    assert ledger.admit(INFO, 13.0) is True  # learnt again: told again


def test_a_peer_whose_submits_failed_is_told_again_and_forgotten_cleanly() -> None:
    ledger = PeerLedger()
    ledger.admit(INFO, 1.0)
    ledger.admit(INFO, 1.0)
    ledger.done(SID, told=False)
    ledger.done(SID, told=False)  # its advertisement is already dropped
    assert ledger.forget_idle(11.0, 10.0) == [SID]
    assert ledger.admit(INFO, 12.0) is True


def test_a_refusal_carries_its_reason_and_a_bad_advertisement_is_a_bad_request() -> None:
    refusal = Refusal(LoadEnd.TIMEOUT, "too late")
    assert (str(refusal), refusal.end, refusal.detail) == ("too late", LoadEnd.TIMEOUT, "too late")
    bad = msgspec.structs.replace(PEER, block_base=[*PEER.block_base, PEER.block_base[0]])
    with pytest.raises(Refusal) as info:
        Admission("", None, False, 1).admit(push(peer=bad), 1)
    detail = "peer decode:1: 3 block bases for 2 buffers"
    assert (info.value.end, info.value.detail) == (LoadEnd.BAD_REQUEST, detail)
    core = held()
    assert core.receive(D, push(peer=bad), 100.0, 100.0) == [
        answer("r", "d", LoadEnd.BAD_REQUEST, detail)
    ]


# -- the prefill core --------------------------------------------------------------------------


def test_the_defaults_renew_by_thirty_seconds_up_to_five_minutes_and_slice_one_byte() -> None:
    core = PrefillCore()
    assert core.next_wake() is None and core.drained() and core.held_blocks() == 0
    assert core.hold("r", [1, 2, 3], 110.0, now=100.0) == []
    assert core.held_blocks() == 3 and not core.drained()
    core.receive(D, Renew("r"), 105.0, 105.0)
    assert core.next_wake() == 135.0
    core.receive(D, Renew("r"), 395.0, 395.0)
    assert core.next_wake() == 400.0 and core.stats.renewed == 2
    sliced = PrefillCore(heads=RankHeads(0, 1, 1), head_major=True)
    sliced.hold("r", [1], 110.0, now=100.0)
    (sub,) = sliced.receive(D, push(first_head=0, head_count=2), 100.0, 100.0)
    assert isinstance(sub, Submit) and sub.part == BlockSlice(0, 0, 1)


def test_a_second_hold_of_a_held_request_changes_nothing() -> None:
    core = held(blocks=[1, 2])
    assert core.hold("r", [7, 8, 9], 150.0, now=101.0) == []
    assert (core.holding(), core.held_blocks(), core.stats.held) == (1, 2, 1)
    assert core.hold("s", [3], 150.0, now=101.0) == []
    assert (core.holding(), core.held_blocks(), core.stats.held) == (2, 3, 2)


def test_pushes_read_before_a_hold_past_its_deadline_are_refused_one_by_one() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    for load in ("a", "b", "c"):
        assert core.receive(D, push(load=load), 100.0, 100.0) == []
    # The hold's deadline has passed: the first push is refused and ends the
    # hold, so the others hear why the request is gone.
    assert core.hold("r", [1], 100.0, now=101.0) == [
        answer("r", "a", LoadEnd.TIMEOUT, "the hold or the push deadline has passed"),
        Release("r"),
        answer("r", "b", LoadEnd.UNKNOWN_REQUEST, "request failed: timeout"),
        answer("r", "c", LoadEnd.UNKNOWN_REQUEST, "request failed: timeout"),
    ]
    assert core.drained() and (core.stats.refused, core.stats.loads) == (1, 3)


def test_a_push_meeting_the_deadline_exactly_is_refused_and_one_just_before_starts() -> None:
    core = held(deadline=105.0)
    assert core.receive(D, push(), 105.0, 105.0) == [
        answer("r", "d", LoadEnd.TIMEOUT, "the hold or the push deadline has passed"),
        Release("r"),  # nothing in flight, and the deadline is here
    ]
    core = held(deadline=105.0)
    assert core.receive(D, push(load="e"), 104.5, 104.5) == [
        submit("r", "e", 0, [2], [5], deadline_s=0.5)
    ]


def test_a_group_releases_after_its_last_load_and_counts_each() -> None:
    core = held()
    assert core.receive(D, push(load="a", group=2), 100.0, 100.0) == [submit("r", "a", 0, [2], [5])]
    assert core.receive(D, push(load="b", group=2), 100.0, 100.0) == [
        submit("r", "b", 1, [2], [5], new_peer=False)
    ]
    assert core.released("r", "a", LoadEnd.LOADED, "", 101.0) == [answer("r", "a", LoadEnd.LOADED)]
    assert core.holding() == 1  # "b" still writes
    assert core.released("r", "b", LoadEnd.LOADED, "", 102.0) == [
        answer("r", "b", LoadEnd.LOADED),
        Release("r"),
    ]
    assert (core.stats.pushed, core.stats.done, core.stats.loads) == (2, 2, 2)
    assert core.receive(D, push(load="c"), 103.0, 103.0) == [
        answer("r", "c", LoadEnd.UNKNOWN_REQUEST, "request done")
    ]


def test_a_failed_last_load_fails_the_hold_and_a_late_push_hears_why() -> None:
    core = held()
    core.receive(D, push(), 100.0, 100.0)
    assert core.released("r", "d", LoadEnd.TRANSFER_ERROR, "e", 101.0) == [
        answer("r", "d", LoadEnd.TRANSFER_ERROR, "e"),
        Release("r"),
    ]
    assert core.receive(D, push(load="d2"), 102.0, 102.0) == [
        answer("r", "d2", LoadEnd.UNKNOWN_REQUEST, "request failed: transfer_error")
    ]
    assert (core.stats.failed, core.stats.done) == (1, 0)


def test_a_load_landing_at_the_deadline_ends_an_unsettled_group() -> None:
    core = held(deadline=105.0)
    core.receive(D, push(group=2), 100.0, 100.0)
    assert core.released("r", "d", LoadEnd.LOADED, "", 105.0) == [
        answer("r", "d", LoadEnd.LOADED),
        Release("r"),
    ]


def test_a_hold_renewed_while_loading_expires_at_the_renewed_deadline() -> None:
    core = held(deadline=105.0)
    core.receive(D, push(group=2), 100.0, 100.0)
    core.receive(D, Renew("r"), 104.0, 104.0)  # LOADING: to 134
    assert core.step(106.0) == []  # the old deadline, popped while loading
    assert core.released("r", "d", LoadEnd.LOADED, "", 110.0) == [answer("r", "d", LoadEnd.LOADED)]
    assert core.next_wake() == 134.0
    assert core.step(133.9) == [] and core.step(134.0) == [Release("r")]
    assert core.receive(D, push(load="e"), 135.0, 135.0) == [
        answer("r", "e", LoadEnd.UNKNOWN_REQUEST, "request expired")
    ]


def test_a_renewal_to_the_current_deadline_is_not_counted() -> None:
    core = held(deadline=130.0)  # renew_s 30
    assert core.receive(D, Renew("r"), 100.0, 100.0) == []
    assert core.stats.renewed == 0


def test_one_step_fires_every_due_timer_past_a_stale_one() -> None:
    core = held(deadline=105.0)
    core.receive(D, push(group=2), 100.0, 100.0)
    core.released("r", "d", LoadEnd.LOADED, "", 101.0)  # HELD again: a second timer at 105
    core.hold("s", [3], 106.0, now=100.0)
    core.receive(D, push("x", "e", expires_at=106.5), 100.0, 100.0)  # EARLY until 106.5
    core.hold("t", [4], 107.0, now=100.0)
    assert core.step(108.0) == [
        Release("r"),
        Release("s"),
        answer("x", "e", LoadEnd.UNKNOWN_REQUEST, "never held here"),
        Release("t"),
    ]
    assert core.stats.expired == 3 and core.drained()


def test_an_early_push_taken_by_its_hold_leaves_no_timer_behind() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    core.receive(D, push(), 100.0, 100.0)
    assert core.hold("r", [1], 130.0, now=101.0) == [submit("r", "d", 0, [1], [5], deadline_s=9.0)]
    assert core.next_wake() is None  # loading: no deadline, and the push's wait is over
    assert core.step(111.0) == []


def test_a_copy_of_an_early_push_waits_once_and_is_answered_once() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    assert core.receive(D, push(), 100.0, 100.0) == []
    assert core.receive(D, push(), 100.5, 100.5) == []
    assert core.step(110.0) == [answer("r", "d", LoadEnd.UNKNOWN_REQUEST, "never held here")]
    assert core.drained() and core.stats.loads == 1


def test_an_abort_of_an_early_push_answers_it_at_once() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    core.receive(D, push(), 100.0, 100.0)
    assert core.receive(D, Abort("r", "d"), 100.5, 100.5) == [
        answer("r", "d", LoadEnd.ABORTED, "given up before its push started")
    ]
    assert core.drained() and core.step(110.0) == []
    assert core.hold("r", [1], 130.0, now=101.0) == []  # the load was given up: waits for others


def test_an_abort_of_an_unknown_request_is_answered_and_remembered() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    assert core.receive(D, Abort("x", "d"), 100.0, 100.0) == [
        answer("x", "d", LoadEnd.ABORTED, "no transfer started")
    ]
    assert core.holding() == 0 and core.drained()


def test_an_abort_of_a_refused_load_settles_nothing() -> None:
    core = held()
    core.receive(D, push(compat="x"), 100.0, 100.0)
    assert core.receive(D, Abort("r", "d"), 100.5, 100.5) == [
        answer("r", "d", LoadEnd.ABORTED, "no transfer started")
    ]
    assert core.holding() == 1 and core.stats.aborted == 0


def test_an_abort_settles_one_request_of_a_group_only() -> None:
    core = held()
    assert core.receive(D, Abort("r", "a", group=2), 100.0, 100.0) == [
        answer("r", "a", LoadEnd.ABORTED, "no transfer started")
    ]
    assert core.holding() == 1
    assert core.receive(D, Abort("r", "b"), 100.5, 100.5) == [
        answer("r", "b", LoadEnd.ABORTED, "no transfer started"),
        Release("r"),
    ]
    assert core.receive(D, push(load="c"), 101.0, 101.0) == [
        answer("r", "c", LoadEnd.UNKNOWN_REQUEST, "request aborted")
    ]


def test_forgets_read_before_the_hold_add_up() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    for _ in range(3):
        assert core.receive(D, Abort("r", group=3), 100.0, 100.0) == []
    assert core.hold("r", [1], 130.0, now=101.0) == [Release("r")]
    assert core.hold("s", [1], 130.0, now=101.0) == []
    assert core.receive(D, Abort("s"), 101.0, 101.0) == [Release("s")]
    assert core.stats.aborted == 2


def test_stale_engine_events_for_a_held_request_change_nothing() -> None:
    core = held()
    assert core.submit_failed("r", "nope", "x", 100.0) == []
    core.receive(D, push(compat="x", load="e"), 100.0, 100.0)
    core.receive(D, push(), 100.0, 100.0)
    assert core.submit_failed("r", "d", "boom", 100.5) == [
        answer("r", "d", LoadEnd.REFUSED, "boom")
    ]
    core.receive(D, push(compat="x", load="f"), 100.5, 100.5)
    assert (core.stats.refused, core.stats.pushed, core.holding()) == (3, 0, 1)


def test_the_early_table_holds_at_most_max_early_pushes() -> None:
    core = PrefillCore(block_bytes=LAYOUT.block_bytes)
    for i in range(MAX_EARLY):
        assert core.receive(D, push(f"r{i}"), 100.0, 100.0) == []
    assert core.receive(D, push("full"), 100.0, 100.0) == [
        answer("full", "d", LoadEnd.UNKNOWN_REQUEST, "too many unknown requests")
    ]
    assert core.receive(D, Abort("r0", "d"), 100.0, 100.0)[0] == answer(
        "r0", "d", LoadEnd.ABORTED, "given up before its push started"
    )
    assert core.receive(D, push("next"), 100.0, 100.0) == []  # room again


def test_an_abort_in_flight_asks_kvguard_and_a_released_peer_stays_known() -> None:
    core = held()
    core.receive(D, push(group=2), 100.0, 100.0)
    assert core.receive(D, Abort("r", "d"), 100.5, 100.5) == [AbortTransfer("kvguard-push-0")]
    assert core.released("r", "d", LoadEnd.ABORTED, "", 101.0) == [
        answer("r", "d", LoadEnd.ABORTED)
    ]
    assert core.receive(D, push(load="e"), 101.0, 101.0) == [
        submit("r", "e", 1, [2], [5], new_peer=False, deadline_s=9.0)
    ]
    assert core.malformed(D, ("r", "z"), "x") == [
        Reply(D, Result("r", "z", False, LoadEnd.BAD_REQUEST.value, "x"))
    ]


def test_a_renewal_read_before_its_hold_extends_the_hold_once_it_begins() -> None:
    """A decode renews as soon as its request queues, which may be before
    the prefill's worker has the hold (vLLM hands it over a step after the
    request finished): the renewal is kept, and counted when the hold begins."""
    core = PrefillCore(renew_s=30.0, max_hold_s=60.0)
    assert core.receive(D, Renew("r"), 100.0, 100.0) == []
    assert (core.stats.renewed, core.holding(), core.next_wake()) == (0, 0, None)
    assert core.hold("r", [1], 104.0, now=101.0) == []
    assert core.stats.renewed == 1 and core.next_wake() == 130.0  # 100 + 30, not 104
    assert core.step(129.9) == [] and core.step(130.0) == [Release("r")]
    assert core.hold("s", [2], 140.0, now=131.0) == []
    assert core.next_wake() == 140.0 and core.stats.renewed == 1  # used once, by "r" only


def test_an_early_renewal_never_pins_a_hold_past_the_max_hold() -> None:
    core = PrefillCore(renew_s=30.0, max_hold_s=10.0)
    core.receive(D, Renew("r"), 100.0, 100.0)
    assert core.hold("r", [1], 104.0, now=101.0) == []
    assert core.next_wake() == 111.0  # the cap, 101 + 10, before 100 + 30
    assert core.step(111.0) == [Release("r")]


def test_early_renewals_are_bounded_and_one_for_a_released_hold_is_not_kept() -> None:
    core = PrefillCore(renew_s=30.0, max_hold_s=60.0)
    for i in range(MAX_EARLY + 1):  # a hostile or confused decode: the oldest goes
        core.receive(D, Renew(f"x{i}"), 100.0, 100.0)
    assert core.hold("x0", [1], 104.0, now=101.0) == [] and core.next_wake() == 104.0
    assert core.step(104.0) == [Release("x0")]
    core.receive(D, Renew("x0"), 105.0, 105.0)  # released: kept, it would push "x1" out
    assert core.hold("x1", [2], 106.0, now=105.0) == []
    assert core.next_wake() == 130.0 and core.stats.renewed == 1
