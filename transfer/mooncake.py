"""MooncakeBackend: the Mooncake transfer engine behind ``TransferBackend``.

How the engine's behaviour (DESIGN.md, "Mooncake transfer engine") maps onto
the backend contract:

* Transfer calls return only 0 or -1. A failure is classified afterwards by
  probing the peer (``FAILURE_CLASS``): a peer that still answers means the
  engine failed (EngineError, retryable); one that refuses or stays silent is
  gone -- PeerLost when bytes of the plan may already have reached it,
  PeerUnreachable when none can have. A plan succeeds only if every batch
  returned 0 (I5).
* Sync calls release the GIL and busy-spin until done. Each op runs batch by
  batch on one of ``max_inflight`` daemon worker threads; ``submit`` only
  enqueues.
* A call to a frozen peer returns only after MC_TRANSFER_TIMEOUT (>= 5 s) and
  may write into the buffers until then. The op quiesces only when that call
  has returned, whatever deadline its caller gave up at (I6).
* ``send_probe`` to a frozen peer blocks for about 60 s. Probes run on their
  own daemon threads, at most one per peer at a time, and are waited for with
  a bound; a probe that does not answer in time counts as a silent peer.
* A killed peer makes the engine back off about 1 s per later call. A peer
  found dead is probed (milliseconds when it refuses) before the next plan
  to it, which fails at once while the peer stays dead.
* The TCP transport queues at most ~2048 transfers per peer, across all
  calls to it, and fails every call that overflows the queue (it may then
  fail that peer for minutes). Calls to one peer share a budget of
  ``max_peer_entries`` entries; a worker waits for budget between batches.
* Over TCP the engine reads unregistered local memory without complaint:
  source ranges are checked against the registered caches before the first
  call.

The ``mooncake`` package is imported when a backend is built, not when this
module is, so ``transfer`` imports on hosts without the wheel.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import queue
import threading
import time
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import structlog
import torch

from .backend import Region, TransferBackend, TransferOp, TransferPlan
from .errors import (
    BackendClosed,
    Backpressure,
    EngineError,
    InvalidPlan,
    PeerLost,
    PeerUnreachable,
    RegistrationError,
    TransferCancelled,
    TransferError,
)
from .layout import KVCache

__all__ = [
    "ENGINE_CODES",
    "FAILURE_CLASS",
    "P2P_HANDSHAKE",
    "Liveness",
    "MooncakeBackend",
    "code_name",
    "is_wildcard",
]

_log = structlog.get_logger("kvguard.transfer")

P2P_HANDSHAKE: Final = "P2PHANDSHAKE"
MIN_TRANSFER_TIMEOUT_S: Final = 5  # the engine clamps MC_TRANSFER_TIMEOUT to at least this
# The TCP transport queues at most ~2048 transfers per peer (across all calls
# to it) and fails every call that overflows the queue: 3 concurrent calls of
# 1024 entries all return -1, 8 of 256 all pass.
DEFAULT_MAX_PEER_ENTRIES: Final = 2048
_BUDGET_POLL_S: Final = 0.05  # how often a worker waiting for budget looks at cancel/close

# error.h: what register_memory, unregister_memory, send_probe and initialize
# return. Transfer calls return only 0 and -1.
ENGINE_CODES: Final[Mapping[int, str]] = {
    0: "OK",
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
}


def code_name(rc: int | None) -> str:
    if rc is None:
        return "no answer"
    return f"{rc} {ENGINE_CODES.get(rc, 'unknown code')}"


class Liveness(enum.Enum):
    """What a bounded ``send_probe`` says about a peer."""

    ALIVE = "alive"  # returned 0
    REFUSED = "refused"  # returned an error code: refused, unknown, bad metadata
    SILENT = "silent"  # no answer within the bound: frozen or partitioned


# (probe verdict after a failed call, may bytes of the plan have reached the
# peer) -> the error the op fails with. Only a live peer makes a retry useful.
FAILURE_CLASS: Final[Mapping[tuple[Liveness, bool], type[TransferError]]] = {
    (Liveness.ALIVE, False): EngineError,
    (Liveness.ALIVE, True): EngineError,
    (Liveness.REFUSED, False): PeerUnreachable,
    (Liveness.REFUSED, True): PeerLost,
    (Liveness.SILENT, False): PeerUnreachable,
    (Liveness.SILENT, True): PeerLost,
}

# torch device type -> engine location string; "{i}" is the device index.
_LOCATIONS: Final[Mapping[str, str]] = {"cpu": "*", "cuda": "cuda:{i}"}

# Engines that may still be inside a call when their backend closed.
# Destroying one under a running call would be a use-after-free, so they live
# until the process ends.
_ABANDONED: list[object] = []

# os.environ is process-global and the engine reads it while it is built.
_ENV_LOCK = threading.Lock()


@dataclass(slots=True)
class _PeerState:
    """What this backend has learnt about one peer. Written by workers and probes;
    each field is a single reference, so a racy read sees an old or a new value."""

    reached: bool = False  # a call or probe to it succeeded once
    dead: Liveness | None = None  # verdict of the last failure; None while believed alive
    entries: int = 0  # (B) entries in running calls to it; <= the budget but for one oversized


class _ProbeCall:
    """One in-flight ``send_probe``; every waiter on the same peer shares it."""

    __slots__ = ("done", "rc")

    done: threading.Event  # set once rc is final
    rc: int

    def __init__(self) -> None:
        self.done = threading.Event()
        self.rc = -1


class MooncakeBackend(TransferBackend):
    """Writes plans to peers through one ``mooncake.engine.TransferEngine``.

    ``local_ip`` is this host's address. With ``metadata="P2PHANDSHAKE"`` no
    metadata server is needed and the session id is ``"ip:rpc_port"``; with a
    metadata URL (``http://host:port/metadata``, ``etcd://...``,
    ``redis://...``) the session id is ``local_ip`` as given, so make it
    unique per engine (``"10.0.0.5:17777"``).

    The engine listens on every interface whatever ``local_ip`` says (its RPC
    and TCP-transport ports bind the wildcard address): ``local_ip`` is the
    address peers are told to use, not a filter on who may connect
    (docs/security.md).
    """

    name = "mooncake"

    _engine: Any  # mooncake.engine.TransferEngine; None once close() released it
    _session_id: str
    _lock: threading.Lock  # guards the fields below marked (L)
    _closed: bool  # (L) once True: submit fails fast, workers stop between batches
    _caches: dict[int, KVCache]  # (L) id -> registered cache, kept alive while registered
    _spans: tuple[list[int], list[int]]  # (L) sorted starts/ends of registered memory; replaced
    _live: set[TransferOp]  # (L) submitted and not yet quiesced
    _probes: dict[str, _ProbeCall]  # (L) at most one send_probe per peer in flight
    _peers: dict[str, _PeerState]  # entries are only added; states are mutated in place
    _queue: queue.SimpleQueue[TransferOp | None]  # None tells one worker to exit
    _workers: tuple[threading.Thread, ...]
    _budget: threading.Condition  # (B) guards _PeerState.entries; notified on every release
    _peer_entries: int  # per-peer budget of entries in running calls
    _max_pending: int
    _probe_timeout_s: float
    _close_timeout_s: float

    def __init__(
        self,
        local_ip: str = "127.0.0.1",
        *,
        metadata: str = P2P_HANDSHAKE,
        protocol: str = "tcp",
        device_name: str = "",
        force_tcp: bool = True,
        max_inflight: int | None = None,
        max_pending: int = 1024,
        max_peer_entries: int = DEFAULT_MAX_PEER_ENTRIES,
        transfer_timeout_s: int | None = None,
        probe_timeout_s: float = 1.0,
        close_timeout_s: float = 5.0,
    ) -> None:
        """Build and initialize the engine; raise RegistrationError if it refuses.

        ``protocol`` is passed through but does not pick the transport: the
        engine prefers RDMA when a NIC exists, so ``force_tcp`` sets
        MC_FORCE_TCP=1. ``transfer_timeout_s`` sets MC_TRANSFER_TIMEOUT for
        this engine only (the engine default is 30 s). ``max_inflight`` ops run
        at once, each busy-spinning one core, so the default is one per core
        (at most 8): more spinners than cores starve everything else on the
        host, the dying peer's teardown included, and slow failure detection
        (measured: 170 ms with 8 on 2 cores, 30-60 ms with 2). At most ``max_pending`` ops may
        be queued or running before submit answers Backpressure. Calls to one
        peer carry at most ``max_peer_entries`` entries together: the TCP
        transport queues ~2048 per peer and fails every call that overflows it.
        A wildcard ``local_ip`` (0.0.0.0, ::) is logged as a warning.
        """
        if max_inflight is None:
            max_inflight = max(1, min(8, os.cpu_count() or 1))
        for name, value, low in (
            ("max_inflight", max_inflight, 1),
            ("max_pending", max_pending, 1),
            ("max_peer_entries", max_peer_entries, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if transfer_timeout_s is not None and (
            isinstance(transfer_timeout_s, bool)
            or not isinstance(transfer_timeout_s, int)
            or transfer_timeout_s < MIN_TRANSFER_TIMEOUT_S
        ):
            raise ValueError(
                f"transfer_timeout_s must be an int >= {MIN_TRANSFER_TIMEOUT_S}, "
                f"got {transfer_timeout_s!r}"
            )
        if not probe_timeout_s > 0 or not close_timeout_s >= 0:
            raise ValueError("probe_timeout_s must be > 0 and close_timeout_s >= 0")
        if is_wildcard(local_ip):
            _log.warning(
                "wildcard_address",
                local_ip=local_ip,
                problem="not a reachable session address; the engine's ports accept anyone "
                "who can reach this host, and the TCP transport has no authentication",
                fix="give this host's address on a private network (docs/security.md)",
            )
        self._engine = _make_engine(
            local_ip, metadata, protocol, device_name, force_tcp, transfer_timeout_s
        )
        p2p = metadata == P2P_HANDSHAKE
        self._session_id = f"{local_ip}:{self._engine.get_rpc_port()}" if p2p else local_ip
        self._lock = threading.Lock()
        self._closed = False
        self._caches = {}
        self._spans = ([], [])
        self._live = set()
        self._probes = {}
        self._peers = {}
        self._queue = queue.SimpleQueue()
        self._budget = threading.Condition()
        self._peer_entries = max_peer_entries
        self._max_pending = max_pending
        self._probe_timeout_s = probe_timeout_s
        self._close_timeout_s = close_timeout_s
        self._workers = tuple(
            threading.Thread(target=self._work, name=f"kvguard-mooncake-{i}", daemon=True)
            for i in range(max_inflight)
        )
        for t in self._workers:
            t.start()

    @property
    def session_id(self) -> str:
        """The name peers use to reach this engine."""
        return self._session_id

    @property
    def engine(self) -> Any:
        """The raw ``TransferEngine`` (benchmarks compare against it); None once closed."""
        return self._engine

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Ops submitted and not yet quiesced."""
        return len(self._live)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._live)} in flight"
        return f"MooncakeBackend({self._session_id}, {state})"

    def __enter__(self) -> MooncakeBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- memory registration ------------------------------------------------------

    def register(self, cache: KVCache) -> None:
        """Register every buffer of ``cache``; all or nothing.

        Raises RegistrationError when ``cache`` is already registered, or when
        the engine refuses a buffer (the error names its address and code).
        """
        if not isinstance(cache, KVCache):
            raise RegistrationError(f"register needs a KVCache, got {type(cache).__name__}")
        location = _location(cache.device)
        with self._lock:
            engine = self._open_engine()
            if id(cache) in self._caches:
                raise RegistrationError(f"{cache!r} is already registered with {self}")
            done: list[int] = []
            for index, region in enumerate(cache.regions()):
                rc = engine.register_memory(region.base, region.length, location)
                if rc != 0:
                    for base in done:  # all or nothing: undo this call's registrations
                        engine.unregister_memory(base)
                    raise RegistrationError(
                        f"register_memory of buffer {index} at {region.base:#x} "
                        f"(+{region.length}, location {location!r}) returned {code_name(rc)}",
                        code=rc,
                    )
                done.append(region.base)
            self._caches[id(cache)] = cache
            self._reindex()

    def unregister(self, cache: KVCache) -> None:
        """Unregister ``cache``. Refused while an op that reads from it is in flight."""
        with self._lock:
            engine = self._open_engine()
            if id(cache) not in self._caches:
                raise RegistrationError(f"{cache!r} is not registered with {self}")
            regions = cache.regions()
            busy = sum(1 for op in self._live if _reads_from(op.plan, regions))
            if busy:
                raise RegistrationError(
                    f"{busy} op(s) reading from {cache!r} are not quiesced yet; "
                    "unregister after they are"
                )
            del self._caches[id(cache)]
            self._reindex()
            failed = [(r.base, rc) for r in regions if (rc := engine.unregister_memory(r.base))]
        if failed:
            base, rc = failed[0]
            raise RegistrationError(
                f"unregister_memory failed for {len(failed)} buffer(s), first at {base:#x}: "
                f"{code_name(rc)}",
                code=rc,
            )

    def _reindex(self) -> None:  # caller holds _lock
        spans = sorted((r for c in self._caches.values() for r in c.regions()), key=_base)
        self._spans = ([r.base for r in spans], [r.end for r in spans])

    def _open_engine(self) -> Any:
        if self._closed:
            raise BackendClosed(f"{self} is closed")
        return self._engine

    # -- TransferBackend ------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> TransferOp:
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"submit needs a TransferPlan, got {type(plan).__name__}")
        op = TransferOp(plan)
        if not plan.batches:  # nothing to move is done, and says so at once
            op._resolve(None)
            op._quiesce()
            return op
        with self._lock:
            if self._closed:
                error: TransferError = BackendClosed(f"{self} is closed", peer=plan.peer)
            elif len(self._live) >= self._max_pending:
                error = Backpressure(
                    f"{len(self._live)} ops pending on {self._session_id} "
                    f"(max_pending={self._max_pending})",
                    peer=plan.peer,
                )
            else:
                self._live.add(op)
                self._queue.put(op)
                return op
        op._resolve(error)
        op._quiesce()
        return op

    def probe(self, peer: str, timeout: float | None = None) -> None:
        """Return if ``peer`` answers within ``timeout`` (default: probe_timeout_s);
        raise PeerUnreachable with the probe's code otherwise."""
        if self._closed:
            raise PeerUnreachable(f"{self} is closed", peer=peer)
        verdict, rc = self._liveness(peer, timeout)
        if verdict is not Liveness.ALIVE:
            raise PeerUnreachable(
                f"probe of {peer}: {verdict.value} ({code_name(rc)})", peer=peer, code=rc
            )

    def close(self) -> None:
        """Stop: fail queued ops, let running ones stop at their next batch, wait
        up to close_timeout_s for them, then release the engine. Idempotent.

        An engine with a call still running (a frozen peer) is never destroyed:
        it is kept alive, unused, until the process exits.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:  # queued ops never reach the engine
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                break
            if op is not None:
                error = BackendClosed(
                    f"{self} closed before the transfer started", peer=op.plan.peer
                )
                self._finish(op, error)
        for _ in self._workers:
            self._queue.put(None)
        deadline = time.monotonic() + self._close_timeout_s
        me = threading.current_thread()
        for t in self._workers:
            if t is not me:  # a done callback may close the backend from a worker
                t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            running = sum(t.is_alive() and t is not me for t in self._workers) + len(self._probes)
            engine, self._engine = self._engine, None
            caches = list(self._caches.values())
            self._caches.clear()
            self._reindex()
        if running:
            _ABANDONED.append(engine)
            _log.warning("engine_abandoned", session=self._session_id, calls_running=running)
            return
        for cache in caches:
            for region in cache.regions():
                engine.unregister_memory(region.base)

    # -- worker side ----------------------------------------------------------------

    def _work(self) -> None:
        get = self._queue.get
        while (op := get()) is not None:
            error: TransferError | None = EngineError("worker interrupted", peer=op.plan.peer)
            try:
                error = self._execute(op)
            except Exception as exc:  # the binding raised: a bug or a bad argument
                error = EngineError(f"transfer to {op.plan.peer} raised {exc!r}", peer=op.plan.peer)
                error.__cause__ = exc
            finally:
                # Only here has the last engine call on the plan returned.
                self._finish(op, error)
                # An idle worker must not keep its last op (and its plan) alive.
                del op, error

    def _finish(self, op: TransferOp, error: TransferError | None) -> None:
        op._resolve(error)
        with self._lock:
            self._live.discard(op)
        op._quiesce()

    def _execute(self, op: TransferOp) -> TransferError | None:
        plan = op.plan
        peer = plan.peer
        state = self._peer(peer)
        if state.dead is not None:
            # A dead peer costs the engine ~1 s of backoff per call; a probe
            # costs milliseconds and tells whether it came back.
            verdict, rc = self._liveness(peer)
            if verdict is not Liveness.ALIVE:
                return PeerUnreachable(
                    f"peer {peer} still {verdict.value} ({code_name(rc)}); nothing sent",
                    peer=peer,
                    code=rc,
                )
        starts, ends = self._spans
        for index, batch in enumerate(plan.batches):
            for addr, length in zip(batch.src, batch.lengths, strict=True):
                i = bisect_right(starts, addr) - 1
                if i < 0 or addr + length > ends[i] or length <= 0:
                    return InvalidPlan(
                        f"batch {index}: source [{addr:#x}, +{length}) is not in memory "
                        f"registered with {self._session_id}; nothing sent",
                        peer=peer,
                    )
        engine = self._engine
        if engine is None:  # closed under us; close() waits for this worker
            return BackendClosed(f"{self} closed before the transfer started", peer=peer)
        write = engine.batch_transfer_sync_write
        total = len(plan.batches)
        for index, batch in enumerate(plan.batches):
            # A batch over the whole budget runs alone (and the engine fails it).
            need = min(len(batch.lengths), self._peer_entries)
            stop = self._stopped(op, index, total) or self._acquire(state, need, op, index, total)
            if stop is not None:
                return stop
            try:
                rc = write(peer, batch.src, batch.dst, batch.lengths)
            finally:
                with self._budget:
                    state.entries -= need
                    self._budget.notify_all()
            if rc != 0:
                return self._classify(peer, state, rc, index, total)
            state.reached = True
        return None

    def _stopped(self, op: TransferOp, index: int, total: int) -> TransferError | None:
        """Why the op must not start batch ``index``, if it must not."""
        where = f"before batch {index + 1}/{total}"
        if op.cancelled:
            return TransferCancelled(f"cancelled {where}", peer=op.plan.peer)
        if self._closed:
            return BackendClosed(f"{self} closed {where}", peer=op.plan.peer)
        return None

    def _acquire(
        self, state: _PeerState, need: int, op: TransferOp, index: int, total: int
    ) -> TransferError | None:
        """Take ``need`` entries of the peer's budget, or say why the op stopped waiting."""
        with self._budget:
            while state.entries + need > self._peer_entries:
                stop = self._stopped(op, index, total)
                if stop is not None:
                    return stop
                self._budget.wait(_BUDGET_POLL_S)
            state.entries += need
        return None

    def _classify(
        self, peer: str, state: _PeerState, rc: int, index: int, total: int
    ) -> TransferError:
        # Bytes may have landed if an earlier batch did, or if the peer was
        # reachable before this call (the failing batch may be half written).
        moved = index > 0 or state.reached
        verdict, probe_rc = self._liveness(peer)
        cls = FAILURE_CLASS[verdict, moved]
        _log.warning(
            "transfer_failed",
            peer=peer,
            batch=index,
            batches=total,
            rc=rc,
            liveness=verdict.value,
            probe_rc=probe_rc,
            error=cls.__name__,
        )
        return cls(
            f"batch {index + 1}/{total} to {peer} returned {rc}; "
            f"probe: {verdict.value} ({code_name(probe_rc)})",
            peer=peer,
            code=rc,
        )

    def _peer(self, peer: str) -> _PeerState:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers.setdefault(peer, _PeerState())
        return state

    def _liveness(self, peer: str, timeout: float | None = None) -> tuple[Liveness, int | None]:
        """Probe ``peer``, waiting at most ``timeout``; record the verdict."""
        with self._lock:
            call = self._probes.get(peer)
            if call is None:
                if self._engine is None:
                    return Liveness.REFUSED, None
                call = self._probes[peer] = _ProbeCall()
                threading.Thread(
                    target=self._probe_thread,
                    args=(self._engine, peer, call),
                    name=f"kvguard-probe-{peer}",
                    daemon=True,
                ).start()
        state = self._peer(peer)
        if not call.done.wait(self._probe_timeout_s if timeout is None else timeout):
            state.dead = Liveness.SILENT
            return Liveness.SILENT, None
        if call.rc == 0:
            state.dead = None
            state.reached = True
            return Liveness.ALIVE, 0
        state.dead = Liveness.REFUSED
        return Liveness.REFUSED, call.rc

    def _probe_thread(self, engine: Any, peer: str, call: _ProbeCall) -> None:
        try:
            call.rc = int(engine.send_probe(peer))
        except Exception:
            _log.exception("probe_raised", peer=peer)
        finally:
            with self._lock:
                if self._probes.get(peer) is call:
                    del self._probes[peer]
            call.done.set()


def _make_engine(
    local_ip: str,
    metadata: str,
    protocol: str,
    device_name: str,
    force_tcp: bool,
    transfer_timeout_s: int | None,
) -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise EngineError(
            "mooncake.engine is not importable: install mooncake-transfer-engine "
            "(or -non-cuda) and the libibverbs1 system package"
        ) from exc
    with _ENV_LOCK:
        saved = os.environ.get("MC_TRANSFER_TIMEOUT")
        if force_tcp:
            os.environ["MC_FORCE_TCP"] = "1"
        if transfer_timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
        try:
            engine = TransferEngine()
            rc = engine.initialize(local_ip, metadata, protocol, device_name)
        finally:
            # Read during construction: restoring keeps other engines' defaults.
            if saved is None:
                os.environ.pop("MC_TRANSFER_TIMEOUT", None)
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = saved
    if rc != 0:
        raise RegistrationError(
            f"TransferEngine.initialize({local_ip!r}, {metadata!r}, {protocol!r}, "
            f"{device_name!r}) returned {code_name(rc)}",
            peer=metadata,
            code=rc,
        )
    return engine


def is_wildcard(local_ip: str) -> bool:
    """True for an address that means "every interface": 0.0.0.0, ::, [::]:port, ""."""
    host = local_ip.strip()
    if host.startswith("["):  # [v6]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # v4:port or name:port
        host = host.partition(":")[0]
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return False


def _location(device: torch.device) -> str:
    template = _LOCATIONS.get(device.type)
    if template is None:
        raise RegistrationError(f"the engine cannot register {device.type} memory")
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return template.format(i=index)


def _base(region: Region) -> int:
    return region.base


def _reads_from(plan: TransferPlan, regions: tuple[Region, ...]) -> bool:
    return any(any(r.base <= addr < r.end for r in regions) for b in plan.batches for addr in b.src)
