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
import shutil
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import psutil
import pytest

from tests.stall_reruns import monitor_pids
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
# kvguard's link events and each load's own line ("... after 0.130s") say
# whether a late load waited on its link or on the engine.
_NOTABLE = re.compile(
    r"\[(?:warning|error|critical) *\]|prefill_link_|hold_expired|kvguard: KV load| ERROR "
)
_PER_LOG = 24  # lines kept per server log and failed test
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
        _seen.extend(_stacks(item.name))
    return report


# Where each server process was when a test failed: a hang (a worker that
# never answers again) is told from a slow host only by its stacks.
_PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent))
_THREADS = re.compile(r"MainThread|kvguard|zmq|ZMQ")  # the threads summed up here


def _stacks(test: str) -> list[str]:
    """Dump every live server process's threads (``py-spy dump --native``)
    to ``LOGS/stacks-TEST.txt``; summarise the main and kvguard threads."""
    if _PY_SPY is None:
        return ["  no stacks: py-spy is not installed (scripts/vllm-env.sh installs it)"]
    safe = re.sub(r"[^\w.-]", "_", test)[:120]
    path = LOGS / f"stacks-{safe}.txt"
    summary = [f"  stacks of the servers' processes: {path}"]
    with path.open("w") as out:
        monitors = monitor_pids()
        for proc in psutil.Process().children(recursive=True):
            if proc.pid in monitors:
                continue
            try:
                name, state = " ".join(proc.cmdline())[:160], proc.status()
            except psutil.Error:  # ended meanwhile
                continue
            try:
                dump = subprocess.run(
                    [_PY_SPY, "dump", "--native", "--pid", str(proc.pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
            except subprocess.TimeoutExpired:
                dump = "py-spy timed out\n"
            out.write(f"=== pid {proc.pid} ({state}): {name}\n{dump}\n")
            threads = dump.split("\nThread ")[1:]
            top = [t.splitlines()[:2] for t in threads if _THREADS.search(t.splitlines()[0])]
            if top:
                summary.append(f"    pid {proc.pid} {name[:80]}")
                summary.extend(f"      {' / '.join(x.strip() for x in t)[:220]}" for t in top)
    return summary


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
