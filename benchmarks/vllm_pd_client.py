"""The vLLM PD benchmark's client: random prompts, sent in closed loops, one way per connector.

A request goes straight to one server (aggregated), through ``kvguard
proxy`` (kvguard, NIXL: the prefill returns the decode's parameters), or
both legs from the client (Mooncake: the router makes up a ``transfer_id``
and names the prefill's engine, which ``kvguard proxy`` does not do). Each
is streamed; the client notes when it was sent, its first token and end.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

from .vllm_pd_servers import MODEL_DIR

__all__ = ["MAX_TOKENS", "PROMPT_TOKENS", "Client", "Sent", "drive", "prompts"]

MAX_TOKENS: Final = 8  # decode tokens per request
PROMPT_TOKENS: Final = (1024, 2048)
VOCAB: Final = 1024  # the benchmark checkpoint's (tests.vllm.checkpoint.BENCH)


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` distinct prompts of 1K-2K random tokens (no prefix is shared)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]


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
