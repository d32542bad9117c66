"""The vLLM PD benchmark's own arithmetic and its CPU shim (no vLLM needed)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.machine import describe_machine
from benchmarks.vllm_pd_figures import percentile, union_seconds
from tests.vllm.checkpoint import BENCH, TINY, kv_bytes_per_token
from tests.vllm.sessions import session_alive, session_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_union_counts_overlaps_once_and_gaps_not_at_all() -> None:
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0)]) == 1.0
    assert union_seconds([(0.0, 2.0), (1.0, 3.0)]) == 3.0  # overlap
    assert union_seconds([(0.0, 4.0), (1.0, 2.0)]) == 4.0  # contained
    assert union_seconds([(5.0, 6.0), (0.0, 1.0)]) == 2.0  # gap, unsorted


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0  # few samples: p99 is the max
    assert percentile([7.0], 50) == 7.0
    assert math.isnan(percentile([], 50))


def test_the_benchmark_checkpoint_moves_32_kib_of_kv_per_token() -> None:
    assert kv_bytes_per_token(BENCH) == 4 * 8 * 128 * 2 * 4 == 32768
    assert BENCH["num_hidden_layers"] * BENCH["num_key_value_heads"] == 32
    assert kv_bytes_per_token(TINY) == 2 * 2 * 32 * 2 * 4  # the tests': 1 KiB


# Burns 0.3 s of its own CPU, says so, then sleeps until killed.
_BURNER = """
import time
while time.process_time() < 0.3:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


@pytest.mark.filterwarnings("error")  # the /proc scan leaves nothing open, even stopped early
def test_a_session_counts_its_cpu_and_is_dead_once_only_a_zombie_is_left() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _BURNER], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"burnt\n"
        assert session_alive(proc.pid)
        # /proc counts user and system time in whole clock ticks, each rounded down.
        assert session_cpu_seconds(proc.pid) >= 0.3 - 2 / os.sysconf("SC_CLK_TCK")
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        assert not session_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert not session_alive(proc.pid)
    assert session_cpu_seconds(proc.pid) == 0.0


def test_the_machine_names_each_distributions_version_or_absent() -> None:
    machine = describe_machine({"the_test": "pytest", "missing": "kvguard-no-such-dist"})
    assert (machine["the_test"], machine["missing"]) == (pytest.__version__, "absent")
    assert (machine["cpus"], machine["python"]) == (os.cpu_count(), sys.version.split()[0])
    assert list(machine) == [
        "platform",
        "machine",
        "cpus",
        "python",
        "the_test",
        "missing",
        "loadavg_1m",
    ]


_PROBE = """
import torch
try:
    print(torch.accelerator.current_device_index())
except RuntimeError as exc:
    print("raised", exc)
"""


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the shim is for hosts without one")
@pytest.mark.parametrize("shim", [False, True])
def test_the_device_shim_applies_only_in_benchmark_servers(shim: bool, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD_BENCH_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "_site"), str(ROOT)])
    if shim:
        env["KVGUARD_BENCH_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    if shim:
        assert out == "0"
    else:
        assert out == "raised Cannot access accelerator device when none is available."
