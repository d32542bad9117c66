"""Hostile ``kv_transfer_params`` sent straight to the servers, as users run them.

A client that skips the proxy can put anything in ``kv_transfer_params``.
Neither server may crash, hold anything past the request, or make the
request wait out its deadline for a value it can tell is bad: each request
below is answered, either computed locally (a key that does not ask for a
load) or failed at once, counted under its reason in the decode's own
figures; and a prefill asked with a junk deadline uses its own,
and the PD request through it still equals non-PD. Afterwards every server is
idle and serves (``settle``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from kvguard.vllm.params import DEADLINE_S as DEADLINE_KEY
from kvguard.vllm.params import (
    DO_REMOTE_PREFILL,
    ENDPOINT,
    LOADS,
    REQUEST_ID,
    TP_SIZE,
)
from tests.vllm.client import (
    Outcome,
    complete,
    http_session,
    pd,
    prefill_step,
    prompts_of,
    run,
)
from tests.vllm.cluster import (
    DEADLINE_S,
    FAILED,
    MAX_TOKENS,
    Cluster,
    ended_as,
    fresh,
    references,
    settle,
    transfers,
)
from tests.vllm.report import Row

pytestmark = [pytest.mark.vllm]

# How soon a request with a bad value it can tell must be answered: far
# below the deadline it would otherwise wait out (a hang guard on a loaded host).
AT_ONCE_S = DEADLINE_S / 2

REFUSED = "tcp://127.0.0.1:1"  # nothing listens: refused at once
ASK = {DO_REMOTE_PREFILL: True, ENDPOINT: REFUSED, REQUEST_ID: "x"}
# (case, kv_transfer_params, the outcome's kind, the failed load's reason or "")
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("endpoint not a string", {**ASK, ENDPOINT: 5}, "ok", ""),
    ("nested junk", {**ASK, ENDPOINT: {"a": [1]}, REQUEST_ID: [2]}, "ok", ""),
    ("ipc endpoint", {**ASK, ENDPOINT: "ipc:///tmp/x"}, FAILED, "bad_endpoint"),
    ("refused endpoint", ASK, FAILED, "peer_lost"),
    ("request id of 100 kB", {**ASK, REQUEST_ID: "x" * 100_000}, FAILED, "bad_request"),
    ("tensor parallel size junk", {**ASK, TP_SIZE: "2"}, FAILED, "incompatible"),
    ("loads and deadline junk", {**ASK, LOADS: -7, DEADLINE_KEY: "soon"}, FAILED, "peer_lost"),
]


def test_hostile_params_to_a_decode_are_answered_at_once(cluster: Cluster) -> None:
    c = cluster
    prompt = prompts_of(1, seed=321)[0]
    (want,) = references(c, c.fail, [prompt], [MAX_TOKENS])
    row = Row("hostile kv_transfer_params straight to the decode")
    before = transfers(c.fail)

    async def go() -> list[Outcome]:
        async with http_session() as http:
            outs = await asyncio.gather(
                *(complete(http, c.fail, prompt, MAX_TOKENS, kv) for _, kv, _, _ in CASES)
            )
            return [o for o, _ in outs]

    outs = run(go())
    row.add(outs, [want] * len(outs))
    c.rows.append(row)
    for (case, _, kind, _), out in zip(CASES, outs, strict=True):
        assert out.kind == kind, f"{case}: {out}\n{c.logs()}"
        if kind == "ok":  # computed locally: the model's own tokens
            assert out.tokens == list(want), f"{case}: {out}"
        assert out.seconds < AT_ONCE_S, f"{case}: {out}"
    # Each failed load counted once under its reason (the decode's own figures).
    ended_as(c.fail, before, dict(Counter(("failed", r) for _, _, _, r in CASES if r)))
    settle(c, row)


@pytest.mark.parametrize("junk", ["soon", -1, 1e308, None, [5]])
def test_a_junk_deadline_to_a_prefill_gets_its_own_and_pd_still_equals_non_pd(
    cluster: Cluster, junk: object
) -> None:
    c = cluster
    prompt = prompts_of(1, seed=322)[0]
    (want,) = references(c, c.fail, [prompt], [MAX_TOKENS])
    fresh(c.prefill, c.fail)

    async def go() -> Outcome:
        async with http_session() as http:
            return await pd(http, c.prefill, c.fail, prompt, MAX_TOKENS, kv={DEADLINE_KEY: junk})

    got = run(go())
    assert got.kind == "ok" and got.tokens == list(want), f"{got}\n{c.logs()}"
    for s in c.servers:
        s.wait_idle(DEADLINE_S)


def test_kv_of_another_prompt_is_not_loaded_and_the_prefill_lets_go(cluster: Cluster) -> None:
    """A prefill's ``kv_transfer_params`` sent with another prompt of the same
    length: the blocks would land in the right places, and no check of the
    bytes could tell they are another prompt's. The prompt's digest can: the
    decode computes its prompt itself, equal to non-PD, and tells the prefill
    to let go at once (its hold would last ``kvguard_hold_s``, 30 s)."""
    c = cluster
    a = prompts_of(1, seed=324)[0]
    b = [*a[:-1], a[-1] % 255 + 1]  # the last token another
    (want,) = references(c, c.fail, [b], [MAX_TOKENS])
    fresh(c.prefill, c.fail)
    before = c.fail.tokens_by_source()
    log_from = c.fail.log.stat().st_size

    async def go() -> Outcome:
        async with http_session() as http:
            first, params = await prefill_step(http, c.prefill, a)
            assert first.kind == "ok" and params is not None, first
            out, _ = await complete(http, c.fail, b, MAX_TOKENS, params)
            return out

    got = run(go())
    assert got.kind == "ok" and got.tokens == list(want), f"{got}\n{c.logs()}"
    assert c.fail.tokens_by_source() - before == {"local_compute": len(b)}
    with c.fail.log.open("rb") as f:
        f.seek(log_from)
        assert f.read().count(b"kv_prompt_mismatch") == 1
    c.prefill.wait_idle(AT_ONCE_S)
