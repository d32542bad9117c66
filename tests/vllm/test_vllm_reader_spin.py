"""kvguard's vLLM plugin against vLLM's own plugin loader and queue readers.

Each case is a fresh interpreter: vLLM loads general plugins once per process
(the API server, the engine core and each worker call the loader), and a
reader is made as those processes make theirs, through vLLM's ``SpinCondition``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvguard.vllm.reader_spin import ENV

pytestmark = [pytest.mark.vllm]

_PROCESS = """
import tempfile, zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
load_general_plugins()
path = "ipc://" + tempfile.mkdtemp() + "/notify"
ctx = zmq.Context()
writer = SpinCondition(False, ctx, path)
readers = [SpinCondition(True, ctx, path), SpinCondition(True, ctx, path, busy_loop_s=5)]
print("spin", writer.busy_loop_s, *(r.busy_loop_s for r in readers))
"""


def _process(spin: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "VLLM_PLUGINS")}
    if spin is not None:
        env[ENV] = spin
    return subprocess.run(
        [sys.executable, "-c", _PROCESS], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("spin", "line"), [(None, "spin 0 1 5"), ("0.002", "spin 0 0.002 0.002")])
def test_vllms_loader_bounds_every_reader_only_when_asked(spin: str | None, line: str) -> None:
    proc = _process(spin)
    assert (proc.returncode, proc.stdout.strip().splitlines()[-1:]) == (0, [line]), proc.stderr
    said = "reader_spin_bounded            busy_loop_s=0.002" in proc.stdout + proc.stderr
    assert said is (spin is not None)


def test_a_bad_value_stops_the_process_naming_it() -> None:
    proc = _process("0.5s")
    assert proc.returncode == 1
    assert (
        "kvguard.vllm.reader_spin.ReaderSpinError: "
        "KVGUARD_VLLM_READER_SPIN_S='0.5s' is not a number of seconds"
    ) in proc.stderr
    assert "spin" not in proc.stdout
