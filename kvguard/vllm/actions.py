"""What the hand-off's cores ask their drivers to do, and what they report.

The contract between a sans-I/O core and its driver: a core returns a list
of these for every event it is fed; the driver carries them out in order
(``prefill_pushes``, ``decode_loads``; the simulation in tests/handoff_sim.py).
An action whose outcome the core must know is answered with an event
(``Submit`` -> ``released`` / ``submit_failed``; ``Open`` -> ``opened`` /
``open_failed``; ``Probe`` -> ``probed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transfer import PeerInfo
from transfer.plan import BlockSlice

from .protocol import Abort, Push, Renew, Result
from .states import LoadEnd

__all__ = [
    "AbortTransfer",
    "Close",
    "DecodeAction",
    "ForgetPeer",
    "LoadOutcome",
    "Open",
    "PrefillAction",
    "Probe",
    "Release",
    "Reply",
    "Report",
    "Send",
    "SenderStats",
    "Submit",
    "Unfence",
]

# -- the prefill ---------------------------------------------------------------


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
    verify: bool = False  # the decode asked for a digest of what is written


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


PrefillAction = Reply | Submit | AbortTransfer | Release | ForgetPeer


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
    denied: int = 0  # handshakes of decodes without an allowed CURVE key
    by_reason: dict[str, int] = field(default_factory=dict)

    def ended(self, end: LoadEnd) -> None:
        """A transfer was released: done, or failed for ``end``."""
        if end.ok:
            self.done += 1
        else:
            self.failed += 1
            self.by_reason[end.value] = self.by_reason.get(end.value, 0) + 1


# -- the decode ----------------------------------------------------------------


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


DecodeAction = Open | Send | Close | Probe | Report | Unfence
