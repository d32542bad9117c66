"""vLLM OpenAI servers as users run them, for the vLLM tests and benchmarks.

Each server is ``python -m vllm.entrypoints.openai.api_server`` in its own
process group (APIServer, EngineCore and Worker are three processes, vLLM's
default multiprocessing), on ports from the free-port finder, with the tiny
checkpoint and small limits (the machine has 2 cores shared with others).
``Server.stop()`` kills the whole group by its id; ``Server.log_tail()``
goes into failure messages. Dev mode is on so a test can empty a server's
prefix cache (``POST /reset_prefix_cache``) and make every PD request load
its KV instead of finding it cached from the reference request.

``Proxy`` is ``kvguard proxy`` as a subprocess (its own process group too).
``benchmarks.vllm_pd`` starts its servers with them too (own model, limits,
logs; a SIGTERM grace; CPU seconds per server session).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm.diagnosis import state_of, total
from tests.vllm.ports import free_port
from tests.vllm.sessions import session_alive, session_cpu_seconds

__all__ = [
    "BIN",
    "LOGS",
    "MODEL",
    "ROOT",
    "SERVES_KV",
    "SMALL",
    "Load",
    "Proxy",
    "Server",
    "kv_config",
    "start_all",
    "wait_healthy",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("KVGUARD_VLLM_MODEL", ROOT / ".venv-vllm" / "tiny-llama"))
LOGS = ROOT / ".venv-vllm"
BIN = Path(sys.executable).parent  # .venv-vllm/bin: python, kvguard
START_S = 300.0  # a server's start on a loaded 2-core machine
# A SIGKILLed server's exit as its parent sees it: the kernel takes each
# process's memory back first (1 GiB of KV per worker). Killed sockets closed
# up to 25 s late here, and a TP 2 prefill's API server was not reaped
# within 30 s of its group's SIGKILL once (a vLLM run of this stop).
REAP_S = 120.0
# A "still serves" check asks for the longest deadline the servers allow
# (kvguard_max_deadline_s): it checks that the decode serves, and must ride
# out a slow step (docs/vllm.md, "Several servers on one small host").
SERVES_KV: dict[str, Any] = {"kvguard_deadline_s": 60.0}

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


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return bytes(r.read())


def wait_healthy(urls: Iterable[str], deadline: float, alive: Any = None) -> None:
    """Every ``url + /health`` answered 200 by ``deadline`` (monotonic), else TimeoutError.

    ``alive()`` (if given) is checked between polls and raises when the
    process serving them is gone.
    """
    pending = list(urls)
    while pending:
        if alive is not None:
            alive()
        with contextlib.suppress(OSError):
            _get(pending[0] + "/health", 2)
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"no /health from {pending}")
        time.sleep(1.0)


@dataclass(frozen=True)
class Load:
    """A server's scheduler and KV cache, from its /metrics."""

    running: float
    waiting: float
    kv_usage: float

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0


@dataclass
class Server:
    """One OpenAI server process group."""

    name: str
    kv: dict[str, Any] | None = None
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # on top of the defaults below
    proc: subprocess.Popen[bytes] | None = None
    # None: the module's MODEL, SMALL, START_S, read as the server starts
    model: Path | None = None
    limits: list[str] | None = None  # before ``args``
    python: str = sys.executable
    pythonpath: list[str] = field(default_factory=list)  # before the checkout
    log_path: Path | None = None  # default: LOGS / server-NAME.log
    start_s: float | None = None
    grace_s: float = 0.0  # stop(): SIGTERM, this long for the session to end, then SIGKILL
    # A shell command line run instead of the one built below (a command as
    # the docs give it); it must serve on ``port``. The environment is the same.
    shell: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_path or LOGS / f"server-{self.name}.log"

    @property
    def pid(self) -> int:
        """The leader's pid: the id of the server's process group and session."""
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU seconds of every live process of the server (its session)."""
        return session_cpu_seconds(self.pid)

    def start(self) -> Server:
        model, limits = self.model or MODEL, SMALL if self.limits is None else self.limits
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *limits, *self.args]
        if self.kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv)]
        env = dict(os.environ, MC_FORCE_TCP="1", VLLM_CPU_KVCACHE_SPACE="1")
        # Several servers share this host's cores: one OpenMP thread per
        # worker, placed by the kernel. vLLM's default on 2 cores gives each
        # worker 2 threads, whose barriers spin-wait on cores other workers
        # need (docs/vllm.md, "Several servers on one small host").
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, str(ROOT)])
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # as in vLLM's activated venv
        start_s = START_S if self.start_s is None else self.start_s
        with self.log.open("ab") as out:  # "ab": a restart keeps the log before it
            start_at = out.tell()
            self.proc = subprocess.Popen(
                ["bash", "-c", self.shell] if self.shell else cmd,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def alive() -> None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited {self.proc.returncode}:\n{self.start_errors(start_at)}"
                )

        try:
            wait_healthy([self.url], time.monotonic() + start_s, alive)
        except TimeoutError:
            self.stop()
            raise TimeoutError(
                f"{self.name}: no /health within {start_s}s:\n{self.log_tail()}"
            ) from None
        return self

    def start_errors(self, start_at: int) -> str:
        """What a failed start logged: each process's error lines (the root
        cause, which vLLM's own last words only point to), then the tail."""
        with self.log.open("rb") as f:
            f.seek(start_at)
            lines = f.read().decode(errors="replace").splitlines()
        errors = [t for t in lines if re.search(r"Error|Exception|Killed|refused|in use", t)]
        return "\n".join(["--- error lines", *errors[:30], "--- tail", *lines[-30:]])

    def restart(self) -> Server:
        self.stop()
        return self.start()

    def signal(self, sig: int) -> None:
        """``sig`` to every process of the server (APIServer, EngineCore, Worker)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def wait_gone(self, within_s: float) -> None:
        """After a kill: every process of the group has exited (none holds the
        listening socket, so a connect is refused)."""
        assert self.proc is not None
        until = time.monotonic() + within_s
        self.proc.wait(within_s)
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            if time.monotonic() > until:
                raise TimeoutError(f"{self.name}: processes left {within_s}s after the kill")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.grace_s:  # SIGTERM first; what is left of the session then gets SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            until = time.monotonic() + self.grace_s
            while session_alive(self.pid) and time.monotonic() < until:
                time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # by group id; ends a stopped one too
        self.proc.wait(REAP_S)
        self.proc = None

    def log_tail(self, lines: int = 40, grep: str = "") -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        keep = [
            t
            for t in text
            if "GET /health" not in t and "Route:" not in t and "GET /metrics" not in t
        ]
        if grep:
            keep = [t for t in keep if re.search(grep, t)]
        return "\n".join(keep[-lines:])

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, name{labels} -> value."""
        # 30 s: a TP 2 server just after failing a batch of requests has
        # kept /metrics unanswered past 10 s on this host.
        text = _get(self.url + "/metrics", 30).decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def gauge(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def load(self) -> Load:
        m = self.metrics()
        return Load(
            running=total(m, "vllm:num_requests_running"),
            waiting=total(m, "vllm:num_requests_waiting"),
            kv_usage=total(m, "vllm:kv_cache_usage_perc"),
        )

    def tokens_by_source(self) -> Counter[str]:
        """Prompt tokens by source: local_compute, local_cache_hit, external_kv_transfer."""
        out: Counter[str] = Counter()
        for key, value in self.metrics().items():
            if key.startswith("vllm:prompt_tokens_by_source_total{"):
                source = re.search(r'source="([^"]+)"', key)
                assert source is not None, key
                out[source.group(1)] += int(value)
        return out

    def wait_idle(self, within_s: float) -> float:
        """Seconds until nothing runs or waits and no KV block is used; fails after ``within_s``."""
        t0 = time.monotonic()
        while True:
            load = self.load()
            if load.idle:
                return time.monotonic() - t0
            if time.monotonic() - t0 > within_s:
                raise AssertionError(
                    f"{self.name} not idle {within_s}s on: {load}\n--- log\n{self.log_tail()}"
                    f"\n{state_of(self)}"
                )
            time.sleep(0.25)

    def reset_prefix_cache(self, within_s: float = 30.0) -> None:
        """Empty the server's prefix cache (refused while blocks are held: retry)."""
        end = time.monotonic() + within_s
        while True:
            req = urllib.request.Request(self.url + "/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read())["success"]:
                    return
            if time.monotonic() > end:
                raise AssertionError(
                    f"{self.name}: prefix cache not reset:\n{self.log_tail(12)}\n{state_of(self)}"
                )
            time.sleep(0.5)


@dataclass
class Proxy:
    """``kvguard proxy`` in its own process group, on a port it picks (``--port 0``)."""

    prefill: Sequence[str]
    decode: Sequence[str]
    args: Sequence[str] = ()
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None  # default: LOGS / proxy.log

    @property
    def log(self) -> Path:
        return self.log_path or LOGS / "proxy.log"

    def start(self) -> Proxy:
        cmd = [str(BIN / "kvguard"), "proxy", "--prefill", *self.prefill]
        cmd += ["--decode", *self.decode, "--port", "0", *self.args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        end = time.monotonic() + 60
        while not self.url:
            found = re.search(r"listening on (http://\S+)", self.log.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
            elif self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"kvguard proxy did not start:\n{self.log_tail()}")
            else:
                time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_all(servers: Sequence[Server]) -> None:
    """Start ``servers`` side by side (a start is mostly imports and one warm-up)."""
    errors: list[BaseException] = []

    def one(s: Server) -> None:
        try:
            s.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
