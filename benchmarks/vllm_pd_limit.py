"""The engine's limit without vLLM: kvguard's MooncakeBackend alone between two processes.

The same per-request KV sizes as the vLLM PD benchmark's requests, at the
same concurrencies, in closed loops; bytes/s over the union of the
transfers' intervals, the figure the connectors' rates are held against.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from tests.vllm.checkpoint import BENCH, DTYPE_BYTES

from .vllm_pd_figures import union_seconds
from .vllm_pd_servers import BLOCK_SIZE

__all__ = ["backend_limit"]


def backend_limit(sizes: list[int], concurrencies: Sequence[int]) -> dict[str, Any]:
    """kvguard's MooncakeBackend alone, two processes: the same per-request KV
    (``sizes``: blocks per request, 4 layers x one block of 1 MiB each) at each
    concurrency; bytes/s over the union of the ops' intervals."""
    import structlog

    from kvguard.decode.service import ReceiverProcess
    from transfer import KVCache, KVLayout, build_plan
    from transfer.mooncake import MooncakeBackend

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    block_bytes = BLOCK_SIZE * BENCH["num_key_value_heads"] * BENCH["head_dim"] * 2 * DTYPE_BYTES
    layout = KVLayout(
        num_layers=BENCH["num_hidden_layers"],
        num_blocks=64,
        block_bytes=block_bytes,
        kv_split=False,
    )
    rng = random.Random(3)
    out: dict[str, Any] = {}
    with ReceiverProcess(layout) as decode, MooncakeBackend() as backend:
        src = KVCache(layout)
        src.fill_seeded(1)
        backend.register(src)
        backend.add_peer(decode.peer)

        def plan_of(n: int) -> Any:
            start = rng.randrange(layout.num_blocks - n + 1)
            blocks = list(range(start, start + n))
            return build_plan(src, decode.peer, blocks, blocks)

        op = backend.submit(plan_of(1))  # connect
        op.result(timeout=60)
        for c in concurrencies:
            plans = [plan_of(n) for n in sizes]
            cpu0, t0 = time.process_time(), time.time()
            ops = _in_flight(backend, plans, c)
            wall, cpu = time.time() - t0, time.process_time() - cpu0
            nbytes = sum(p.nbytes for p in plans)
            rates = [n / (b - a) for n, a, b in ops]
            out[str(c)] = {
                "requests": len(plans),
                "kv_bytes": nbytes,
                "kv_gbps": round(nbytes / union_seconds([(a, b) for _, a, b in ops]) / 1e9, 3),
                "kv_gbps_median_transfer": round(statistics.median(rates) / 1e9, 3),
                "wall_s": round(wall, 3),
                "cpu_s_per_gb_sender": round(cpu / (nbytes / 1e9), 3),
            }
    return out


def _in_flight(backend: Any, plans: list[Any], c: int) -> list[tuple[int, float, float]]:
    """Submit ``plans`` with ``c`` in flight (closed loop); each op's bytes,
    submit and result times."""
    lock = threading.Lock()
    todo = list(reversed(plans))
    ops: list[tuple[int, float, float]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    plan = todo.pop()
                a = time.time()
                op = backend.submit(plan)
                op.result(timeout=120)
                b = time.time()
                if not op.wait_quiesced(120):
                    raise RuntimeError("backend op did not quiesce")
                with lock:
                    ops.append((plan.nbytes, a, b))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ops
