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

import structlog

from scheduler._lazyheap import LazyHeap
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import PeerMessage

from .actions import DecodeAction, LoadOutcome, Report, Unfence
from .decode_links import _DEADLINE, _LINK, _REASK, LinkSide
from .decode_records import Link, Wait
from .protocol import Abort, Push, Renew, Result, check, prefill_url, truncate
from .states import LOAD, LinkState, LoadEnd, LoadState

__all__ = ["DecodeCore"]

_log = structlog.get_logger("kvguard.vllm.receiver")


class DecodeCore(LinkSide):
    """Loads and links, decided from events; see the module docstring."""

    def __init__(
        self,
        peer: PeerMessage,
        *,
        stall_s: float = 3.0,
        margin_s: float = 0.25,
        compat: str = "",
        heads: tuple[int, int] = (0, 0),
        verify: bool = False,
    ) -> None:
        """``peer``: what this side advertises. ``stall_s``: a link not up
        this long after its connect or drop is stalled (the heartbeat
        timeout). ``margin_s``: the prefill is told to finish that much
        before the deadline, so its verdict arrives in time. ``compat`` and
        ``heads`` (first, count) go with each push, and ``verify``: ask for
        a digest of the bytes written (the driver checks it)."""
        self._peer = peer
        self._stall_s = stall_s
        self._margin_s = margin_s
        self._compat = compat
        self._heads = heads
        self._verify = verify
        self._gens = itertools.count(1)
        self._waits: dict[str, Wait] = {}  # until OVER
        self._links: dict[str, Link] = {}  # until CLOSED
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
    ) -> list[DecodeAction]:
        """Ask ``endpoint`` to push ``remote_id`` into ``blocks``; end by ``deadline``."""
        out: list[DecodeAction] = []
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
            remote_id,
            rid,
            list(blocks),
            self._peer,
            wall + left,
            self._compat,
            group,
            first,
            count,
            self._verify,
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
        self._waits[rid] = Wait(rid, url, remote_id, deadline, now, push)
        link.waits.add(rid)
        self._timers.push(deadline, (deadline, _DEADLINE, rid))
        self._send(link, push, out)
        self._arm(link)
        return out

    def cancel(self, rid: str, now: float) -> list[DecodeAction]:
        """The engine gave ``rid`` up: ask the prefill to stop. It is still
        reported once, with the prefill's verdict (its blocks may be written
        until then)."""
        out: list[DecodeAction] = []
        wait = self._waits.get(rid)
        if wait is not None and wait.state is LoadState.ASKED:
            LOAD.move(wait, LoadState.CANCELLED, rid)
            self._ask_verdict(wait, now, out)
        return out

    def renew(self, endpoint: str, remote_id: str, now: float) -> list[DecodeAction]:
        """A request that will load ``remote_id`` still queues: keep it held."""
        return self._tell(endpoint, Renew(remote_id), now)

    def forget(
        self, endpoint: str, remote_id: str, now: float, group: int = 1
    ) -> list[DecodeAction]:
        """Tell a prefill one decode request of ``remote_id``'s group (of
        ``group`` as the client declared it) will never ask for it."""
        return self._tell(endpoint, Abort(remote_id, group=group), now)

    def result(self, endpoint: str, res: Result, now: float) -> list[DecodeAction]:
        """A prefill's verdict on one load: nothing of it writes its blocks."""
        out: list[DecodeAction] = []
        wait = self._waits.get(res.load_id)
        if wait is None or wait.endpoint != endpoint or wait.remote_id != res.request_id:
            _log.info("result_unexpected", endpoint=endpoint, load=res.load_id)
            return out  # not a load of ours on this link: it marks nothing
        end = LoadEnd.of_result(res.ok, res.reason)
        detail = res.detail if end is not LoadEnd.PREFILL_ERROR else f"{res.reason}: {res.detail}"
        self._over(wait, end, truncate(detail), now, out)
        return out

    def step(self, now: float) -> list[DecodeAction]:
        """Fire what is due: deadlines, verdicts to ask for again, links to
        probe (one a step: an unreachable host's probe takes its timeout),
        remake or close."""
        out: list[DecodeAction] = []
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

    def _tell(self, endpoint: str, msg: Abort | Renew, now: float) -> list[DecodeAction]:
        out: list[DecodeAction] = []
        try:
            url = prefill_url(endpoint)
        except ValueError:
            return out  # its load, if any, was refused as bad_endpoint
        link = self._link(url, now, out)
        self._send(link, msg, out)
        self._arm(link)
        return out

    def _ask_verdict(self, wait: Wait, now: float, out: list[DecodeAction]) -> None:
        """Abort: the prefill answers it once nothing writes the blocks."""
        link = self._links.get(wait.endpoint)
        if link is not None:
            # With its group's size: a hold no push reached yet settles the group it names.
            self._send(link, Abort(wait.remote_id, wait.request_id, wait.push.group), out)
        self._reask_at(wait, now + self._stall_s)

    def _reask_at(self, wait: Wait, at: float) -> None:
        wait.reask_at = at
        self._timers.push(at, (at, _REASK, wait.request_id))

    def _give_up(
        self, wait: Wait, end: LoadEnd, detail: str, now: float, out: list[DecodeAction]
    ) -> None:
        """Report ``wait`` failed now, fenced: its verdict comes later."""
        if wait.state is not LoadState.ASKED:
            return
        LOAD.move(wait, LoadState.FENCED, wait.request_id)
        if wait.reask_at <= now:
            self._reask_at(wait, now + self._stall_s)
        out.append(Report(LoadOutcome(wait.request_id, end, detail, now - wait.started, True)))

    def _over(
        self, wait: Wait, end: LoadEnd, detail: str, now: float, out: list[DecodeAction]
    ) -> None:
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
