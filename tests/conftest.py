"""Shared test configuration: hypothesis profiles and structlog capture."""

from __future__ import annotations

import os

import structlog
from hypothesis import HealthCheck, settings

# CI: reproducible (derandomized), no per-example deadline (a loaded 2-core
# machine makes timings meaningless), no example database on a fresh clone.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The library never configures structlog; the test suite is an application
# and keeps transition records out of the output unless a test captures them.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
