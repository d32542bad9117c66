"""The prefill side's decisions, sans I/O: hold finished requests, serve pushes.

``PrefillCore`` is fed events -- the engine's ``hold``, a decode's message
(``receive``), kvguard's release of a transfer (``released``), a submit the
driver could not make (``submit_failed``), the clock (``step``) -- each with
``now`` (and ``wall`` where a message carries wall-clock time), and returns
``actions``. It owns no socket, lock, thread or clock: ``prefill_pushes``
drives it over ZeroMQ and kvguard's ``Scheduler``, tests/handoff_sim.py on a
simulated clock. It promises, and the simulation checks after every event:

* a hold is released exactly once, and only with no load in flight, once
  every decode request of its group is settled (answered, or said it will
  not push) or its deadline has passed;
* a load is answered once nothing of this side writes its blocks: after
  kvguard's release (terminal AND quiesced), or at once when nothing was
  ever submitted for it;
* a load given up before its push started is remembered, so a push read
  later (a frozen prefill reads its socket on thaw) is refused, never served;
  a second push of a known load starts nothing.

States: ``states.HOLD`` and ``states.PUSH``; timers: one lazy heap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Final

import structlog

from scheduler._lazyheap import LazyHeap

from .actions import AbortTransfer, ForgetPeer, PrefillAction, Release, Reply, SenderStats, Submit
from .admission import Admission, Refusal
from .peer_ledger import PeerLedger
from .prefill_records import Bounded, EarlyPushes, Hold, PushRecord
from .protocol import Abort, Push, Renew, Result, truncate
from .ranks import RankHeads
from .states import HOLD, PUSH, HoldEnd, HoldState, LoadEnd, PushState

__all__ = ["EARLY_WAIT_S", "IDLE_PEER_S", "MAX_EARLY", "RECENT", "PrefillCore"]

_log = structlog.get_logger("kvguard.vllm.sender")

RECENT: Final = 4096  # ended holds and given-up loads remembered, to answer late pushes
# A push may arrive before the engine's hold (one engine step later); it
# waits this long at most, and at most this many wait at once.
EARLY_WAIT_S: Final = 10.0
MAX_EARLY: Final = 4096
# A decode peer with no load in flight this long is forgotten (decodes churn:
# every restart is a new Mooncake session); it is learnt again from its push.
IDLE_PEER_S: Final = 300.0


class PrefillCore:
    """Holds and pushes, decided from events; see the module docstring."""

    def __init__(
        self,
        *,
        compat: str = "",
        renew_s: float = 30.0,
        max_hold_s: float = 300.0,
        heads: RankHeads | None = None,
        head_major: bool = False,
        block_bytes: int = 1,
    ) -> None:
        self._admission = Admission(compat, heads, head_major, block_bytes)
        self._renew_s = renew_s
        self._max_hold_s = max_hold_s
        self._ids = itertools.count()
        self._holds: dict[str, Hold] = {}  # held until released to the engine
        self._early = EarlyPushes()  # at most MAX_EARLY
        self._recent: Bounded[str, str] = Bounded(RECENT)  # released id -> how, for late pushes
        self._aborted: Bounded[tuple[str, str], None] = Bounded(RECENT)  # given-up loads
        # Forgets (an Abort with no load id) read before their hold: counted in it.
        self._forgets: Bounded[str, tuple[int, int]] = Bounded(MAX_EARLY)  # (count, group)
        self._renewed: Bounded[str, float] = Bounded(MAX_EARLY)  # Renews before it: when
        self._peers = PeerLedger()
        # (due, request, load): a hold's deadline (load "") or an EARLY push's wait
        self._timers: LazyHeap[float, tuple[float, str, str]] = LazyHeap(self._timer_live)
        self.stats = SenderStats()

    # -- inspection ------------------------------------------------------------

    def holding(self) -> int:
        return len(self._holds)

    def is_held(self, rid: str) -> bool:
        return rid in self._holds

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def peers(self) -> int:
        return len(self._peers)

    def next_wake(self) -> float | None:
        """When ``step`` next has something to do (None: nothing timed).
        Idle peers are few (one per decode instance): scanned, not timed."""
        idle = self._peers.next_idle(IDLE_PEER_S)
        dues = [d for d in (self._timers.next_key(), idle) if d is not None]
        return min(dues) if dues else None

    def drained(self) -> bool:
        """Nothing held, waiting or in flight (what a drain must reach)."""
        return not self._holds and not self._early.count

    # -- events ----------------------------------------------------------------

    def hold(
        self, rid: str, blocks: Sequence[int], deadline: float, now: float
    ) -> list[PrefillAction]:
        """The engine keeps ``blocks`` of ``rid`` until a decode has them or
        ``deadline`` passes; pushes that came first start now."""
        if rid in self._holds or rid in self._recent:
            _log.warning("hold_duplicate", request=rid)
            return []
        hold = Hold(rid, list(blocks), deadline, now + self._max_hold_s)
        self._holds[rid] = hold
        self._timers.push(deadline, (deadline, rid, ""))
        if (renewed := self._renewed.pop(rid, None)) is not None:
            self._renew(rid, renewed)  # a decode queued for it before vLLM handed it over
        self.stats.held += 1
        hold.forgotten, hold.group = self._forgets.pop(rid, (0, 1))
        out: list[PrefillAction] = []
        for rec in self._early.take_request(rid):
            assert rec.push is not None
            if hold.state is HoldState.RELEASED:  # by an earlier one's refusal: start nothing
                what = f"request {self._recent[rid]}"
                self._answer(rec, PushState.REFUSED, LoadEnd.UNKNOWN_REQUEST, what, out)
                continue
            self._start(hold, rec, rec.push, now, rec.expires, out)
        if hold.state is HoldState.HELD:  # (not released by a refusal)
            self._end_if_settled(hold, out)
        return out

    def malformed(
        self, ident: bytes, ids: tuple[str, str] | None, detail: str
    ) -> list[PrefillAction]:
        """A message that failed validation: answer its load when its ids
        parse, or its decode waits out its deadline."""
        if ids is None:
            return []
        return [Reply(ident, Result(ids[0], ids[1], False, LoadEnd.BAD_REQUEST.value, detail))]

    def receive(
        self, ident: bytes, msg: Push | Abort | Renew, now: float, wall: float
    ) -> list[PrefillAction]:
        """A decode's message (validated); ``wall`` is ``time.time()`` now."""
        out: list[PrefillAction] = []
        if isinstance(msg, Abort):
            self._abort(ident, msg, out)
        elif isinstance(msg, Renew):
            self._renew(msg.request_id, now)
        else:
            self._push(ident, msg, now, wall, out)
        return out

    def released(
        self, rid: str, load_id: str, end: LoadEnd, detail: str, now: float
    ) -> list[PrefillAction]:
        """kvguard released ``load_id``'s transfer: terminal AND quiesced."""
        hold = self._holds.get(rid)
        rec = None if hold is None else hold.pushes.get(load_id)
        if hold is None or rec is None or rec.state is not PushState.IN_FLIGHT:
            return []
        self.stats.ended(end)
        out: list[PrefillAction] = []
        self._land(hold, rec, PushState.SETTLED, end, detail, now, out)
        return out

    def submit_failed(self, rid: str, load_id: str, detail: str, now: float) -> list[PrefillAction]:
        """The driver could not submit ``load_id``: nothing touches its blocks."""
        hold = self._holds.get(rid)
        rec = None if hold is None else hold.pushes.get(load_id)
        if hold is None or rec is None or rec.state is not PushState.IN_FLIGHT:
            return []
        _log.warning("push_refused", request=rid, load=load_id, error=detail)
        self.stats.pushed -= 1
        self.stats.refused += 1
        out: list[PrefillAction] = []
        self._land(hold, rec, PushState.REFUSED, LoadEnd.REFUSED, detail, now, out)
        return out

    def step(self, now: float) -> list[PrefillAction]:
        """Fire what is due: EARLY pushes whose hold never came, holds whose
        deadline passed with nothing in flight; forget idle peers."""
        out: list[PrefillAction] = []
        for item in self._timers.pop_due(now):
            if not self._timer_live(item):
                continue  # stale since it was popped: a hold's second timer, released by its first
            _, rid, load_id = item
            if load_id:
                rec = self._early.get(rid, load_id)
                if rec is not None:
                    self._early.take(rec)
                    self._answer(
                        rec, PushState.SETTLED, LoadEnd.UNKNOWN_REQUEST, "never held here", out
                    )
                continue
            hold = self._holds[rid]
            _log.info("hold_expired", request=rid)
            self.stats.expired += 1
            self._release(hold, HoldEnd.EXPIRED, "", out)
        for session in self._peers.forget_idle(now, IDLE_PEER_S):
            _log.info("peer_forgotten", peer=session)
            out.append(ForgetPeer(session))
        return out

    # -- decisions -------------------------------------------------------------

    def _timer_live(self, item: tuple[float, str, str]) -> bool:
        due, rid, load_id = item
        if load_id:
            rec = self._early.get(rid, load_id)
            return rec is not None and rec.until == due
        hold = self._holds.get(rid)
        return hold is not None and hold.state is HoldState.HELD and hold.deadline == due

    def _push(
        self, ident: bytes, push: Push, now: float, wall: float, out: list[PrefillAction]
    ) -> None:
        rid, load_id = push.request_id, push.load_id
        hold = self._holds.get(rid)
        if (rid, load_id) in self._aborted:
            rec = PushRecord(rid, load_id, ident, push)
            self._answer(
                rec, PushState.SETTLED, LoadEnd.ABORTED, "the decode gave this load up before", out
            )
        elif hold is not None:
            if load_id in hold.pushes:  # a copy: its decode may have heard the first's answer
                _log.warning("push_duplicate", request=rid, load=load_id)
                return
            left = push.expires_at - wall
            self._start(hold, PushRecord(rid, load_id, ident, push), push, now, now + left, out)
        elif rid not in self._recent and self._early.count < MAX_EARLY:
            if self._early.get(rid, load_id) is not None:
                _log.warning("push_duplicate", request=rid, load=load_id)
                return
            # The engine has not told us yet: wait for hold(), briefly.
            expires = now + push.expires_at - wall
            until = min(max(expires, now), now + EARLY_WAIT_S)
            rec = PushRecord(rid, load_id, ident, push, until=until, expires=expires)
            PUSH.move(rec, PushState.EARLY, rid)
            self._early.add(rec)
            self._timers.push(until, (until, rid, load_id))
        else:
            how = self._recent.get(rid)
            what = f"request {how}" if how else "too many unknown requests"
            rec = PushRecord(rid, load_id, ident, push)
            self._answer(rec, PushState.REFUSED, LoadEnd.UNKNOWN_REQUEST, what, out)

    def _start(
        self,
        hold: Hold,
        rec: PushRecord,
        push: Push,
        now: float,
        expires: float,
        out: list[PrefillAction],
    ) -> None:
        """Turn a held request and a decode's push into a kvguard transfer,
        or refuse it (nothing submitted: the blocks are untouched)."""
        rid = hold.request_id
        hold.pushes[rec.load_id] = rec
        hold.group = max(hold.group, push.group)
        try:
            info, part = self._admission.admit(push, len(hold.blocks))
            deadline_s = min(hold.deadline, expires) - now
            if deadline_s <= 0:
                raise Refusal(LoadEnd.TIMEOUT, "the hold or the push deadline has passed")
        except Refusal as refusal:
            _log.warning("push_refused", request=rid, load=rec.load_id, error=refusal.detail)
            self.stats.refused += 1
            # Refused, it settles nothing: another decode may still ask in time.
            self._land(hold, rec, PushState.REFUSED, refusal.end, refusal.detail, now, out)
            return
        rec.transfer = f"kvguard-push-{next(self._ids)}"
        rec.peer = info.session_id
        PUSH.move(rec, PushState.IN_FLIGHT, rec.load_id)
        hold.in_flight += 1
        if hold.state is HoldState.HELD:
            HOLD.move(hold, HoldState.LOADING, rid)
        new_peer = self._peers.admit(info, now)
        self.stats.pushed += 1
        src, dst = hold.blocks[len(hold.blocks) - len(push.blocks) :], list(push.blocks)
        sub = Submit(rid, rec.load_id, rec.transfer, src, dst, info, new_peer, deadline_s, part)
        out.append(replace(sub, verify=push.verify))

    def _land(
        self,
        hold: Hold,
        rec: PushRecord,
        state: PushState,
        end: LoadEnd,
        detail: str,
        now: float,
        out: list[PrefillAction],
    ) -> None:
        """``rec`` ended and nothing writes its blocks: answer it, and end the
        hold once its group is settled (or its deadline passed) and no other
        load is in flight."""
        if rec.state is PushState.IN_FLIGHT:
            hold.in_flight -= 1
            self._peers.done(rec.peer, told=state is not PushState.REFUSED)
        self._answer(rec, state, end, detail, out)
        if state is PushState.SETTLED:
            hold.settled += 1
        if hold.in_flight:
            return
        if hold.group_settled() or hold.deadline <= now:
            how = HoldEnd.DONE if end.ok else HoldEnd.FAILED
            self._release(hold, how, "" if end.ok else end.value, out)
        elif hold.state is HoldState.LOADING:
            HOLD.move(hold, HoldState.HELD, hold.request_id)
            self._timers.push(hold.deadline, (hold.deadline, hold.request_id, ""))

    def _answer(
        self, rec: PushRecord, state: PushState, end: LoadEnd, detail: str, out: list[PrefillAction]
    ) -> None:
        PUSH.move(rec, state, rec.load_id)
        self.stats.loads += 1
        out.append(
            Reply(
                rec.ident, Result(rec.request_id, rec.load_id, end.ok, end.reason, truncate(detail))
            )
        )

    def _abort(self, ident: bytes, msg: Abort, out: list[PrefillAction]) -> None:
        """The decode gave up ``load_id``: answered once nothing writes its
        blocks. With no load id, one decode request of ``rid``'s group will
        never push. Either settles one request of the group."""
        rid, load_id = msg.request_id, msg.load_id
        hold = self._holds.get(rid)
        if not load_id:
            if hold is not None:
                hold.forgotten += 1
                hold.group = max(hold.group, msg.group)
                self._end_if_settled(hold, out)
            elif rid not in self._recent:
                count, group = self._forgets.get(rid, (0, 1))
                self._forgets[rid] = (count + 1, max(group, msg.group))
            return
        early = self._early.get(rid, load_id)
        rec = None if hold is None else hold.pushes.get(load_id)
        self._aborted[(rid, load_id)] = None
        if hold is not None:  # the size its push would have told (this may settle the group)
            hold.group = max(hold.group, msg.group)
        if early is not None:
            self._early.take(early)
            self._answer(
                early, PushState.SETTLED, LoadEnd.ABORTED, "given up before its push started", out
            )
            return
        if rec is not None and rec.state is PushState.IN_FLIGHT:
            out.append(AbortTransfer(rec.transfer))  # its release answers it
            return
        if hold is not None and rec is None:
            rec = hold.pushes[load_id] = PushRecord(rid, load_id, ident, None)
            PUSH.move(rec, PushState.SETTLED, load_id)
            hold.settled += 1
        out.append(
            Reply(ident, Result(rid, load_id, False, LoadEnd.ABORTED.value, "no transfer started"))
        )
        if hold is not None:
            self._end_if_settled(hold, out)

    def _end_if_settled(self, hold: Hold, out: list[PrefillAction]) -> None:
        if hold.state is HoldState.HELD and hold.group_settled():
            self.stats.aborted += 1
            self._release(hold, HoldEnd.ABORTED, "", out)

    def _renew(self, rid: str, now: float) -> None:
        hold = self._holds.get(rid)
        if hold is None:  # ended (the decode's push will hear why), or not begun yet
            if rid not in self._recent:
                self._renewed[rid] = now
            return
        until = min(now + self._renew_s, hold.last)
        if until <= hold.deadline:
            return
        left, hold.deadline = hold.deadline - now, until
        if hold.state is HoldState.HELD:
            self._timers.push(until, (until, rid, ""))
        self.stats.renewed += 1
        _log.debug("hold_renewed", request=rid, left_s=round(left, 3))  # near 0: renewed late

    def _release(self, hold: Hold, end: HoldEnd, reason: str, out: list[PrefillAction]) -> None:
        """Release ``hold``'s blocks to the engine, once."""
        rid = hold.request_id
        HOLD.move(hold, HoldState.RELEASED, rid)
        del self._holds[rid]
        self._recent[rid] = f"{end.value}: {reason}" if reason else end.value
        _log.debug("hold_released", request=rid, how=end.value, reason=reason)
        out.append(Release(rid))
