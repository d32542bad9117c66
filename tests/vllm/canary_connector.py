"""The I6 canary's connector: KVGuardConnector with a late prefill and a logging decode.

Its scheduler side (``CanaryScheduler``) logs allocations, its worker side
(``CanaryWorker``) is the late prefill engine and the fence log.

Loaded by tests/vllm/test_vllm_canary.py with ``kv_connector="CanaryKVGuardConnector"``
and ``kv_connector_module_path="tests.vllm.canary_connector"``. Both roles share the
directory named by ``KVGUARD_CANARY_DIR`` and append one JSON object per line
to its ``events.jsonl`` (wall-clock ``t``: the servers' processes compare times).

Prefill (``kv_producer``): the backend is a ``LateMooncakeBackend``. While the
file ``arm`` exists (it holds a delay in seconds), the next submit takes it and
hands its plan to the real Mooncake engine only that many seconds later: as if
the engine had accepted the write and sat on it. A cancel in between does not
stop it (accepted entries run on); the op quiesces once the real write did.
Events: ``write_submitted`` (with a digest of the source bytes in destination
order), ``write_issued``, ``write_landed``.

Decode (``kv_consumer``): ``alloc`` for every block allocation the scheduler
makes (``update_state_after_alloc``: a request's blocks; each step's output: the
blocks a running request grew by), ``fenced`` for every load the connector
reports fenced (its blocks and a digest of their bytes then), ``released`` when
its fence is lifted (the digest again: the late write must be in it). While the
file ``bypass`` exists, a fenced load is handed back to vLLM at once as finished
and failed (the behaviour before the fence, the negative control).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.metadata import KVGuardMetadata
from kvguard.vllm.scheduler_side import KVGuardScheduler
from kvguard.vllm.worker import KVGuardWorker
from transfer.backend import TransferOp, TransferPlan
from transfer.mooncake import MooncakeBackend

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvguard.vllm.decode_loads import LoadOutcome

__all__ = [
    "CanaryKVGuardConnector",
    "CanaryScheduler",
    "CanaryWorker",
    "LateMooncakeBackend",
    "digest_of",
]

DIR = Path(os.environ.get("KVGUARD_CANARY_DIR", "/nonexistent-canary-dir"))


def event(kind: str, **fields: Any) -> None:
    """Append one event; one write(2) on an O_APPEND file, so lines never interleave."""
    line = json.dumps({"event": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(DIR / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def digest_of(ranges: list[tuple[int, int]]) -> str:
    """sha256 of the bytes at ``(address, length)`` ranges of this process, in that order."""
    h = hashlib.sha256()
    for addr, length in ranges:
        h.update(ctypes.string_at(addr, length))
    return h.hexdigest()


def take_flag(name: str) -> str | None:
    """The flag file's text, removing it; None if absent (one taker wins)."""
    path = DIR / name
    try:
        text = path.read_text()
        path.unlink()
    except FileNotFoundError:
        return None
    return text


class LateMooncakeBackend(MooncakeBackend):
    """The real engine, told about an armed submit only ``delay`` seconds late."""

    def submit(self, plan: TransferPlan) -> TransferOp:
        armed = take_flag("arm")
        if armed is None:
            return super().submit(plan)
        delay = float(armed)
        triples = sorted(
            (d, s, n) for b in plan.batches for s, d, n in zip(b.src, b.dst, b.lengths, strict=True)
        )
        event(
            "write_submitted",
            delay_s=delay,
            nbytes=plan.nbytes,
            blocks=plan.num_blocks,
            digest=digest_of([(s, n) for _, s, n in triples]),
        )
        op = TransferOp(plan)
        timer = threading.Timer(delay, self._late, (op,))
        timer.daemon = True
        timer.start()
        return op

    def _late(self, op: TransferOp) -> None:
        event("write_issued", cancelled=op.cancelled)
        inner = super().submit(op.plan)  # the real write, through the real engine

        def landed(i: TransferOp) -> None:
            event("write_landed", error=repr(i.error) if i.error else "")
            op._resolve(i.error)
            op._quiesce()

        inner.add_quiesce_callback(landed)


class CanaryScheduler(KVGuardScheduler):
    """Decode: logs every block allocation."""

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if not self.is_producer:
            ids = list(blocks.get_block_ids()[0])
            event("alloc", rid=request.request_id, blocks=ids, external=num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVGuardMetadata:
        if not self.is_producer:
            cached = scheduler_output.scheduled_cached_reqs
            for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if new and new[0]:
                    event("alloc", rid=rid, blocks=list(new[0]), grown=True)
        return super().build_connector_meta(scheduler_output)


class CanaryWorker(KVGuardWorker):
    """Prefill: a late engine. Decode: logs fences, and hands them back early when asked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bypassed: set[str] = set()  # decode: fenced loads handed back at once
        self._fenced_now: set[str] = set()  # decode: fenced in this call

    def make_backend(self) -> MooncakeBackend:
        if not self.is_producer:
            return super().make_backend()
        s = self.settings
        return LateMooncakeBackend(s.host, protocol=s.protocol, force_tcp=s.protocol == "tcp")

    # -- decode: fences --------------------------------------------------------

    def _start(self) -> None:
        super()._start()
        receiver = self.receiver
        if receiver is None:
            return
        take_finished, take_released = receiver.take_finished, receiver.take_released

        def finished() -> list[LoadOutcome]:
            outs = take_finished()
            for out in outs:
                if out.fenced:
                    blocks = self._legs.blocks(out.request_id)
                    bypass = (DIR / "bypass").exists()
                    event(
                        "fenced",
                        rid=out.request_id,
                        blocks=blocks,
                        reason=out.reason,
                        bypass=bypass,
                        digest=self._digest(blocks),
                    )
                    self._fenced_now.add(out.request_id)
                    if bypass:
                        self._bypassed.add(out.request_id)
            return outs

        def released() -> list[str]:
            rids = take_released()
            for rid in rids:
                blocks = self._legs.blocks(rid)
                event("released", rid=rid, blocks=blocks, digest=self._digest(blocks))
            return rids

        receiver.take_finished = finished  # type: ignore[method-assign]
        receiver.take_released = released  # type: ignore[method-assign]

    def _digest(self, blocks: list[int]) -> str:
        cache = self.cache
        assert cache is not None
        size = cache.layout.block_bytes
        ranges = sorted(
            (cache.block_addr(buf, b), size)
            for buf in range(cache.layout.num_buffers)
            for b in blocks
        )
        return digest_of(ranges)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._fenced_now.clear()
        results = super().get_transfer_results(finished_req_ids)
        for rid in self._fenced_now & self._bypassed:
            # The old behaviour: the blocks go back to vLLM with the failure.
            blocks = self._legs.drop(rid)
            self._invalid.difference_update(blocks)
            results.finished_recving.add(rid)
            results.failed_recving.add(rid)
        late = {r for r in results.finished_recving if r in self._bypassed}
        late -= self._fenced_now
        for rid in late:  # reported already; vLLM would not know it any more
            results.finished_recving.discard(rid)
            results.failed_recving.discard(rid)
            self._bypassed.discard(rid)
        return results


class CanaryKVGuardConnector(KVGuardConnector):
    scheduler_class = CanaryScheduler
    worker_class = CanaryWorker
