"""The decode's records: one leg's load, and the link to one prefill.

``states.LOAD`` and ``states.LINK`` govern their ``state`` fields; only
``decode_core.DecodeCore`` changes them. Each field's invariant is written
next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from .protocol import Abort, Push, Renew
from .states import LinkState, LoadState

__all__ = ["MAX_BACKOFF_DOUBLINGS", "Link", "Wait"]

# A stalled link's wait before it is made again doubles up to 2**this times ``stall_s``.
MAX_BACKOFF_DOUBLINGS: Final = 4


@dataclass(slots=True)
class Wait:
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
class Link:
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

    def stall_due(self, stall_s: float) -> float | None:
        """When a link not up, with loads waiting, counts as stalled: no
        handshake ``stall_s`` after its connect or drop, doubling with each
        remake in a row (a peer that accepts and never answers is not
        dialled every few seconds for good). None: it cannot stall now."""
        if self.state is LinkState.UP or not self.waits or self.dialing:
            return None
        return self.down_since + stall_s * (1 << min(self.stalls, MAX_BACKOFF_DOUBLINGS))
