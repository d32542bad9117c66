"""The prefill side: hold finished requests' blocks, push them when asked.

``PrefillSender`` is driven by two parties:

* the serving engine (vLLM's worker, any thread): ``hold(request, blocks,
  deadline)`` when a request finished prefill and its blocks must wait for a
  decode, and ``take_released()`` each step, for the requests whose blocks
  the engine may free now;
* decode sides, over ZeroMQ (``protocol``): ``Push`` asks to write a held
  request's KV into one load's blocks, ``Abort`` gives a load up.

One held request may serve several loads (a decode's n > 1 children share
one prefill request: its group, whose size each push carries), each its own
kvguard transfer, answered by its own ``Result`` naming the load, and only
once nothing writes that load's blocks: after kvguard's release callback
(terminal AND every engine call quiesced), or at once when nothing was ever
submitted for it. A decode request of the group that will never push says
so (``Abort`` without a load id). A load given
up before its push started is remembered (``_aborted``), so a push read
later (a frozen prefill reads its socket on thaw) is refused, never served.

Every held request ends in exactly one release to the engine, and only once
nothing touches its blocks: when no load is in flight and every decode
request of the group was answered or said it will not push, or its
deadline passed.

A ``Push`` may overtake the engine's ``hold`` (vLLM tells the worker one
step after the client already has the request's parameters): it waits, until
the hold arrives or the push's own deadline passes.

Threads: one ``kvguard-vllm-sender`` thread owns the ROUTER socket; kvguard's
own threads run the transfers and the release callbacks. Shared state is
under ``_lock``; no engine call and no socket call happens under it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
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
from transfer.plan import BlockSlice

from .protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Push,
    Renew,
    Result,
    decode_from_decode,
    encode,
    ids_of,
    truncate,
)
from .ranks import RankHeads

__all__ = ["PrefillSender", "SenderStats"]

_log = structlog.get_logger("kvguard.vllm.sender")

_POLL_MS: Final = 5  # how often the thread looks at deadlines and its outbox
_RECENT: Final = 4096  # finished ids remembered to answer a late push
# A push may arrive before the engine's hold (one engine step later); it
# waits this long at most, and at most this many wait at once.
_EARLY_WAIT_S: Final = 10.0
_MAX_EARLY: Final = 4096
# A decode peer with no load in flight this long is forgotten (decodes churn:
# every restart is a new Mooncake session); it is learnt again from its push.
IDLE_PEER_S: Final = 300.0


@dataclass(slots=True)
class _Load:
    """One load in flight: a kvguard transfer exists; only its release ends it."""

    ident: bytes  # the decode's ROUTER identity, for the Result
    transfer: str  # the kvguard request id
    peer: str = ""  # the decode's Mooncake session, once the push was admitted


@dataclass(slots=True)
class _Held:
    blocks: list[int]
    deadline: float  # time.monotonic(); the hold ends then unless a load is in flight
    last: float  # the latest a renewal may push ``deadline`` to (time.monotonic())
    loads: dict[str, _Load] = field(default_factory=dict)  # load id -> in flight
    # Each decode request of the group loads at most once: answered or
    # forgotten, it is settled. The hold waits for the whole group.
    answered: set[str] = field(default_factory=set)  # load ids, transfer run or not
    # Load ids whose push was refused: a settle-nothing answer, but a second
    # push of the same load (a decode re-sending on a new connection) must
    # not start what the decode already heard had failed.
    refused: set[str] = field(default_factory=set)
    forgotten: int = 0  # decode requests of the group that will never push
    group: int = 1  # the decode's group size: the largest a push said

    def knows(self, load_id: str) -> bool:
        """Was ``load_id`` pushed here before (in flight, answered, refused)?
        A second push of it starts nothing: its decode may already have
        heard the first one's answer and handed the blocks back to vLLM."""
        return load_id in self.loads or load_id in self.answered or load_id in self.refused

    def settled(self) -> bool:
        return not self.loads and len(self.answered) + self.forgotten >= self.group


@dataclass(slots=True)
class SenderStats:
    held: int = 0
    pushed: int = 0
    done: int = 0
    failed: int = 0
    expired: int = 0  # no decode asked before the deadline
    aborted: int = 0  # the decode said it would not ask
    refused: int = 0  # a push that could not be submitted
    loads: int = 0  # loads answered (a request serves one per decode child)
    renewed: int = 0  # holds extended by a decode whose request queues
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
        compat: str = "",
        renew_s: float = 30.0,
        max_hold_s: float = 300.0,
        heads: RankHeads | None = None,
        head_major: bool = False,
    ) -> None:
        """``backend`` moves the bytes (it may wrap the engine, e.g. to inject
        faults); ``peer_backends`` also learn each decode's regions. ``compat``:
        this side's KV layout fingerprint; a push with another is refused. A
        decode's ``Renew`` extends a hold to ``renew_s`` from then, and never
        past ``max_hold_s`` after the hold began (blocks pinned by a decode
        that queues them). ``heads``: the KV heads this tensor parallel rank
        holds; a decode rank holding others gets the heads both hold, which
        needs heads outermost in a block (``head_major``)."""
        self._heads = heads
        self._head_major = head_major
        self._block_bytes = cache.layout.block_bytes
        self._renew_s = renew_s
        self._max_hold_s = max_hold_s
        self._peer_backends = tuple(peer_backends)
        self._backend = backend
        self._compat = compat
        self._sched = Scheduler(
            backend, cache, workers=workers, retry=retry, default_deadline_s=30.0
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # (L) held until released to the engine
        # (L) pushes read before their hold, by (request, load): (ident, push, until)
        self._early: dict[tuple[str, str], tuple[bytes, Push, float]] = {}
        # (L) lazy heap over _held (load "") and _early deadlines
        self._deadlines: list[tuple[float, str, str]] = []
        self._released: set[str] = set()  # (L) released, not yet taken by the engine
        self._recent: OrderedDict[str, str] = OrderedDict()  # (L) id -> how its hold ended
        # (L) loads given up before their push started: a later push is refused
        self._aborted: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._outbox: deque[tuple[bytes, bytes]] = deque()  # (L) results to send
        self._starts: deque[tuple[str, bytes, Push]] = deque()  # (L) pushes matched by hold()
        self._peers: dict[str, PeerInfo] = {}  # sender thread only
        self._peer_used: dict[str, float] = {}  # (L) session -> last push admitted to it
        self._peer_loads: Counter[str] = Counter()  # (L) session -> loads in flight to it
        self.stats = SenderStats()  # (L)
        # Its own context: its I/O thread starts here, with this thread's CPUs
        # (transfer.affinity), and never shares the host's ZeroMQ I/O thread.
        self._ctx = zmq.Context()
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone decode raises
        # A decode that reconnects keeps its identity: its new connection
        # takes over, so a Result sent after the reconnect reaches it.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
            now = time.monotonic()
            self._held[request_id] = _Held(list(blocks), deadline, now + self._max_hold_s)
            heapq.heappush(self._deadlines, (deadline, request_id, ""))
            self.stats.held += 1
            for key in [k for k in self._early if k[0] == request_id]:
                ident, push, _ = self._early.pop(key)  # the sender thread starts it (it owns peers)
                self._starts.append((request_id, ident, push))

    def take_released(self) -> set[str]:
        """Requests whose blocks nothing touches any more; each is returned once."""
        with self._lock:
            out, self._released = self._released, set()
        return out

    def holding(self) -> int:
        with self._lock:
            return len(self._held)

    def snapshot(self) -> tuple[SenderStats, int]:
        """A consistent copy of the stats and the blocks held now."""
        with self._lock:
            stats = replace(self.stats, by_reason=dict(self.stats.by_reason))
            return stats, sum(len(h.blocks) for h in self._held.values())

    @property
    def scheduler(self) -> Scheduler:
        """The kvguard Scheduler that runs the pushes: its metrics and observers."""
        return self._sched

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
            ids = ids_of(body)  # answer the load, or its decode waits out its deadline
            if ids is not None:
                self._reply(ident, Result(ids[0], ids[1], False, "bad_request", truncate(str(exc))))
            return
        if isinstance(msg, Abort):
            self._abort(ident, msg.request_id, msg.load_id)
            return
        if isinstance(msg, Renew):
            self._renew(msg.request_id)
            return
        rid, key = msg.request_id, (msg.request_id, msg.load_id)
        with self._lock:
            held = self._held.get(rid)
            ended = self._recent.get(rid)
            aborted = key in self._aborted
            early = held is None and ended is None and not aborted and len(self._early) < _MAX_EARLY
            if early:
                # The engine has not told us yet: wait for hold(), briefly.
                left = msg.expires_at - time.time()
                until = time.monotonic() + max(0.0, min(left, _EARLY_WAIT_S))
                self._early[key] = (ident, msg, until)
                heapq.heappush(self._deadlines, (until, rid, msg.load_id))
                return
        if aborted:
            self._answer(ident, msg, "aborted", "the decode gave this load up before")
        elif held is None:
            what = f"request {ended}" if ended else "too many unknown requests"
            self._answer(ident, msg, "unknown_request", what)
        elif held.knows(msg.load_id):
            _log.warning("push_duplicate", request=rid, load=msg.load_id)
        else:
            self._start(rid, ident, msg)

    def _renew(self, rid: str) -> None:
        with self._lock:
            held = self._held.get(rid)
            if held is None:
                return  # ended: the decode's push will hear why
            until = min(time.monotonic() + self._renew_s, held.last)
            if until <= held.deadline:
                return
            held.deadline = until
            heapq.heappush(self._deadlines, (until, rid, ""))
            self.stats.renewed += 1
        _log.debug("hold_renewed", request=rid)

    def _answer(self, ident: bytes, push: Push, reason: str, detail: str) -> None:
        """A push that started nothing: nothing of ours writes its blocks."""
        with self._lock:
            self.stats.loads += 1
        self._reply(ident, Result(push.request_id, push.load_id, False, reason, detail))

    def _start(self, rid: str, ident: bytes, push: Push) -> None:
        """Turn a held request and a decode's push into a kvguard transfer."""
        key = (rid, push.load_id)
        transfer = f"kvguard-push-{next(self._ids)}"
        with self._lock:
            held = self._held.get(rid)
            if held is None or held.knows(push.load_id) or key in self._aborted:
                return  # a copy of it started first (the early one, or the re-sent)
            held.loads[push.load_id] = _Load(ident, transfer)
            held.group = max(held.group, push.group)
            left = held.deadline - time.monotonic()
        try:
            if push.compat != self._compat:
                raise PeerProtocolError(
                    f"KV layouts differ: decode {push.compat!r}, prefill {self._compat!r}"
                )
            info = peer_info_of(push.peer)
            if len(push.blocks) > len(held.blocks):
                raise PeerProtocolError(
                    f"decode asks for {len(push.blocks)} blocks, request {rid} has "
                    f"{len(held.blocks)}"
                )
            part = self._part(push)
            deadline_s = min(left, push.expires_at - time.time())
            if deadline_s <= 0:
                raise TimeoutError(f"request {rid}: the hold or the push deadline has passed")
            if self._peers.get(info.session_id) != info:
                for b in self._peer_backends:
                    b.add_peer(info)
                self._sched.add_peer(info)
                self._peers[info.session_id] = info
            src = held.blocks[len(held.blocks) - len(push.blocks) :]
            with self._lock:
                held.loads[push.load_id].peer = info.session_id
                self._peer_loads[info.session_id] += 1
                self._peer_used[info.session_id] = time.monotonic()
            self._sched.submit(
                transfer,
                src,
                list(push.blocks),
                peer=info.session_id,
                deadline_s=deadline_s,
                release=partial(self._on_release, rid, push.load_id),
                part=part,
            )
        except Exception as exc:  # nothing was submitted: the blocks are untouched
            _log.warning("push_refused", request=rid, load=push.load_id, error=repr(exc))
            with self._lock:
                self.stats.refused += 1
            result = Result(rid, push.load_id, False, type(exc).__name__, truncate(str(exc)))
            # Refused, it settles nothing: another decode may still ask in time.
            self._load_over(rid, push.load_id, result, settles=False)
            return
        with self._lock:
            self.stats.pushed += 1

    def _part(self, push: Push) -> BlockSlice | None:
        """Whole blocks where the decode rank holds this rank's heads, else
        the slice of each block with the heads both hold."""
        mine, first, count = self._heads, push.first_head, push.head_count
        if mine is None or count == 0 or (first, count) == (mine.first, mine.count):
            return None
        lo, hi = max(mine.first, first), min(mine.first + mine.count, first + count)
        if lo >= hi or not self._head_major:
            raise PeerProtocolError(
                f"the decode rank holds KV heads [{first}, {first + count}), this prefill "
                f"rank [{mine.first}, {mine.first + mine.count}): "
                + ("none in common" if lo >= hi else "a share of a block needs heads outermost")
            )
        unit = self._block_bytes // mine.count
        return BlockSlice((lo - mine.first) * unit, (lo - first) * unit, (hi - lo) * unit)

    def _on_release(self, rid: str, load_id: str, _transfer: str, fin: Finished) -> None:
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
        self._load_over(rid, load_id, Result(rid, load_id, ok, reason, detail))

    def _load_over(self, rid: str, load_id: str, result: Result, *, settles: bool = True) -> None:
        """``load_id`` ended and nothing writes its blocks: answer it, and end
        the hold once its group is settled (or its deadline passed) and no
        other load is in flight."""
        with self._lock:
            held = self._held.get(rid)
            load = None if held is None else held.loads.pop(load_id, None)
            if held is None or load is None:
                return
            self.stats.loads += 1
            self._outbox.append((load.ident, encode(result)))
            if load.peer:
                self._peer_loads[load.peer] -= 1
            (held.answered if settles else held.refused).add(load_id)
            last = held.settled() or (not held.loads and held.deadline <= time.monotonic())
        if last:
            self._end(rid, "done" if result.ok else f"failed:{result.reason}")

    def _abort(self, ident: bytes, rid: str, load_id: str) -> None:
        """The decode gave up ``load_id``: answered once nothing writes its
        blocks. With no load id, one decode request of ``rid``'s group will
        never push. Either settles one request of the group; the hold ends
        once the whole group is settled and nothing is in flight or waiting."""
        if not load_id:
            with self._lock:
                held = self._held.get(rid)
                if held is not None:
                    held.forgotten += 1
            self._end_if_settled(rid)
            return
        dropped: list[tuple[bytes, Push]] = []
        with self._lock:
            early = self._early.pop((rid, load_id), None)
            if early is not None:
                dropped.append((early[0], early[1]))
            keep: deque[tuple[str, bytes, Push]] = deque()
            for start in self._starts:
                if (start[0], start[2].load_id) == (rid, load_id):
                    dropped.append((start[1], start[2]))
                else:
                    keep.append(start)
            self._starts = keep
            self._aborted[(rid, load_id)] = None
            while len(self._aborted) > _RECENT:
                self._aborted.popitem(last=False)
            held = self._held.get(rid)
            load = None if held is None else held.loads.get(load_id)
            if held is not None and load is None:
                held.answered.add(load_id)  # not in flight: answered below or before
        for ident_, push in dropped:
            self._answer(ident_, push, "aborted", "given up before its push started")
        if load is not None:  # its release callback answers it
            try:
                self._sched.abort(load.transfer)
            except Exception as exc:  # released meanwhile: answered already
                _log.debug("abort_unknown", request=rid, load=load_id, error=repr(exc))
            return
        if not dropped:  # nothing of this load was ever started here
            self._reply(ident, Result(rid, load_id, False, "aborted", "no transfer started"))
        self._end_if_settled(rid)

    def _end_if_settled(self, rid: str) -> None:
        with self._lock:
            held = self._held.get(rid)
            waiting = any(k[0] == rid for k in self._early) or any(
                s[0] == rid for s in self._starts
            )
            settled = held is not None and held.settled() and not waiting
            if settled:
                self.stats.aborted += 1
        if settled:
            self._end(rid, "aborted")

    def _end(self, rid: str, how: str) -> None:
        """Release ``rid``'s blocks to the engine, once."""
        with self._lock:
            held = self._held.get(rid)
            if held is None or held.loads:
                return  # gone, or a load in flight: its release ends the hold
            del self._held[rid]
            self._released.add(rid)
            self._recent[rid] = how
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
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
        late: list[tuple[bytes, Push]] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, rid, load_id = heapq.heappop(self._deadlines)
                early = self._early.get((rid, load_id))
                if early is not None and early[2] <= now:
                    del self._early[(rid, load_id)]
                    late.append((early[0], early[1]))
                held = self._held.get(rid)
                if not load_id and held is not None and not held.loads and held.deadline <= now:
                    expired.append(rid)
                    self.stats.expired += 1
        for rid in expired:
            _log.info("hold_expired", request=rid)
            self._end(rid, "expired")
        for ident, push in late:
            self._answer(ident, push, "unknown_request", "never held here")
        self._forget_idle_peers(now)

    def _forget_idle_peers(self, now: float) -> None:
        with self._lock:
            idle = [
                p
                for p, used in self._peer_used.items()
                if now - used > IDLE_PEER_S and self._peer_loads[p] <= 0
            ]
            for p in idle:
                del self._peer_used[p]
                self._peer_loads.pop(p, None)
        for p in idle:  # nothing in flight to it: forgetting fails nothing
            self._peers.pop(p, None)
            self._sched.remove_peer(p)
            for b in self._peer_backends:
                b.remove_peer(p)
            _log.info("peer_forgotten", peer=p)

    def peers(self) -> int:
        """Decode peers known here (for inspection and tests)."""
        with self._lock:
            return len(self._peer_used)
