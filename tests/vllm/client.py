"""An HTTP client of the vLLM OpenAI servers, as users' clients and PD proxies are.

The client runs the PD proxy's two steps itself where a test must act
between them (``prefill_step``/``pd``, the body vLLM's toy proxy sends),
asks for token ids (``return_token_ids``) and compares them with a non-PD
request of the same prompt (temperature 0, ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from kvguard.proxy.legs import IDLE_CONNECTION_S
from kvguard.vllm.params import PREFILL_KV_TRANSFER_PARAMS
from tests.vllm.servers import MODEL, Proxy, Server

__all__ = [
    "Outcome",
    "ask",
    "ask_all",
    "ask_streamed",
    "complete",
    "completion_body",
    "pd",
    "post",
    "prefill_step",
    "prompts_of",
    "run",
]

T = TypeVar("T")


def prompts_of(n: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of 33..64 tokens (more than one 32-token block)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(33, 65))] for _ in range(n)]


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` to its end in a new event loop."""

    async def main() -> T:
        return await coro

    return asyncio.run(main())


def http_session() -> aiohttp.ClientSession:
    """The tests' HTTP client: like kvguard's proxy, it lets go of a kept-alive
    connection well before vLLM's server does (uvicorn, 5 s idle). aiohttp
    keeps one for 15 s by default and reuses the longest-idle first; a
    request sent just as the server closes it fails ``disconnected``, which
    a test would read as the system's failure (the proxy met it at 15 s: 1
    of 64 requests in a bench run)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
    )


@dataclass(frozen=True)
class Outcome:
    """How one client request ended.

    ``kind`` is ``ok``, ``http <status> <error type>``, ``refused`` (no
    connection), ``disconnected`` (closed before the reply) or ``timeout``
    (the client's own deadline: a request that hung).
    """

    status: int  # 0: no HTTP reply
    kind: str
    choices: tuple[tuple[int, ...], ...]  # each choice's token ids, by index
    error: str
    seconds: float
    id: str = ""  # the answer's own (a router writes its route into it)

    @property
    def tokens(self) -> list[int] | None:
        return list(self.choices[0]) if self.choices else None


def _error_type(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("type", "?"))
    return "?"


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    timeout_s: float = 60.0,
) -> tuple[Outcome, dict[str, Any] | None]:
    """One POST /v1/completions to ``url``; its outcome and the returned kv_transfer_params."""
    t0 = time.monotonic()

    def failed(kind: str, exc: BaseException) -> tuple[Outcome, None]:
        return Outcome(0, kind, (), f"{type(exc).__name__}: {exc}", time.monotonic() - t0), None

    try:
        async with http.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            text = await r.text()
    except aiohttp.ClientConnectorError as exc:
        return failed("refused", exc)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        return failed("disconnected", exc)
    except aiohttp.ClientOSError as exc:
        return failed("disconnected", exc)
    except asyncio.TimeoutError as exc:
        return failed("timeout", exc)
    took = time.monotonic() - t0
    try:
        data = json.loads(text)
    except ValueError:  # a proxy's own plain-text error
        return Outcome(r.status, f"http {r.status} (not JSON)", (), text[:300], took), None
    if r.status != 200:
        kind = f"http {r.status} {_error_type(data)}"
        return Outcome(r.status, kind, (), json.dumps(data)[:300], took), None
    ordered = sorted(data["choices"], key=lambda c: int(c["index"]))
    choices = tuple(tuple(int(t) for t in c["token_ids"]) for c in ordered)
    out = Outcome(200, "ok", choices, "", took, str(data.get("id", "")))
    return out, data.get("kv_transfer_params")


def completion_body(prompt: Sequence[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(MODEL),
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


async def complete(
    http: aiohttp.ClientSession,
    server: Server | str,
    prompt: Sequence[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    **extra: Any,
) -> tuple[Outcome, dict[str, Any] | None]:
    """One /v1/completions call; its outcome and the returned kv_transfer_params."""
    body = completion_body(prompt, max_tokens, **extra)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    url = server.url if isinstance(server, Server) else server
    return await post(http, url, body, timeout_s)


async def ask(
    http: aiohttp.ClientSession,
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    timeout_s: float = 60.0,
    **extra: Any,
) -> Outcome:
    """One completion through a proxy (or a server used without PD); its outcome."""
    out, _ = await post(http, url, completion_body(prompt, max_tokens, **extra), timeout_s)
    return out


async def ask_streamed(
    http: aiohttp.ClientSession,
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    timeout_s: float = 60.0,
    **extra: Any,
) -> tuple[Outcome, list[dict[str, Any]]]:
    """One streamed completion (``stream: true``): its outcome, tokens put
    together from the events, and the events themselves, decoded."""
    body = completion_body(prompt, max_tokens, stream=True, **extra)
    t0 = time.monotonic()
    events: list[dict[str, Any]] = []
    async with http.post(
        url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as r:
        if r.status != 200:
            text = await r.text()
            return Outcome(r.status, f"http {r.status}", (), text[:300], 0.0), events
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[len(b"data: ") :]))
    took = time.monotonic() - t0
    if errors := [e for e in events if "error" in e]:
        return Outcome(200, "stream error", (), json.dumps(errors)[:300], took), events
    tokens = tuple(int(t) for e in events for c in e["choices"] for t in c.get("token_ids") or ())
    return Outcome(200, "ok", (tokens,), "", took, str(events[0].get("id", ""))), events


def ask_all(
    prefill: Server,
    decode: Server,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int],
    timeout_s: float = 60.0,
    proxy_args: Sequence[str] = (),
    **extra: Any,
) -> list[Outcome]:
    """``prompts`` at once through a ``kvguard proxy`` started for ``prefill``
    and ``decode`` (stopped after, ``proxy_args`` added to its command);
    each outcome, in order. ``max_tokens``: one for all, or one per prompt."""
    tokens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    proxy = Proxy([prefill.url], [decode.url], args=proxy_args).start()

    async def go() -> list[Outcome]:
        async with http_session() as http:
            return list(
                await asyncio.gather(
                    *(
                        ask(http, proxy.url, p, m, timeout_s, **extra)
                        for p, m in zip(prompts, tokens, strict=True)
                    )
                )
            )

    try:
        return asyncio.run(go())
    finally:
        proxy.stop()


async def prefill_step(
    http: aiohttp.ClientSession, prefill: Server, prompt: Sequence[int], **kv: Any
) -> tuple[Outcome, dict[str, Any] | None]:
    """The toy proxy's prefill leg: max_tokens 1, its kv_transfer_params (plus ``kv``)."""
    return await complete(http, prefill, prompt, 1, {**PREFILL_KV_TRANSFER_PARAMS, **kv})


async def pd(
    http: aiohttp.ClientSession,
    prefill: Server,
    decode: Server,
    prompt: Sequence[int],
    max_tokens: int,
    timeout_s: float = 60.0,
    kv: dict[str, Any] | None = None,
    **extra: Any,
) -> Outcome:
    """The PD proxy's two steps for one prompt; the decode's outcome (``kv`` goes
    into the prefill's kv_transfer_params, ``extra`` on the decode)."""
    first, params = await prefill_step(http, prefill, prompt, **(kv or {}))
    if first.status != 200 or params is None:
        return first
    out, _ = await complete(http, decode, prompt, max_tokens, params, timeout_s, **extra)
    return Outcome(out.status, out.kind, out.choices, out.error, first.seconds + out.seconds)
