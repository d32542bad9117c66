"""How long vLLM's shared-memory queue readers busy-wait: a vLLM general plugin.

After each read, a reader of vLLM's shared-memory queues (the worker reading
its engine core's next step, the engine core reading its worker's output)
spins for ``SpinCondition.busy_loop_s``, 1 s, before it sleeps on a socket;
vLLM has no setting for it. On a host or cgroup where a prefill and a decode
share cores, each server's idle worker spins on the cores the other computes
on, and takes them from the Mooncake engine's threads that move the KV
(docs/performance.md, "Two servers on two cores"). A server with cores of
its own loses nothing to the spin and should keep vLLM's.

kvguard registers ``register`` as a ``vllm.general_plugins`` entry point:
vLLM calls it in the API server, the engine core and each worker before
their queues are made. With ``KVGUARD_VLLM_READER_SPIN_S`` unset it does
nothing; set (0 to 60 seconds), every reader made after it spins that long.
A value that is not a number in range, or a vLLM without the parameter,
raises ``ReaderSpinError`` there and the server does not start.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
from typing import Any, Final

import structlog

__all__ = ["ENV", "MAX_SPIN_S", "ReaderSpinError", "parse", "register"]

ENV: Final = "KVGUARD_VLLM_READER_SPIN_S"
MAX_SPIN_S: Final = 60.0  # beyond a minute a typo: vLLM's own is 1 s
_MODULE: Final = "vllm.distributed.device_communicators.shm_broadcast"
_PARAM: Final = "busy_loop_s"
_MARK: Final = "_kvguard_reader_spin_s"  # on the patched __init__: the value it forces

_log = structlog.get_logger("kvguard.vllm")


class ReaderSpinError(ValueError):
    """``KVGUARD_VLLM_READER_SPIN_S`` is unusable: its value, or this vLLM."""


def parse(text: str) -> float:
    """The spin in seconds that ``text`` asks for, or ``ReaderSpinError`` naming it."""
    try:
        spin = float(text)
    except ValueError:
        raise ReaderSpinError(f"{ENV}={text!r} is not a number of seconds") from None
    if not (math.isfinite(spin) and 0.0 <= spin <= MAX_SPIN_S):
        raise ReaderSpinError(f"{ENV}={text!r} is outside 0 to {MAX_SPIN_S:g} seconds")
    return spin


def bound(cls: Any, spin: float) -> None:
    """Make every ``cls`` built from now on spin ``spin`` s, whatever its caller asks."""
    init = cls.__init__
    if _PARAM not in inspect.signature(init).parameters:
        raise ReaderSpinError(
            f"{ENV} is set but this vLLM's {cls.__qualname__} has no {_PARAM!r}: unset it"
        )
    init = getattr(init, "__wrapped__", init)  # a second call replaces the first's value

    @functools.wraps(init)
    def bounded(self: Any, *args: Any, **kwargs: Any) -> None:
        params = inspect.signature(init).bind(self, *args, **kwargs)
        params.arguments[_PARAM] = spin
        init(*params.args, **params.kwargs)

    setattr(bounded, _MARK, spin)
    cls.__init__ = bounded


def register() -> None:
    """The plugin: bound the readers' spin where ``KVGUARD_VLLM_READER_SPIN_S`` asks."""
    text = os.environ.get(ENV)
    if text is None:
        return  # vLLM's own spin
    spin = parse(text)
    cls = importlib.import_module(_MODULE).SpinCondition
    bound(cls, spin)
    _log.info("reader_spin_bounded", busy_loop_s=spin, pid=os.getpid())
