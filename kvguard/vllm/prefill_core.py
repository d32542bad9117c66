"""The prefill side's decisions, sans I/O: hold finished requests, serve pushes.

``PrefillCore`` is fed events -- the engine's ``hold``, a decode's message
(``receive``), kvguard's release of a transfer (``released``), a submit the
driver could not make (``submit_failed``), the clock (``step``) -- each with
``now`` (monotonic seconds; ``wall`` too where a message carries wall-clock
time), and returns the actions to take: reply to a decode, submit or abort a
kvguard transfer, release a hold's blocks to the engine, forget a peer. It
owns no socket, lock, thread or clock; ``prefill_pushes.PrefillSender``
drives it over ZeroMQ and kvguard's ``Scheduler``, and the hand-off
simulation (tests/handoff_sim.py) drives it on a simulated clock.

What it promises (the simulation checks each after every event):

* a hold is released exactly once, and only with no load in flight, once
  every decode request of its group is settled (answered, or said it will
  not push) or its deadline has passed;
* a load is answered once nothing of this side writes its blocks: after
  kvguard's release (terminal AND quiesced), or at once when nothing was
  ever submitted for it;
* a load given up before its push started is remembered, so a push read
  later (a frozen prefill reads its socket on thaw) is refused, never served;
  a second push of a known load starts nothing.

States live in two tables (``states.HOLD``, ``states.PUSH``); timers in
one lazy heap.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog

from scheduler._lazyheap import LazyHeap
from transfer import PeerInfo
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import peer_info_of
from transfer.plan import BlockSlice

from .protocol import Abort, Push, Renew, Result, truncate
from .ranks import RankHeads, block_slice
from .states import HOLD, PUSH, HoldEnd, HoldState, LoadEnd, PushState

__all__ = [
    "AbortTransfer",
    "Action",
    "ForgetPeer",
    "PrefillCore",
    "Release",
    "Reply",
    "SenderStats",
    "Submit",
]

_log = structlog.get_logger("kvguard.vllm.sender")

RECENT: Final = 4096  # ended holds and given-up loads remembered, to answer late pushes
# A push may arrive before the engine's hold (one engine step later); it
# waits this long at most, and at most this many wait at once.
EARLY_WAIT_S: Final = 10.0
MAX_EARLY: Final = 4096
# A decode peer with no load in flight this long is forgotten (decodes churn:
# every restart is a new Mooncake session); it is learnt again from its push.
IDLE_PEER_S: Final = 300.0


# -- actions -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``result`` to the decode whose ROUTER identity is ``ident``."""

    ident: bytes
    result: Result


@dataclass(frozen=True, slots=True)
class Submit:
    """Submit kvguard transfer ``transfer``; its release is ``released(request_id,
    load_id, ...)``, a failed submit ``submit_failed(request_id, load_id, ...)``."""

    request_id: str
    load_id: str
    transfer: str
    src: list[int]
    dst: list[int]
    peer: PeerInfo
    new_peer: bool  # first push to this session (or its advertisement changed)
    deadline_s: float
    part: BlockSlice | None


@dataclass(frozen=True, slots=True)
class AbortTransfer:
    transfer: str  # its release still comes, and answers the load


@dataclass(frozen=True, slots=True)
class Release:
    """Nothing touches ``request_id``'s blocks any more: the engine may free them."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ForgetPeer:
    session: str  # nothing in flight to it, idle for IDLE_PEER_S


Action = Reply | Submit | AbortTransfer | Release | ForgetPeer


@dataclass(slots=True)
class SenderStats:
    held: int = 0
    pushed: int = 0  # transfers submitted
    done: int = 0
    failed: int = 0
    expired: int = 0  # no decode asked before the deadline
    aborted: int = 0  # the decode said it would not ask
    refused: int = 0  # a push that could not be submitted
    loads: int = 0  # loads answered (a request serves one per decode child)
    renewed: int = 0  # holds extended by a decode whose request queues
    by_reason: dict[str, int] = field(default_factory=dict)


# -- records -------------------------------------------------------------------


@dataclass(slots=True)
class _Push:
    """One load of a request, as this side serves it (``states.PUSH``)."""

    request_id: str
    load_id: str
    ident: bytes  # the decode's ROUTER identity, for the Result
    push: Push | None  # None: named by an Abort only
    state: PushState = PushState.NEW
    until: float = 0.0  # EARLY: the latest its hold may come (monotonic)
    expires: float = 0.0  # EARLY: the push's own expiry, on the monotonic clock
    transfer: str = ""  # IN_FLIGHT: the kvguard request id
    peer: str = ""  # IN_FLIGHT: the decode's Mooncake session


@dataclass(slots=True)
class _Hold:
    """A held request (``states.HOLD``). Its group settles when
    ``settled + forgotten >= group``: each decode request loads at most once."""

    request_id: str
    blocks: list[int]
    deadline: float  # monotonic; the hold ends then unless a load is in flight
    last: float  # the latest a renewal may push ``deadline`` to
    state: HoldState = HoldState.HELD
    pushes: dict[str, _Push] = field(default_factory=dict)  # load id -> record, every state
    in_flight: int = 0  # pushes IN_FLIGHT; LOADING iff > 0
    settled: int = 0  # pushes SETTLED
    forgotten: int = 0  # decode requests of the group that will never push
    group: int = 1  # the group's size: the largest a push said

    def group_settled(self) -> bool:
        return self.settled + self.forgotten >= self.group


# -- the core ------------------------------------------------------------------


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
        self._compat = compat
        self._renew_s = renew_s
        self._max_hold_s = max_hold_s
        self._heads = heads
        self._head_major = head_major
        self._block_bytes = block_bytes
        self._ids = itertools.count()
        self._holds: dict[str, _Hold] = {}  # held until released to the engine
        self._early: dict[str, dict[str, _Push]] = {}  # request -> load -> EARLY push
        self._n_early = 0  # EARLY pushes in _early; <= MAX_EARLY
        self._recent: OrderedDict[str, str] = OrderedDict()  # released id -> how, for late pushes
        self._aborted: OrderedDict[tuple[str, str], None] = OrderedDict()  # given-up loads
        # Forgets (an Abort with no load id) read before their hold: counted
        # into it when it comes (vLLM tells the worker a step after the client).
        self._forgets: OrderedDict[str, int] = OrderedDict()
        self._peers: dict[str, PeerInfo] = {}  # sessions the driver was told of
        self._peer_loads: Counter[str] = Counter()  # session -> loads in flight to it
        self._peer_used: dict[str, float] = {}  # session -> last push admitted to it
        # (due, request id, load id): a hold's deadline (load id "") or an
        # EARLY push's wait; stale once the record moved on.
        self._timers: LazyHeap[float, tuple[float, str, str]] = LazyHeap(self._timer_live)
        self.stats = SenderStats()

    # -- inspection ------------------------------------------------------------

    def holding(self) -> int:
        return len(self._holds)

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def peers(self) -> int:
        return len(self._peer_used)

    def next_wake(self) -> float | None:
        """When ``step`` next has something to do (None: nothing timed).
        Idle peers are few (one per decode instance): scanned, not timed."""
        dues = [u + IDLE_PEER_S for p, u in self._peer_used.items() if self._peer_loads[p] <= 0]
        timer = self._timers.next_key()
        if timer is not None:
            dues.append(timer)
        return min(dues) if dues else None

    def drained(self) -> bool:
        """Nothing held, waiting or in flight (what a drain must reach)."""
        return not self._holds and not self._n_early

    # -- events ----------------------------------------------------------------

    def hold(self, rid: str, blocks: Sequence[int], deadline: float, now: float) -> list[Action]:
        """The engine keeps ``blocks`` of ``rid`` until a decode has them or
        ``deadline`` passes; pushes that came first start now."""
        if rid in self._holds or rid in self._recent:
            _log.warning("hold_duplicate", request=rid)
            return []
        hold = _Hold(rid, list(blocks), deadline, now + self._max_hold_s)
        self._holds[rid] = hold
        self._timers.push(deadline, (deadline, rid, ""))
        self.stats.held += 1
        hold.forgotten = self._forgets.pop(rid, 0)
        out: list[Action] = []
        for rec in self._early.pop(rid, {}).values():
            self._n_early -= 1
            assert rec.push is not None
            self._start(hold, rec, rec.push, now, rec.expires, out)
        if hold.state is HoldState.HELD:  # (not released by a refusal)
            self._end_if_settled(hold, out)
        return out

    def malformed(self, ident: bytes, ids: tuple[str, str] | None, detail: str) -> list[Action]:
        """A message that failed validation: answer its load when its ids
        parse, or its decode waits out its deadline."""
        if ids is None:
            return []
        return [Reply(ident, Result(ids[0], ids[1], False, LoadEnd.BAD_REQUEST.value, detail))]

    def receive(
        self, ident: bytes, msg: Push | Abort | Renew, now: float, wall: float
    ) -> list[Action]:
        """A decode's message (validated); ``wall`` is ``time.time()`` now."""
        out: list[Action] = []
        if isinstance(msg, Abort):
            self._abort(ident, msg.request_id, msg.load_id, now, out)
        elif isinstance(msg, Renew):
            self._renew(msg.request_id, now)
        else:
            self._push(ident, msg, now, wall, out)
        return out

    def released(
        self, rid: str, load_id: str, end: LoadEnd, detail: str, now: float
    ) -> list[Action]:
        """kvguard released ``load_id``'s transfer: terminal AND quiesced."""
        hold = self._holds.get(rid)
        rec = None if hold is None else hold.pushes.get(load_id)
        if hold is None or rec is None or rec.state is not PushState.IN_FLIGHT:
            return []
        if end.ok:
            self.stats.done += 1
        else:
            self.stats.failed += 1
            self.stats.by_reason[end.value] = self.stats.by_reason.get(end.value, 0) + 1
        out: list[Action] = []
        self._land(hold, rec, PushState.SETTLED, end, detail, now, out)
        return out

    def submit_failed(self, rid: str, load_id: str, detail: str, now: float) -> list[Action]:
        """The driver could not submit ``load_id``: nothing touches its blocks."""
        hold = self._holds.get(rid)
        rec = None if hold is None else hold.pushes.get(load_id)
        if hold is None or rec is None or rec.state is not PushState.IN_FLIGHT:
            return []
        _log.warning("push_refused", request=rid, load=load_id, error=detail)
        self._peers.pop(rec.peer, None)  # told again with the next push
        self.stats.pushed -= 1
        self.stats.refused += 1
        out: list[Action] = []
        self._land(hold, rec, PushState.REFUSED, LoadEnd.REFUSED, detail, now, out)
        return out

    def step(self, now: float) -> list[Action]:
        """Fire what is due: EARLY pushes whose hold never came, holds whose
        deadline passed with nothing in flight; forget idle peers."""
        out: list[Action] = []
        for _, rid, load_id in self._timers.pop_due(now):
            if load_id:
                rec = self._early.get(rid, {}).get(load_id)
                if rec is not None:
                    self._unearly(rec)
                    self._answer(
                        rec, PushState.SETTLED, LoadEnd.UNKNOWN_REQUEST, "never held here", out
                    )
                continue
            hold = self._holds[rid]
            _log.info("hold_expired", request=rid)
            self.stats.expired += 1
            self._release(hold, HoldEnd.EXPIRED, "", out)
        for session in [
            p
            for p, used in self._peer_used.items()
            if now - used >= IDLE_PEER_S and self._peer_loads[p] <= 0
        ]:
            del self._peer_used[session]
            self._peer_loads.pop(session, None)
            self._peers.pop(session, None)
            _log.info("peer_forgotten", peer=session)
            out.append(ForgetPeer(session))
        return out

    # -- decisions -------------------------------------------------------------

    def _timer_live(self, item: tuple[float, str, str]) -> bool:
        due, rid, load_id = item
        if load_id:
            rec = self._early.get(rid, {}).get(load_id)
            return rec is not None and rec.until == due
        hold = self._holds.get(rid)
        return hold is not None and hold.state is HoldState.HELD and hold.deadline == due

    def _push(self, ident: bytes, push: Push, now: float, wall: float, out: list[Action]) -> None:
        rid, load_id = push.request_id, push.load_id
        hold = self._holds.get(rid)
        if (rid, load_id) in self._aborted:
            rec = _Push(rid, load_id, ident, push)
            self._answer(
                rec, PushState.SETTLED, LoadEnd.ABORTED, "the decode gave this load up before", out
            )
        elif hold is not None:
            if load_id in hold.pushes:  # a copy: its decode may have heard the first's answer
                _log.warning("push_duplicate", request=rid, load=load_id)
                return
            left = push.expires_at - wall
            self._start(hold, _Push(rid, load_id, ident, push), push, now, now + left, out)
        elif rid not in self._recent and self._n_early < MAX_EARLY:
            waiting = self._early.setdefault(rid, {})
            if load_id in waiting:
                _log.warning("push_duplicate", request=rid, load=load_id)
                return
            # The engine has not told us yet: wait for hold(), briefly.
            expires = now + push.expires_at - wall
            until = min(max(expires, now), now + EARLY_WAIT_S)
            rec = _Push(rid, load_id, ident, push, until=until, expires=expires)
            PUSH.move(rec, PushState.EARLY, rid)
            waiting[load_id] = rec
            self._n_early += 1
            self._timers.push(until, (until, rid, load_id))
        else:
            how = self._recent.get(rid)
            what = f"request {how}" if how else "too many unknown requests"
            rec = _Push(rid, load_id, ident, push)
            self._answer(rec, PushState.REFUSED, LoadEnd.UNKNOWN_REQUEST, what, out)

    def _start(
        self, hold: _Hold, rec: _Push, push: Push, now: float, expires: float, out: list[Action]
    ) -> None:
        """Turn a held request and a decode's push into a kvguard transfer,
        or refuse it (nothing submitted: the blocks are untouched)."""
        rid = hold.request_id
        hold.pushes[rec.load_id] = rec
        hold.group = max(hold.group, push.group)
        try:
            if push.compat != self._compat:
                raise _Refusal(
                    LoadEnd.INCOMPATIBLE,
                    f"KV layouts differ: decode {push.compat!r}, prefill {self._compat!r}",
                )
            try:
                info = peer_info_of(push.peer)
            except PeerProtocolError as exc:
                raise _Refusal(LoadEnd.BAD_REQUEST, str(exc)) from exc
            if len(push.blocks) > len(hold.blocks):
                raise _Refusal(
                    LoadEnd.BAD_REQUEST,
                    f"decode asks for {len(push.blocks)} blocks, request {rid} has "
                    f"{len(hold.blocks)}",
                )
            try:
                part = block_slice(
                    self._heads,
                    push.first_head,
                    push.head_count,
                    self._head_major,
                    self._block_bytes,
                )
            except ValueError as exc:
                raise _Refusal(LoadEnd.INCOMPATIBLE, str(exc)) from exc
            deadline_s = min(hold.deadline, expires) - now
            if deadline_s <= 0:
                raise _Refusal(LoadEnd.TIMEOUT, "the hold or the push deadline has passed")
        except _Refusal as refusal:
            _log.warning("push_refused", request=rid, load=rec.load_id, error=refusal.detail)
            self.stats.refused += 1
            # Refused, it settles nothing: another decode may still ask in time.
            self._land(hold, rec, PushState.REFUSED, refusal.end, refusal.detail, now, out)
            return
        rec.transfer = f"kvguard-push-{next(self._ids)}"
        rec.peer = session = info.session_id
        PUSH.move(rec, PushState.IN_FLIGHT, rec.load_id)
        hold.in_flight += 1
        if hold.state is HoldState.HELD:
            HOLD.move(hold, HoldState.LOADING, rid)
        new_peer = self._peers.get(session) != info
        self._peers[session] = info
        self._peer_loads[session] += 1
        self._peer_used[session] = now
        self.stats.pushed += 1
        src = hold.blocks[len(hold.blocks) - len(push.blocks) :]
        out.append(
            Submit(
                rid,
                rec.load_id,
                rec.transfer,
                src,
                list(push.blocks),
                info,
                new_peer,
                deadline_s,
                part,
            )
        )

    def _land(
        self,
        hold: _Hold,
        rec: _Push,
        state: PushState,
        end: LoadEnd,
        detail: str,
        now: float,
        out: list[Action],
    ) -> None:
        """``rec`` ended and nothing writes its blocks: answer it, and end the
        hold once its group is settled (or its deadline passed) and no other
        load is in flight."""
        if rec.state is PushState.IN_FLIGHT:
            hold.in_flight -= 1
            self._peer_loads[rec.peer] -= 1
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
        self, rec: _Push, state: PushState, end: LoadEnd, detail: str, out: list[Action]
    ) -> None:
        PUSH.move(rec, state, rec.load_id)
        self.stats.loads += 1
        out.append(
            Reply(
                rec.ident, Result(rec.request_id, rec.load_id, end.ok, end.reason, truncate(detail))
            )
        )

    def _unearly(self, rec: _Push) -> None:
        waiting = self._early[rec.request_id]
        del waiting[rec.load_id]
        if not waiting:
            del self._early[rec.request_id]
        self._n_early -= 1

    def _abort(self, ident: bytes, rid: str, load_id: str, now: float, out: list[Action]) -> None:
        """The decode gave up ``load_id``: answered once nothing writes its
        blocks. With no load id, one decode request of ``rid``'s group will
        never push. Either settles one request of the group."""
        hold = self._holds.get(rid)
        if not load_id:
            if hold is not None:
                hold.forgotten += 1
                self._end_if_settled(hold, out)
            elif rid not in self._recent:
                self._forgets[rid] = self._forgets.get(rid, 0) + 1
                while len(self._forgets) > MAX_EARLY:
                    self._forgets.popitem(last=False)
            return
        self._aborted[(rid, load_id)] = None
        while len(self._aborted) > RECENT:
            self._aborted.popitem(last=False)
        early = self._early.get(rid, {}).get(load_id)
        if early is not None:
            self._unearly(early)
            self._answer(
                early, PushState.SETTLED, LoadEnd.ABORTED, "given up before its push started", out
            )
            return
        rec = None if hold is None else hold.pushes.get(load_id)
        if rec is not None and rec.state is PushState.IN_FLIGHT:
            out.append(AbortTransfer(rec.transfer))  # its release answers it
            return
        if hold is not None and rec is None:
            rec = hold.pushes[load_id] = _Push(rid, load_id, ident, None)
            PUSH.move(rec, PushState.SETTLED, load_id)
            hold.settled += 1
        out.append(
            Reply(ident, Result(rid, load_id, False, LoadEnd.ABORTED.value, "no transfer started"))
        )
        if hold is not None:
            self._end_if_settled(hold, out)

    def _end_if_settled(self, hold: _Hold, out: list[Action]) -> None:
        if hold.state is HoldState.HELD and hold.group_settled():
            self.stats.aborted += 1
            self._release(hold, HoldEnd.ABORTED, "", out)

    def _renew(self, rid: str, now: float) -> None:
        hold = self._holds.get(rid)
        if hold is None:
            return  # ended: the decode's push will hear why
        until = min(now + self._renew_s, hold.last)
        if until <= hold.deadline:
            return
        hold.deadline = until
        if hold.state is HoldState.HELD:
            self._timers.push(until, (until, rid, ""))
        self.stats.renewed += 1
        _log.debug("hold_renewed", request=rid)

    def _release(self, hold: _Hold, end: HoldEnd, reason: str, out: list[Action]) -> None:
        """Release ``hold``'s blocks to the engine, once."""
        rid = hold.request_id
        HOLD.move(hold, HoldState.RELEASED, rid)
        del self._holds[rid]
        self._recent[rid] = f"{end.value}: {reason}" if reason else end.value
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        _log.debug("hold_released", request=rid, how=end.value, reason=reason)
        out.append(Release(rid))


class _Refusal(Exception):
    def __init__(self, end: LoadEnd, detail: str) -> None:
        super().__init__(detail)
        self.end, self.detail = end, detail
