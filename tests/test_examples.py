"""The examples run as shipped: a subprocess each, checked by exit code and output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mooncake_helpers import requires_mooncake

ROOT = Path(__file__).resolve().parent.parent
SERVING_LOOP = ROOT / "examples" / "serving_loop.py"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SERVING_LOOP), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_summary(out: str, backend: str) -> None:
    lines = out.strip().splitlines()
    assert lines[-1] == "OK", out
    head = re.search(rf"backend={backend} steps=(\d+) requests=(\d+)", out)
    assert head, out
    requests = int(head.group(2))
    counts = re.search(r"done: (\d+)\s+failed: (\d+)", out)
    assert counts, out
    done, failed = int(counts.group(1)), int(counts.group(2))
    assert requests > 0 and done > 0
    assert done + failed == requests, out  # every request reported terminal
    assert "integrity errors: 0" in out
    assert "released before quiesce: 0" in out
    assert "non-terminal: 0" in out
    assert re.search(r"abort\(req-2-\d+\): (ABORTED|already finished)", out), out
    # Every destination block came back through the release callback.
    free = re.search(r"blocks free: (\d+)/(\d+)", out)
    assert free and free.group(1) == free.group(2), out


def test_serving_loop_runs_on_the_local_backend() -> None:
    proc = run_example()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_summary(proc.stdout, "local")
    assert "Traceback" not in proc.stderr


def test_serving_loop_options_are_honoured() -> None:
    proc = run_example("--steps", "5", "--per-step", "2", "--blocks", "3", "--seed", "7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_summary(proc.stdout, "local")
    assert "steps=5 requests=10" in proc.stdout


def test_serving_loop_rejects_an_unknown_backend() -> None:
    proc = run_example("--backend", "carrier-pigeon")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


@pytest.mark.mooncake
@requires_mooncake
def test_serving_loop_runs_on_mooncake() -> None:
    proc = run_example("--backend", "mooncake")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    check_summary(proc.stdout, "mooncake")
