"""Typed transfer errors: every engine failure becomes one of these.

Each class carries the ``lifecycle.FailureReason`` it maps to and whether a
retry can help. ``CompletionGuard`` reads ``reason`` off the exception, so a
TransferError escaping a worker fails the request with the right reason
without any mapping code in between: every backend failure ends FAILED
with a typed reason.
"""

from __future__ import annotations

from typing import ClassVar

from lifecycle import FailureReason

__all__ = [
    "BackendClosed",
    "Backpressure",
    "EngineError",
    "InvalidPlan",
    "PeerLost",
    "PeerProtocolError",
    "PeerUnreachable",
    "RegistrationError",
    "RemoteRangeRejected",
    "TransferCancelled",
    "TransferError",
    "TransferTimeout",
]


class TransferError(Exception):
    """Base class. ``code`` is the raw engine return code when there is one."""

    reason: ClassVar[FailureReason] = FailureReason.TRANSFER_ERROR
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, peer: str | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code


class EngineError(TransferError):
    """The engine returned a failure while the peer still answers probes."""

    retryable = True


class Backpressure(TransferError):
    """The engine refused work because too much was asked of it at once."""

    retryable = True


class PeerUnreachable(TransferError):
    """No connection to the peer could be made (unknown, down, refused)."""

    reason = FailureReason.PEER_LOST


class PeerLost(TransferError):
    """The peer went away while a transfer to it was in flight."""

    reason = FailureReason.PEER_LOST


class TransferCancelled(TransferError):
    """The caller cancelled the op; the backend stopped between batches."""

    reason = FailureReason.ABORTED


class TransferTimeout(TransferError):
    """The transfer did not finish before its deadline.

    The engine call may still be running and writing into the buffers: the
    operation is not quiesced until the call returns, and its blocks may not
    be reused before then.
    """

    reason = FailureReason.TIMEOUT


class RegistrationError(TransferError):
    """Registering or unregistering memory with the engine failed."""


class InvalidPlan(TransferError, ValueError):
    """A transfer plan failed validation; nothing was sent."""

    reason = FailureReason.INVALID_REQUEST


class RemoteRangeRejected(InvalidPlan):
    """A destination range lies outside the regions the peer advertised."""


class BackendClosed(TransferError):
    """The backend was closed before the op could run; nothing was sent."""

    reason = FailureReason.SHUTDOWN


class PeerProtocolError(TransferError, ValueError):
    """A message from (or about) a peer is malformed; nothing was sent."""

    reason = FailureReason.INVALID_REQUEST
