"""The decode side's driver: ZeroMQ sockets, monitors and probes around ``DecodeCore``.

``DecodeReceiver.expect(...)`` asks the prefill at ``endpoint`` to push its
request's KV into local blocks (registered with this side's Mooncake
engine). ``take_finished()`` then reports each expected load exactly once,
as loaded or as failed, and ``take_released()`` names a load reported
fenced once nothing of the prefill can write its blocks. Every decision is
``decode_core.DecodeCore``'s (its docstring says when each happens).

It only moves events in and actions out, on one thread that owns every
socket (a DEALER per prefill endpoint, with its monitor) and the core; the
engine's calls reach it through an ``Inbox`` that wakes its poll. It maps
ZeroMQ's monitor events to ``states.LinkEvent``, tells its own frames come
back (a TCP self-connect: nothing listens), and probes a lost prefill's
port with a TCP connect.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvguard.curve import ClientKeys, secure_client
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import PeerMessage

from .actions import Close, DecodeAction, LoadOutcome, Open, Probe, Report, Send, Unfence
from .decode_core import DecodeCore
from .idle import Bell
from .inbox import Inbox, poll_ms
from .integrity import Verifier
from .probe import gone
from .protocol import MAX_FRAME_BYTES, decode_from_decode, decode_from_prefill, encode
from .states import LinkEvent

__all__ = ["DecodeReceiver", "LoadOutcome"]

_log = structlog.get_logger("kvguard.vllm.receiver")

_POLL_MS: Final = 5  # the longest poll: the inbox and the core's timers wake it sooner
_RECENT: Final = 4096  # outcomes kept for inspection
# ZeroMQ's monitor events, as the core knows them.
_LINK_EVENTS: Final[dict[int, LinkEvent]] = {
    int(zmq.EVENT_HANDSHAKE_SUCCEEDED): LinkEvent.HANDSHAKE,
    int(zmq.EVENT_DISCONNECTED): LinkEvent.DROPPED,
    int(zmq.EVENT_CONNECT_RETRIED): LinkEvent.REFUSED,
    int(zmq.EVENT_CLOSED): LinkEvent.CLOSED,
    int(zmq.EVENT_CONNECTED): LinkEvent.CONNECTED,
    int(zmq.EVENT_CONNECT_DELAYED): LinkEvent.CONNECTING,
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): LinkEvent.HANDSHAKE_FAILED,
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): LinkEvent.HANDSHAKE_FAILED_PROTOCOL,
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): LinkEvent.DENIED,
}
_EVENTS: Final = sum(_LINK_EVENTS)


def _close(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    """Close a socket and its monitor, the monitor stopped first. libzmq's
    I/O thread sends monitor events blocking: one of the closing socket's
    own (its connection torn down) sent to a monitor already closed blocks
    that thread for good, and with it every socket of the context (seen:
    a link made after such a close never even dialled)."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    sock.close()
    monitor.close()


def _ours(body: bytes) -> bool:
    """Is ``body`` a message a decode sends (a frame we sent, come back)?"""
    try:
        decode_from_decode(body)
    except PeerProtocolError:
        return False
    return True


@dataclass(slots=True)
class _Socket:
    """The open DEALER of one link, and its monitor."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    gen: int  # the core's number for it


class DecodeReceiver:
    """Expect pushes from prefill senders; report each request once."""

    def __init__(
        self,
        peer: PeerMessage,
        *,
        heartbeat_s: float = 0.5,
        heartbeat_timeout_s: float = 3.0,
        margin_s: float = 0.25,
        compat: str = "",
        heads: tuple[int, int] = (0, 0),
        verify: Verifier | None = None,
        curve: ClientKeys | None = None,
        bell: str = "",
    ) -> None:
        """``peer``: what this side advertises (Mooncake session, layout,
        regions). ``margin_s``: the prefill is told to finish that much
        before this side's deadline, so its verdict arrives in time.
        ``compat``: this side's KV layout fingerprint, and ``heads`` (first,
        count) the KV heads its blocks hold, sent with each push. ``verify``
        checks each loaded Result's digest against this side's blocks
        (``integrity``); None loads unverified. ``curve``: this decode's key
        and the prefills' (``kvguard.curve``). ``bell``: the engine core's
        doorbell (``idle``), rung whenever a load is ready to take."""
        self._curve = curve
        self.peer = peer
        self._core = DecodeCore(
            peer,
            stall_s=heartbeat_timeout_s,  # no handshake this long after a connect or drop
            margin_s=margin_s,
            compat=compat,
            heads=heads,
            verify=verify is not None,
        )
        self._verifier = verify  # receiver thread only
        self._hb_ms = max(1, int(heartbeat_s * 1000))
        self._hb_timeout_ms = max(1, int(heartbeat_timeout_s * 1000))
        self._inbox: Inbox[tuple[str, tuple[object, ...]]] = Inbox()
        self._lock = threading.Lock()
        self._finished: list[LoadOutcome] = []  # (L) not yet taken
        self._unfenced: list[str] = []  # (L) fenced loads nothing writes any more
        self.outcomes: OrderedDict[str, LoadOutcome] = OrderedDict()  # (L) the last _RECENT
        self._socks: dict[str, _Socket] = {}  # receiver thread only
        self._poller = zmq.Poller()  # receiver thread only
        self._poller.register(self._inbox, zmq.POLLIN)  # never an empty poll
        self.steps = 0  # receiver thread loop turns (a few hundred a second at most)
        # Its own context: its I/O thread has this thread's CPUs (transfer.affinity).
        self._ctx = zmq.Context()
        self._bell = Bell(self._ctx, bell)  # receiver thread only
        self._identity = f"kvguard-decode-{uuid.uuid4().hex}".encode()
        self._monitors = 0  # monitor endpoints made (receiver thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-vllm-receiver", daemon=True)
        self._thread.start()

    def expect(
        self,
        request_id: str,
        endpoint: str,
        remote_id: str,
        blocks: Sequence[int],
        deadline: float,
        group: int = 1,
        part: tuple[int, int] | None = None,
    ) -> None:
        """Ask ``endpoint`` to push ``remote_id`` into ``blocks``; end by
        ``deadline``. ``group``: loads of ``remote_id`` asked for together
        (n > 1), so the prefill holds its blocks until all have asked.
        ``part``: (offset, length) of each block the prefill writes (a
        tensor parallel leg's heads), None for whole blocks."""
        self._inbox.put(
            ("expect", (request_id, endpoint, remote_id, list(blocks), deadline, group, part))
        )

    def cancel(self, request_id: str) -> None:
        """The engine gave up on ``request_id``: ask the prefill to stop. It is
        still reported once, when the prefill confirms (its blocks may be
        written to until then)."""
        self._inbox.put(("cancel", (request_id,)))

    def renew(self, endpoint: str, remote_id: str) -> None:
        """A request that will load ``remote_id`` still queues: keep it held."""
        self._inbox.put(("renew", (endpoint, remote_id)))

    def forget(self, endpoint: str, remote_id: str, group: int = 1) -> None:
        """Tell a prefill one decode request of ``remote_id``'s group (of
        ``group`` as the client declared it) will never ask for it."""
        self._inbox.put(("forget", (endpoint, remote_id, group)))

    def take_finished(self) -> list[LoadOutcome]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def take_released(self) -> list[str]:
        """Loads reported fenced whose blocks nothing can write any more; each once."""
        with self._lock:
            out, self._unfenced = self._unfenced, []
        return out

    def recent_outcomes(self) -> list[LoadOutcome]:
        """The last outcomes reported, oldest first (a copy)."""
        with self._lock:
            return list(self.outcomes.values())

    def links(self) -> int:
        """Prefill endpoints with an open socket (for inspection and tests)."""
        return len(self._socks)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread, which closes its inbox, sockets and context as it ends."""
        self._stop.set()
        self._inbox.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.error("receiver_thread_not_ended", timeout_s=timeout)

    # -- the receiver thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception:
                    _log.exception("receiver_loop_error")
        finally:
            for s in self._socks.values():
                _close(s.sock, s.monitor)
            self._bell.close()
            self._inbox.close()
            self._ctx.term()

    def _turn(self) -> None:
        wait_ms = poll_ms(self._core.next_wake(), time.monotonic(), _POLL_MS)
        ready = dict(self._poller.poll(wait_ms))
        for kind, args in self._inbox.drain():
            self._command(kind, args)
        self.steps += 1
        for endpoint, s in list(self._socks.items()):
            if ready.get(s.monitor):
                self._monitor(endpoint, s)
            if ready.get(s.sock) and self._socks.get(endpoint) is s:
                self._results(endpoint, s)
        now = time.monotonic()
        wake = self._core.next_wake()
        if wake is not None and wake <= now:
            self._apply(self._core.step(now))

    def _command(self, kind: str, args: tuple[object, ...]) -> None:
        core, now = self._core, time.monotonic()
        if kind == "expect":
            rid, endpoint, remote_id, blocks, deadline, group, part = args
            assert isinstance(rid, str) and isinstance(remote_id, str)
            assert isinstance(endpoint, str) and isinstance(blocks, list)
            assert isinstance(deadline, float) and isinstance(group, int)
            assert part is None or isinstance(part, tuple)
            if self._verifier is not None:
                self._verifier.expect(rid, blocks, part)
            acts = core.expect(rid, endpoint, remote_id, blocks, deadline, group, now, time.time())
        elif kind == "cancel":
            (rid,) = args
            assert isinstance(rid, str)
            acts = core.cancel(rid, now)
        elif kind == "forget":
            endpoint, remote_id, group = args
            assert isinstance(endpoint, str) and isinstance(remote_id, str)
            assert isinstance(group, int)
            acts = core.forget(endpoint, remote_id, now, group)
        else:
            endpoint, remote_id = args
            assert isinstance(endpoint, str) and isinstance(remote_id, str)
            acts = core.renew(endpoint, remote_id, now)
        self._apply(acts)

    def _apply(self, actions: list[DecodeAction]) -> None:
        """Carry out the core's actions, and those their outcomes bring."""
        todo = list(reversed(actions))
        while todo:
            act = todo.pop()
            more: list[DecodeAction] = []
            if isinstance(act, Send):
                s = self._socks.get(act.endpoint)
                if s is not None:
                    try:
                        s.sock.send(encode(act.msg), flags=zmq.NOBLOCK)
                    except zmq.ZMQError as exc:  # queue full: the deadline or the monitor ends it
                        _log.info("send_failed", error=str(exc))
            elif isinstance(act, Open):
                more = self._dial(act)
            elif isinstance(act, Close):
                self._drop(act.endpoint)
            elif isinstance(act, Probe):
                more = self._core.probed(act.endpoint, gone(act.endpoint), time.monotonic())
            elif isinstance(act, Report):
                self._report(act.outcome)
            elif isinstance(act, Unfence):
                with self._lock:
                    self._unfenced.append(act.request_id)
                self._bell.ring()
            todo.extend(reversed(more))

    def _dial(self, act: Open) -> list[DecodeAction]:
        """Open the core's socket ``act.gen``; the old one (a stalled link's)
        closes only once the new one is made."""
        endpoint, now = act.endpoint, time.monotonic()
        try:
            sock, monitor = self._open(endpoint)
        except zmq.ZMQError as exc:
            return self._core.open_failed(endpoint, act.gen, str(exc), now)
        self._drop(endpoint)
        self._socks[endpoint] = _Socket(sock, monitor, act.gen)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        return self._core.opened(endpoint, act.gen, now)

    def _open(self, endpoint: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A new DEALER connecting to ``endpoint``, and its monitor (ZMQError:
        nothing was made)."""
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb_timeout_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb_timeout_ms)
            sock.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
            if self._curve is not None:
                secure_client(sock, self._curve)
            # One identity across reconnects: the prefill's ROUTER hands the
            # new connection over and its late Results reach us.
            sock.setsockopt(zmq.ROUTING_ID, self._identity)
            # A name of its own: pyzmq's default derives it from the socket's
            # fd, which the kernel reuses once a socket closes, so a new
            # monitor could name the endpoint of one still being torn down.
            self._monitors += 1
            addr = f"inproc://kvguard-monitor-{self._identity.decode()}-{self._monitors}"
            monitor = sock.get_monitor_socket(_EVENTS, addr=addr)
        except zmq.ZMQError:
            sock.close()
            raise
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            _close(sock, monitor)
            raise
        return sock, monitor

    def _drop(self, endpoint: str) -> None:
        """Close a link's socket with whatever it still queued (LINGER 0)."""
        s = self._socks.pop(endpoint, None)
        if s is not None:
            self._poller.unregister(s.sock)
            self._poller.unregister(s.monitor)
            _close(s.sock, s.monitor)

    def _monitor(self, endpoint: str, s: _Socket) -> None:
        while self._socks.get(endpoint) is s:
            try:
                event = recv_monitor_message(s.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = _LINK_EVENTS.get(int(event["event"]))
            if ev is not None:
                self._apply(self._core.link_event(endpoint, s.gen, ev, time.monotonic()))

    def _results(self, endpoint: str, s: _Socket) -> None:
        while self._socks.get(endpoint) is s:
            try:
                body = s.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            try:
                res = decode_from_prefill(body)
            except PeerProtocolError as exc:
                if _ours(body):  # our own message came back: connected to itself
                    self._apply(self._core.echoed(endpoint, s.gen, now))
                else:
                    _log.warning("bad_prefill_message", endpoint=endpoint, error=str(exc))
                continue
            if self._verifier is not None:
                res = self._verifier.checked(res)
            self._apply(self._core.result(endpoint, res, now))

    def _report(self, out: LoadOutcome) -> None:
        if self._verifier is not None:
            self._verifier.done(out.request_id)
        if not out.ok:
            _log.warning(
                "kv_load_failed",
                request=out.request_id,
                reason=out.reason,
                detail=out.detail,
                fenced=out.fenced,
            )
        with self._lock:
            self._finished.append(out)
            self.outcomes[out.request_id] = out
            while len(self.outcomes) > _RECENT:
                self.outcomes.popitem(last=False)
        self._bell.ring()
