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
* The engine gives no reason for a failure. It is classified by probing the
  peer (``FAILURE_CLASS``): a peer that still answers means the engine failed
  (EngineError, retryable); one that refuses or stays silent is gone --
  PeerLost when the engine accepted an entry of the plan, PeerUnreachable when
  it accepted none. A plan succeeds only if every entry ended with status 1.
* A frozen peer leaves entries without a final status indefinitely. Past the
  engine's own timeout (MC_TRANSFER_TIMEOUT + 1 ns per byte) the peer is
  probed and the op fails PeerLost, still quarantined.
* ``send_probe`` to a frozen peer blocks for about 60 s. Probes run on their
  own daemon threads, at most one per peer at a time, and are waited for with
  a bound; a probe that does not answer in time counts as a silent peer.
  A peer never reached, or found dead, is probed before entries go to it, so
  the loop never blocks on a handshake and a dead peer fails in milliseconds.
* The TCP transport queues MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024) entries
  per peer plus MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (1024) waiting ones,
  and fails the rest. The loop budgets that many entries per peer, each from
  submit until its final status. A waiting entry fails after
  MC_TCP_ADMISSION_TIMEOUT_MS (1 s) if the queue does not drain: that is how
  a frozen peer's large op fails in ~2 s rather than at the engine timeout.
* Done and quiesce callbacks run on the engine loop thread: keep them short.
* Over TCP the engine reads unregistered local memory and, on the legacy
  protocol, writes outside the peer's memory without complaint: sources are
  checked against the registered caches and destinations against the regions
  the peer advertised (``add_peer``) before anything is sent.
* The engine's glog INFO/WARNING lines are silenced (MC_LOG_LEVEL=ERROR,
  read when the library loads) unless KVGUARD_ENGINE_LOG=1 or MC_LOG_LEVEL
  is set.

The ``mooncake`` package is imported when a backend is built, not when this
module is, so ``transfer`` imports on hosts without the wheel.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

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
from ._poller import EngineLoop, EngineOp, PeerCheck
from .backend import (
    QuarantineTally,
    TransferBackend,
    TransferOp,
    TransferPlan,
    check_destinations,
    check_ranges,
)
from .cache import KVCache
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
from .regions import Region, RegionIndex

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


class ProbeVerdict(enum.Enum):
    """What a bounded ``send_probe`` says about a peer."""

    ALIVE = "alive"  # returned 0
    REFUSED = "refused"  # returned an error code: refused, unknown, bad metadata
    SILENT = "silent"  # no answer within the bound: frozen or partitioned


# (probe verdict after a failure, did the engine accept an entry of the plan)
# -> the error the op fails with. Only a live peer makes a retry useful.
FAILURE_CLASS: Final[Mapping[tuple[ProbeVerdict, bool], type[TransferError]]] = {
    (ProbeVerdict.ALIVE, False): EngineError,
    (ProbeVerdict.ALIVE, True): EngineError,
    (ProbeVerdict.REFUSED, False): PeerUnreachable,
    (ProbeVerdict.REFUSED, True): PeerLost,
    (ProbeVerdict.SILENT, False): PeerUnreachable,
    (ProbeVerdict.SILENT, True): PeerLost,
}


@dataclass(slots=True)
class _PeerState:
    """What this backend has learnt about one peer. Written by probes; each
    field is a single reference, so a racy read sees an old or a new value."""

    reached: bool = False  # a probe or transfer to it succeeded once
    dead: ProbeVerdict | None = None  # verdict of the last failed probe; None while believed alive


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
    _caches: dict[int, KVCache]  # (L) id -> registered cache, kept alive while registered
    _sources: RegionIndex  # (L) registered memory; replaced, never mutated
    _live: set[TransferOp]  # (L) submitted and not yet quiesced
    _probes: dict[str, _ProbeCall]  # (L) at most one send_probe per peer in flight
    # states are mutated in place; an entry goes only with remove_peer (no op to it left)
    _peers: dict[str, _PeerState]
    _loop: EngineLoop  # the only caller of transfer_submit_write / transfer_check_status
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
        self._caches = {}
        self._sources = RegionIndex(())
        self._live = set()
        self._probes = {}
        self._peers = {}
        self._max_pending = max_pending
        self._probe_timeout_s = probe_timeout_s
        self._close_timeout_s = close_timeout_s
        if max_peer_entries is not None:
            budget = min(budget, max_peer_entries)
        self._loop = EngineLoop(
            self._engine, _Hooks(self), budget, timeout_s, f"kvguard-mooncake-{self._session_id}"
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
            if id(cache) in self._caches:
                raise RegistrationError(f"{cache!r} is already registered with {self}")
            done: list[int] = []
            for index, region in enumerate(cache.regions()):
                rc = engine.register_memory(region.base, region.length, where)
                if rc != 0:
                    for base in done:  # all or nothing: undo this call's registrations
                        if (undo := engine.unregister_memory(base)) != 0:
                            _log.warning("unregister_failed", base=hex(base), rc=code_name(undo))
                    raise RegistrationError(
                        f"register_memory of buffer {index} at {region.base:#x} "
                        f"(+{region.length}, location {where!r}) returned {code_name(rc)}",
                        code=rc,
                    )
                done.append(region.base)
            self._caches[id(cache)] = cache
            self._reindex()

    def unregister(self, cache: KVCache) -> None:
        """Unregister ``cache``. Refused while an op that reads from it is not quiesced."""
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
        self._sources = RegionIndex(r for c in self._caches.values() for r in c.regions())

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
            closed, sources = self._closed, self._sources
        if closed:
            return _finished(TransferOp(plan), BackendClosed(f"{self} is closed", peer=plan.peer))
        try:
            _check_sources(plan, sources, self._session_id)
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
        verdict, rc = self._liveness(peer, timeout)
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
            caches = list(self._caches.values())
            self._caches.clear()
            self._reindex()
            held = len(self._live)
            probes = len(self._probes)
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
        for cache in caches:
            for region in cache.regions():
                if (rc := engine.unregister_memory(region.base)) != 0:
                    _log.warning("unregister_failed", base=hex(region.base), rc=code_name(rc))
        if loop.release_engine():
            del engine  # the last reference: the engine is destroyed here, now

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer's regions and what probes learnt of it (a decode that
        churned away); ops already submitted to it run on."""
        super().remove_peer(session_id)
        self._peers.pop(session_id, None)

    # -- what the engine loop asks ----------------------------------------------------

    def _peer(self, peer: str) -> _PeerState:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers.setdefault(peer, _PeerState())
        return state

    def _check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        check = PeerCheck()

        def run() -> None:
            try:
                verdict, rc = self._liveness(peer)
                check.verdict, check.rc, check.alive = verdict, rc, verdict is ProbeVerdict.ALIVE
            except Exception:  # a bug; the peer counts as gone, which fails safe
                _log.exception("peer_check_raised", peer=peer)
                check.verdict = ProbeVerdict.REFUSED
            finally:
                check.done.set()
                wake()

        threading.Thread(target=run, name=f"kvguard-check-{peer}", daemon=True).start()
        return check

    def _failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        verdict = check.verdict if isinstance(check.verdict, ProbeVerdict) else ProbeVerdict.REFUSED
        peer, plan = op.plan.peer, op.plan
        cls = FAILURE_CLASS[verdict, op.moved]
        what = op.failure or f"peer {peer} is {verdict.value}"
        _log.warning(
            "transfer_failed",
            peer=peer,
            failure=what,
            entries=plan.num_entries,
            completed=op.completed,
            with_engine=op.inflight,
            liveness=verdict.value,
            probe_rc=check.rc,
            error=cls.__name__,
        )
        sent = (
            f"{op.completed}/{plan.num_entries} entries done, {op.inflight} still with the engine"
            if op.moved
            else "nothing sent"
        )
        return cls(
            f"transfer to {peer}: {what}; {sent}; probe: {verdict.value} ({code_name(check.rc)})",
            peer=peer,
            code=check.rc if verdict is ProbeVerdict.REFUSED else None,
        )

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

    def _liveness(self, peer: str, timeout: float | None = None) -> tuple[ProbeVerdict, int | None]:
        """Probe ``peer``, waiting at most ``timeout``; record the verdict."""
        with self._lock:
            call = self._probes.get(peer)
            if call is None:
                engine = self._engine
                if engine is None:
                    return ProbeVerdict.REFUSED, None
                call = self._probes[peer] = _ProbeCall()
                prober = threading.Thread(
                    target=self._probe_thread,
                    args=(engine, peer, call),
                    name=f"kvguard-probe-{peer}",
                    daemon=True,
                )
                ENGINE_EXIT.track(prober)
                prober.start()
        state = self._peer(peer)
        if not call.done.wait(self._probe_timeout_s if timeout is None else timeout):
            state.dead = ProbeVerdict.SILENT
            return ProbeVerdict.SILENT, None
        if call.rc == 0:
            state.dead = None
            state.reached = True
            return ProbeVerdict.ALIVE, 0
        state.dead = ProbeVerdict.REFUSED
        return ProbeVerdict.REFUSED, call.rc

    def _probe_thread(self, engine: Any, peer: str, call: _ProbeCall) -> None:
        try:
            if not ENGINE_EXIT.closing:  # past it the call stays -1: refused
                call.rc = int(engine.send_probe(peer))
        except Exception:
            _log.exception("probe_raised", peer=peer)
        finally:
            with self._lock:
                if self._probes.get(peer) is call:
                    del self._probes[peer]
            call.done.set()


class _Hooks:
    """The engine loop's view of its backend (``_poller.Hooks``)."""

    __slots__ = ("_b",)

    def __init__(self, backend: MooncakeBackend) -> None:
        self._b = backend

    def needs_check(self, peer: str) -> bool:
        state = self._b._peer(peer)
        return state.dead is not None or not state.reached

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        return self._b._check(peer, wake)

    def failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        return self._b._failed(op, check)

    def stopped(self, op: EngineOp) -> TransferError | None:
        return self._b._stopped(op)

    def retire(self, op: EngineOp) -> None:
        self._b._retire(op)


def _finished(op: TransferOp, error: TransferError | None) -> TransferOp:
    op._resolve(error)
    op._quiesce()
    return op


def _check_sources(plan: TransferPlan, sources: RegionIndex, session: str) -> None:
    outside = f"is not in memory registered with {session}"
    check_ranges(plan, sources, sources=True, error=InvalidPlan, outside=outside)


def _reads_from(plan: TransferPlan, regions: tuple[Region, ...]) -> bool:
    index = RegionIndex(regions)
    return any(index.contains(addr, 1) for b in plan.batches for addr in b.src)
