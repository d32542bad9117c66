"""Which skips a full run may have: with ``--strict-skips`` any other fails the session.

``scripts/test.sh`` (the README's test command, and so CI) passes it, so a
test that skips itself because something the set-up provides is missing --
the engine, etcd, Graphviz, aiohttp, vLLM in .venv-vllm -- fails the run
instead of passing it quietly. An xfail is a skip too (pytest reports it as
one): its reason must be on the list, or the run fails, so a known bug cannot
hide behind a marker. Skips are read from pytest's own reports (test and
collection reports), never from its text output; ``-ra`` (pyproject) still
lists every skip with its reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Final

import pytest

__all__ = ["ALLOWED", "pytest_addoption", "pytest_configure"]


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _not_root() -> bool:
    return os.geteuid() != 0


# Skip reason -> whether this host really lacks what the test needs: a CUDA
# device, or root for network namespaces. Nothing else may be skipped.
ALLOWED: Final[Mapping[str, Callable[[], bool]]] = {
    "needs CUDA": _no_cuda,
    "network namespace tests need root (ip netns add)": _not_root,
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--strict-skips",
        action="store_true",
        default=False,
        help="fail the session on a skip whose reason is not allowed here (tests/skip_policy.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--strict-skips"):
        config.pluginmanager.register(_StrictSkips(), "kvguard-strict-skips")


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):  # an xfail: its marker's (or pytest.xfail()'s) reason
        return str(report.wasxfail)
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class _StrictSkips:
    """Records skips (xfails included) not on the allow-list and fails a session that had one."""

    unexpected: list[tuple[str, str]]  # (node id, reason), in report order

    def __init__(self) -> None:
        self.unexpected = []

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped:  # an xfail is skipped too; an xpass is not (strict: it failed)
            return
        reason = _reason(report)
        allowed = ALLOWED.get(reason)
        if allowed is None or not allowed():
            xfail = hasattr(report, "wasxfail")
            self.unexpected.append((report.nodeid, f"xfail: {reason}" if xfail else reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # A run whose only module skipped ends "no tests collected": failed too, for that skip.
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.unexpected and session.exitstatus in passing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("skips not allowed here (--strict-skips)", red=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(
            f"{len(self.unexpected)} skipped test(s) must run: provide what they need "
            "(scripts/bootstrap.sh, scripts/vllm-env.sh) or allow the reason in "
            "tests/skip_policy.py"
        )
