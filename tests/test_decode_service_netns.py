"""``kvguard run --decode`` against ``kvguard decode --listen`` on another host.

Two network namespaces joined by a veth pair (``tests/netns_helpers.py``)
stand in for two hosts: the decode service listens on the decode side's
address only, the run starts in the prefill namespace and reaches it over
the veth -- control channel and Mooncake alike. Needs root and ``ip netns``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mooncake_helpers import requires_mooncake
from netns_helpers import NetnsPair, netns_unavailable

UNAVAILABLE = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.mooncake,
    requires_mooncake,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--layers=2", "--blocks=64", "--block-bytes=4096"]


def test_run_drives_a_decode_service_on_another_host(tmp_path: Path) -> None:
    env = {**os.environ, "MC_FORCE_TCP": "1", "PYTHONPATH": str(REPO)}
    with NetnsPair() as pair:
        service = subprocess.Popen(
            [
                *pair.exec_argv(pair.decode),
                sys.executable,
                "-m",
                "scheduler.cli",
                "decode",
                f"--listen={pair.decode.addr}:0",
                *SHAPE,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            assert service.stdout is not None
            line = service.stdout.readline()
            found = re.search(r"listening on tcp://(\S+) for engine session (\S+):", line)
            assert found, f"kvguard decode did not start: {line!r}"
            address, session = found.groups()
            assert address.startswith(pair.decode.addr + ":")
            assert session.startswith(pair.decode.addr + ":")  # the engine is reachable too
            summary = tmp_path / "summary.json"
            run = subprocess.run(
                [
                    *pair.exec_argv(pair.prefill),
                    sys.executable,
                    "-m",
                    "scheduler.cli",
                    "run",
                    f"--decode={address}",
                    "--requests=40",
                    "--blocks-per-request=4",
                    "--no-progress",
                    f"--json={summary}",
                    *SHAPE,
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            assert run.returncode == 0, run.stdout + run.stderr[-2000:]
            result = json.loads(summary.read_text())
            assert result["done"] == 40 and result["integrity_errors"] == 0, result
            assert result["unverified"] == 0, result
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=15) == 0  # stopped listening, engine released
        finally:
            if service.poll() is None:
                service.kill()
            service.wait()
