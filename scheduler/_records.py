"""Value types the scheduler hands out: policies, outcomes, metrics.

Nothing here holds a lock or a thread; every type is immutable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from lifecycle import FailureReason, TransferState

__all__ = [
    "DEFAULT_PEER_LOST_AFTER_PROBES",
    "Finished",
    "MetricsSnapshot",
    "ReleaseCallback",
    "RetryPolicy",
    "detach_traceback",
]

ReleaseCallback = Callable[[str, "Finished"], object]

# How many consecutive failed probes mark a peer lost (and fail its live
# requests with PEER_LOST). One is too few: a probe racing a decode restart,
# a reconnect after an idle TCP drop, or a single lost packet fails one probe
# of a healthy peer, and losing a peer fails every request to it. Two probes
# in a row, ``probe_interval_s`` apart (0.5 s by default), cost about one
# second to detect a dead peer -- a thirtieth of the default deadline and of
# the engine's own 30 s transfer timeout -- while a transfer error that says
# the peer is gone (first-hand evidence) still marks it lost at once.
DEFAULT_PEER_LOST_AFTER_PROBES = 2


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries of retryable errors, with exponential backoff.

    A retry never outlives the request's deadline: the deadline fires during
    the backoff, and abort() ends it at once.
    """

    max_attempts: int = 3
    backoff_s: float = 0.01
    backoff_factor: float = 2.0
    backoff_max_s: float = 0.5

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * self.backoff_factor ** (attempt - 1)))


class Finished(NamedTuple):
    """One request's outcome, as poll() reports it.

    A NamedTuple, not a frozen dataclass: one is made per request, on the
    core's step, and a frozen dataclass costs three times as much to build.

    ``error`` carries no traceback: the scheduler logs a crash's traceback
    once, when it happens, then drops it, so that no outcome kept for a
    caller pins the frames (and through them plans and tensors) it saw.
    """

    request_id: str
    state: TransferState
    reason: FailureReason | None
    error: BaseException | None
    attempt: int
    peer: str
    nbytes: int
    latency_s: float  # submit -> the step that saw it terminal


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    done: int
    failed_by_reason: dict[str, int]
    live_by_state: dict[str, int]
    quarantined: int  # terminal, but a backend op may still touch the blocks
    oldest_live_age_s: float
    released: int
    released_before_quiesce: int  # must stay 0: blocks are released only after quiesce
    double_releases: int  # must stay 0: a request is released exactly once
    peers_lost: int
    bytes_done: int
    quarantined_bytes: int = 0  # bytes of the quarantined requests' plans
    releasing: int = 0  # quiesced; the release callback is queued or running
    unpolled: int = 0  # outcomes waiting for poll()
    unpolled_dropped: int = 0  # outcomes dropped from a full poll() queue (oldest first)
    callbacks_pending: int = 0  # release/observer/done callbacks not yet run
    callbacks_stalled: int = 0  # callbacks that ran past the stall limit
    driver_alive: bool = True  # False: the thread stepping the core died (see logs)

    @property
    def failed(self) -> int:
        return sum(self.failed_by_reason.values())


def detach_traceback(exc: BaseException | None) -> None:
    """Drop the frames an error pins (they hold plans, ops, tensors); keep the error."""
    if exc is None:
        return
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
