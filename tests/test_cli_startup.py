"""Commands that move no KV start fast: they import neither torch nor the engine.

Measured before: `kvguard --help` took about 5 s, all of it torch's import.
The check is on what gets imported (`-X importtime`), not on a timing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "mooncake", "numpy")


def _imported(*args: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {
        line.split("|")[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("j") / "j.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard.cli",
            "run",
            "--backend",
            "local",
            "--requests",
            "3",
            "--layers",
            "1",
            "--blocks",
            "16",
            "--block-bytes",
            "256",
            "--blocks-per-request",
            "2",
            "--no-progress",
            "--journal",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    return path


@pytest.mark.parametrize(
    "args", [("--help",), ("diagram", "--check"), ("run", "--help"), ("proxy", "--help")]
)
def test_commands_that_move_no_kv_import_no_torch(args: tuple[str, ...]) -> None:
    heavy = _imported(*args) & set(HEAVY)
    assert not heavy, f"kvguard {' '.join(args)} imported {sorted(heavy)}"


def test_trace_imports_no_torch(journal: Path) -> None:
    heavy = _imported("trace", str(journal)) & set(HEAVY)
    assert not heavy, f"kvguard trace imported {sorted(heavy)}"


def test_the_check_has_teeth() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import transfer; transfer.KVCache"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "torch" in proc.stderr  # a name that needs torch does import it
