"""The connector in the deployment users run: OpenAI servers, PD steps over HTTP.

The session's cluster (tests/vllm/cluster.py: one prefill, two decodes, one
per ``kv_load_failure_policy``) serves the clean scenarios here: the docs'
commands as written, concurrent requests through ``kvguard proxy``, prefix
caching on both sides, n > 1, and more requests than the decode holds.
Faults (kills, freezes, disconnects) are tests/vllm/test_vllm_faults.py's.
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
from typing import Any

import pytest

from tests.vllm.client import (
    Outcome,
    ask,
    ask_all,
    ask_streamed,
    http_session,
    pd,
    prompts_of,
    run,
)
from tests.vllm.cluster import (
    DEADLINE_S,
    MAX_TOKENS,
    SETTLE_S,
    Cluster,
    assert_outcomes,
    fresh,
    idle_after,
    references,
    sampling,
    settle,
)
from tests.vllm.docs import checked_block, local
from tests.vllm.ports import free_port
from tests.vllm.report import Row
from tests.vllm.servers import BIN, LOGS, ROOT, Proxy, Server, kv_config, start_all, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

_rng = random.Random(17)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(_rng.randrange(33, 100))] for _ in range(32)]


# ==== docs/vllm.md's commands ==================================================

DOCS_MARK = "<!-- checked by tests/vllm/test_vllm_server.py -->"


def docs_commands() -> tuple[str, str]:
    """The checked block of docs/vllm.md: (the servers and proxy, the curl through it)."""
    block = checked_block(DOCS_MARK)
    start, sep, curl = block.partition("# once /health")
    assert sep, "the checked block has no '# once /health' line between the servers and the curl"
    return start, curl.partition("\n")[2]


def test_docs_commands_serve_a_pd_request_through_the_proxy() -> None:
    start, curl = docs_commands()
    ports = {p: free_port() for p in ("8100", "8200", "8000", "17600")}

    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    log = LOGS / "docs-commands.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", local(start, ports) + "\nwait"],
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
            ["bash", "-c", local(curl, ports)], cwd=ROOT, env=env, capture_output=True, timeout=120
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
        async with http_session() as http:
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
            async with http_session() as http:
                many = await asyncio.gather(
                    *(ask(http, proxy.url, p, MAX_TOKENS) for p in prompts[:32])
                )
                toy = await pd(http, c.prefill, c.fail, prompts[32], MAX_TOKENS)
                return [*many, toy]

        outs = run(go())
    finally:
        proxy.stop()
    row.add(outs, want)
    c.rows.append(row)
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
            async with http_session() as http:
                one = await asyncio.gather(*(ask(http, proxy.url, p, MAX_TOKENS) for p in firsts))
                two = await asyncio.gather(*(ask(http, proxy.url, p, MAX_TOKENS) for p in rest))
                return [*one, *two]

        outs = run(go())
    finally:
        proxy.stop()
    row.add(outs, want)
    c.rows.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs, want, set())
    hit = 64 * len(rest)  # the second wave finds its prefix's two blocks on both sides
    p_moved = c.prefill.tokens_by_source() - p_before
    d_moved = c.fail.tokens_by_source() - d_before
    total = sum(len(p) for p in firsts + rest)
    assert p_moved == {"local_cache_hit": hit, "local_compute": total - hit}, p_moved
    assert d_moved == {"local_cache_hit": hit, "external_kv_transfer": total - hit}, d_moved
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
    c.rows.append(row)
    idle_after(c, row)
    assert all(len(o.choices) in (0, n) for o in outs), outs
    assert_outcomes(c, outs, want, set())
    settle(c, row)


def test_streamed_completions_start_with_the_prefills_token(cluster: Cluster) -> None:
    """The early first token: the client's first event is the prefill's token
    and the decode continues from it, on the prompt's KV and one token of its own.

    Prompt lengths on both sides of the 32-token block: at 32, 64 and 96 the
    decode's prompt (the prompt and the token) needs one block more than the
    prefill held, which it computes; with a stop token the prefill's first
    token ends the request and the decode computes the prompt itself.
    """
    c = cluster
    rng = random.Random(23)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (32, 33, 63, 64, 65, 96)]
    want = references(c, c.fail, prompts, [MAX_TOKENS] * len(prompts))
    fresh(c.prefill, c.fail)
    before = c.fail.tokens_by_source()
    row = Row("streamed: the prefill's first token, 6 prompts of 32-96 tokens")
    proxy = Proxy([c.prefill.url], [c.fail.url]).start()
    usage = {"stream_options": {"include_usage": True}}
    try:

        async def go() -> list[tuple[Outcome, list[dict[str, Any]]]]:
            async with http_session() as http:
                return list(
                    await asyncio.gather(
                        *(ask_streamed(http, proxy.url, p, MAX_TOKENS, **usage) for p in prompts)
                    )
                )

        streamed = run(go())
        moved = c.fail.tokens_by_source() - before
        fresh(c.prefill, c.fail)

        async def stopped() -> Outcome:
            async with http_session() as http:
                first = want[0][0]
                return await ask(http, proxy.url, prompts[0], MAX_TOKENS, stop_token_ids=[first])

        stop = run(stopped())
        served = re.findall(r"proxy_request .* served=(\w+)", proxy.log.read_text())
    finally:
        proxy.stop()
    outs = [out for out, _ in streamed]
    row.add(outs, want)
    c.rows.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs, want, set())
    for prompt, reference, (_, events) in zip(prompts, want, streamed, strict=True):
        first, *_, last = events
        assert first["choices"][0]["prompt_token_ids"] == prompt, events
        assert first["choices"][0]["token_ids"] == [reference[0]], events
        assert len({e["id"] for e in events}) == 1, events
        total = len(prompt) + MAX_TOKENS
        assert last["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": MAX_TOKENS,
            "total_tokens": total,
        }, events
    # Each prompt's KV came over the transfer; each decode computed one token.
    assert moved == {
        "external_kv_transfer": sum(map(len, prompts)),
        "local_compute": len(prompts),
    }, moved
    assert (stop.kind, stop.tokens) == ("ok", [want[0][0]]), stop
    assert served == ["early_first_token"] * len(prompts) + ["decode_only"], served
    settle(c, row)


def test_more_requests_than_the_decode_holds_queue_past_the_hold(cluster: Cluster) -> None:
    """48 requests to a decode with KV room for about two: most queue past the hold.

    A prefill and a decode of the scenario's own: the prefill's short
    ``kvguard_hold_s``, and a decode KV cache of 8 blocks. vLLM starts a
    load once it can allocate the request's blocks (a load does not take a
    run slot), so here the later requests wait for blocks, for several
    holds (about 24 waves of two). A request that waits renews its hold as
    it reaches the decode's engine, then every third of the hold: only the
    path there (proxy, API servers) must stay inside one. That path took
    0.3-0.4 s in a quiet run (the first renewals' ``left_s``), 2.4 s with
    two busy loops beside, and over 2.7 s in a CI run: the hold is 6 s, and
    the requests still queue for about twice that. Without renewals their
    holds expire (``unknown_request``); with them the prefill logs each
    ``hold_renewed`` and every request loads.
    """
    c = cluster
    hold_s = 6.0
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
        c.rows.append(row)
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
        assert_outcomes(c, outs, want, set(), servers=[prefill, decode])
        assert "NOT IDLE" not in row.decode_idle, f"{row}\n{logs}"
    finally:
        prefill.stop()
        decode.stop()
