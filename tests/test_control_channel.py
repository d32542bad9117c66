"""The control channel (kvguard.decode.control): frames, request ids, deadlines, limits.

In process, a ``ControlServer`` answers with an engine-less ``Receiver`` (its
``handle`` only touches its cache) or with a hand-written fake that lies:
wrong ids, wrong kinds, garbage, oversized replies. Every wait has a deadline
and every failure is typed. At the end, ``kvguard decode --listen`` serves a
real Mooncake cache to ``kvguard run --decode`` over TCP and stops cleanly.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from mooncake_helpers import SMALL, decode_service, free_port, requires_mooncake
from structlog.testing import capture_logs
from zmq.utils.monitor import recv_monitor_message

from kvguard.decode import control
from kvguard.decode.control import (
    ControlClient,
    ControlServer,
    DecodeClient,
    ServiceTimeout,
    endpoint_of,
)
from transfer import KVCache, KVLayout, PeerProtocolError
from transfer.peer_protocol import (
    DIGEST_SIZE,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    ChecksumReply,
    PingReply,
    PingRequest,
    ZeroReply,
    block_digest_bytes,
    decode_reply,
    encode,
)

SID = "10.0.0.2:15000"
# A hang guard, not a speed figure: how long past its own deadline a call may
# come back on a loaded 2-core machine (how fast is `kvguard bench`'s).
HANG_S = 10.0


def _bare_receiver(layout: KVLayout) -> Any:
    from kvguard.decode.service import Receiver

    rx = object.__new__(Receiver)
    rx.cache = KVCache(layout)
    rx.cache.fill_seeded(3)
    rx.peer_info = rx.cache.peer_info(SID)
    return rx


class Served:
    """A ControlServer answering with ``handle`` on a thread, until closed."""

    def __init__(self, endpoint: str, handle: Callable[[bytes], bytes]) -> None:
        self.server = ControlServer(endpoint, handle)
        self.endpoint = self.server.endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.serve, args=(self._stop, 0.02))
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.server.close()


@pytest.fixture
def ipc(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/control"


@pytest.fixture
def served(ipc: str) -> Iterator[tuple[Any, Served]]:
    rx = _bare_receiver(KVLayout(1, 40_000, 64))
    s = Served(ipc, rx.handle)
    yield rx, s
    s.close()


# -- through an engine-less receiver ----------------------------------------------------


def test_typed_calls_round_trip(served: tuple[Any, Served]) -> None:
    rx, s = served
    client = DecodeClient(s.endpoint, timeout_s=5.0)
    try:
        assert client.peer() == rx.peer_info
        assert client.ping() > 0
        assert client.checksums([3, 1]) == block_digest_bytes(rx.cache, [3, 1])
        client.zero()
        assert not any(bool(t.any()) for t in rx.cache.tensors)
    finally:
        client.close()


def test_a_checksum_reply_past_every_line_limit_keeps_the_channel_in_step(
    served: tuple[Any, Served],
) -> None:
    """Issue 10: a reply longer than the old 1 MiB line split, failed its request
    and desynchronised the next. One frame is one reply, whatever its size."""
    rx, s = served
    client = DecodeClient(s.endpoint, timeout_s=20.0)
    try:
        blocks = list(range(40_000))
        digests = client.checksums(blocks)
        assert len(digests) == 40_000 * DIGEST_SIZE > 1 << 20
        assert digests == block_digest_bytes(rx.cache, blocks)
        assert client.ping() > 0  # the next request gets its own answer
        assert client.checksums([7]) == digests[7 * DIGEST_SIZE : 8 * DIGEST_SIZE]
    finally:
        client.close()


def test_an_oversized_request_frame_is_dropped_unread_and_the_service_goes_on(
    served: tuple[Any, Served],
) -> None:
    _, s = served
    client = DecodeClient(s.endpoint, timeout_s=5.0)
    try:
        with pytest.raises(ServiceTimeout, match=r"no reply from ipc://.* within 0\.5s"):
            client.call_raw(b"x" * (MAX_REQUEST_BYTES + 1), timeout=0.5)
        assert client.ping() > 0
    finally:
        client.close()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", r"request is not valid msgpack: Input data was truncated"),
        (b"\xc1garbage", r"request is not valid msgpack: .*invalid opcode"),
        (encode(ZeroReply())[:-1], r"truncated|Expected"),
        (msgspec.msgpack.encode({"cmd": "ping", "id": True}), r"unknown field `id`"),
        (msgspec.msgpack.encode({"cmd": "checksum", "blocks": [False]}), r"got `bool`"),
        (msgspec.msgpack.encode({"cmd": "checksum", "blocks": [40_000]}), r">= 40000 blocks"),
    ],
)
def test_bad_requests_get_typed_error_replies(
    served: tuple[Any, Served], body: bytes, match: str
) -> None:
    _, s = served
    client = DecodeClient(s.endpoint, timeout_s=5.0)
    try:
        with pytest.raises(PeerProtocolError, match=r"decode service error PeerProtocolError: "):
            client.call_raw(body)
        with pytest.raises(PeerProtocolError, match=match):
            client.call_raw(body)
        assert client.ping() > 0
    finally:
        client.close()


def test_a_malformed_envelope_is_dropped_and_the_service_goes_on(
    served: tuple[Any, Served],
) -> None:
    _, s = served
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(s.endpoint)
    try:
        raw.send_multipart([b"no id frame"])
        raw.send_multipart([b"short", encode(ZeroReply())])
        raw.send_multipart([b"\0" * 8, b"a", b"third frame"])
        assert not raw.poll(300)  # no answer to any of them
    finally:
        raw.close()
    client = DecodeClient(s.endpoint, timeout_s=5.0)
    try:
        assert client.ping() > 0
    finally:
        client.close()


# -- against a lying service ---------------------------------------------------------------


class Liar:
    """A ROUTER that answers each request with ``answer(id, body) -> [frames]``."""

    def __init__(self, endpoint: str, answer: Callable[[bytes, bytes], list[list[bytes]]]):
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._stop = threading.Event()
        self._answer = answer
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                ident, cid, body = self.sock.recv_multipart()
                for frames in self._answer(cid, body):
                    self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.sock.close()


PING = encode(PingReply(4242))


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        # A reply to another request id (a stale one) is dropped, the right one taken.
        (lambda cid, body: [[b"\0" * 8, encode(PingReply(1))], [cid, PING]], 4242),
        (lambda cid, body: [[cid, PING, b"extra"], [cid, PING]], 4242),
        # Only wrong ids: nothing is taken for the answer; the deadline ends the wait.
        (lambda cid, body: [[b"\xff" * 8, PING]], ServiceTimeout),
        (lambda cid, body: [], ServiceTimeout),
        (lambda cid, body: [[cid, encode(ZeroReply())]], "ZeroReply in reply to PingRequest"),
        (lambda cid, body: [[cid, b"\xc1"]], "reply is not valid msgpack"),
        (lambda cid, body: [[cid, b"\x81\xa4type"]], "reply is not valid msgpack: .*truncated"),
        (lambda cid, body: [[cid, msgspec.msgpack.encode({"type": "ping", "pid": True})]], "bool"),
        (lambda cid, body: [[cid, msgspec.msgpack.encode({"type": "ping", "pid": -1})]], ">= 1"),
        # Past MAXMSGSIZE the client drops the connection before buffering the reply.
        (lambda cid, body: [[cid, b"\0" * (MAX_REPLY_BYTES + 1)]], ServiceTimeout),
    ],
    ids=[
        "stale id first",
        "extra frame first",
        "only wrong ids",
        "silence",
        "wrong kind",
        "garbage",
        "truncated",
        "bool as int",
        "negative pid",
        "oversized reply",
    ],
)
def test_replies_are_matched_by_id_and_checked(
    ipc: str, answer: Callable[[bytes, bytes], list[list[bytes]]], outcome: object
) -> None:
    liar = Liar(ipc, answer)
    client = DecodeClient(ipc, timeout_s=0.5)
    try:
        if isinstance(outcome, int):
            assert client.ping() == outcome
        elif outcome is ServiceTimeout:
            start = time.monotonic()
            with pytest.raises(ServiceTimeout) as info:
                client.ping()
            assert 0.5 <= time.monotonic() - start < 0.5 + HANG_S  # at its deadline
            assert isinstance(info.value, TimeoutError)
            assert info.value.reason.name == "TIMEOUT"
        else:
            with pytest.raises(PeerProtocolError, match=str(outcome)):
                client.ping()
    finally:
        client.close()
        liar.close()


def test_a_dead_service_is_a_timeout_not_a_hang(tmp_path: Path) -> None:
    client = ControlClient(f"ipc://{tmp_path}/nobody", timeout_s=0.3)
    try:
        for _ in range(3):  # and again: the socket is reopened each time
            start = time.monotonic()
            with pytest.raises(ServiceTimeout, match=r"no reply from ipc://.* within 0\.3s"):
                client.request(b"anything")
            assert 0.3 <= time.monotonic() - start < 0.3 + HANG_S  # at its deadline
    finally:
        client.close()
    with pytest.raises(PeerProtocolError, match="closed"):
        client.request(b"anything")


def test_a_liveness_check_ends_the_wait_early(tmp_path: Path) -> None:
    client = ControlClient(f"ipc://{tmp_path}/nobody", timeout_s=30.0)

    def gone() -> None:
        raise PeerProtocolError("the child exited")

    try:  # only the check raises this: it, not the 30 s deadline, ended the wait
        with pytest.raises(PeerProtocolError, match="the child exited"):
            client.request(b"anything", alive=gone)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("127.0.0.1:7000", "tcp://127.0.0.1:7000"),
        ("decode-0.internal:0", "tcp://decode-0.internal:0"),
        ("[::1]:7000", "tcp://[::1]:7000"),
        ("tcp://10.0.0.2:7000", "tcp://10.0.0.2:7000"),
        ("ipc:///tmp/x/control", "ipc:///tmp/x/control"),
        ("127.0.0.1", ValueError),
        ("127.0.0.1:http", ValueError),
        ("127.0.0.1:70000", ValueError),
        (":7000", ValueError),
        ("::1:7000", ValueError),
    ],
)
def test_addresses(address: str, endpoint: object) -> None:
    if endpoint is ValueError:
        with pytest.raises(ValueError, match=r"HOST:PORT|IPv6"):
            endpoint_of(address)
    else:
        assert endpoint_of(address) == endpoint


# -- the channel's own error paths, over TCP on 127.0.0.1 -----------------------------------


def _lying_about_digests(rx: Any, keep: Callable[[int], int]) -> Callable[[bytes], bytes]:
    """The receiver's answers, with ``keep(n)`` of each checksum reply's n digest bytes."""

    def handle(body: bytes) -> bytes:
        reply = decode_reply(rx.handle(body))
        if isinstance(reply, ChecksumReply):
            digests = reply.digests * 2  # enough bytes to keep more than were sent
            return encode(ChecksumReply(digests[: keep(len(reply.digests))]))
        return encode(reply)

    return handle


@pytest.mark.parametrize(
    ("keep", "got"),
    [
        (lambda n: n - DIGEST_SIZE, DIGEST_SIZE),  # one block short
        (lambda n: n - 1, 2 * DIGEST_SIZE - 1),  # a digest cut short
        (lambda n: n + DIGEST_SIZE, 3 * DIGEST_SIZE),  # a block too many
        (lambda n: 0, 0),
    ],
    ids=["block short", "byte short", "block extra", "empty"],
)
def test_a_checksum_reply_with_the_wrong_digest_count_is_refused_typed(
    keep: Callable[[int], int], got: int
) -> None:
    # Verification compares these digests block by block: a decode that
    # answers fewer or more must not pass for one whose blocks all match.
    rx = _bare_receiver(KVLayout(1, 16, 64))
    s = Served("127.0.0.1:0", _lying_about_digests(rx, keep))
    client = DecodeClient(s.endpoint, timeout_s=5.0)
    try:
        assert s.endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(PeerProtocolError) as info:
            client.checksums([3, 1])
        assert str(info.value) == f"{s.endpoint}: {got} digest bytes for 2 blocks"
        assert client.ping() > 0  # the channel stays in step
    finally:
        client.close()
        s.close()


def test_a_full_send_queue_fails_at_once_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the default options a reset leaves one request queued at most, so
    # the queue is full only on a socket that queues nothing: here one told to
    # queue to completed connections only (ZMQ_IMMEDIATE), with nobody listening.
    make = control._socket

    def immediate(kind: int, endpoint: str, max_frame: int) -> zmq.Socket[bytes]:
        sock = make(kind, endpoint, max_frame)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        return sock

    monkeypatch.setattr(control, "_socket", immediate)
    port = free_port()
    client = ControlClient(f"127.0.0.1:{port}", timeout_s=HANG_S)
    try:
        for _ in range(2):  # and again: the reset socket is as empty as the first
            start = time.monotonic()
            with pytest.raises(ServiceTimeout) as info:
                client.request(b"anything")
            assert time.monotonic() - start < HANG_S  # said at once, not at the deadline
            assert str(info.value) == (
                f"tcp://127.0.0.1:{port} is not taking requests: "
                "the send queue is full (SNDHWM 1000)"
            )
            assert isinstance(info.value, TimeoutError)
            assert info.value.reason.name == "TIMEOUT"
    finally:
        client.close()


def _open_sockets() -> set[zmq.Socket[bytes]]:
    return {sock for sock in zmq.Context.instance()._sockets if not sock.closed}


def test_a_taken_port_is_refused_typed_and_leaves_no_socket() -> None:
    rx = _bare_receiver(KVLayout(1, 16, 64))
    first = Served("127.0.0.1:0", rx.handle)
    port = int(first.endpoint.rpartition(":")[2])
    try:
        before = _open_sockets()
        with pytest.raises(OSError) as info:
            ControlServer(f"127.0.0.1:{port}", rx.handle)
        assert type(info.value) is OSError
        assert str(info.value) == (
            f"cannot listen on 127.0.0.1:{port}: "
            f"Address already in use (addr='tcp://127.0.0.1:{port}')"
        )
        assert isinstance(info.value.__cause__, zmq.ZMQError)
        assert info.value.__cause__.errno == errno.EADDRINUSE
        with pytest.raises(ValueError, match=r"expected HOST:PORT, got '127\.0\.0\.1:65536'"):
            ControlServer("127.0.0.1:65536", rx.handle)
        assert _open_sockets() == before  # neither failure left a socket open
        client = DecodeClient(first.endpoint, timeout_s=5.0)
        try:
            assert client.ping() > 0  # the holder of the port still serves
        finally:
            client.close()
    finally:
        first.close()


def test_a_reply_to_a_client_that_gave_up_is_dropped_and_said(all_levels: None) -> None:
    """The client times out while the service works on its request and
    reopens its socket: the reply has nobody to go to, and the service logs
    it dropped and goes on serving."""
    rx = _bare_receiver(KVLayout(1, 16, 64))
    seen: list[bytes] = []
    working, finish = threading.Event(), threading.Event()

    def slow(body: bytes) -> bytes:
        seen.append(body)
        if len(seen) == 2:  # after the warm-up: answered once its client has left
            working.set()
            finish.wait(HANG_S)
        return rx.handle(body)

    server = ControlServer("127.0.0.1:0", slow)
    # Set up before serve() runs: a socket is never shared between threads.
    monitor = server._sock.get_monitor_socket(  # type: ignore[union-attr]
        zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
    )
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop, 0.02))
    client = ControlClient(server.endpoint, timeout_s=HANG_S)
    ping = encode(PingRequest())
    try:
        with capture_logs() as logs:
            thread.start()
            assert decode_reply(client.request(ping)) == PingReply(os.getpid())  # connected
            with pytest.raises(ServiceTimeout, match=r"within 0\.3s"):
                client.request(ping, timeout=0.3)
            assert working.wait(HANG_S), "the service never got the request"
            # The reply is made only once the service has seen the old socket
            # go and the reopened one come (the warm-up's came first).
            events: list[int] = []
            while events.count(zmq.EVENT_ACCEPTED) < 2 or zmq.EVENT_DISCONNECTED not in events:
                assert monitor.poll(int(1000 * HANG_S)), f"only these socket events: {events}"
                events.append(int(recv_monitor_message(monitor)["event"]))
            finish.set()
            deadline = time.monotonic() + HANG_S
            while not [e for e in logs if e["event"] == "reply_dropped"]:
                assert time.monotonic() < deadline, "the dropped reply was never logged"
                time.sleep(0.01)
        [dropped] = [e for e in logs if e["event"] == "reply_dropped"]
        assert dropped["why"] == "client gone"
        assert dropped["bytes"] == len(encode(PingReply(os.getpid())))
        assert dropped["log_level"] == "debug"
        # The service goes on, and the reopened client gets its own answer.
        assert decode_reply(client.request(ping)) == PingReply(os.getpid())
        assert len(seen) == 3
    finally:
        finish.set()
        client.close()
        stop.set()
        thread.join(HANG_S)
        monitor.close()
        server.close()
    assert not thread.is_alive()


# -- kvguard decode --listen / kvguard run --decode ----------------------------------------


@requires_mooncake
@pytest.mark.mooncake
def test_kvguard_run_drives_a_decode_service_over_tcp_and_it_stops_cleanly() -> None:
    from kvguard.run import RunConfig, run

    proc, address = decode_service()
    try:
        cfg = RunConfig(requests=30, blocks_per_request=4, progress=False, decode=address, **SMALL)  # type: ignore[arg-type]
        for _ in range(2):  # the service outlives a run, and serves the next one
            summary = run(cfg, out=io.StringIO())
            assert summary.ok() == [] and summary.done == 30, summary
            assert summary.integrity_errors == 0 and summary.unverified == 0
        other = RunConfig(requests=1, decode=address, layers=2, blocks=32, block_bytes=4096)
        with pytest.raises(ValueError, match="start it with the same"):
            run(other, out=io.StringIO())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        client = DecodeClient(address, timeout_s=0.3)  # nobody listens any more
        with pytest.raises(ServiceTimeout):
            client.ping()
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_run_refuses_to_kill_or_freeze_a_remote_service() -> None:
    from kvguard.run import RunConfig

    for bad, match in [
        ({"kill_decode_after": 3}, "--kill-decode-after"),
        ({"freeze_decode_after": 3}, "--freeze-decode-after"),
        ({"backend": "local"}, "--backend local"),
    ]:
        with pytest.raises(ValueError, match=f"--decode cannot be combined with {match}"):
            RunConfig(decode="127.0.0.1:7000", **bad).check()  # type: ignore[arg-type]


def test_run_against_nothing_fails_typed_within_its_deadline(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine")
    from kvguard.cli import main

    start = time.monotonic()
    code = main(["run", "--decode", f"ipc://{tmp_path}/nobody", "--requests", "1", "--no-progress"])
    assert code == 2
    # Its 10 s connect deadline plus the hang guard: it never waits for a reply forever.
    assert time.monotonic() - start < 10.0 + HANG_S


def test_decode_on_a_wildcard_address_needs_the_address_peers_use() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvguard.cli", "decode", "--listen=0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "wildcard_address" in out.stderr
    assert "--listen 0.0.0.0:0 needs --ip: the address peers use" in out.stderr
