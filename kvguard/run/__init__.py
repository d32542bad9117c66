"""``kvguard run``: the main job (``job``), its records, decode side,
progress bar, workload, verification and raw-engine baseline."""

from .job import run
from .records import RunConfig, RunSummary

__all__ = ["RunConfig", "RunSummary", "run"]
