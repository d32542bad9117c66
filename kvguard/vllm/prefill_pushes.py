"""The prefill side: hold finished requests' blocks, push them when asked.

``PrefillSender`` is driven by two parties:

* the serving engine (vLLM's worker, any thread): ``hold(request, blocks,
  deadline)`` when a request finished prefill and its blocks must wait for a
  decode, and ``take_released()`` each step, for the requests whose blocks
  the engine may free now;
* decode sides, over ZeroMQ (``protocol``): ``Push`` asks to write a held
  request's KV into the decode's blocks, ``Abort`` says it will not.

Every held request ends in exactly one release, and only once nothing can
touch its blocks any more (invariant I6):

* pushed: a kvguard ``Scheduler`` request; released by kvguard's release
  callback, which runs after the request is terminal AND every engine call
  on its blocks has quiesced. The decode gets its ``Result`` then.
* never asked for by its deadline, aborted by the decode before a push, or a
  push refused before anything was submitted: released at once, no engine
  call ever touched the blocks.

A ``Push`` may overtake the engine's ``hold`` (vLLM tells the worker one
step after the client already has the request's parameters): it waits, until
the hold arrives or the push's own deadline passes.

Threads: one ``kvguard-vllm-sender`` thread owns the ROUTER socket; kvguard's
own threads run the transfers and the release callbacks. Shared state is
under ``_lock``; no engine call and no socket call happens under it.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import structlog
import zmq

from kvguard.decode.control import endpoint_of
from lifecycle import TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from transfer import PeerInfo, TransferBackend
from transfer.cache import KVCache
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import peer_info_of

from .protocol import MAX_FRAME_BYTES, Abort, Push, Result, decode_from_decode, encode, truncate

__all__ = ["PrefillSender", "SenderStats"]

_log = structlog.get_logger("kvguard.vllm.sender")

_POLL_MS: Final = 5  # how often the thread looks at deadlines and its outbox
_RECENT: Final = 4096  # finished ids remembered to answer a late push
# A push may arrive before the engine's hold (one engine step later); it
# waits this long at most, and at most this many wait at once.
_EARLY_WAIT_S: Final = 10.0
_MAX_EARLY: Final = 4096


@dataclass(slots=True)
class _Held:
    blocks: list[int]
    deadline: float  # time.monotonic(); the hold ends then if no push started
    pushed: bool = False  # a kvguard request exists; only its release ends the hold
    ident: bytes | None = None  # the decode's ROUTER identity, for the Result


@dataclass(slots=True)
class SenderStats:
    held: int = 0
    pushed: int = 0
    done: int = 0
    failed: int = 0
    expired: int = 0  # no decode asked before the deadline
    aborted: int = 0  # the decode said it would not ask
    refused: int = 0  # a push that could not be submitted
    by_reason: dict[str, int] = field(default_factory=dict)


class PrefillSender:
    """Holds prefill blocks for decodes and pushes them through kvguard."""

    endpoint: str  # where decodes connect (tcp://host:port, the real port)

    def __init__(
        self,
        backend: TransferBackend,
        cache: KVCache,
        bind: str,
        *,
        peer_backends: Sequence[TransferBackend] = (),
        workers: int = 4,
        retry: RetryPolicy | None = None,
    ) -> None:
        """``backend`` moves the bytes (it may wrap the engine, e.g. to inject
        faults); ``peer_backends`` also learn each decode's regions."""
        self._peer_backends = tuple(peer_backends)
        self._backend = backend
        self._sched = Scheduler(
            backend, cache, workers=workers, retry=retry, default_deadline_s=30.0
        )
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # (L) held, pushed or not, until released
        self._early: dict[str, tuple[bytes, Push, float]] = {}  # (L) pushes before their hold
        self._deadlines: list[tuple[float, str]] = []  # (L) lazy heap over _held and _early
        self._released: set[str] = set()  # (L) released, not yet taken by the engine
        self._recent: OrderedDict[str, str] = OrderedDict()  # (L) id -> how it ended
        self._outbox: deque[tuple[bytes, bytes]] = deque()  # (L) results to send
        self._starts: deque[tuple[str, bytes, Push]] = deque()  # (L) pushes matched by hold()
        self._peers: dict[str, PeerInfo] = {}  # sender thread only
        self.stats = SenderStats()  # (L)
        # Its own context: its I/O thread starts here, with this thread's CPUs
        # (transfer.affinity), and never shares the host's ZeroMQ I/O thread.
        self._ctx = zmq.Context()
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone decode raises
        try:
            sock.bind(endpoint_of(bind))
        except zmq.ZMQError as exc:
            sock.close()
            self._ctx.term()
            self._sched.close(timeout=1.0)
            raise OSError(f"kvguard sender cannot listen on {bind}: {exc}") from exc
        self._sock = sock
        self.endpoint = str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-vllm-sender", daemon=True)
        self._thread.start()
        _log.info("sender_listening", endpoint=self.endpoint)

    # -- engine side -----------------------------------------------------------

    def hold(self, request_id: str, blocks: Sequence[int], deadline: float) -> None:
        """Keep ``blocks`` of ``request_id`` until a decode has them or ``deadline``
        (``time.monotonic()``) passes; ``take_released`` says when they are free."""
        with self._lock:
            if request_id in self._held or request_id in self._recent:
                _log.warning("hold_duplicate", request=request_id)
                return
            held = _Held(list(blocks), deadline)
            self._held[request_id] = held
            heapq.heappush(self._deadlines, (deadline, request_id))
            self.stats.held += 1
            early = self._early.pop(request_id, None)
            if early is not None:  # the sender thread starts it (it owns peers)
                self._starts.append((request_id, early[0], early[1]))

    def take_released(self) -> set[str]:
        """Requests whose blocks nothing touches any more; each is returned once."""
        with self._lock:
            out, self._released = self._released, set()
        return out

    def holding(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self, timeout: float = 5.0) -> None:
        """Stop answering decodes and end kvguard's requests (SHUTDOWN)."""
        self._stop.set()
        self._thread.join(timeout)
        self._sched.close(timeout=timeout)
        self._sock.close()
        self._ctx.term()

    # -- the sender thread -----------------------------------------------------

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    while True:
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._receive(frames)
                while True:
                    with self._lock:
                        if not self._starts:
                            break
                        rid, ident, push = self._starts.popleft()
                    self._start(rid, ident, push)
                self._flush()
                self._expire(time.monotonic())
            except Exception:  # the thread must outlive any one bad message
                _log.exception("sender_loop_error")

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            _log.debug("malformed_envelope", frames=len(frames))
            return
        ident, body = frames
        try:
            msg = decode_from_decode(body)
        except PeerProtocolError as exc:
            _log.warning("bad_decode_message", error=str(exc))
            return
        if isinstance(msg, Abort):
            self._abort(msg.request_id)
            return
        rid = msg.request_id
        with self._lock:
            held = self._held.get(rid)
            ended = self._recent.get(rid)
            early = held is None and ended is None and len(self._early) < _MAX_EARLY
            if early:
                # The engine has not told us yet: wait for hold(), briefly.
                until = time.monotonic() + min(msg.deadline_s, _EARLY_WAIT_S)
                self._early[rid] = (ident, msg, until)
                heapq.heappush(self._deadlines, (until, rid))
                return
        if held is None:
            what = f"request {ended}" if ended else "too many unknown requests"
            self._reply(ident, Result(rid, False, "unknown_request", what))
        elif held.pushed:
            _log.warning("push_duplicate", request=rid)
        else:
            self._start(rid, ident, msg)

    def _start(self, rid: str, ident: bytes, push: Push) -> None:
        """Turn a held request and a decode's push into a kvguard request."""
        with self._lock:
            held = self._held.get(rid)
            if held is None or held.pushed:
                return
            held.pushed, held.ident = True, ident
            left = held.deadline - time.monotonic()
        try:
            info = peer_info_of(push.peer)
            if len(push.blocks) > len(held.blocks):
                raise PeerProtocolError(
                    f"decode asks for {len(push.blocks)} blocks, request {rid} has "
                    f"{len(held.blocks)}"
                )
            deadline_s = min(left, push.deadline_s)
            if deadline_s <= 0:
                raise TimeoutError(f"request {rid}: the hold or the push deadline has passed")
            if self._peers.get(info.session_id) != info:
                for b in self._peer_backends:
                    b.add_peer(info)
                self._sched.add_peer(info)
                self._peers[info.session_id] = info
            src = held.blocks[len(held.blocks) - len(push.blocks) :]
            self._sched.submit(
                rid,
                src,
                list(push.blocks),
                peer=info.session_id,
                deadline_s=deadline_s,
                release=self._on_release,
            )
        except Exception as exc:  # nothing was submitted: the blocks are untouched
            _log.warning("push_refused", request=rid, error=repr(exc))
            self._end(rid, "refused", Result(rid, False, type(exc).__name__, truncate(str(exc))))
            return
        with self._lock:
            self.stats.pushed += 1

    def _on_release(self, rid: str, fin: Finished) -> None:
        # kvguard's release thread: terminal AND quiesced.
        ok = fin.state is TransferState.DONE
        reason = "" if fin.reason is None else fin.reason.value
        detail = "" if fin.error is None else truncate(repr(fin.error))
        with self._lock:
            if ok:
                self.stats.done += 1
            else:
                self.stats.failed += 1
                self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self._end(rid, "done" if ok else f"failed:{reason}", Result(rid, ok, reason, detail))

    def _abort(self, rid: str) -> None:
        with self._lock:
            self._early.pop(rid, None)
            held = self._held.get(rid)
            if held is None:
                return
            pushed = held.pushed
        if pushed:
            try:
                self._sched.abort(rid)  # its release callback ends the hold
            except Exception as exc:
                _log.debug("abort_unknown", request=rid, error=repr(exc))
        else:
            with self._lock:
                self.stats.aborted += 1
            self._end(rid, "aborted", None)

    def _end(self, rid: str, how: str, result: Result | None) -> None:
        """Release ``rid``'s blocks to the engine, once; then tell the decode."""
        with self._lock:
            held = self._held.pop(rid, None)
            if held is None:
                return
            self._released.add(rid)
            self._recent[rid] = how
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
            if how == "refused":
                self.stats.refused += 1
            if result is not None and held.ident is not None:
                self._outbox.append((held.ident, encode(result)))
        _log.debug("hold_released", request=rid, how=how)

    def _reply(self, ident: bytes, result: Result) -> None:
        with self._lock:
            self._outbox.append((ident, encode(result)))

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                ident, body = self._outbox.popleft()
            try:
                self._sock.send_multipart([ident, body], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the decode is gone or not reading
                _log.info("result_undeliverable", error=str(exc))

    def _expire(self, now: float) -> None:
        expired: list[str] = []
        late: list[tuple[bytes, str]] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, rid = heapq.heappop(self._deadlines)
                early = self._early.get(rid)
                if early is not None and early[2] <= now:
                    del self._early[rid]
                    late.append((early[0], rid))
                held = self._held.get(rid)
                if held is not None and not held.pushed and held.deadline <= now:
                    expired.append(rid)
                    self.stats.expired += 1
        for rid in expired:
            _log.info("hold_expired", request=rid)
            self._end(rid, "expired", None)
        for ident, rid in late:
            self._reply(ident, Result(rid, False, "unknown_request", "never held here"))
