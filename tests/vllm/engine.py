"""One vLLM engine in its own process, driven by JSON lines (the tests' client).

    .venv-vllm/bin/python -m tests.vllm.engine --model DIR [--role kv_producer|kv_consumer]
        [--policy fail|recompute] [--extra JSON] [--connector NAME --module PATH]

stdin, one JSON object a line:
    {"op": "add", "id": ..., "prompt": [token ids], "max_tokens": N,
     "kv_transfer_params": {...} | null}
    {"op": "abort", "id": ...}
    {"op": "usage"}            -> {"ev": "usage", "free_blocks": ..., ...}
    {"op": "quit"}
stdout (the real one; vLLM's own output goes to stderr), one JSON object a line:
    {"ev": "ready", "pid", "startup_s", "free_blocks", "total_blocks"}
    {"ev": "finished", "id", "tokens", "finish_reason", "kv_transfer_params",
     "latency_s" (add -> finished), "external_tokens", "load" (ok, or why it failed)}

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and
is stepped whenever it has anything to do, held prefill blocks included, so
the connector's completions are collected without a client request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import sys
import threading
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_EVENTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # everything else that writes to stdout goes to stderr
sys.stdout = sys.stderr


def emit(event: dict[str, Any]) -> None:
    _EVENTS.write(json.dumps(event) + "\n")
    _EVENTS.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", default="")
    ap.add_argument("--policy", default="fail")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--connector", default="KVGuardConnector")
    ap.add_argument("--module", default="kvguard.vllm.connector")
    args = ap.parse_args()

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if args.role:
        kv = KVTransferConfig(
            kv_connector=args.connector,
            kv_connector_module_path=args.module,
            kv_role=args.role,
            kv_load_failure_policy=args.policy,
            kv_connector_extra_config=json.loads(args.extra),
        )
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=128,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=kv,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # in-process EngineCore
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool

    def connector() -> Any:
        return getattr(sched, "connector", None)

    def usage() -> dict[str, Any]:
        conn = connector()
        holding = sender = None
        worker = _side(_worker_connector(), "connector_worker")
        if worker is not None and getattr(worker, "sender", None) is not None:
            holding = worker.sender.holding()
            sender = dataclasses.asdict(worker.sender.stats)
        return {
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks,
            "requests": len(sched.requests),
            "holding": holding,
            "sender": sender,
            "connector": type(conn).__name__ if conn else None,
        }

    emit({"ev": "ready", "pid": os.getpid(), "startup_s": time.monotonic() - t0, **usage()})

    commands: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read, daemon=True).start()
    started: dict[str, float] = {}
    running = True
    while running:
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                break
            if cmd is None or cmd["op"] == "quit":
                running = False
                break
            if cmd["op"] == "add":
                extra = None
                if cmd.get("kv_transfer_params"):
                    extra = {"kv_transfer_params": dict(cmd["kv_transfer_params"])}
                params = SamplingParams(
                    max_tokens=cmd["max_tokens"],
                    temperature=0.0,
                    ignore_eos=True,
                    detokenize=False,
                    extra_args=extra,
                )
                started[cmd["id"]] = time.monotonic()
                engine.add_request(cmd["id"], {"prompt_token_ids": cmd["prompt"]}, params)
            elif cmd["op"] == "abort":
                engine.abort_request([cmd["id"]])
            elif cmd["op"] == "usage":
                emit({"ev": "usage", **usage()})
        if not running:
            break
        if not sched.has_requests() and not engine.has_unfinished_requests():
            time.sleep(0.005)
            continue
        for out in engine.step():
            if not out.finished:
                continue
            comp = out.outputs[0] if out.outputs else None
            conn = _side(connector(), "connector_scheduler")
            ext = None
            if conn is not None and hasattr(conn, "external_tokens"):
                for rid, n in conn.external_tokens.items():
                    if rid == out.request_id or rid.startswith(out.request_id + "-"):
                        ext = n
            load = None  # how the KV load ended on this (decode) side
            worker = _side(_worker_connector(), "connector_worker")
            receiver = getattr(worker, "receiver", None)
            if receiver is not None:
                with receiver._lock:
                    for rid, o in receiver.outcomes.items():
                        if rid == out.request_id or rid.startswith(out.request_id + "-"):
                            load = "ok" if o.ok else o.reason
            emit(
                {
                    "ev": "finished",
                    "id": out.request_id,
                    "tokens": list(comp.token_ids) if comp else [],
                    "finish_reason": comp.finish_reason if comp else None,
                    "kv_transfer_params": out.kv_transfer_params,
                    "latency_s": time.monotonic() - started.get(out.request_id, 0.0),
                    "external_tokens": ext,
                    "load": load,
                }
            )
    emit({"ev": "bye"})
    # Returns: the interpreter finalizes as any program's would, engine
    # threads ended by the transfer library's exit hook (a quit is exit 0).


def _side(conn: Any, name: str) -> Any:
    """A connector's scheduler or worker side (``KVGuardConnector`` builds one
    by role, as vLLM's own connectors do); a connector without sides itself."""
    return getattr(conn, name, conn)


def _worker_connector() -> Any:
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    return get_kv_transfer_group() if has_kv_transfer_group() else None


if __name__ == "__main__":
    main()
