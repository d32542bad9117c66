"""The cluster the server-mode tests share: a prefill and two decodes, as users run them.

Three ``python -m vllm.entrypoints.openai.api_server`` processes with vLLM's
default multiprocessing (APIServer, EngineCore, Worker each), started once
per session by the ``cluster`` fixture (tests/vllm/conftest.py): one prefill
and two decodes, one per ``kv_load_failure_policy``. Every PD outcome is
compared with a non-PD request of the same prompt on the same decode server.
Before each scenario the prefix caches are emptied, so a PD request loads its
KV instead of finding the reference's. After each one every server is idle
(nothing running or waiting, KV cache usage 0) and one more PD request
through each decode still equals its reference (``settle``).

Each scenario adds a ``Row`` to ``Cluster.rows``: the table printed at the
end (``-s``) and written to ``.venv-vllm/vllm-server-table.md``.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.vllm.client import Outcome, complete, http_session, pd, prompts_of, run
from tests.vllm.ports import free_port
from tests.vllm.report import Row
from tests.vllm.servers import SERVES_KV, Server, kv_config, start_all

__all__ = [
    "DEADLINE_S",
    "FAILED",
    "FREEZE_S",
    "HEARTBEAT_S",
    "HEARTBEAT_TIMEOUT_S",
    "KILL_S",
    "MAX_TOKENS",
    "QUEUE_S",
    "SETTLE_S",
    "Cluster",
    "assert_outcomes",
    "decode_step",
    "ended_as",
    "first_done",
    "fresh",
    "idle_after",
    "in_flight",
    "load_seconds",
    "references",
    "sampling",
    "settle",
    "spread",
    "spread_tokens",
    "start_cluster",
    "timed",
    "transfers",
    "wait_loading",
]

DEADLINE_S = 10.0  # the prefill's hold and the decodes' wait (kvguard_deadline_s)
HEARTBEAT_TIMEOUT_S = 3.0  # the decodes' default kvguard_heartbeat_timeout_s
# A request ends by its deadline counted from when vLLM allocated its blocks;
# before that it may queue behind the decode's 16 running requests.
QUEUE_S = 15.0
SETTLE_S = DEADLINE_S + 20.0  # bounds a wait for a server to become idle
MAX_TOKENS = 8
# The promises of docs/vllm.md "What a user sees on each failure":
KILL_S = 1.0  # a killed prefill's loads end this soon after its connections close
HEARTBEAT_S = 0.5  # the decodes' default kvguard_heartbeat_s
FREEZE_S = HEARTBEAT_TIMEOUT_S + 1.0  # a frozen prefill's loads end this soon after the freeze
FAILED = "http 500 InternalServerError"  # policy "fail": a load failure ends the request


def spread_tokens(n: int) -> list[int]:
    """max_tokens 8..64 across ``n`` requests, so they finish one after another."""
    return [8 + (56 * i) // max(n - 1, 1) for i in range(n)]


@dataclass
class Cluster:
    prefill: Server
    fail: Server  # decode, kv_load_failure_policy "fail"
    recompute: Server  # decode, kv_load_failure_policy "recompute"
    refs: dict[tuple[str, tuple[int, ...], int, int], tuple[int, ...]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    @property
    def servers(self) -> list[Server]:
        return [self.prefill, self.fail, self.recompute]

    def logs(self, servers: Sequence[Server] = ()) -> str:
        """The tails of ``servers``' logs (the cluster's by default)."""
        # kvguard's own events first: a CI excerpt keeps the head of a failure.
        ours = "prefill_link|kv_load|KV load|sender_|hold_|push_|receiver_|peer_"
        them = servers or self.servers
        return "\n".join(
            f"--- {s.name} kvguard events\n{s.log_tail(15, grep=ours)}" for s in them
        ) + "\n".join(f"\n--- {s.name} log\n{s.log_tail(25)}" for s in them)


def start_cluster() -> Cluster:
    extra = {"kvguard_deadline_s": DEADLINE_S}
    prefill = Server("prefill", kv_config("kv_producer", kvguard_control_port=free_port(), **extra))
    fail = Server("decode-fail", kv_config("kv_consumer", "fail", **extra))
    recompute = Server("decode-recompute", kv_config("kv_consumer", "recompute", **extra))
    c = Cluster(prefill, fail, recompute)
    try:
        start_all(c.servers)
    except BaseException:
        for s in c.servers:
            s.stop()
        raise
    return c


def sampling(n: int) -> dict[str, Any]:
    """Greedy ``n`` choices: vLLM refuses n > 1 at temperature 0, so top_k 1 instead."""
    return {"n": n} if n == 1 else {"n": n, "temperature": 1.0, "top_k": 1}


def references(
    c: Cluster,
    decode: Server,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    n: int = 1,
) -> list[tuple[int, ...]]:
    """Each prompt's non-PD greedy tokens on ``decode`` (all ``n`` choices must agree)."""
    keys = [(decode.name, tuple(p), m, n) for p, m in zip(prompts, max_tokens, strict=True)]
    missing = [k for k in dict.fromkeys(keys) if k not in c.refs]

    async def non_pd() -> list[Outcome]:
        async with http_session() as http:
            return list(
                await asyncio.gather(
                    *(
                        complete(http, decode, list(k[1]), k[2], timeout_s=180, **sampling(k[3]))
                        for k in missing
                    )
                )
            )

    for k, (out, _) in zip(missing, run(non_pd()) if missing else [], strict=True):
        assert out.kind == "ok" and len(out.choices) == n, out
        assert len(set(out.choices)) == 1, f"top_k 1, yet the {n} choices differ: {out}"
        c.refs[k] = out.choices[0]
    return [c.refs[k] for k in keys]


def fresh(*servers: Server) -> None:
    """Empty the prefix caches, so every PD request below transfers its KV."""
    for s in servers:
        s.reset_prefix_cache()


def idle_after(c: Cluster, row: Row) -> None:
    """Record (not assert: the outcomes' check comes first) whether each server went idle."""
    seen: list[str] = []
    for s in c.servers:
        try:
            seen.append(f"{s.name} {s.wait_idle(SETTLE_S):.1f}s")
        except AssertionError:
            seen.append(f"{s.name} NOT IDLE {s.load()}")
    row.decode_idle = ", ".join(seen)


def settle(c: Cluster, row: Row) -> None:
    """Every server idle; then each decode still serves a PD request equal to non-PD."""
    for s in c.servers:
        s.wait_idle(SETTLE_S)
    prompt = prompts_of(1, seed=999)[0]
    for decode in (c.fail, c.recompute):
        (want,) = references(c, decode, [prompt], [MAX_TOKENS])
        fresh(c.prefill, decode)

        async def check(d: Server = decode) -> Outcome:
            async with http_session() as http:
                return await pd(http, c.prefill, d, prompt, MAX_TOKENS, kv=SERVES_KV)

        got = run(check())
        served = got.kind == "ok" and got.tokens == list(want)
        row.note += (
            f"{'; ' if row.note else ''}{decode.name} serves: {'yes' if served else got.kind}"
        )
        assert served, f"{decode.name}: {got}\n{c.logs()}"
    for s in c.servers:
        s.wait_idle(SETTLE_S)


async def first_done(tasks: Sequence[asyncio.Task[Outcome]], count: int) -> None:
    """Return once ``count`` of ``tasks`` ended."""
    while sum(t.done() for t in tasks) < count:
        await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)


async def in_flight(server: Server, tasks: Sequence[asyncio.Task[Outcome]]) -> None:
    """Return once ``server`` has a request (loading its KV or generating)
    while ``tasks`` are not all done: by the server's own count, not by which
    replies this process has read. (Generating alone can be too short to
    see: 14 requests of tiny-llama ended in CI before a poll saw one run.)"""
    until = time.monotonic() + SETTLE_S
    while True:
        load = await asyncio.to_thread(server.load)
        if load.running + load.waiting > 0:
            return
        assert not all(t.done() for t in tasks), f"{server.name} ended them all unseen: {tasks}"
        assert time.monotonic() < until, f"{server.name} had none of the requests"
        await asyncio.sleep(0.02)


def assert_outcomes(
    c: Cluster,
    outs: Sequence[Outcome],
    want: Sequence[Sequence[int]],
    errors: set[str],
    servers: Sequence[Server] = (),
) -> None:
    """Each request is ok with every choice equal to its reference, or one of
    ``errors``; a failure shows ``servers``' logs (the cluster's by default)."""
    bad = [
        (i, o)
        for i, (o, w) in enumerate(zip(outs, want, strict=True))
        if not (o.kind == "ok" and all(list(ch) == list(w) for ch in o.choices))
        and o.kind not in errors
    ]
    assert not bad, (
        f"unexpected outcomes (allowed errors {sorted(errors)}):\n"
        + "\n".join(f"  #{i}: {o}" for i, o in bad[:10])
        + f"\n{c.logs(servers)}"
    )


async def decode_step(
    http: aiohttp.ClientSession, decode: Server, prompt: list[int], max_tokens: int, kv: Any
) -> Outcome:
    out, _ = await complete(http, decode, prompt, max_tokens, kv)
    return out


async def timed(step: Awaitable[Outcome]) -> tuple[Outcome, float]:
    """``step``'s outcome and the monotonic time it arrived."""
    out = await step
    return out, time.monotonic()


def wait_loading(server: Server, count: int, within_s: float) -> float:
    """Seconds until ``server`` has ``count`` requests waiting with blocks
    allocated (loading their KV); fails after ``within_s``."""
    t0 = time.monotonic()
    while True:
        load = server.load()
        if load.waiting >= count and load.kv_usage > 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"{server.name}: not {count} loading: {load}"
        time.sleep(0.02)


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def transfers(server: Server) -> Counter[tuple[str, str]]:
    """``vllm:kvguard_transfers_total`` by (outcome, reason), every rank together."""
    out: Counter[tuple[str, str]] = Counter()
    for key, value in server.metrics().items():
        if key.startswith("vllm:kvguard_transfers_total{"):
            labels = dict(_LABEL.findall(key))
            out[labels["outcome"], labels["reason"]] += int(value)
    return +out


def load_seconds(server: Server, outcome: str, within: float | None = None) -> tuple[int, float]:
    """(count, sum) of ``vllm:kvguard_transfer_seconds`` for the decode's loads
    that ended ``outcome``: kvguard's own time from asking to the outcome.
    With ``within`` (a bucket's bound), the count is of those that took at
    most that long."""
    count, total = 0, 0.0
    counted = "_count" if within is None else "_bucket"
    for key, value in server.metrics().items():
        name, _, rest = key.partition("{")
        labels = dict(_LABEL.findall(rest))
        if labels.get("role") != "decode" or labels.get("outcome") != outcome:
            continue
        if within is not None and name.endswith("_bucket") and float(labels["le"]) != within:
            continue
        if name == f"vllm:kvguard_transfer_seconds{counted}":
            count += int(value)
        elif name == "vllm:kvguard_transfer_seconds_sum":
            total += value
    return count, total


def spread(seconds: Sequence[float]) -> str:
    return f"{min(seconds):.2f}/{statistics.median(seconds):.2f}/{max(seconds):.2f}s"


def ended_as(
    server: Server, before: Counter[tuple[str, str]], want: dict[tuple[str, str], int]
) -> None:
    """``server``'s kvguard transfers since ``before`` become exactly ``want``
    (its stats reach /metrics with vLLM's next log interval)."""
    until = time.monotonic() + SETTLE_S
    while True:
        got = dict(transfers(server) - before)
        if got == want or time.monotonic() > until:
            break
        time.sleep(0.25)
    assert got == want, f"{server.name}: transfers {got}, want {want}\n{server.log_tail(30)}"
