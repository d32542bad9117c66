"""The hand-off simulation (``handoff_sim``): random worlds, throughput, seeded bugs.

* ``test_random_worlds_keep_every_invariant``: hypothesis draws a seed and a
  world (tensor parallel sizes, timings, fault and client rates) and runs it
  to rest; every invariant of ``handoff_sim`` is checked after every event.
* ``test_throughput``: at least ``KVGUARD_SIM_REQUESTS`` decode requests
  (100,000 unless set) over seeded worlds with the default fault mix, with
  the simulated requests per second printed. A longer run is one variable
  away: ``KVGUARD_SIM_REQUESTS=1000000 .venv/bin/pytest -q -s -k throughput
  tests/test_handoff_sim.py``.
* ``test_each_seeded_bug_is_found_on_every_seed``: each of ``SEEDED_BUGS``
  (defects this code had, planted by monkeypatching the cores) must be
  caught on every one of ``SEEDS``, in the world it is hunted in (``FLAPPING``
  or ``STORMY``, 1,500 client requests each), by an invariant its defect
  breaks; the clean cores pass the same seeds and worlds
  (``test_the_clean_cores_pass_the_same_seeds``). ``-s`` prints per bug the
  decode requests loaded up to each seed's catch.
* What the simulation found in the cores stays found: the last tests pin
  the reproductions of its catches (an Abort read before any push released a
  declared group's hold; a hold's second timer crashed ``step``; early pushes
  started on a hold their first's refusal had released).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from handoff_model import peer_message
from handoff_sim import Config, Outcome, run
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.vllm.actions import DecodeAction, Open, Release, Reply, Send, Submit, Unfence
from kvguard.vllm.decode_core import DecodeCore
from kvguard.vllm.decode_legs import DecodeLegs, Verdict
from kvguard.vllm.decode_records import Wait
from kvguard.vllm.prefill_core import PrefillCore
from kvguard.vllm.prefill_records import Hold, PushRecord
from kvguard.vllm.protocol import Abort, Push
from kvguard.vllm.ranks import Pairing
from kvguard.vllm.states import LinkState, LoadEnd, LoadState, PushState

# -- random worlds -------------------------------------------------------------


@st.composite
def worlds(draw: st.DrawFn) -> Config:
    rate = st.floats(0.0, 1.0)
    hold_s = draw(st.floats(0.2, 3.0))
    hold_blocks = draw(st.integers(1, 8))
    return Config(
        prefills=tuple(draw(st.lists(st.sampled_from((1, 2)), min_size=1, max_size=3))),
        decodes=tuple(draw(st.lists(st.sampled_from((1, 2)), min_size=1, max_size=3))),
        heads=draw(st.sampled_from((4, 1))),  # 1: MLA (a larger prefill has spare ranks)
        requests=draw(st.integers(20, 250)),
        rate=draw(st.floats(20.0, 400.0)),
        p_group=draw(rate),
        max_n=draw(st.integers(2, 4)),
        p_declared=draw(rate),
        # (a pool of one request serializes them all: slow to simulate, nothing new)
        pool=draw(st.integers(2 * hold_blocks, 48)),
        hold_blocks=hold_blocks,
        deadline_s=draw(st.floats(0.1, 3.0)),
        hold_s=hold_s,
        max_hold_s=hold_s * draw(st.floats(1.0, 4.0)),
        hb_s=draw(st.floats(0.05, 1.0)),
        margin_s=draw(st.floats(0.0, 0.2)),
        monitor_s=draw(st.floats(0.0, 0.03)),
        skew_s=draw(st.floats(0.0, 0.05)),
        p_fail=draw(st.floats(0.0, 0.3)),
        p_hang=draw(st.floats(0.0, 0.2)),
        p_late=draw(st.floats(0.0, 0.2)),
        p_submit_fail=draw(st.floats(0.0, 0.2)),
        p_open_fail=draw(st.floats(0.0, 0.1)),
        p_connect_error=draw(st.floats(0.0, 0.2)),
        p_abort=draw(st.floats(0.0, 0.5)),
        p_retry=draw(rate),
        p_prefix=draw(st.floats(0.0, 0.3)),
        crash=draw(st.floats(0.0, 0.5)),
        freeze=draw(st.floats(0.0, 1.5)),
        partition=draw(st.floats(0.0, 1.0)),
        max_freeze_hb=draw(st.floats(2.0, 40.0)),
        max_partition_s=draw(st.floats(0.1, 4.0)),
        max_down_s=draw(st.floats(0.1, 3.0)),
    )


# KVGUARD_SIM_EXAMPLES: fewer for mutation testing, more for a longer search.
EXAMPLES = int(os.environ.get("KVGUARD_SIM_EXAMPLES", "1200"))


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cfg=worlds())
def test_random_worlds_keep_every_invariant(seed: int, cfg: Config) -> None:
    out = run(seed, cfg)  # raises InvariantViolated naming the invariant, seed and time
    assert out.violation is None


def test_a_seed_replays_the_same_world() -> None:
    cfg = Config(requests=300, crash=0.3, freeze=0.6, partition=0.4)
    first, again = run(7, cfg), run(7, cfg)
    assert (again.events, again.sim_s, again.seen) == (first.events, first.sim_s, first.seen)
    assert first.events > 1000 and first.seen["prefill frozen"] >= 1


# -- throughput ----------------------------------------------------------------

THROUGHPUT_REQUESTS = int(os.environ.get("KVGUARD_SIM_REQUESTS", "100000"))


def test_throughput() -> None:
    cfg = Config(requests=2000)  # the default fault mix
    outs: list[Outcome] = []
    start = time.perf_counter()
    while sum(o.children for o in outs) < THROUGHPUT_REQUESTS:
        outs.append(run(len(outs), cfg))
    wall = time.perf_counter() - start
    made, loads, events = (
        sum(getattr(o, f) for o in outs) for f in ("children", "loads", "events")
    )
    print(
        f"\nhand-off simulation: {made:,} decode requests ({loads:,} loaded, {events:,} events, "
        f"{len(outs)} worlds) in {wall:.1f}s: {made / wall:,.0f} simulated requests/s"
    )
    assert made >= THROUGHPUT_REQUESTS


# -- seeded bugs ---------------------------------------------------------------


# The worlds seeded bugs are hunted in (the clean cores must pass both):
# heartbeats of 0.1 s, refusals, local connect errors, clients retrying
# refused loads, n > 1 every other request, and
STORMY = Config(  # long freezes (to 30 heartbeat timeouts), crashes, partitions:
    requests=1500,  # pools run dry on fenced blocks, requests queue, holds are renewed
    hb_s=0.1,
    crash=0.1,
    freeze=1.0,
    partition=0.3,
    p_submit_fail=0.15,
    p_connect_error=0.1,
    p_retry=1.0,
    p_group=0.5,
)
FLAPPING = replace(  # prefills pausing 3 times a second for up to 4 heartbeat timeouts
    STORMY,  # (GC, CPU starvation), a receiver thread up to 20 ms late: links
    freeze=3.0,  # remade as their old socket's handshake lands
    max_freeze_hb=4.0,
    crash=0.02,
    partition=0.05,
    monitor_s=0.02,
)
KILLING = replace(  # prefills killed 3 times a second: loads fenced, then proven gone at once
    STORMY, crash=3.0, freeze=0.3, max_down_s=0.5
)
SEEDS = range(1, 11)


@dataclass(frozen=True)
class SeededBug:
    plant: Callable[[pytest.MonkeyPatch], None]
    caught_by: frozenset[str]  # the invariants its defect breaks
    world: Config = FLAPPING


def _group_size_ignored(mp: pytest.MonkeyPatch) -> None:
    """(1) Group accounting: a hold ends once one load of its group settled."""
    mp.setattr(Hold, "group_settled", lambda self: self.settled + self.forgotten >= 1)


def _duplicate_push_starts(mp: pytest.MonkeyPatch) -> None:
    """(2) A push re-sent on a remade link starts a second transfer."""
    push = PrefillCore._push

    def no_duplicate_check(
        self: PrefillCore, ident: bytes, msg: Push, now: float, wall: float, out: Any
    ) -> None:
        hold = self._holds.get(msg.request_id)
        if hold is not None:
            hold.pushes.pop(msg.load_id, None)  # the check finds no earlier push
        push(self, ident, msg, now, wall, out)

    mp.setattr(PrefillCore, "_push", no_duplicate_check)


def _refusal_settles(mp: pytest.MonkeyPatch) -> None:
    """(3) A refused push counts as settling its group (no other decode may ask)."""
    land = PrefillCore._land

    def refusal_counted(
        self: PrefillCore, hold: Hold, rec: PushRecord, state: PushState, *rest: Any
    ) -> None:
        if state is PushState.REFUSED:
            hold.settled += 1
        land(self, hold, rec, state, *rest)

    mp.setattr(PrefillCore, "_land", refusal_counted)


def _expiry_while_loading(mp: pytest.MonkeyPatch) -> None:
    """(4) A hold's deadline releases it with a load in flight."""
    live = PrefillCore._timer_live

    def loading_too(self: PrefillCore, item: tuple[float, str, str]) -> bool:
        due, rid, load_id = item
        if load_id:
            return live(self, item)
        hold = self._holds.get(rid)
        return hold is not None and hold.deadline == due

    mp.setattr(PrefillCore, "_timer_live", loading_too)


def _fence_bypassed(mp: pytest.MonkeyPatch) -> None:
    """(5) A load given up at its deadline or a drop hands its blocks back at once."""
    give_up = DecodeCore._give_up

    def unfenced(self: DecodeCore, wait: Wait, *rest: Any) -> None:
        out: list[DecodeAction] = rest[-1]
        was = wait.state
        give_up(self, wait, *rest)
        if was is LoadState.ASKED and wait.state is LoadState.FENCED:
            out.append(Unfence(wait.request_id))

    mp.setattr(DecodeCore, "_give_up", unfenced)


def _verdict_asked_once(mp: pytest.MonkeyPatch) -> None:
    """(6) A given-up load's verdict is asked for once, never again after a reconnect."""
    ask = DecodeCore._ask_verdict
    asked: set[str] = set()

    def once(self: DecodeCore, wait: Wait, now: float, out: list[DecodeAction]) -> None:
        if wait.request_id in asked:
            self._reask_at(wait, now + self._stall_s)
            return
        asked.add(wait.request_id)
        ask(self, wait, now, out)

    mp.setattr(DecodeCore, "_ask_verdict", once)


def _remade_link_fresh(mp: pytest.MonkeyPatch) -> None:
    """(7) A remade link is taken as never connected: its drop before its
    handshake ends its loads unfenced (the old socket may have delivered)."""
    opened = DecodeCore.opened

    def as_fresh(self: DecodeCore, endpoint: str, gen: int, now: float) -> list[DecodeAction]:
        link = self._links.get(endpoint)
        remade = link is not None and gen == link.dialing and link.gen != 0
        out = opened(self, endpoint, gen, now)
        if remade:
            assert link is not None
            link.state = LinkState.DIALING
        return out

    mp.setattr(DecodeCore, "opened", as_fresh)


def _renew_past_max(mp: pytest.MonkeyPatch) -> None:
    """(8) Renewals ignore ``max_hold_s``: a queued decode keeps a hold for good."""
    renew = PrefillCore._renew

    def uncapped(self: PrefillCore, rid: str, now: float) -> None:
        hold = self._holds.get(rid)
        if hold is not None:
            hold.last = math.inf
        renew(self, rid, now)

    mp.setattr(PrefillCore, "_renew", uncapped)


def _renewal_ignored(mp: pytest.MonkeyPatch) -> None:
    """(9) A renewal of a hold the prefill has is dropped: queued decodes lose it."""
    renew = PrefillCore._renew

    def dropped(self: PrefillCore, rid: str, now: float) -> None:
        if rid not in self._holds:
            renew(self, rid, now)

    mp.setattr(PrefillCore, "_renew", dropped)


def _early_renewal_dropped(mp: pytest.MonkeyPatch) -> None:
    """(10) A renewal read before its hold began is dropped, as before 3c73771."""
    renew = PrefillCore._renew

    def dropped(self: PrefillCore, rid: str, now: float) -> None:
        if rid in self._holds:
            renew(self, rid, now)

    mp.setattr(PrefillCore, "_renew", dropped)


def _early_release_lost(mp: pytest.MonkeyPatch) -> None:
    """(11) A release the worker takes before its load's fenced report is
    dropped, and with it the load: its request never finishes (as before
    this was found in CI)."""

    def lost(self: DecodeLegs, leg: str) -> Verdict | None:
        load = self._load_of.pop(leg, None)  # even for a leg not reported yet
        if load is None or leg not in load.fenced:
            return None
        load.fenced.discard(leg)
        return self._verdict(load.request_id, load)

    mp.setattr(DecodeLegs, "released", lost)


SEEDED_BUGS = {
    "group_size_ignored": SeededBug(_group_size_ignored, frozenset({"group"})),
    # The second transfer writes blocks the first's answer handed back (I6),
    # or the orphaned first one keeps its hold from ever ending.
    "duplicate_push_starts": SeededBug(
        _duplicate_push_starts, frozenset({"I6", "release", "max_hold", "drain", "group"})
    ),
    "refusal_settles": SeededBug(_refusal_settles, frozenset({"group"})),
    "expiry_while_loading": SeededBug(_expiry_while_loading, frozenset({"release"})),
    "fence_bypassed": SeededBug(_fence_bypassed, frozenset({"I6"})),
    "verdict_asked_once": SeededBug(_verdict_asked_once, frozenset({"drain"})),
    "remade_link_fresh": SeededBug(_remade_link_fresh, frozenset({"I6"})),
    "renew_past_max": SeededBug(_renew_past_max, frozenset({"max_hold"}), STORMY),
    "renewal_ignored": SeededBug(_renewal_ignored, frozenset({"renew"}), STORMY),
    "early_renewal_dropped": SeededBug(_early_renewal_dropped, frozenset({"renew"})),
    "early_release_lost": SeededBug(_early_release_lost, frozenset({"deadline", "drain"}), KILLING),
}


def report_line(name: str, outs: list[Outcome]) -> str:
    """Per seed, the decode requests loaded up to the catch ("-": none)."""
    caught = [o.loads for o in outs if o.violation is not None]
    by = sorted({o.violation.invariant for o in outs if o.violation is not None})
    median = f"{statistics.median(caught):.0f}" if caught else "-"
    each = " ".join(str(o.loads) if o.violation is not None else "-" for o in outs)
    return (
        f"{name:24} caught {len(caught):2}/{len(outs)} by {','.join(by) or '-':14} "
        f"loads to the catch: median {median:>5} ({each})"
    )


@pytest.mark.parametrize("bug", list(SEEDED_BUGS))
def test_each_seeded_bug_is_found_on_every_seed(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    SEEDED_BUGS[bug].plant(monkeypatch)
    outs = [run(seed, SEEDED_BUGS[bug].world, stop_on_violation=False) for seed in SEEDS]
    print("\n" + report_line(bug, outs))
    missed = [o.seed for o in outs if o.violation is None]
    wrong = [(o.seed, o.violation.invariant) for o in outs if o.violation is not None
             and o.violation.invariant not in SEEDED_BUGS[bug].caught_by]  # fmt: skip
    assert (missed, wrong) == ([], [])


@pytest.mark.parametrize("world", ["STORMY", "FLAPPING", "KILLING"])
def test_the_clean_cores_pass_the_same_seeds(world: str) -> None:
    cfg = {"STORMY": STORMY, "FLAPPING": FLAPPING, "KILLING": KILLING}[world]
    outs = [run(seed, cfg, stop_on_violation=False) for seed in SEEDS]
    print("\n" + report_line(f"clean cores, {world}", outs))
    assert [o.violation for o in outs] == [None] * len(SEEDS)
    assert all(o.children >= cfg.requests for o in outs)


# -- found by the simulation --------------------------------------------------

# One client request, n = 2 declared, no faults: on seed 1 its first decode
# request is a full prefix hit before its sibling arrives, so the forget
# reaches the prefill before any push.
FORGET_FIRST = Config(
    prefills=(1,),
    decodes=(1,),
    requests=1,
    p_group=1.0,
    max_n=2,
    p_declared=1.0,
    p_prefix=0.5,
    p_abort=0.0,
    crash=0.0,
    freeze=0.0,
    partition=0.0,
    p_fail=0.0,
    p_hang=0.0,
    p_late=0.0,
    p_submit_fail=0.0,
    p_open_fail=0.0,
    p_connect_error=0.0,
)
URL = "tcp://10.0.1.0:17600"


def _push(load: str) -> Push:
    return Push("r", load, [5], peer_message("d0.0"), 100.0, group=2)


def test_a_forget_before_any_push_keeps_a_declared_groups_hold() -> None:
    """Found on ``FORGET_FIRST`` seed 1: an Abort carried no group size, so a
    forget read before any push settled "a group of 1", released the hold,
    and the sibling's push failed ``unknown_request``. A forget names its group."""
    out = run(1, FORGET_FIRST)
    assert (out.children, out.loads, out.seen.get("load loaded")) == (2, 1, 1)
    core = PrefillCore(renew_s=1.0, max_hold_s=2.0)
    core.hold("r", [0, 1], 10.0, 0.0)
    assert core.receive(b"d", Abort("r", group=2), 0.1, 0.1) == []  # still held
    assert [type(a) for a in core.receive(b"d", _push("r.1"), 0.2, 0.2)] == [Submit]


def test_a_given_up_load_before_any_push_keeps_a_declared_groups_hold() -> None:
    """Found on a thawing prefill (FLAPPING): the Abort asking for a given-up
    load's verdict carried no group size either; read before any push reached
    the hold, it settled a group of 1. It carries its push's group now."""
    decode = DecodeCore(peer_message("d0.0"), stall_s=0.5)
    assert [type(a) for a in decode.expect("r.0", URL, "r", [5], 5.0, 2, 0.0, 0.0)] == [Open]
    assert [type(a) for a in decode.opened(URL, 1, 0.0)] == [Send]  # the queued push
    assert decode.cancel("r.0", 0.1) == [Send(URL, Abort("r", "r.0", group=2))]
    core = PrefillCore(renew_s=1.0, max_hold_s=2.0)
    core.hold("r", [0, 1], 10.0, 0.0)
    (reply,) = core.receive(b"d", Abort("r", "r.0", group=2), 0.1, 0.1)  # no Release
    assert isinstance(reply, Reply) and reply.result.reason == LoadEnd.ABORTED.value
    assert [type(a) for a in core.receive(b"d", _push("r.1"), 0.2, 0.2)] == [Submit]


# One latent head (MLA): a prefill of 2 ranks, a decode of 1, no faults.
MLA_SPARE = replace(FORGET_FIRST, prefills=(2,), heads=1, requests=40, p_group=0.0, p_prefix=0.0)


def test_an_mla_prefills_spare_rank_lets_go_when_the_load_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill rank 1 holds what the decode loads from rank 0 alone: told by
    the decode to let go once the load is over, no hold runs out. Without
    that forget, every request's spare hold runs out at its deadline (vLLM
    frees the prefill's blocks only then)."""
    out = run(1, MLA_SPARE)
    assert (out.children, out.loads, out.seen.get("load loaded")) == (40, 40, 40)
    assert out.seen.get("hold ran out", 0) == 0
    monkeypatch.setattr(Pairing, "spare_urls", lambda self, source: [])
    out = run(1, MLA_SPARE)
    assert (out.seen.get("load loaded"), out.seen.get("hold ran out")) == (40, 40)


def test_a_hold_back_from_loading_ends_once_at_its_deadline() -> None:
    """Found on the first seeds: a hold whose load landed before its deadline
    has a second timer at that deadline; ``step`` raised KeyError on it and
    lost the first's Release (the engine never got the blocks back)."""
    core = PrefillCore(renew_s=1.0, max_hold_s=2.0)
    core.hold("r", [0, 1], 1.0, 0.0)
    assert [type(a) for a in core.receive(b"d", _push("r.0"), 0.1, 0.1)] == [Submit]
    assert [type(a) for a in core.released("r", "r.0", LoadEnd.LOADED, "", 0.2)] == [Reply]
    assert core.step(1.0) == [Release("r")]  # its sibling never came


def test_pushes_read_before_an_expired_hold_start_nothing_once_it_is_released() -> None:
    """Found on a thawing prefill: two pushes waited for their hold, which
    came with its deadline passed; the first's refusal released it and the
    second was started on the released hold (TableError; admitted, it would
    read blocks the engine has back)."""
    core = PrefillCore(renew_s=1.0, max_hold_s=2.0)
    assert core.receive(b"d", _push("r.0"), 5.0, 5.0) == []  # both wait for the hold
    assert core.receive(b"d", _push("r.1"), 5.0, 5.0) == []
    acts = core.hold("r", [0, 1], 4.0, 5.0)
    assert [type(a) for a in acts] == [Reply, Release, Reply]
    reasons = [a.result.reason for a in acts if isinstance(a, Reply)]
    assert reasons == [LoadEnd.TIMEOUT.value, LoadEnd.UNKNOWN_REQUEST.value]
