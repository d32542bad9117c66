"""Shared test configuration: hypothesis profiles, structlog capture, the skip
policy, reruns over a host stall."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import HealthCheck, Phase, settings

# --strict-skips (scripts/test.sh): a skip not on tests/skip_policy.py's list fails the run.
from skip_policy import pytest_addoption, pytest_configure  # noqa: F401 -- pytest hooks

# A failure under a host stall (a CPU that ran nothing) runs again; no other.
from tests.stall_reruns import (  # noqa: F401 -- pytest hooks and a fixture
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_terminal_summary,
    stall_watch,
)

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
# Mutation testing (HYPOTHESIS_PROFILE=mutmut): a mutant only has to be
# detected, so no shrinking -- a shrinking pass over a broken core can run
# for minutes per mutant -- and reproducible, like CI.
settings.register_profile(
    "mutmut",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The library never configures structlog; the test suite is an application
# and keeps transition records out of the output unless a test captures them.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))


@pytest.fixture
def all_levels() -> Iterator[None]:
    """Let every level through for ``structlog.testing.capture_logs``."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        yield
    finally:
        structlog.configure(wrapper_class=old)
