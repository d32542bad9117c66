"""The vLLM connector's two halves without vLLM: PrefillSender and DecodeReceiver
over real ZeroMQ TCP on loopback, bytes moved by the in-process LocalBackend.

What the vLLM tests (tests/test_vllm_pd.py, .venv-vllm) show with real
engines, checked here in milliseconds: a push lands and is reported once on
both sides; a push may overtake its hold; a hold nobody asks for is released
at its deadline and not before; a dead prefill fails the wait at once;
garbage on the wire changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvguard.vllm.decode_loads import DecodeReceiver, LoadOutcome
from kvguard.vllm.prefill_pushes import PrefillSender
from kvguard.vllm.protocol import (
    Abort,
    Push,
    Result,
    decode_from_decode,
    decode_from_prefill,
    encode,
)
from kvguard.vllm.states import LoadEnd
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
        self.unfenced: list[str] = []

    def poll(self) -> None:
        self.released |= self.sender.take_released()
        for out in self.receiver.take_finished():
            assert out.request_id not in self.outcomes, "reported twice"
            self.outcomes[out.request_id] = out
        for rid in self.receiver.take_released():
            assert self.outcomes[rid].fenced and rid not in self.unfenced, rid
            self.unfenced.append(rid)

    def until(self, cond: Callable[[], bool], timeout: float = 10.0) -> float:
        """Poll until ``cond``; ``timeout`` is a hang guard, far below the
        30 s deadlines the "at once" cases use, not a speed figure."""
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


def hanging_pair() -> tuple[Pair, FaultInjectingBackend]:
    """A pair whose prefill engine hangs in its first transfer until released."""
    p = Pair()
    hanging = FaultInjectingBackend(p.backend, FaultPlan.script([FaultKind.HANG]))
    p.sender.close(timeout=2.0)
    p.sender = PrefillSender(hanging, p.src, "tcp://127.0.0.1:0")  # it forwards peers
    return p, hanging


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_a_receiver_with_no_prefill_linked_waits_instead_of_spinning(pair: Pair) -> None:
    """ZeroMQ's poll returns at once when nothing is registered: the receiver
    waits on its inbox then (a busy loop holds the GIL the engine's own
    thread needs, on every idle decode worker). A 5 ms turn makes about 100
    turns in 0.5 s; the busy loop made over 50,000."""
    assert pair.receiver.links() == 0
    before = pair.receiver.steps
    time.sleep(0.5)
    assert 0 < pair.receiver.steps - before <= 200


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
    pair.until(lambda: "r1" in pair.released)  # its own bound is the hang guard
    assert time.monotonic() - t0 >= 0.3
    assert pair.sender.stats.expired == 1


def test_abort_before_a_push_releases_at_once(pair: Pair) -> None:
    pair.sender.hold("r1", [1], time.monotonic() + 30)
    pair.receiver.forget(pair.sender.endpoint, "r1")
    pair.until(lambda: "r1" in pair.released)  # long before its 30 s deadline
    assert pair.sender.stats.aborted == 1


def test_an_unknown_request_fails_the_load_with_the_prefills_word_before_the_deadline(
    pair: Pair,
) -> None:
    # The push waits at the prefill for its hold until the push's own expiry
    # (the deadline less the decode's margin), then is answered: not fenced.
    pair.receiver.expect("d1", pair.sender.endpoint, "nope", [1], time.monotonic() + 1.0)
    pair.until(lambda: "d1" in pair.outcomes)
    out = pair.outcomes["d1"]
    assert (out.ok, out.reason, out.detail, out.fenced) == (
        False,
        "unknown_request",
        "never held here",
        False,
    )


def test_a_dead_prefill_fails_the_wait_at_once(pair: Pair) -> None:
    pair.receiver.expect("d0", pair.sender.endpoint, "x", [1], time.monotonic() + 30)
    time.sleep(0.2)  # connected, the push waiting at the sender for its hold
    pair.sender.close(timeout=2.0)  # the socket closes: what a kill does to TCP
    pair.until(lambda: "d0" in pair.outcomes)  # not the 30 s deadline
    out = pair.outcomes["d0"]
    # Dropped is not proof (a frozen prefill drops too): fenced, then the
    # refused reconnect proves nothing listens, and the blocks come back.
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out
    assert "connection dropped" in out.detail
    pair.until(lambda: pair.unfenced == ["d0"])
    # Asked again while it stays dead: refused at once, not at the deadline.
    pair.receiver.expect("d1", pair.sender.endpoint, "y", [1], time.monotonic() + 30)
    pair.until(lambda: "d1" in pair.outcomes)
    out = pair.outcomes["d1"]
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", False), out


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
    pair.until(lambda: "d1" in pair.outcomes)  # not the 30 s deadline
    out = pair.outcomes["d1"]
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", False), out
    assert "refused" in out.detail


def _port_nobody_listens_on() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_link_connected_to_itself_fails_its_loads_at_once_unfenced(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP self-connect: dialling a port nothing listens on can pick that same
    port as the source (it is in the kernel's ephemeral range) and connect
    the socket to itself; ZeroMQ then hands the DEALER its own Push. Forced
    here with ZeroMQ's source-address syntax: nothing listens, so the load
    fails at once, unfenced, instead of waiting out its deadline fenced."""
    from kvguard.vllm import decode_core

    port = _port_nobody_listens_on()
    looped = f"tcp://127.0.0.1:{port};127.0.0.1:{port}"
    monkeypatch.setattr(decode_core, "prefill_url", lambda endpoint: looped)
    pair.receiver.expect("d1", f"127.0.0.1:{port}", "r1", [1], time.monotonic() + 30)
    pair.until(lambda: "d1" in pair.outcomes)  # not the 30 s deadline
    out = pair.outcomes["d1"]
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", False), out
    assert out.detail == f"prefill {looped}: connected to itself, nothing listens there"
    pair.until(lambda: pair.receiver.links() == 0)  # the looped link is closed
    monkeypatch.undo()
    pair.sender.hold("r2", [5], time.monotonic() + 5)  # still serving
    pair.receiver.expect("d2", pair.sender.endpoint, "r2", [6], time.monotonic() + 5)
    pair.until(lambda: "d2" in pair.outcomes)
    assert pair.outcomes["d2"].ok and same(pair, [5], [6])


def test_a_probe_connected_to_itself_counts_as_nothing_listening(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost prefill's probe that connects to itself proves nothing listens
    (as a refusal does): the fenced load's blocks come back."""
    import socket

    def looped(address: tuple[str, int], timeout: float) -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())  # a real self-connected socket
        return s

    pair.receiver.expect("d0", pair.sender.endpoint, "x", [1], time.monotonic() + 30)
    time.sleep(0.2)  # connected, the push waiting at the sender for its hold
    monkeypatch.setattr(socket, "create_connection", looped)
    pair.sender.close(timeout=2.0)
    pair.until(lambda: pair.unfenced == ["d0"])
    out = pair.outcomes["d0"]
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out


def test_equal_addresses_with_no_echo_do_not_prove_a_prefill_gone(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe's socket whose two ends read the same (a NAT hairpin to a live
    listener can look so) proves nothing unless what it sends comes back: a
    frozen prefill's kernel accepts and sends nothing. The fenced load
    stays fenced until a real refusal."""
    import socket

    class Hairpin:
        def __enter__(self) -> Hairpin:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", 40000)

        getpeername = getsockname

        def sendall(self, data: bytes) -> None:
            pass

        def recv(self, n: int) -> bytes:
            raise TimeoutError("timed out")

    real = socket.create_connection
    pair.receiver.expect("d0", pair.sender.endpoint, "x", [1], time.monotonic() + 30)
    time.sleep(0.2)  # connected, the push waiting at the sender for its hold
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: Hairpin())
    pair.sender.close(timeout=2.0)
    pair.until(lambda: "d0" in pair.outcomes)
    assert pair.outcomes["d0"].fenced
    time.sleep(1.2)  # two probes or more, each fooled
    pair.poll()
    assert pair.unfenced == []
    monkeypatch.setattr(socket, "create_connection", real)
    pair.until(lambda: pair.unfenced == ["d0"])  # a real probe is refused


def test_one_lost_prefill_is_probed_a_turn(
    pair: Pair, all_levels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe of an unreachable host blocks the receiver's thread for up
    to its timeout; with many such prefills lost at once (a partitioned
    host's ranks), probing them all in one turn would hold every other
    load's deadline and verdict. At most one is probed each turn."""
    import socket

    from structlog.testing import capture_logs

    gates = [_Gate(pair.sender.endpoint) for _ in range(3)]
    turns: list[int] = []

    def unreachable(address: tuple[str, int], timeout: float) -> socket.socket:
        turns.append(pair.receiver.steps)
        time.sleep(0.05)
        raise TimeoutError("timed out")

    try:
        with capture_logs() as logs:
            for k, gate in enumerate(gates):
                gate.open = True
                pair.receiver.expect(f"d{k}", gate.endpoint, f"r{k}", [k], time.monotonic() + 30)
            pair.until(lambda: len(_events(logs, "prefill_link_up")) == 3)
            monkeypatch.setattr(socket, "create_connection", unreachable)
            for gate in gates:
                gate.cut()
            pair.until(lambda: len(pair.outcomes) == 3)
            pair.until(lambda: len(turns) >= 9)
        assert len(set(turns)) == len(turns), turns  # never two in one turn
        assert all(pair.outcomes[f"d{k}"].fenced for k in range(3)), pair.outcomes
    finally:
        monkeypatch.undo()
        for gate in gates:
            gate.close()


class _Gate:
    """A TCP relay to ``target``. Shut, it holds the connections it accepts
    (accepted, never answered: no ZeroMQ handshake, no refusal); open, it
    relays them. ``release()`` opens it and closes what it held (their
    ZeroMQ peers connect again, through the relay); ``drop()`` closes every
    connection before any handshake; ``cut()`` closes every relayed
    connection, as a network partition ending a session would."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self.open = False
        self.dropping = False  # close what it accepts at once (a drop before any handshake)
        self._lock = threading.Lock()
        self.held: list[socket.socket] = []
        self.relayed: list[socket.socket] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        def pipe(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := a.recv(65536):
                    b.sendall(data)
            for end in (a, b):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:  # a mode change and its closing of held happen as one
                if self.dropping:
                    self._close([conn])
                    continue
                if not self.open:
                    self.held.append(conn)
                    continue
            up = socket.create_connection(self._target)
            with self._lock:
                self.relayed += [conn, up]
            threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
            threading.Thread(target=pipe, args=(up, conn), daemon=True).start()

    @staticmethod
    def _close(conns: list[Any]) -> None:
        import socket

        while conns:
            conn = conns.pop()
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def release(self) -> None:
        with self._lock:
            self.open, self.dropping = True, False
            self._close(self.held)

    def drop(self) -> None:
        """Close what it holds and, from now on, what it accepts (whenever
        the kernel's queue hands it over)."""
        with self._lock:
            self.dropping = True
            self._close(self.held)

    def cut(self) -> None:
        with self._lock:
            self.open = False
            self._close(self.relayed)

    def close(self) -> None:
        self._srv.close()
        self._close(self.held)
        self._close(self.relayed)


def test_a_link_that_never_comes_up_connects_again_and_its_push_lands(
    pair: Pair, all_levels: None
) -> None:
    """The prefill's address accepts the TCP connection but nothing answers:
    no handshake, and no refusal either. After ``heartbeat_timeout_s`` the
    link is stalled and connected again with its push (each time logged);
    once the path works, the load lands, well before its deadline."""
    from structlog.testing import capture_logs

    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            pair.sender.hold("r1", [2, 3], time.monotonic() + 30)
            pair.receiver.expect("d1", gate.endpoint, "r1", [4, 5], time.monotonic() + 30)

            def stalled() -> list[dict[str, object]]:
                return [e for e in logs if e["event"] == "prefill_link_stalled"]

            pair.until(lambda: len(stalled()) >= 2)
            first = stalled()[0]
            want = (gate.endpoint, 1, "warning", "connected")
            assert (
                first["endpoint"],
                first["waits"],
                first["log_level"],
                first["last_event"],
            ) == want
            assert "d1" not in pair.outcomes  # stalled is not failed: its deadline is 30 s off
            gate.open = True
            pair.until(lambda: "d1" in pair.outcomes)
    finally:
        gate.close()
    out = pair.outcomes["d1"]
    assert out == LoadOutcome("d1", LoadEnd.LOADED, "", out.latency_s), out
    assert same(pair, [2, 3], [4, 5])


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_remade_link_dropped_before_its_handshake_keeps_its_load_fenced(
    pair: Pair, all_levels: None
) -> None:
    """The stalled socket may have handshaken unseen as it closed, so the
    prefill may hold its push: a drop of the link made in its place, before
    that one's handshake, is no proof nothing was delivered. The load fails
    fenced, probes find the port listening, and only the prefill's answer,
    once the path works, lets its blocks go."""
    from structlog.testing import capture_logs

    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            pair.receiver.expect("d1", gate.endpoint, "r1", [4, 5], time.monotonic() + 30)
            pair.until(lambda: bool(_events(logs, "prefill_link_stalled")))
            gate.drop()  # the re-made link drops before its handshake
            pair.until(lambda: "d1" in pair.outcomes)
            out = pair.outcomes["d1"]
            assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out
            assert out.detail == f"prefill {gate.endpoint}: connection dropped"
            time.sleep(1.0)  # two probes: the gate accepts, nothing proves the prefill gone
            pair.poll()
            assert pair.unfenced == []
            gate.release()
            pair.until(lambda: pair.unfenced == ["d1"])
            assert [e["was_lost"] for e in _events(logs, "prefill_link_up")] == [True]
    finally:
        gate.close()


def test_a_remade_link_that_cannot_even_dial_keeps_its_load_fenced(
    pair: Pair, all_levels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeroMQ says "connect retried" for a refusal but also for a host name
    that does not resolve (or a socket() that failed), with no connection
    ever made. On a re-made link, whose predecessor may have delivered the
    push, that is no proof the prefill is gone: the load is fenced."""
    from structlog.testing import capture_logs

    receiver = pair.receiver
    real_open = receiver._open
    opened: list[str] = []

    def unresolvable_second(endpoint: str) -> Any:
        opened.append(endpoint)
        return real_open(endpoint if len(opened) == 1 else "tcp://kvguard-test.invalid:9")

    monkeypatch.setattr(receiver, "_open", unresolvable_second)
    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            receiver.expect("d1", gate.endpoint, "r1", [4, 5], time.monotonic() + 30)
            pair.until(lambda: "d1" in pair.outcomes)
            # At least the re-made link: a host stall may let the next redial
            # (1.2 s on) run before this line does.
            assert len(opened) >= 2 and _events(logs, "prefill_link_stalled")
        out = pair.outcomes["d1"]
        assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out
        time.sleep(1.0)  # probes of the endpoint find the gate listening
        pair.poll()
        assert pair.unfenced == []
    finally:
        gate.close()
    pair.until(lambda: pair.unfenced == ["d1"])  # nothing listens now: refused


def test_a_stalled_link_backs_off_and_outlives_a_failed_reopen(
    pair: Pair, all_levels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that accepts and never answers is dialled again after
    ``heartbeat_timeout_s``, then twice, four times as long; a new socket
    that cannot be made leaves the old one and its load in place."""
    from structlog.testing import capture_logs

    receiver = pair.receiver
    real_open = receiver._open
    opened: list[str] = []

    def flaky(endpoint: str) -> Any:
        opened.append(endpoint)
        if len(opened) == 2:
            raise zmq.ZMQError(errno.EMFILE)
        return real_open(endpoint)

    monkeypatch.setattr(receiver, "_open", flaky)
    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            receiver.expect("d1", gate.endpoint, "r1", [4, 5], time.monotonic() + 30)
            pair.until(lambda: len(_events(logs, "prefill_link_stalled")) >= 3)
            # The receiver's thread logs a stall before it makes the new
            # socket: let the turn that logged the third one end first.
            turn, deadline = receiver.steps, time.monotonic() + 10.0
            while receiver.steps <= turn:
                assert time.monotonic() < deadline, "the turn of the third stall never ended"
                time.sleep(0.002)
            stalls = [e["after_s"] for e in _events(logs, "prefill_link_stalled")]
            assert all(after >= 0.6 * 2**k for k, after in enumerate(stalls)), stalls
            failed = _events(logs, "prefill_link_reopen_failed")
            assert [(e["endpoint"], e["log_level"]) for e in failed] == [(gate.endpoint, "warning")]
            assert len(opened) == 4 and receiver.links() == 1  # the expect, then a stall each
            assert "d1" not in pair.outcomes  # stalled is not failed
            gate.drop()  # the link drops before its handshake: fenced
            pair.until(lambda: "d1" in pair.outcomes)
            gate.release()  # until the prefill answers
            pair.until(lambda: pair.unfenced == ["d1"])
    finally:
        gate.close()
    out = pair.outcomes["d1"]
    assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out


def _load_then_cut(pair: Pair, gate: _Gate) -> None:
    """Load d1 (r1: block 1 -> 2) through ``gate``, open; then cut the
    session and shut the gate."""
    gate.open = True
    pair.sender.hold("r1", [1], time.monotonic() + 30)
    pair.receiver.expect("d1", gate.endpoint, "r1", [2], time.monotonic() + 30)
    pair.until(lambda: "d1" in pair.outcomes)
    gate.cut()


def _assert_both_landed(pair: Pair) -> None:
    """d1 (r1: 1 -> 2) and d2 (r2: 3 -> 4) loaded, bytes equal."""
    assert pair.outcomes["d1"].ok, pair.outcomes["d1"]
    out = pair.outcomes["d2"]
    assert out == LoadOutcome("d2", LoadEnd.LOADED, "", out.latency_s), out
    assert same(pair, [1, 3], [2, 4])


def test_a_load_asked_while_its_link_is_lost_is_not_aborted_when_it_returns(
    pair: Pair, all_levels: None
) -> None:
    """On a lost link's new handshake the decode asks again for the verdicts
    it gave up on, and only those: a push made while the link was down is
    delivered then and must land, not be aborted with them."""
    from structlog.testing import capture_logs

    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            _load_then_cut(pair, gate)
            pair.until(lambda: bool(_events(logs, "prefill_link_lost")))
            pair.receiver.expect("d2", gate.endpoint, "r2", [4], time.monotonic() + 30)
            gate.release()
            pair.until(lambda: len(_events(logs, "prefill_link_up")) == 2)
            time.sleep(0.3)  # the push reaches the sender before its hold
            pair.sender.hold("r2", [3], time.monotonic() + 30)
            pair.until(lambda: "d2" in pair.outcomes)
    finally:
        gate.close()
    _assert_both_landed(pair)


def test_a_lost_link_whose_reconnect_hangs_is_made_again(pair: Pair, all_levels: None) -> None:
    """After a drop ZeroMQ reconnects by itself, and its new connection can
    hang before the handshake (accepted, never answered) until ZeroMQ's own
    30 s handshake limit. A lost link with loads not up
    ``heartbeat_timeout_s`` after its drop is made again, its pushes sent
    again, so a load asked meanwhile lands once the path works."""
    from structlog.testing import capture_logs

    gate = _Gate(pair.sender.endpoint)
    try:
        with capture_logs() as logs:
            _load_then_cut(pair, gate)
            # ZeroMQ's reconnect is held by the gate.
            pair.until(lambda: bool(_events(logs, "prefill_link_lost")) and len(gate.held) >= 1)
            pair.receiver.expect("d2", gate.endpoint, "r2", [4], time.monotonic() + 30)
            pair.sender.hold("r2", [3], time.monotonic() + 30)
            gate.open = True  # what is held stays held; a new connection passes
            pair.until(lambda: "d2" in pair.outcomes)
            stalled = _events(logs, "prefill_link_stalled")
            assert stalled and stalled[0]["last_event"] == "connected", stalled
    finally:
        gate.close()
    _assert_both_landed(pair)


def test_a_verdict_lost_on_the_way_is_asked_for_again() -> None:
    """The prefill's Result for a given-up load never arrives (sent while the
    decode's connection changed hands: ZeroMQ drops it, EHOSTUNREACH): the
    decode asks again every ``heartbeat_timeout_s`` until it is answered,
    so the fenced blocks come back instead of staying out for good."""
    backend = LocalBackend(workers=1)
    receiver = DecodeReceiver(
        peer_message_of(backend.register_peer("d:9", KVCache(LAYOUT))),
        heartbeat_s=0.2,
        heartbeat_timeout_s=0.6,
    )
    ctx = zmq.Context.instance()
    router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        receiver.expect("d1", f"127.0.0.1:{port}", "r1", [1], time.monotonic() + 0.5)
        aborts: list[float] = []
        outcome: LoadOutcome | None = None
        released: list[str] = []
        end = time.monotonic() + 10
        while not released:
            assert time.monotonic() < end, (aborts, outcome)
            if router.poll(10):
                ident, body = router.recv_multipart()
                msg = decode_from_decode(body)
                if isinstance(msg, Abort):
                    aborts.append(time.monotonic())
                    if len(aborts) == 2:  # the first answer was "lost": answer the second
                        reply = Result(msg.request_id, msg.load_id, False, "aborted")
                        router.send_multipart([ident, encode(reply)])
            for out in receiver.take_finished():
                outcome = out
            released += receiver.take_released()
        assert outcome is not None
        assert (outcome.ok, outcome.reason, outcome.fenced) == (False, "timeout", True), outcome
        assert released == ["d1"] and len(aborts) == 2, aborts
        assert aborts[1] - aborts[0] >= 0.6, aborts  # asked again after the stall bound
    finally:
        receiver.close()
        router.close()
        backend.close()


def test_a_cancelled_load_is_reported_only_after_the_prefill_let_go() -> None:
    """vLLM #46283's case: the decode aborts while the transfer runs. The
    decode's blocks may be written until the prefill's engine let go of them,
    so the load is reported (failed) only then, and the prefill's hold too."""
    p, hanging = hanging_pair()
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


def same(p: Pair, src: list[int], dst: list[int]) -> bool:
    return all(
        bool((p.src.block(buf, a) == p.dst.block(buf, b)).all())
        for buf in range(LAYOUT.num_buffers)
        for a, b in zip(src, dst, strict=True)
    )


def test_each_of_n_loads_of_one_prefill_request_gets_its_own_transfer(pair: Pair) -> None:
    """vLLM splits n > 1 into decode requests sharing one prefill request:
    each is loaded by its own transfer and answered by its own Result."""
    pair.sender.hold("r1", [1, 2], time.monotonic() + 5)
    for i, dst in enumerate(([3, 4], [5, 6], [7, 8])):
        pair.receiver.expect(f"d{i}", pair.sender.endpoint, "r1", dst, time.monotonic() + 5, 3)
    pair.until(lambda: len(pair.outcomes) == 3 and "r1" in pair.released)
    assert [o.ok for o in pair.outcomes.values()] == [True, True, True], pair.outcomes
    assert same(pair, [1, 2], [3, 4]) and same(pair, [1, 2], [5, 6]) and same(pair, [1, 2], [7, 8])
    assert (pair.sender.stats.pushed, pair.sender.stats.done, pair.sender.stats.loads) == (3, 3, 3)
    assert pair.sender.holding() == 0


def test_a_group_pushed_steps_apart_keeps_its_hold_for_the_last_child(pair: Pair) -> None:
    """vLLM may allocate n > 1 children steps apart: the first child's push
    says 3, so its Result does not end the hold the later children need."""
    pair.sender.hold("r1", [1, 2], time.monotonic() + 5)
    pair.receiver.expect("d0", pair.sender.endpoint, "r1", [3, 4], time.monotonic() + 5, 3)
    pair.until(lambda: "d0" in pair.outcomes)
    time.sleep(0.1)  # a step or two of the decode
    pair.poll()
    assert pair.released == set() and pair.sender.holding() == 1
    for i, dst in ((1, [5, 6]), (2, [7, 8])):
        pair.receiver.expect(f"d{i}", pair.sender.endpoint, "r1", dst, time.monotonic() + 5, 3)
    pair.until(lambda: len(pair.outcomes) == 3 and "r1" in pair.released)
    assert [(k, o.ok, o.reason) for k, o in sorted(pair.outcomes.items())] == [
        ("d0", True, ""),
        ("d1", True, ""),
        ("d2", True, ""),
    ]
    assert same(pair, [1, 2], [5, 6]) and same(pair, [1, 2], [7, 8])


def test_a_forgotten_child_settles_its_group_and_a_late_abort_counts_once(pair: Pair) -> None:
    """One child pushed (group 2), the other will never push: the hold ends
    with the forget, not at its deadline. An abort of the load already
    answered settles nothing more."""
    pair.sender.hold("r1", [1], time.monotonic() + 30)
    pair.sender.hold("r2", [2], time.monotonic() + 30)
    pair.receiver.expect("d0", pair.sender.endpoint, "r1", [3], time.monotonic() + 5, 2)
    pair.receiver.expect("e0", pair.sender.endpoint, "r2", [4], time.monotonic() + 5, 3)
    pair.until(lambda: {"d0", "e0"} <= set(pair.outcomes))
    pair.receiver.forget(pair.sender.endpoint, "r1")
    pair.until(lambda: "r1" in pair.released)  # long before its 30 s deadline
    # r2: its one answered load aborted again (a cancel that crossed its
    # Result) and one forget: 1 + 1 of 3, so the third child still may push.
    pair.receiver.forget(pair.sender.endpoint, "r2")
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a hang guard, not a speed figure
        sock.connect(pair.sender.endpoint)
        sock.send(encode(Abort("r2", "e0")))
        res = decode_from_prefill(sock.recv())
        assert isinstance(res, Result)
        assert (res.load_id, res.ok, res.reason) == ("e0", False, "aborted"), res
    time.sleep(0.1)
    pair.poll()
    assert "r2" not in pair.released and pair.sender.holding() == 1
    pair.receiver.expect("e1", pair.sender.endpoint, "r2", [5], time.monotonic() + 5, 3)
    pair.until(lambda: "e1" in pair.outcomes and "r2" in pair.released)
    assert (pair.outcomes["e1"].ok, pair.outcomes["e1"].reason) == (True, "")
    assert same(pair, [2], [5])


def test_an_id_reused_while_loading_is_ignored_and_the_first_load_lands(pair: Pair) -> None:
    pair.sender.hold("r1", [1], time.monotonic() + 5)
    pair.receiver.expect("d1", pair.sender.endpoint, "r1", [2], time.monotonic() + 5)
    pair.receiver.expect("d1", pair.sender.endpoint, "r1", [3], time.monotonic() + 5)
    pair.until(lambda: "d1" in pair.outcomes and "r1" in pair.released)
    time.sleep(0.2)  # a second outcome for d1 would fail poll()'s reported-twice check
    pair.poll()
    assert pair.outcomes["d1"].ok and same(pair, [1], [2])
    assert pair.sender.stats.pushed == 1 and not same(pair, [1], [3])


class FakePrefill:
    """A ROUTER that answers as a prefill would, or lies."""

    def __init__(self) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self) -> tuple[bytes, object]:
        assert self.sock.poll(5000), "nothing from the decode"
        ident, body = self.sock.recv_multipart()
        return ident, decode_from_decode(body)

    def close(self) -> None:
        self.sock.close()


def test_a_result_for_another_load_or_request_marks_nothing(pair: Pair) -> None:
    fake = FakePrefill()
    try:
        pair.receiver.expect("d1", fake.endpoint, "r1", [2], time.monotonic() + 1.0)
        ident, push = fake.recv()
        assert isinstance(push, Push) and (push.request_id, push.load_id) == ("r1", "d1")
        for lie in (Result("r1", "d2", True), Result("r2", "d1", True)):
            fake.sock.send_multipart([ident, encode(lie)])
        pair.until(lambda: "d1" in pair.outcomes)
        out = pair.outcomes["d1"]
        assert (out.ok, out.reason, out.fenced) == (False, "timeout", True), out
        _, abort = fake.recv()  # the decode asks the prefill to let go
        assert abort == Abort("r1", "d1")
        fake.sock.send_multipart([ident, encode(Result("r1", "d1", False, "aborted"))])
        pair.until(lambda: pair.unfenced == ["d1"])
    finally:
        fake.close()


def test_a_load_past_its_deadline_stays_fenced_until_the_prefill_lets_go() -> None:
    """The prefill's engine hangs in the transfer: the decode reports the
    load failed at its deadline, but names its blocks free only once the
    prefill released the transfer (terminal AND quiesced)."""
    p, hanging = hanging_pair()
    try:
        p.sender.hold("r1", [1], time.monotonic() + 30)
        p.receiver.expect("d1", p.sender.endpoint, "r1", [2], time.monotonic() + 1.0)
        p.until(lambda: "d1" in p.outcomes)
        out = p.outcomes["d1"]
        assert (out.ok, out.reason, out.fenced) == (False, "timeout", True), out
        time.sleep(0.3)  # aborted at the prefill, but the engine still holds the blocks
        p.poll()
        assert p.unfenced == [] and "r1" not in p.released
        hanging.release_hangs()
        p.until(lambda: p.unfenced == ["d1"] and "r1" in p.released)
    finally:
        p.close()


def raw_decode(p: Pair) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(p.sender.endpoint)
    return sock


def answer(sock: zmq.Socket[bytes]) -> Result:
    assert sock.poll(5000), "no answer from the prefill"
    return decode_from_prefill(sock.recv())


def push_of(p: Pair, rid: str, load: str, **kw: object) -> Push:
    args: dict[str, object] = dict(
        request_id=rid,
        load_id=load,
        blocks=[2],
        peer=p.receiver.peer,
        expires_at=time.time() + 5,
        compat="",
    )
    args.update(kw)
    return Push(**args)  # type: ignore[arg-type]


def test_a_push_read_after_its_load_was_given_up_is_refused(pair: Pair) -> None:
    pair.sender.hold("r1", [1], time.monotonic() + 5)
    sock = raw_decode(pair)
    try:
        sock.send(encode(Abort("r1", "d1")))
        assert answer(sock) == Result("r1", "d1", False, "aborted", "no transfer started")
        pair.until(lambda: "r1" in pair.released)  # nothing else wanted it
        sock.send(encode(push_of(pair, "r1", "d1")))
        res = answer(sock)
        assert (res.request_id, res.load_id, res.ok, res.reason) == ("r1", "d1", False, "aborted")
        assert pair.sender.stats.pushed == 0
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("kw", "reason", "detail"),
    [
        ({"expires_at": 1.0}, "timeout", "the hold or the push deadline has passed"),
        ({"compat": "float16/x"}, "incompatible", "KV layouts differ: decode 'float16/x'"),
        ({"blocks": [2, 3, 4]}, "bad_request", "decode asks for 3 blocks"),
    ],
)
def test_a_push_that_cannot_start_is_answered_at_once_and_touches_nothing(
    pair: Pair, kw: dict[str, object], reason: str, detail: str
) -> None:
    pair.sender.hold("r1", [1], time.monotonic() + 5)
    sock = raw_decode(pair)
    try:
        sock.send(encode(push_of(pair, "r1", "d1", **kw)))
        res = answer(sock)
        assert (res.ok, res.reason) == (False, reason) and detail in res.detail, res
        assert pair.sender.stats.pushed == 0 and pair.sender.stats.refused == 1
        assert pair.sender.holding() == 1  # another decode may still ask in time
    finally:
        sock.close()


def test_a_push_read_before_its_hold_that_cannot_start_is_answered_at_the_hold(
    pair: Pair,
) -> None:
    """A push waiting for its hold is checked against it when it comes: the
    refusal is the hold's turn's answer, and the hold stays for others."""
    sock = raw_decode(pair)
    try:
        sock.send(encode(push_of(pair, "r1", "d1", blocks=[2, 3, 4])))
        assert not sock.poll(100)  # it waits for the hold
        pair.sender.hold("r1", [1], time.monotonic() + 5)
        res = answer(sock)
        assert (res.request_id, res.load_id, res.ok, res.reason) == (
            "r1",
            "d1",
            False,
            "bad_request",
        )
        assert "decode asks for 3 blocks" in res.detail
        assert pair.sender.stats.pushed == 0 and pair.sender.stats.refused == 1
        assert pair.sender.holding() == 1
    finally:
        sock.close()


def test_a_refused_load_pushed_again_starts_nothing(pair: Pair) -> None:
    """A decode re-sends its push on a new connection (the old one stalled
    and may have delivered it): once refused, the same load must not start,
    since its decode heard it failed and vLLM may reuse its blocks; another
    load of the request still may."""
    pair.sender.hold("r1", [1], time.monotonic() + 5)
    sock = raw_decode(pair)
    try:
        sock.send(encode(push_of(pair, "r1", "d1", compat="float16/x")))
        assert answer(sock).reason == "incompatible"
        sock.send(encode(push_of(pair, "r1", "d1")))  # valid now, same load
        assert not sock.poll(300)
        assert (pair.sender.stats.pushed, pair.sender.stats.refused) == (0, 1)
        sock.send(encode(push_of(pair, "r1", "d2")))
        assert answer(sock) == Result("r1", "d2", True, "", "")
        assert pair.sender.stats.pushed == 1
    finally:
        sock.close()


def test_copies_of_a_push_read_before_its_hold_start_one_transfer(pair: Pair) -> None:
    """Two copies of one push (the decode re-sent it on a new connection)
    read before the engine's hold: the hold starts one transfer, answered
    once; the copy starts nothing."""
    sock = raw_decode(pair)
    try:
        sock.send(encode(push_of(pair, "r1", "d1")))
        sock.send(encode(push_of(pair, "r1", "d1")))
        assert not sock.poll(100)  # both wait for the hold
        pair.sender.hold("r1", [1], time.monotonic() + 5)
        assert answer(sock) == Result("r1", "d1", True, "", "")
        assert not sock.poll(300)
        assert (pair.sender.stats.pushed, pair.sender.stats.done) == (1, 1)
    finally:
        sock.close()


def test_a_push_failing_validation_is_answered_when_its_ids_parse(pair: Pair) -> None:
    sock = raw_decode(pair)
    try:
        bad = msgspec.msgpack.encode(
            {"kind": "push", "request_id": "r1", "load_id": "d1", "blocks": [-1]}
        )
        sock.send(bad)
        res = answer(sock)
        assert (res.request_id, res.load_id, res.ok, res.reason) == (
            "r1",
            "d1",
            False,
            "bad_request",
        )
        assert "bad message from decode" in res.detail
    finally:
        sock.close()


def test_a_renewed_hold_outlives_its_deadline_up_to_the_cap_only() -> None:
    """A decode whose request queues renews the prefill's hold; renewals
    never pin the blocks past the prefill's own cap."""
    p = Pair()
    p.sender.close(timeout=2.0)
    # Renewals 0.2 s apart each give 3 s: the test tolerates 2.8 s stalls.
    p.sender = PrefillSender(p.backend, p.src, "tcp://127.0.0.1:0", renew_s=3.0, max_hold_s=4.0)
    try:
        t0 = time.monotonic()
        p.sender.hold("r1", [1], t0 + 0.3)
        while time.monotonic() - t0 < 2.5:  # renewed every 0.2 s, past the 0.3 s deadline
            p.receiver.renew(p.sender.endpoint, "r1")
            time.sleep(0.2)
            p.poll()
            assert "r1" not in p.released, f"released at {time.monotonic() - t0:.2f}s"
        p.until(lambda: "r1" in p.released)  # the cap ends it though renewals go on
        assert p.sender.stats.renewed >= 3 and p.sender.stats.expired == 1
        p.receiver.expect("d1", p.sender.endpoint, "r1", [2], time.monotonic() + 5)
        p.until(lambda: "d1" in p.outcomes)
        out = p.outcomes["d1"]
        assert (out.ok, out.reason, out.detail) == (False, "unknown_request", "request expired")
    finally:
        p.close()


def test_decodes_and_prefills_that_churn_away_are_forgotten(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every decode restart is a new Mooncake session and every prefill a
    new endpoint: idle ones are forgotten on both sides, and learnt again."""
    from kvguard.vllm import decode_links, prefill_core

    monkeypatch.setattr(prefill_core, "IDLE_PEER_S", 0.3)
    monkeypatch.setattr(decode_links, "IDLE_LINK_S", 0.3)
    test_push_lands_and_both_sides_report_once(pair)
    assert pair.sender.peers() == 1 and pair.receiver.links() == 1
    pair.until(lambda: pair.sender.peers() == 0 and pair.receiver.links() == 0)
    assert pair.backend.advertised_regions(PEER) is None
    pair.sender.hold("r2", [5], time.monotonic() + 5)
    pair.receiver.expect("d2", pair.sender.endpoint, "r2", [6], time.monotonic() + 5)
    pair.until(lambda: "d2" in pair.outcomes)
    assert pair.outcomes["d2"].ok and same(pair, [5], [6])


FAKE_PREFILL = r"""
import zmq
from kvguard.vllm.protocol import Abort, Result, decode_from_decode, encode

sock = zmq.Context().socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:  # never pushes; answers each given-up load as released
    ident, body = sock.recv_multipart()
    msg = decode_from_decode(body)
    if isinstance(msg, Abort) and msg.load_id:
        sock.send_multipart([ident, encode(Result(msg.request_id, msg.load_id, False, "aborted"))])
"""


def test_a_frozen_prefill_is_not_taken_for_dead_and_its_late_answer_lands(pair: Pair) -> None:
    """SIGSTOP: heartbeats fail and the connection drops, but the stopped
    process's port still accepts, so the load stays fenced; on SIGCONT the
    decode reconnects under the same identity, asks again, and the answer
    lifts the fence. Then SIGKILL: the port refuses, and that is proof."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_PREFILL], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert fake.stdout is not None
        endpoint = f"tcp://127.0.0.1:{int(fake.stdout.readline())}"
        pair.receiver.expect("d1", endpoint, "r1", [1], time.monotonic() + 30)
        time.sleep(0.5)  # connected; the push sits at the fake, unanswered
        fake.send_signal(signal.SIGSTOP)
        pair.until(lambda: "d1" in pair.outcomes)
        out = pair.outcomes["d1"]
        assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", True), out
        time.sleep(2.0)  # four probes: each finds the port accepting
        pair.poll()
        assert pair.unfenced == [], "a stopped prefill was taken for a dead one"
        fake.send_signal(signal.SIGCONT)
        pair.until(lambda: pair.unfenced == ["d1"])
        fake.kill()
        fake.wait(10)
        pair.receiver.expect("d2", endpoint, "r2", [1], time.monotonic() + 30)
        pair.until(lambda: "d2" in pair.outcomes)  # long before its 30 s deadline
        out = pair.outcomes["d2"]
        assert (out.ok, out.reason, out.fenced) == (False, "peer_lost", False), out
    finally:
        fake.kill()
        fake.wait(10)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://nowhere:notaport",
        # ZeroMQ would take these, but such a link never reports a drop or a
        # refusal, so a load given up on it would stay fenced for good.
        "inproc://kvguard-prefill",
        "ipc:///tmp/kvguard-prefill",
        "tcp://ipc://x",
    ],
)
def test_a_bad_endpoint_fails_the_load_at_once_naming_it(pair: Pair, endpoint: str) -> None:
    """The endpoint comes from a request's parameters: untrusted. Nothing is
    sent, so nothing is fenced, and the receiver keeps serving."""
    pair.receiver.expect("bad", endpoint, "r1", [1], time.monotonic() + 30)
    pair.until(lambda: "bad" in pair.outcomes)
    out = pair.outcomes["bad"]
    assert (out.ok, out.reason, out.fenced) == (False, "bad_endpoint", False), out
    assert repr(endpoint) in out.detail and pair.receiver.links() == 0
    test_push_lands_and_both_sides_report_once(pair)  # still serving


@pytest.mark.parametrize(
    ("remote", "detail"),
    [("", "Expected `str` of length >= 1"), ("r" * 513, "Expected `str` of length <= 512")],
)
def test_a_request_id_the_prefill_would_refuse_fails_at_once_unfenced(
    pair: Pair, remote: str, detail: str
) -> None:
    """A prefill request id from the client's parameters that the protocol
    bounds refuse: the prefill could not parse the push, nor answer it or an
    Abort, so the load would wait out its deadline and stay fenced. It is
    refused here, before anything is sent or any link made."""
    pair.receiver.expect("bad", pair.sender.endpoint, remote, [1], time.monotonic() + 30)
    pair.until(lambda: "bad" in pair.outcomes)
    out = pair.outcomes["bad"]
    assert (out.ok, out.reason, out.fenced) == (False, "bad_request", False), out
    assert detail in out.detail and pair.receiver.links() == 0
    test_push_lands_and_both_sides_report_once(pair)  # still serving


@pytest.mark.usefixtures("all_levels")
def test_garbage_from_a_prefill_is_logged_typed_and_marks_nothing(pair: Pair) -> None:
    from structlog.testing import capture_logs

    fake = FakePrefill()
    try:
        with capture_logs() as logs:
            pair.receiver.expect("d1", fake.endpoint, "r1", [2], time.monotonic() + 30)
            ident, _ = fake.recv()
            fake.sock.send_multipart([ident, b"\xff\x00"])
            fake.sock.send_multipart([ident, encode(Result("r1", "d1", True))])
            pair.until(lambda: "d1" in pair.outcomes)
        bad = [e for e in logs if e["event"] == "bad_prefill_message"]
        assert len(bad) == 1 and "bad message from prefill" in bad[0]["error"], logs
        assert pair.outcomes["d1"].ok  # the good Result after it still counts
    finally:
        fake.close()
