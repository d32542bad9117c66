"""The rerun policy (tests/stall_reruns.py), in a pytest run of its own: a
failure under a host stall runs again, any other failure fails at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests.stall_reruns import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_terminal_summary,
    stall_watch,
)
"""

# Each test fails on its first try only; "stalled" stops a monitor (a CPU
# that runs nothing, as far as the watch can tell) across that failure.
TESTS = """
import os, signal, time
from pathlib import Path

from tests.stall_reruns import monitor_pids

def _first_try(name):
    mark = Path(os.environ["TRIES"]) / name
    first = not mark.exists()
    mark.touch()
    return first

def test_stalled():
    if _first_try("stalled"):
        time.sleep(0.5)  # the monitors have started their loops
        pid = min(monitor_pids())
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.6)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.3)  # its late wake is written down
        raise AssertionError("a bound missed during the stall")

def test_unstalled():
    if _first_try("unstalled"):
        raise AssertionError("a bound missed, no stall")
"""


def test_only_a_failure_under_a_host_stall_runs_again(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_policy.py").write_text(TESTS)
    tries = tmp_path / "tries"
    tries.mkdir()
    env = {**os.environ, "TRIES": str(tries), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed, 1 rerun" in out, out
    assert "FAILED test_policy.py::test_unstalled - AssertionError: a bound missed, no stall" in out
    # The stalled one's failure is reported as the stall, raised from its own error.
    assert "failures under a host stall" in out, out
    assert "test_policy.py::test_stalled (call): cpu " in out, out
    assert sorted(p.name for p in tries.iterdir()) == ["stalled", "unstalled"]
