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

from lifecycle._lazy import lazy_exports

# The public names, once: module -> what it defines. Imported on first use
# (PEP 562): `kvguard --help`, `trace` and `diagram` import this package but
# move no KV, so they must not pay for torch and the engine that
# ``Scheduler`` pulls in.
_EXPORTS = {
    "._scheduler": ("Scheduler",),
    "._records": (
        "DEFAULT_PEER_LOST_AFTER_PROBES",
        "Finished",
        "MetricsSnapshot",
        "ReleaseCallback",
        "RetryPolicy",
    ),
    ".errors": (
        "DriverFailed",
        "DuplicateRequest",
        "InvalidRequest",
        "SchedulerClosed",
        "SchedulerError",
        "UnknownPeer",
        "UnknownRequest",
    ),
    ".journal": ("JournalError", "JsonlJournal", "Replay", "RequestTrace", "read_journal"),
    ".metrics": ("MetricsServer", "SchedulerCollector", "register_metrics", "serve_metrics"),
    ".stuck": (
        "QuarantinedRequest",
        "StuckInspector",
        "StuckRequest",
        "quarantined_requests",
        "stuck_requests",
    ),
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_lazy.py: they agree)
    from ._records import DEFAULT_PEER_LOST_AFTER_PROBES as DEFAULT_PEER_LOST_AFTER_PROBES
    from ._records import Finished as Finished
    from ._records import MetricsSnapshot as MetricsSnapshot
    from ._records import ReleaseCallback as ReleaseCallback
    from ._records import RetryPolicy as RetryPolicy
    from ._scheduler import Scheduler as Scheduler
    from .errors import DriverFailed as DriverFailed
    from .errors import DuplicateRequest as DuplicateRequest
    from .errors import InvalidRequest as InvalidRequest
    from .errors import SchedulerClosed as SchedulerClosed
    from .errors import SchedulerError as SchedulerError
    from .errors import UnknownPeer as UnknownPeer
    from .errors import UnknownRequest as UnknownRequest
    from .journal import JournalError as JournalError
    from .journal import JsonlJournal as JsonlJournal
    from .journal import Replay as Replay
    from .journal import RequestTrace as RequestTrace
    from .journal import read_journal as read_journal
    from .metrics import MetricsServer as MetricsServer
    from .metrics import SchedulerCollector as SchedulerCollector
    from .metrics import register_metrics as register_metrics
    from .metrics import serve_metrics as serve_metrics
    from .stuck import QuarantinedRequest as QuarantinedRequest
    from .stuck import StuckInspector as StuckInspector
    from .stuck import StuckRequest as StuckRequest
    from .stuck import quarantined_requests as quarantined_requests
    from .stuck import stuck_requests as stuck_requests
