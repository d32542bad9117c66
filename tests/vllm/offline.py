"""Offline vLLM engines for the connector's tests: each its own OS process
(``tests/vllm/engine.py``), driven over pipes by the test, the "client".

The harness of tests/vllm/test_vllm_pd.py: ``Engine`` (events from its
stdout, commands to its stdin), ``engine`` and ``producer`` (started and
stopped, a clean exit asserted), ``prefill`` (the prefill leg of a batch),
``row`` and ``record`` (the per-request report).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.vllm.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("KVGUARD_VLLM_MODEL", ROOT / ".venv-vllm" / "tiny-llama"))
DEADLINE_S = 5.0  # per request, both sides
# How long a quit engine may take to exit by itself (about 5 s measured): a hang guard.
QUIT_S = 60.0

RUN_REPORT: dict[str, Any] = {"scenarios": {}, "engines": []}


class Engine:
    """One vLLM engine process; events from its stdout, commands to its stdin."""

    def __init__(self, name: str, role: str = "", policy: str = "fail", **extra: Any) -> None:
        self.name = name
        args = [sys.executable, "-m", "tests.vllm.engine", "--model", str(MODEL)]
        if role:
            args += ["--role", role, "--policy", policy, "--extra", json.dumps(extra)]
            if role == "kv_consumer":
                args += ["--connector", "CorruptingKVGuardConnector"]
                args += ["--module", "tests.vllm.corrupt_connector"]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log = ROOT / ".venv-vllm" / f"engine-{name}.log"
        self._logf = self.log.open("w")
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._logf,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.pid = self.proc.pid
        self.signalled = False  # killed or frozen by the test: close() kills it
        self._events: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.finished: dict[str, dict[str, Any]] = {}
        self.sent: dict[str, float] = {}
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(lambda e: e["ev"] == "ready", 300)
        self.startup_s = ready["startup_s"]
        self.free_blocks0 = ready["free_blocks"]
        RUN_REPORT["engines"].append({"name": name, "startup_s": round(self.startup_s, 2)})

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._events.put(json.loads(line))
        self._events.put(None)

    def _next(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                break
            if ev is None:
                raise RuntimeError(f"engine {self.name} exited; see {self.log}")
            if ev["ev"] == "finished":
                ev["t_end"] = time.monotonic()
                self.finished[ev["id"]] = ev
            if pred(ev):
                return ev
        raise TimeoutError(f"engine {self.name}: no event within {timeout}s; see {self.log}")

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: Any = None) -> None:
        self.sent[rid] = time.monotonic()
        self.send(op="add", id=rid, prompt=prompt, max_tokens=max_tokens, kv_transfer_params=params)

    def wait(self, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
        """Each request's finished event; TimeoutError if one does not finish."""
        end = time.monotonic() + timeout
        for rid in ids:
            if rid not in self.finished:
                self._next(
                    lambda e, rid=rid: e["ev"] == "finished" and e["id"] == rid,
                    max(0.0, end - time.monotonic()),
                )
        return {rid: self.finished[rid] for rid in ids}

    def usage(self) -> dict[str, Any]:
        self.send(op="usage")
        return self._next(lambda e: e["ev"] == "usage", 30)

    def signal(self, sig: int) -> None:
        self.signalled = True
        os.kill(self.pid, sig)

    def close(self) -> None:
        """Quit an engine no signal reached and let it exit by itself; kill the rest."""
        if self.proc.poll() is None and not self.signalled:
            with contextlib.suppress(OSError):  # a pipe it closed by dying
                self.send(op="quit")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(QUIT_S)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # by pid; SIGKILL ends a stopped one too
        self.proc.wait(30)
        self._logf.close()


@contextlib.contextmanager
def engine(name: str, role: str = "", policy: str = "fail", **extra: Any) -> Iterator[Engine]:
    e = Engine(name, role, policy, **extra)
    try:
        yield e
    finally:
        e.close()
    if not e.signalled:  # asked to quit: it ends by itself, status 0, no abort
        log = e.log.read_text()
        assert e.proc.returncode == 0, f"{name} exited {e.proc.returncode}: {log[-3000:]}"
        assert "terminate called" not in log, log[-3000:]


def producer(name: str, **extra: Any) -> contextlib.AbstractContextManager[Engine]:
    return engine(
        name,
        "kv_producer",
        kvguard_control_port=free_port(),
        kvguard_deadline_s=DEADLINE_S,
        # A request no decode asks for is held this long (renewals aside).
        kvguard_hold_s=DEADLINE_S,
        **extra,
    )


def prefill(p: Engine, ids: list[str], prompts: list[list[int]]) -> dict[str, Any]:
    for rid, prompt in zip(ids, prompts, strict=True):
        p.add(rid, prompt, 1, {"do_remote_decode": True})
    out = p.wait(ids, 60)
    for rid in ids:
        assert out[rid]["finish_reason"] == "length", out[rid]
        assert out[rid]["kv_transfer_params"]["do_remote_prefill"] is True
    return {rid: out[rid]["kv_transfer_params"] for rid in ids}


def row(d: Engine, rid: str, ref: list[int] | None) -> dict[str, Any]:
    ev = d.finished[rid]
    return {
        "request": rid,
        "engine": d.name,
        "outcome": ev["finish_reason"],
        "time_to_terminal_s": round(ev["t_end"] - d.sent[rid], 3),
        "tokens_equal": None if ref is None else ev["tokens"] == ref,
        "external_tokens": ev["external_tokens"],
        "load": ev.get("load"),
    }


def record(scenario: str, rows: list[dict[str, Any]]) -> None:
    RUN_REPORT["scenarios"].setdefault(scenario, []).extend(rows)
