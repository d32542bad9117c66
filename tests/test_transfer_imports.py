"""``transfer``'s modules import one another one way, and its bottom layer needs no torch.

Read statically (every import, ``TYPE_CHECKING`` and function-level ones
included), so a circle that only type checkers follow is caught too. Issue 21:
``backend.py`` and ``layout.py`` imported each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transfer"
# What the scheduler and the peer protocol's callers may load without torch.
TORCH_FREE = ("backend", "errors", "layout", "metadata", "regions")


def _graph() -> dict[str, set[str]]:
    """Module -> the sibling modules it imports (the package __init__ left out)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.level == 1:
                    deps.add(node.module.split(".")[0])
                elif node.level == 0 and node.module.startswith("transfer."):
                    deps.add(node.module.split(".")[1])
    return graph


def test_transfer_modules_import_each_other_without_a_circle() -> None:
    graph = _graph()
    assert {"backend", "cache", "layout", "regions"} <= graph.keys()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            assert dep not in path, f"import circle: {' -> '.join([*path, dep])}"
            if dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    assert "backend" not in graph["layout"] and "backend" not in graph["regions"]


def test_bottom_layer_imports_no_torch() -> None:
    names = ", ".join(f"transfer.{m}" for m in TORCH_FREE)
    code = f"import sys, {names}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False", out.stderr
