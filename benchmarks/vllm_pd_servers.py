"""The vLLM PD benchmark's servers: each connector's config and environment, on the tests' harness.

Every server is a ``tests.vllm.servers.Server`` (the vLLM tests' one
starter: its own session, health wait, logs) with the benchmark's model
(``tests.vllm.checkpoint.BENCH``), limits and recorders
(``benchmarks/_site`` on PYTHONPATH, see ``benchmarks.vllm_shim``); every
port comes from the harness's free-port finder. kvguard's config is the
harness's ``kv_config``; Mooncake's and NIXL's are vLLM's own connectors.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.vllm.ports import free_port
from tests.vllm.servers import ROOT, Proxy, Server
from tests.vllm.servers import kv_config as kvguard_config

__all__ = [
    "BLOCK_SIZE",
    "DEADLINE_S",
    "MODEL_DIR",
    "Ports",
    "kv_config",
    "mooncake_extra",
    "proxy",
    "server",
]

SITE_DIR: Final = Path(__file__).resolve().parent / "_site"
MODEL_DIR: Final = ROOT / ".venv-vllm" / "bench-llama"
BLOCK_SIZE: Final = 128  # vLLM's CPU default, given explicitly
KV_CACHE_BYTES: Final = 2 << 30  # per server: 64K tokens, 32 requests of 2K
DEADLINE_S: Final = 60  # kvguard's hold and load deadline: only failures reach it
START_S: Final = 600.0  # two servers with 2 GiB of KV each, on 2 busy cores
LIMITS: Final = [
    "--skip-tokenizer-init",
    "--enforce-eager",
    *f"--dtype float32 --block-size {BLOCK_SIZE} --max-model-len 4096".split(),
    *f"--max-num-seqs 32 --kv-cache-memory-bytes {KV_CACHE_BYTES}".split(),
    # Every prompt is new anyway: no prefix hit skews a row.
    "--no-enable-prefix-caching",
    "--disable-uvicorn-access-log",
]


@dataclass(frozen=True)
class Ports:
    """The connectors' side ports (the servers' and the proxy's own are picked as they start)."""

    kvguard_control: int = field(default_factory=free_port)
    mooncake_bootstrap: int = field(default_factory=free_port)
    nixl_prefill: int = field(default_factory=free_port)
    nixl_decode: int = field(default_factory=free_port)


def kv_config(connector: str, role: str, ports: Ports) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one server (None: no connector)."""
    if connector == "aggregated":
        return None
    if connector.startswith("kvguard"):
        own = {"kvguard_control_port": ports.kvguard_control} if role == "kv_producer" else {}
        if connector == "kvguard-unverified":
            own["kvguard_verify"] = False
        elif connector == "kvguard-nowait":
            own["kvguard_idle_wait_ms"] = 0
        return kvguard_config(role, "fail", kvguard_deadline_s=DEADLINE_S, **own)
    cfg: dict[str, Any] = {"kv_role": role}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "fail"  # a failed load shows as an error
    if connector == "mooncake":
        cfg["kv_connector"] = "MooncakeConnector"
        cfg["kv_connector_extra_config"] = {"mooncake_protocol": "tcp"}
    elif connector == "nixl":
        cfg["kv_connector"] = "NixlConnector"
        cfg["kv_buffer_device"] = "cpu"
    else:
        raise ValueError(f"unknown connector {connector!r}")
    return cfg


def server(connector: str, role: str, ports: Ports, out: Path) -> Server:
    """One server of ``connector`` in ``role`` (kv_producer, kv_consumer; "" when aggregated)."""
    name = f"{connector}-{role.removeprefix('kv_')}" if connector != "aggregated" else connector
    env = {
        "KVGUARD_BENCH_DIR": str(out / "records"),
        "KVGUARD_BENCH_SERVER": name,
        "VLLM_HOST_IP": "127.0.0.1",
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports.mooncake_bootstrap),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(
            ports.nixl_prefill if role == "kv_producer" else ports.nixl_decode
        ),
        # Both servers share 2 cores: one compute thread each (the harness's
        # default too), unless the caller's environment says otherwise.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    if connector == "nixl":
        # UCX's TCP transport, like Mooncake's: on one host UCX would pick
        # shared memory, which no two-host deployment has.
        env["UCX_TLS"] = os.environ.get("KVGUARD_BENCH_UCX_TLS", "tcp")
    return Server(
        name,
        kv=kv_config(connector, role, ports),
        env=env,
        model=MODEL_DIR,
        limits=list(LIMITS),
        pythonpath=[str(SITE_DIR)],
        log_path=out / "logs" / f"{name}.log",
        start_s=START_S,
        grace_s=20.0,
    )


def proxy(connector: str, prefill: Server, decode: Server, out: Path) -> Proxy:
    """``kvguard proxy`` in front of one prefill and one decode (not started)."""
    # kvguard-two-step: the first token the decode's, after the handover
    # (the proxy's early first token off), its TTFT side by side.
    early = ("--no-early-first-token",) if connector == "kvguard-two-step" else ()
    return Proxy(
        [prefill.url],
        [decode.url],
        args=("--log-level", "warning", *early),
        log_path=out / "logs" / f"{connector}-proxy.log",
    )


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except OSError:
        return 0, b""


def mooncake_extra(ports: Ports, timeout_s: float = 120.0) -> dict[str, Any]:
    """The decode leg's ``kv_transfer_params`` for Mooncake: the prefill's engine
    id, from its bootstrap server, and that server's address."""
    addr = f"http://127.0.0.1:{ports.mooncake_bootstrap}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = _http_get(addr + "/query")
        if status == 200:
            entries = json.loads(body)
            if entries:
                engine = next(iter(entries.values()))["engine_id"]
                return {"remote_engine_id": engine, "remote_bootstrap_addr": addr}
        time.sleep(0.5)
    raise TimeoutError(f"no prefill registered with Mooncake's bootstrap server {addr}")
