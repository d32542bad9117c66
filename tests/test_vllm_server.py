"""The connector in the deployment users run: two vLLM OpenAI servers, PD steps over HTTP.

Both engines are ``python -m vllm.entrypoints.openai.api_server`` with
vLLM's default multiprocessing (APIServer, EngineCore, Worker in three
processes), started once per module (``tests/vllm_server.py``); the client
runs the PD proxy's two steps and compares token ids with a non-PD request
of the same prompt on the same decode server.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator

import pytest

if os.environ.get("KVGUARD_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  -- CI: a missing vLLM must fail, not skip
else:
    pytest.importorskip("vllm", reason="vLLM tests run in .venv-vllm (scripts/vllm-env.sh)")

import aiohttp
from vllm_server import Server, complete, free_port, kv_config, pd

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

DEADLINE_S = 10.0
MAX_TOKENS = 8
_rng = random.Random(17)
PROMPTS = [[_rng.randrange(1, 256) for _ in range(_rng.randrange(33, 100))] for _ in range(32)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    prefill = Server(
        "prefill",
        kv_config("kv_producer", kvguard_control_port=free_port(), kvguard_deadline_s=DEADLINE_S),
    )
    decode = Server("decode", kv_config("kv_consumer", "fail", kvguard_deadline_s=DEADLINE_S))
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_one_request_through_pd_equals_non_pd(servers: tuple[Server, Server]) -> None:
    prefill, decode = servers

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            want, _ = await complete(http, decode, PROMPTS[0], MAX_TOKENS)
            assert want.status == 200 and want.tokens is not None, want
            got = await pd(http, prefill, decode, PROMPTS[0], MAX_TOKENS)
            assert got.status == 200, f"{got}\n--- decode log\n{decode.log_tail()}"
            assert got.tokens == want.tokens, got
            assert got.seconds < DEADLINE_S, got

    asyncio.run(run())
