"""Lazy package exports (PEP 562), shared by the packages above this one.

``kvguard --help``, ``trace`` and ``diagram`` import ``scheduler`` and
``transfer`` but move no KV: names are resolved, and torch and the engine
imported, only when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(
    package: str, table: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``name`` from ``table[name]`` (a relative module)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    return __getattr__
