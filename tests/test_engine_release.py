"""Who destroys the Mooncake engine, and when.

The engine's destructor joins its threads with the GIL held (up to about
1 s), so no thread of the process runs meanwhile. Left to the cyclic GC --
the backend and its engine loop reference each other -- it ran in whichever
thread next tripped a collection: a scheduler's driver due to expire a
request ended it up to 1.5 s past its deadline (I4; the benchmark's frozen
peer overshoot, 417 and 540 ms in CI). close() must destroy it itself.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
from mooncake_helpers import prefill_backend, receiver, requires_mooncake

from transfer import KVCache, KVLayout, build_plan
from transfer._poller import EngineLoop, EngineOp, PeerCheck
from transfer.errors import TransferError

LAYOUT = KVLayout(num_layers=1, num_blocks=64, block_bytes=4096)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counts free objects: what the cyclic GC would free stays."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@requires_mooncake
@pytest.mark.mooncake
@pytest.mark.usefixtures("no_cyclic_gc")
def test_close_destroys_the_engine_before_it_returns() -> None:
    with prefill_backend() as backend:
        src = KVCache(LAYOUT)
        src.fill_seeded(3)
        backend.register(src)
        with receiver(LAYOUT, backend) as peer:
            op = backend.submit(build_plan(src, peer.peer, [1, 2], [3, 4]))
            op.result(timeout=30)
            assert op.wait_quiesced(5)
            del op
            engine = weakref.ref(backend.engine)
            assert engine() is not None
            backend.close()  # the peer still up: its connection is open
            assert engine() is None, "close() left the engine to the cyclic GC"
            assert backend.engine is None


class _Engine:
    """Never asked for anything: the loop gets no op."""


class _Hooks:
    def needs_check(self, peer: str) -> bool:
        return False

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        raise AssertionError("no op, no check")

    def failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        raise AssertionError("no op, no failure")

    def stopped(self, op: EngineOp) -> TransferError | None:
        return None

    def retire(self, op: EngineOp) -> None:
        pass


@pytest.mark.usefixtures("no_cyclic_gc")
def test_the_loop_lets_go_of_its_engine_only_once_it_has_ended() -> None:
    engine = _Engine()
    ref = weakref.ref(engine)
    loop = EngineLoop(engine, _Hooks(), budget=4, timeout_s=60.0, name="test-release")
    del engine
    assert not loop.release_engine(), "the loop still runs: it may call the engine"
    assert ref() is not None
    loop.stop()
    loop.thread.join(5.0)
    assert not loop.thread.is_alive()
    assert loop.release_engine()
    assert ref() is None
