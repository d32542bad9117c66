"""Which decode peers a prefill knows, and when one may be forgotten.

Decodes churn: every restart is a new Mooncake session, so a prefill that
remembered each would grow without bound. A peer is learnt from a push
(its advertisement, told to the engine once, again if it changed), counted
while loads to it are in flight, and forgotten once none has been for
``idle_s`` (the owner's setting, given at each call): forgetting it fails
nothing, and its next push teaches it again.
"""

from __future__ import annotations

from collections import Counter

from transfer import PeerInfo

__all__ = ["PeerLedger"]


class PeerLedger:
    """Decode sessions: their advertisement, loads in flight, last use."""

    __slots__ = ("_info", "_loads", "_used")

    def __init__(self) -> None:
        self._info: dict[str, PeerInfo] = {}  # sessions the engine was told of
        self._loads: Counter[str] = Counter()  # session -> loads in flight to it; >= 0
        self._used: dict[str, float] = {}  # session -> last push admitted to it

    def __len__(self) -> int:
        return len(self._used)

    def admit(self, info: PeerInfo, now: float) -> bool:
        """A load to ``info`` starts: True if the engine must be told of it."""
        session = info.session_id
        new = self._info.get(session) != info
        self._info[session] = info
        self._loads[session] += 1
        self._used[session] = now
        return new

    def done(self, session: str, *, told: bool = True) -> None:
        """A load to ``session`` ended; ``told`` False: the engine may not
        know the peer (its submit failed), so the next push tells it again."""
        self._loads[session] -= 1
        if not told:
            self._info.pop(session, None)

    def next_idle(self, idle_s: float) -> float | None:
        """When the first idle peer may be forgotten (peers are few: scanned)."""
        dues = [u + idle_s for p, u in self._used.items() if self._loads[p] <= 0]
        return min(dues) if dues else None

    def forget_idle(self, now: float, idle_s: float) -> list[str]:
        """Forget the peers idle for ``idle_s``; their sessions."""
        idle = [p for p, u in self._used.items() if now - u >= idle_s and self._loads[p] <= 0]
        for p in idle:
            del self._used[p]
            self._loads.pop(p, None)
            self._info.pop(p, None)
        return idle
