"""What wakes an engine core that waits for KV: a worker's hold or load ended.

vLLM steps an engine that has requests but nothing to run (a decode whose
requests wait for their KV, a prefill holding blocks for decodes) about
once a millisecond: each step schedules nothing, hands the workers an empty
batch and reads their answers, and with the multiprocess executor the
engine core and each worker spin while they wait for each other. On a host
with few CPUs that loop takes the cycles the transfer itself needs: inside
vLLM on 2 CPUs the same 54 MB moved at a quarter of the engine's own rate.

So a step that schedules nothing while kvguard holds or loads KV waits for
the first of them to end, for at most ``kvguard_idle_wait_ms``: the
``Doorbell`` in the engine core. The workers' threads ``Bell.ring`` it the
moment a hold is released or a load reported, so the step that follows
finds it; a wait that ends by its timeout changes nothing but the pace of
the loop. A ring is a hint, never a message: one lost (the engine core
not listening yet, a full pipe that already holds a ring) costs at most
one wait's bound, and nothing waits on it for correctness.

The two meet at an abstract IPC socket (Linux: no file, no ``TMPDIR``)
named after the engine's ``engine_id`` and role. A second engine given the
same id and role on one host cannot bind it, and runs without a doorbell.

No doorbell either where a step with nothing scheduled may still have a
forward in flight or owe its output to others: vLLM's batch queue (async
scheduling, pipeline parallel) takes a step's output a step later, so a
ring would be spent on the wrong step and an engine could wait beside a
running forward; with data parallel an idle rank runs dummy batches in
step with the others, which it would hold up. Nor does anything ring for
what vLLM waits on itself (grammar compilation, streamed input): such a
request starts at most one wait's bound later.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import TYPE_CHECKING, Final

import structlog
import zmq

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["Bell", "Doorbell", "bell_endpoint", "doorbell_route"]

_log = structlog.get_logger("kvguard.vllm")
_RING: Final = b"\x01"


def bell_endpoint(engine_id: str, producer: bool) -> str:
    """The abstract IPC endpoint of ``engine_id``'s doorbell in its role (a
    prefill and a decode given one id keep apart)."""
    role = "prefill" if producer else "decode"
    digest = hashlib.sha256(f"{engine_id}/{role}".encode()).hexdigest()[:24]
    return f"ipc://@kvguard-{digest}"


def doorbell_route(config: VllmConfig, producer: bool, wait_ms: float) -> tuple[str, str]:
    """Where this engine's doorbell listens and its workers ring, and "";
    or "" and why it has none (the module's docstring says when)."""
    engine_id = config.kv_transfer_config.engine_id if config.kv_transfer_config else None
    off = (
        (wait_ms <= 0, "kvguard_idle_wait_ms is 0"),
        (config.max_concurrent_batches > 1, "vLLM's batch queue reads a step's output late"),
        (config.parallel_config.data_parallel_size > 1, "data parallel ranks step together"),
        (not engine_id, "no engine id"),
    )
    why = next((reason for applies, reason in off if applies), "")
    return ("", why) if why else (bell_endpoint(str(engine_id), producer), "")


class Doorbell:
    """The engine core's end: waits until a worker rings, or a timeout."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)  # one ring queued says as much as many
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._ctx.term()
            raise OSError(f"kvguard doorbell cannot listen on {endpoint}: {exc}") from exc
        self._sock = sock

    def wait(self, timeout_s: float) -> bool:
        """Until some worker rang since the last wait, at most ``timeout_s``;
        whether one did. Every ring before the call counts (a step may
        find what it announced without waiting)."""
        if self._drain():
            return True
        if not self._sock.poll(max(0, round(timeout_s * 1000))):
            return False
        self._drain()
        return True

    def _drain(self) -> bool:
        rung = False
        while True:
            try:
                self._sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return rung
            rung = True

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class Bell:
    """A worker's end, used by one thread only (its sender's or receiver's);
    on endpoint "" (no doorbell) it rings nothing."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self._sock: zmq.Socket[bytes] | None = None
        if not endpoint:
            return
        sock: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1)  # a ring already queued wakes the engine
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:  # the engine core's waits then end by their bound
            sock.close()
            _log.warning("idle_bell_unavailable", endpoint=endpoint, error=str(exc))
            return
        self._sock = sock

    def ring(self) -> None:
        """Wake the engine core if it waits; never blocks."""
        if self._sock is None:
            return
        # Again: not connected yet, or a ring is already queued.
        with contextlib.suppress(zmq.Again):
            self._sock.send(_RING, flags=zmq.NOBLOCK)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
