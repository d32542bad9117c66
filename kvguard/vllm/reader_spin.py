"""How long vLLM's shared-memory queue readers busy-wait: a vLLM general plugin.

A reader of vLLM's shared-memory queues (the worker reading its engine
core's next step, the engine core reading its worker's output) that finds
nothing to read spins, yielding, until ``SpinCondition.busy_loop_s`` after
its last read, and only then sleeps on a socket the writer pings; vLLM has
no setting for it (1 s). So an idle worker keeps a core busy for a second
after its last step. On a host or cgroup where a prefill and a decode share
cores, each spins on the cores the other computes on, and takes them from
the Mooncake engine's threads that move the KV (docs/performance.md, "Two
servers on two cores"). A server with cores of its own loses nothing to the
spin and should keep vLLM's.

kvguard registers ``register`` as a ``vllm.general_plugins`` entry point:
vLLM calls it in the API server, the engine core and each worker before
their queues are made (a forked process inherits the bound from its
parent instead, and does not log it again). With
``KVGUARD_VLLM_READER_SPIN_S`` unset it does nothing, not even import vLLM;
set (0 to 60 seconds), every ``SpinCondition`` made after it spins that
long. A value that is not a number in range, or a vLLM without
``SpinCondition(busy_loop_s=...)``, raises ``ReaderSpinError`` there and the
server does not start.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
from collections.abc import Callable
from typing import Any, Final

import structlog

__all__ = [
    "BOUNDED",
    "ENV",
    "MAX_SPIN_S",
    "PLUGIN",
    "ReaderSpinError",
    "bound",
    "parse",
    "register",
]

ENV: Final = "KVGUARD_VLLM_READER_SPIN_S"
PLUGIN: Final = "kvguard_reader_spin"  # the entry point's name, as VLLM_PLUGINS lists it
BOUNDED: Final = "reader_spin_bounded"  # the event each process logs once bound
MAX_SPIN_S: Final = 60.0  # beyond a minute a typo: vLLM's own is 1 s
_MODULE: Final = "vllm.distributed.device_communicators.shm_broadcast"
_CLASS: Final = "SpinCondition"
_PARAM: Final = "busy_loop_s"

# Each bound class's own __init__: bounding it again replaces the value
# instead of wrapping kvguard's wrapper.
_ORIGINAL: dict[Any, Callable[..., None]] = {}  # vLLM's classes are untyped

_log = structlog.get_logger("kvguard.vllm")


class ReaderSpinError(ValueError):
    """``KVGUARD_VLLM_READER_SPIN_S`` is unusable: its value, or this vLLM."""


def parse(text: str, name: str = ENV) -> float:
    """The spin in seconds that ``text`` asks for, or ``ReaderSpinError`` naming it as ``name``."""
    try:
        spin = float(text)
    except ValueError:
        raise ReaderSpinError(f"{name}={text!r} is not a number of seconds") from None
    if not (math.isfinite(spin) and 0.0 <= spin <= MAX_SPIN_S):
        raise ReaderSpinError(f"{name}={text!r} is outside 0 to {MAX_SPIN_S:g} seconds")
    return spin


def bound(cls: Any, spin: float) -> None:
    """Make every ``cls`` built from now on spin ``spin`` s, whatever its caller asks."""
    init: Callable[..., None] = _ORIGINAL.get(cls) or cls.__init__
    sig = inspect.signature(init)
    if _PARAM not in sig.parameters:
        raise ReaderSpinError(
            f"{ENV} is set but {cls.__module__}.{cls.__qualname__} takes no {_PARAM!r}"
            f" ({_vllm_version()}): unset it"
        )

    @functools.wraps(init)
    def bounded(self: Any, *args: Any, **kwargs: Any) -> None:
        call = sig.bind(self, *args, **kwargs)
        call.arguments[_PARAM] = spin
        init(*call.args, **call.kwargs)

    _ORIGINAL[cls] = init
    cls.__init__ = bounded


def register() -> None:
    """The plugin: bound the readers' spin where ``KVGUARD_VLLM_READER_SPIN_S`` asks."""
    text = os.environ.get(ENV)
    if text is None:
        return  # vLLM's own spin
    spin = parse(text)
    try:
        cls = getattr(importlib.import_module(_MODULE), _CLASS)
    except (ImportError, AttributeError):
        raise ReaderSpinError(
            f"{ENV} is set but {_MODULE}.{_CLASS} does not exist ({_vllm_version()}): unset it"
        ) from None
    bound(cls, spin)
    _log.info(BOUNDED, busy_loop_s=spin, pid=os.getpid())


def _vllm_version() -> str:
    try:
        return f"vLLM {importlib.import_module('vllm').__version__}"
    except (ImportError, AttributeError):
        return "vLLM not importable"
