from __future__ import annotations

import types

import pytest

from lifecycle._lazy import lazy_getattr


def test_resolves_on_first_use_and_caches_in_the_namespace() -> None:
    ns: dict[str, object] = {}
    getattr_ = lazy_getattr("lifecycle", {"TransferState": "._table"}, ns)
    from lifecycle._table import TransferState

    assert getattr_("TransferState") is TransferState
    assert ns == {"TransferState": TransferState}


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    getattr_ = lazy_getattr("pkgname", {}, {})
    with pytest.raises(AttributeError, match=r"^module 'pkgname' has no attribute 'nope'$"):
        getattr_("nope")


def test_the_packages_export_exactly_their_tables() -> None:
    import scheduler
    import transfer

    for pkg in (scheduler, transfer):
        assert isinstance(pkg, types.ModuleType)
        assert sorted(pkg.__all__) == sorted(pkg._LAZY)
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None


def test_the_name_is_taken_from_the_named_module_not_the_package() -> None:
    # A name the package itself does not have: only lifecycle._lifecycle does.
    ns: dict[str, object] = {}
    getattr_ = lazy_getattr("lifecycle", {"_PLAIN": "._lifecycle"}, ns)
    from lifecycle._lifecycle import _PLAIN

    assert getattr_("_PLAIN") is _PLAIN
    assert ns == {"_PLAIN": _PLAIN}
