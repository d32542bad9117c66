"""The engine loop: the one thread per MooncakeBackend that hands entries to
the engine and collects their final statuses.

Why not a sync call per op: a returned ``batch_transfer_sync_write`` says
nothing about the slices the engine still moves (after one returned -1, a
frozen peer's blocks were seen landing once it thawed), and each call
spins a core. ``transfer_submit_write`` gives one engine id per entry and
``transfer_check_status`` its final status; an op quiesces only when every
entry the engine accepted has one, however long that takes: only then may
its blocks be reused.

Budget: the TCP transport queues MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024)
entries per peer plus MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (1024) waiting
ones, and fails the rest. The loop budgets that many entries per peer, each
from submit until its final status. A waiting entry fails after
MC_TCP_ADMISSION_TIMEOUT_MS (1 s) if the queue does not drain: that is how a
frozen peer's large op fails in ~2 s rather than at the engine timeout.

Ownership: every field marked (loop) is read and written by the loop thread
only. Other threads reach the loop through ``post`` (a new op, or a cancel)
and ``stop``; verdicts of peer probes come back through a ``PeerCheck``. The
op, the check and the hooks the loop calls on its backend are ``_loop_api``'s
(re-exported here).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from ._engine import ENGINE_EXIT, keep_forever
from ._loop_api import EngineOp, Hooks, PeerCheck
from .errors import TransferCancelled

__all__ = ["EngineLoop", "EngineOp", "PeerCheck"]

_log = structlog.get_logger("kvguard.transfer")

# transfer_submit_write's refusals: 0 (0.3.13.post1), or (batch_id_t)-1 when the
# peer's segment cannot be opened. Ids are heap pointers, far below 2**63.
_ID_LIMIT: Final = 1 << 63
# transfer_check_status answers. 1 and -1 free the id (never ask again); 0 and
# -2 (the engine's TIMEOUT) leave it allocated and the slices may still run.
_DONE: Final = 1
_STILL_RUNNING: Final = frozenset({0, -2})

# Polling: entries of one peer finish roughly in submission order, so a pass
# stops after this many consecutive unfinished ones (a frozen peer's 2048
# entries cost 8 checks a pass, not 2048; ~3 us each).
_SCAN_AHEAD: Final = 8
_BUSY_SLEEP_S: Final = 0.0001  # between passes while entries finish
_MAX_SLEEP_S: Final = 0.002  # back-off ceiling while anything moved in the last _RECENT_S
_STALL_SLEEP_S: Final = 0.02  # ceiling once nothing moved for _RECENT_S (a frozen peer)
_RECENT_S: Final = 0.1
_STALE_EVERY_S: Final = 0.25  # how often every entry is checked and ops are compared
# with the engine's own timeout


@dataclass(slots=True)
class _Peer:
    """(loop) What the loop holds for one peer."""

    session_id: str
    waiting: deque[EngineOp] = field(default_factory=deque)  # FIFO; head gets budget first
    flying: list[tuple[int, EngineOp]] = field(default_factory=list)  # (engine id, op), in order
    suspects: list[EngineOp] = field(default_factory=list)  # failed, waiting for check's verdict
    check: PeerCheck | None = None  # the probe in flight; None when no verdict is pending


class EngineLoop:
    """Submits entries within a per-peer budget, polls them, resolves and quiesces ops."""

    _engine: Any  # mooncake.engine.TransferEngine, kept alive by this loop while it runs
    _hooks: Hooks
    _budget: int  # entries per peer from acceptance to final status (engine queue + admissions)
    _timeout_s: float  # the engine's transfer timeout: past it an op's peer is probed
    _inbox: deque[EngineOp]  # new and cancelled ops; deque appends are atomic
    _wake: threading.Event  # set by post/stop/probes; the loop sleeps on it
    _stopping: bool  # set once by stop(): fail what waits, finish what the engine holds
    _peers: dict[str, _Peer]  # (loop)
    _ops: set[EngineOp]  # (loop) taken and not yet quiesced
    thread: threading.Thread

    def __init__(self, engine: Any, hooks: Hooks, budget: int, timeout_s: float, name: str) -> None:
        self._engine = engine
        self._hooks = hooks
        self._budget = budget
        self._timeout_s = timeout_s
        self._inbox = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._peers = {}
        self._ops = set()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        ENGINE_EXIT.track(self.thread, self._wake.set)
        self.thread.start()

    def post(self, op: EngineOp) -> None:
        self._inbox.append(op)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def release_engine(self) -> bool:
        """Drop the loop's reference to the engine once the loop has ended
        with nothing held; True if it did.

        The loop and its backend reference each other (through the hooks), so
        an engine left here is freed only by the cyclic GC: at a random moment,
        on whatever thread happens to allocate, with the GIL held for as long
        as the engine's destructor runs (it joins the engine's threads: up to
        about 1 s), so that every thread of the process -- a scheduler's
        driver past a deadline among them -- stands still meanwhile. The
        backend's ``close()`` calls this and destroys the engine itself.
        """
        if self.thread.is_alive() or self._ops:
            return False
        self._engine = None
        return True

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        sleep = 0.0
        last_progress = next_stale = 0.0
        try:
            while True:
                if ENGINE_EXIT.closing:  # interpreter exit: no engine call from here on
                    if self._ops:  # the engine may still touch their memory
                        keep_forever(self)
                    return
                self._wake.clear()  # before reading the inbox: a later post wakes us
                progress = self._take()
                if self._stopping:
                    self._halt_waiting()
                sweep = time.monotonic() >= next_stale  # look past the unfinished head too
                for peer in list(self._peers.values()):
                    progress |= self._judge(peer) | self._submit(peer) | self._poll(peer, sweep)
                now = time.monotonic()
                if sweep:
                    self._check_stale(now)
                    next_stale = now + _STALE_EVERY_S
                if self._stopping and not self._ops and not self._inbox:
                    return
                if not self._ops:
                    self._peers.clear()
                    self._wake.wait()  # idle: costs nothing until a post
                    continue
                if progress:
                    last_progress, sleep = now, _BUSY_SLEEP_S
                else:
                    ceiling = _MAX_SLEEP_S if now - last_progress < _RECENT_S else _STALL_SLEEP_S
                    sleep = min(ceiling, max(sleep, _BUSY_SLEEP_S) * 2)
                self._wake.wait(sleep)
        except BaseException:  # a bug: say so loudly; ops it held stay unquiesced (safe)
            _log.exception("engine_loop_crashed", ops=len(self._ops))
            raise

    def _peer(self, session_id: str) -> _Peer:
        peer = self._peers.get(session_id)
        if peer is None:
            peer = self._peers[session_id] = _Peer(session_id)
        return peer

    def _take(self) -> bool:
        progress = False
        while self._inbox:
            op = self._inbox.popleft()
            progress = True
            if op not in self._ops:
                if op.quiesced:
                    continue  # a cancel that arrived after the op was retired
                self._ops.add(op)
                self._peer(op.plan.peer).waiting.append(op)
            else:
                self._halt(op)  # a cancel: resolve it now; its place in waiting is skipped
        return progress

    def _halt(self, op: EngineOp) -> None:
        """Stop ``op`` if it must stop (cancel, close): it gets its result now."""
        if op.stopped and op.done:
            return
        error = self._hooks.stopped(op)
        if error is None:
            return
        op.stopped = True
        op._resolve(error)
        self._settle(op)

    def _halt_waiting(self) -> None:
        """Closing: nothing waiting goes to the engine any more."""
        for peer in self._peers.values():
            for op in peer.waiting:
                self._halt(op)
            peer.waiting = deque(op for op in peer.waiting if not op.stopped)

    def _submit(self, peer: _Peer) -> bool:
        waiting = peer.waiting
        if not waiting or peer.check is not None:
            return False
        if self._hooks.needs_check(peer.session_id):
            peer.check = self._hooks.start_check(peer.session_id, self._wake.set)
            return False
        room = self._budget - len(peer.flying)
        progress = False
        submit = self._engine.transfer_submit_write
        flying = peer.flying
        sid = peer.session_id
        while waiting and room > 0:
            op = waiting[0]
            self._halt(op)
            if op.stopped:
                waiting.popleft()
                self._settle(op)
                continue
            batches = op.plan.batches
            b, e = op.batch, op.entry
            batch = batches[b]
            srcs, dsts, lengths = batch.src, batch.dst, batch.lengths
            while room > 0:
                try:
                    bid = submit(sid, srcs[e], dsts[e], lengths[e])
                except Exception as exc:  # the binding refused the arguments: nothing accepted
                    bid = 0
                    _log.exception("transfer_submit_write_raised", peer=sid, error=repr(exc))
                progress = True
                if not 0 < bid < _ID_LIMIT:
                    rc = bid if bid < _ID_LIMIT else -1
                    self._fail(peer, op, f"transfer_submit_write of entry {e} of batch {b} -> {rc}")
                    break
                flying.append((bid, op))
                op.inflight += 1
                room -= 1
                if not op.started_at:
                    op.started_at = time.monotonic()
                    op.stale_at = op.started_at + self._timeout_s + op.plan.nbytes * 1e-9
                e += 1
                if e == len(lengths):
                    b, e = b + 1, 0
                    if b == len(batches):
                        op.stopped = True  # everything handed over
                        break
                    batch = batches[b]
                    srcs, dsts, lengths = batch.src, batch.dst, batch.lengths
            op.batch, op.entry = b, e
            if op.stopped:
                waiting.popleft()
                self._settle(op)
        return progress

    def _poll(self, peer: _Peer, sweep: bool) -> bool:
        """Collect final statuses; a sweep checks every entry, not just the head
        (entries behind a stuck head can fail first: admission timeouts)."""
        flying = peer.flying
        if not flying:
            return False
        check = self._engine.transfer_check_status
        keep: list[tuple[int, EngineOp]] = []
        unfinished = scanned = 0
        n = len(flying)
        ahead = n if sweep else _SCAN_AHEAD
        while scanned < n and unfinished < ahead:
            bid, op = flying[scanned]
            scanned += 1
            rc = check(bid)
            if rc in _STILL_RUNNING:
                keep.append((bid, op))
                unfinished += 1
                continue
            op.inflight -= 1
            if rc == _DONE:
                op.completed += 1
            else:
                self._fail(peer, op, f"an entry's transfer_check_status returned {rc}")
            if op.inflight == 0:
                self._settle(op)
        if len(keep) == scanned:
            return False
        flying[:scanned] = keep
        return True

    def _fail(self, peer: _Peer, op: EngineOp, what: str) -> None:
        """Record the op's first engine failure and ask the peer for a verdict."""
        op.stopped = True
        if op.failure is None and not op.done:
            op.failure = what
            peer.suspects.append(op)
            if peer.check is None:
                peer.check = self._hooks.start_check(peer.session_id, self._wake.set)

    def _judge(self, peer: _Peer) -> bool:
        """Apply a finished probe: failed ops get their error; a gone peer fails
        everything not yet finished (the engine's share stays quarantined)."""
        check = peer.check
        if check is None or not check.done.is_set():
            return False
        peer.check = None
        if check.alive:
            suspects, peer.suspects = peer.suspects, []
        else:
            suspects = [op for op in self._ops if op.plan.peer == peer.session_id]
            peer.suspects = []
            peer.waiting.clear()
        for op in suspects:
            op.stopped = True
            if not op.done:
                op._resolve(self._hooks.failed(op, check))
            self._settle(op)
        return True

    def _check_stale(self, now: float) -> None:
        """Past the engine's own timeout with no final status: ask whether the peer lives."""
        for op in self._ops:
            if op.inflight and not op.done and op.failure is None and 0.0 < op.stale_at <= now:
                op.stale_at = now + self._timeout_s
                waited = now - op.started_at
                what = f"no final status from the engine {waited:.1f}s after submit"
                self._fail(self._peer(op.plan.peer), op, what)

    def _settle(self, op: EngineOp) -> None:
        """Quiesce ``op`` once nothing of it is with the engine and it has its result."""
        if op.inflight or not op.stopped or op not in self._ops:
            return
        if not op.done:
            if op.failure is not None:
                return  # its peer's verdict resolves it, then settles again
            if op.batch < len(op.plan.batches):
                op._resolve(TransferCancelled("stopped with entries left", peer=op.plan.peer))
            else:
                op._resolve(None)  # DONE only when every entry ended with status 1
        self._ops.discard(op)
        op._quiesce()
        self._hooks.retire(op)
