from __future__ import annotations

import subprocess
import sys

from lifecycle import TERMINAL, TransferState


def test_diagram_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "diagram", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_terminal_states() -> None:
    assert frozenset({TransferState.DONE, TransferState.FAILED}) == TERMINAL
