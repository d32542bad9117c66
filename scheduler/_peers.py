"""Decode peers: what each advertises, whether it is alive, who writes to it.

``Peers`` is plain data with no lock of its own: every method runs under
the request table's lock, the same one that admits submits, so adding,
replacing or removing a peer is atomic with submit() -- a request is either
accepted before the change (and then failed by it) or judged after it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from transfer import PeerInfo

__all__ = ["Peer", "Peers"]

R = TypeVar("R", bound=Hashable)


@dataclass(slots=True, eq=False)
class Peer(Generic[R]):
    info: PeerInfo  # what plans to this peer were validated against
    alive: bool = True  # False: submits fail fast with PEER_LOST, probes try to revive it
    live: set[R] = field(default_factory=set)  # its requests not yet released
    failures: int = 0  # consecutive failed probes; reset by a good one
    next_probe_at: float = 0.0  # core clock; probes are never more frequent
    probing: bool = False  # a probe is out: at most one per peer at a time


class Peers(Generic[R]):
    """The known peers by session id, with probe bookkeeping."""

    __slots__ = ("_by_id", "lost_after", "lost_count")

    _by_id: dict[str, Peer[R]]
    lost_after: int  # consecutive failed probes that make a peer lost; >= 1
    lost_count: int  # alive -> lost changes so far (metrics: peers_lost)

    def __init__(self, lost_after: int) -> None:
        self._by_id = {}
        self.lost_after = lost_after
        self.lost_count = 0

    def get(self, session_id: str) -> Peer[R] | None:
        return self._by_id.get(session_id)

    def __iter__(self) -> Iterator[tuple[str, Peer[R]]]:
        return iter(list(self._by_id.items()))

    def add(self, info: PeerInfo) -> tuple[Peer[R], list[R]]:
        """Add or replace; returns the peer and the requests a replacement strands.

        A replacement that advertises something else (a restarted decode
        instance, other regions) strands the live requests: their plans were
        checked against the old advertisement, so they must not be sent.
        """
        peer = self._by_id.get(info.session_id)
        if peer is None:
            peer = self._by_id[info.session_id] = Peer(info)
            return peer, []
        stranded = []
        if peer.info != info:
            stranded = list(peer.live)
            peer.info = info
        peer.alive = True
        peer.failures = 0
        return peer, stranded

    def remove(self, session_id: str) -> Peer[R] | None:
        return self._by_id.pop(session_id, None)

    def lose(self, session_id: str) -> tuple[bool, list[R]]:
        """Mark lost; (newly lost, its requests not yet released)."""
        peer = self._by_id.get(session_id)
        if peer is None:
            return False, []
        newly = peer.alive
        peer.alive = False
        if newly:
            self.lost_count += 1
        return newly, list(peer.live)

    def revive(self, session_id: str) -> bool:
        """Mark alive; True if it was lost."""
        peer = self._by_id.get(session_id)
        if peer is None or peer.alive:
            return False
        peer.alive = True
        peer.failures = 0
        return True

    def due_probes(self, now: float) -> list[str]:
        """Peers to probe now: those with requests in flight, and lost ones."""
        due = []
        for sid, peer in self._by_id.items():
            if (peer.live or not peer.alive) and not peer.probing and peer.next_probe_at <= now:
                peer.probing = True
                due.append(sid)
        return due

    def next_probe_at(self) -> float | None:
        times = [
            p.next_probe_at
            for p in self._by_id.values()
            if (p.live or not p.alive) and not p.probing
        ]
        return min(times) if times else None

    def probed(self, session_id: str, ok: bool, now: float, interval: float) -> str | None:
        """Record a probe result: "lost", "alive" (revived) or None (no change)."""
        peer = self._by_id.get(session_id)
        if peer is None:
            return None  # removed while the probe was out
        peer.probing = False
        peer.next_probe_at = now + interval
        if ok:
            peer.failures = 0
            return "alive" if self.revive(session_id) else None
        peer.failures += 1
        if peer.alive and peer.failures >= self.lost_after:
            return "lost"
        return None
