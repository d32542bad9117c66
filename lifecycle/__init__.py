"""kvguard lifecycle: the pure, I/O-free core.

Each request is an explicit finite state machine whose only exits are the
terminal states DONE and FAILED; a CompletionGuard makes every worker exit
path end in one of them. This package imports nothing from ``transfer`` or
``scheduler``.
"""

from ._diagram import render_markdown, render_mermaid
from ._guard import EXIT_REASONS, CompletionGuard, exit_reason, guarded
from ._journal import LOGGER_NAME, Journal, TransitionRecord
from ._lifecycle import DoneCallback, InvalidTransition, Outcome, RequestLifecycle
from ._machine import Edge, StateTable, TableError
from ._table import (
    DISPATCH,
    GUARDS,
    INITIAL,
    REFERENCE_MACHINE,
    TERMINAL,
    TRANSITIONS,
    Event,
    FailureReason,
    Guard,
    TransferState,
    Transition,
)

__all__ = [
    "DISPATCH",
    "EXIT_REASONS",
    "GUARDS",
    "INITIAL",
    "LOGGER_NAME",
    "REFERENCE_MACHINE",
    "TERMINAL",
    "TRANSITIONS",
    "CompletionGuard",
    "DoneCallback",
    "Edge",
    "Event",
    "FailureReason",
    "Guard",
    "InvalidTransition",
    "Journal",
    "Outcome",
    "RequestLifecycle",
    "StateTable",
    "TableError",
    "TransferState",
    "Transition",
    "TransitionRecord",
    "exit_reason",
    "guarded",
    "render_markdown",
    "render_mermaid",
]
