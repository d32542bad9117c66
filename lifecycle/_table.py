"""The transition table: the single source of truth for a request's lifecycle.

Everything else is derived from ``TRANSITIONS`` and ``GUARDS``: the fast
dispatch dict the hot path uses (``DISPATCH``), the ``transitions`` machine
that draws the diagram (``REFERENCE_MACHINE``, a mermaid ``GraphMachine``)
and the tests that walk the graph.

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
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from transitions.extensions import GraphMachine

__all__ = [
    "DISPATCH",
    "GUARDS",
    "INITIAL",
    "REFERENCE_MACHINE",
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "FailureReason",
    "Guard",
    "TransferState",
    "Transition",
]


class TransferState(enum.Enum):
    # Members are singletons compared by identity: hash them in C too (Enum's
    # own __hash__ is a Python call, paid several times per transition).
    __hash__ = object.__hash__

    PENDING = "PENDING"
    TRANSFERRING = "TRANSFERRING"
    DONE = "DONE"
    FAILED = "FAILED"


class Event(str, enum.Enum):
    # Equal to its value, so hashed as its value (and in C, unlike Enum's).
    __hash__ = str.__hash__

    START = "start"
    COMPLETE = "complete"
    RETRY = "retry"
    FAIL = "fail"


class FailureReason(enum.Enum):
    """Why a request ended FAILED. The first cause wins: a request ends exactly once."""

    __hash__ = object.__hash__  # as TransferState

    TRANSFER_ERROR = "transfer_error"  # the engine reported a failure
    PEER_LOST = "peer_lost"  # the decode peer is dead or unreachable
    TIMEOUT = "timeout"  # the request's deadline passed
    ABORTED = "aborted"  # the caller aborted it, or its worker was cancelled
    WORKER_CRASHED = "worker_crashed"  # the worker raised
    WORKER_EXITED = "worker_exited"  # the worker returned without finishing it
    WORKER_DROPPED = "worker_dropped"  # the worker was garbage-collected before it ever ran
    INVALID_REQUEST = "invalid_request"  # the request or its plan is malformed
    SHUTDOWN = "shutdown"  # the scheduler or process is shutting down


class Transition(NamedTuple):
    event: Event
    source: TransferState
    dest: TransferState
    guard: str | None = None  # a key of GUARDS, or None


class Guard(NamedTuple):
    """A named condition on an edge: its rule lives here, next to its text."""

    allows: Callable[[int, int], bool]  # (attempt, max_attempts) -> may the edge be taken
    text: str  # the rule as the docs show it


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

# Guard name -> its rule. RequestLifecycle evaluates exactly the predicate
# named on the edge, so a new guard needs its own entry here (an unknown name
# fails at import) and can never inherit another guard's rule.
GUARDS: Mapping[str, Guard] = {
    "attempts_left": Guard(
        lambda attempt, max_attempts: attempt < max_attempts, "attempt < max_attempts"
    ),
}


def _compile(
    table: Iterable[Transition],
) -> dict[tuple[TransferState, Event], tuple[TransferState, str | None]]:
    """(state, event) -> (dest, guard name): the hot path's plain dict."""
    out: dict[tuple[TransferState, Event], tuple[TransferState, str | None]] = {}
    for t in table:
        key = (t.source, t.event)
        if key in out:
            raise AssertionError(f"ambiguous transition {key!r}")
        if t.guard is not None and t.guard not in GUARDS:
            raise AssertionError(f"unknown guard {t.guard!r} on {t.event.value!r}")
        out[key] = (t.dest, t.guard)
    return out


# (state, event) -> (dest, guard name or None). Anything missing is invalid.
DISPATCH: Mapping[tuple[TransferState, Event], tuple[TransferState, str | None]] = _compile(
    TRANSITIONS
)


def _build_reference_machine() -> GraphMachine:
    # One machine for the whole process, with no model: per-request machines
    # cost ~100 us and ~9 KB each, and add_model() is O(n) with strong refs.
    # It is never triggered; it draws the diagram (mermaid needs no Graphviz).
    return GraphMachine(
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
        graph_engine="mermaid",
        show_conditions=True,
        title="title: Request lifecycle",  # mermaid front matter
    )


REFERENCE_MACHINE: GraphMachine = _build_reference_machine()


def _validate() -> None:
    for source, event in DISPATCH:
        if source in TERMINAL:
            raise AssertionError(f"terminal state {source.name} has an outgoing {event.value!r}")
    # Every non-terminal state must be able to reach a terminal one: one
    # backward step per pass, and no path needs more passes than states.
    reaches = set(TERMINAL)
    for _ in TransferState:
        reaches |= {source for (source, _), (dest, _) in DISPATCH.items() if dest in reaches}
    stranded = set(TransferState) - reaches
    if stranded:
        raise AssertionError(
            f"states that cannot reach a terminal state: {sorted(s.name for s in stranded)}"
        )


_validate()
