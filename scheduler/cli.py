"""The ``kvguard`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lifecycle import render_markdown

__all__ = ["main"]

# The repository checkout this package runs from (an editable install).
DIAGRAM_PATH = Path(__file__).resolve().parents[1] / "docs" / "state-diagram.md"


def _cmd_diagram(args: argparse.Namespace) -> int:
    text = render_markdown()
    path: Path = args.output
    if args.check:
        current = path.read_text() if path.exists() else None
        if current != text:
            print(
                f"{path} is stale: it differs from the transition table in "
                "lifecycle/_table.py. Run `kvguard diagram` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diagram", help="regenerate docs/state-diagram.md from the table")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument("--output", type=Path, default=DIAGRAM_PATH)
    p.set_defaults(func=_cmd_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
