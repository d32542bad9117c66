"""Fault injection around any TransferBackend, Mooncake included.

``FaultInjectingBackend`` draws one ``Fault`` per ``submit`` from a
``FaultPlan`` (seeded, or an exact script) and either fakes the failure the
real engine would produce or lets the transfer through. Every fault honours
the op contract the scheduler relies on: one result, then quiescence --
except HANG, which withholds both on purpose until ``release_hangs`` or
``close`` (the caller's deadline must fire first: no waiter may block
past it, whatever the backend does).
"""

from __future__ import annotations

import enum
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .backend import PeerInfo, QuarantineTally, TransferBackend, TransferOp, TransferPlan
from .errors import EngineError, PeerLost, PeerUnreachable, TransferError
from .regions import RegionIndex

__all__ = [
    "DEFAULT_FAULT_KINDS",
    "Fault",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultPlan",
]


class FaultKind(enum.Enum):
    ERROR_CODE = "error_code"  # the engine returns -1
    RAISE = "raise"  # the engine binding raises
    HANG = "hang"  # the engine call never returns (frozen peer)
    LOSE_PEER = "lose_peer"  # the peer dies; sticky until restore_peer
    FAIL_BATCH = "fail_batch"  # one batch fails, the others really transfer
    NONE = "none"  # no fault: the inner backend does the transfer


# LOSE_PEER is left out: it is sticky, so a random plan containing it soon
# fails every later submit to that peer. Ask for it explicitly.
DEFAULT_FAULT_KINDS: tuple[FaultKind, ...] = (
    FaultKind.ERROR_CODE,
    FaultKind.RAISE,
    FaultKind.HANG,
    FaultKind.FAIL_BATCH,
)


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    batch: int = 0  # FAIL_BATCH only: index of the failing batch, clamped to the last

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise ValueError(f"Fault.kind must be a FaultKind, got {self.kind!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 0:
            raise ValueError(f"Fault.batch must be a non-negative int, got {self.batch!r}")


_NO_FAULT = Fault(FaultKind.NONE)


class FaultPlan:
    """Decides the fault of each submit, deterministically.

    ``FaultPlan(seed, rate, kinds)``: each draw is a fault with probability
    ``rate``, its kind uniform over ``kinds``. Every draw consumes the same
    random numbers whatever its outcome, so the sequence of kinds depends on
    the seed alone (FAIL_BATCH's batch also scales with the plan's size).
    ``FaultPlan.script(faults)``: exactly these faults in order, then NONE.
    """

    __slots__ = ("_draw", "_lock")

    _lock: threading.Lock  # backends submit from many threads
    _draw: Callable[[int], Fault]  # num_batches -> the next fault

    def __init__(
        self, seed: int, rate: float = 0.3, kinds: Sequence[FaultKind] = DEFAULT_FAULT_KINDS
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"FaultPlan seed must be an int, got {seed!r}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"FaultPlan rate must be in [0, 1], got {rate!r}")
        kinds = tuple(kinds)
        if not kinds or not all(isinstance(k, FaultKind) for k in kinds):
            raise ValueError(
                f"FaultPlan kinds must be a non-empty sequence of FaultKind: {kinds!r}"
            )
        rng = random.Random(seed)

        def draw(num_batches: int) -> Fault:
            hit, pick, where = rng.random(), rng.randrange(len(kinds)), rng.random()
            if hit >= rate:
                return _NO_FAULT
            return Fault(kinds[pick], batch=int(where * num_batches))

        self._lock = threading.Lock()
        self._draw = draw

    @classmethod
    def script(cls, faults: Iterable[Fault | FaultKind]) -> FaultPlan:
        queue = deque(f if isinstance(f, Fault) else Fault(f) for f in faults)
        plan = cls.__new__(cls)
        plan._lock = threading.Lock()
        plan._draw = lambda _num_batches: queue.popleft() if queue else _NO_FAULT
        return plan

    def next(self, num_batches: int = 1) -> Fault:
        """The fault for the next submit of a plan with ``num_batches`` batches."""
        with self._lock:
            return self._draw(max(num_batches, 1))


class _LinkedOp(TransferOp):
    """An outer op whose cancel reaches the inner op that does the work."""

    __slots__ = ("_inner",)

    _inner: TransferOp | None  # set once the inner op exists

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self._inner = None

    def link(self, inner: TransferOp) -> None:
        self._inner = inner
        if self.cancelled:  # cancel() ran before the link existed
            inner.cancel()

    def cancel(self) -> None:
        super().cancel()
        if self._inner is not None:
            self._inner.cancel()


def _finish(op: TransferOp, error: TransferError | None) -> None:
    op._resolve(error)
    op._quiesce()


class FaultInjectingBackend(TransferBackend):
    """Wraps ``inner`` and injects the faults ``plan`` draws, one per submit."""

    inner: TransferBackend  # does every real transfer; closed by close()
    plan: FaultPlan  # consulted once per submit while open and the peer is not lost
    _inject: dict[FaultKind, Callable[[_LinkedOp, Fault], None]]  # every kind but NONE
    _lock: threading.Lock  # guards the fields below
    _lost: set[str]  # peers lost: submits fail with PeerLost, probes raise
    _hung: list[TransferOp]  # HANG ops, resolved by release_hangs/close only
    _stats: dict[FaultKind, int]  # faults drawn per kind, NONE included
    _closed: bool  # once True: no new faults, submits go straight to inner

    def __init__(self, inner: TransferBackend, plan: FaultPlan) -> None:
        self.inner = inner  # the peer table that counts; this one's stays empty
        self.plan = plan
        self.name = f"faults({inner.name})"
        self._lock = threading.Lock()
        self._lost = set()
        self._hung = []
        self._stats = dict.fromkeys(FaultKind, 0)
        self._closed = False
        self._inject = {
            FaultKind.ERROR_CODE: self._error_code,
            FaultKind.RAISE: self._raise,
            FaultKind.HANG: self._hang,
            FaultKind.LOSE_PEER: self._lose_peer,
            FaultKind.FAIL_BATCH: self._fail_batch,
        }

    @property
    def stats(self) -> dict[FaultKind, int]:
        """A snapshot of how many faults of each kind were drawn."""
        with self._lock:
            return dict(self._stats)

    # -- control ------------------------------------------------------------------

    def release_hangs(self) -> None:
        """Let every hung op end: EngineError, then quiescence."""
        with self._lock:
            hung, self._hung = self._hung, []
        for op in hung:
            _finish(op, EngineError("injected hang released", peer=op.plan.peer, code=-1))

    def lose_peer(self, peer: str) -> None:
        with self._lock:
            self._lost.add(peer)

    def restore_peer(self, peer: str) -> None:
        with self._lock:
            self._lost.discard(peer)

    # -- TransferBackend ----------------------------------------------------------

    def submit(self, plan: TransferPlan) -> TransferOp:
        with self._lock:
            closed, lost = self._closed, plan.peer in self._lost
        if closed:
            return self._delegate(plan)
        if lost:
            op = TransferOp(plan)
            _finish(op, PeerLost(f"peer {plan.peer} is lost (injected)", peer=plan.peer))
            return op
        fault = self.plan.next(len(plan.batches))
        with self._lock:
            self._stats[fault.kind] += 1
        inject = self._inject.get(fault.kind)
        if inject is None:  # NONE: the inner op is the real thing, result and quiescence
            return self._delegate(plan)
        op = _LinkedOp(plan)
        inject(op, fault)
        return op

    def probe(self, peer: str) -> None:
        with self._lock:
            lost = peer in self._lost
        if lost:
            raise PeerUnreachable(f"peer {peer} is lost (injected)", peer=peer)
        self.inner.probe(peer)

    def add_peer(self, info: PeerInfo) -> None:
        self.inner.add_peer(info)

    def remove_peer(self, session_id: str) -> None:
        self.inner.remove_peer(session_id)

    def advertised_regions(self, session_id: str) -> RegionIndex | None:
        return self.inner.advertised_regions(session_id)

    def quarantined(self) -> QuarantineTally:
        """The inner backend's quarantine (hung ops have no result: not counted)."""
        return self.inner.quarantined()

    def close(self) -> None:
        """Release every hang, then close the inner backend. Idempotent."""
        with self._lock:
            self._closed = True
        self.release_hangs()
        self.inner.close()

    # -- one method per fault -----------------------------------------------------

    def _delegate(self, plan: TransferPlan) -> TransferOp:
        try:
            return self.inner.submit(plan)
        except Exception as exc:  # a backend must not raise; make it an op anyway
            op = TransferOp(plan)
            _finish(op, _wrap(exc, plan.peer, f"{self.inner.name}.submit raised"))
            return op

    def _error_code(self, op: _LinkedOp, fault: Fault) -> None:
        peer = op.plan.peer
        _finish(op, EngineError(f"transfer to {peer} returned -1 (injected)", peer=peer, code=-1))

    def _raise(self, op: _LinkedOp, fault: Fault) -> None:
        try:
            raise RuntimeError("engine binding raised (injected)")
        except RuntimeError as exc:
            _finish(op, _wrap(exc, op.plan.peer, "engine raised"))

    def _hang(self, op: _LinkedOp, fault: Fault) -> None:
        with self._lock:
            if not self._closed:
                self._hung.append(op)
                return
        # close() already released the hangs; this one would never be freed.
        _finish(op, EngineError("injected hang on a closed backend", peer=op.plan.peer))

    def _lose_peer(self, op: _LinkedOp, fault: Fault) -> None:
        self.lose_peer(op.plan.peer)
        _finish(op, PeerLost(f"peer {op.plan.peer} lost (injected)", peer=op.plan.peer))

    def _fail_batch(self, op: _LinkedOp, fault: Fault) -> None:
        """Really send every batch but one; the op fails, and quiesces only
        once the inner op has (its writes may land until then, so its blocks
        stay quarantined)."""
        plan, peer = op.plan, op.plan.peer
        k = min(fault.batch, len(plan.batches) - 1)
        injected = EngineError(
            f"batch {k} of {len(plan.batches)} to {peer} failed (injected)", peer=peer, code=-1
        )
        rest = plan.batches[:k] + plan.batches[k + 1 :]
        if not rest:
            _finish(op, injected)
            return
        sub = TransferPlan(
            peer=peer,
            batches=rest,
            nbytes=sum(b.nbytes for b in rest),
            num_blocks=plan.num_blocks,
        )
        inner = self._delegate(sub)
        op.link(inner)
        # A real failure of the other batches is the truer cause; report it first.
        inner.add_quiesce_callback(lambda i: _finish(op, i.error or injected))


def _wrap(exc: BaseException, peer: str, what: str) -> EngineError:
    error = EngineError(f"{what}: {exc!r}", peer=peer)
    error.__cause__ = exc
    return error
