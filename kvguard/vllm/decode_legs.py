"""A decode request's load as legs, one per prefill rank that writes some of it.

With tensor parallelism of different sizes (``ranks``), one decode rank's
blocks are written by several prefill ranks: each writes its heads, as a
load of its own in ``DecodeReceiver`` (a *leg*). vLLM must hear of the
request once, and only as the legs together allow:

* loaded: every leg loaded;
* failed: some leg failed, and every leg is over and none may still write
  the blocks (a fenced leg is over once ``take_released`` names it);
* until then a failed request's blocks go to vLLM as load errors, once, so
  it fails the request (or schedules its recompute) now and keeps the blocks
  until the finish.

Equal sizes give one leg per request, named as the request: this is then the
receiver's own outcome, unchanged. vLLM joins the ranks' reports itself (a
request is finished when every rank said so).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import structlog

from .actions import LoadOutcome
from .states import REQUEST, LoadEnd, RequestState

__all__ = ["DecodeLegs", "Verdict"]

_log = structlog.get_logger("kvguard.vllm.receiver")
_RECENT: Final = 4096  # request outcomes kept for the stats


@dataclass(frozen=True, slots=True)
class Verdict:
    """What vLLM is told about ``request_id`` now."""

    request_id: str
    blocks: list[int]
    outcome: LoadOutcome  # the request's: the first failed leg's, else loaded
    final: bool  # True: finished (failed too unless ok); False: its blocks are load errors


@dataclass(slots=True)
class _Load:
    """A request's legs (``states.REQUEST``): FINISHED iff no leg is pending
    or fenced; INVALID iff a leg failed and its blocks went out as load errors."""

    request_id: str
    blocks: list[int]
    pending: set[str]  # legs not reported yet
    fenced: set[str] = field(default_factory=set)  # reported fenced, not released yet
    # Legs released before their report: the worker takes the receiver's
    # reports, then its releases, so a load fenced and released between the
    # two takes comes as its release first. Its report then ends the leg.
    early: set[str] = field(default_factory=set)
    outcome: LoadOutcome | None = None  # the first failure, or the last loaded leg's
    latency_s: float = 0.0  # the slowest leg's, so far
    state: RequestState = RequestState.LOADING


class DecodeLegs:
    """The legs of each decode request in flight; one thread (the worker's)."""

    def __init__(self) -> None:
        self._loads: dict[str, _Load] = {}  # request id -> its legs, until finished
        # leg id -> its load, while the leg is pending or fenced (it may report or be released)
        self._load_of: dict[str, _Load] = {}
        self._recent: OrderedDict[str, LoadOutcome] = OrderedDict()  # the last _RECENT

    def start(self, request_id: str, blocks: Sequence[int], legs: Sequence[str]) -> bool:
        """``request_id`` loads ``blocks`` through ``legs`` (leg ids, distinct).
        False for an id still loading: its first load stands."""
        if request_id in self._loads or not legs:
            _log.error("expect_duplicate", request=request_id, legs=list(legs))
            return False
        load = self._loads[request_id] = _Load(request_id, list(blocks), set(legs))
        for leg in legs:
            self._load_of[leg] = load
        return True

    def refused(
        self, request_id: str, blocks: Sequence[int], end: LoadEnd, why: str
    ) -> Verdict | None:
        """``request_id``'s load cannot start (nothing was asked): failed at
        once, ``end`` and ``why``; None for an id still loading."""
        if not self.start(request_id, blocks, [request_id]):
            return None
        verdict = self.reported(LoadOutcome(request_id, end, why, 0.0))
        assert verdict is not None and verdict.final
        return verdict

    def legs(self, request_id: str) -> list[str]:
        """The legs of ``request_id`` not reported yet (to cancel)."""
        load = self._loads.get(request_id)
        return sorted(load.pending) if load else []

    def blocks(self, request_id: str) -> list[int]:
        """The blocks ``request_id`` loads into ([] once finished)."""
        load = self._loads.get(request_id)
        return list(load.blocks) if load else []

    def drop(self, request_id: str) -> list[int]:
        """Forget ``request_id`` and its legs (tests: the canary's control,
        which gives fenced blocks back early on purpose); its blocks."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return []
        for leg in load.pending | load.fenced:
            self._load_of.pop(leg, None)
        return load.blocks

    def in_use(self) -> dict[str, int]:
        """Requests whose blocks vLLM has not got back: their block counts."""
        return {rid: len(load.blocks) for rid, load in self._loads.items()}

    def recent_outcomes(self) -> list[LoadOutcome]:
        """The requests' outcomes, oldest first, once every leg reported."""
        return list(self._recent.values())

    def reported(self, out: LoadOutcome) -> Verdict | None:
        """A leg's outcome, from the receiver's ``take_finished``."""
        load = self._load_of.get(out.request_id)
        if load is None or out.request_id not in load.pending:
            return None
        rid = load.request_id
        load.pending.discard(out.request_id)
        load.latency_s = max(load.latency_s, out.latency_s)
        if out.fenced and out.request_id not in load.early:
            load.fenced.add(out.request_id)
        else:
            del self._load_of[out.request_id]
        if load.outcome is None or (load.outcome.ok and not out.ok):
            load.outcome = out
        if not load.pending:
            merged = replace(
                load.outcome,
                request_id=rid,
                latency_s=load.latency_s,
                fenced=bool(load.fenced),
            )
            self._recent[rid] = merged
            self._recent.move_to_end(rid)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        return self._verdict(rid, load)

    def released(self, leg: str) -> Verdict | None:
        """A fenced leg nothing writes any more, from ``take_released``;
        one not reported yet is kept for its report (``_Load.early``)."""
        load = self._load_of.get(leg)
        if load is None:
            return None
        if leg in load.pending:
            load.early.add(leg)
            return None
        del self._load_of[leg]  # mapped and not pending: fenced
        load.fenced.discard(leg)
        return self._verdict(load.request_id, load)

    def _verdict(self, rid: str, load: _Load) -> Verdict | None:
        outcome = load.outcome
        assert outcome is not None  # a leg reported
        merged = replace(outcome, request_id=rid, latency_s=load.latency_s)
        if not load.pending and not load.fenced:
            REQUEST.move(load, RequestState.FINISHED, rid)
            del self._loads[rid]
            return Verdict(rid, load.blocks, merged, final=True)
        if not outcome.ok and load.state is RequestState.LOADING:
            REQUEST.move(load, RequestState.INVALID, rid)
            return Verdict(rid, load.blocks, merged, final=False)
        return None
