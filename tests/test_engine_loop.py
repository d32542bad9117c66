"""The engine loop's bookkeeping against a scripted engine: what the real
engine rarely shows on demand (TIMEOUT statuses, refused ids, a budget at its
edge, cancel and stop with entries still held). The real engine is in
tests/test_mooncake.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from transfer._poller import EngineLoop, EngineOp, PeerCheck
from transfer.backend import Batch, TransferPlan
from transfer.errors import (
    BackendClosed,
    EngineError,
    PeerLost,
    TransferCancelled,
    TransferError,
)

PEER = "peer:1"
WAIT = 5.0


class ScriptedEngine:
    """Ids it hands out stay 0 until ``finish``; checking a freed id fails the test."""

    def __init__(self, budget: int) -> None:
        self.lock = threading.Lock()
        self.status: dict[int, int] = {}
        self.freed: set[int] = set()
        self.refuse: int | None = None  # the id submit returns instead of a real one
        self.budget = budget
        self.peak = 0
        self.errors: list[str] = []
        self._next = 4096

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        with self.lock:
            if self.refuse is not None:
                return self.refuse
            bid, self._next = self._next, self._next + 16
            self.status[bid] = 0
            live = sum(1 for b in self.status if b not in self.freed)
            self.peak = max(self.peak, live)
            return bid

    def transfer_check_status(self, bid: int) -> int:
        with self.lock:
            if bid in self.freed or bid not in self.status:
                self.errors.append(f"checked freed or unknown id {bid}")
                return -1
            rc = self.status[bid]
            if rc in (1, -1):
                self.freed.add(bid)
            return rc

    def ids(self) -> list[int]:
        with self.lock:
            return sorted(self.status)

    def finish(self, rc: int, ids: list[int] | None = None) -> None:
        with self.lock:
            for bid in self.status if ids is None else ids:
                if bid not in self.freed:
                    self.status[bid] = rc


class Hooks:
    def __init__(self, alive: bool = True) -> None:
        self.alive = alive
        self.retired: list[EngineOp] = []
        self.closed = False

    def needs_check(self, peer: str) -> bool:
        return False

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        check = PeerCheck(alive=self.alive)
        check.done.set()
        wake()
        return check

    def failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        cls = EngineError if check.alive else PeerLost
        return cls(op.failure or "peer gone", peer=op.plan.peer)

    def stopped(self, op: EngineOp) -> TransferError | None:
        if op.cancelled:
            return TransferCancelled("cancelled", peer=op.plan.peer)
        if self.closed:  # as MooncakeBackend.close(): closed first, then the loop stops
            return BackendClosed("closed", peer=op.plan.peer)
        return None

    def retire(self, op: EngineOp) -> None:
        self.retired.append(op)


def _plan(entries: int, per_batch: int = 4) -> TransferPlan:
    batches = []
    for start in range(0, entries, per_batch):
        n = min(per_batch, entries - start)
        addrs = tuple(range(start * 64, (start + n) * 64, 64))
        batches.append(Batch(addrs, addrs, (64,) * n))
    return TransferPlan(PEER, tuple(batches), entries * 64, entries)


@pytest.fixture
def rig() -> Iterator[tuple[ScriptedEngine, Hooks, EngineLoop]]:
    engine, hooks = ScriptedEngine(budget=6), Hooks()
    loop = EngineLoop(engine, hooks, engine.budget, timeout_s=60.0, name="test-loop")
    yield engine, hooks, loop
    engine.finish(1)
    hooks.closed = True
    loop.stop()
    loop.thread.join(WAIT)
    assert not loop.thread.is_alive()
    assert not engine.errors, engine.errors


def _submit(loop: EngineLoop, plan: TransferPlan) -> EngineOp:
    op = EngineOp(plan, loop)
    loop.post(op)
    return op


def _until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_budget_bounds_entries_until_their_final_status(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop],
) -> None:
    engine, hooks, loop = rig
    op = _submit(loop, _plan(20))
    _until(lambda: len(engine.ids()) == 6)
    time.sleep(0.05)
    assert len(engine.ids()) == 6 and not op.done  # no final status: no more budget
    while not op.done:
        engine.finish(1)
        time.sleep(0.002)
    assert op.error is None and op.wait_quiesced(WAIT)
    assert engine.peak <= 6 and len(engine.ids()) == 20
    _until(lambda: hooks.retired == [op])  # the poller retires it after the quiescence


def test_timeout_status_keeps_the_op_unquiesced_and_the_id_alive(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop],
) -> None:
    engine, _, loop = rig
    op = _submit(loop, _plan(3))
    _until(lambda: len(engine.ids()) == 3)
    ids = engine.ids()
    engine.finish(1, ids[:2])
    engine.finish(-2, ids[2:])  # the engine's TIMEOUT: not freed, slices may still run
    assert not op.wait_quiesced(0.3) and not op.done
    engine.finish(1, ids[2:])
    assert op.wait_quiesced(WAIT) and op.error is None


def test_a_failed_entry_fails_the_op_at_once_and_quiesce_waits_for_the_rest(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop],
) -> None:
    engine, hooks, loop = rig
    hooks.alive = False
    op = _submit(loop, _plan(4))
    _until(lambda: len(engine.ids()) == 4)
    ids = engine.ids()
    engine.finish(-1, ids[:1])
    with pytest.raises(PeerLost):
        op.result(WAIT)
    assert op.quarantined
    assert not op.wait_quiesced(0.2)
    engine.finish(1, ids[1:])
    assert op.wait_quiesced(WAIT)
    assert op.quiesced_at is not None and op.resolved_at is not None
    assert op.quiesced_at >= op.resolved_at


@pytest.mark.parametrize("refused", [0, (1 << 64) - 1])
def test_a_refused_submit_fails_the_op_with_nothing_held(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop], refused: int
) -> None:
    engine, _, loop = rig
    engine.refuse = refused
    op = _submit(loop, _plan(5))
    with pytest.raises(EngineError, match="transfer_submit_write"):
        op.result(WAIT)
    assert op.wait_quiesced(WAIT)
    assert engine.ids() == []


def test_cancel_hands_over_nothing_more_and_waits_for_what_was_accepted(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop],
) -> None:
    engine, _, loop = rig
    op = _submit(loop, _plan(20))
    _until(lambda: len(engine.ids()) == 6)
    op.cancel()
    with pytest.raises(TransferCancelled):
        op.result(WAIT)
    assert not op.wait_quiesced(0.1)
    engine.finish(1)
    assert op.wait_quiesced(WAIT)
    time.sleep(0.05)
    assert len(engine.ids()) == 6  # the 14 entries never handed over stay so


def test_stop_keeps_polling_until_the_engine_is_done(
    rig: tuple[ScriptedEngine, Hooks, EngineLoop],
) -> None:
    engine, hooks, loop = rig
    op = _submit(loop, _plan(2))
    queued = _submit(loop, _plan(2))
    _until(lambda: len(engine.ids()) == 4)
    later = EngineOp(_plan(30), loop)
    loop.post(later)
    hooks.closed = True
    loop.stop()
    loop.thread.join(0.2)
    assert loop.thread.is_alive() and not op.quiesced  # the engine holds entries
    engine.finish(1)
    loop.thread.join(WAIT)
    assert not loop.thread.is_alive()
    assert op.quiesced and queued.quiesced and later.quiesced
    assert op.error is None and queued.error is None
    assert isinstance(later.error, BackendClosed)
    assert len(engine.ids()) <= 6  # at most what the budget let through before the stop
