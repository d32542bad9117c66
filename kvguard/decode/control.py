"""The control channel between a prefill side and a decode service, over ZeroMQ.

One request, one reply, each a single msgpack message (``peer_protocol``) in
one ZeroMQ frame: ZeroMQ delimits messages, so a reply of any size can
neither split nor run into the next one. The envelope is::

    client (DEALER) -> [request id: 8 bytes, big-endian] [body]
    service (ROUTER) -> [the same id] [reply body]

Every wait has a deadline. A request that times out raises
``ServiceTimeout`` and the client reopens its socket (the "lazy pirate"
pattern), so a late reply goes to a socket that no longer exists; the id
check drops anything else that is not the answer to the current request.
Both sides set ``MAXMSGSIZE``: ZeroMQ drops a connection whose frame
announces more, before buffering it.

Addresses: ``HOST:PORT`` or ``[v6]:PORT`` for TCP, or a ZeroMQ URL
(``tcp://``, ``ipc://`` -- a filesystem path, reachable across network
namespaces). ``tcp_address`` is kvguard's one parser of TCP endpoints: this
channel's (``endpoint_of``), a vLLM prefill's control endpoint and its
ranks' (``kvguard.vllm.protocol``, ``kvguard.vllm.ranks``).
"""

from __future__ import annotations

import errno
import itertools
import struct
import threading
import time
from collections.abc import Callable
from typing import Final, TypeVar

import structlog
import zmq

from kvguard.curve import ClientKeys, Guard, ServerKeys, secure_client
from transfer.backend import PeerInfo
from transfer.errors import PeerProtocolError, TransferTimeout
from transfer.peer_protocol import (
    DIGEST_SIZE,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    REPLY_OF,
    ChecksumReply,
    ChecksumRequest,
    ErrorReply,
    PeerMessage,
    PeerRequest,
    PingReply,
    PingRequest,
    Reply,
    Request,
    ZeroRequest,
    decode_reply,
    encode,
    peer_info_of,
)

__all__ = [
    "ControlClient",
    "ControlServer",
    "DecodeClient",
    "ServiceTimeout",
    "endpoint_of",
    "tcp_address",
    "tcp_url",
]

_log = structlog.get_logger("kvguard.control")

_ID: Final = struct.Struct(">Q")
_SLICE_S: Final = 0.05  # how often a waiting call runs its liveness check
# Why a ROUTER_MANDATORY socket refuses a reply, by errno.
_DROPPED: Final = {
    errno.EHOSTUNREACH: "client gone",
    errno.EAGAIN: "client not reading",
}

Liveness = Callable[[], None]  # raises when the service is known to be gone


class ServiceTimeout(TransferTimeout, TimeoutError):
    """No reply within the deadline: the service is dead, frozen or unreachable."""


def tcp_address(address: str) -> tuple[str, int]:
    """The one parser of kvguard's TCP endpoints: ``HOST:PORT``, ``[v6]:PORT``,
    either after ``tcp://`` -> (host, port). ValueError names anything else,
    another scheme included (``ipc://`` after ``tcp://`` too)."""
    rest = address.removeprefix("tcp://")
    if "://" in rest:
        raise ValueError(f"expected tcp://HOST:PORT or HOST:PORT, got {address!r}")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    if ":" in host and not host.startswith("["):
        raise ValueError(f"write an IPv6 address as [ADDR]:PORT, got {address!r}")
    return host, int(port)


def tcp_url(host: str, port: int) -> str:
    """The ZeroMQ URL of a ``tcp_address``."""
    return f"tcp://{host}:{port}"


def endpoint_of(address: str) -> str:
    """``HOST:PORT`` / ``[v6]:PORT`` / ``tcp://`` of either -> ``tcp://HOST:PORT``
    (``tcp_address``); ``ipc://`` and ``inproc://`` URLs pass unchanged."""
    if address.startswith(("ipc://", "inproc://")):
        return address
    return tcp_url(*tcp_address(address))


def _socket(
    kind: int, endpoint: str, max_frame: int, ctx: zmq.Context[zmq.Socket[bytes]] | None = None
) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close never waits for unsent messages
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
    return sock


class ControlClient:
    """Request/reply over one DEALER socket. Thread-safe: one call at a time."""

    endpoint: str
    _sock: zmq.Socket[bytes] | None  # None once closed
    _ids: itertools.count[int]  # request ids; never 0, never reused
    _lock: threading.Lock  # serialises calls; the socket is not thread-safe

    def __init__(
        self, endpoint: str, *, timeout_s: float = 30.0, curve: ClientKeys | None = None
    ) -> None:
        """``curve``: this client's key and the service's (``kvguard.curve``)."""
        self.endpoint = endpoint_of(endpoint)
        self.timeout_s = timeout_s
        self._curve = curve
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sock = None
        self._open()

    def _open(self) -> None:
        self._sock = _socket(zmq.DEALER, self.endpoint, MAX_REPLY_BYTES)
        if self._curve is not None:
            secure_client(self._sock, self._curve)
        self._sock.connect(self.endpoint)

    def request(
        self, body: bytes, *, timeout: float | None = None, alive: Liveness | None = None
    ) -> bytes:
        """Send one frame, return the reply frame to it; ServiceTimeout if none in time."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._lock:
            if self._sock is None:
                raise PeerProtocolError(f"control client for {self.endpoint} is closed")
            cid = _ID.pack(next(self._ids))
            deadline = time.monotonic() + timeout
            try:
                self._sock.send_multipart([cid, body], flags=zmq.NOBLOCK)
            except zmq.Again:
                # A timeout resets the socket, so no older request is queued:
                # a full queue takes none at all, the service is not taking
                # requests, and waiting out the deadline would change nothing.
                hwm = int(self._sock.getsockopt(zmq.SNDHWM))
                self._reset()
                raise ServiceTimeout(
                    f"{self.endpoint} is not taking requests: the send queue is full (SNDHWM {hwm})"
                ) from None
            while (left := deadline - time.monotonic()) > 0:
                if alive is not None:
                    alive()
                if not self._sock.poll(int(1000 * min(left, _SLICE_S)) + 1, zmq.POLLIN):
                    continue
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                if len(frames) == 2 and frames[0] == cid:
                    return frames[1]
                # A stale or foreign reply: never mistaken for this one's.
            self._reset()
            raise ServiceTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s")

    def _reset(self) -> None:
        """Reopen the socket, dropping queued requests and any late replies."""
        if self._sock is not None:
            self._sock.close()
        self._open()

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_R = TypeVar("_R", bound=Reply)


class DecodeClient:
    """The typed calls a prefill side makes to a decode service."""

    def __init__(
        self, endpoint: str, *, timeout_s: float = 30.0, curve: ClientKeys | None = None
    ) -> None:
        self.channel = ControlClient(endpoint, timeout_s=timeout_s, curve=curve)

    @property
    def endpoint(self) -> str:
        return self.channel.endpoint

    def call(
        self, req: Request, *, timeout: float | None = None, alive: Liveness | None = None
    ) -> Reply:
        """Send ``req``; return its reply, checked against ``REPLY_OF``.

        An ErrorReply, or a reply of the wrong kind, raises PeerProtocolError.
        """
        reply = self.call_raw(encode(req), timeout=timeout, alive=alive)
        if not isinstance(reply, REPLY_OF[type(req)]):
            raise PeerProtocolError(
                f"{self.endpoint}: {type(reply).__name__} in reply to {type(req).__name__}"
            )
        return reply

    def call_raw(
        self, body: bytes, *, timeout: float | None = None, alive: Liveness | None = None
    ) -> Reply:
        """Send ``body`` as one frame, unvalidated; the reply as ``call`` checks it."""
        reply = decode_reply(self.channel.request(body, timeout=timeout, alive=alive))
        if isinstance(reply, ErrorReply):
            raise PeerProtocolError(f"decode service error {reply.error}: {reply.message}")
        return reply

    def _typed(
        self, req: Request, kind: type[_R], timeout: float | None, alive: Liveness | None
    ) -> _R:
        reply = self.call(req, timeout=timeout, alive=alive)
        assert isinstance(reply, kind)  # call() checked it against REPLY_OF
        return reply

    def peer(self, *, timeout: float | None = None, alive: Liveness | None = None) -> PeerInfo:
        """What the service advertises, with its layout, regions and buffers checked."""
        reply = self.call(PeerRequest(), timeout=timeout, alive=alive)
        assert isinstance(reply, PeerMessage)
        return peer_info_of(reply)

    def checksums(
        self, blocks: list[int], *, timeout: float | None = None, alive: Liveness | None = None
    ) -> bytes:
        """DIGEST_SIZE bytes per block (``peer_protocol.block_digest_bytes``)."""
        reply = self._typed(ChecksumRequest(blocks), ChecksumReply, timeout, alive)
        if len(reply.digests) != DIGEST_SIZE * len(blocks):
            raise PeerProtocolError(
                f"{self.endpoint}: {len(reply.digests)} digest bytes for {len(blocks)} blocks"
            )
        return reply.digests

    def zero(self, *, timeout: float | None = None, alive: Liveness | None = None) -> None:
        self.call(ZeroRequest(), timeout=timeout, alive=alive)

    def ping(self, *, timeout: float | None = None, alive: Liveness | None = None) -> int:
        return self._typed(PingRequest(), PingReply, timeout, alive).pid

    def close(self) -> None:
        self.channel.close()


class ControlServer:
    """A ROUTER socket answering each request frame with ``handle(frame)``.

    ``handle`` must not raise: it turns every failure into an error reply.
    Malformed envelopes (no 8-byte id, extra frames) are dropped: only a
    kvguard client can be waiting for an answer, and it sends neither.
    """

    endpoint: str  # as bound: a tcp port of 0 is replaced by the real one

    def __init__(
        self, endpoint: str, handle: Callable[[bytes], bytes], curve: ServerKeys | None = None
    ) -> None:
        """``curve``: only clients holding an allowed key talk (``kvguard.curve``),
        on a context of its own (its ZAP handler judges no other socket)."""
        self._handle = handle
        url = endpoint_of(endpoint)  # ValueError before any socket exists
        self._ctx = None if curve is None else zmq.Context()
        self.guard = None if self._ctx is None or curve is None else Guard(self._ctx, curve)
        self._sock: zmq.Socket[bytes] | None = _socket(
            zmq.ROUTER, url, MAX_REQUEST_BYTES, self._ctx
        )
        if self.guard is not None:
            self.guard.secure(self._sock)
        # A reply ZeroMQ cannot route raises instead of vanishing, so serve()
        # can say which one it dropped and why.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(url)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot listen on {endpoint}: {exc}") from exc
        self.endpoint = str(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Answer requests until ``stop`` is set (checked every ``poll_s``)."""
        sock = self._sock
        if sock is None:
            raise RuntimeError("control server is closed")
        while not stop.is_set():
            try:
                if not sock.poll(int(1000 * poll_s), zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:  # readable, then not: nothing to answer
                continue
            if len(frames) != 3 or len(frames[1]) != _ID.size:
                _log.debug("malformed_envelope", frames=len(frames))
                continue
            ident, cid, body = frames
            reply = self._handle(body)
            try:
                # NOBLOCK: a client that stopped reading cannot stall the service.
                sock.send_multipart([ident, cid, reply], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno not in _DROPPED:
                    raise
                # The client gave up (a timed-out client reopens its socket)
                # or stopped reading: nobody waits for this reply.
                _log.debug("reply_dropped", why=_DROPPED[exc.errno], bytes=len(reply))

    def close(self) -> None:
        """Stop listening (an ipc socket file is removed). Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
