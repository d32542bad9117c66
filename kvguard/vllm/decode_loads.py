"""The decode side: ask a prefill to push, and never wait past the deadline.

``DecodeReceiver.expect(...)`` asks the prefill at ``endpoint`` to push its
request's KV into local blocks (registered with this side's Mooncake
engine). ``take_finished()`` then reports each expected request exactly
once, as loaded or as failed, at the first of:

* the prefill's ``Result`` -- sent only after kvguard released the blocks on
  its side (terminal AND quiesced), so no write follows it;
* the prefill's death: its TCP connection drops (ZeroMQ's monitor reports
  the disconnect within milliseconds of a kill), or it cannot be reached;
* its silence: ZeroMQ heartbeats unanswered for ``heartbeat_timeout_s``
  (a frozen process; its TCP connection stays up);
* the request's deadline.

One ``kvguard-vllm-receiver`` thread owns every socket (one DEALER per
prefill endpoint, with its monitor); the engine's calls reach it through a
queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvguard.decode.control import endpoint_of
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import PeerMessage

from .protocol import MAX_FRAME_BYTES, Abort, Push, decode_from_prefill, encode

__all__ = ["DecodeReceiver", "LoadOutcome"]

_log = structlog.get_logger("kvguard.vllm.receiver")

_POLL_MS: Final = 5
_RECENT: Final = 4096  # outcomes kept for inspection
_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CLOSED
)
_EVENT_WORDS: Final[dict[int, str]] = {
    int(zmq.EVENT_DISCONNECTED): "connection dropped",
    int(zmq.EVENT_CONNECT_RETRIED): "connection refused",
    int(zmq.EVENT_CLOSED): "connection refused or closed",
}


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one expected request ended on this side."""

    request_id: str
    ok: bool
    reason: str  # "" when ok; else timeout, peer_lost, or the prefill's reason
    detail: str
    latency_s: float  # expect() -> this outcome


@dataclass(slots=True)
class _Wait:
    endpoint: str
    remote_id: str
    deadline: float  # time.monotonic()
    started: float
    cancelled: bool = False


@dataclass(slots=True)
class _Link:
    """One prefill endpoint: its DEALER socket and what its monitor said."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    up: bool = False  # a ZMTP handshake succeeded and no drop since
    down: bool = False  # dropped or refused since the last handshake
    waits: dict[str, str] = field(default_factory=dict)  # remote id -> local id


class DecodeReceiver:
    """Expect pushes from prefill senders; report each request once."""

    def __init__(
        self,
        peer: PeerMessage,
        *,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 3.0,
        margin_s: float = 0.25,
    ) -> None:
        """``peer``: what this side advertises (Mooncake session, layout,
        regions). ``margin_s``: the prefill is told to finish that much
        before this side's deadline, so its verdict arrives in time."""
        self._peer = peer
        self._hb_ms = max(1, int(heartbeat_s * 1000))
        self._hb_timeout_ms = max(1, int(heartbeat_timeout_s * 1000))
        self._margin_s = margin_s
        self._inbox: queue.SimpleQueue[tuple[str, tuple[object, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[LoadOutcome] = []  # (L) not yet taken
        self.outcomes: OrderedDict[str, LoadOutcome] = OrderedDict()  # (L) the last _RECENT
        self._links: dict[str, _Link] = {}  # receiver thread only
        self._waits: dict[str, _Wait] = {}  # receiver thread only
        # Its own context: its I/O thread starts here, with this thread's CPUs
        # (transfer.affinity), and never shares the host's ZeroMQ I/O thread.
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-vllm-receiver", daemon=True)
        self._thread.start()

    # -- engine side -----------------------------------------------------------

    def expect(
        self,
        request_id: str,
        endpoint: str,
        remote_id: str,
        blocks: Sequence[int],
        deadline: float,
    ) -> None:
        """Ask ``endpoint`` to push ``remote_id`` into ``blocks``; end by ``deadline``."""
        self._inbox.put(("expect", (request_id, endpoint, remote_id, list(blocks), deadline)))

    def cancel(self, request_id: str) -> None:
        """The engine gave up on ``request_id``: ask the prefill to stop. It is
        still reported once, when the prefill confirms or at the deadline (its
        blocks may be written to until then)."""
        self._inbox.put(("cancel", (request_id,)))

    def forget(self, endpoint: str, remote_id: str) -> None:
        """Tell a prefill its request will never be asked for (free it now)."""
        self._inbox.put(("forget", (endpoint, remote_id)))

    def take_finished(self) -> list[LoadOutcome]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # -- the receiver thread ---------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                try:
                    self._step(poller)
                except Exception:
                    _log.exception("receiver_loop_error")
        finally:
            for link in self._links.values():
                link.sock.close()
                link.monitor.close()
            self._ctx.term()

    def _step(self, poller: zmq.Poller) -> None:
        while True:
            try:
                kind, args = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._command(poller, kind, args)
        ready = dict(poller.poll(_POLL_MS))
        for endpoint, link in list(self._links.items()):
            if ready.get(link.monitor):
                self._monitor(endpoint, link)
            if ready.get(link.sock):
                self._results(endpoint, link)
        self._expire(time.monotonic())

    def _link(self, poller: zmq.Poller, endpoint: str) -> _Link:
        link = self._links.get(endpoint)
        if link is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb_timeout_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb_timeout_ms)
            sock.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
            monitor = sock.get_monitor_socket(_EVENTS)
            sock.connect(endpoint)
            link = _Link(sock, monitor)
            self._links[endpoint] = link
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        return link

    def _command(self, poller: zmq.Poller, kind: str, args: tuple[object, ...]) -> None:
        if kind == "expect":
            rid, endpoint, remote_id, blocks, deadline = args
            assert isinstance(rid, str) and isinstance(remote_id, str)
            assert isinstance(endpoint, str) and isinstance(blocks, list)
            assert isinstance(deadline, float)
            now = time.monotonic()
            self._waits[rid] = _Wait(endpoint, remote_id, deadline, now)
            try:
                url = endpoint_of(endpoint)
            except ValueError as exc:
                self._finish(rid, False, "bad_endpoint", str(exc))
                return
            self._waits[rid].endpoint = url
            link = self._link(poller, url)
            if link.down:
                self._finish(rid, False, "peer_lost", f"prefill {url} is unreachable")
                return
            left = deadline - now - self._margin_s
            if left <= 0:
                self._finish(rid, False, "timeout", "deadline passed before asking")
                return
            link.waits[remote_id] = rid
            self._send(link, encode(Push(remote_id, blocks, self._peer, left)))
        elif kind == "cancel":
            (rid,) = args
            assert isinstance(rid, str)
            wait = self._waits.get(rid)
            if wait is not None and not wait.cancelled:
                wait.cancelled = True
                self._send(self._link(poller, wait.endpoint), encode(Abort(wait.remote_id)))
        elif kind == "forget":
            endpoint, remote_id = args
            assert isinstance(endpoint, str) and isinstance(remote_id, str)
            try:
                url = endpoint_of(endpoint)
            except ValueError:
                return
            self._send(self._link(poller, url), encode(Abort(remote_id)))

    def _send(self, link: _Link, body: bytes) -> None:
        try:
            link.sock.send(body, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # queue full: the deadline or the monitor ends it
            _log.info("send_failed", error=str(exc))

    def _monitor(self, endpoint: str, link: _Link) -> None:
        while True:
            try:
                event = recv_monitor_message(link.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = event["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.up, link.down = True, False
                continue
            if ev == zmq.EVENT_CONNECT_RETRIED and link.up:
                continue  # a stale retry report from before the handshake
            # Disconnected (a kill closes the socket; unanswered heartbeats
            # close it too) or refused: nothing in flight to it can complete.
            link.up, link.down = False, True
            what = _EVENT_WORDS.get(int(ev), f"event {ev}")
            for remote_id, rid in list(link.waits.items()):
                del link.waits[remote_id]
                self._finish(rid, False, "peer_lost", f"prefill {endpoint}: {what}")

    def _results(self, endpoint: str, link: _Link) -> None:
        while True:
            try:
                body = link.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                res = decode_from_prefill(body)
            except PeerProtocolError as exc:
                _log.warning("bad_prefill_message", endpoint=endpoint, error=str(exc))
                continue
            rid = link.waits.pop(res.request_id, None)
            if rid is not None:
                self._finish(rid, res.ok, res.reason, res.detail)

    def _expire(self, now: float) -> None:
        for rid, wait in list(self._waits.items()):
            if wait.deadline <= now:
                link = self._links.get(wait.endpoint)
                if link is not None:
                    link.waits.pop(wait.remote_id, None)
                    if not wait.cancelled:  # best effort: let the prefill free it now
                        self._send(link, encode(Abort(wait.remote_id)))
                self._finish(rid, False, "timeout", "no verdict from the prefill by the deadline")

    def _finish(self, rid: str, ok: bool, reason: str, detail: str) -> None:
        wait = self._waits.pop(rid, None)
        if wait is None:
            return
        out = LoadOutcome(rid, ok, "" if ok else reason, detail, time.monotonic() - wait.started)
        if not ok:
            _log.warning("kv_load_failed", request=rid, reason=reason, detail=detail)
        with self._lock:
            self._finished.append(out)
            self.outcomes[rid] = out
            while len(self.outcomes) > _RECENT:
                self.outcomes.popitem(last=False)
