"""Peer liveness for the Mooncake backend: bounded probes, what they learnt
of each peer, the error a failed transfer gets from them, and the hooks
through which the engine loop asks.

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
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from ._engine import ENGINE_EXIT, code_name
from ._loop_api import EngineOp, PeerCheck
from .errors import EngineError, PeerLost, PeerUnreachable, TransferError

__all__ = ["FAILURE_CLASS", "LoopHooks", "PeerLiveness", "PeerState", "ProbeVerdict", "failure_of"]

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
class PeerState:
    """What this backend has learnt about one peer. Written by probes; each
    field is a single reference, so a racy read sees an old or a new value."""

    reached: bool = False  # a probe or transfer to it succeeded once
    dead: ProbeVerdict | None = None  # verdict of the last failed probe; None while believed alive


class ProbeCall:
    """One in-flight ``send_probe``; every waiter on the same peer shares it."""

    __slots__ = ("done", "rc")

    done: threading.Event  # set once rc is final
    rc: int

    def __init__(self) -> None:
        self.done = threading.Event()
        self.rc = -1


class PeerLiveness:
    """What probes learnt of each peer, and the probes in flight (one per peer).

    It shares its backend's lock: a probe starts only while the backend still
    holds its engine, and the backend's close() counts the probes it leaves
    running under the same lock.
    """

    _lock: threading.Lock  # the backend's; guards _probes
    _engine: Callable[[], Any]  # the backend's engine (call under _lock); None once closed
    _probes: dict[str, ProbeCall]  # (L) at most one send_probe per peer in flight
    # states are mutated in place; an entry goes only with forget (no op to it left)
    _peers: dict[str, PeerState]
    _probe_timeout_s: float

    def __init__(
        self, lock: threading.Lock, engine: Callable[[], Any], probe_timeout_s: float
    ) -> None:
        self._lock = lock
        self._engine = engine
        self._probes = {}
        self._peers = {}
        self._probe_timeout_s = probe_timeout_s

    def running(self) -> int:
        """Probes in flight; the caller holds the lock."""
        return len(self._probes)

    def forget(self, peer: str) -> None:
        """Forget what probes learnt of ``peer`` (a peer the backend removed)."""
        self._peers.pop(peer, None)

    def needs_check(self, peer: str) -> bool:
        """Whether ``peer`` must be probed before entries go to it: never reached, or dead."""
        state = self.state_of(peer)
        return state.dead is not None or not state.reached

    def state_of(self, peer: str) -> PeerState:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers.setdefault(peer, PeerState())
        return state

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        """Probe ``peer`` on another thread; set the check's ``done``, then call ``wake``."""
        check = PeerCheck()

        def run() -> None:
            try:
                verdict, rc = self.probe(peer)
                check.verdict, check.rc, check.alive = verdict, rc, verdict is ProbeVerdict.ALIVE
            except Exception:  # a bug; the peer counts as gone, which fails safe
                _log.exception("peer_check_raised", peer=peer)
                check.verdict = ProbeVerdict.REFUSED
            finally:
                check.done.set()
                wake()

        threading.Thread(target=run, name=f"kvguard-check-{peer}", daemon=True).start()
        return check

    def probe(self, peer: str, timeout: float | None = None) -> tuple[ProbeVerdict, int | None]:
        """Probe ``peer``, waiting at most ``timeout``; record the verdict."""
        with self._lock:
            call = self._probes.get(peer)
            if call is None:
                engine = self._engine()
                if engine is None:
                    return ProbeVerdict.REFUSED, None
                call = self._probes[peer] = ProbeCall()
                prober = threading.Thread(
                    target=self._probe_thread,
                    args=(engine, peer, call),
                    name=f"kvguard-probe-{peer}",
                    daemon=True,
                )
                ENGINE_EXIT.track(prober)
                prober.start()
        state = self.state_of(peer)
        if not call.done.wait(self._probe_timeout_s if timeout is None else timeout):
            state.dead = ProbeVerdict.SILENT
            return ProbeVerdict.SILENT, None
        if call.rc == 0:
            state.dead = None
            state.reached = True
            return ProbeVerdict.ALIVE, 0
        state.dead = ProbeVerdict.REFUSED
        return ProbeVerdict.REFUSED, call.rc

    def _probe_thread(self, engine: Any, peer: str, call: ProbeCall) -> None:
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


def failure_of(op: EngineOp, check: PeerCheck) -> TransferError:
    """The error ``op`` fails with, given the verdict of the check on its peer."""
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


class LoopHooks:
    """The engine loop's view of its backend (``_loop_api.Hooks``): peers are
    judged here; whether an op must stop, and its retirement, are the backend's."""

    __slots__ = ("_liveness", "_retire", "_stopped")

    _liveness: PeerLiveness
    _stopped: Callable[[EngineOp], TransferError | None]
    _retire: Callable[[EngineOp], None]

    def __init__(
        self,
        liveness: PeerLiveness,
        stopped: Callable[[EngineOp], TransferError | None],
        retire: Callable[[EngineOp], None],
    ) -> None:
        self._liveness = liveness
        self._stopped = stopped
        self._retire = retire

    def needs_check(self, peer: str) -> bool:
        return self._liveness.needs_check(peer)

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        return self._liveness.start_check(peer, wake)

    def failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        return failure_of(op, check)

    def stopped(self, op: EngineOp) -> TransferError | None:
        return self._stopped(op)

    def retire(self, op: EngineOp) -> None:
        self._retire(op)
