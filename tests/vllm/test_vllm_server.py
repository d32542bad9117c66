"""The connector in the deployment users run: two vLLM OpenAI servers, PD steps over HTTP.

Both engines are ``python -m vllm.entrypoints.openai.api_server`` with
vLLM's default multiprocessing (APIServer, EngineCore, Worker in three
processes), started once per module (``tests/vllm/servers.py``): one
prefill and two decodes, one per ``kv_load_failure_policy``. The clients
go through ``kvguard proxy`` (a subprocess) or run the toy proxy's two steps
themselves where the test acts between them, and every PD outcome is
compared with a non-PD request of the same prompt on the same decode
server. Before each scenario the prefix caches are emptied, so a PD request
loads its KV instead of finding the reference's. After each one every
server is idle (nothing running or waiting, KV cache usage 0) and one more
PD request through each decode still equals its reference.

Each scenario adds a row to the table printed at the end (``-s``) and
written to ``.venv-vllm/vllm-server-table.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.vllm.client import Outcome, ask, ask_all, complete, pd, prefill_step, prompts_of, run
from tests.vllm.ports import free_port
from tests.vllm.report import TABLE_HEADER, Row
from tests.vllm.servers import (
    BIN,
    LOGS,
    ROOT,
    SERVES_KV,
    Proxy,
    Server,
    kv_config,
    start_all,
    wait_healthy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

DEADLINE_S = 10.0  # the prefill's hold and the decodes' wait (kvguard_deadline_s)
HEARTBEAT_TIMEOUT_S = 3.0  # the decodes' default kvguard_heartbeat_timeout_s
# A request ends by its deadline counted from when vLLM allocated its blocks;
# before that it may queue behind the decode's 16 running requests.
QUEUE_S = 15.0
SETTLE_S = DEADLINE_S + 20.0  # bounds a wait for a server to become idle
MAX_TOKENS = 8
_rng = random.Random(17)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(_rng.randrange(33, 100))] for _ in range(32)]

ROWS: list[Row] = []


def spread_tokens(n: int) -> list[int]:
    """max_tokens 8..64 across ``n`` requests, so they finish one after another."""
    return [8 + (56 * i) // max(n - 1, 1) for i in range(n)]


# ==== the servers ==============================================================


@dataclass
class Cluster:
    prefill: Server
    fail: Server  # decode, kv_load_failure_policy "fail"
    recompute: Server  # decode, kv_load_failure_policy "recompute"
    refs: dict[tuple[str, tuple[int, ...], int, int], tuple[int, ...]] = field(default_factory=dict)

    @property
    def servers(self) -> list[Server]:
        return [self.prefill, self.fail, self.recompute]

    def logs(self) -> str:
        # kvguard's own events first: a CI excerpt keeps the head of a failure.
        ours = "prefill_link|kv_load|sender_|hold_|push_|receiver_|peer_"
        return "\n".join(
            f"--- {s.name} kvguard events\n{s.log_tail(15, grep=ours)}" for s in self.servers
        ) + "\n".join(f"\n--- {s.name} log\n{s.log_tail(25)}" for s in self.servers)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    extra = {"kvguard_deadline_s": DEADLINE_S}
    prefill = Server("prefill", kv_config("kv_producer", kvguard_control_port=free_port(), **extra))
    fail = Server("decode-fail", kv_config("kv_consumer", "fail", **extra))
    recompute = Server("decode-recompute", kv_config("kv_consumer", "recompute", **extra))
    c = Cluster(prefill, fail, recompute)
    try:
        start_all(c.servers)
        yield c
    finally:
        for s in c.servers:
            s.stop()


@pytest.fixture(autouse=True)
def idle_before(request: pytest.FixtureRequest) -> None:
    """A scenario starts on idle servers: one that an earlier scenario's
    failure left busy, fenced or dead is restarted (and says so), so that one
    failure fails one test, not every test after it."""
    if "cluster" not in request.fixturenames:
        return
    c: Cluster = request.getfixturevalue("cluster")
    for s in c.servers:
        try:
            s.wait_idle(SETTLE_S)
        except (AssertionError, OSError) as exc:
            print(f"\n{s.name} not idle before {request.node.name}, restarting: {exc!r:.300}")
            s.restart()


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    text = "\n".join([TABLE_HEADER, *(r.line() for r in ROWS)])
    (LOGS / "vllm-server-table.md").write_text(text + "\n")
    print("\n" + text)


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
        async with aiohttp.ClientSession() as http:
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
            async with aiohttp.ClientSession() as http:
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


def assert_outcomes(
    c: Cluster, outs: Sequence[Outcome], want: Sequence[Sequence[int]], errors: set[str]
) -> None:
    """Each request is ok with every choice equal to its reference, or one of ``errors``."""
    bad = [
        (i, o)
        for i, (o, w) in enumerate(zip(outs, want, strict=True))
        if not (o.kind == "ok" and all(list(ch) == list(w) for ch in o.choices))
        and o.kind not in errors
    ]
    assert not bad, (
        f"unexpected outcomes (allowed errors {sorted(errors)}):\n"
        + "\n".join(f"  #{i}: {o}" for i, o in bad[:10])
        + f"\n{c.logs()}"
    )


# ==== docs/vllm.md's commands ==================================================

DOCS = ROOT / "docs" / "vllm.md"
DOCS_MARK = "<!-- checked by tests/vllm/test_vllm_server.py -->"


def docs_commands() -> tuple[str, str]:
    """The checked block of docs/vllm.md: (the servers and proxy, the curl through it)."""
    text = DOCS.read_text()
    found = re.search(re.escape(DOCS_MARK) + r"\s*```sh\n(.*?)```", text, re.S)
    assert found, f"no block marked {DOCS_MARK!r} in {DOCS}"
    block = found.group(1)
    start, sep, curl = block.partition("# once /health")
    assert sep, "the checked block has no '# once /health' line between the servers and the curl"
    return start, curl.partition("\n")[2]


def test_docs_commands_serve_a_pd_request_through_the_proxy() -> None:
    start, curl = docs_commands()
    ports = {p: free_port() for p in ("8100", "8200", "8000", "17600")}

    def local(cmd: str) -> str:
        for old, new in ports.items():
            cmd = re.sub(rf"\b{old}\b", str(new), cmd)
        return cmd

    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    log = LOGS / "docs-commands.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", local(start) + "\nwait"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        urls = [f"http://127.0.0.1:{ports[p]}" for p in ("8100", "8200", "8000")]

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"docs commands exited {proc.returncode}:\n{log.read_text()}")

        wait_healthy(urls, time.monotonic() + 2 * 300.0, alive)
        got = subprocess.run(
            ["bash", "-c", local(curl)], cwd=ROOT, env=env, capture_output=True, timeout=120
        )
        assert got.returncode == 0, (got, log.read_text()[-3000:])
        reply = json.loads(got.stdout)
        (choice,) = reply["choices"]
        assert choice["finish_reason"] == "length", reply
        assert reply["usage"]["completion_tokens"] == 16, reply
        decode = Server("docs-decode", port=ports["8200"])
        assert decode.tokens_by_source()["external_kv_transfer"] > 0, "the decode loaded no KV"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


# ==== scenarios ================================================================


def test_one_request_through_pd_equals_non_pd(cluster: Cluster) -> None:
    prefill, decode = cluster.prefill, cluster.fail
    (want,) = references(cluster, decode, [PROMPTS[0]], [MAX_TOKENS])
    fresh(prefill, decode)

    async def go() -> Outcome:
        async with aiohttp.ClientSession() as http:
            return await pd(http, prefill, decode, PROMPTS[0], MAX_TOKENS)

    got = run(go())
    assert got.kind == "ok", f"{got}\n--- decode log\n{decode.log_tail()}"
    assert got.tokens == list(want), got
    assert got.seconds < DEADLINE_S, got


def test_clean_concurrent_requests_through_kvguard_proxy(cluster: Cluster) -> None:
    c = cluster
    prompts = prompts_of(33, seed=1)
    want = references(c, c.fail, prompts, [MAX_TOKENS] * len(prompts))
    fresh(c.prefill, c.fail)
    before = c.fail.tokens_by_source()
    row = Row("clean: 32 concurrent via kvguard proxy + 1 via toy-proxy steps")
    proxy = Proxy([c.prefill.url], [c.fail.url]).start()
    try:

        async def go() -> list[Outcome]:
            async with aiohttp.ClientSession() as http:
                many = await asyncio.gather(
                    *(ask(http, proxy.url, p, MAX_TOKENS) for p in prompts[:32])
                )
                toy = await pd(http, c.prefill, c.fail, prompts[32], MAX_TOKENS)
                return [*many, toy]

        outs = run(go())
    finally:
        proxy.stop()
    row.add(outs, want)
    ROWS.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs, want, set())
    moved = c.fail.tokens_by_source() - before
    # Every prompt token came over the transfer: none computed, none cached.
    assert moved == {"external_kv_transfer": sum(len(p) for p in prompts)}, moved
    settle(c, row)


def test_prefix_caching_with_shared_prefixes_on_both_sides(cluster: Cluster) -> None:
    c = cluster
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 256) for _ in range(64)] for _ in range(4)]  # two blocks
    firsts = [p + [rng.randrange(1, 256) for _ in range(5)] for p in prefixes]
    rest = [p + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))] for p in prefixes * 3]
    want = references(c, c.fail, firsts + rest, [MAX_TOKENS] * (len(firsts) + len(rest)))
    fresh(c.prefill, c.fail)
    p_before, d_before = c.prefill.tokens_by_source(), c.fail.tokens_by_source()
    row = Row("prefix caching: 4 prefixes of 64 tokens, 16 prompts")
    proxy = Proxy([c.prefill.url], [c.fail.url]).start()
    try:

        async def go() -> list[Outcome]:
            async with aiohttp.ClientSession() as http:
                one = await asyncio.gather(*(ask(http, proxy.url, p, MAX_TOKENS) for p in firsts))
                two = await asyncio.gather(*(ask(http, proxy.url, p, MAX_TOKENS) for p in rest))
                return [*one, *two]

        outs = run(go())
    finally:
        proxy.stop()
    row.add(outs, want)
    ROWS.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs, want, set())
    hit = 64 * len(rest)  # the second wave finds its prefix's two blocks on both sides
    p_moved = c.prefill.tokens_by_source() - p_before
    d_moved = c.fail.tokens_by_source() - d_before
    total = sum(len(p) for p in firsts + rest)
    assert p_moved == {"local_cache_hit": hit, "local_compute": total - hit}, p_moved
    assert d_moved == {"local_cache_hit": hit, "external_kv_transfer": total - hit}, d_moved
    settle(c, row)


def test_client_disconnect_mid_load_leaves_decode_idle(cluster: Cluster) -> None:
    """The prefill is frozen after its step, so the decode's load waits; the client leaves.

    The request ends at once, but its blocks stay out of use while the frozen
    prefill may still write them (it has the push, unread): they come back
    once the thawed prefill answers the abort.
    """
    c = cluster
    (prompt,) = prompts_of(1, seed=6)
    references(c, c.fail, [prompt], [MAX_TOKENS])
    fresh(c.prefill, c.fail)
    row = Row("client disconnects mid-load (prefill frozen meanwhile)")

    async def go() -> float:
        async with aiohttp.ClientSession() as http:
            first, params = await prefill_step(http, c.prefill, prompt)
            assert first.kind == "ok" and params is not None, first
            c.prefill.signal(signal.SIGSTOP)
            task = asyncio.create_task(complete(http, c.fail, prompt, MAX_TOKENS, params))
            end = time.monotonic() + HEARTBEAT_TIMEOUT_S
            while True:  # loading: its blocks are allocated while it waits
                load = await asyncio.to_thread(c.fail.load)
                if load.waiting == 1 and load.kv_usage > 0:
                    break
                assert time.monotonic() < end, f"the decode never started loading: {load}"
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t0 = time.monotonic()
            while True:  # vLLM ends the request; the fence keeps its blocks
                load = await asyncio.to_thread(c.fail.load)
                if load.running == 0 and load.waiting == 0:
                    break
                assert time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S, f"request not ended: {load}"
                await asyncio.sleep(0.05)
            ended_s = time.monotonic() - t0
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S + 1)  # past heartbeat loss: still fenced
            fenced = await asyncio.to_thread(c.fail.load)
            return ended_s, fenced.kv_usage

    try:
        ended_s, fenced_usage = run(go())
    finally:
        c.prefill.signal(signal.SIGCONT)
    t_thaw = time.monotonic()
    c.fail.wait_idle(SETTLE_S)
    idle_s = time.monotonic() - t_thaw
    row.requests, row.errors["client cancelled"] = 1, 1
    row.max_s = ended_s
    row.note = (
        f"request ended {ended_s:.1f}s after the disconnect; blocks fenced while the prefill "
        f"was frozen, back {idle_s:.1f}s after its thaw"
    )
    ROWS.append(row)
    idle_after(c, row)
    assert fenced_usage > 0, "blocks the frozen prefill may write went back to vLLM"
    assert idle_s <= DEADLINE_S + 2, row.note
    settle(c, row)


async def decode_step(
    http: aiohttp.ClientSession, decode: Server, prompt: list[int], max_tokens: int, kv: Any
) -> Outcome:
    out, _ = await complete(http, decode, prompt, max_tokens, kv)
    return out


def links_lost(s: Server) -> int:
    """How often ``s``'s receiver saw a prefill link drop (its log's events)."""
    return s.log.read_text(errors="replace").count("prefill_link_lost")


def _decode_steps_with_prefill_fault(c: Cluster, sig: int, name: str) -> None:
    """Prefill 48 prompts; ask both decodes for 8 each (all ok), then send ``sig``
    to the prefill, its 32 other requests held, and ask the decodes for them.

    A frozen prefill may still write what it was asked to: the fail decode's
    requests end by their deadline, but a recompute request must not reuse
    its blocks before the prefill lets go, so it waits for the thaw (sent once
    every fail request ended) or for the prefill's death (connection refused).
    """
    prompts = prompts_of(48, seed=30 + sig)
    tokens = spread_tokens(24) * 2
    decodes = [c.fail] * 24 + [c.recompute] * 24
    want = references(c, c.fail, prompts[:24], tokens[:24])
    want += references(c, c.recompute, prompts[24:], tokens[24:])
    fresh(c.prefill, c.fail, c.recompute)
    r_before = c.recompute.tokens_by_source()
    first = [i for i in range(48) if i % 24 < 8]
    second = [i for i in range(48) if i % 24 >= 8]

    async def go() -> list[Outcome]:
        async with aiohttp.ClientSession() as http:
            steps = await asyncio.gather(*(prefill_step(http, c.prefill, p) for p in prompts))
            assert all(o.kind == "ok" and kv for o, kv in steps), steps
            outs: dict[int, Outcome] = {}

            def ask_decode(i: int) -> asyncio.Task[Outcome]:
                return asyncio.create_task(
                    decode_step(http, decodes[i], prompts[i], tokens[i], steps[i][1])
                )

            for i, o in zip(first, await asyncio.gather(*map(ask_decode, first)), strict=True):
                outs[i] = o
            # Before the second wave is sent: every one of its loads meets the
            # fault, however fast the machine moves the first.
            lost_before = links_lost(c.recompute)
            c.prefill.signal(sig)
            later = {i: ask_decode(i) for i in second}
            fail_side = [i for i in second if decodes[i] is c.fail]
            for i in fail_side:
                outs[i] = await later[i]
            if sig == signal.SIGSTOP:
                # Thaw once the recompute decode also saw its link drop: its
                # loads then failed fenced and recompute, however the two
                # decodes' heartbeat timers fall.
                until = time.monotonic() + SETTLE_S
                while links_lost(c.recompute) == lost_before and time.monotonic() < until:
                    await asyncio.sleep(0.1)
                c.prefill.signal(signal.SIGCONT)
            for i in second:
                outs[i] = await later[i]
            return [outs[i] for i in range(48)]

    try:
        outs = run(go())
    finally:
        if sig == signal.SIGSTOP:
            c.prefill.signal(signal.SIGCONT)  # again, should the run have failed early
        else:
            c.prefill.restart()
    fail_row = Row(f"{name}, policy fail")
    fail_row.add(outs[:24], want[:24])
    rec_row = Row(f"{name}, policy recompute")
    rec_row.add(outs[24:], want[24:])
    recomputed = (c.recompute.tokens_by_source() - r_before)["local_compute"]
    rec_row.note = f"{recomputed} prompt tokens recomputed"
    ROWS.extend([fail_row, rec_row])
    idle_after(c, fail_row)
    assert_outcomes(c, [outs[i] for i in first], [want[i] for i in first], set())
    assert_outcomes(c, outs[:24], want[:24], {"http 500 InternalServerError"})
    assert_outcomes(c, outs[24:], want[24:], set())
    assert fail_row.errors, f"the {name} failed no load of the fail decode"
    assert recomputed > 0, f"the {name} made the recompute decode recompute nothing"
    late = [o for o in outs if o.kind != "ok" and o.seconds > DEADLINE_S + QUEUE_S]
    assert not late, late
    rec_row.decode_idle = fail_row.decode_idle
    settle(c, fail_row)


def test_prefill_sigstop_mid_run_then_sigcont(cluster: Cluster) -> None:
    _decode_steps_with_prefill_fault(cluster, signal.SIGSTOP, "prefill SIGSTOP, SIGCONT after")


def test_prefill_sigkill_mid_run(cluster: Cluster) -> None:
    _decode_steps_with_prefill_fault(cluster, signal.SIGKILL, "prefill SIGKILL")


def test_decode_sigkill_mid_run_returns_prefill_blocks(cluster: Cluster) -> None:
    """32 prompts prefilled, 16 asked of the decode, SIGKILL after 2 ended, then 16 more asked."""
    c = cluster
    prompts = prompts_of(32, seed=2)
    tokens = spread_tokens(32)
    # Two one-token requests end first; the 14 others asked run as long as
    # --max-model-len allows, so the kill right after those two always finds
    # requests in flight (with 8..35 tokens all 16 once ended before it).
    tokens[:16] = [1, 1] + [128 - len(p) for p in prompts[2:16]]
    want = references(c, c.fail, prompts, tokens)
    fresh(c.prefill, c.fail)
    row = Row("decode SIGKILL mid-run (16 asked, 16 held, not asked)")

    async def go() -> tuple[list[Outcome], float, float]:
        async with aiohttp.ClientSession() as http:
            steps = await asyncio.gather(*(prefill_step(http, c.prefill, p) for p in prompts))
            assert all(o.kind == "ok" and kv for o, kv in steps), steps
            # The hold the prefill applied, as it tells the decode.
            hold = max(float(kv["kvguard_hold_s"]) for _, kv in steps if kv)
            tasks = [
                asyncio.create_task(decode_step(http, c.fail, p, m, kv))
                for p, m, (_, kv) in zip(prompts[:16], tokens[:16], steps[:16], strict=True)
            ]
            await first_done(tasks, 2)
            c.fail.signal(signal.SIGKILL)
            t_kill = time.monotonic()
            outs = list(await asyncio.gather(*tasks))
            await asyncio.to_thread(c.fail.wait_gone, SETTLE_S)
            # New connections: a pooled one to the dead server resets on
            # write, which says nothing about a server that is gone.
            async with aiohttp.ClientSession() as later:
                outs += await asyncio.gather(
                    *(
                        decode_step(later, c.fail, p, m, kv)
                        for p, m, (_, kv) in zip(prompts[16:], tokens[16:], steps[16:], strict=True)
                    )
                )
            return outs, t_kill, hold

    try:
        outs, t_kill, hold_s = run(go())
        c.prefill.wait_idle(SETTLE_S)
        back_s = time.monotonic() - t_kill
    finally:
        c.fail.restart()
    row.add(outs, want)
    row.note = f"prefill KV usage 0 within {back_s:.1f}s of the kill"
    ROWS.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs[:16], want[:16], {"disconnected"})
    assert_outcomes(c, outs[16:], want[16:], {"refused"})
    assert row.errors["disconnected"] > 0, "the kill ended no request in flight"
    assert row.errors["refused"] == 16, row
    # The 16 never asked are held at most the prefill's hold, from the end of their prefill.
    assert back_s <= hold_s + 2, row.note
    settle(c, row)


@pytest.mark.parametrize("n", [2, 4])
def test_n_choices_each_equal_non_pd(cluster: Cluster, n: int) -> None:
    c = cluster
    prompts = prompts_of(4, seed=70 + n)
    want = references(c, c.fail, prompts, [MAX_TOKENS] * 4, n=n)
    fresh(c.prefill, c.fail)
    row = Row(f"n = {n}, 4 requests via kvguard proxy")
    outs = ask_all(c.prefill, c.fail, prompts, MAX_TOKENS, **sampling(n))
    row.add(outs, want)
    ROWS.append(row)
    idle_after(c, row)
    assert all(len(o.choices) in (0, n) for o in outs), outs
    assert_outcomes(c, outs, want, set())
    settle(c, row)


def test_more_requests_than_the_decode_holds_queue_past_the_hold(cluster: Cluster) -> None:
    """48 requests to a decode with KV room for about two: most queue past the hold.

    A prefill and a decode of the scenario's own: the prefill's short
    ``kvguard_hold_s``, and a decode KV cache of 8 blocks. vLLM starts a
    load once it can allocate the request's blocks (a load does not take a
    run slot), so here the later requests wait for blocks, for several
    holds (about 24 waves of two), while the path to the decode (proxy,
    API servers) stays well inside one, however slow the machine. Without
    renewals their holds expire (``unknown_request``); with them the prefill
    logs each ``hold_renewed`` and every request loads.
    """
    c = cluster
    hold_s = 4.0
    kv_blocks = 8
    prompts = prompts_of(48, seed=8)
    tokens = [128 - len(p) for p in prompts]  # as long as --max-model-len allows
    prefill = Server(
        "prefill-short-hold",
        kv_config(
            "kv_producer",
            kvguard_control_port=free_port(),
            kvguard_deadline_s=DEADLINE_S,
            kvguard_hold_s=hold_s,
        ),
    )
    decode = Server(
        "decode-8-blocks",
        kv_config("kv_consumer", "fail", kvguard_deadline_s=DEADLINE_S),
        args=["--num-gpu-blocks-override", str(kv_blocks)],  # CPU blocks too
    )
    row = Row(
        f"{len(prompts)} requests via kvguard proxy, decode KV {kv_blocks} blocks, hold {hold_s}s"
    )
    log_from = prefill.log.stat().st_size if prefill.log.exists() else 0
    try:
        start_all([prefill, decode])
        want = references(c, decode, prompts, tokens)
        fresh(decode)
        outs = ask_all(prefill, decode, prompts, tokens, timeout_s=240)
        row.add(outs, want)
        ROWS.append(row)
        seen = []
        for s in (prefill, decode):
            try:
                seen.append(f"{s.name} {s.wait_idle(SETTLE_S):.1f}s")
            except AssertionError:
                seen.append(f"{s.name} NOT IDLE {s.load()}")
        row.decode_idle = ", ".join(seen)
        with prefill.log.open("rb") as f:
            f.seek(log_from)
            renewed = f.read().decode(errors="replace").count("hold_renewed")
        row.note = f"{renewed} holds renewed"
        logs = "\n".join(f"--- {s.name} log\n{s.log_tail(25)}" for s in (prefill, decode))
        # The scenario's premise: requests queued past the hold, which renewals kept.
        assert renewed > 0 and row.max_s > hold_s, f"{row}\n{logs}"
        assert_outcomes(c, outs, want, set())
        assert "NOT IDLE" not in row.decode_idle, f"{row}\n{logs}"
    finally:
        prefill.stop()
        decode.stop()
