"""A request's phase in the core: the phases, which may follow which, and the one setter.

The lifecycle (``lifecycle``) says what happened to a transfer; the phase
says what the core does with the request: waiting to be seen, queued for a
slot, holding a slot (running or backing off), terminal and held until its
ops quiesce, handed to its release. ``EDGES`` is the whole phase machine and
``move`` is the only code that changes a phase; the core alone calls it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, Protocol

__all__ = ["EDGES", "ENDABLE", "LIVE", "Phase", "PhaseError", "Phased", "move"]


class Phase(enum.IntEnum):
    """Where a request is in the core.

    An IntEnum: the core's hot path hashes and compares phases, and an
    IntEnum member hashes as its int (a plain Enum member hashes its name in
    Python). The values carry no meaning; ``EDGES`` says what follows what.
    """

    NEW = 0  # accepted by submit(); the core has not seen it yet
    QUEUED = 1  # waits for an in-flight slot (admission by priority)
    RUNNING = 2  # holds a slot; an op is in flight
    BACKOFF = 3  # holds a slot; waits to retry
    FINISHED = 4  # terminal and reported; held until every op quiesced
    RELEASING = 5  # handed to the release callback; the id is free once it returns


# Which phase may follow which; anything else is a bug in the core. Every
# phase is reachable from NEW, every phase can reach RELEASING, and
# RELEASING, the only terminal phase, has no way out (tests/test_phase.py).
EDGES: Final[Mapping[Phase, frozenset[Phase]]] = {
    Phase.NEW: frozenset({Phase.QUEUED}),  # the core sees it (ended or not)
    Phase.QUEUED: frozenset({Phase.RUNNING, Phase.FINISHED}),  # admitted, or ended in the queue
    Phase.RUNNING: frozenset({Phase.BACKOFF, Phase.FINISHED}),  # a retryable error, or the end
    Phase.BACKOFF: frozenset({Phase.RUNNING, Phase.FINISHED}),  # the retry starts, or the end
    Phase.FINISHED: frozenset({Phase.RELEASING}),  # its last op quiesced
    Phase.RELEASING: frozenset(),
}

# The phases a request may end in (FINISHED may follow them). Not NEW: the
# core ends such a request when it first sees it, once it is QUEUED.
ENDABLE: Final = frozenset(p for p, nxt in EDGES.items() if Phase.FINISHED in nxt)
# The phases before the core saw the request terminal.
LIVE: Final = ENDABLE | {Phase.NEW}


class PhaseError(RuntimeError):
    """A phase change that ``EDGES`` does not allow: a bug in the core."""


class Phased(Protocol):
    """What ``move`` needs of a request (``_requests.RequestRecord``)."""

    request_id: str
    phase: Phase


def move(req: Phased, new: Phase) -> None:
    """Change ``req.phase`` to ``new`` along ``EDGES``; else raise PhaseError
    naming both phases, and leave the phase as it was."""
    old = req.phase
    if new not in EDGES[old]:
        raise PhaseError(
            f"request {req.request_id!r} cannot go from phase {old.name} to {new.name}"
        )
    req.phase = new
