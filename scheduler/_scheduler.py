"""Scheduler: the public API over the sans-I/O core and a driver.

One class says everything a caller can do and be told: submit, peers,
driving, outcomes (poll, get, wait, wait_async), abort, metrics, drain and
close. Request state lives in the request table and the core, and every
read here takes their locks; the Scheduler keeps only what is its callers':
the outcomes not yet polled and the observers. What it tells of each
request's end is its base ``Outcomes`` (``_outcomes.py``); what it shows of
itself, metrics and live and quarantined requests, its base ``Observation``
(``_observation.py``).

``submit`` validates and builds the plan in the caller's thread, then admits
the request atomically with peer changes (``_requests.RequestTable``).
Everything after that happens in the core's steps (``_core.py``), run by a
driver (``_drivers.py``): a thread by default, an asyncio task
(``run_async``) or the host's own loop (``step``) with ``driver="external"``.
Callbacks run on the callback thread, probes on the prober thread.

close(): refuses new submits, fails live requests with SHUTDOWN, waits up
to ``timeout`` for every release, and stops the driver. A request whose op
has not quiesced by then stays quarantined -- its blocks are never released
early -- and is released exactly once when the op quiesces: the core is then
stepped by the thread that reports the quiescence (the backend's), and the
release callback runs in that thread, after close() returned. metrics()
keeps counting such requests as ``quarantined`` until then.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import structlog

from lifecycle import Journal, RequestLifecycle
from transfer import PeerInfo, PeerLost, TransferBackend, TransferError, TransferPlan
from transfer.cache import KVCache
from transfer.plan import DEFAULT_MAX_BATCH_ENTRIES, BlockSlice, build_plan

from ._core import SchedulerCore, StepResult
from ._drivers import CallbackRunner, Prober, ThreadDriver, run_async
from ._observation import Observation
from ._outcomes import Outcomes
from ._records import DEFAULT_PEER_LOST_AFTER_PROBES, Finished, ReleaseCallback, RetryPolicy
from ._release import run_release
from ._requests import RequestTable
from .errors import DriverFailed, InvalidRequest, SchedulerClosed, UnknownPeer

__all__ = ["Scheduler"]

_log = structlog.get_logger("kvguard.scheduler")


class Scheduler(Outcomes, Observation):
    """Submit KV transfers; every request ends DONE or FAILED by its deadline."""

    def __init__(
        self,
        backend: TransferBackend,
        source: KVCache,
        *,
        workers: int = 4,
        default_deadline_s: float = 30.0,
        retry: RetryPolicy | None = None,
        release: ReleaseCallback | None = None,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        probe_interval_s: float = 0.5,
        journal: Journal | None = None,
        peer_lost_after_probes: int = DEFAULT_PEER_LOST_AFTER_PROBES,
        driver: Literal["thread", "external"] = "thread",
        max_unpolled: int = 100_000,
        callback_stall_s: float = 5.0,
    ) -> None:
        """``workers``: requests in flight at once (running or backing off).

        ``peer_lost_after_probes``: consecutive failed probes that mark a
        peer lost (see ``DEFAULT_PEER_LOST_AFTER_PROBES`` for the default's
        reasoning). ``max_unpolled``: outcomes kept for poll(); beyond it the
        oldest are dropped and counted (a caller that only uses wait() never
        grows memory). ``callback_stall_s``: a callback running longer while
        others wait is given up on (it finishes in its own thread).
        """
        for name, value, low in (
            ("workers", workers, 1),
            ("peer_lost_after_probes", peer_lost_after_probes, 1),
            ("max_unpolled", max_unpolled, 1),
        ):
            if type(value) is not int or value < low:
                raise InvalidRequest(f"{name} must be an int >= {low}, got {value!r}")
        if driver not in ("thread", "external"):
            raise InvalidRequest(f"driver must be 'thread' or 'external', got {driver!r}")
        self.backend = backend
        self.source = source
        self.default_deadline_s = default_deadline_s
        self.retry_policy = retry or RetryPolicy()
        self.max_batch_entries = max_batch_entries
        self.probe_interval_s = probe_interval_s
        self._release_default = release
        self._callbacks = CallbackRunner(callback_stall_s)
        self._core = core = SchedulerCore(
            backend,
            max_in_flight=workers,
            retry=self.retry_policy,
            probe_interval_s=probe_interval_s,
            peer_lost_after_probes=peer_lost_after_probes,
            journal=journal,
            defer=self._callbacks.post,
        )
        self._table: RequestTable = core.table
        self._prober = Prober(backend, core)
        # Called with each Finished on the callback thread, in order.
        self._observers: list[Callable[[Finished], object]] = []
        self._unpolled: deque[Finished] = deque(maxlen=max_unpolled)
        self._unpolled_dropped = 0
        self._closing = False
        self._driver_error: BaseException | None = None
        self._driver: ThreadDriver | None = None
        if driver == "thread":
            self._driver = ThreadDriver(
                core, self._dispatch, self._driver_died, idle_check=self._callbacks.next_check
            )

    @property
    def default_deadline_s(self) -> float:
        """The deadline of a submit() that names none; set only to a valid one."""
        return self._default_deadline_s

    @default_deadline_s.setter
    def default_deadline_s(self, value: float) -> None:
        _check_deadline("default_deadline_s", value)
        self._default_deadline_s = value

    def add_observer(self, fn: Callable[[Finished], object]) -> None:
        """Call ``fn(finished)`` for every request that becomes terminal from now on."""
        self._observers.append(fn)

    # -- driving ---------------------------------------------------------------

    def step(self) -> float | None:
        """One step of the core, for ``driver="external"``: call it once per
        iteration of the host's loop. Returns in how many seconds the core
        next needs a step at the latest (None: only when something happens)."""
        now = time.monotonic()
        res = self._core.step(now)
        self._dispatch(res)
        return None if res.next_at is None else max(0.0, res.next_at - now)

    async def run_async(self) -> None:
        """Step the core from the running asyncio loop until close()."""
        await run_async(self._core, self._dispatch, lambda: self._closing)

    def _dispatch(self, res: StepResult) -> None:
        # The driver's thread: nothing here runs user code.
        for wake in res.wakers:
            with contextlib.suppress(Exception):
                wake()
        if res.finished:
            room = self._unpolled.maxlen or 0
            over = len(self._unpolled) + len(res.finished) - room
            if over > 0:
                self._unpolled_dropped += over
                _log.warning("unpolled_outcomes_dropped", dropped=over, max_unpolled=room)
            self._unpolled.extend(res.finished)
            if self._observers:
                self._callbacks.post(self._observe, res.finished)
        if res.releases:
            table, checks = self._table, self._core.checks
            self._callbacks.extend([(run_release, (r, table, checks)) for r in res.releases])
        if res.probes:
            self._prober.probe(res.probes)
        self._callbacks.check_stall()

    def _observe(self, finished: list[Finished]) -> None:
        for fin in finished:
            for observe in list(self._observers):
                try:
                    observe(fin)
                except BaseException:
                    _log.exception("observer_failed", request_id=fin.request_id)

    def _driver_died(self, exc: BaseException) -> None:
        self._driver_error = exc
        for wake in self._table.wakers_of_all():
            with contextlib.suppress(Exception):
                wake()

    # -- peers -----------------------------------------------------------------

    def add_peer(self, info: PeerInfo) -> None:
        """Make a decode peer known, or replace what it advertises.

        A replacement that advertises something else fails the peer's live
        requests with PEER_LOST (their plans target the old advertisement).
        """
        if not isinstance(info, PeerInfo):
            raise InvalidRequest(f"add_peer needs a PeerInfo, got {info!r}")
        hook = getattr(self.backend, "add_peer", None)
        if callable(hook):
            hook(info)  # the backend knows the peer before any plan to it is admitted
        self._core.add_peer(info)

    def peer_alive(self, session_id: str) -> bool:
        with self._table.lock:
            peer = self._table.peers.get(session_id)
            if peer is None:
                raise UnknownPeer(f"unknown peer {session_id!r}")
            return peer.alive

    def mark_peer_lost(self, session_id: str, error: TransferError | None = None) -> int:
        """Fail every live request to the peer with PEER_LOST, at once; returns
        how many. New submits to it fail fast until a probe sees it alive."""
        err = error or PeerLost(f"peer {session_id} was lost", peer=session_id)
        failed = self._core.lose_peer(session_id, err)
        if failed is None:
            raise UnknownPeer(f"unknown peer {session_id!r}")
        return failed

    def mark_peer_alive(self, session_id: str) -> None:
        with self._table.lock:
            if self._table.peers.get(session_id) is None:
                raise UnknownPeer(f"unknown peer {session_id!r}")
            revived = self._table.peers.revive(session_id)
        if revived:
            _log.info("peer_alive", peer=session_id)

    def remove_peer(self, session_id: str) -> int:
        """Forget a peer; its live requests fail with PEER_LOST at once (their
        blocks are still released only after quiesce). Returns how many."""
        failed = self._core.remove_peer(session_id)
        if failed is None:
            raise UnknownPeer(f"unknown peer {session_id!r}")
        hook = getattr(self.backend, "remove_peer", None)
        if callable(hook):
            hook(session_id)
        return failed

    # -- submit ----------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        peer: str,
        deadline_s: float | None = None,
        priority: int = 0,
        release: ReleaseCallback | None = None,
        part: BlockSlice | None = None,
    ) -> RequestLifecycle:
        """Queue a transfer and return its lifecycle (``part``: a slice of each
        block, see ``transfer.BlockSlice``; whole blocks without).

        Raises (leaving no state behind) ``InvalidRequest``, ``UnknownPeer``,
        ``DuplicateRequest``, ``SchedulerClosed``, ``DriverFailed`` or
        ``transfer.InvalidPlan``. A submit to a peer known dead is accepted
        and fails at once with PEER_LOST; an empty one is DONE at once.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty str, got {request_id!r}")
        if deadline_s is None:
            deadline_s = self._default_deadline_s  # checked by its setter
        else:
            _check_deadline("deadline_s", deadline_s)
        if type(priority) is not int:
            raise InvalidRequest(f"priority must be an int, got {priority!r}")
        self._check_driver()
        if self._table.closed:
            raise SchedulerClosed(f"scheduler is closed; cannot submit {request_id!r}")
        core = self._core
        while True:
            info = self._table.peer_info(peer)
            if _is_empty(src_blocks) and _is_empty(dst_blocks):
                plan = TransferPlan(peer, (), 0, 0)
            else:  # validation before any state exists: a bad plan raises here
                plan = build_plan(
                    self.source,
                    info,
                    src_blocks,
                    dst_blocks,
                    max_batch_entries=self.max_batch_entries,
                    part=part,
                )
            req = core.new_request(
                request_id,
                plan,
                time.monotonic(),
                deadline_s,
                priority,
                release or self._release_default,
            )
            try:
                core.accept(req, info)
            except LookupError:
                continue  # the peer was replaced meanwhile: validate against the new one
            return req.lc

    def _check_driver(self) -> None:
        if self._driver_error is not None:
            raise DriverFailed("the scheduler's driver thread died") from self._driver_error

    # -- drain and close -------------------------------------------------------

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every request is terminal and released; True if so."""
        if self._driver is not None:
            return self._table.wait_idle(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while len(self._table):  # external driver: step here while waiting
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            nxt = self.step()
            wait = 0.01 if nxt is None else min(nxt, 0.01)
            if self._table.wait_idle(wait if left is None else min(wait, left)):
                break
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Refuse submits, fail live requests with SHUTDOWN, stop the driver.

        Returns drain()'s answer: False if some op had not quiesced in time;
        see the module docstring for what happens to such a request. Called
        from a callback, it does not wait for the callbacks queued behind it.
        """
        self._core.shutdown()
        if threading.get_ident() in self._callbacks.idents:
            timeout = 0.0  # the releases it would wait for run on this thread
        drained = self.drain(timeout)
        self._closing = True
        self._table.wake()  # an asyncio driver sees _closing and returns
        if self._driver is not None:
            self._driver.stop(timeout=1.0)
        self._prober.stop()
        self._callbacks.stop(timeout=1.0)
        # From now on, whoever wakes the core (a late quiescence) steps it.
        self._table.wake = self._step_late
        self._step_late()
        return drained

    def _step_late(self) -> None:
        res = self._core.step(time.monotonic())
        if res.releases:
            _log.info("released_after_close", requests=len(res.releases))
        self._dispatch(res)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_empty(blocks: object) -> bool:
    return isinstance(blocks, _SEQUENCES) and not blocks


_SEQUENCES = (list, tuple, range)  # a tuple: isinstance() checks it faster than a union


def _check_deadline(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or value == float("inf")
    ):
        raise InvalidRequest(f"{name} must be a positive finite number of seconds, got {value!r}")
