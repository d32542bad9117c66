from __future__ import annotations

import subprocess
import sys

from lifecycle import TERMINAL, TransferState


def test_diagram_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvguard.cli", "diagram", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_terminal_states() -> None:
    assert frozenset({TransferState.DONE, TransferState.FAILED}) == TERMINAL


def test_readme_commands_match_ci() -> None:
    """README opens with the two set-up commands; CI runs exactly the second."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[0] == "bash scripts/bootstrap.sh && .venv/bin/kvguard run"
    assert block[1] == "bash scripts/bootstrap.sh && bash scripts/test.sh"
    ci_lines = [ln for ln in (root / ".ci/run").read_text().splitlines() if ln.strip()]
    assert ci_lines[-1] == block[1]
