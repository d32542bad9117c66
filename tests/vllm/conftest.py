"""The vLLM tests' one import gate, and the server-mode tests' shared cluster.

They run in ``.venv-vllm`` (``scripts/vllm-env.sh``); ``scripts/test.sh``
runs them there with ``KVGUARD_REQUIRE_VLLM=1``, where a vLLM that does not
import fails the run. In an environment without vLLM (``.venv``) this
folder's test modules are not collected -- each imports the connector,
which imports vLLM -- and the run's header says so.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.vllm.cluster import SETTLE_S, Cluster, start_cluster
from tests.vllm.report import TABLE_HEADER
from tests.vllm.servers import LOGS

REQUIRED = os.environ.get("KVGUARD_REQUIRE_VLLM") == "1"
if REQUIRED:
    import vllm  # noqa: F401  -- a missing or broken vLLM is an error, not a skip

# This folder is on sys.path too, as a namespace package "vllm" that only
# the real one (a regular package) outranks: a spec without an origin is it.
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = REQUIRED or (_spec is not None and _spec.origin is not None)
collect_ignore_glob = [] if HAVE_VLLM else ["test_*.py"]


def pytest_report_header() -> str | None:
    return None if HAVE_VLLM else "tests/vllm: not collected, no vLLM here (scripts/vllm-env.sh)"


# What kvguard said while a test failed, printed last: a CI log keeps the
# head and tail of a run's output, where a failure's own text (with the
# servers' logs) may be cut out of the middle.
_NOTABLE = re.compile(r"\[(?:warning|error|critical) *\]|prefill_link_closed| ERROR ")
_PER_LOG = 12  # lines kept per server log and failed test
_OFFSETS = pytest.StashKey[dict[Path, int]]()
_seen: list[str] = []


def _log_sizes() -> dict[Path, int]:
    return {p: p.stat().st_size for p in LOGS.glob("*.log")} if LOGS.is_dir() else {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_OFFSETS] = _log_sizes()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when != "teardown":
        start = item.stash.get(_OFFSETS, {})
        _seen.append(f"{item.nodeid} ({call.when}):")
        for path, size in sorted(_log_sizes().items()):
            with path.open("rb") as f:
                at = start.get(path, 0)
                f.seek(at if at <= size else 0)  # a smaller log was started anew
                text = f.read().decode(errors="replace")
            lines = [ln for ln in text.splitlines() if _NOTABLE.search(ln)]
            if lines:
                _seen.append(f"  {path.name}: {len(lines)} lines, the last {_PER_LOG}:")
                _seen.extend(f"    {ln[:300]}" for ln in lines[-_PER_LOG:])
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _seen:
        terminalreporter.section("kvguard and server warnings during failed tests")
        for line in _seen:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The server-mode tests' prefill and two decodes (tests/vllm/cluster.py),
    started once for every module that asks; their table written at the end."""
    c = start_cluster()
    try:
        yield c
    finally:
        for s in c.servers:
            s.stop()
        text = "\n".join([TABLE_HEADER, *(r.line() for r in c.rows)])
        (LOGS / "vllm-server-table.md").write_text(text + "\n")
        print("\n" + text)


@pytest.fixture(autouse=True)
def idle_before(request: pytest.FixtureRequest) -> None:
    """A scenario starts on idle servers. One that an earlier scenario left
    busy, fenced or dead fails this test with its log (never restarted
    quietly: a server that does not get idle is a finding)."""
    if "cluster" not in request.fixturenames:
        return
    c: Cluster = request.getfixturevalue("cluster")
    for s in c.servers:
        try:
            s.wait_idle(SETTLE_S)
        except OSError as exc:
            pytest.fail(f"{s.name} is not serving before this test: {exc!r}\n{s.log_tail()}")
        except AssertionError as exc:
            pytest.fail(f"{s.name} not idle before this test: {exc}")
