"""Reruns of a test whose failure overlapped a host stall, in both runs.

Hooks and a fixture that ``tests/conftest.py`` imports, so they serve the
suite in ``.venv`` and the vLLM tests in ``.venv-vllm`` alike: one monitor
per CPU for the whole session (``tests/stalls.py``); a failure of a test's
setup or call during which a CPU ran nothing becomes ``HostStall``, raised
from the original error (the report shows both), and pytest-rerunfailures
runs only such a test again. A failure with no stall under it fails the run
at once, as before; every stall is listed at the end, and every test that a
stall was blamed for.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator

import pytest

from tests.stalls import HostStall, Stall, StallWatch

__all__ = [
    "RERUNS",
    "monitor_pids",
    "pytest_collection_modifyitems",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
    "stall_watch",
]

# A test whose failure overlapped a host stall runs again, up to this many
# times; no other failure does. The VM stalls in clusters (three of 26-59 s
# in five minutes of the TP module, dmesg's "workqueue lockup"), so twice.
RERUNS = 2

_watch: list[StallWatch] = []  # the session's, while it runs
_stalls: list[Stall] = []  # what it saw, once the session ended
_blamed: list[str] = []  # "test (phase): the stalls under its failure"


def monitor_pids() -> set[int]:
    """The monitors' processes: not the servers a failed test's stacks show."""
    return _watch[0].pids if _watch else set()


@pytest.fixture(scope="session", autouse=True)
def stall_watch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StallWatch]:
    """One monitor per CPU, its log in the session's own temporary folder."""
    watch = StallWatch(tmp_path_factory.getbasetemp() / "stalls.log")
    _watch.append(watch)
    try:
        yield watch
    finally:
        _watch.remove(watch)
        watch.close()
        _stalls.extend(watch.stalls())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=RERUNS, only_rerun=[HostStall.__name__]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    if call.when != "teardown":  # a teardown that fails is never rerun
        _blame(item, call)
    return (yield)


def _blame(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.excinfo is None or not _watch or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    stalls = _watch[0].during(call.start, call.stop)
    if not stalls:
        return
    what = "; ".join(f"{s}, {s.start - call.start:.1f} s into the {call.when}" for s in stalls)
    _blamed.append(f"{item.nodeid} ({call.when}): {what}")
    try:
        raise HostStall(f"the host stalled during this test: {what}") from call.excinfo.value
    except HostStall:
        call.excinfo = pytest.ExceptionInfo.from_current()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _stalls:
        terminalreporter.section("host stalls (a CPU that ran nothing; tests/stalls.py)")
        for stall in _stalls:
            at = time.strftime("%H:%M:%S", time.localtime(stall.start))
            terminalreporter.write_line(f"{at}: {stall}")
    if _blamed:
        terminalreporter.section(f"failures under a host stall (each rerun up to {RERUNS} times)")
        for line in _blamed:
            terminalreporter.write_line(line)
