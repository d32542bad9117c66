"""Peer changes, in the core: a decode peer added or replaced, removed, lost
(to a transfer error or to failed probes) and revived by a probe.

``SchedulerCore`` is a ``PeerChanges``. Each change fails the peer's live
requests with PEER_LOST where it must: a replacement that advertises
something else (their plans target the old advertisement), a removal, a
loss. The core's own structlog events are these, one per peer change and
none per request: ``peer_removed``, ``peer_lost`` and ``peer_alive``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from lifecycle import FailureReason
from transfer import PeerInfo, PeerLost, TransferError

from ._requests import RequestRecord, RequestTable, fail_all

__all__ = ["PeerChanges"]

_log = structlog.get_logger("kvguard.scheduler")


class PeerChanges:
    """The peer inputs of ``SchedulerCore`` (any thread) and their handlers (step only)."""

    # The core's own, set by SchedulerCore.__init__.
    table: RequestTable
    probe_interval_s: float
    _now: float  # the time step() was given

    if TYPE_CHECKING:  # the core's, called from here

        def _finish(self, req: RequestRecord, *, expired: bool = False) -> None: ...

    # -- any thread ------------------------------------------------------------------

    def probe_result(self, session_id: str, error: BaseException | None) -> None:
        self.table.post(self._on_probe, session_id, error)

    def add_peer(self, info: PeerInfo) -> int:
        with self.table.lock:
            _, stranded = self.table.peers.add(info)
        err = PeerLost(f"peer {info.session_id} was replaced", peer=info.session_id)
        return fail_all(stranded, FailureReason.PEER_LOST, err)

    def remove_peer(self, session_id: str) -> int | None:
        with self.table.lock:
            peer = self.table.peers.remove(session_id)
        if peer is None:
            return None
        _log.info("peer_removed", peer=session_id, live_requests=len(peer.live))
        err = PeerLost(f"peer {session_id} was removed", peer=session_id)
        return fail_all(list(peer.live), FailureReason.PEER_LOST, err)

    def lose_peer(self, session_id: str, err: TransferError) -> int | None:
        """Mark lost and fail its live requests; None if the peer is unknown."""
        victims = self._lose(session_id)
        return None if victims is None else fail_all(victims, FailureReason.PEER_LOST, err)

    def _lose(self, session_id: str) -> list[RequestRecord] | None:
        with self.table.lock:
            if self.table.peers.get(session_id) is None:
                return None
            newly, victims = self.table.peers.lose(session_id)
        if newly:
            _log.warning("peer_lost", peer=session_id, live_requests=len(victims))
            self.table.wake()  # the driver schedules probes that may revive it
        return victims

    # -- step only -----------------------------------------------------------------

    def _on_probe(self, session_id: str, error: BaseException | None) -> None:
        with self.table.lock:
            verdict = self.table.peers.probed(
                session_id, error is None, self._now, self.probe_interval_s
            )
        if verdict == "lost":
            self._lose_now(session_id, PeerLost(f"probe failed: {error}", peer=session_id))
        elif verdict == "alive":
            _log.info("peer_alive", peer=session_id)

    def _lose_now(self, session_id: str, err: TransferError) -> None:
        # In the step, the core's own endings post nothing: finish them here.
        for req in self._lose(session_id) or ():
            if req.lc.fail(FailureReason.PEER_LOST, err) or req.lc.is_terminal:
                self._finish(req)
