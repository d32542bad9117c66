"""vLLM OpenAI servers as users run them, for the server-mode tests.

Each server is ``python -m vllm.entrypoints.openai.api_server`` in its own
process group (APIServer, EngineCore and Worker are three processes, vLLM's
default multiprocessing), on ports from the free-port finder, with the tiny
checkpoint and small limits (the machine has 2 cores shared with others).
``Server.stop()`` kills the whole group by its id; ``Server.log_tail()``
goes into failure messages.

The client runs the PD proxy's two steps itself (prefill with max_tokens 1
and ``do_remote_decode``, then decode with the prefill's
``kv_transfer_params``), asks for token ids (``return_token_ids``) and
compares them with a non-PD request of the same prompt (temperature 0,
``ignore_eos``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("KVGUARD_VLLM_MODEL", ROOT / ".venv-vllm" / "tiny-llama"))
LOGS = ROOT / ".venv-vllm"
START_S = 300.0  # a server's start on a loaded 2-core machine

SMALL = [
    "--skip-tokenizer-init",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--max-model-len",
    "128",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(role: str, policy: str = "fail", **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "KVGuardConnector",
        "kv_connector_module_path": "kvguard.vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": {"kvguard_host": "127.0.0.1", **extra},
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = policy
    return cfg


@dataclass
class Server:
    """One OpenAI server process group."""

    name: str
    kv: dict[str, Any] | None = None
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return LOGS / f"server-{self.name}.log"

    def start(self) -> Server:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += SMALL + self.args
        if self.kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv)]
        env = dict(os.environ, MC_FORCE_TCP="1", VLLM_CPU_KVCACHE_SPACE="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name}: no /health within {START_S}s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        """``sig`` to every process of the server (APIServer, EngineCore, Worker)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # by group id; ends a stopped one too
        self.proc.wait(30)
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        keep = [t for t in text if "GET /health" not in t and "Route:" not in t]
        return "\n".join(keep[-lines:])

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, name{labels} -> value."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def gauge(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)


@dataclass(frozen=True)
class Outcome:
    """How one client request ended."""

    status: int
    tokens: list[int] | None
    error: str
    seconds: float


async def complete(
    http: aiohttp.ClientSession,
    server: Server,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> tuple[Outcome, dict[str, Any] | None]:
    """One /v1/completions call; its outcome and the returned kv_transfer_params."""
    body: dict[str, Any] = {
        "model": str(MODEL),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    t0 = time.monotonic()
    async with http.post(
        server.url + "/v1/completions",
        json=body,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as r:
        data = await r.json(content_type=None)
    took = time.monotonic() - t0
    if r.status != 200:
        return Outcome(r.status, None, json.dumps(data)[:300], took), None
    choice = data["choices"][0]
    return Outcome(200, list(choice["token_ids"]), "", took), data.get("kv_transfer_params")


async def pd(
    http: aiohttp.ClientSession,
    prefill: Server,
    decode: Server,
    prompt: list[int],
    max_tokens: int,
) -> Outcome:
    """The PD proxy's two steps for one prompt; the decode's outcome."""
    first, params = await complete(http, prefill, prompt, 1, {"do_remote_decode": True})
    if first.status != 200 or params is None:
        return first
    t0 = time.monotonic()
    out, _ = await complete(http, decode, prompt, max_tokens, params)
    return Outcome(out.status, out.tokens, out.error, first.seconds + (time.monotonic() - t0))
