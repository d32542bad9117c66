"""Compatibility module: the scheduler's public names, from where they live now.

The scheduler was one module; it is now a sans-I/O core (``_core``) with its
seams in their own modules (``_requests``, ``_peers``, ``_deadlines``,
``_release``, ``_drivers``) behind the ``Scheduler`` facade (``_facade``).
Import from ``scheduler``; this module keeps older imports working.
"""

from ._facade import Scheduler
from ._records import Finished, MetricsSnapshot, ReleaseCallback, RetryPolicy
from ._requests import RECENT

__all__ = ["RECENT", "Finished", "MetricsSnapshot", "ReleaseCallback", "RetryPolicy", "Scheduler"]
