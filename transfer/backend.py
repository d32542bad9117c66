"""The backend interface and the handle of one in-flight transfer.

A backend moves the entries of a ``TransferPlan`` to a peer. ``submit`` never
blocks on the network and never raises for a transfer failure: the outcome
lives in the returned ``TransferOp``. An op has two separate completions:

* its *result*: success, or the typed ``TransferError`` that ended it;
* its *quiescence*: every engine call that touches the plan's buffers has
  returned. A caller that gave up at its deadline has a result (timeout)
  long before the op is quiesced; KV blocks may be reused only after
  quiescence (invariant I6).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from .errors import TransferError, TransferTimeout

if TYPE_CHECKING:  # layout.py imports this module
    from .layout import KVLayout

__all__ = ["Batch", "PeerInfo", "Region", "TransferBackend", "TransferOp", "TransferPlan"]

_log = structlog.get_logger("kvguard.transfer")


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory range: [base, base + length)."""

    base: int
    length: int

    @property
    def end(self) -> int:
        return self.base + self.length

    def contains(self, addr: int, length: int) -> bool:
        return length > 0 and self.base <= addr and addr + length <= self.end


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a decode peer advertises so that a prefill side can write to it.

    ``session_id`` is the engine's address of the peer (``"ip:port"`` for
    Mooncake in P2PHANDSHAKE mode); ``regions`` are the only ranges a plan may
    target; ``layout`` describes the peer's KV cache.
    """

    session_id: str
    regions: tuple[Region, ...]
    layout: KVLayout  # the peer's cache geometry; plans check compatibility against it
    block_base: tuple[int, ...] = ()  # base address of each layer/K-V buffer, layout order


@dataclass(frozen=True, slots=True)
class Batch:
    """Parallel arrays, ready for ``batch_transfer_sync_write``."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A validated plan: built only by ``transfer.build_plan``."""

    peer: str  # the destination session id
    batches: tuple[Batch, ...]
    nbytes: int
    num_blocks: int

    @property
    def num_entries(self) -> int:
        return sum(len(b.lengths) for b in self.batches)


OpCallback = Callable[["TransferOp"], object]


class TransferOp:
    """One submitted transfer. Created by a backend; completed by it alone."""

    __slots__ = (
        "_cancelled",
        "_error",
        "_lock",
        "_q_callbacks",
        "_quiesced",
        "_r_callbacks",
        "_resolved",
        "plan",
    )

    plan: TransferPlan
    _lock: threading.Lock
    _resolved: threading.Event  # set once; _error is final from then on
    _error: TransferError | None  # None after success
    _r_callbacks: list[OpCallback] | None  # None once resolved
    _quiesced: threading.Event  # set once every engine call on the plan has returned
    _q_callbacks: list[OpCallback] | None  # None once quiesced
    _cancelled: bool  # checked by the backend between batches

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self._resolved = threading.Event()
        self._error = None
        self._r_callbacks = []
        self._quiesced = threading.Event()
        self._q_callbacks = []
        self._cancelled = False

    # -- caller side ----------------------------------------------------------

    def result(self, timeout: float | None = None) -> None:
        """Return on success; raise the op's TransferError, or TransferTimeout.

        A TransferTimeout raised here does not stop the engine: check
        ``quiesced`` before reusing the buffers.
        """
        if not self._resolved.wait(timeout):
            raise TransferTimeout(
                f"transfer to {self.plan.peer} not finished after {timeout:.3f}s",
                peer=self.plan.peer,
            )
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._resolved.is_set()

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def quiesced(self) -> bool:
        return self._quiesced.is_set()

    def wait_quiesced(self, timeout: float | None = None) -> bool:
        return self._quiesced.wait(timeout)

    def add_done_callback(self, fn: OpCallback) -> None:
        """Call ``fn(op)`` once, when the op has a result (at once if it has)."""
        with self._lock:
            if self._r_callbacks is not None:
                self._r_callbacks.append(fn)
                return
        fn(self)

    def add_quiesce_callback(self, fn: OpCallback) -> None:
        """Call ``fn(op)`` once, when the op is quiesced (at once if it is)."""
        with self._lock:
            if self._q_callbacks is not None:
                self._q_callbacks.append(fn)
                return
        fn(self)

    def cancel(self) -> None:
        """Ask the backend not to start further batches. Idempotent."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    # -- backend side ---------------------------------------------------------

    def _resolve(self, error: TransferError | None) -> None:
        with self._lock:
            if self._r_callbacks is None:
                return  # first outcome wins
            callbacks, self._r_callbacks = self._r_callbacks, None
            self._error = error
            self._resolved.set()
        _run_callbacks(callbacks, self, "done")

    def _quiesce(self) -> None:
        with self._lock:
            if self._q_callbacks is None:
                return
            callbacks, self._q_callbacks = self._q_callbacks, None
            self._quiesced.set()
        _run_callbacks(callbacks, self, "quiesce")


def _run_callbacks(callbacks: list[OpCallback], op: TransferOp, kind: str) -> None:
    # One raising callback must not rob the others of their exactly-once call.
    for fn in callbacks:
        try:
            fn(op)
        except Exception:
            _log.exception(f"{kind}_callback_failed", peer=op.plan.peer)


class TransferBackend(abc.ABC):
    """Moves plans to peers. Implementations: MooncakeBackend, LocalBackend."""

    name: str = "abstract"

    @abc.abstractmethod
    def submit(self, plan: TransferPlan) -> TransferOp:
        """Start moving ``plan``; never block on the network, never raise for
        a transfer failure (it is reported through the op)."""

    @abc.abstractmethod
    def probe(self, peer: str) -> None:
        """Return if ``peer`` answers; raise PeerUnreachable otherwise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release engine resources. Idempotent."""
