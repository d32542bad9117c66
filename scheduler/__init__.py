"""kvguard scheduler: embed guaranteed-terminal KV transfers in a serving loop.

``Scheduler`` owns request lifecycles: submit, poll (vLLM ``get_finished()``
shape), blocking and asyncio waits, abort, deadlines, peer liveness, retries,
release after quiesce and metrics. Inside it, a sans-I/O core is stepped by a
thread, an asyncio task (``run_async``) or the host's loop (``step``).
``kvguard`` (kvguard.cli) is the CLI.
Observability (docs/observability.md): ``JsonlJournal`` writes the
transition journal and ``read_journal`` replays it; ``register_metrics``
exports Prometheus metrics; ``StuckInspector`` finds overdue live requests
and long-quarantined ones.
"""

from typing import TYPE_CHECKING

from lifecycle._lazy import lazy_getattr

# Imported on first use (PEP 562): `kvguard --help`, `trace` and `diagram`
# import this package but move no KV, so they must not pay for torch and the
# engine that ``Scheduler`` pulls in. Name -> the module that defines it.
_LAZY = {
    "Scheduler": "._scheduler",
    **dict.fromkeys(
        (
            "DEFAULT_PEER_LOST_AFTER_PROBES",
            "Finished",
            "MetricsSnapshot",
            "ReleaseCallback",
            "RetryPolicy",
        ),
        "._records",
    ),
    **dict.fromkeys(
        (
            "DriverFailed",
            "DuplicateRequest",
            "InvalidRequest",
            "SchedulerClosed",
            "SchedulerError",
            "UnknownPeer",
            "UnknownRequest",
        ),
        ".errors",
    ),
    **dict.fromkeys(
        ("JournalError", "JsonlJournal", "Replay", "RequestTrace", "read_journal"), ".journal"
    ),
    **dict.fromkeys(
        ("MetricsServer", "SchedulerCollector", "register_metrics", "serve_metrics"), ".metrics"
    ),
    **dict.fromkeys(
        (
            "QuarantinedRequest",
            "StuckInspector",
            "StuckRequest",
            "quarantined_requests",
            "stuck_requests",
        ),
        ".stuck",
    ),
}

if TYPE_CHECKING:
    from ._records import (
        DEFAULT_PEER_LOST_AFTER_PROBES,
        Finished,
        MetricsSnapshot,
        ReleaseCallback,
        RetryPolicy,
    )
    from ._scheduler import Scheduler
    from .errors import (
        DriverFailed,
        DuplicateRequest,
        InvalidRequest,
        SchedulerClosed,
        SchedulerError,
        UnknownPeer,
        UnknownRequest,
    )
    from .journal import JournalError, JsonlJournal, Replay, RequestTrace, read_journal
    from .metrics import MetricsServer, SchedulerCollector, register_metrics, serve_metrics
    from .stuck import (
        QuarantinedRequest,
        StuckInspector,
        StuckRequest,
        quarantined_requests,
        stuck_requests,
    )


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "DEFAULT_PEER_LOST_AFTER_PROBES",
    "DriverFailed",
    "DuplicateRequest",
    "Finished",
    "InvalidRequest",
    "JournalError",
    "JsonlJournal",
    "MetricsServer",
    "MetricsSnapshot",
    "QuarantinedRequest",
    "ReleaseCallback",
    "Replay",
    "RequestTrace",
    "RetryPolicy",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerCollector",
    "SchedulerError",
    "StuckInspector",
    "StuckRequest",
    "UnknownPeer",
    "UnknownRequest",
    "quarantined_requests",
    "read_journal",
    "register_metrics",
    "serve_metrics",
    "stuck_requests",
]
