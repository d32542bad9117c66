"""The backend interface and the handle of one in-flight transfer.

A backend moves the entries of a ``TransferPlan`` to a peer. ``submit`` never
blocks on the network and never raises for a transfer failure: the outcome
lives in the returned ``TransferOp``. An op has two separate completions:

* its *result*: success, or the typed ``TransferError`` that ended it;
* its *quiescence*: the engine has given a final status to every entry it
  accepted, so it can no longer read or write the plan's buffers. A caller
  that gave up at its deadline, or an op failed at peer loss, has a result
  long before it is quiesced; KV blocks may be reused only after
  quiescence, and exactly once. Between the two the op is *quarantined*.

Destination ranges are checked where the plan runs, against the regions the
peer advertised (``add_peer``), because ``TransferPlan`` is a public
dataclass and need not come from ``build_plan``.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import structlog

from .errors import InvalidPlan, RemoteRangeRejected, TransferError, TransferTimeout
from .layout import KVLayout
from .regions import Region, RegionIndex

__all__ = [
    "Batch",
    "PeerInfo",
    "QuarantineTally",
    "TransferBackend",
    "TransferOp",
    "TransferPlan",
]

_log = structlog.get_logger("kvguard.transfer")


def check_destinations(plan: TransferPlan, regions: RegionIndex | None) -> None:
    """Raise RemoteRangeRejected unless every destination range of ``plan`` lies
    inside one region the peer advertised (``None``: the peer advertised nothing)."""
    if regions is None:
        raise RemoteRangeRejected(
            f"no regions known for peer {plan.peer!r}: call backend.add_peer(PeerInfo) "
            "before submitting plans to it; nothing sent",
            peer=plan.peer,
        )
    check_ranges(
        plan,
        regions,
        sources=False,
        error=RemoteRangeRejected,
        outside=f"is outside every region peer {plan.peer} advertised",
    )


def check_ranges(
    plan: TransferPlan,
    regions: RegionIndex,
    *,
    sources: bool,
    error: type[InvalidPlan],
    outside: str,
) -> None:
    """Raise ``error`` at the first destination (or, with ``sources``, source)
    range of ``plan`` that no single region holds; ``outside`` says where it is."""
    side = "source" if sources else "destination"
    for index, batch in enumerate(plan.batches):
        bad = regions.first_outside(batch.src if sources else batch.dst, batch.lengths)
        if bad is not None:
            raise error(
                f"batch {index}: {side} [{bad[0]:#x}, +{bad[1]}) {outside}; nothing sent",
                peer=plan.peer,
            )


class QuarantineTally(NamedTuple):
    """Ops with a result whose buffers the engine may still touch, and their bytes."""

    ops: int
    nbytes: int


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
_Backend = TypeVar("_Backend", bound="TransferBackend")


class TransferOp:
    """One submitted transfer. Created by a backend; completed by it alone."""

    __slots__ = (
        "_cancelled",
        "_cv",
        "_error",
        "_lock",
        "_q_callbacks",
        "_r_callbacks",
        "plan",
        "quiesced_at",
        "resolved_at",
    )

    plan: TransferPlan
    _lock: threading.Lock  # guards the fields below that _resolve/_quiesce change
    _cv: threading.Condition | None  # on _lock; made by the first blocking waiter only
    _error: TransferError | None  # final once _r_callbacks is None; None after success
    _r_callbacks: list[OpCallback] | None  # None once resolved: "done" is this being None
    _q_callbacks: list[OpCallback] | None  # None once quiesced (the engine can no
    # longer touch the plan's buffers); only ever after _r_callbacks became None
    _cancelled: bool  # checked by the backend before it hands the engine more entries
    resolved_at: float | None  # time.monotonic() of the result; None before
    quiesced_at: float | None  # time.monotonic() of quiescence; None before; >= resolved_at

    # Most ops are only ever observed through callbacks (the scheduler): two
    # threading.Events per op cost ~8 us, so the condition is made on demand.
    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self._cv = None
        self._error = None
        self._r_callbacks = []
        self._q_callbacks = []
        self._cancelled = False
        self.resolved_at = None
        self.quiesced_at = None

    # -- caller side ----------------------------------------------------------

    def result(self, timeout: float | None = None) -> None:
        """Return on success; raise the op's TransferError, or TransferTimeout.

        A TransferTimeout raised here does not stop the engine: check
        ``quiesced`` before reusing the buffers.
        """
        if self._r_callbacks is not None and not self._wait(_is_resolved, timeout):
            raise TransferTimeout(
                f"transfer to {self.plan.peer} not finished after {timeout:.3f}s",
                peer=self.plan.peer,
            )
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._r_callbacks is None

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def quiesced(self) -> bool:
        return self._q_callbacks is None

    @property
    def quarantined(self) -> bool:
        """Has a result, but the engine may still read or write its buffers."""
        return self._r_callbacks is None and self._q_callbacks is not None

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves: what a quarantined op keeps out of use."""
        return self.plan.nbytes

    def wait_quiesced(self, timeout: float | None = None) -> bool:
        return self._q_callbacks is None or self._wait(_is_quiesced, timeout)

    def _wait(self, pred: Callable[[TransferOp], bool], timeout: float | None) -> bool:
        with self._lock:
            if self._cv is None:
                self._cv = threading.Condition(self._lock)
            return self._cv.wait_for(lambda: pred(self), timeout)

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
        """Ask the backend to hand the engine no further entries. Idempotent.

        An op cancelled before it finished fails with TransferCancelled; what
        the engine already accepted still runs, and the op quiesces after it.
        """
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    # -- backend side ---------------------------------------------------------

    def _resolve(self, error: TransferError | None) -> None:
        with self._lock:
            callbacks = self._r_callbacks
            if callbacks is None:
                return  # first outcome wins
            self._error = error  # before "done" is visible: a reader sees both
            self.resolved_at = time.monotonic()
            self._r_callbacks = None
            if self._cv is not None:
                self._cv.notify_all()
        _run_callbacks(callbacks, self, "done")

    def _quiesce(self) -> None:
        """Only after _resolve: an op is never quiesced without a result."""
        with self._lock:
            callbacks = self._q_callbacks
            if callbacks is None:
                return
            self.quiesced_at = time.monotonic()
            self._q_callbacks = None
            if self._cv is not None:
                self._cv.notify_all()
        _run_callbacks(callbacks, self, "quiesce")


def _is_resolved(op: TransferOp) -> bool:
    return op._r_callbacks is None


def _is_quiesced(op: TransferOp) -> bool:
    return op._q_callbacks is None


def _run_callbacks(callbacks: list[OpCallback], op: TransferOp, kind: str) -> None:
    # One raising callback must not rob the others of their exactly-once call.
    for fn in callbacks:
        try:
            fn(op)
        except Exception:
            _log.exception(f"{kind}_callback_failed", peer=op.plan.peer)


class TransferBackend(abc.ABC):
    """Moves plans to peers. Implementations: MooncakeBackend, LocalBackend.

    The base owns the peer table: what each peer advertised (``add_peer``),
    the only ranges plans to it may write. Subclasses check each plan against
    ``advertised_regions(plan.peer)``.
    """

    name: str = "abstract"

    _advertised: dict[str, RegionIndex]  # session id -> the regions it advertised. Each
    # access is one dict operation, atomic on its own: no lock, so a backend may
    # read it under its own lock together with the state that lock guards.

    # The table is made here, not in __init__: a subclass (a test double, a
    # wrapper) need not call the base's __init__ for add_peer to work.
    def __new__(cls: type[_Backend], *args: object, **kwargs: object) -> _Backend:
        self = super().__new__(cls)
        self._advertised = {}
        return self

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

    # -- peers ----------------------------------------------------------------

    def add_peer(self, info: PeerInfo) -> None:
        """Learn (or replace) the regions ``info`` advertises: the only ranges
        plans to ``info.session_id`` may write."""
        if not isinstance(info, PeerInfo):
            raise TypeError(f"add_peer needs a PeerInfo, got {type(info).__name__}")
        self._advertised[info.session_id] = RegionIndex(info.regions)

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer's regions; ops already submitted run on."""
        self._advertised.pop(session_id, None)

    def advertised_regions(self, session_id: str) -> RegionIndex | None:
        """What ``session_id`` advertised; None before ``add_peer`` or after ``remove_peer``."""
        return self._advertised.get(session_id)

    # A concrete default so that test doubles need not implement it.
    def quarantined(self) -> QuarantineTally:
        """Ops that have a result but are not quiesced yet, and their bytes."""
        return QuarantineTally(0, 0)
