"""The transition table: the single source of truth for a request's lifecycle.

Everything else is derived from ``TRANSITIONS``: the reference
``transitions.Machine`` (``REFERENCE_MACHINE``), the fast dispatch table the
hot path uses (``DISPATCH``, read back from that machine, not from the tuple),
the generated diagram and the tests that walk the graph.

    PENDING --start--> TRANSFERRING --complete--> DONE
       |                  |   \\--retry--> PENDING   (while attempts remain)
       +------fail--------+--fail--> FAILED

DONE and FAILED are terminal and absorbing. ``transitions`` does not enforce
that (``final=True`` only fires a callback), so ``_validate`` checks it when
this module is imported: a bad edit to the table fails at import, not in
production.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

from transitions import Machine

__all__ = [
    "DISPATCH",
    "GUARDS",
    "INITIAL",
    "REFERENCE_MACHINE",
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "FailureReason",
    "TransferState",
    "Transition",
]


class TransferState(enum.Enum):
    PENDING = "PENDING"
    TRANSFERRING = "TRANSFERRING"
    DONE = "DONE"
    FAILED = "FAILED"


class Event(str, enum.Enum):
    START = "start"
    COMPLETE = "complete"
    RETRY = "retry"
    FAIL = "fail"


class FailureReason(enum.Enum):
    """Why a request ended FAILED. The first cause wins (invariant I2)."""

    TRANSFER_ERROR = "transfer_error"  # the engine reported a failure
    PEER_LOST = "peer_lost"  # the decode peer is dead or unreachable
    TIMEOUT = "timeout"  # the request's deadline passed
    ABORTED = "aborted"  # the caller aborted it, or its worker was cancelled
    WORKER_CRASHED = "worker_crashed"  # the worker raised
    WORKER_EXITED = "worker_exited"  # the worker returned without finishing it
    INVALID_REQUEST = "invalid_request"  # the request or its plan is malformed
    SHUTDOWN = "shutdown"  # the scheduler or process is shutting down


class Transition(NamedTuple):
    event: Event
    source: TransferState
    dest: TransferState
    guard: str | None = None  # name of a predicate in GUARDS, or None


_S = TransferState

INITIAL = _S.PENDING
TERMINAL: frozenset[TransferState] = frozenset({_S.DONE, _S.FAILED})

TRANSITIONS: tuple[Transition, ...] = (
    Transition(Event.START, _S.PENDING, _S.TRANSFERRING),
    Transition(Event.COMPLETE, _S.TRANSFERRING, _S.DONE),
    Transition(Event.RETRY, _S.TRANSFERRING, _S.PENDING, guard="attempts_left"),
    Transition(Event.FAIL, _S.PENDING, _S.FAILED),
    Transition(Event.FAIL, _S.TRANSFERRING, _S.FAILED),
)

# Guard predicates over (attempt, max_attempts). Their names appear in the
# table, in the reference machine's conditions and in the diagram.
GUARDS: Mapping[str, str] = {
    "attempts_left": "attempt < max_attempts",
}


def _build_reference_machine() -> Machine:
    # One machine for the whole process, with no model: per-request machines
    # cost ~100 us and ~9 KB each, and add_model() is O(n) with strong refs.
    return Machine(
        model=None,
        states=[s.name for s in TransferState],
        initial=INITIAL.name,
        transitions=[
            {
                "trigger": t.event.value,
                "source": t.source.name,
                "dest": t.dest.name,
                **({"conditions": t.guard} if t.guard else {}),
            }
            for t in TRANSITIONS
        ],
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


REFERENCE_MACHINE: Machine = _build_reference_machine()


def _compile(
    machine: Machine,
) -> dict[tuple[TransferState, Event], tuple[TransferState, str | None]]:
    """Read the (state, event) -> (dest, guard) map back out of the machine."""
    table: dict[tuple[TransferState, Event], tuple[TransferState, str | None]] = {}
    for name, ev in machine.events.items():
        event = Event(name)
        for source, edges in ev.transitions.items():
            for edge in edges:
                guards: list[str] = [str(c.func) for c in edge.conditions]
                if len(guards) > 1 or (guards and guards[0] not in GUARDS):
                    raise AssertionError(f"unsupported guard(s) {guards!r} on {name}")
                key = (TransferState[source], event)
                if key in table:
                    raise AssertionError(f"ambiguous transition {key!r}")
                table[key] = (TransferState[str(edge.dest)], guards[0] if guards else None)
    return table


# (state, event) -> (dest, guard name or None). Anything missing is invalid.
DISPATCH: Mapping[tuple[TransferState, Event], tuple[TransferState, str | None]] = _compile(
    REFERENCE_MACHINE
)


def _validate() -> None:
    for (source, event), _ in DISPATCH.items():
        if source in TERMINAL:
            raise AssertionError(f"terminal state {source.name} has an outgoing {event.value!r}")
    # Every non-terminal state must be able to reach a terminal one.
    reaches = set(TERMINAL)
    changed = True
    while changed:
        changed = False
        for (source, _), (dest, _) in DISPATCH.items():
            if dest in reaches and source not in reaches:
                reaches.add(source)
                changed = True
    stranded = set(TransferState) - reaches
    if stranded:
        raise AssertionError(
            f"states that cannot reach a terminal state: {sorted(s.name for s in stranded)}"
        )
    if len(DISPATCH) != len(TRANSITIONS):
        raise AssertionError("reference machine and TRANSITIONS disagree")


_validate()
