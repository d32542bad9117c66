"""The decode's links to its prefills: what each socket's events mean for the loads on it.

``LinkSide`` is the half of ``decode_core.DecodeCore`` that reads a link's
socket: opened or not, its monitor's events, our own frames come back, a
probe's answer, and the link's timer (probe, stall, idle). What an event
means for a load is the other half's (``_over``: the prefill's last word or
proof it is gone; ``_give_up``: a fenced failure; ``_ask_verdict``).

* A link that never came up (DIALING) and is refused or dropped proves
  nothing was delivered: its loads end unfenced and it closes.
* An up link that drops (a kill, or heartbeats unanswered: frozen,
  partitioned), or a remade one that drops before its handshake, is LOST:
  its loads fail fenced, and a probe of the port every ``PROBE_EVERY_S``
  turns that into proof once nothing listens (a stopped process's port
  still accepts). A new handshake asks again for every verdict given up.
* A link not up ``stall_s`` after its connect or drop (accepted, never
  answered) is remade, asking again, backing off; one idle ``IDLE_LINK_S``
  closes.
"""

from __future__ import annotations

import itertools
from typing import Final

import structlog

from scheduler._lazyheap import LazyHeap

from .actions import Close, DecodeAction, Open, Probe, Send
from .decode_records import Link, Wait
from .protocol import Abort, Push, Renew, truncate
from .states import LINK, LinkEvent, LinkState, LoadEnd, LoadState

__all__ = ["IDLE_LINK_S", "PROBE_EVERY_S", "LinkSide"]

_log = structlog.get_logger("kvguard.vllm.receiver")

IDLE_LINK_S: Final = 60.0  # a link with no load this long is closed
# A lost link's prefill is probed this often: a plain TCP connect to its
# control port, refused only when nothing listens.
PROBE_EVERY_S: Final = 0.5

_DEADLINE, _REASK, _LINK = 0, 1, 2  # the kinds of the side's timers


class LinkSide:
    """The link events of ``DecodeCore``; see the module docstring."""

    _stall_s: float  # a link not up this long after its connect or drop is stalled
    _gens: itertools.count[int]  # socket numbers, never reused
    _waits: dict[str, Wait]  # loads until OVER
    _links: dict[str, Link]  # links until CLOSED; each wait's endpoint has one
    _timers: LazyHeap[float, tuple[float, int, str]]  # (due, kind, id): the side's one heap

    def _over(
        self, wait: Wait, end: LoadEnd, detail: str, now: float, out: list[DecodeAction]
    ) -> None:
        raise NotImplementedError

    def _give_up(
        self, wait: Wait, end: LoadEnd, detail: str, now: float, out: list[DecodeAction]
    ) -> None:
        raise NotImplementedError

    def _ask_verdict(self, wait: Wait, now: float, out: list[DecodeAction]) -> None:
        raise NotImplementedError

    def opened(self, endpoint: str, gen: int, now: float) -> list[DecodeAction]:
        """Socket ``gen`` to ``endpoint`` is open (the previous one closed)."""
        out: list[DecodeAction] = []
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

    def open_failed(self, endpoint: str, gen: int, detail: str, now: float) -> list[DecodeAction]:
        """Socket ``gen`` could not be made: a first one fails its loads
        (nothing was sent); a remake keeps the old socket and backs off."""
        out: list[DecodeAction] = []
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

    def link_event(self, endpoint: str, gen: int, ev: LinkEvent, now: float) -> list[DecodeAction]:
        """What socket ``gen``'s monitor saw."""
        out: list[DecodeAction] = []
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
            end = LoadEnd.DENIED if ev is LinkEvent.DENIED else LoadEnd.PEER_LOST
            self._drop_all(link, what, now, out, end)
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

    def echoed(self, endpoint: str, gen: int, now: float) -> list[DecodeAction]:
        """Our own message came back on socket ``gen``: it connected to itself
        (TCP self-connect), which happens only where nothing listens."""
        out: list[DecodeAction] = []
        link = self._links.get(endpoint)
        if link is not None and gen == link.gen:
            what = f"prefill {endpoint}: connected to itself, nothing listens there"
            self._drop_all(link, what, now, out)
        return out

    def probed(self, endpoint: str, gone: bool, now: float) -> list[DecodeAction]:
        """A probe's answer: ``gone`` when nothing listens at the port."""
        out: list[DecodeAction] = []
        link = self._links.get(endpoint)
        if gone and link is not None and link.state is LinkState.LOST:
            self._drop_all(link, f"prefill {endpoint}: connection refused", now, out)
        return out

    def _link(self, url: str, now: float, out: list[DecodeAction]) -> Link:
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = Link(url, down_since=now)
            link.dialing = next(self._gens)
            out.append(Open(url, link.dialing))
        link.used = now
        return link

    def _send(self, link: Link, msg: Push | Abort | Renew, out: list[DecodeAction]) -> None:
        if link.gen:
            out.append(Send(link.endpoint, msg))
        else:
            link.queued.append(msg)

    def _drop_all(
        self,
        link: Link,
        what: str,
        now: float,
        out: list[DecodeAction],
        end: LoadEnd = LoadEnd.PEER_LOST,
    ) -> None:
        """Proof nothing of this prefill writes: every load over (``end``), link closed."""
        for rid in sorted(link.waits):
            self._over(self._waits[rid], end, what, now, out)
        self._close(link, out)

    def _close(self, link: Link, out: list[DecodeAction]) -> None:
        _log.info("prefill_link_closed", endpoint=link.endpoint, state=link.state.name)
        LINK.move(link, LinkState.CLOSED, link.endpoint)
        del self._links[link.endpoint]
        if link.gen:
            out.append(Close(link.endpoint))

    def _arm(self, link: Link) -> None:
        """Set ``link``'s one timer to its next probe, stall or idle check."""
        dues = [link.used + IDLE_LINK_S] if not link.waits else []
        stall = link.stall_due(self._stall_s)
        if stall is not None:
            dues.append(stall)
        if link.state is LinkState.LOST and link.waits:
            dues.append(link.probe_at)
        wake = min(dues) if dues else 0.0
        if wake and wake != link.wake:
            link.wake = wake
            self._timers.push(wake, (wake, _LINK, link.endpoint))

    def _link_due(self, link: Link, now: float, probed: bool, out: list[DecodeAction]) -> bool:
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
        stall = link.stall_due(self._stall_s)
        if stall is not None and stall <= now:
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
