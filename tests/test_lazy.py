from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from lifecycle._lazy import lazy_exports


def test_resolves_on_first_use_and_caches_in_the_namespace() -> None:
    ns: dict[str, object] = {}
    _, getattr_ = lazy_exports("lifecycle", {"._table": ("TransferState",)}, ns)
    from lifecycle._table import TransferState

    assert getattr_("TransferState") is TransferState
    assert ns == {"TransferState": TransferState}


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    _, getattr_ = lazy_exports("pkgname", {"._table": ("TransferState",)}, {})
    with pytest.raises(AttributeError, match=r"^module 'pkgname' has no attribute 'nope'$"):
        getattr_("nope")


PACKAGES = ("scheduler", "transfer", "kvguard.proxy")


def _type_checking_imports(path: str) -> list[tuple[str, str, str | None]]:
    """(module, name, alias) of each import under ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(path).read_text(), path)
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, f"{path}: expected one TYPE_CHECKING block"
    out = []
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        module = "." * node.level + (node.module or "")
        out += [(module, alias.name, alias.asname) for alias in node.names]
    return out


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_the_sorted_export_list_with_no_name_twice(name: str) -> None:
    pkg = importlib.import_module(name)
    listed = [n for names in pkg._EXPORTS.values() for n in names]
    assert len(listed) == len(set(listed)) > 0
    assert pkg.__all__ == sorted(listed)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves_to_its_modules_public_object(name: str) -> None:
    pkg = importlib.import_module(name)
    for module, names in pkg._EXPORTS.items():
        mod = importlib.import_module(module, name)
        for n in names:
            assert n in mod.__all__, f"{name}{module}.{n} is not public there"
            assert getattr(pkg, n) is getattr(mod, n)
            assert n in vars(pkg)  # resolved once, then a plain attribute


@pytest.mark.parametrize("name", PACKAGES)
def test_the_type_checking_mirror_lists_exactly_the_exports(name: str) -> None:
    pkg = importlib.import_module(name)
    assert pkg.__file__ is not None
    mirror = _type_checking_imports(pkg.__file__)
    # ``name as name``: the only form a type checker re-exports without a literal __all__.
    assert [(m, n) for m, n, alias in mirror if alias != n] == []
    exports = {(m, n) for m, names in pkg._EXPORTS.items() for n in names}
    assert sorted((m, n) for m, n, _ in mirror) == sorted(exports)


@pytest.mark.parametrize("name", PACKAGES)
def test_a_name_the_package_does_not_export_is_an_attribute_error(name: str) -> None:
    pkg = importlib.import_module(name)
    with pytest.raises(AttributeError, match=rf"^module '{name}' has no attribute 'nope'$"):
        _ = pkg.nope


def test_lazy_exports_derives_a_sorted_all_and_a_getattr_from_one_list() -> None:
    ns: dict[str, object] = {}
    all_, getattr_ = lazy_exports(
        "lifecycle", {"._table": ("TransferState", "Event"), "._lifecycle": ("_PLAIN",)}, ns
    )
    from lifecycle._lifecycle import _PLAIN
    from lifecycle._table import Event, TransferState

    assert all_ == ["Event", "TransferState", "_PLAIN"]
    assert (getattr_("Event"), getattr_("_PLAIN")) == (Event, _PLAIN)
    assert ns == {"Event": Event, "_PLAIN": _PLAIN}
    assert getattr_("TransferState") is TransferState


@pytest.mark.parametrize(
    ("exports", "message"),
    [
        ({".a": ("X",), ".b": ("Y", "X")}, "pkg exports 'X' twice: from '.a' and '.b'"),
        ({".a": ("X", "X")}, "pkg exports 'X' twice: from '.a' and '.a'"),
    ],
)
def test_a_name_listed_twice_is_refused_naming_it_and_both_places(
    exports: dict[str, tuple[str, ...]], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        lazy_exports("pkg", exports, {})


def test_the_name_is_taken_from_the_named_module_not_the_package() -> None:
    # A name the package itself does not have: only lifecycle._lifecycle does.
    ns: dict[str, object] = {}
    _, getattr_ = lazy_exports("lifecycle", {"._lifecycle": ("_PLAIN",)}, ns)
    from lifecycle._lifecycle import _PLAIN

    assert getattr_("_PLAIN") is _PLAIN
    assert ns == {"_PLAIN": _PLAIN}
