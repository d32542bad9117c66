"""The shell blocks of docs/vllm.md that tests run as they stand.

A block is marked by an HTML comment naming its test, just above the
```` ```sh ```` fence. ``local`` swaps the block's example ports for free
ones (every whole-word occurrence), so servers started from it do not clash
with other tests; nothing else in the text changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from tests.vllm.servers import ROOT

__all__ = ["DOCS", "Jobs", "checked_block", "jobs_of", "local"]

DOCS = ROOT / "docs" / "vllm.md"


def checked_block(mark: str) -> str:
    """The ``sh`` block just below ``mark`` in docs/vllm.md."""
    found = re.search(re.escape(mark) + r"\s*```sh\n(.*?)```", DOCS.read_text(), re.S)
    assert found, f"no block marked {mark!r} in {DOCS}"
    return found.group(1)


def local(text: str, ports: Mapping[str, int]) -> str:
    """``text`` with each example port (whole words) replaced by its free one."""
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", str(new), text)
    return text


@dataclass(frozen=True)
class Jobs:
    """A block of background commands: the settings before the first one,
    and each command (``&`` dropped) that runs with them."""

    preamble: str
    commands: list[str]

    def script(self, i: int) -> str:
        """Command ``i`` as a script of its own: the preamble, then it."""
        return f"{self.preamble}\n{self.commands[i]}\n"


def jobs_of(block: str) -> Jobs:
    """Split ``block`` into its preamble and its ``&`` commands (a command
    spans lines up to the one ending with ``&``; comments are dropped)."""
    preamble: list[str] = []
    commands: list[str] = []
    current: list[str] = []
    for line in block.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if not commands and not current and not _starts_job(line):
            preamble.append(line)
            continue
        current.append(line)
        if line.rstrip().endswith("&"):
            commands.append("\n".join(current).rstrip().removesuffix("&").rstrip())
            current = []
    assert not current, f"a command without its closing '&': {current}"
    return Jobs("\n".join(preamble), commands)


def _starts_job(line: str) -> bool:
    """A line that starts a command (not an assignment or its continuation)."""
    head = line.strip()
    return bool(head) and not re.match(r"^[A-Z_]+=", head) and not line.startswith((" ", "\t"))
