"""Tensor parallelism in the server deployment: TP 2 on both sides, and sizes that differ.

Four vLLM OpenAI servers (default multiprocessing, ``tests/vllm/servers.py``)
start once for the module: prefills of TP 2 and TP 1, decodes of TP 2 and
TP 1 (policy ``fail``). Every PD
outcome is compared with a non-PD request of the same prompt on the same
decode server: with random weights a head whose KV did not arrive (or
arrived in another head's place) changes the tokens.

* every pairing (2 -> 2, 2 -> 1, 1 -> 2) loads every head: concurrent
  requests through ``kvguard proxy``, tokens equal, every prompt token came
  over the transfer, both servers idle afterwards;
* a fault on one prefill rank (``kvguard_fault_rank``): every request fails
  with that rank's reason, while the other rank's transfers all succeed
  (Prometheus, per outcome), and no block stays in use on either side;
* one prefill rank's worker killed between the two PD steps: vLLM ends that
  engine, every decode request fails within its deadline and the decode is
  idle and still serves.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aiohttp
import pytest

from kvguard.vllm.params import PREFILL_KV_TRANSFER_PARAMS
from tests.vllm import servers as harness
from tests.vllm.client import Outcome, ask_all, complete, pd, prompts_of, run
from tests.vllm.ports import free_port
from tests.vllm.servers import SERVES_KV, Server, kv_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

# Generous on purpose: these tests check where KV goes, not how fast. Six
# worker processes share two cores (docs/vllm.md, "Several servers on one
# small host"), and this module starts and stops the most memory of any:
# on the project's VM, memory churn froze every process for 5-30 s at a
# time (a 0.1 s sleeper woke 29 s late), far past a 10 s heartbeat.
# In CI a TP 1 prefill then answered nothing for 38 s while the VM itself
# ran (its pages, idle for minutes, faulting back in), past a 30 s heartbeat.
DEADLINE_S = 120.0  # with kvguard_max_deadline_s raised to match
HEARTBEAT_TIMEOUT_S = 60.0
HOLD_S = 240.0  # within kvguard_max_hold_s (300 s)
SETTLE_S = DEADLINE_S + 60.0
# The proxy's prefill leg outlives a freeze as the loads do.
PROXY_ARGS = ["--prefill-timeout-s", str(2 * DEADLINE_S)]
MAX_TOKENS = 8
TP2 = ["--tensor-parallel-size", "2"]
# vLLM's CPU worker binds each rank's whole process to the rank's cores, and
# kvguard's threads (sender, receiver, engine) with it. On two cores shared
# by two TP 2 engines, ranks bound "0|1" starve those threads (heartbeats
# missed, a 60 s deadline acted on minutes late): let the kernel place them.
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# Four servers, six worker processes, start side by side on two cores.
START_S = 900.0


@dataclass
class Servers:
    p2: Server
    p1: Server
    d2: Server
    d1: Server

    @property
    def all(self) -> list[Server]:
        return [self.p2, self.p1, self.d2, self.d1]

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} log\n{s.log_tail(25)}" for s in self.all)


def prefill_kv(port: int, **extra: object) -> dict[str, object]:
    # A held prefill outlives a decode engine that did not step for 27 s in
    # CI (its renewals stopped with it), within kvguard_max_hold_s (300 s).
    return kv_config(
        "kv_producer",
        kvguard_control_port=port,
        kvguard_deadline_s=DEADLINE_S,
        kvguard_max_deadline_s=DEADLINE_S,
        kvguard_hold_s=HOLD_S,
        **extra,
    )


@pytest.fixture(scope="module")
def servers(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Servers]:
    monkeypatch_module.setattr(harness, "START_S", START_S)
    kv = {
        "kvguard_deadline_s": DEADLINE_S,
        "kvguard_max_deadline_s": DEADLINE_S,
        "kvguard_heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
    }
    s = Servers(
        p2=Server("tp-prefill-2", prefill_kv(free_port(span=2)), args=TP2, env=NOBIND),
        p1=Server("tp-prefill-1", prefill_kv(free_port())),
        d2=Server("tp-decode-2", kv_config("kv_consumer", **kv), args=TP2, env=NOBIND),
        d1=Server("tp-decode-1", kv_config("kv_consumer", **kv)),
    )
    try:
        harness.start_all(s.all)
        yield s
    finally:
        for server in s.all:
            server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def references(decode: Server, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    async def go() -> list[tuple[Outcome, object]]:
        async with aiohttp.ClientSession() as http:
            return list(
                await asyncio.gather(
                    *(complete(http, decode, p, MAX_TOKENS, timeout_s=300) for p in prompts)
                )
            )

    outs = [o for o, _ in run(go())]
    assert all(o.kind == "ok" and o.tokens for o in outs), outs
    return [list(o.tokens or ()) for o in outs]


_SAMPLE = re.compile(r'(\w+)="([^"]*)"')


def transfers(server: Server) -> Counter[tuple[str, str]]:
    """``vllm:kvguard_transfers_total`` by (outcome, reason), every rank together."""
    out: Counter[tuple[str, str]] = Counter()
    for key, value in server.metrics().items():
        if key.startswith("vllm:kvguard_transfers_total{"):
            labels = dict(_SAMPLE.findall(key))
            out[labels["outcome"], labels["reason"]] += int(value)
    return +out


def ensure(server: Server, kv: dict[str, object]) -> None:
    """``server`` running with the connector settings ``kv``: restarted if not."""
    assert server.proc is not None
    if server.kv != kv or server.proc.poll() is not None:
        server.kv = kv
        server.restart()


def clean_kv(s: Servers) -> dict[str, object]:
    extra = s.p2.kv["kv_connector_extra_config"]  # type: ignore[index]
    return prefill_kv(int(extra["kvguard_control_port"]))


def fresh(*servers: Server) -> None:
    for server in servers:
        server.reset_prefix_cache(within_s=SETTLE_S)


@pytest.mark.parametrize(("prefill", "decode"), [("p2", "d2"), ("p2", "d1"), ("p1", "d2")])
def test_every_pairing_loads_every_head(servers: Servers, prefill: str, decode: str) -> None:
    ensure(servers.p2, clean_kv(servers))
    p, d = getattr(servers, prefill), getattr(servers, decode)
    prompts = prompts_of(8, seed=40 + len(prefill + decode))
    want = references(d, prompts)
    fresh(p, d)
    before = d.tokens_by_source()
    outs = ask_all(p, d, prompts, MAX_TOKENS, timeout_s=4 * DEADLINE_S, proxy_args=PROXY_ARGS)
    bad = [(i, o) for i, (o, w) in enumerate(zip(outs, want, strict=True)) if o.tokens != w]
    assert not bad, f"{p.name} -> {d.name}: {bad[:4]}\n{servers.logs()}"
    moved = d.tokens_by_source() - before
    assert moved == {"external_kv_transfer": sum(len(q) for q in prompts)}, moved
    for server in (p, d):
        server.wait_idle(SETTLE_S)


def test_a_fault_on_one_prefill_rank_fails_every_request(servers: Servers) -> None:
    s = servers
    port = int(clean_kv(s)["kv_connector_extra_config"]["kvguard_control_port"])  # type: ignore[index]
    ensure(s.p2, prefill_kv(port, kvguard_fault_rate=1.0, kvguard_fault_rank=1))
    prompts = prompts_of(4, seed=60)
    fresh(s.d2)
    p_before, d_before = transfers(s.p2), transfers(s.d2)

    async def go() -> list[Outcome]:
        async with aiohttp.ClientSession() as http:
            return list(
                await asyncio.gather(
                    *(
                        pd(http, s.p2, s.d2, q, MAX_TOKENS, timeout_s=4 * DEADLINE_S)
                        for q in prompts
                    )
                )
            )

    t0 = time.monotonic()
    outs = run(go())
    assert all(o.kind == "http 500 InternalServerError" for o in outs), outs
    assert max(o.seconds for o in outs) < DEADLINE_S + 5, outs
    for server in (s.p2, s.d2):
        server.wait_idle(SETTLE_S)
    # Rank 0's transfers all went through; rank 1's all failed, each its own reason.
    p_moved, d_moved = transfers(s.p2) - p_before, transfers(s.d2) - d_before
    assert p_moved[("done", "")] == len(prompts), p_moved
    assert sum(n for (o, _), n in p_moved.items() if o == "failed") == len(prompts), p_moved
    assert d_moved[("loaded", "")] == len(prompts), d_moved
    failed = {r: n for (o, r), n in d_moved.items() if o == "failed"}
    assert sum(failed.values()) == len(prompts), (d_moved, time.monotonic() - t0)
    # The request still serves through the TP 1 prefill, and after a clean restart.
    check_serves(s.p1, s.d2)


def test_killing_one_prefill_rank_between_the_steps(servers: Servers) -> None:
    s = servers
    ensure(s.p2, clean_kv(s))
    prompts = prompts_of(4, seed=70)
    fresh(s.p2, s.d2)

    async def prefill_all() -> list[dict[str, object]]:
        async with aiohttp.ClientSession() as http:
            firsts = await asyncio.gather(
                *(complete(http, s.p2, q, 1, dict(PREFILL_KV_TRANSFER_PARAMS)) for q in prompts)
            )
        assert all(o.kind == "ok" and params for o, params in firsts), firsts
        return [dict(params or {}) for _, params in firsts]

    params = run(prefill_all())
    worker = rank_pid(s.p2, 1)
    os.kill(worker, signal.SIGKILL)

    async def decode_all() -> list[Outcome]:
        async with aiohttp.ClientSession() as http:
            pairs = await asyncio.gather(
                *(
                    complete(http, s.d2, q, MAX_TOKENS, dict(kv), timeout_s=4 * DEADLINE_S)
                    for q, kv in zip(prompts, params, strict=True)
                )
            )
        return [o for o, _ in pairs]

    outs = run(decode_all())
    assert all(o.kind == "http 500 InternalServerError" for o in outs), (outs, s.logs())
    assert max(o.seconds for o in outs) < DEADLINE_S + 5, outs
    s.d2.wait_idle(SETTLE_S)
    check_serves(s.p1, s.d2)


def rank_pid(server: Server, rank: int) -> int:
    """The pid of ``server``'s worker of tensor parallel rank ``rank`` (from its log)."""
    found = re.findall(rf"\(Worker_TP{rank} pid=(\d+)\)", server.log.read_text(errors="replace"))
    assert found, f"no Worker_TP{rank} in {server.log}"
    return int(found[-1])


def check_serves(prefill: Server, decode: Server) -> None:
    (prompt,) = prompts_of(1, seed=999)
    (want,) = references(decode, [prompt])
    fresh(prefill, decode)

    async def go() -> Outcome:
        async with aiohttp.ClientSession() as http:
            return await pd(
                http, prefill, decode, prompt, MAX_TOKENS, timeout_s=4 * DEADLINE_S, kv=SERVES_KV
            )

    got = run(go())
    assert got.kind == "ok" and got.tokens == want, got
    decode.wait_idle(SETTLE_S)
