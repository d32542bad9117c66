"""Lazy package exports (PEP 562), shared by the packages above this one.

``kvguard --help``, ``trace`` and ``diagram`` import ``scheduler`` and
``transfer`` but move no KV: names are resolved, and torch and the engine
imported, only when first used.

A package lists its public names once, as ``relative module -> names``, and
``lazy_exports`` derives both ``__all__`` and the lazy ``__getattr__`` from
that list. Type checkers cannot see through ``__getattr__``, so the package
mirrors the list in an ``if TYPE_CHECKING:`` block of ``name as name``
imports; tests/test_lazy.py checks that the mirror and the list agree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]], namespace: MutableMapping[str, Any]
) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` of ``package``, from ``exports``: each
    relative module and the public names it defines. ``__getattr__`` imports
    a name's module on first use and stores the name in ``namespace``.

    Raises ValueError naming a name listed twice, and where.
    """
    table: dict[str, str] = {}
    for module, names in exports.items():
        for name in names:
            if name in table:
                raise ValueError(
                    f"{package} exports {name!r} twice: from {table[name]!r} and {module!r}"
                )
            table[name] = module

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    return sorted(table), __getattr__
