"""The prefill side's driver: ZeroMQ and kvguard's ``Scheduler`` around ``PrefillCore``.

``PrefillSender`` is driven by two parties:

* the serving engine (vLLM's worker, any thread): ``hold(request, blocks,
  deadline)`` when a request finished prefill and its blocks must wait for a
  decode, and ``take_released()`` each step, for the requests whose blocks
  the engine may free now;
* decode sides, over ZeroMQ (``protocol``): ``Push`` asks to write a held
  request's KV into one load's blocks, ``Abort`` gives a load up, ``Renew``
  keeps a hold.

Every decision is ``prefill_core.PrefillCore``'s (its docstring says what it
promises). This module only moves events in and actions out, on one thread:
``kvguard-vllm-sender`` owns the ROUTER socket and the core; the engine's
holds and kvguard's release callbacks reach it through an ``Inbox`` that
wakes its poll (so a Result goes out as the release comes). What other
threads read (stats, released ids) is published under ``_lock`` at the end
of each turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from functools import partial
from typing import Any, Final

import msgspec
import structlog
import zmq

from kvguard.curve import Guard, ServerKeys
from kvguard.decode.control import endpoint_of
from lifecycle import TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from transfer import TransferBackend
from transfer.cache import KVCache
from transfer.checksum import BlockSums
from transfer.errors import PeerProtocolError

from .actions import AbortTransfer, ForgetPeer, PrefillAction, Release, Reply, SenderStats, Submit
from .idle import Bell
from .inbox import Inbox, poll_ms
from .integrity import source_digest
from .prefill_core import PrefillCore
from .protocol import MAX_FRAME_BYTES, decode_from_decode, encode, ids_of, truncate
from .ranks import RankHeads
from .states import LoadEnd

__all__ = ["PrefillSender", "SenderStats"]

_log = structlog.get_logger("kvguard.vllm.sender")

# The longest poll: the inbox and the core's timers wake it sooner; this
# bounds what a wake-up missed by a bug would cost.
_POLL_MS: Final = 5

# What reaches the sender thread from others: the engine's hold, kvguard's release.
_Hold = tuple[str, list[int], float]
_Released = tuple[str, str, LoadEnd, str]


class PrefillSender:
    """Holds prefill blocks for decodes and pushes them through kvguard."""

    endpoint: str  # where decodes connect (tcp://host:port, the real port)

    def __init__(
        self,
        backend: TransferBackend,
        cache: KVCache,
        bind: str,
        *,
        workers: int = 4,
        retry: RetryPolicy | None = None,
        compat: str = "",
        renew_s: float = 30.0,
        max_hold_s: float = 300.0,
        heads: RankHeads | None = None,
        head_major: bool = False,
        curve: ServerKeys | None = None,
        sum_early: bool = True,
        bell: str = "",
    ) -> None:
        """``backend`` moves the bytes (it may wrap the engine, e.g. to inject
        faults: a wrapper forwards each decode's regions to what it wraps);
        kvguard's ``Scheduler`` alone tells it about decodes. ``compat``:
        this side's KV layout fingerprint; a push with another is refused. A
        decode's ``Renew`` extends a hold to ``renew_s`` from then, and never
        past ``max_hold_s`` after the hold began (blocks pinned by a decode
        that queues them). ``heads``: the KV heads this tensor parallel rank
        holds; a decode rank holding others gets the heads both hold, which
        needs heads outermost in a block (``head_major``). ``curve``: only
        decodes holding an allowed key may talk (``kvguard.curve``).
        ``sum_early``: read each hold's blocks for a digest as the hold
        begins, so that a decode asking for whole blocks verified finds its
        digest (nearly) made and the engine's transfer does not share the
        CPUs with it. ``bell``: the engine core's doorbell (``idle``), rung
        whenever a release is ready to take; "" none."""
        self._core = PrefillCore(
            compat=compat,
            renew_s=renew_s,
            max_hold_s=max_hold_s,
            heads=heads,
            head_major=head_major,
            block_bytes=cache.layout.block_bytes,
        )
        self._sched = Scheduler(
            backend, cache, workers=workers, retry=retry, default_deadline_s=30.0
        )
        self._inbox: Inbox[_Hold | _Released] = Inbox()
        self._lock = threading.Lock()  # guards what other threads read:
        self._released: set[str] = set()  # (L) released, not yet taken by the engine
        self._stats = SenderStats()  # (L) the core's, as of the last turn
        self._held_blocks = 0  # (L)
        self._holding = 0  # (L)
        self._peers = 0  # (L)
        self._cache = cache
        # The digest of each verified load's source bytes, made on a thread of
        # its own while the engine moves them; the sender thread keeps each
        # until its Result goes out (and waits for it then, if it must).
        self._digester = ThreadPoolExecutor(1, thread_name_prefix="kvguard-digest")
        self._digests: dict[tuple[str, str], Future[bytes]] = {}  # sender thread only
        # Each hold's whole blocks read as it begins (``sum_early``), on a
        # thread of their own so that no push's digest queues behind them,
        # until the hold is released; a digest of whole blocks weighs them
        # instead. A read not yet started when it is needed (a backlog: many
        # holds at once) is cancelled, and the blocks are read as before: no
        # one ever waits for more than one read already running.
        self._sum_early = sum_early
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvguard-read")
        self._sums: dict[str, Future[BlockSums]] = {}  # sender thread only
        # Its own context: its I/O thread starts here, with this thread's CPUs
        # (transfer.affinity), and never shares the host's ZeroMQ I/O thread.
        self._ctx = zmq.Context()
        self._guard = None if curve is None else Guard(self._ctx, curve)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        if self._guard is not None:
            self._guard.secure(sock)
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
            if self._guard is not None:
                self._guard.close()
            self._ctx.term()
            self._sched.close(timeout=1.0)
            self._inbox.close()
            raise OSError(f"kvguard sender cannot listen on {bind}: {exc}") from exc
        self._sock = sock
        self._bell = Bell(self._ctx, bell)  # sender thread only
        self._poller = zmq.Poller()  # sender thread only
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._inbox, zmq.POLLIN)
        self.endpoint = str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-vllm-sender", daemon=True)
        self._thread.start()
        _log.info("sender_listening", endpoint=self.endpoint)

    # -- engine side -----------------------------------------------------------

    def hold(self, request_id: str, blocks: Sequence[int], deadline: float) -> None:
        """Keep ``blocks`` of ``request_id`` until a decode has them or ``deadline``
        (``time.monotonic()``) passes; ``take_released`` says when they are free."""
        self._inbox.put((request_id, list(blocks), deadline))

    def take_released(self) -> set[str]:
        """Requests whose blocks nothing touches any more; each is returned once."""
        with self._lock:
            out, self._released = self._released, set()
        return out

    @property
    def stats(self) -> SenderStats:
        """The counters as of the sender thread's last turn (a copy)."""
        with self._lock:
            return replace(self._stats, by_reason=dict(self._stats.by_reason))

    def holding(self) -> int:
        with self._lock:
            return self._holding

    def snapshot(self) -> tuple[SenderStats, int]:
        """A consistent copy of the stats and the blocks held now."""
        with self._lock:
            return replace(self._stats, by_reason=dict(self._stats.by_reason)), self._held_blocks

    def peers(self) -> int:
        """Decode peers known here (for inspection and tests)."""
        with self._lock:
            return self._peers

    @property
    def scheduler(self) -> Scheduler:
        """The kvguard Scheduler that runs the pushes: its metrics and observers."""
        return self._sched

    def close(self, timeout: float = 5.0) -> None:
        """Stop answering decodes and end kvguard's requests (SHUTDOWN).

        The thread closes its inbox, sockets and context as it ends: ZeroMQ
        sockets are not thread-safe, and an eventfd closed under a poll may
        be another file's number by the next one. One still running after
        what it may wait for (reads, digests, transfers) ended is logged
        (``sender_thread_not_ended``) and keeps them until it ends."""
        self._stop.set()
        self._inbox.wake()
        self._thread.join(timeout)
        self._digester.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._sched.close(timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.error("sender_thread_not_ended", timeout_s=timeout)

    # -- the sender thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception:  # the thread must outlive any one bad message
                    _log.exception("sender_loop_error")
        finally:  # what this thread polls and sends on, closed by it (``close``)
            self._sock.close()
            self._bell.close()
            self._inbox.close()
            if self._guard is not None:
                self._guard.close()
            self._ctx.term()

    def _turn(self) -> None:
        core, sock = self._core, self._sock
        later: list[Release | Reply] = []  # once the turn's stats are published
        wait_ms = poll_ms(core.next_wake(), time.monotonic(), _POLL_MS)
        ready = dict(self._poller.poll(wait_ms)).get(sock, 0)
        # The engine's holds first: a decode's word read in the same turn
        # may be about them (the engine tells the worker a step late).
        for item in self._inbox.drain():
            now = time.monotonic()
            if len(item) == 3:
                rid, blocks, deadline = item
                acts = core.hold(rid, blocks, deadline, now)
                if self._sum_early and core.is_held(rid) and rid not in self._sums:
                    # before the pushes the hold starts, which may use it
                    self._sums[rid] = self._reader.submit(BlockSums, self._cache, blocks)
                self._apply(acts, later)
            else:
                rid, load_id, end, detail = item
                self._apply(core.released(rid, load_id, end, detail, now), later)
        while ready:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._apply(self._receive(frames), later)
        now = time.monotonic()
        wake = core.next_wake()
        if wake is not None and wake <= now:
            self._apply(core.step(now), later)
        # A digest reads a held source: it ends before that hold's release is
        # published (vLLM may write the blocks once it takes the id).
        releasing = {a.request_id for a in later if isinstance(a, Release)}
        if releasing:  # most turns release nothing: no scan of the digests
            reads: list[Future[Any]] = [
                made for (rid, _), made in self._digests.items() if rid in releasing
            ]
            for rid in releasing & self._sums.keys():
                early = self._sums.pop(rid)
                if not early.cancel():  # running (or done): it reads the blocks
                    reads.append(early)
            wait(reads)
        # Stats first: whoever hears of a release or an answer finds it counted.
        denied = 0 if self._guard is None else self._guard.denied
        with self._lock:
            self._stats = replace(core.stats, by_reason=dict(core.stats.by_reason), denied=denied)
            self._holding, self._held_blocks = core.holding(), core.held_blocks()
            self._peers = core.peers()
            self._released.update(releasing)
        if releasing:
            self._bell.ring()
        for act in later:
            if isinstance(act, Reply):
                res = act.result
                made = self._digests.pop((res.request_id, res.load_id), None)
                if res.ok and made is not None:
                    res = msgspec.structs.replace(res, digest=made.result())
                try:
                    self._sock.send_multipart([act.ident, encode(res)], flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the decode is gone or not reading
                    _log.info("result_undeliverable", error=str(exc))

    def _receive(self, frames: list[bytes]) -> list[PrefillAction]:
        if len(frames) != 2:
            _log.debug("malformed_envelope", frames=len(frames))
            return []
        ident, body = frames
        try:
            msg = decode_from_decode(body)
        except PeerProtocolError as exc:
            _log.warning("bad_decode_message", error=str(exc))
            return self._core.malformed(ident, ids_of(body), truncate(str(exc)))
        return self._core.receive(ident, msg, time.monotonic(), time.time())

    def _apply(self, actions: list[PrefillAction], later: list[Release | Reply]) -> None:
        """Carry out the core's actions, and those their outcomes bring;
        releases and answers wait in ``later`` for the turn's end."""
        todo = list(reversed(actions))
        while todo:
            act = todo.pop()
            more: list[PrefillAction] = []
            if isinstance(act, Release | Reply):
                later.append(act)
            elif isinstance(act, Submit):
                more = self._submit(act)
            elif isinstance(act, AbortTransfer):
                try:
                    self._sched.abort(act.transfer)
                except Exception as exc:  # released meanwhile: answered already
                    _log.debug("abort_unknown", transfer=act.transfer, error=repr(exc))
            elif isinstance(act, ForgetPeer):  # nothing in flight to it
                self._sched.remove_peer(act.session)  # and from the backend
            todo.extend(reversed(more))

    def _submit(self, act: Submit) -> list[PrefillAction]:
        try:
            if act.new_peer:
                self._sched.add_peer(act.peer)  # the backend first, then the core
            self._sched.submit(
                act.transfer,
                act.src,
                act.dst,
                peer=act.peer.session_id,
                deadline_s=act.deadline_s,
                release=partial(self._on_release, act.request_id, act.load_id),
                part=act.part,
            )
        except Exception as exc:  # nothing was submitted: the blocks are untouched
            detail = truncate(repr(exc))
            return self._core.submit_failed(act.request_id, act.load_id, detail, time.monotonic())
        if act.verify:  # the source is held, unchanged: digest it while the engine moves it
            early = self._sums.get(act.request_id)
            made = self._digester.submit(source_digest, self._cache, act.src, act.part, early)
            self._digests[act.request_id, act.load_id] = made
        return []

    def _on_release(self, rid: str, load_id: str, _transfer: str, fin: Finished) -> None:
        # kvguard's release thread: terminal AND quiesced.
        if fin.state is TransferState.DONE:
            end = LoadEnd.LOADED
        else:
            end = LoadEnd.of_failure(fin.reason) if fin.reason else LoadEnd.TRANSFER_ERROR
        detail = "" if fin.error is None else truncate(repr(fin.error))
        self._inbox.put((rid, load_id, end, detail))
