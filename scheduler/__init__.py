"""kvguard scheduler: embed guaranteed-terminal KV transfers in a serving loop.

``Scheduler`` owns request lifecycles: submit, poll (vLLM ``get_finished()``
shape), blocking and asyncio waits, abort, deadlines, peer liveness, retries,
release after quiesce and metrics. ``kvguard`` (scheduler.cli) is the CLI.
"""

from ._scheduler import Finished, MetricsSnapshot, ReleaseCallback, RetryPolicy, Scheduler
from .errors import (
    DuplicateRequest,
    InvalidRequest,
    SchedulerClosed,
    SchedulerError,
    UnknownPeer,
    UnknownRequest,
)

__all__ = [
    "DuplicateRequest",
    "Finished",
    "InvalidRequest",
    "MetricsSnapshot",
    "ReleaseCallback",
    "RetryPolicy",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerError",
    "UnknownPeer",
    "UnknownRequest",
]
