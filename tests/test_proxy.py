"""kvguard's PD proxy over real HTTP on 127.0.0.1.

The backends are small aiohttp servers speaking vLLM's OpenAI protocol for
the fields the proxy touches; they record every request they got and every
byte they answered, so the tests assert the exact bodies of both legs and
that each client got exactly what its decode answered for it. The proxy runs
in-process (``kvguard.proxy.serve``) for the fine-grained cases and as the
``kvguard proxy`` command for the concurrent one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    MutableMapping,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import structlog
from aiohttp import web
from multidict import CIMultiDict

from kvguard.proxy import Failure, ProxyConfig, ProxyError, serve
from kvguard.proxy.backends import Pool
from kvguard.proxy.legs import IDLE_CONNECTION_S
from kvguard.proxy.protocol import (
    CHAT_COMPLETIONS,
    CLIENT_TIMEOUT_HEADER,
    COMPLETIONS,
    KV_LOADS,
    PREFILL_KV_TRANSFER_PARAMS,
    decode_request,
    prefill_request,
)

T = TypeVar("T")
KVGUARD = Path(sys.executable).parent / "kvguard"
# Bounds a wait for something that must happen; never a speed assertion.
SETTLE_S = 20.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# ==== backends =================================================================


@dataclass
class Received:
    method: str
    path: str
    body: Any
    headers: CIMultiDict[str]


Handler = Callable[["Backend", web.Request, Any], Awaitable[web.StreamResponse]]


@dataclass
class Backend:
    """One upstream server: ``handler`` answers, everything is recorded."""

    name: str
    handler: Handler
    url: str = ""
    received: list[Received] = field(default_factory=list)
    # X-Request-Id -> the exact bytes this backend sent for it
    answered: dict[str, bytes] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    # The proxy's background /health probes: answered here, never recorded
    # (a test sees only the legs), counted; a test sets the status.
    health: int = 200
    probes: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/health":
            self.probes += 1
            return web.Response(status=self.health)
        data = await request.read()
        body = json.loads(data) if data else None
        self.received.append(Received(request.method, request.path, body, request.headers.copy()))
        self.arrived.set()
        try:
            return await self.handler(self, request, body)
        except asyncio.CancelledError:  # the proxy closed the connection
            self.cancelled.set()
            raise

    def posts(self) -> list[Received]:
        return [r for r in self.received if r.method == "POST"]


@contextlib.asynccontextmanager
async def backends(*specs: tuple[str, Handler]) -> AsyncIterator[list[Backend]]:
    runners: list[web.AppRunner] = []
    out: list[Backend] = []
    try:
        for name, handler in specs:
            backend = Backend(name, handler)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", backend.handle)
            runner = web.AppRunner(
                app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
            )
            runners.append(runner)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            backend.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            out.append(backend)
        yield out
    finally:
        for runner in runners:
            await runner.cleanup()


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body["prompt"])


async def vllm(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    """A vLLM server with a PD connector, as far as the proxy can tell."""
    if request.path == "/health":
        return web.Response()
    rid = request.headers["X-Request-Id"]
    if request.path == "/v1/models":
        data = json.dumps({"object": "list", "data": [{"id": backend.name}]}).encode()
        backend.answered[rid] = data
        return web.Response(body=data, content_type="application/json")
    params = body.get("kv_transfer_params") or {}
    if params.get("do_remote_decode"):  # prefill: compute, hold, say where
        reply = {
            "id": f"cmpl-{rid}",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "kvguard_endpoint": f"tcp://{backend.name}",
                "kvguard_request_id": f"{backend.name}/{_prompt(body)}",
                "kvguard_deadline_s": params.get("kvguard_deadline_s", 10),
            },
        }
        data = json.dumps(reply).encode()
        backend.answered[rid] = data
        return web.Response(body=data, content_type="application/json")
    # decode: an answer that names everything it was given
    text = f"{backend.name}|{_prompt(body)}|{params.get('kvguard_request_id')}"
    if not body.get("stream"):
        data = json.dumps({"id": f"cmpl-{rid}", "choices": [{"index": 0, "text": text}]}).encode()
        backend.answered[rid] = data
        return web.Response(body=data, content_type="application/json")
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await out.prepare(request)
    sent = b""
    for piece in [*text.split("|"), None]:
        if piece is None:
            event = b"data: [DONE]\n\n"
        else:
            event = b"data: " + json.dumps({"choices": [{"text": piece}]}).encode() + b"\n\n"
        # Each event in two writes: the proxy must reassemble whole events.
        for part in (event[:7], event[7:]):
            await out.write(part)
            await asyncio.sleep(0)
        sent += event
    backend.answered[rid] = sent
    await out.write_eof()
    return out


async def hang(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def http_error(status: int, data: bytes, content_type: str = "application/json") -> Handler:
    async def handler(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        return web.Response(status=status, body=data, content_type=content_type)

    return handler


async def no_kv_params(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": None})


async def dies_mid_stream(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: {"n": ')  # a third, cut
    await asyncio.sleep(0.05)  # let the chunks reach the proxy before the close
    assert request.transport is not None
    request.transport.close()
    return out


async def stalls_mid_stream(
    backend: Backend, request: web.Request, body: Any
) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"n": 1}\n\n')
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def dies_mid_json(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "application/json"})
    out.content_length = 100
    await out.prepare(request)
    await out.write(b'{"choices": [')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()
    return out


# ==== the proxy and its clients =================================================


@contextlib.asynccontextmanager
async def proxy(
    prefills: list[Backend], decodes: list[Backend], **options: Any
) -> AsyncIterator[str]:
    config = ProxyConfig([b.url for b in prefills], [b.url for b in decodes], **options)
    async with serve(config) as url:
        yield url


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    data: bytes

    def json(self) -> Any:
        return json.loads(self.data)


async def post(url: str, path: str, body: Any, **kwargs: Any) -> Reply:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, **kwargs) as r:
        return Reply(r.status, r.headers.copy(), await r.read())


async def get(url: str, path: str) -> Reply:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return Reply(r.status, r.headers.copy(), await r.read())


def error(status: int, type_: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def logs(all_levels: None) -> Iterator[list[MutableMapping[str, Any]]]:
    with structlog.testing.capture_logs() as captured:
        yield captured


def requests_logged(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "proxy_request"]


# ==== vLLM's toy proxy protocol, as data ========================================

VLLM_TOY_PROXY: dict[str, Any] = {
    "prefill_set": {
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    },
    "prefill_set_if_present": {"max_completion_tokens": 1},
    "prefill_removed": ["stream_options", "min_tokens", "min_completion_tokens"],
    "decode_replaced": ["kv_transfer_params"],
    "header_same_on_both_legs": "X-Request-Id",
}


def toy_prefill(body: dict[str, Any]) -> dict[str, Any]:
    toy = VLLM_TOY_PROXY
    out = {k: v for k, v in body.items() if k not in toy["prefill_removed"]}
    out.update(toy["prefill_set"])
    for k, v in toy["prefill_set_if_present"].items():
        if k in body:
            out[k] = v
    return out


TOY_CASES = [
    (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9}),
    (COMPLETIONS, {"model": "m", "prompt": "a", "max_tokens": 9, "min_tokens": 3, "n": 1}),
    (
        COMPLETIONS,
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}, "seed": 7},
    ),
    (
        CHAT_COMPLETIONS,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "min_completion_tokens": 2,
            "stream": True,
        },
    ),
    (COMPLETIONS, {"prompt": "a", "kv_transfer_params": {"do_remote_decode": False, "x": 1}}),
]


@pytest.mark.parametrize(("path", "body"), TOY_CASES)
def test_the_prefill_body_is_vllm_toy_proxys_field_by_field(
    path: str, body: dict[str, Any]
) -> None:
    ours = prefill_request(path, body)
    toy = toy_prefill(body)
    assert sorted(ours) == sorted(toy)
    for key in toy:
        assert ours[key] == toy[key], key
    assert dict(PREFILL_KV_TRANSFER_PARAMS) == VLLM_TOY_PROXY["prefill_set"]["kv_transfer_params"]
    # the decode leg: the client's body, kv_transfer_params replaced
    params = {"do_remote_prefill": True, "kvguard_request_id": "r"}
    assert decode_request(body, params) == {**body, "kv_transfer_params": params}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT_COMPLETIONS])
def test_n_choices_prefill_once_and_tell_the_decode_how_many_load(path: str) -> None:
    body = {"prompt": "a", "max_tokens": 9, "n": 3, "temperature": 1.0}
    assert prefill_request(path, body)["n"] == 1
    got = decode_request(body, {"do_remote_prefill": True, "kvguard_request_id": "r"})
    assert got == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "kvguard_request_id": "r",
            KV_LOADS: 3,
        },
    }
    assert KV_LOADS == "kvguard_loads"


@pytest.mark.parametrize("n", [None, 1, 0, -2, "3", 2.0, True])
def test_an_n_of_one_or_not_an_int_is_passed_on_unchanged(n: object) -> None:
    """The decode server rejects a bad n, naming it; the proxy adds nothing."""
    body: dict[str, Any] = {"prompt": "a"} if n is None else {"prompt": "a", "n": n}
    prefill = prefill_request(COMPLETIONS, body)
    assert ("n" in prefill, prefill.get("n")) == ("n" in body, body.get("n"))
    assert decode_request(body, {"x": 1}) == {**body, "kv_transfer_params": {"x": 1}}


def test_the_two_additions_to_the_toy_protocol() -> None:
    # Chat reads max_completion_tokens first: it is set even if absent.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert prefill_request(CHAT_COMPLETIONS, chat) == {
        **toy_prefill(chat),
        "max_completion_tokens": 1,
    }
    # The client's kvguard_* keys reach the prefill; nothing else of its params does.
    body = {"prompt": "a", "kv_transfer_params": {"kvguard_deadline_s": 4, "do_remote_decode": 0}}
    assert prefill_request(COMPLETIONS, body)["kv_transfer_params"] == {
        **PREFILL_KV_TRANSFER_PARAMS,
        "kvguard_deadline_s": 4,
    }
    assert body["kv_transfer_params"] == {"kvguard_deadline_s": 4, "do_remote_decode": 0}


# ==== the two legs ===============================================================


def test_completion_legs_carry_exactly_the_protocols_bodies(
    logs: list[MutableMapping[str, Any]],
) -> None:
    client = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 7,
        "min_tokens": 2,
        "kv_transfer_params": {"kvguard_deadline_s": 4, "remote_host": "evil"},
    }

    async def scenario() -> None:
        async with backends(("P", vllm), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, client, headers={"Authorization": "Bearer k"})
            assert reply.status == 200
            rid = reply.headers["X-Request-Id"]
            assert re.fullmatch(r"[0-9a-f]{32}", rid)
            [pre] = p.posts()
            assert pre.path == COMPLETIONS
            assert pre.body == {
                "model": "tiny",
                "prompt": "hello",
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {**PREFILL_KV_TRANSFER_PARAMS, "kvguard_deadline_s": 4},
            }
            [dec] = d.posts()
            assert dec.path == COMPLETIONS
            prefill_params = json.loads(p.answered[rid])["kv_transfer_params"]
            assert prefill_params["kvguard_deadline_s"] == 4
            assert dec.body == {**client, "kv_transfer_params": prefill_params}
            for leg in (pre, dec):
                assert leg.headers["X-Request-Id"] == rid
                assert leg.headers["Authorization"] == "Bearer k"
            assert reply.data == d.answered[rid]
            assert reply.headers["Content-Type"] == "application/json"
            assert reply.json()["choices"][0]["text"] == "D|hello|P/hello"

    run(scenario())
    [event] = requests_logged(logs)
    times = {k: event.pop(k) for k in ("total_s", "prefill_s", "decode_s")}
    assert all(isinstance(t, float) and t >= 0 for t in times.values())
    assert event.pop("request_id")
    assert event.pop("prefill").startswith("http://127.0.0.1:")
    assert event.pop("decode").startswith("http://127.0.0.1:")
    assert event == {
        "event": "proxy_request",
        "log_level": "info",
        "endpoint": COMPLETIONS,
        "outcome": "ok",
        "status": 200,
        "served": "two_step",
        "prefill_status": 200,
        "decode_status": 200,
    }


def test_a_streamed_chat_is_relayed_event_for_event() -> None:
    client = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def scenario() -> None:
        async with backends(("P", vllm), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, CHAT_COMPLETIONS, client)
            assert reply.status == 200
            assert reply.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            rid = reply.headers["X-Request-Id"]
            [pre] = p.posts()
            assert pre.path == CHAT_COMPLETIONS
            assert pre.body == {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "max_completion_tokens": 1,
                "stream": False,
                "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
            }
            [dec] = d.posts()
            params = json.loads(p.answered[rid])["kv_transfer_params"]
            assert dec.body == {**client, "kv_transfer_params": params}
            assert reply.data == d.answered[rid]
            events = reply.data.decode().split("\n\n")
            assert events == [
                'data: {"choices": [{"text": "D"}]}',
                'data: {"choices": [{"text": "hi"}]}',
                'data: {"choices": [{"text": "P/hi"}]}',
                "data: [DONE]",
                "",
            ]

    run(scenario())


def test_round_robin_over_prefills_and_decodes() -> None:
    async def scenario() -> None:
        specs = [("P0", vllm), ("P1", vllm), ("P2", vllm), ("D0", vllm), ("D1", vllm)]
        async with backends(*specs) as (p0, p1, p2, d0, d1), proxy([p0, p1, p2], [d0, d1]) as url:
            texts = []
            for i in range(6):
                reply = await post(url, COMPLETIONS, {"prompt": f"q{i}", "max_tokens": 3})
                assert reply.status == 200
                texts.append(reply.json()["choices"][0]["text"])
            assert texts == [
                "D0|q0|P0/q0",
                "D1|q1|P1/q1",
                "D0|q2|P2/q2",
                "D1|q3|P0/q3",
                "D0|q4|P1/q4",
                "D1|q5|P2/q5",
            ]

    run(scenario())


# ==== each leg's failures =========================================================

Scenario = Callable[[], Coroutine[Any, Any, None]]


def test_prefill_unreachable_is_502_naming_it() -> None:
    async def scenario() -> None:
        url_p = f"http://127.0.0.1:{closed_port()}"
        async with backends(("D", vllm)) as [d]:
            config = ProxyConfig([url_p], [d.url])
            async with serve(config) as url:
                reply = await post(url, COMPLETIONS, {"prompt": "a"})
            assert reply.status == 502
            assert reply.json() == error(
                502,
                "UpstreamUnreachableError",
                f"prefill {url_p}: cannot connect (Connection refused)",
            )
            assert d.received == []

    run(scenario())


def test_decode_unreachable_is_502_naming_it() -> None:
    async def scenario() -> None:
        url_d = f"http://127.0.0.1:{closed_port()}"
        async with backends(("P", vllm)) as [p]:
            async with serve(ProxyConfig([p.url], [url_d])) as url:
                reply = await post(url, COMPLETIONS, {"prompt": "a"})
            assert reply.status == 502
            assert reply.json() == error(
                502,
                "UpstreamUnreachableError",
                f"decode {url_d}: cannot connect (Connection refused)",
            )
            assert len(p.posts()) == 1

    run(scenario())


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_a_hung_leg_is_504_at_its_deadline_and_its_request_closed(leg: str) -> None:
    async def scenario() -> None:
        specs = [
            ("P", hang if leg == "prefill" else vllm),
            ("D", hang if leg == "decode" else vllm),
        ]
        async with backends(*specs) as (p, d):
            hung = p if leg == "prefill" else d
            options = {f"{leg}_timeout_s": 0.4}
            async with proxy([p], [d], **options) as url:
                reply = await post(url, COMPLETIONS, {"prompt": "a", "stream": True})
                assert reply.status == 504
                assert reply.json() == error(
                    504,
                    "UpstreamTimeoutError",
                    f"{leg} {hung.url}: no complete reply within the 0.4 s deadline",
                )
                # the proxy closed the connection: the backend's handler was cancelled
                await asyncio.wait_for(hung.cancelled.wait(), SETTLE_S)
            if leg == "prefill":
                assert d.received == []

    run(scenario())


def slow(seconds: float) -> Handler:
    """Answers as vLLM does, ``seconds`` late (a prefill queued behind others)."""

    async def handler(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return await vllm(backend, request, body)

    return handler


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_the_time_the_client_allows_ends_each_leg_before_the_legs_own(leg: str) -> None:
    """OpenAI's SDKs send their timeout as X-Stainless-Timeout: both legs end
    within it (the decode within what the prefill left), 504 naming it."""

    async def scenario() -> None:
        specs = [
            ("P", hang if leg == "prefill" else slow(0.1)),
            ("D", hang if leg == "decode" else vllm),
        ]
        async with backends(*specs) as (p, d):
            hung = p if leg == "prefill" else d
            async with proxy([p], [d], prefill_timeout_s=30, decode_timeout_s=30) as url:
                t0 = time.monotonic()
                reply = await post(
                    url, COMPLETIONS, {"prompt": "a"}, headers={CLIENT_TIMEOUT_HEADER: "0.5"}
                )
                took = time.monotonic() - t0
                assert reply.status == 504, reply.data
                message = reply.json()["error"]["message"]
                head = f"{leg} {hung.url}: no complete reply within the "
                tail = " s the client allows (X-Stainless-Timeout)"
                assert message.startswith(head) and message.endswith(tail), message
                allowed = float(message[len(head) : -len(tail)])
                if leg == "prefill":
                    assert 0.45 < allowed <= 0.5, message  # all of it, less the body's read
                else:
                    assert 0 < allowed <= 0.4, message  # what the 0.1 s prefill left
                assert took < 30, took  # not the leg's own deadline
                await asyncio.wait_for(hung.cancelled.wait(), SETTLE_S)

    run(scenario())


def test_a_queued_prefill_completes_within_the_client_time_and_a_set_deadline_still_binds() -> None:
    """A prefill that answers late completes while the client waits: by
    default the proxy waits as long as OpenAI's SDKs do (600 s). A deadline
    the operator set (--prefill-timeout-s) binds under a longer client time."""

    async def scenario() -> None:
        async with backends(("P", slow(0.6)), ("D", vllm)) as (p, d):
            slow_ok = {"headers": {CLIENT_TIMEOUT_HEADER: "5"}}
            async with proxy([p], [d]) as url:
                assert (await post(url, COMPLETIONS, {"prompt": "a"}, **slow_ok)).status == 200
                assert (await post(url, COMPLETIONS, {"prompt": "a"})).status == 200
            async with proxy([p], [d], prefill_timeout_s=0.3) as url:
                reply = await post(url, COMPLETIONS, {"prompt": "a"}, **slow_ok)
                assert reply.json() == error(
                    504,
                    "UpstreamTimeoutError",
                    f"prefill {p.url}: no complete reply within the 0.3 s deadline",
                )
        assert ProxyConfig(["http://a:1"], ["http://b:2"]).prefill_timeout_s == 600

    run(scenario())


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf", "", "1" * 64 + "s" * 200])
def test_a_client_time_that_is_not_seconds_is_400_and_reaches_no_backend(value: str) -> None:
    """The error names the value, echoing at most its first 64 characters."""

    async def scenario() -> None:
        async with backends(("P", vllm), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            headers = {CLIENT_TIMEOUT_HEADER: value}
            reply = await post(url, COMPLETIONS, {"prompt": "a"}, headers=headers)
            assert reply.json() == error(
                400,
                "BadRequestError",
                f"header X-Stainless-Timeout: {value[:64]!r} is not a number of seconds > 0",
            )
            assert p.received == d.received == []

    run(scenario())


def test_an_idle_backend_connection_is_closed_before_vllm_would_close_it() -> None:
    """vLLM's server closes a connection idle 5 s; a request the proxy sends
    on it as it closes fails. So the proxy drops its own idle ones sooner:
    a leg after IDLE_CONNECTION_S opens a new connection (another port)."""
    ports: list[int] = []

    async def port_of(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        assert request.transport is not None
        ports.append(request.transport.get_extra_info("peername")[1])
        return await vllm(backend, request, body)

    async def scenario() -> None:
        quiet = {"health_interval_s": 60}  # no /health probe reuses the connection meanwhile
        async with backends(("P", port_of), ("D", vllm)) as (p, d), proxy([p], [d], **quiet) as url:
            for pause in (0.0, 0.2, IDLE_CONNECTION_S + 0.5):
                await asyncio.sleep(pause)
                assert (await post(url, COMPLETIONS, {"prompt": "a"})).status == 200
        assert ports[0] == ports[1] != ports[2], ports  # kept alive, then not
        assert IDLE_CONNECTION_S < 5

    run(scenario())


def test_a_backend_that_never_accepts_is_a_connect_timeout() -> None:
    async def scenario() -> None:
        with socket.socket() as listener, socket.socket() as filler:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            filler.connect(("127.0.0.1", port))  # the accept queue (of one) is full
            url_p = f"http://127.0.0.1:{port}"
            async with backends(("D", vllm)) as [d]:
                config = ProxyConfig([url_p], [d.url], connect_timeout_s=0.3)
                async with serve(config) as url:
                    reply = await post(url, COMPLETIONS, {"prompt": "a"})
                assert reply.json() == error(
                    504, "UpstreamTimeoutError", f"prefill {url_p}: no connection within 0.3 s"
                )
                assert reply.status == 504
                assert d.received == []

    run(scenario())


VLLM_500 = json.dumps(error(500, "InternalServerError", "engine dead")).encode()


@pytest.mark.parametrize(
    ("handler", "status", "type_", "detail"),
    [
        (http_error(500, VLLM_500), 500, "InternalServerError", "engine dead"),
        (http_error(404, b'{"detail":"Not Found"}'), 404, "UpstreamError", "Not Found"),
        (http_error(503, b"  overloaded\n", "text/plain"), 503, "UpstreamError", "overloaded"),
        (
            http_error(500, json.dumps(error(500, "InternalServerError", "")).encode()),
            500,
            "InternalServerError",
            "HTTP 500, no message",
        ),
        (
            no_kv_params,
            502,
            "UpstreamProtocolError",
            "prefill returned no kv_transfer_params",
        ),
        (
            http_error(200, b"[1]"),
            502,
            "UpstreamProtocolError",
            "reply is not a JSON object",
        ),
        (
            http_error(204, b""),
            502,
            "UpstreamProtocolError",
            "unexpected HTTP 204: HTTP 204, no message",
        ),
    ],
)
def test_a_prefill_error_reply_is_passed_through_or_502(
    handler: Handler, status: int, type_: str, detail: str
) -> None:
    async def scenario() -> None:
        async with backends(("P", handler), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, {"prompt": "a"})
            assert reply.status == status
            assert reply.json() == error(status, type_, f"prefill {p.url}: {detail}")
            assert d.received == []

    run(scenario())


def test_a_decode_error_reply_is_passed_through(logs: list[MutableMapping[str, Any]]) -> None:
    async def scenario() -> None:
        specs = [("P", vllm), ("D", http_error(500, VLLM_500))]
        async with backends(*specs) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, {"prompt": "a", "stream": True})
            assert reply.status == 500
            assert reply.json() == error(500, "InternalServerError", f"decode {d.url}: engine dead")
            assert reply.headers["X-Request-Id"] == d.posts()[0].headers["X-Request-Id"]

    run(scenario())
    [event] = requests_logged(logs)
    assert event["log_level"] == "warning"
    assert (event["outcome"], event["status"], event["prefill_status"], event["decode_status"]) == (
        "InternalServerError",
        500,
        200,
        500,
    )
    assert event["error"].endswith(": engine dead")


def test_a_decode_that_dies_mid_stream_ends_with_an_error_event(
    logs: list[MutableMapping[str, Any]],
) -> None:
    async def scenario() -> None:
        async with backends(("P", vllm), ("D", dies_mid_stream)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, {"prompt": "a", "stream": True})
            assert reply.status == 200  # sent before the decode died
            failure = error(
                502,
                "UpstreamDisconnectedError",
                f"decode {d.url}: connection closed before the reply was complete",
            )
            # whole events only: the third, cut short, is not forwarded
            assert reply.data.decode().split("\n\n") == [
                'data: {"n": 1}',
                'data: {"n": 2}',
                "data: " + json.dumps(failure),
                "data: [DONE]",
                "",
            ]

    run(scenario())
    [event] = requests_logged(logs)
    assert (event["outcome"], event["status"], event["decode_status"]) == (
        "UpstreamDisconnectedError",
        200,
        200,
    )


def test_a_decode_stream_that_stalls_ends_at_the_deadline() -> None:
    async def scenario() -> None:
        specs = [("P", vllm), ("D", stalls_mid_stream)]
        async with backends(*specs) as (p, d), proxy([p], [d], decode_timeout_s=0.5) as url:
            reply = await post(url, COMPLETIONS, {"prompt": "a", "stream": True})
            assert reply.status == 200
            failure = error(
                504,
                "UpstreamTimeoutError",
                f"decode {d.url}: no complete reply within the 0.5 s deadline",
            )
            assert reply.data.decode().split("\n\n") == [
                'data: {"n": 1}',
                "data: " + json.dumps(failure),
                "data: [DONE]",
                "",
            ]
            await asyncio.wait_for(d.cancelled.wait(), SETTLE_S)

    run(scenario())


def test_a_decode_that_dies_mid_json_is_502() -> None:
    async def scenario() -> None:
        async with backends(("P", vllm), ("D", dies_mid_json)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, {"prompt": "a"})
            assert reply.status == 502
            assert reply.json() == error(
                502,
                "UpstreamDisconnectedError",
                f"decode {d.url}: connection closed before the reply was complete",
            )

    run(scenario())


def test_replies_and_requests_over_the_size_cap() -> None:
    big = {"prompt": "x" * 2000}

    async def chunked() -> AsyncIterator[bytes]:
        yield json.dumps(big).encode()

    async def scenario() -> None:
        specs = [("P", vllm), ("D", vllm), ("Pbig", http_error(200, b" " * 1025))]
        async with backends(*specs) as (p, d, pbig):
            async with proxy([p], [d], max_body_bytes=1024) as url:
                too_large = error(413, "RequestTooLargeError", "request body exceeds 1024 bytes")
                reply = await post(url, COMPLETIONS, big)
                assert (reply.status, reply.json()) == (413, too_large)
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url + COMPLETIONS, data=chunked()) as r,
                ):
                    assert r.request_info.headers["Transfer-Encoding"] == "chunked"
                    assert (r.status, await r.json()) == (413, too_large)
                assert p.received == []
            async with proxy([pbig], [d], max_body_bytes=1024) as url:
                reply = await post(url, COMPLETIONS, {"prompt": "a"})
                assert reply.status == 502
                assert reply.json() == error(
                    502, "UpstreamProtocolError", f"prefill {pbig.url}: reply exceeds 1024 bytes"
                )

    run(scenario())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[1, 2]", "request body must be a JSON object, got array"),
        (b'"hi"', "request body must be a JSON object, got string"),
        (
            b"{",
            "request body is not JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": [1]}',
            "kv_transfer_params must be a JSON object or null, got array",
        ),
        # A client's kvguard_* keys: only the deadline, and only a number > 0.
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_deadline_s": "soon"}}',
            "kv_transfer_params['kvguard_deadline_s'] must be a number > 0, got 'soon'",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_deadline_s": true}}',
            "kv_transfer_params['kvguard_deadline_s'] must be a number > 0, got True",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_deadline_s": -1}}',
            "kv_transfer_params['kvguard_deadline_s'] must be a number > 0, got -1",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_deadline_s": 1e999}}',
            "kv_transfer_params['kvguard_deadline_s'] must be a number > 0, got inf",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_endpoint": "tcp://evil:1"}}',
            "kv_transfer_params['kvguard_endpoint'] is the servers' to set "
            "(a client's: kvguard_deadline_s)",
        ),
        (
            b'{"prompt": "a", "kv_transfer_params": {"kvguard_' + b"x" * 200 + b'": 1}}',
            "kv_transfer_params['kvguard_" + "x" * 55 + "] is the servers' to set "
            "(a client's: kvguard_deadline_s)",
        ),
    ],
)
def test_a_bad_client_body_is_400_and_reaches_no_backend(data: bytes, message: str) -> None:
    async def scenario() -> None:
        async with backends(("P", vllm), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            async with aiohttp.ClientSession() as s, s.post(url + COMPLETIONS, data=data) as r:
                assert r.status == 400
                assert await r.json() == error(400, "BadRequestError", message)
            assert p.received == d.received == []

    run(scenario())


def test_with_an_api_key_only_its_bearer_reaches_a_backend() -> None:
    """``--api-key``: /v1/* needs ``Authorization: Bearer <key>`` (compared in
    constant time), passed on to both legs; /health stays open, as vLLM's."""
    why = "missing or wrong API key: send 'Authorization: Bearer <key>'"
    denied = error(401, "AuthenticationError", why)

    async def scenario() -> None:
        async with (
            backends(("P", vllm), ("D", vllm)) as (p, d),
            proxy([p], [d], api_key="s3cret") as url,
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                reply = await post(url, COMPLETIONS, {"prompt": "a"}, headers=headers)
                assert (reply.status, reply.json()) == (401, denied)
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                assert (r.status, await r.json()) == (401, denied)
            assert p.received == d.received == []
            assert (await get(url, "/health")).status == 200
            auth = {"Authorization": "Bearer s3cret"}
            reply = await post(url, COMPLETIONS, {"prompt": "a"}, headers=auth)
            assert reply.status == 200
            for leg in (*p.posts(), *d.posts()):
                assert leg.headers["Authorization"] == "Bearer s3cret"

    run(scenario())


def test_the_api_key_comes_from_the_environment_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from kvguard.proxy.config import add_arguments, config_from_args

    monkeypatch.setenv("KVGUARD_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    assert config_from_args(parser.parse_args(base)).api_key == "from-env"
    assert config_from_args(parser.parse_args([*base, "--api-key", "k"])).api_key == "k"
    assert "from-env" not in repr(config_from_args(parser.parse_args(base)))


# ==== a client that leaves ========================================================


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_a_client_that_disconnects_cancels_the_leg_in_flight(
    leg: str, logs: list[MutableMapping[str, Any]]
) -> None:
    async def scenario() -> None:
        specs = [
            ("P", hang if leg == "prefill" else vllm),
            ("D", stalls_mid_stream if leg == "decode" else vllm),
        ]
        async with backends(*specs) as (p, d), proxy([p], [d]) as url:
            hung = p if leg == "prefill" else d
            client = asyncio.create_task(post(url, COMPLETIONS, {"prompt": "a", "stream": True}))
            await asyncio.wait_for(hung.arrived.wait(), SETTLE_S)
            client.cancel()  # closes the client's connection to the proxy
            with contextlib.suppress(asyncio.CancelledError):
                await client
            await asyncio.wait_for(hung.cancelled.wait(), SETTLE_S)
            if leg == "prefill":
                assert d.received == []
            for _ in range(200):  # the proxy's handler logs as it unwinds
                if requests_logged(logs):
                    break
                await asyncio.sleep(0.01)

    run(scenario())
    [event] = requests_logged(logs)
    assert event["outcome"] == "client_disconnected"
    assert event[f"{leg}_s"] >= 0


# ==== backends that are down =======================================================


def test_a_prefill_that_refuses_connections_is_retried_on_the_next_and_skipped(
    logs: list[MutableMapping[str, Any]],
) -> None:
    """Nothing was sent to a prefill that cannot be connected to: the same
    request goes to the next one, and the dead one is skipped from then on
    (until a /health probe answers again)."""

    async def scenario() -> None:
        gone = f"http://127.0.0.1:{closed_port()}"
        async with backends(("P", vllm), ("D", vllm)) as (p, d):
            config = ProxyConfig([gone, p.url], [d.url], health_interval_s=3600)
            async with serve(config) as url:
                # The first probe round marks it down: wait for it, not a time.
                deadline = time.monotonic() + SETTLE_S
                while not [e for e in logs if e["event"] == "backend_down"]:
                    assert time.monotonic() < deadline, "the first probe never marked it down"
                    await asyncio.sleep(0.01)
                replies = [await post(url, COMPLETIONS, {"prompt": f"q{i}"}) for i in range(4)]
            assert [r.status for r in replies] == [200] * 4
            assert len(p.posts()) == 4 and len(d.posts()) == 4

    run(scenario())
    down = [e for e in logs if e["event"] == "backend_down"]
    assert [(e["role"], e["url"]) for e in down] == [("prefill", down[0]["url"])]
    assert not [e for e in logs if e["event"] == "prefill_retried"]  # skipped, never tried


def test_a_prefill_found_dead_by_a_request_is_retried_on_the_next_and_skipped(
    logs: list[MutableMapping[str, Any]],
) -> None:
    """A prefill that dies between probes: the request that finds it refusing
    connections goes on to the next prefill (once), and it is skipped after."""

    async def scenario() -> None:
        async with backends(("P1", vllm), ("D", vllm)) as (p1, d):
            async with contextlib.AsyncExitStack() as stack:
                (p0,) = await stack.enter_async_context(backends(("P0", vllm)))
                config = ProxyConfig([p0.url, p1.url], [d.url], health_interval_s=3600)
                async with serve(config) as url:
                    while p0.probes < 1:  # probed up, then it dies
                        await asyncio.sleep(0.01)
                    dead = p0.url
                    await stack.aclose()
                    replies = [await post(url, COMPLETIONS, {"prompt": f"q{i}"}) for i in range(3)]
            assert [r.status for r in replies] == [200] * 3
            assert len(p1.posts()) == 3 and len(d.posts()) == 3
            retried = [e for e in logs if e["event"] == "prefill_retried"]
            assert [e["failed"] for e in retried] == [dead]
            down = [e for e in logs if e["event"] == "backend_down"]
            assert [(e["role"], e["url"]) for e in down] == [("prefill", dead)]
            assert down[0]["why"] == f"prefill {dead}: cannot connect (Connection refused)"

    run(scenario())


def test_a_decode_whose_health_fails_is_skipped_until_it_answers_again(
    logs: list[MutableMapping[str, Any]],
) -> None:
    async def scenario() -> None:
        async with backends(("P", vllm), ("D0", vllm), ("D1", vllm)) as (p, d0, d1):
            d0.health = 503
            config = ProxyConfig([p.url], [d0.url, d1.url], health_interval_s=0.05)
            async with serve(config) as url:
                while d0.probes < 1 or d1.probes < 1:
                    await asyncio.sleep(0.01)
                # D0 counting a probe is not the proxy marking it down: wait for that.
                deadline = time.monotonic() + SETTLE_S
                while not [e for e in logs if e["event"] == "backend_down"]:
                    assert time.monotonic() < deadline, "the probe of D0 never marked it down"
                    await asyncio.sleep(0.01)
                for i in range(3):
                    assert (await post(url, COMPLETIONS, {"prompt": f"a{i}"})).status == 200
                assert (len(d0.posts()), len(d1.posts())) == (0, 3)
                d0.health = 200
                seen = d0.probes
                while d0.probes < seen + 2:
                    await asyncio.sleep(0.01)
                for i in range(4):
                    assert (await post(url, COMPLETIONS, {"prompt": f"b{i}"})).status == 200
                assert len(d0.posts()) == 2 and len(d1.posts()) == 5

    run(scenario())
    changes = [(e["event"], e["role"]) for e in logs if e["event"].startswith("backend_")]
    assert changes == [("backend_down", "decode"), ("backend_up", "decode")]


def test_a_pool_picks_up_backends_in_turn_and_falls_back_when_all_are_down() -> None:
    @dataclass(frozen=True)
    class B:
        url: str

    pool = Pool("decode", [B("a"), B("b"), B("c")])
    assert [pool.pick().url for _ in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]
    pool.mark("b", "HTTP 503")
    assert [pool.pick().url for _ in range(3)] == ["c", "a", "c"]  # type: ignore[union-attr]
    got = pool.pick({"a"})
    assert got is not None and got.url == "c"
    pool.mark("a", "x")
    pool.mark("c", "x")
    got = pool.pick()  # every one down: the rotation goes on
    assert got is not None and got.url in "abc"
    assert pool.pick({"a", "b", "c"}) is None
    pool.mark("a", None)
    assert pool.down == {"b": "HTTP 503", "c": "x"}


# ==== /v1/models and /health ======================================================


def test_models_is_a_decodes_and_health_needs_every_backend() -> None:
    async def scenario() -> None:
        specs = [("P", vllm), ("D0", vllm), ("D1", vllm), ("bad", http_error(500, b"x"))]
        async with backends(*specs) as (p, d0, d1, bad):
            bad.health = 500
            async with proxy([p], [d0, d1]) as url:
                models = [await get(url, "/v1/models") for _ in range(3)]
                assert [m.json()["data"][0]["id"] for m in models] == ["D0", "D1", "D0"]
                assert all(m.status == 200 for m in models)
                health = await get(url, "/health")
                assert health.status == 200
                assert health.json() == {
                    "status": "ok",
                    "prefill": [p.url],
                    "decode": [d0.url, d1.url],
                }
            gone = f"http://127.0.0.1:{closed_port()}"
            async with serve(ProxyConfig([p.url, gone], [d0.url, bad.url])) as url:
                health = await get(url, "/health")
                assert health.status == 503
                assert health.json() == error(
                    503,
                    "ServiceUnavailableError",
                    f"unhealthy: prefill {gone}: cannot connect (Connection refused); "
                    f"decode {bad.url}: HTTP 500",
                )
            async with serve(ProxyConfig([p.url], [bad.url])) as url:
                failed = await get(url, "/v1/models")
                assert failed.status == 500
                assert failed.json() == error(500, "UpstreamError", f"decode {bad.url}: x")

    run(scenario())


# ==== settings ===================================================================


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_urls": []}, "prefill URLs: need a non-empty list, got []"),
        ({"decode_urls": "http://h:1"}, "decode URLs: need a non-empty list, got 'http://h:1'"),
        (
            {"prefill_urls": ["ftp://h:1"]},
            "prefill URL 'ftp://h:1': expected http://HOST:PORT (or https), no path",
        ),
        (
            {"decode_urls": ["http://h:1/v1"]},
            "decode URL 'http://h:1/v1': expected http://HOST:PORT (or https), no path",
        ),
        ({"decode_urls": ["http://h"]}, "decode URL 'http://h': no port"),
        (
            {"prefill_urls": ["http://h:99999"]},
            "prefill URL 'http://h:99999': Port out of range 0-65535",
        ),
        ({"prefill_timeout_s": 0}, "prefill_timeout_s must be finite and > 0, got 0"),
        ({"decode_timeout_s": float("nan")}, "decode_timeout_s must be finite and > 0, got nan"),
        ({"connect_timeout_s": True}, "connect_timeout_s must be a number, got True"),
        ({"health_timeout_s": "5"}, "health_timeout_s must be a number, got '5'"),
        ({"max_body_bytes": 0}, "max_body_bytes must be a positive integer, got 0"),
    ],
)
def test_a_bad_setting_is_a_value_error_naming_it(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"prefill_urls": ["http://h:1"], "decode_urls": ["http://h:2"]}
    with pytest.raises(ValueError) as info:
        ProxyConfig(**{**base, **kwargs})
    assert str(info.value) == message


def test_urls_are_normalised() -> None:
    config = ProxyConfig(["http://127.0.0.1:8100/"], ["https://[::1]:8200"])
    assert config.prefill_urls == ("http://127.0.0.1:8100",)
    assert config.decode_urls == ("https://[::1]:8200",)


def test_the_error_table_and_the_package_exports() -> None:
    import kvguard.proxy

    assert {f.status for f in Failure} == {400, 401, 413, 502, 503, 504}
    assert len({f.type for f in Failure}) == len(Failure)
    assert ProxyError.of(Failure.TIMEOUT, "m").body() == error(504, "UpstreamTimeoutError", "m")
    assert kvguard.proxy.__all__ == sorted(n for ns in kvguard.proxy._EXPORTS.values() for n in ns)
    for name in kvguard.proxy.__all__:
        assert getattr(kvguard.proxy, name) is not None


def test_the_config_module_loads_no_aiohttp() -> None:
    code = "import sys, kvguard.proxy.config; print('aiohttp' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout == "False\n"


# ==== the command line ============================================================


@contextlib.asynccontextmanager
async def proxy_command(*args: str) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    proc = await asyncio.create_subprocess_exec(
        str(KVGUARD),
        "proxy",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        match = re.fullmatch(r"kvguard proxy: listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, line
        yield match.group(1), proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


def test_32_concurrent_clients_through_the_command_get_their_own_answers() -> None:
    async def client(url: str, i: int) -> tuple[int, Reply]:
        if i % 2:
            body = {"model": "tiny", "prompt": f"prompt-{i}", "max_tokens": 4, "stream": i % 4 == 1}
            return i, await post(url, COMPLETIONS, body)
        chat = {"messages": [{"role": "user", "content": f"prompt-{i}"}], "stream": i % 4 == 0}
        return i, await post(url, CHAT_COMPLETIONS, chat)

    async def scenario() -> None:
        specs = [("P0", vllm), ("P1", vllm), ("D0", vllm), ("D1", vllm)]
        async with backends(*specs) as (p0, p1, d0, d1):
            args = ["--prefill", p0.url, p1.url, "--decode", d0.url, "--decode", d1.url]
            async with proxy_command(*args) as (url, proc):
                replies = await asyncio.gather(*(client(url, i) for i in range(32)))
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 60) == 0
                assert proc.stderr is not None
                stderr = (await proc.stderr.read()).decode()
            answered = {**d0.answered, **d1.answered}
            prefilled = {**p0.answered, **p1.answered}
            for i, reply in replies:
                assert reply.status == 200, reply.data
                rid = reply.headers["X-Request-Id"]
                assert reply.data == answered[rid]
                # and its decode got the params its own prefill made for it
                text = reply.data.decode()  # JSON: D|prompt|P/prompt; SSE: "D", "prompt", ...
                assert re.search(f'[|"]prompt-{i}[|"]', text), text
                assert re.search(f'[|"]P[01]/prompt-{i}"', text), text
                params = json.loads(prefilled[rid])["kv_transfer_params"]
                decoded = [
                    r for r in (*d0.posts(), *d1.posts()) if r.headers["X-Request-Id"] == rid
                ]
                assert [r.body["kv_transfer_params"] for r in decoded] == [params]
            assert len({r.headers["X-Request-Id"] for _, r in replies}) == 32
            assert [len(b.posts()) for b in (p0, p1, d0, d1)] == [16, 16, 16, 16]
            assert stderr.count("proxy_request") == 32
            assert stderr.count("outcome=ok") == 32

    run(scenario())


def test_the_command_refuses_a_bad_url_and_a_busy_port() -> None:
    base = [str(KVGUARD), "proxy", "--prefill", "ftp://h:1", "--decode", "http://h:2"]
    proc = subprocess.run(
        base,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "kvguard proxy: prefill URL 'ftp://h:1': expected http://HOST:PORT (or https), no path\n"
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [*base[:3], "http://h:1", *base[4:], "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith(f"kvguard proxy: cannot listen on 127.0.0.1:{port}: ")
