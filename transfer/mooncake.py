"""MooncakeBackend: the Mooncake transfer engine behind ``TransferBackend``.

How the engine behaves (measured over loopback TCP) and how that maps onto
the backend contract:

* A returned or timed-out engine call is not a quiesced transfer: the engine
  keeps moving slices after it. Entries therefore go one by one through
  ``transfer_submit_write``, and one engine loop thread per backend
  (``_poller.EngineLoop``) polls ``transfer_check_status`` until each has a
  final status. An op's *result* may end early (failure, cancel, close, a
  peer found gone); its *quiescence* comes only when every entry the engine
  accepted has a final status; only then may its blocks be reused. In
  between it is quarantined (``quarantined()``), for as long as the peer
  stays frozen.
* The engine gives no reason for a failure: it is classified by probing the
  peer, with bounded probes on their own threads (``_liveness``: how, and
  why; ``FAILURE_CLASS`` and ``ProbeVerdict`` are re-exported here). A plan
  succeeds only if every entry ended with status 1.
* The engine queues a bounded number of entries per peer and fails the
  rest: the loop budgets entries per peer (``_poller``: the limits, and how a
  frozen peer's large op fails in ~2 s rather than at the engine timeout).
* Done and quiesce callbacks run on the engine loop thread: keep them short.
* Over TCP the engine reads unregistered local memory and, on the legacy
  protocol, writes outside the peer's memory without complaint: sources are
  checked against the registered caches (``_memory``) and destinations against
  the regions the peer advertised (``add_peer``) before anything is sent.
* The engine's glog INFO/WARNING lines are silenced (MC_LOG_LEVEL=ERROR,
  read when the library loads) unless KVGUARD_ENGINE_LOG=1 or MC_LOG_LEVEL
  is set.

The ``mooncake`` package is imported when a backend is built, not when this
module is, so ``transfer`` imports on hosts without the wheel.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import structlog

from ._engine import (
    DEFAULT_MAX_PEER_ENTRIES,
    ENGINE_CODES,
    ENGINE_EXIT,
    MIN_TRANSFER_TIMEOUT_S,
    P2P_HANDSHAKE,
    code_name,
    engine_peer_budget,
    import_engine,
    is_wildcard,
    keep_forever,
    location,
    make_engine,
)
from ._liveness import FAILURE_CLASS, LoopHooks, PeerLiveness, ProbeVerdict
from ._memory import RegisteredMemory, check_sources, unregister_all
from ._poller import EngineLoop, EngineOp
from .backend import QuarantineTally, TransferBackend, TransferOp, TransferPlan, check_destinations
from .cache import KVCache
from .errors import (
    BackendClosed,
    Backpressure,
    InvalidPlan,
    PeerUnreachable,
    RegistrationError,
    TransferCancelled,
    TransferError,
)

__all__ = [
    "DEFAULT_MAX_PEER_ENTRIES",
    "ENGINE_CODES",
    "FAILURE_CLASS",
    "P2P_HANDSHAKE",
    "MooncakeBackend",
    "ProbeVerdict",
    "code_name",
    "engine_peer_budget",
    "import_engine",
    "is_wildcard",
]

_log = structlog.get_logger("kvguard.transfer")


class MooncakeBackend(TransferBackend):
    """Writes plans to peers through one ``mooncake.engine.TransferEngine``.

    ``local_ip`` is this host's address. With ``metadata="P2PHANDSHAKE"`` no
    metadata server is needed and the session id is ``"ip:rpc_port"``; with a
    metadata URL (``http://host:port/metadata``, ``etcd://...``,
    ``redis://...``) the session id is ``local_ip`` as given, so make it
    unique per engine (``"10.0.0.5:17777"``).

    Plans go only to peers added with ``add_peer(PeerInfo)``: their regions
    bound every destination range.

    The engine listens on every interface whatever ``local_ip`` says (its RPC
    and TCP-transport ports bind the wildcard address): ``local_ip`` is the
    address peers are told to use, not a filter on who may connect
    (docs/security.md).
    """

    name = "mooncake"

    _engine: Any  # mooncake.engine.TransferEngine; None once close() let go of it
    _session_id: str
    _lock: threading.Lock  # guards the fields below marked (L)
    _closed: bool  # (L) once True: submit fails fast, the loop hands over nothing more
    _memory: RegisteredMemory  # (L) the registered caches and the index of their regions
    _live: set[TransferOp]  # (L) submitted and not yet quiesced
    _liveness: PeerLiveness  # probes (under _lock) and what they learnt of each peer
    _loop: EngineLoop  # the only caller of transfer_submit_write / transfer_check_status
    _max_pending: int
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
        max_peer_entries: int | None = None,
        transfer_timeout_s: int | None = None,
        probe_timeout_s: float = 1.0,
        close_timeout_s: float = 5.0,
    ) -> None:
        """Build and initialize the engine; raise RegistrationError if it refuses.

        ``protocol`` is passed through but does not pick the transport: the
        engine prefers RDMA when a NIC exists, so ``force_tcp`` sets
        MC_FORCE_TCP=1. ``transfer_timeout_s`` sets MC_TRANSFER_TIMEOUT for
        this engine only (the engine default is 30 s); past it an op whose
        entries have no final status fails PeerLost (or EngineError if the
        peer answers) and stays quarantined. At most ``max_pending`` ops may
        be submitted and not quiesced before submit answers Backpressure.
        Entries to one peer, from submit to final status, are at most
        ``max_peer_entries`` (default and ceiling: the engine's own per-peer
        limits, ``engine_peer_budget()``). ``max_inflight`` is accepted and
        ignored: one engine loop thread replaced the spinning workers. A
        wildcard ``local_ip`` (0.0.0.0, ::) is logged as a warning.
        """
        for name, value in (
            ("max_inflight", 1 if max_inflight is None else max_inflight),
            ("max_pending", max_pending),
            ("max_peer_entries", 1 if max_peer_entries is None else max_peer_entries),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
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
        self._engine, timeout_s, budget = make_engine(
            local_ip, metadata, protocol, device_name, force_tcp, transfer_timeout_s
        )
        p2p = metadata == P2P_HANDSHAKE
        self._session_id = f"{local_ip}:{self._engine.get_rpc_port()}" if p2p else local_ip
        self._lock = threading.Lock()
        self._closed = False
        self._memory = RegisteredMemory()
        self._live = set()
        self._liveness = PeerLiveness(self._lock, lambda: self._engine, probe_timeout_s)
        self._max_pending = max_pending
        self._close_timeout_s = close_timeout_s
        if max_peer_entries is not None:
            budget = min(budget, max_peer_entries)
        self._loop = EngineLoop(
            self._engine,
            LoopHooks(self._liveness, self._stopped, self._retire),
            budget,
            timeout_s,
            f"kvguard-mooncake-{self._session_id}",
        )

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
        """Ops submitted and not yet quiesced (quarantined ones included)."""
        return len(self._live)

    def quarantined(self) -> QuarantineTally:
        """Ops failed or given up whose entries the engine still holds, and their bytes."""
        with self._lock:
            held = [op for op in self._live if op.quarantined]
        return QuarantineTally(len(held), sum(op.nbytes for op in held))

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

    # -- memory registration and peers ---------------------------------------------

    def register(self, cache: KVCache) -> None:
        """Register every buffer of ``cache``; all or nothing.

        Raises RegistrationError when ``cache`` is already registered, or when
        the engine refuses a buffer (the error names its address and code).
        """
        if not isinstance(cache, KVCache):
            raise RegistrationError(f"register needs a KVCache, got {type(cache).__name__}")
        where = location(cache.device)
        with self._lock:
            engine = self._open_engine()
            if cache in self._memory:
                raise RegistrationError(f"{cache!r} is already registered with {self}")
            self._memory.add(engine, cache, where)

    def unregister(self, cache: KVCache) -> None:
        """Unregister ``cache``. Refused while an op that reads from it is not quiesced."""
        with self._lock:
            engine = self._open_engine()
            if cache not in self._memory:
                raise RegistrationError(f"{cache!r} is not registered with {self}")
            failed = self._memory.remove(engine, cache, self._live)
        if failed:
            base, rc = failed[0]
            raise RegistrationError(
                f"unregister_memory failed for {len(failed)} buffer(s), first at {base:#x}: "
                f"{code_name(rc)}",
                code=rc,
            )

    def _open_engine(self) -> Any:
        if self._closed:
            raise BackendClosed(f"{self} is closed")
        return self._engine

    # -- TransferBackend ------------------------------------------------------------

    def submit(self, plan: TransferPlan) -> TransferOp:
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"submit needs a TransferPlan, got {type(plan).__name__}")
        if not plan.batches:  # nothing to move is done, and says so at once
            return _finished(TransferOp(plan), None)
        with self._lock:
            closed, sources = self._closed, self._memory.sources
        if closed:
            return _finished(TransferOp(plan), BackendClosed(f"{self} is closed", peer=plan.peer))
        try:
            check_sources(plan, sources, self._session_id)
            check_destinations(plan, self.advertised_regions(plan.peer))
        except InvalidPlan as error:
            return _finished(TransferOp(plan), error)
        op = EngineOp(plan, self._loop)
        with self._lock:
            if self._closed or ENGINE_EXIT.closing:  # no loop runs past interpreter exit
                why = f"{self} is closed" if self._closed else "the interpreter is exiting"
                failure: TransferError = BackendClosed(why, peer=plan.peer)
            elif len(self._live) >= self._max_pending:
                failure = Backpressure(
                    f"{len(self._live)} ops pending on {self._session_id} "
                    f"(max_pending={self._max_pending})",
                    peer=plan.peer,
                )
            else:
                self._live.add(op)
                self._loop.post(op)
                return op
        return _finished(op, failure)

    def probe(self, peer: str, timeout: float | None = None) -> None:
        """Return if ``peer`` answers within ``timeout`` (default: probe_timeout_s);
        raise PeerUnreachable with the probe's code otherwise."""
        if self._closed:
            raise PeerUnreachable(f"{self} is closed", peer=peer)
        verdict, rc = self._liveness.probe(peer, timeout)
        if verdict is not ProbeVerdict.ALIVE:
            raise PeerUnreachable(
                f"probe of {peer}: {verdict.value} ({code_name(rc)})", peer=peer, code=rc
            )

    def close(self) -> None:
        """Stop: ops not yet handed over fail BackendClosed; wait up to
        close_timeout_s for the engine to give every accepted entry a final
        status; then unregister the memory and let the engine go. Idempotent.

        Memory the engine may still touch (a frozen peer's entries) is never
        unregistered or freed: the engine, the caches and the loop are kept
        alive, deliberately leaked, until the process exits, with a warning.
        The loop goes on polling, so those ops still quiesce when the engine
        is done with them; at interpreter exit it stops (``ENGINE_EXIT``) and
        they stay leaked.

        Otherwise the engine is destroyed before close() returns, on the
        closing thread. Its destructor joins the engine's threads with the GIL
        held (up to about 1 s), stalling every thread of the process: here, at a
        time the caller chose, rather than in a later cyclic GC pass on any
        thread, such as a scheduler's driver due to expire a request.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        loop = self._loop
        loop.stop()
        if threading.current_thread() is not loop.thread:  # a callback may close us
            loop.thread.join(self._close_timeout_s)
        with self._lock:
            engine, self._engine = self._engine, None
            caches = self._memory.take_all()
            held = len(self._live)
            probes = self._liveness.running()
        # A loop that ended holding ops (interpreter exit, a crash) did not see them quiesce.
        if loop.thread.is_alive() or held or probes:
            keep_forever((engine, caches, loop))
            _log.warning(
                "engine_memory_kept",
                session=self._session_id,
                ops_unquiesced=held,
                probes_running=probes,
                caches_kept=len(caches),
                why="the engine may still read or write this memory; unregistering or "
                "freeing it could corrupt it, so it is kept until the process exits",
            )
            return
        unregister_all(engine, caches)
        if loop.release_engine():
            del engine  # the last reference: the engine is destroyed here, now

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer's regions and what probes learnt of it (a decode that
        churned away); ops already submitted to it run on."""
        super().remove_peer(session_id)
        self._liveness.forget(session_id)

    # -- what the engine loop asks ----------------------------------------------------

    def _stopped(self, op: EngineOp) -> TransferError | None:
        total = op.plan.num_entries
        if op.cancelled:
            return TransferCancelled(f"cancelled ({total} entries planned)", peer=op.plan.peer)
        if self._closed:
            return BackendClosed(f"{self} closed before the transfer ended", peer=op.plan.peer)
        return None

    def _retire(self, op: EngineOp) -> None:
        with self._lock:
            self._live.discard(op)


def _finished(op: TransferOp, error: TransferError | None) -> TransferOp:
    op._resolve(error)
    op._quiesce()
    return op
