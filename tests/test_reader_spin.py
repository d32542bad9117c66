"""kvguard.vllm.reader_spin: the vLLM plugin that bounds its queue readers' busy-wait.

vLLM is not installed here: a stand-in ``SpinCondition`` with vLLM's
signature takes its place (tests/vllm/test_vllm_reader_spin.py runs vLLM's
own through vLLM's plugin loader).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import types
from importlib.metadata import entry_points
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvguard.vllm import reader_spin
from kvguard.vllm.reader_spin import ENV, PLUGIN, ReaderSpinError, bound, parse, register


class Spin:
    """vLLM 0.32's ``SpinCondition.__init__`` signature, recording what it got."""

    def __init__(
        self, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1
    ) -> None:
        self.got = (is_reader, context, notify_address)
        self.busy_loop_s = busy_loop_s


ORIGINAL = Spin.__init__


@pytest.fixture(autouse=True)
def _restore() -> Any:
    yield
    Spin.__init__ = ORIGINAL  # type: ignore[method-assign]
    reader_spin._ORIGINAL.pop(Spin, None)


@pytest.mark.parametrize(
    ("text", "spin"), [("0", 0.0), ("0.002", 0.002), ("1e-3", 0.001), ("60", 60.0), (" 2 ", 2.0)]
)
def test_parse_takes_seconds_from_zero_to_a_minute(text: str, spin: float) -> None:
    assert parse(text) == spin


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("abc", "is not a number of seconds"),
        ("", "is not a number of seconds"),
        ("2ms", "is not a number of seconds"),
        ("-0.001", "is outside 0 to 60 seconds"),
        ("60.001", "is outside 0 to 60 seconds"),
        ("nan", "is outside 0 to 60 seconds"),
        ("inf", "is outside 0 to 60 seconds"),
    ],
)
def test_parse_names_a_bad_value(text: str, why: str) -> None:
    with pytest.raises(ReaderSpinError) as err:
        parse(text)
    assert str(err.value) == f"KVGUARD_VLLM_READER_SPIN_S={text!r} {why}"
    assert isinstance(err.value, ValueError)
    with pytest.raises(ReaderSpinError, match=rf"^--spin={re.escape(repr(text))} {why}$"):
        parse(text, name="--spin")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((True, "ctx", "ipc://a"), {}),
        ((True, "ctx", "ipc://a", 5.0), {}),
        ((True,), {"context": "ctx", "notify_address": "ipc://a", "busy_loop_s": 5.0}),
        ((), {"is_reader": True, "context": "ctx", "notify_address": "ipc://a"}),
    ],
)
def test_bound_forces_the_spin_however_the_caller_passes_it(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    bound(Spin, 0.002)
    spin = Spin(*args, **kwargs)
    assert (spin.got, spin.busy_loop_s) == ((True, "ctx", "ipc://a"), 0.002)


def test_bound_again_replaces_the_first_value_instead_of_wrapping_it() -> None:
    calls: list[float] = []

    def counting(self: Spin, *args: Any, **kwargs: Any) -> None:
        ORIGINAL(self, *args, **kwargs)
        calls.append(self.busy_loop_s)

    Spin.__init__ = functools.wraps(ORIGINAL)(counting)  # type: ignore[method-assign]
    bound(Spin, 0.5)
    bound(Spin, 0.002)
    assert Spin(False, "ctx", "ipc://b").busy_loop_s == 0.002
    assert calls == [0.002]  # the class's own __init__ ran once, not through two wrappers


def test_bound_leaves_a_wrapper_it_did_not_make_in_place() -> None:
    seen: list[str] = []

    @functools.wraps(ORIGINAL)
    def traced(self: Spin, *args: Any, **kwargs: Any) -> None:
        seen.append("traced")
        ORIGINAL(self, *args, **kwargs)

    Spin.__init__ = traced  # type: ignore[method-assign]
    bound(Spin, 0.002)
    assert (Spin(True, "ctx", "ipc://a").busy_loop_s, seen) == (0.002, ["traced"])


def test_bound_refuses_a_vllm_whose_readers_take_no_spin() -> None:
    class Other:
        def __init__(self, is_reader: bool) -> None:
            self.is_reader = is_reader

    before = Other.__init__
    with pytest.raises(ReaderSpinError) as err:
        bound(Other, 0.002)
    assert str(err.value) == (
        f"KVGUARD_VLLM_READER_SPIN_S is set but {__name__}."
        "test_bound_refuses_a_vllm_whose_readers_take_no_spin.<locals>.Other takes no "
        "'busy_loop_s' (vLLM not importable): unset it"
    )
    assert Other.__init__ is before
    assert Other not in reader_spin._ORIGINAL


def test_the_refusal_names_the_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    class Old:
        def __init__(self, is_reader: bool) -> None:
            self.is_reader = is_reader

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.8.5"))
    with pytest.raises(ReaderSpinError) as err:
        bound(Old, 0.002)
    assert str(err.value).endswith("takes no 'busy_loop_s' (vLLM 0.8.5): unset it")


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("shm_broadcast")
    module.SpinCondition = Spin  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, reader_spin._MODULE, module)
    return module


@pytest.mark.usefixtures("all_levels")
def test_register_leaves_vllm_alone_and_unimported_without_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, reader_spin._MODULE, None)  # an import would raise
    monkeypatch.delenv(ENV, raising=False)
    with capture_logs() as logs:
        register()
    assert (Spin.__init__, logs) == (ORIGINAL, [])
    assert Spin(True, "ctx", "ipc://a").busy_loop_s == 1


@pytest.mark.usefixtures("all_levels")
def test_register_bounds_every_reader_and_says_so(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "0.002")
    with capture_logs() as logs:
        register()
    assert Spin(True, "ctx", "ipc://a").busy_loop_s == 0.002
    assert [(e["event"], e["busy_loop_s"], e["pid"], e["log_level"]) for e in logs] == [
        ("reader_spin_bounded", 0.002, os.getpid(), "info")
    ]


@pytest.mark.parametrize("module", [None, types.ModuleType("shm_broadcast")])
def test_register_names_a_vllm_without_the_readers(
    module: types.ModuleType | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, reader_spin._MODULE, module)
    monkeypatch.setenv(ENV, "0.002")
    with pytest.raises(ReaderSpinError) as err:
        register()
    assert str(err.value) == (
        "KVGUARD_VLLM_READER_SPIN_S is set but vllm.distributed.device_communicators."
        "shm_broadcast.SpinCondition does not exist (vLLM not importable): unset it"
    )


def test_register_raises_on_a_bad_setting_and_leaves_vllm_alone(
    fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "-1")
    with pytest.raises(ReaderSpinError, match=r"^KVGUARD_VLLM_READER_SPIN_S='-1' is outside"):
        register()
    assert Spin.__init__ is ORIGINAL


def test_vllm_finds_the_plugin_among_its_general_plugins() -> None:
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name.startswith("kvguard")]
    assert [(e.name, e.value) for e in found] == [(PLUGIN, "kvguard.vllm.reader_spin:register")]
    assert PLUGIN == "kvguard_reader_spin"
    assert found[0].load() is register
