"""kvguard's connector against vLLM's own, in real OpenAI servers, at realistic KV sizes.

    python -m benchmarks.vllm_pd [--quick] [--connectors kvguard,mooncake,nixl]
                                 [--concurrency 1,8,32] [--out DIR]
    kvguard bench --vllm [...]   # the same; re-executed with .venv-vllm's python

For each connector, one prefill and one decode vLLM OpenAI server
(``vllm.entrypoints.openai.api_server``, default multiprocessing) serve a
generated Llama checkpoint with 32 KiB of KV per token
(``benchmarks.vllm_checkpoint``); an HTTP client sends prompts of 1K-2K
random tokens in closed loops of 1, 8 and 32 concurrent requests. The same
run also measures:

* the aggregated baseline: one server, no connector, the same prompts
  prefilled locally;
* the engine's limit without vLLM: kvguard's ``MooncakeBackend`` between two
  processes moving the same per-request KV sizes at the same concurrencies.

Every request is the two-step PD protocol, legs in sequence: the prefill
with ``max_tokens`` 1 and ``do_remote_decode``, then the decode with the
parameters that make it load the prefill's KV. Connectors that return those
parameters from the prefill (kvguard, NIXL) go through ``kvguard proxy``;
Mooncake's need the router to make them up (a ``transfer_id`` on both legs,
the prefill's engine id and bootstrap address on the decode leg), which
``kvguard proxy`` does not do, so the client drives both legs itself.

Figures per connector and concurrency (``vllm_pd.json``, plot
``vllm_pd.png``):

* handover: decode request arrival to first token, from the decode server's
  own view (vLLM's arrival time and first-token latency for the request,
  recorded in its frontend), p50 and p99; the aggregated row is the same
  figure on the one server (local prefill included);
* TTFT: the client's request sent to first streamed token, through the proxy;
* KV bytes/s: KV bytes moved over the time some transfer was in flight (the
  union of the transfers' intervals, each as the connector timed it), and
  the median transfer's own rate;
* CPU s/GB: CPU seconds of each server's whole process tree (API server,
  engine core, worker; ``/proc/<pid>/stat``) over the level, per GB moved;
* hook overhead: time vLLM's loop spent inside the connector's per-step
  hooks, per request, on each server;
* kvguard only, per request: where the handover time goes (schedule, push,
  submit, engine, release, report, first token; see ``PHASES``).

The patches inside the servers (a CPU shim for Mooncake's device lookup and
the recorders) are ``benchmarks.vllm_shim``'s, never kvguard's. Needs
``.venv-vllm`` (``scripts/vllm-env.sh``) and the ``bench`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .machine import describe_machine

__all__ = ["PHASES", "main", "percentile", "run", "union_seconds"]

ROOT: Final = Path(__file__).resolve().parent.parent
VLLM_PYTHON: Final = ROOT / ".venv-vllm" / "bin" / "python"
SITE_DIR: Final = Path(__file__).resolve().parent / "_site"
MODEL_DIR: Final = ROOT / ".venv-vllm" / "bench-llama"
BLOCK_SIZE: Final = 128  # vLLM's CPU default, given explicitly
KV_CACHE_BYTES: Final = 2 << 30  # per server: 64K tokens, 32 requests of 2K
MAX_TOKENS: Final = 8  # decode tokens per request
PROMPT_TOKENS: Final = (1024, 2048)
VOCAB: Final = 1024
DEADLINE_S: Final = 60  # kvguard's hold and load deadline: only failures reach it

# kvguard's handover, phase by phase (each from the end of the one before):
PHASES: Final = (
    ("schedule", "decode: request arrival -> the connector asks the prefill (receiver.expect)"),
    ("push", "the decode's Push reaches the prefill's sender"),
    ("submit", "push received -> Scheduler.submit returned"),
    ("engine", "submit -> the transfer DONE (kvguard's engine loop, Mooncake TCP)"),
    ("release", "DONE -> quiesced, released, Result sent to the decode"),
    ("report", "Result sent -> the load reported to vLLM (finished_recving)"),
    ("first_token", "reported -> first token in the decode's frontend"),
)


# -- small figures ---------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): a value that occurred."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Total time covered by at least one of the ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _ms(x: float) -> float:
    return round(1000 * x, 2)


# -- processes -------------------------------------------------------------------

_TICK: Final = os.sysconf("SC_CLK_TCK")


def _session_stats(sid: int) -> Iterator[list[bytes]]:
    """The ``/proc/PID/stat`` fields after the command name (``fields[0]`` is
    field 3, the state) of every process in session ``sid``.

    Each server is started as a session leader, so its engine core, worker
    and any helper it forks stay in its session even when reparented. A
    process that exits while being read is skipped.
    """
    with os.scandir("/proc") as entries:  # closed too when a caller stops early
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rindex(b")") + 2 :].split()
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                yield fields


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds (user + system) of every live process in session ``sid``."""
    ticks = sum(int(f[11]) + int(f[12]) for f in _session_stats(sid))  # utime, stime
    return ticks / _TICK


@dataclass
class Server:
    """A process this benchmark started (a session leader), owned by pid."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=ROOT,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return session_cpu_seconds(self.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the session (by its leader's pid), SIGKILL what is left."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _session_alive(self.pid):
                time.sleep(0.2)
            if not _session_alive(self.pid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def _session_alive(sid: int) -> bool:
    """Whether any process of session ``sid`` is still running (not a zombie)."""
    return any(f[0] != b"Z" for f in _session_stats(sid))


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except OSError:
        return 0, b""


def wait_ready(servers: Sequence[Server], path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            s.check_alive()
            if _http_get(s.url + path)[0] == 200:
                waiting.remove(s)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[s.name for s in waiting]} not ready in {timeout_s:.0f} s")
        time.sleep(0.5)


# -- what runs where -------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    prefill: int = 8310
    decode: int = 8320
    proxy: int = 8330
    kvguard_control: int = 17710
    mooncake_bootstrap: int = 18998
    nixl_prefill: int = 15610
    nixl_decode: int = 15620


def kv_config(connector: str, role: str, ports: Ports) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one server (None: no connector)."""
    if connector == "aggregated":
        return None
    cfg: dict[str, Any] = {"kv_role": role}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "fail"  # a failed load shows as an error
    if connector == "kvguard":
        cfg["kv_connector"] = "KVGuardConnector"
        cfg["kv_connector_module_path"] = "kvguard.vllm.connector"
        extra: dict[str, Any] = {"kvguard_host": "127.0.0.1", "kvguard_deadline_s": DEADLINE_S}
        if role == "kv_producer":
            extra["kvguard_control_port"] = ports.kvguard_control
        cfg["kv_connector_extra_config"] = extra
    elif connector == "mooncake":
        cfg["kv_connector"] = "MooncakeConnector"
        cfg["kv_connector_extra_config"] = {"mooncake_protocol": "tcp"}
    elif connector == "nixl":
        cfg["kv_connector"] = "NixlConnector"
        cfg["kv_buffer_device"] = "cpu"
    else:
        raise ValueError(f"unknown connector {connector!r}")
    return cfg


def server(connector: str, role: str, port: int, ports: Ports, out: Path, python: str) -> Server:
    name = f"{connector}-{role.removeprefix('kv_')}" if connector != "aggregated" else connector
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR)]
    argv += f"--host 127.0.0.1 --port {port} --skip-tokenizer-init --enforce-eager".split()
    argv += f"--dtype float32 --block-size {BLOCK_SIZE} --max-model-len 4096".split()
    argv += f"--max-num-seqs 32 --kv-cache-memory-bytes {KV_CACHE_BYTES}".split()
    # Every prompt is new anyway: no prefix hit skews a row.
    argv += ["--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    cfg = kv_config(connector, role, ports)
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(
                [str(SITE_DIR), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
            ),
            "KVGUARD_BENCH_DIR": str(out / "records"),
            "KVGUARD_BENCH_SERVER": name,
            "VLLM_HOST_IP": "127.0.0.1",
            "MC_LOG_LEVEL": env.get("MC_LOG_LEVEL", "ERROR"),
            "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports.mooncake_bootstrap),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(
                ports.nixl_prefill if role == "kv_producer" else ports.nixl_decode
            ),
            # Both servers share 2 cores: one compute thread each.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        }
    )
    if connector == "nixl":
        # UCX's TCP transport, like Mooncake's: on one host UCX would pick
        # shared memory, which no two-host deployment has.
        env["UCX_TLS"] = env.get("KVGUARD_BENCH_UCX_TLS", "tcp")
    return Server(name, argv, env, out / "logs" / f"{name}.log", url=f"http://127.0.0.1:{port}")


# -- prompts ---------------------------------------------------------------------


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` distinct prompts of 1K-2K random tokens (no prefix is shared)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]


# -- the client ------------------------------------------------------------------


@dataclass
class Sent:
    """One request as the client saw it (times: ``time.time()``)."""

    index: int
    tokens_in: int
    start: float = 0.0
    decode_sent: float = 0.0  # two-leg client: the decode leg's send
    first: float = 0.0  # first streamed token
    end: float = 0.0
    request_id: str = ""  # X-Request-Id of the leg whose server view is read
    output: list[int] = field(default_factory=list)
    error: str = ""


class Client:
    """Sends one request its way: direct, through the proxy, or both legs itself."""

    def __init__(
        self, mode: str, base: str, prefill: str = "", extra: dict[str, Any] | None = None
    ):
        self.mode = mode  # "direct" | "proxy" | "mooncake"
        self.base = base  # where the request (or its decode leg) goes
        self.prefill = prefill
        self.extra = extra or {}  # mooncake: remote_engine_id, remote_bootstrap_addr

    async def send(self, session: Any, sent: Sent, prompt: list[int]) -> None:
        body: dict[str, Any] = {
            "model": str(MODEL_DIR),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        rid = f"bench-{uuid.uuid4().hex}"
        sent.start = time.time()
        try:
            if self.mode == "mooncake":
                transfer = uuid.uuid4().hex
                pre = dict(body, max_tokens=1, stream=False)
                pre["kv_transfer_params"] = {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "transfer_id": transfer,
                }
                async with session.post(
                    self.prefill + "/v1/completions", json=pre, headers={"X-Request-Id": rid + "-p"}
                ) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"prefill HTTP {r.status}")
                body["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "transfer_id": transfer,
                    **self.extra,
                }
                sent.decode_sent = time.time()
            headers = {"X-Request-Id": rid}
            async with session.post(self.base + "/v1/completions", json=body, headers=headers) as r:
                sent.request_id = r.headers.get("X-Request-Id", rid)
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error']}")
                    ids = chunk["choices"][0].get("token_ids") or []
                    if ids and not sent.first:
                        sent.first = time.time()
                    sent.output.extend(ids)
        except Exception as exc:
            sent.error = f"{type(exc).__name__}: {exc}"[:300]
        sent.end = time.time()


async def _closed_loop(client: Client, batch: list[tuple[int, list[int]]], c: int) -> list[Sent]:
    import aiohttp

    queue = list(reversed(batch))
    done: list[Sent] = []
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker() -> None:
            while queue:
                index, prompt = queue.pop()
                sent = Sent(index, len(prompt))
                await client.send(session, sent, prompt)
                done.append(sent)

        await asyncio.gather(*(worker() for _ in range(c)))
    return done


def drive(client: Client, batch: list[tuple[int, list[int]]], c: int) -> list[Sent]:
    return asyncio.run(_closed_loop(client, batch, c))


# -- what the servers recorded ---------------------------------------------------


def read_jsonl(records: Path, kind: str, server: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(records.glob(f"{kind}-{server}-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                out.append(json.loads(line))
    return out


def hook_totals(records: Path, server: str) -> dict[str, tuple[int, float]]:
    """Per hook: calls and seconds, summed over the server's processes."""
    out: dict[str, tuple[int, float]] = {}
    for path in records.glob(f"hooks-{server}-*.json"):
        with contextlib.suppress(json.JSONDecodeError, OSError):
            for name, (calls, secs) in json.loads(path.read_text())["hooks"].items():
                c0, s0 = out.get(name, (0, 0.0))
                out[name] = (c0 + int(calls), s0 + float(secs))
    return out


def _hook_delta(after: dict[str, tuple[int, float]], before: dict[str, tuple[int, float]]) -> float:
    return sum(s for _, s in after.values()) - sum(s for _, s in before.values())


def _match(server_reqs: list[dict[str, Any]], rid: str) -> dict[str, Any] | None:
    for r in server_reqs:
        if rid and rid in str(r.get("request_id")):
            return r
    return None


def kvguard_phases(
    prefill_events: list[dict[str, Any]],
    decode_events: list[dict[str, Any]],
    decode_request: dict[str, Any],
) -> dict[str, float] | None:
    """One request's handover split at kvguard's events (seconds), or None."""
    arrival = decode_request.get("arrival")
    first = decode_request.get("first_token_latency")
    if arrival is None or first is None:
        return None
    # The decode's engine request id: the one whose expect happened first after arrival.
    expects = [e for e in decode_events if e["kind"] == "expect" and e["t"] >= arrival]
    ext = str(decode_request["request_id"])
    expects = [e for e in expects if ext in e["request"]] or []
    if not expects:
        return None
    exp = expects[0]
    rid, remote = exp["request"], exp["remote"]

    def at(events: list[dict[str, Any]], kind: str, key: str) -> dict[str, Any] | None:
        return next((e for e in events if e["kind"] == kind and e.get("request") == key), None)

    push = at(prefill_events, "push", remote)
    sub = at(prefill_events, "submitted", remote)
    rel = at(prefill_events, "released", remote)
    rep = at(decode_events, "reported", rid)
    if not (push and sub and rel and rep):
        return None
    done = sub["start"] + rel["engine_s"]
    sent = next(
        (e["t"] for e in prefill_events if e["kind"] == "results_sent" and e["t"] >= rel["t"]),
        rel["t"],
    )
    marks = [arrival, exp["t"], push["t"], sub["t"], done, sent, rep["t"], arrival + first]
    return {name: marks[i + 1] - marks[i] for i, (name, _) in enumerate(PHASES)}


# -- the engine's limit without vLLM ---------------------------------------------


def backend_limit(sizes: list[int], concurrencies: Sequence[int]) -> dict[str, Any]:
    """kvguard's MooncakeBackend alone, two processes: the same per-request KV
    (``sizes``: blocks per request, 4 layers x one block of 1 MiB each) at each
    concurrency; bytes/s over the union of the ops' intervals."""
    import structlog

    from kvguard.decode.service import ReceiverProcess
    from transfer import KVCache, KVLayout, build_plan
    from transfer.mooncake import MooncakeBackend

    from .vllm_checkpoint import CONFIG, DTYPE_BYTES

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    block_bytes = BLOCK_SIZE * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 2 * DTYPE_BYTES
    layout = KVLayout(
        num_layers=CONFIG["num_hidden_layers"],
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


# -- one connector ---------------------------------------------------------------


def _mooncake_extra(ports: Ports, timeout_s: float = 120.0) -> dict[str, Any]:
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


def measure_connector(
    connector: str,
    levels: Sequence[tuple[int, int]],
    prompt_set: list[list[int]],
    out: Path,
    ports: Ports,
    python: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    if connector == "aggregated":
        servers = [server("aggregated", "", ports.decode, ports, out, python)]
    else:
        servers = [
            server(connector, "kv_producer", ports.prefill, ports, out, python),
            server(connector, "kv_consumer", ports.decode, ports, out, python),
        ]
    proxy: Server | None = None
    result: dict[str, Any] = {"levels": {}}
    try:
        for s in servers:
            s.start()
        wait_ready(servers, "/health", 600)
        log(
            f"   {connector}: servers ready ({', '.join(f'{s.name} pid {s.pid}' for s in servers)})"
        )
        decode = servers[-1]
        prefill = servers[0] if len(servers) == 2 else None
        if connector == "aggregated":
            client = Client("direct", decode.url)
        elif connector == "mooncake":
            assert prefill is not None
            client = Client("mooncake", decode.url, prefill.url, _mooncake_extra(ports))
        else:
            assert prefill is not None
            proxy = Server(
                f"{connector}-proxy",
                [
                    python,
                    "-m",
                    "kvguard.cli",
                    "proxy",
                    "--prefill",
                    prefill.url,
                    "--decode",
                    decode.url,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(ports.proxy),
                    "--log-level",
                    "warning",
                ],
                dict(os.environ),
                out / "logs" / f"{connector}-proxy.log",
                url=f"http://127.0.0.1:{ports.proxy}",
            )
            proxy.start()
            wait_ready([proxy], "/health", 60)
            client = Client("proxy", proxy.url)
        cursor = 0
        warm = drive(client, [(cursor + i, prompt_set[cursor + i]) for i in range(2)], 1)
        cursor += 2
        bad = [s.error for s in warm if s.error]
        if bad:
            raise RuntimeError(f"{connector}: warm-up failed: {bad[0]}")
        for c, n in levels:
            batch = [(cursor + i, prompt_set[cursor + i]) for i in range(n)]
            cursor += n
            cpu0 = {s.name: s.cpu_seconds() for s in servers}
            hooks0 = {s.name: hook_totals(records, s.name) for s in servers}
            t0 = time.time()
            sent = drive(client, batch, c)
            t1 = time.time()
            time.sleep(1.2)  # let the servers' hook snapshots and records land
            cpu = {s.name: s.cpu_seconds() - cpu0[s.name] for s in servers}
            hooks = {
                s.name: _hook_delta(hook_totals(records, s.name), hooks0[s.name]) for s in servers
            }
            result["levels"][str(c)] = summarize(
                connector, sent, servers, records, (t0, t1), cpu, hooks
            )
            row = result["levels"][str(c)]
            row["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
            log(
                f"   {connector} c={c:<3} n={n:<3} errors={row['errors']} "
                f"handover p50/p99 {row['handover_p50_ms']}/{row['handover_p99_ms']} ms  "
                f"ttft p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms  "
                f"kv {row['kv_gbps']} GB/s"
            )
            result.setdefault("outputs", {}).update({str(s.index): s.output for s in sent})
    finally:
        for srv in [proxy, *servers]:
            if srv is not None:
                srv.stop()
    return result


def summarize(
    connector: str,
    sent: list[Sent],
    servers: list[Server],
    records: Path,
    window: tuple[float, float],
    cpu: dict[str, float],
    hooks: dict[str, float],
) -> dict[str, Any]:
    ok = [s for s in sent if not s.error]
    decode = servers[-1]
    decode_reqs = read_jsonl(records, "requests", decode.name)
    handover: list[float] = []
    client_handover: list[float] = []
    matched: list[dict[str, Any]] = []
    for s in ok:
        r = _match(decode_reqs, s.request_id)
        if r is not None and r.get("first_token_latency") is not None:
            handover.append(float(r["first_token_latency"]))
            matched.append(r)
        if s.first:
            client_handover.append(s.first - (s.decode_sent or s.start))
    ttft = [s.first - s.start for s in ok if s.first]
    row: dict[str, Any] = {
        "requests": len(sent),
        "errors": len(sent) - len(ok),
        "error_sample": next((s.error for s in sent if s.error), ""),
        "prompt_tokens_mean": round(statistics.mean(s.tokens_in for s in sent)),
        "handover_n": len(handover),
        "handover_p50_ms": _ms(percentile(handover, 50)),
        "handover_p99_ms": _ms(percentile(handover, 99)),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "wall_s": round(window[1] - window[0], 3),
    }
    if connector == "mooncake":
        row["client_decode_leg_p50_ms"] = _ms(percentile(client_handover, 50))
        row["client_decode_leg_p99_ms"] = _ms(percentile(client_handover, 99))
    # Transfers that belong to this level: started within its window.
    a, b = window
    if connector == "aggregated":
        from .vllm_checkpoint import kv_bytes_per_token

        nbytes = sum(math.ceil(s.tokens_in / BLOCK_SIZE) * BLOCK_SIZE for s in sent)
        nbytes *= kv_bytes_per_token()
        row["kv_bytes_prefilled"] = nbytes
        row["kv_gbps"] = None
        row[f"cpu_s_per_gb_{decode.name}"] = round(cpu[decode.name] / (nbytes / 1e9), 3)
        row["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
        return row
    intervals: list[tuple[float, float]] = []
    rates: list[float] = []
    nbytes = 0
    events = {s.name: read_jsonl(records, "events", s.name) for s in servers}
    if connector == "kvguard":
        sub = {e["request"]: e for e in events[servers[0].name] if e["kind"] == "submitted"}
        for e in events[servers[0].name]:
            if e["kind"] == "released" and e["ok"] and e["request"] in sub:
                start = sub[e["request"]]["start"]
                if a <= start <= b:
                    intervals.append((start, start + e["engine_s"]))
                    rates.append(e["nbytes"] / max(e["engine_s"], 1e-9))
                    nbytes += e["nbytes"]
    else:
        for srv in servers:
            for e in events[srv.name]:
                if e["kind"] == "xfer" and e["ok"] and a <= e["start"] <= b:
                    intervals.append((e["start"], e["t"]))
                    rates.append(e["nbytes"] / max(e["t"] - e["start"], 1e-9))
                    nbytes += e["nbytes"]
    busy = union_seconds(intervals)
    row["transfers"] = len(intervals)
    row["kv_bytes"] = nbytes
    row["kv_gbps"] = round(nbytes / busy / 1e9, 3) if busy else None
    row["kv_gbps_median_transfer"] = round(statistics.median(rates) / 1e9, 3) if rates else None
    row["kv_gbps_wall"] = round(nbytes / (b - a) / 1e9, 3)
    gb = nbytes / 1e9
    for srv in servers:
        role = "prefill" if srv is servers[0] else "decode"
        row[f"cpu_s_per_gb_{role}"] = round(cpu[srv.name] / gb, 3) if gb else None
        row[f"hook_us_per_request_{role}"] = round(1e6 * hooks[srv.name] / max(1, len(sent)), 1)
    row["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
    if connector == "kvguard":
        splits = [
            p
            for r in matched
            if (p := kvguard_phases(events[servers[0].name], events[decode.name], r)) is not None
        ]
        row["phases_n"] = len(splits)
        row["phases_ms"] = {
            name: {
                "p50": _ms(percentile([p[name] for p in splits], 50)),
                "p99": _ms(percentile([p[name] for p in splits], 99)),
            }
            for name, _ in PHASES
        }
    return row


# -- the whole run ---------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for connector, data in result["connectors"].items():
        levels = sorted(data.get("levels", {}), key=int)
        if not levels:
            continue
        xs = [int(c) for c in levels]
        for ax, key in zip(axes, ("handover", "ttft"), strict=True):
            p50 = [data["levels"][c][f"{key}_p50_ms"] for c in levels]
            p99 = [data["levels"][c][f"{key}_p99_ms"] for c in levels]
            (line,) = ax.plot(xs, p50, marker="o", label=f"{connector} p50")
            ax.plot(
                xs,
                p99,
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{connector} p99",
            )
    axes[0].set_title("decode handover: arrival to first token (decode's view)")
    axes[1].set_title("time to first token through the proxy (client)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    m = result["machine"]
    fig.suptitle(
        f"vLLM PD on {m['cpus']} CPUs, {result['kv_bytes_per_token'] // 1024} KiB KV/token, "
        f"prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios, same run: kvguard / Mooncake handover, kvguard /
    backend-alone KV bytes/s."""
    conns = result["connectors"]
    kvg, mc = (
        conns.get("kvguard", {}).get("levels", {}),
        conns.get("mooncake", {}).get("levels", {}),
    )
    # The engine's limit at each concurrency: the better of the two runs
    # (before and after the servers), so load from elsewhere never lowers it.
    runs = [result.get("backend_limit", {}), result.get("backend_limit_after", {})]
    limit = {
        c: {"kv_gbps": max(r[c]["kv_gbps"] for r in runs if c in r)} for c in set().union(*runs)
    }
    best = max((v["kv_gbps"] for v in limit.values()), default=math.nan)
    out: dict[str, Any] = {}
    for c in sorted(set(kvg) | set(mc), key=int):
        g: dict[str, Any] = {}
        if c in kvg and c in mc:
            for q in ("p50", "p99"):
                ratio = kvg[c][f"handover_{q}_ms"] / mc[c][f"handover_{q}_ms"]
                g[f"handover_{q}_vs_mooncake"] = round(ratio, 3)
                g[f"handover_{q}_ok"] = ratio <= 1.0
        if c in kvg and kvg[c].get("kv_gbps") and c in limit:
            ratio = kvg[c]["kv_gbps"] / limit[c]["kv_gbps"]
            g["kv_gbps_vs_backend_same_c"] = round(ratio, 3)
            g["kv_gbps_vs_backend_best"] = round(kvg[c]["kv_gbps"] / best, 3)
            g["kv_gbps_ok"] = ratio >= 0.8
        out[c] = g
    return out


def run(
    connectors: Sequence[str],
    concurrencies: Sequence[int],
    requests: dict[int, int],
    out: Path,
    ports: Ports = Ports(),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from . import vllm_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "records", ignore_errors=True)
    vllm_checkpoint.generate(MODEL_DIR)
    levels = [(c, requests[c]) for c in concurrencies]
    prompt_set = prompts(2 + sum(n for _, n in levels), seed=11)
    sizes = [math.ceil(len(p) / BLOCK_SIZE) for p in prompt_set[2:]]
    dists = ("vllm-cpu", "torch", "mooncake-transfer-engine-non-cuda", "nixl", "aiohttp")
    machine = describe_machine({d: d for d in dists})
    result: dict[str, Any] = {
        "machine": machine,
        "uptime_before": Path("/proc/loadavg").read_text().strip(),
        "kv_bytes_per_token": vllm_checkpoint.kv_bytes_per_token(),
        "block_size": BLOCK_SIZE,
        "prompt_tokens": list(PROMPT_TOKENS),
        "max_tokens": MAX_TOKENS,
        "levels": {str(c): n for c, n in levels},
        "connectors": {},
    }
    log("== kvguard's MooncakeBackend alone, two processes, the same per-request KV")
    result["backend_limit"] = backend_limit(sizes[: max(n for _, n in levels)], concurrencies)
    for c, row in result["backend_limit"].items():
        log(
            f"   backend c={c:<3} {row['kv_gbps']} GB/s over busy time, median transfer "
            f"{row['kv_gbps_median_transfer']} GB/s"
        )
    for connector in connectors:
        log(f"== {connector}")
        t0 = time.monotonic()
        try:
            result["connectors"][connector] = measure_connector(
                connector, levels, prompt_set, out, ports, sys.executable, log
            )
        except Exception as exc:
            log(f"   {connector} FAILED: {exc}")
            result["connectors"][connector] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        result["connectors"][connector]["seconds"] = round(time.monotonic() - t0, 1)
    log("== kvguard's MooncakeBackend alone again, after the servers")
    result["backend_limit_after"] = backend_limit(sizes[: max(n for _, n in levels)], concurrencies)
    for c, row in result["backend_limit_after"].items():
        log(f"   backend c={c:<3} {row['kv_gbps']} GB/s over busy time")
    # Same prompts, greedy: PD output equals the aggregated server's.
    ref = result["connectors"].get("aggregated", {}).get("outputs", {})
    for name, data in result["connectors"].items():
        outs = data.get("outputs", {})
        if name != "aggregated" and ref and outs:
            both = [k for k in outs if k in ref and outs[k] and ref[k]]
            data["outputs_equal_aggregated"] = f"{sum(outs[k] == ref[k] for k in both)}/{len(both)}"
    result["goals"] = goals(result)
    result["uptime_after"] = Path("/proc/loadavg").read_text().strip()
    for data in result["connectors"].values():
        data.pop("outputs", None)
    (out / "vllm_pd.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out / 'vllm_pd.json'}")
    try:
        plot(result, out / "vllm_pd.png")
        log(f"wrote {out / 'vllm_pd.png'}")
    except ImportError:
        log("matplotlib missing (pip install -e '.[bench]'): no plot")
    return result


CONNECTORS: Final = ("aggregated", "mooncake", "kvguard", "nixl")
FULL_REQUESTS: Final = {1: 8, 8: 32, 32: 64}


def reexec_in_vllm_env(argv: Sequence[str]) -> None:
    """Run this module with .venv-vllm's interpreter when this one lacks vLLM."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if not VLLM_PYTHON.exists():
        raise SystemExit(
            f"vLLM is not importable here and {VLLM_PYTHON} does not exist: "
            "build it with `bash scripts/vllm-env.sh`"
        )
    os.execv(str(VLLM_PYTHON), [str(VLLM_PYTHON), "-m", "benchmarks.vllm_pd", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--connectors", default=",".join(CONNECTORS))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="", help="per level, e.g. 8,32,64 (default)")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 4 requests each")
    parser.add_argument("--out", type=Path, default=ROOT / ".venv-vllm" / "vllm-pd")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    reexec_in_vllm_env(argv)
    # SIGTERM unwinds like ^C: every server session started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    connectors = [c for c in args.connectors.split(",") if c]
    unknown = sorted(set(connectors) - set(CONNECTORS))
    if unknown:
        parser.error(f"unknown connectors {unknown}; known: {', '.join(CONNECTORS)}")
    concurrencies = [1, 4] if args.quick else [int(c) for c in args.concurrency.split(",")]
    if args.requests:
        counts = [int(n) for n in args.requests.split(",")]
        requests = dict(zip(concurrencies, counts, strict=True))
    elif args.quick:
        requests = dict.fromkeys(concurrencies, 4)
    else:
        requests = {c: FULL_REQUESTS.get(c, 2 * c) for c in concurrencies}
    result = run(connectors, concurrencies, requests, args.out, log=lambda s: print(s, flush=True))
    if args.json is not None:
        shutil.copyfile(args.out / "vllm_pd.json", args.json)
    failed = [n for n, d in result["connectors"].items() if "error" in d]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
