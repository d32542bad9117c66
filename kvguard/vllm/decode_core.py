"""The decode side's decisions, sans I/O: ask prefills to push, end every
wait by its deadline, never let a block go back while a prefill may write it.

``DecodeCore`` is fed events -- the engine's ``expect``, ``cancel``,
``renew`` and ``forget``; a link's socket opened or not; what a link's
monitor saw (``link_event``); a prefill's ``Result``; a probe's answer; the
clock (``step``) -- each with ``now`` (monotonic seconds), and returns
actions: open, close or send on a link, probe a prefill's port, report a
load to the engine, unfence a load's blocks. It owns no socket, lock,
thread or clock; ``decode_loads.DecodeReceiver`` drives it over ZeroMQ, and
the hand-off simulation (tests/handoff_sim.py) on a simulated clock.

Each load is reported exactly once, at the first of:

* the prefill's ``Result`` -- sent only once nothing of the prefill writes
  its blocks -- or proof the prefill is gone (nothing listens on its port,
  or a link that never came up was refused): unfenced;
* its deadline, or its link dropping (a kill, or heartbeats unanswered: a
  frozen or partitioned prefill): *fenced*, since the prefill may still
  write (a frozen one writes on thaw). The load is named again (``Unfence``)
  once its ``Result`` or the proof arrives; until then its blocks stay out
  of circulation. A fenced load's verdict is asked for again (``Abort``)
  while its link is up, for a verdict can be lost while a link changes hands.

A link that never came up after ``stall_s`` (accepted, never answered) is
made again, asking again, waiting twice as long each time; a link idle for
``IDLE_LINK_S`` is closed. States live in ``states.LOAD`` and
``states.LINK``; timers in one lazy heap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog

from scheduler._lazyheap import LazyHeap
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import PeerMessage

from .protocol import Abort, Push, Renew, Result, check, prefill_url, truncate
from .states import LINK, LOAD, LinkEvent, LinkState, LoadEnd, LoadState

__all__ = [
    "IDLE_LINK_S",
    "Action",
    "Close",
    "DecodeCore",
    "Open",
    "Probe",
    "Report",
    "Send",
    "Unfence",
]

_log = structlog.get_logger("kvguard.vllm.receiver")

IDLE_LINK_S: Final = 60.0  # a link with no load this long is closed
# A lost link's prefill is probed this often: a plain TCP connect to its
# control port, refused only when nothing listens (a stopped process's port
# still accepts, so ZeroMQ's own retries prove nothing).
PROBE_EVERY_S: Final = 0.5
# A stalled link's wait before it is made again doubles up to 2**this times ``stall_s``.
MAX_BACKOFF_DOUBLINGS: Final = 4


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one expected load ended on this side."""

    request_id: str
    end: LoadEnd
    detail: str
    latency_s: float  # expect() -> this outcome
    # Failed with no word from the prefill: it may still write the blocks.
    # An ``Unfence`` names the request once nothing can.
    fenced: bool = False

    @property
    def ok(self) -> bool:
        return self.end.ok

    @property
    def reason(self) -> str:
        return self.end.reason


# -- actions -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Open socket ``gen`` to ``endpoint`` (replacing the open one, if any,
    only once it is made): answer with ``opened`` or ``open_failed``."""

    endpoint: str
    gen: int


@dataclass(frozen=True, slots=True)
class Send:
    endpoint: str  # on its open socket; dropped if it has none
    msg: Push | Abort | Renew


@dataclass(frozen=True, slots=True)
class Close:
    endpoint: str  # with whatever its socket still queued


@dataclass(frozen=True, slots=True)
class Probe:
    endpoint: str  # does anything listen there? Answer with ``probed``


@dataclass(frozen=True, slots=True)
class Report:
    outcome: LoadOutcome  # to the engine, once per load


@dataclass(frozen=True, slots=True)
class Unfence:
    request_id: str  # a fenced load's blocks: nothing writes them any more


Action = Open | Send | Close | Probe | Report | Unfence

_DEADLINE, _REASK, _LINK = 0, 1, 2  # timer kinds


@dataclass(slots=True)
class _Wait:
    """One load (``states.LOAD``)."""

    request_id: str
    endpoint: str
    remote_id: str
    deadline: float
    started: float
    push: Push  # sent again on a remade link
    state: LoadState = LoadState.ASKED
    reask_at: float = 0.0  # FENCED, CANCELLED: when to ask for the verdict again


@dataclass(slots=True)
class _Link:
    """One prefill endpoint (``states.LINK``)."""

    endpoint: str
    state: LinkState = LinkState.DIALING
    gen: int = 0  # the open socket's number; 0 until the first is open
    dialing: int = 0  # the socket asked for and not yet answered; 0 when none
    queued: list[Push | Abort | Renew] = field(default_factory=list)  # until gen > 0
    waits: set[str] = field(default_factory=set)  # loads awaiting this prefill's verdict
    used: float = 0.0  # the last expect, renew or forget
    down_since: float = 0.0  # the connect or the drop: not up long after either is a stall
    stalls: int = 0  # remakes in a row that never came up; each waits twice as long
    probe_at: float = 0.0  # LOST: when to probe next
    wake: float = 0.0  # its live timer
    last_event: str = "none"  # the monitor's latest word, for logs


class DecodeCore:
    """Loads and links, decided from events; see the module docstring."""

    def __init__(
        self,
        peer: PeerMessage,
        *,
        stall_s: float = 3.0,
        margin_s: float = 0.25,
        compat: str = "",
        heads: tuple[int, int] = (0, 0),
    ) -> None:
        """``peer``: what this side advertises. ``stall_s``: a link not up
        this long after its connect or drop is stalled (the heartbeat
        timeout). ``margin_s``: the prefill is told to finish that much
        before the deadline, so its verdict arrives in time. ``compat`` and
        ``heads`` (first, count) go with each push."""
        self._peer = peer
        self._stall_s = stall_s
        self._margin_s = margin_s
        self._compat = compat
        self._heads = heads
        self._gens = itertools.count(1)
        self._waits: dict[str, _Wait] = {}  # until OVER
        self._links: dict[str, _Link] = {}  # until CLOSED
        self._timers: LazyHeap[float, tuple[float, int, str]] = LazyHeap(self._live)

    # -- inspection ------------------------------------------------------------

    def links(self) -> int:
        return len(self._links)

    def waiting(self) -> int:
        return len(self._waits)

    def next_wake(self) -> float | None:
        return self._timers.next_key()

    def drained(self) -> bool:
        return not self._waits

    # -- events ----------------------------------------------------------------

    def expect(
        self,
        rid: str,
        endpoint: str,
        remote_id: str,
        blocks: Sequence[int],
        deadline: float,
        group: int,
        now: float,
        wall: float,
    ) -> list[Action]:
        """Ask ``endpoint`` to push ``remote_id`` into ``blocks``; end by ``deadline``."""
        out: list[Action] = []
        if rid in self._waits:
            # The engine reused an id still loading: one outcome per id, the first's.
            _log.error("expect_duplicate", request=rid, remote=remote_id)
            return out
        left = deadline - now - self._margin_s
        if left <= 0:
            out.append(
                Report(LoadOutcome(rid, LoadEnd.TIMEOUT, "deadline passed before asking", 0.0))
            )
            return out
        first, count = self._heads
        push = Push(
            remote_id, rid, list(blocks), self._peer, wall + left, self._compat, group, first, count
        )
        try:
            check(push)  # the prefill's own checks (ids, bounds): nothing sent
            url = prefill_url(endpoint)
        except PeerProtocolError as exc:
            out.append(Report(LoadOutcome(rid, LoadEnd.BAD_REQUEST, truncate(str(exc)), 0.0)))
            return out
        except ValueError as exc:
            detail = truncate(f"{endpoint!r}: {exc}")
            out.append(Report(LoadOutcome(rid, LoadEnd.BAD_ENDPOINT, detail, 0.0)))
            return out
        link = self._link(url, now, out)
        self._waits[rid] = _Wait(rid, url, remote_id, deadline, now, push)
        link.waits.add(rid)
        self._timers.push(deadline, (deadline, _DEADLINE, rid))
        self._send(link, push, out)
        self._arm(link)
        return out

    def cancel(self, rid: str, now: float) -> list[Action]:
        """The engine gave ``rid`` up: ask the prefill to stop. It is still
        reported once, with the prefill's verdict (its blocks may be written
        until then)."""
        out: list[Action] = []
        wait = self._waits.get(rid)
        if wait is not None and wait.state is LoadState.ASKED:
            LOAD.move(wait, LoadState.CANCELLED, rid)
            self._ask_verdict(wait, now, out)
        return out

    def renew(self, endpoint: str, remote_id: str, now: float) -> list[Action]:
        """A request that will load ``remote_id`` still queues: keep it held."""
        return self._tell(endpoint, Renew(remote_id), now)

    def forget(self, endpoint: str, remote_id: str, now: float) -> list[Action]:
        """Tell a prefill its request will never be asked for (free it now)."""
        return self._tell(endpoint, Abort(remote_id), now)

    def opened(self, endpoint: str, gen: int, now: float) -> list[Action]:
        """Socket ``gen`` to ``endpoint`` is open (the previous one closed)."""
        out: list[Action] = []
        link = self._links.get(endpoint)
        if link is None or gen != link.dialing:
            return out
        link.dialing = 0
        if link.gen == 0:  # the first: what was asked meanwhile goes out now
            link.gen = gen
            link.down_since = now
            for msg in link.queued:
                out.append(Send(endpoint, msg))
            link.queued.clear()
        else:
            # A remade link: the old socket's handshake may have happened
            # unseen as it closed, so only the prefill's answer or a refusal
            # frees a block. Ask again for every push and given-up verdict.
            LINK.move(link, LinkState.LOST if link.state is LinkState.LOST else LinkState.REDIALING)
            link.gen, link.down_since, link.stalls = gen, now, link.stalls + 1
            for rid in sorted(link.waits):
                wait = self._waits[rid]
                if wait.state is LoadState.ASKED:
                    out.append(Send(endpoint, wait.push))
                else:
                    self._ask_verdict(wait, now, out)
        self._arm(link)
        return out

    def open_failed(self, endpoint: str, gen: int, detail: str, now: float) -> list[Action]:
        """Socket ``gen`` could not be made: a first one fails its loads
        (nothing was sent); a remake keeps the old socket and backs off."""
        out: list[Action] = []
        link = self._links.get(endpoint)
        if link is None or gen != link.dialing:
            return out
        link.dialing = 0
        if link.gen == 0:
            what = truncate(f"{endpoint!r}: {detail}")
            for rid in sorted(link.waits):
                self._over(self._waits[rid], LoadEnd.BAD_ENDPOINT, what, now, out)
            self._close(link, out)
            return out
        _log.warning("prefill_link_reopen_failed", endpoint=endpoint, error=detail)
        link.down_since, link.stalls = now, link.stalls + 1
        self._arm(link)
        return out

    def link_event(self, endpoint: str, gen: int, ev: LinkEvent, now: float) -> list[Action]:
        """What socket ``gen``'s monitor saw."""
        out: list[Action] = []
        link = self._links.get(endpoint)
        if link is None or gen != link.gen:
            return out
        link.last_event = ev.value
        what = f"prefill {endpoint}: {ev.value}"
        if not ev.acted_on:
            return out
        if ev is LinkEvent.HANDSHAKE:
            _log.info(
                "prefill_link_up",
                endpoint=endpoint,
                was=link.state.name,
                was_lost=link.state is LinkState.LOST,
                waits=len(link.waits),
            )
            if link.state in (LinkState.LOST, LinkState.REDIALING):
                # What we asked may be lost: ask again for every verdict we
                # gave up on (pushes sent since are queued on this socket).
                for rid in sorted(link.waits):
                    wait = self._waits[rid]
                    if wait.state is not LoadState.ASKED:
                        self._ask_verdict(wait, now, out)
            if link.state is not LinkState.UP:
                LINK.move(link, LinkState.UP, endpoint)
            link.stalls = 0
        elif link.state is LinkState.LOST:
            pass  # a lost link waits for its handshake or a probe
        elif link.state is LinkState.UP and ev is not LinkEvent.DROPPED:
            pass  # only a drop ends an up link's session
        elif link.state is LinkState.DIALING:
            # Never connected: nothing we sent was delivered (messages flow
            # only after a handshake), and closing the link drops what it
            # queued, so no prefill started later gets it.
            self._drop_all(link, what, now, out)
            return out
        else:
            # Dropped: killed, or silent (frozen, partitioned), or a remade
            # link's drop before its handshake. Not proof: a frozen prefill
            # writes on thaw; the loads stay fenced until its Result or a probe.
            _log.info("prefill_link_lost", endpoint=endpoint, waits=len(link.waits))
            LINK.move(link, LinkState.LOST, endpoint)
            link.probe_at = link.down_since = now
            for rid in sorted(link.waits):
                self._give_up(self._waits[rid], LoadEnd.PEER_LOST, what, now, out)
        self._arm(link)
        return out

    def echoed(self, endpoint: str, gen: int, now: float) -> list[Action]:
        """Our own message came back on socket ``gen``: it connected to itself
        (TCP self-connect), which happens only where nothing listens."""
        out: list[Action] = []
        link = self._links.get(endpoint)
        if link is not None and gen == link.gen:
            what = f"prefill {endpoint}: connected to itself, nothing listens there"
            self._drop_all(link, what, now, out)
        return out

    def result(self, endpoint: str, res: Result, now: float) -> list[Action]:
        """A prefill's verdict on one load: nothing of it writes its blocks."""
        out: list[Action] = []
        wait = self._waits.get(res.load_id)
        if wait is None or wait.endpoint != endpoint or wait.remote_id != res.request_id:
            _log.info("result_unexpected", endpoint=endpoint, load=res.load_id)
            return out  # not a load of ours on this link: it marks nothing
        end = LoadEnd.of_result(res.ok, res.reason)
        detail = res.detail if end is not LoadEnd.PREFILL_ERROR else f"{res.reason}: {res.detail}"
        self._over(wait, end, truncate(detail), now, out)
        return out

    def probed(self, endpoint: str, gone: bool, now: float) -> list[Action]:
        """A probe's answer: ``gone`` when nothing listens at the port."""
        out: list[Action] = []
        link = self._links.get(endpoint)
        if gone and link is not None and link.state is LinkState.LOST:
            self._drop_all(link, f"prefill {endpoint}: connection refused", now, out)
        return out

    def step(self, now: float) -> list[Action]:
        """Fire what is due: deadlines, verdicts to ask for again, links to
        probe (one a step: an unreachable host's probe takes its timeout),
        remake or close."""
        out: list[Action] = []
        probed = False
        for _, kind, key in self._timers.pop_due(now):
            if kind == _DEADLINE:
                wait = self._waits[key]
                self._ask_verdict(wait, now, out)  # answered once nothing writes
                why = "no verdict from the prefill by the deadline"
                self._give_up(wait, LoadEnd.TIMEOUT, why, now, out)
            elif kind == _REASK:
                wait = self._waits[key]
                if self._links[wait.endpoint].state is LinkState.UP:
                    self._ask_verdict(wait, now, out)
                else:  # its handshake asks again
                    self._reask_at(wait, now + self._stall_s)
            else:
                probed = self._link_due(self._links[key], now, probed, out)
        return out

    # -- decisions -------------------------------------------------------------

    def _live(self, item: tuple[float, int, str]) -> bool:
        due, kind, key = item
        if kind == _LINK:
            link = self._links.get(key)
            return link is not None and link.wake == due
        wait = self._waits.get(key)
        if wait is None:
            return False
        if kind == _DEADLINE:
            return wait.state is LoadState.ASKED and wait.deadline == due
        return wait.state is not LoadState.ASKED and wait.reask_at == due

    def _link(self, url: str, now: float, out: list[Action]) -> _Link:
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = _Link(url, down_since=now)
            link.dialing = next(self._gens)
            out.append(Open(url, link.dialing))
        link.used = now
        return link

    def _tell(self, endpoint: str, msg: Abort | Renew, now: float) -> list[Action]:
        out: list[Action] = []
        try:
            url = prefill_url(endpoint)
        except ValueError:
            return out  # its load, if any, was refused as bad_endpoint
        link = self._link(url, now, out)
        self._send(link, msg, out)
        self._arm(link)
        return out

    def _send(self, link: _Link, msg: Push | Abort | Renew, out: list[Action]) -> None:
        if link.gen:
            out.append(Send(link.endpoint, msg))
        else:
            link.queued.append(msg)

    def _ask_verdict(self, wait: _Wait, now: float, out: list[Action]) -> None:
        """Abort: the prefill answers it once nothing writes the blocks."""
        link = self._links.get(wait.endpoint)
        if link is not None:
            self._send(link, Abort(wait.remote_id, wait.request_id), out)
        self._reask_at(wait, now + self._stall_s)

    def _reask_at(self, wait: _Wait, at: float) -> None:
        wait.reask_at = at
        self._timers.push(at, (at, _REASK, wait.request_id))

    def _give_up(
        self, wait: _Wait, end: LoadEnd, detail: str, now: float, out: list[Action]
    ) -> None:
        """Report ``wait`` failed now, fenced: its verdict comes later."""
        if wait.state is not LoadState.ASKED:
            return
        LOAD.move(wait, LoadState.FENCED, wait.request_id)
        if wait.reask_at <= now:
            self._reask_at(wait, now + self._stall_s)
        out.append(Report(LoadOutcome(wait.request_id, end, detail, now - wait.started, True)))

    def _over(self, wait: _Wait, end: LoadEnd, detail: str, now: float, out: list[Action]) -> None:
        """Nothing of the prefill writes ``wait``'s blocks any more."""
        rid = wait.request_id
        was = wait.state
        LOAD.move(wait, LoadState.OVER, rid)
        del self._waits[rid]
        link = self._links.get(wait.endpoint)
        if link is not None:
            link.waits.discard(rid)
            self._arm(link)
        if was is LoadState.FENCED:
            _log.info("kv_load_released", request=rid, reason=end.reason)
            out.append(Unfence(rid))
        else:
            out.append(Report(LoadOutcome(rid, end, detail, now - wait.started)))

    def _drop_all(self, link: _Link, what: str, now: float, out: list[Action]) -> None:
        """Proof nothing of this prefill writes: every load over, link closed."""
        for rid in sorted(link.waits):
            self._over(self._waits[rid], LoadEnd.PEER_LOST, what, now, out)
        self._close(link, out)

    def _close(self, link: _Link, out: list[Action]) -> None:
        _log.info("prefill_link_closed", endpoint=link.endpoint, state=link.state.name)
        LINK.move(link, LinkState.CLOSED, link.endpoint)
        del self._links[link.endpoint]
        if link.gen:
            out.append(Close(link.endpoint))

    def _stall_due(self, link: _Link) -> float | None:
        if link.state is LinkState.UP or not link.waits or link.dialing:
            return None
        backoff = 1 << min(link.stalls, MAX_BACKOFF_DOUBLINGS)
        return link.down_since + self._stall_s * backoff

    def _arm(self, link: _Link) -> None:
        """Set ``link``'s one timer to its next probe, stall or idle check."""
        dues = [link.used + IDLE_LINK_S] if not link.waits else []
        stall = self._stall_due(link)
        if stall is not None:
            dues.append(stall)
        if link.state is LinkState.LOST and link.waits:
            dues.append(link.probe_at)
        wake = min(dues) if dues else 0.0
        if wake and wake != link.wake:
            link.wake = wake
            self._timers.push(wake, (wake, _LINK, link.endpoint))

    def _link_due(self, link: _Link, now: float, probed: bool, out: list[Action]) -> bool:
        link.wake = 0.0
        if link.state is LinkState.LOST and link.waits and link.probe_at <= now:
            if probed:  # one probe a step: the next step probes this one
                link.wake = now
                self._timers.push(now, (now, _LINK, link.endpoint))
            else:
                link.probe_at = now + PROBE_EVERY_S
                out.append(Probe(link.endpoint))
                self._arm(link)
            return True
        stall = self._stall_due(link)
        if stall is not None and stall < now:
            _log.warning(
                "prefill_link_stalled",
                endpoint=link.endpoint,
                waits=len(link.waits),
                after_s=round(now - link.down_since, 3),
                last_event=link.last_event,
            )
            link.dialing = next(self._gens)
            out.append(Open(link.endpoint, link.dialing))
        elif not link.waits and now - link.used >= IDLE_LINK_S:
            self._close(link, out)
            return probed
        self._arm(link)
        return probed
