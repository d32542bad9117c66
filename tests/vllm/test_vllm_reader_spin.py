"""kvguard's vLLM plugin against vLLM's own plugin loader and queue readers.

Each case is a fresh interpreter: vLLM loads general plugins once per process
(the API server, the engine core and each worker call the loader), and a
reader is made as those processes make theirs, through vLLM's ``SpinCondition``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_pd import plugin_missing
from kvguard.vllm.reader_spin import ENV, PLUGIN

pytestmark = [pytest.mark.vllm]

_PROCESS = """
import sys, zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
load_general_plugins()
path = "ipc://" + sys.argv[1] + "/notify"
ctx = zmq.Context()
writer = SpinCondition(False, ctx, path)
readers = [SpinCondition(True, ctx, path), SpinCondition(True, ctx, path, busy_loop_s=5)]
print("spin", writer.busy_loop_s, *(r.busy_loop_s for r in readers))
"""


def _process(
    spin: str | None, tmp: Path, plugins: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "VLLM_PLUGINS")}
    if spin is not None:
        env[ENV] = spin
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-c", _PROCESS, str(tmp)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


_SAID = re.compile(r"reader_spin_bounded\s+busy_loop_s=0\.002 pid=\d+")


@pytest.mark.parametrize(
    ("spin", "plugins", "line", "said"),
    [
        (None, None, "spin 0 1 5", 0),
        ("0.002", None, "spin 0 0.002 0.002", 1),
        ("0.002", f"lora_filesystem_resolver,{PLUGIN}", "spin 0 0.002 0.002", 1),
        # vLLM's allow-list without it: not loaded, which the bench checks first
        ("0.002", "lora_filesystem_resolver", "spin 0 1 5", 0),
    ],
)
def test_vllms_loader_bounds_every_reader_only_when_asked(
    spin: str | None, plugins: str | None, line: str, said: int, tmp_path: Path
) -> None:
    proc = _process(spin, tmp_path, plugins)
    assert (proc.returncode, proc.stdout.strip().splitlines()[-1:]) == (0, [line]), proc.stderr
    assert len(_SAID.findall(proc.stdout + proc.stderr)) == said
    loads = plugins is None or PLUGIN in plugins.split(",")
    assert (plugin_missing(plugins) == "") is loads


def test_a_bad_value_stops_the_process_naming_it(tmp_path: Path) -> None:
    proc = _process("0.5s", tmp_path)
    assert proc.returncode == 1
    assert (
        "kvguard.vllm.reader_spin.ReaderSpinError: "
        "KVGUARD_VLLM_READER_SPIN_S='0.5s' is not a number of seconds"
    ) in proc.stderr
    assert "spin" not in proc.stdout
