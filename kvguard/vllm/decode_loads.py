"""The decode side: ask a prefill to push, never wait past the deadline,
and never let a block go back while the prefill may still write it.

``DecodeReceiver.expect(...)`` asks the prefill at ``endpoint`` to push its
request's KV into local blocks (registered with this side's Mooncake
engine). ``take_finished()`` then reports each expected load exactly once,
as loaded or as failed, at the first of:

* the prefill's ``Result`` for this load -- sent only once nothing of the
  prefill writes its blocks (kvguard released the transfer: terminal AND
  quiesced, or it never started);
* proof the prefill is gone: nothing listens on its control port (a plain
  TCP connect is refused, or connects to itself, which the kernel does only
  where nothing listens; a killed process's socket closes with it, while a
  stopped one's port still accepts);
* its deadline, or the prefill falling silent (its connection drops: a
  kill, or ZeroMQ heartbeats unanswered for ``heartbeat_timeout_s``: a
  frozen or partitioned process). These are *fenced* outcomes: the prefill
  may still write the blocks (a frozen one writes on thaw), so the load is
  named again by ``take_released()`` once its ``Result`` or the proof
  arrives; until then its blocks must stay out of circulation.

One ``kvguard-vllm-receiver`` thread owns every socket (one DEALER per
prefill endpoint, with its monitor); the engine's calls reach it through a
queue. A link whose prefill refused the connection is closed with whatever
it still queued (a prefill started later on that port gets none of it), a
link with no handshake ``heartbeat_timeout_s`` after its connect or its drop
(accepted, never answered) connects again and asks again, waiting twice as
long each time, and a link idle for ``IDLE_LINK_S`` is closed.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvguard.decode.control import endpoint_of
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import PeerMessage

from .protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Push,
    Renew,
    Result,
    decode_from_decode,
    decode_from_prefill,
    encode,
)

__all__ = ["DecodeReceiver", "LoadOutcome", "prefill_url"]

_log = structlog.get_logger("kvguard.vllm.receiver")

_POLL_MS: Final = 5
_RECENT: Final = 4096  # outcomes kept for inspection
IDLE_LINK_S: Final = 60.0  # a link with no load this long is closed
# A lost link's prefill is probed this often: a plain TCP connect to its
# control port, refused only when nothing listens (a stopped process's port
# still accepts, so ZeroMQ's own retries prove nothing).
_PROBE_EVERY_S: Final = 0.5
_PROBE_TIMEOUT_S: Final = 0.2
# A stalled link's wait before it is made again doubles up to 2**this times
# ``heartbeat_timeout_s``.
_MAX_BACKOFF_DOUBLINGS: Final = 4
# The events that change a link; the others are only noted (``last_event``).
_EVENTS_ACTED_ON: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_CLOSED
)
_EVENTS: Final = (
    _EVENTS_ACTED_ON
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
_EVENT_WORDS: Final[dict[int, str]] = {
    int(zmq.EVENT_DISCONNECTED): "connection dropped",
    int(zmq.EVENT_CONNECT_RETRIED): "connection refused",
    int(zmq.EVENT_CLOSED): "connection refused or closed",
    int(zmq.EVENT_CONNECTED): "connected",
    int(zmq.EVENT_CONNECT_DELAYED): "connecting",
    int(zmq.EVENT_HANDSHAKE_SUCCEEDED): "handshake done",
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake failed",
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake failed (protocol)",
}


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


def _echoes(sock: socket.socket) -> bool:
    """Does what ``sock`` sends come back to it? Only on a socket connected
    to itself: equal addresses alone can also be a NAT hairpin to a live
    (perhaps frozen) listener, which sends nothing back."""
    nonce = uuid.uuid4().bytes
    try:
        sock.sendall(nonce)
        got = b""
        while len(got) < len(nonce):
            part = sock.recv(len(nonce) - len(got))
            if not part:
                return False
            got += part
    except OSError:  # a timeout included: nothing came back
        return False
    return got == nonce


def prefill_url(endpoint: str) -> str:
    """A prefill's control endpoint from a request's parameters (untrusted):
    ``tcp://HOST:PORT`` or ``HOST:PORT`` only; ValueError names anything else
    (an ``inproc://`` or ``ipc://`` link would never report a drop, so its
    loads could stay fenced for good)."""
    rest = endpoint.removeprefix("tcp://")
    if "://" in rest:
        raise ValueError(f"expected tcp://HOST:PORT or HOST:PORT, got {endpoint!r}")
    return endpoint_of(rest)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one expected load ended on this side."""

    request_id: str
    ok: bool
    reason: str  # "" when ok; else timeout, peer_lost, or the prefill's reason
    detail: str
    latency_s: float  # expect() -> this outcome
    # Failed with no word from the prefill: it may still write the blocks.
    # ``take_released()`` names the request once nothing can.
    fenced: bool = False


@dataclass(slots=True)
class _Wait:
    endpoint: str
    remote_id: str
    deadline: float  # time.monotonic()
    started: float
    push: bytes  # what asked for it, sent again on a new link (_reconnect)
    asked: float = 0.0  # time.monotonic() of the last Abort: given up, asked again until answered
    reported: bool = False  # the engine has a fenced outcome; the verdict releases it
    cancelled: bool = False  # the engine gave up; the verdict reports it


@dataclass(slots=True)
class _Link:
    """One prefill endpoint: its DEALER socket and what its monitor said."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    up: bool = False  # a ZMTP handshake succeeded and no drop since
    lost: bool = False  # dropped since the last handshake: what we asked may be lost
    # Nothing sent for these waits can have reached the prefill unless this
    # socket's monitor says so (a handshake). False on a link that replaced
    # a stalled one: the old socket's handshake may have happened unseen, so
    # a drop before this one's handshake proves nothing; only a refusal does.
    fresh: bool = True
    waits: set[str] = field(default_factory=set)  # local ids awaiting this prefill's verdict
    used: float = 0.0  # time.monotonic() of the last expect
    # time.monotonic() of the connect or the drop: a link not up long after
    # either is stalled (ZeroMQ's own reconnects can hang, unanswered, for good)
    down_since: float = 0.0
    stalls: int = 0  # connects in a row that never came up; each waits twice as long
    last_event: str = "none"  # the monitor's latest word, for a stalled link's log
    probe_at: float = 0.0  # lost: when to probe the prefill's port next


class DecodeReceiver:
    """Expect pushes from prefill senders; report each request once."""

    def __init__(
        self,
        peer: PeerMessage,
        *,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 3.0,
        margin_s: float = 0.25,
        compat: str = "",
        heads: tuple[int, int] = (0, 0),
    ) -> None:
        """``peer``: what this side advertises (Mooncake session, layout,
        regions). ``margin_s``: the prefill is told to finish that much
        before this side's deadline, so its verdict arrives in time.
        ``compat``: this side's KV layout fingerprint, and ``heads`` (first,
        count) the KV heads its blocks hold, sent with each push."""
        self._peer = peer
        self._compat = compat
        self._heads = heads
        self._hb_ms = max(1, int(heartbeat_s * 1000))
        self._hb_timeout_ms = max(1, int(heartbeat_timeout_s * 1000))
        # A link with no handshake this long after its connect or its drop is
        # stalled (on a live network one takes milliseconds; a refusal is an
        # event); each stall in a row doubles it (_stalled).
        self._stall_s = heartbeat_timeout_s
        self._margin_s = margin_s
        self._inbox: queue.SimpleQueue[tuple[str, tuple[object, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[LoadOutcome] = []  # (L) not yet taken
        self._unfenced: list[str] = []  # (L) fenced loads nothing writes any more
        self.outcomes: OrderedDict[str, LoadOutcome] = OrderedDict()  # (L) the last _RECENT
        self._links: dict[str, _Link] = {}  # receiver thread only
        self._waits: dict[str, _Wait] = {}  # receiver thread only
        self.steps = 0  # receiver thread loop turns (a few hundred a second at most)
        # Its own context: its I/O thread starts here, with this thread's CPUs
        # (transfer.affinity), and never shares the host's ZeroMQ I/O thread.
        self._ctx = zmq.Context()
        self._identity = f"kvguard-decode-{uuid.uuid4().hex}".encode()
        self._monitors = 0  # monitor endpoints made (receiver thread only)
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
        group: int = 1,
    ) -> None:
        """Ask ``endpoint`` to push ``remote_id`` into ``blocks``; end by
        ``deadline``. ``group``: loads of ``remote_id`` asked for together
        (n > 1), so the prefill holds its blocks until all have asked."""
        self._inbox.put(
            ("expect", (request_id, endpoint, remote_id, list(blocks), deadline, group))
        )

    def cancel(self, request_id: str) -> None:
        """The engine gave up on ``request_id``: ask the prefill to stop. It is
        still reported once, when the prefill confirms or at the deadline (its
        blocks may be written to until then)."""
        self._inbox.put(("cancel", (request_id,)))

    def renew(self, endpoint: str, remote_id: str) -> None:
        """A request that will load ``remote_id`` still queues: keep it held."""
        self._inbox.put(("renew", (endpoint, remote_id)))

    def forget(self, endpoint: str, remote_id: str) -> None:
        """Tell a prefill its request will never be asked for (free it now)."""
        self._inbox.put(("forget", (endpoint, remote_id)))

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
        return len(self._links)

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
                _close(link.sock, link.monitor)
            self._ctx.term()

    def _step(self, poller: zmq.Poller) -> None:
        if not self._links:
            # ZeroMQ's poll returns at once with nothing to poll (a busy loop
            # holding the GIL the engine's thread needs): wait on the inbox.
            with contextlib.suppress(queue.Empty):
                self._command(poller, *self._inbox.get(timeout=_POLL_MS / 1000))
        while True:
            try:
                kind, args = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._command(poller, kind, args)
        ready = dict(poller.poll(_POLL_MS)) if self._links else {}
        self.steps += 1
        for endpoint, link in list(self._links.items()):
            if ready.get(link.monitor):
                self._monitor(poller, endpoint, link)
            if ready.get(link.sock) and endpoint in self._links:
                self._results(poller, endpoint, link)
        self._expire(poller, time.monotonic())

    def _link(self, poller: zmq.Poller, endpoint: str) -> _Link:
        link = self._links.get(endpoint)
        if link is None:
            link = self._open(endpoint)
            self._add_link(poller, endpoint, link)
        return link

    def _open(self, endpoint: str) -> _Link:
        """A new DEALER connecting to ``endpoint``, with its monitor (ZMQError:
        nothing was made)."""
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, self._hb_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._hb_timeout_ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, self._hb_timeout_ms)
            sock.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
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
        now = time.monotonic()
        return _Link(sock, monitor, used=now, down_since=now)

    def _add_link(self, poller: zmq.Poller, endpoint: str, link: _Link) -> None:
        self._links[endpoint] = link
        poller.register(link.sock, zmq.POLLIN)
        poller.register(link.monitor, zmq.POLLIN)

    def _drop_link(self, poller: zmq.Poller, endpoint: str) -> None:
        """Close a link with whatever it still queued (LINGER 0)."""
        link = self._links.pop(endpoint)
        _log.info("prefill_link_closed", endpoint=endpoint, up=link.up, lost=link.lost)
        poller.unregister(link.sock)
        poller.unregister(link.monitor)
        _close(link.sock, link.monitor)

    def _command(self, poller: zmq.Poller, kind: str, args: tuple[object, ...]) -> None:
        if kind == "expect":
            rid, endpoint, remote_id, blocks, deadline, group = args
            assert isinstance(rid, str) and isinstance(remote_id, str)
            assert isinstance(endpoint, str) and isinstance(blocks, list)
            assert isinstance(deadline, float) and isinstance(group, int)
            now = time.monotonic()
            if rid in self._waits:
                # The engine reused an id still loading: one outcome per id, the first's.
                _log.error("expect_duplicate", request=rid, remote=remote_id)
                return
            left = deadline - now - self._margin_s
            if left <= 0:
                self._report(
                    LoadOutcome(rid, False, "timeout", "deadline passed before asking", 0.0)
                )
                return
            first, count = self._heads
            push = Push(
                remote_id,
                rid,
                blocks,
                self._peer,
                time.time() + left,
                self._compat,
                group,
                first,
                count,
            )
            body = encode(push)
            try:
                decode_from_decode(body)  # the prefill's own checks (ids, bounds)
                url = prefill_url(endpoint)
                link = self._link(poller, url)
            except PeerProtocolError as exc:  # nothing was sent
                self._report(LoadOutcome(rid, False, "bad_request", str(exc)[:1024], 0.0))
                return
            except (ValueError, zmq.ZMQError) as exc:
                self._report(LoadOutcome(rid, False, "bad_endpoint", f"{endpoint!r}: {exc}", 0.0))
                return
            self._waits[rid] = _Wait(url, remote_id, deadline, now, body)
            link.used = now
            link.waits.add(rid)
            self._send(link, body)
        elif kind == "cancel":
            (rid,) = args
            assert isinstance(rid, str)
            wait = self._waits.get(rid)
            if wait is not None and not wait.cancelled and not wait.reported:
                wait.cancelled = True
                self._abort(poller, rid, wait)
        elif kind in ("forget", "renew"):
            endpoint, remote_id = args
            assert isinstance(endpoint, str) and isinstance(remote_id, str)
            try:
                link = self._link(poller, prefill_url(endpoint))
            except (ValueError, zmq.ZMQError):
                return  # its load, if any, was refused as bad_endpoint
            msg = Abort(remote_id) if kind == "forget" else Renew(remote_id)
            self._send(link, encode(msg))

    def _abort(self, poller: zmq.Poller, rid: str, wait: _Wait) -> None:
        link = self._links.get(wait.endpoint)
        if link is not None:
            wait.asked = time.monotonic()
            self._send(link, encode(Abort(wait.remote_id, rid)))

    def _send(self, link: _Link, body: bytes) -> None:
        try:
            link.sock.send(body, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # queue full: the deadline or the monitor ends it
            _log.info("send_failed", error=str(exc))

    def _monitor(self, poller: zmq.Poller, endpoint: str, link: _Link) -> None:
        while True:
            try:
                event = recv_monitor_message(link.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = int(event["event"])
            link.last_event = _EVENT_WORDS.get(ev, f"event {ev}")
            what = f"prefill {endpoint}: {link.last_event}"
            if ev == zmq.EVENT_CONNECTED:
                continue  # TCP only: nothing flows before the handshake
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                _log.info(
                    "prefill_link_up", endpoint=endpoint, was_lost=link.lost, waits=len(link.waits)
                )
                if link.lost or not link.fresh:
                    # What we asked may be lost: ask again for every verdict
                    # we gave up on (pushes sent since are queued on this
                    # socket and arrive now).
                    for rid in link.waits:
                        wait = self._waits[rid]
                        if wait.reported or wait.cancelled:
                            self._abort(poller, rid, wait)
                link.up, link.lost, link.fresh, link.stalls = True, False, True, 0
                continue
            if not ev & _EVENTS_ACTED_ON or link.lost:
                continue  # a lost link waits for its handshake or a probe (_expire)
            if link.up and ev != zmq.EVENT_DISCONNECTED:
                continue  # only a drop ends an up link's session
            if not link.up and link.fresh:
                # Never connected: nothing we sent was delivered (messages
                # flow only after a handshake), and closing the link drops
                # what it queued, so no prefill started later gets it. (Not
                # on a replaced link, whatever the event: a failed DNS look-up
                # or socket() reads as "retried" too, and is no refusal.)
                self._drop_all(poller, endpoint, link, what)
                return
            # Dropped: killed, or silent (frozen, partitioned), or a replaced
            # link's drop before its handshake. Not proof: a frozen prefill
            # writes on thaw; the loads stay fenced until its Result, or a
            # probe finds nothing listening (_expire).
            _log.info("prefill_link_lost", endpoint=endpoint, waits=len(link.waits))
            link.up, link.lost = False, True
            link.probe_at = link.down_since = time.monotonic()
            for rid in link.waits:
                self._give_up(rid, "peer_lost", what)

    def _reconnect(self, poller: zmq.Poller, endpoint: str, link: _Link, now: float) -> None:
        """A link with no handshake long after its connect or its drop:
        connect again, asking again for its pushes, and for the verdicts of
        its loads given up meanwhile. The old socket's handshake may happen
        unseen as it closes, so the new link is not ``fresh``: only the
        prefill's answer or a refusal frees a block."""
        self._monitor(poller, endpoint, link)  # what it said up to now
        if self._links.get(endpoint) is not link or not self._stalled(link, now):
            return  # it came up, dropped or was closed meanwhile
        _log.warning(
            "prefill_link_stalled",
            endpoint=endpoint,
            waits=len(link.waits),
            after_s=round(now - link.down_since, 3),
            last_event=link.last_event,
        )
        try:
            new = self._open(endpoint)  # before the old one closes: it keeps the waits
        except zmq.ZMQError as exc:
            _log.warning("prefill_link_reopen_failed", endpoint=endpoint, error=str(exc))
            link.down_since, link.stalls = now, link.stalls + 1
            return
        new.waits, new.used, new.fresh = link.waits, link.used, False
        new.lost, new.probe_at, new.stalls = link.lost, link.probe_at, link.stalls + 1
        self._drop_link(poller, endpoint)
        self._add_link(poller, endpoint, new)
        for rid in new.waits:
            wait = self._waits[rid]
            if wait.reported or wait.cancelled:
                self._abort(poller, rid, wait)
            else:
                self._send(new, wait.push)

    def _stalled(self, link: _Link, now: float) -> bool:
        """No handshake long after the connect (backing off: a peer that
        accepts and never answers is not dialled every few seconds for good)."""
        if link.up or not link.waits:
            return False
        backoff = 1 << min(link.stalls, _MAX_BACKOFF_DOUBLINGS)
        return now - link.down_since > self._stall_s * backoff

    def _drop_all(self, poller: zmq.Poller, endpoint: str, link: _Link, what: str) -> None:
        for rid in list(link.waits):
            self._over(rid, Result(self._waits[rid].remote_id, rid, False, "peer_lost", what))
        self._drop_link(poller, endpoint)

    def _results(self, poller: zmq.Poller, endpoint: str, link: _Link) -> None:
        while True:
            try:
                body = link.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                res = decode_from_prefill(body)
            except PeerProtocolError as exc:
                if _ours(body):
                    # Our own message came back: the link connected to
                    # itself (TCP self-connect: dialling a port nothing
                    # listens on, from that same port), so nothing listens.
                    what = f"prefill {endpoint}: connected to itself, nothing listens there"
                    self._drop_all(poller, endpoint, link, what)
                    return
                _log.warning("bad_prefill_message", endpoint=endpoint, error=str(exc))
                continue
            wait = self._waits.get(res.load_id)
            if wait is None or wait.endpoint != endpoint or wait.remote_id != res.request_id:
                _log.info("result_unexpected", endpoint=endpoint, load=res.load_id)
                continue  # not a load of ours on this link: it marks nothing
            self._over(res.load_id, res)

    def _probe(self, poller: zmq.Poller, endpoint: str, link: _Link, now: float) -> None:
        """Does anything listen at a lost prefill's port? Refused: nothing
        of that prefill can write any more."""
        link.probe_at = now + _PROBE_EVERY_S
        parts = urlsplit(endpoint)
        if parts.hostname is None or parts.port is None:
            return
        try:
            with socket.create_connection((parts.hostname, parts.port), _PROBE_TIMEOUT_S) as s:
                if s.getsockname() != s.getpeername() or not _echoes(s):
                    return  # something listens: perhaps the frozen prefill
        except ConnectionRefusedError:
            pass
        except OSError:
            return  # unreachable or slow: silent, not proof
        # Refused, or connected to itself (TCP self-connect), which happens
        # only where nothing listens.
        self._drop_all(poller, endpoint, link, f"prefill {endpoint}: connection refused")

    def _expire(self, poller: zmq.Poller, now: float) -> None:
        for rid, wait in self._waits.items():
            if wait.deadline <= now and not wait.reported and not wait.cancelled:
                self._abort(poller, rid, wait)  # answered once nothing writes its blocks
                self._give_up(rid, "timeout", "no verdict from the prefill by the deadline")
            elif (wait.reported or wait.cancelled) and now - wait.asked > self._stall_s:
                # A verdict can be lost on the way (the prefill replied while
                # our connection changed hands): ask again while the link is
                # up; the prefill answers every Abort, once nothing writes.
                link = self._links.get(wait.endpoint)
                if link is not None and link.up:
                    self._abort(poller, rid, wait)
        probed = False  # one probe a turn: an unreachable host's takes _PROBE_TIMEOUT_S
        for endpoint, link in list(self._links.items()):
            if link.lost and link.waits and link.probe_at <= now and not probed:
                self._probe(poller, endpoint, link, now)
                probed = True
            elif self._stalled(link, now):
                self._reconnect(poller, endpoint, link, now)
            elif not link.waits and now - link.used > IDLE_LINK_S:
                self._drop_link(poller, endpoint)

    def _give_up(self, rid: str, reason: str, detail: str) -> None:
        """Report ``rid`` failed now, fenced: its verdict comes later."""
        wait = self._waits[rid]
        if wait.reported or wait.cancelled:
            return
        wait.reported = True
        self._report(LoadOutcome(rid, False, reason, detail, time.monotonic() - wait.started, True))

    def _over(self, rid: str, res: Result) -> None:
        """Nothing of the prefill writes ``rid``'s blocks any more."""
        wait = self._waits.pop(rid)
        link = self._links.get(wait.endpoint)
        if link is not None:
            link.waits.discard(rid)
        if wait.reported:
            with self._lock:
                self._unfenced.append(rid)
            _log.info("kv_load_released", request=rid, reason=res.reason)
            return
        latency = time.monotonic() - wait.started
        self._report(LoadOutcome(rid, res.ok, "" if res.ok else res.reason, res.detail, latency))

    def _report(self, out: LoadOutcome) -> None:
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
