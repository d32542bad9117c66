"""The vLLM connector's two halves without vLLM: PrefillSender and DecodeReceiver
over real ZeroMQ TCP on loopback, bytes moved by the in-process LocalBackend.

What the vLLM tests (tests/test_vllm_pd.py, .venv-vllm) show with real
engines, checked here in milliseconds: a push lands and is reported once on
both sides; a push may overtake its hold; a hold nobody asks for is released
at its deadline and not before; a dead prefill fails the wait at once;
garbage on the wire changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvguard.vllm.decode_loads import DecodeReceiver, LoadOutcome
from kvguard.vllm.prefill_pushes import PrefillSender
from kvguard.vllm.protocol import Abort, decode_from_decode, encode
from transfer import FaultInjectingBackend, FaultKind, FaultPlan, KVCache, KVLayout, LocalBackend
from transfer.peer_protocol import peer_message_of

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_bytes=256, kv_split=False)
PEER = "decode:1"


class Pair:
    def __init__(self) -> None:
        self.src = KVCache(LAYOUT)
        self.src.fill_seeded(7)
        self.dst = KVCache(LAYOUT)
        self.backend = LocalBackend(workers=2)
        self.backend.register_source(self.src)
        info = self.backend.register_peer(PEER, self.dst)
        self.sender = PrefillSender(self.backend, self.src, "tcp://127.0.0.1:0")
        self.receiver = DecodeReceiver(
            peer_message_of(info), heartbeat_s=0.2, heartbeat_timeout_s=0.6
        )
        self.released: set[str] = set()
        self.outcomes: dict[str, LoadOutcome] = {}

    def poll(self) -> None:
        self.released |= self.sender.take_released()
        for out in self.receiver.take_finished():
            assert out.request_id not in self.outcomes, "reported twice"
            self.outcomes[out.request_id] = out

    def until(self, cond: Callable[[], bool], timeout: float = 5.0) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, "condition not reached"
            time.sleep(0.002)
            self.poll()
        return time.monotonic() - t0

    def close(self) -> None:
        self.receiver.close()
        self.sender.close(timeout=2.0)
        self.backend.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_push_lands_and_both_sides_report_once(pair: Pair) -> None:
    src, dst = [1, 2, 3], [9, 4, 11]
    pair.sender.hold("r1", src, time.monotonic() + 5)
    pair.receiver.expect("d1", pair.sender.endpoint, "r1", dst, time.monotonic() + 5)
    pair.until(lambda: "d1" in pair.outcomes and "r1" in pair.released)
    assert pair.outcomes["d1"].ok, pair.outcomes["d1"]
    for buf in range(LAYOUT.num_buffers):
        for s, d in zip(src, dst, strict=True):
            assert bool((pair.src.block(buf, s) == pair.dst.block(buf, d)).all())
    assert pair.sender.holding() == 0 and pair.sender.stats.done == 1


def test_a_push_may_overtake_its_hold(pair: Pair) -> None:
    pair.receiver.expect("d1", pair.sender.endpoint, "r1", [5], time.monotonic() + 5)
    time.sleep(0.1)  # the push waits at the sender
    pair.sender.hold("r1", [0, 6], time.monotonic() + 5)  # the tail block goes
    pair.until(lambda: "d1" in pair.outcomes and "r1" in pair.released)
    assert pair.outcomes["d1"].ok
    assert bool((pair.src.block(0, 6) == pair.dst.block(0, 5)).all())


def test_an_unasked_hold_is_released_at_its_deadline_not_before(pair: Pair) -> None:
    t0 = time.monotonic()
    pair.sender.hold("r1", [1], t0 + 0.3)
    pair.until(lambda: "r1" in pair.released)
    assert time.monotonic() - t0 >= 0.3
    assert time.monotonic() - t0 < 0.3 + 0.2
    assert pair.sender.stats.expired == 1


def test_abort_before_a_push_releases_at_once(pair: Pair) -> None:
    pair.sender.hold("r1", [1], time.monotonic() + 30)
    pair.receiver.forget(pair.sender.endpoint, "r1")
    assert pair.until(lambda: "r1" in pair.released) < 1.0
    assert pair.sender.stats.aborted == 1


def test_an_unknown_request_fails_the_load_by_the_deadline(pair: Pair) -> None:
    pair.receiver.expect("d1", pair.sender.endpoint, "nope", [1], time.monotonic() + 0.8)
    pair.until(lambda: "d1" in pair.outcomes)
    out = pair.outcomes["d1"]
    assert not out.ok and out.reason in ("unknown_request", "timeout"), out
    assert out.latency_s <= 0.8 + 0.1


def test_a_dead_prefill_fails_the_wait_at_once(pair: Pair) -> None:
    pair.receiver.expect("d0", pair.sender.endpoint, "x", [1], time.monotonic() + 30)
    time.sleep(0.2)  # connected, the push waiting at the sender for its hold
    pair.sender.close(timeout=2.0)  # the socket closes: what a kill does to TCP
    t = pair.until(lambda: "d0" in pair.outcomes, 5.0)
    out = pair.outcomes["d0"]
    assert not out.ok and out.reason == "peer_lost", out
    assert t < 1.0
    # Asked again while it stays dead: refused at once, not at the deadline.
    pair.receiver.expect("d1", pair.sender.endpoint, "y", [1], time.monotonic() + 30)
    assert pair.until(lambda: "d1" in pair.outcomes, 5.0) < 1.0
    assert pair.outcomes["d1"].reason == "peer_lost"


def test_garbage_on_the_wire_changes_nothing(pair: Pair) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.sender.endpoint)
    for junk in (b"", b"\xff" * 100, encode(Abort("r9"))[:-1], b"\x81\xa4kind\xa4push"):
        sock.send(junk)
    sock.send_multipart([b"a", b"b", b"c"])
    sock.close()
    with pytest.raises(Exception, match="bad message"):
        decode_from_decode(b"\xff")
    test_push_lands_and_both_sides_report_once(pair)  # still serving


def test_nobody_listening_at_first_contact_fails_at_once(pair: Pair) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    pair.receiver.expect("d1", f"127.0.0.1:{port}", "r1", [1], time.monotonic() + 30)
    assert pair.until(lambda: "d1" in pair.outcomes, 5.0) < 1.0
    out = pair.outcomes["d1"]
    assert not out.ok and out.reason == "peer_lost" and "refused" in out.detail, out


def test_a_cancelled_load_is_reported_only_after_the_prefill_let_go() -> None:
    """vLLM #46283's case: the decode aborts while the transfer runs. The
    decode's blocks may be written until the prefill's engine let go of them,
    so the load is reported (failed) only then, and the prefill's hold too."""
    p = Pair()
    hanging = FaultInjectingBackend(p.backend, FaultPlan.script([FaultKind.HANG]))
    p.sender.close(timeout=2.0)
    p.sender = PrefillSender(hanging, p.src, "tcp://127.0.0.1:0", peer_backends=(p.backend,))
    try:
        p.sender.hold("r1", [1], time.monotonic() + 30)
        p.receiver.expect("d1", p.sender.endpoint, "r1", [2], time.monotonic() + 30)
        p.until(lambda: p.sender.stats.pushed == 1)
        p.receiver.cancel("d1")
        time.sleep(0.3)  # aborted at the prefill, but the engine still holds the blocks
        p.poll()
        assert "d1" not in p.outcomes and "r1" not in p.released
        hanging.release_hangs()  # the engine lets go
        p.until(lambda: "d1" in p.outcomes and "r1" in p.released)
        out = p.outcomes["d1"]
        assert not out.ok and out.reason == "aborted", out
    finally:
        p.close()
