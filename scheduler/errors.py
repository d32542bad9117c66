"""Errors the scheduler raises at its API. A rejected call leaves no state."""

from __future__ import annotations

from typing import ClassVar

from lifecycle import FailureReason

__all__ = [
    "DriverFailed",
    "DuplicateRequest",
    "InvalidRequest",
    "SchedulerClosed",
    "SchedulerError",
    "UnknownPeer",
    "UnknownRequest",
]


class SchedulerError(Exception):
    reason: ClassVar[FailureReason] = FailureReason.INVALID_REQUEST


class InvalidRequest(SchedulerError, ValueError):
    """An argument of submit() is malformed; the message names it."""


class DuplicateRequest(SchedulerError, ValueError):
    """The request id is still in use (live, or terminal but not yet released)."""


class UnknownRequest(SchedulerError, KeyError):
    """No request with this id is known to the scheduler."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownPeer(SchedulerError, KeyError):
    """No peer with this session id was added with add_peer()."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SchedulerClosed(SchedulerError, RuntimeError):
    """submit() after close()."""

    reason = FailureReason.SHUTDOWN


class DriverFailed(SchedulerError, RuntimeError):
    """The thread stepping the scheduler died; the cause is chained and logged.

    Raised by submit() and by a wait() that can no longer be answered, so a
    dead driver is never silent. Live requests are not advanced any more.
    """

    reason = FailureReason.SHUTDOWN
