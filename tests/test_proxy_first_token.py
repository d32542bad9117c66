"""The proxy's early first token (``kvguard.proxy.first_token``) and a prefill whose token ends.

Which requests may take the prefill's token is a table, checked field by
field; the client's stream is checked byte for byte against backends that
answer as vLLM does (a prefill with ``return_token_ids``, a decode that
streams the continuation); the first event is shown to reach the client
while the decode has not answered yet (the decode waits for the client to
have it). A prefill whose one token was a stop holds no KV: the decode then
computes the prompt itself and the client gets its answer, not a 502.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvguard.proxy.first_token import CONTINUABLE, NEUTRAL, FirstToken, eligible, prefill_asks
from kvguard.proxy.protocol import CHAT_COMPLETIONS, COMPLETIONS
from kvguard.vllm.params import TEXT, TOKENS
from tests.test_proxy import (
    Backend,
    backends,
    error,
    logs,
    post,
    proxy,
    requests_logged,
    run,
    vllm,
)

__all__ = ["logs"]  # the fixture, used by name

PROMPT_IDS = [11, 12, 13]
CREATED = 1_700_000_000
FIRST = FirstToken("cmpl-r", CREATED, "tiny", PROMPT_IDS, 7, " A")
STREAMED: dict[str, Any] = {
    "model": "tiny",
    "prompt": "hello",
    "max_tokens": 4,
    "stream": True,
    "return_token_ids": True,
}


def prefill_reply(rid: str, **choice: Any) -> dict[str, Any]:
    """A kvguard prefill's reply to a body with ``return_token_ids``, as vLLM writes it."""
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": CREATED,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " A",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": PROMPT_IDS,
                "token_ids": [7],
            }
            | choice
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvguard_endpoint": "tcp://P",
            "kvguard_request_id": f"P/{rid}",
            TOKENS: len(PROMPT_IDS),
            TEXT: True,
        },
    }


# ==== which requests ===========================================================


def test_a_streamed_completion_of_known_fields_takes_the_prefills_token() -> None:
    assert eligible(COMPLETIONS, STREAMED)
    assert eligible(COMPLETIONS, {**STREAMED, "prompt": [1, 2], "min_tokens": 4})
    every = {k: v[-1] for k, v in NEUTRAL.items()} | {k: None for k in CONTINUABLE}
    assert eligible(COMPLETIONS, {**every, "stream": True, "prompt": "x", "max_tokens": 2})


@pytest.mark.parametrize(
    ("path", "change"),
    [
        (CHAT_COMPLETIONS, {}),  # a chat's prompt cannot be token ids
        (COMPLETIONS, {"stream": False}),  # nobody waits for a first token
        (COMPLETIONS, {"stream": 1}),
        (COMPLETIONS, {"n": 2}),
        (COMPLETIONS, {"best_of": 3}),
        (COMPLETIONS, {"echo": True}),
        (COMPLETIONS, {"logprobs": 0}),
        (COMPLETIONS, {"prompt_logprobs": 1}),
        (COMPLETIONS, {"stop": ["\n"]}),
        (COMPLETIONS, {"stop": "x"}),
        (COMPLETIONS, {"stop": ""}),
        (COMPLETIONS, {"skip_special_tokens": False}),
        (COMPLETIONS, {"spaces_between_special_tokens": False}),
        (COMPLETIONS, {"seed": 1}),
        (COMPLETIONS, {"presence_penalty": 0.5}),
        (COMPLETIONS, {"frequency_penalty": 1}),
        (COMPLETIONS, {"suffix": "x"}),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}),  # a grammar
        (COMPLETIONS, {"some_future_field": 1}),  # unknown: the two steps, as before
        (COMPLETIONS, {"max_tokens": 1}),  # the prefill's token is all of it
        (COMPLETIONS, {"max_tokens": 2.0}),
        (COMPLETIONS, {"max_tokens": None}),  # vLLM's default would count from the decode
        (COMPLETIONS, {"min_tokens": 5}),  # above max_tokens: the decode's 400, before any event
        (COMPLETIONS, {"min_tokens": 1.0}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),  # a batch
        (COMPLETIONS, {"prompt": []}),
        (COMPLETIONS, {"prompt": [1, True]}),
        (COMPLETIONS, {"prompt": None}),
    ],
)
def test_anything_the_output_depends_on_takes_the_two_steps(
    path: str, change: dict[str, Any]
) -> None:
    assert not eligible(path, {**STREAMED, **change})


def test_without_max_tokens_the_two_steps_are_taken() -> None:
    assert not eligible(COMPLETIONS, {k: v for k, v in STREAMED.items() if k != "max_tokens"})


def test_a_replys_token_is_used_only_if_the_decode_can_continue_from_it() -> None:
    reply = prefill_reply("r")
    params = reply["kv_transfer_params"]
    assert FirstToken.of(reply, params) == FIRST
    defects: list[dict[str, Any]] = [
        {"finish_reason": "stop"},  # the request ended at it
        {"token_ids": [7, 8]},
        {"token_ids": []},
        {"token_ids": None},
        {"prompt_token_ids": None},
        {"prompt_token_ids": [11, 12, "13"]},  # as many as it holds, one not an id
        {"prompt_token_ids": []},
        {"token_ids": ["7"]},
        {"text": ""},  # held back: it ends inside a character
        {"text": None},
    ]
    for choice in defects:
        assert FirstToken.of(prefill_reply("r", **choice), params) is None, choice
    # A server without a tokenizer: every text is empty, none is held back.
    blank = prefill_reply("r", text="")
    assert FirstToken.of(blank, {**params, TEXT: False}) == FirstToken(
        "cmpl-r", CREATED, "tiny", PROMPT_IDS, 7, ""
    )
    assert FirstToken.of(blank, {k: v for k, v in params.items() if k != TEXT}) is None
    # Not a kvguard prefill, or a count that is not what it holds.
    assert FirstToken.of(reply, {k: v for k, v in params.items() if k != TOKENS}) is None
    assert FirstToken.of(reply, {**params, TOKENS: 4}) is None
    tops: list[dict[str, Any]] = [{"id": None}, {"created": "now"}, {"model": 1}, {"choices": []}]
    for top in tops:
        assert FirstToken.of({**reply, **top}, params) is None, top


def test_the_decode_continues_after_the_token_on_the_prompts_kv() -> None:
    first = FIRST
    body = {**STREAMED, "min_tokens": 2, "truncate_prompt_tokens": 2, "add_special_tokens": True}
    params = {"kvguard_request_id": "P/r", TOKENS: 3}
    assert first.decode_body(body, params) == {
        "model": "tiny",
        "prompt": [11, 12, 13, 7],
        "max_tokens": 3,
        "min_tokens": 1,
        "stream": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    assert first.decode_body({**STREAMED, "min_tokens": 1}, params)["min_tokens"] == 0
    assert first.decode_body({**STREAMED, "min_tokens": 0}, params) == {
        **STREAMED,
        "prompt": [11, 12, 13, 7],
        "max_tokens": 3,
        "min_tokens": 0,
        "kv_transfer_params": params,
    }


def test_the_decodes_events_read_as_one_completion() -> None:
    first = FIRST
    chunk = {
        "id": "cmpl-other",
        "created": 5,
        "choices": [{"index": 0, "text": " B", "prompt_token_ids": [11, 12, 13, 7]}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }
    events = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    later = {"id": "cmpl-other", "created": 5, "choices": [{"index": 0, "text": " C"}]}
    events += b"data: " + json.dumps(later).encode() + b"\n\n"
    # The decode's error and end, byte for byte: an error is never re-encoded.
    events += b'data: {"error":{"message":"m","code":500}}\n\ndata: [DONE]\n\n'
    got = first.rewrite(events).split(b"\n\n")
    assert json.loads(got[0][6:]) == {
        "id": "cmpl-r",
        "created": CREATED,
        "choices": [{"index": 0, "text": " B", "prompt_token_ids": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    # A choice without the prompt's ids gets none.
    assert json.loads(got[1][6:])["choices"] == [{"index": 0, "text": " C"}]
    assert got[2:] == [b'data: {"error":{"message":"m","code":500}}', b"data: [DONE]", b""]
    assert first.rewrite(b"data: {not json\n\n: comment\n\n") == b"data: {not json\n\n: comment\n\n"
    # Only data lines are read; another field's JSON is passed on as it came.
    assert first.rewrite(b'event: {"id": "x"}\n\n') == b'event: {"id": "x"}\n\n'


def test_usage_the_decode_did_not_count_in_whole_is_passed_on_as_it_came() -> None:
    for usage in ({"prompt_tokens": 4, "completion_tokens": None}, {"prompt_tokens": "4"}):
        event = b"data: " + json.dumps({"usage": usage}).encode()
        assert json.loads(FIRST.rewrite(event)[6:]) == {"usage": usage}


def test_the_prefill_is_asked_for_the_ids_whatever_the_client_asked() -> None:
    assert prefill_asks({"prompt": "x"}) == {"prompt": "x", "return_token_ids": True}
    assert prefill_asks({"return_token_ids": False})["return_token_ids"] is True


def test_the_first_event_is_vllms_chunk_of_the_prefills_token() -> None:
    first = FIRST
    plain = {"stream": True}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    each = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}}
    choice = {
        "index": 0,
        "text": " A",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,  # as vLLM's: set, null
        "token_ids": None,
    }
    head = {"id": "cmpl-r", "object": "text_completion", "created": CREATED, "model": "tiny"}
    assert first.event(plain) == b"data: " + json.dumps({**head, "choices": [choice]}).encode() + (
        b"\n\n"
    )
    assert json.loads(first.event(usage)[6:]) == {**head, "choices": [choice]}
    assert json.loads(first.event(each)[6:])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
    }
    ids = json.loads(first.event(STREAMED)[6:])["choices"][0]
    assert (ids["prompt_token_ids"], ids["token_ids"]) == (PROMPT_IDS, [7])


# ==== over HTTP ================================================================


async def prefill(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    rid = request.headers["X-Request-Id"]
    data = json.dumps(prefill_reply(rid)).encode()
    backend.answered[rid] = data
    return web.Response(body=data, content_type="application/json")


def decode_after(gate: asyncio.Event) -> Any:
    """A decode that streams tokens 8, 9 and 10 after the prompt it is given,
    once ``gate`` is set (the client has the first event)."""

    async def handler(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        await gate.wait()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        rid = request.headers["X-Request-Id"]
        for i, token in enumerate((8, 9, 10)):
            choice = {"index": 0, "text": f" t{token}", "token_ids": [token]}
            if i == 0:
                choice["prompt_token_ids"] = body["prompt"]
            if i == 2:
                choice["finish_reason"] = "length"
            chunk = {"id": f"cmpl-{rid}", "created": CREATED + 1, "choices": [choice]}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        tail = {"id": f"cmpl-{rid}", "created": CREATED + 1, "choices": [], "usage": usage}
        await out.write(b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n")
        await out.write_eof()
        return out

    return handler


async def stream(
    url: str,
    body: dict[str, Any],
    gate: asyncio.Event | None,
    headers: dict[str, str] | None = None,
) -> list[Any]:
    """The client's events, decoded; sets ``gate`` once it has the first
    and copies the reply's headers, their names lower case, into ``headers``."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url + COMPLETIONS, json=body) as r:
        assert r.status == 200
        if headers is not None:
            headers.update((k.lower(), v) for k, v in r.headers.items())
        async for line in r.content:
            if line.startswith(b"data: "):
                text = line[6:].strip()
                events.append(text.decode() if text == b"[DONE]" else json.loads(text))
                if gate is not None:
                    gate.set()
    return events


def test_the_client_has_the_prefills_token_before_the_decode_answers(
    logs: list[MutableMapping[str, Any]],
) -> None:
    gate = asyncio.Event()
    body = {**STREAMED, "stream_options": {"include_usage": True}}

    async def scenario() -> None:
        async with (
            backends(("P", prefill), ("D", decode_after(gate))) as (p, d),
            proxy([p], [d]) as url,
        ):
            seen: dict[str, str] = {}
            events = await stream(url, body, gate, seen)
            [pre], [dec] = p.posts(), d.posts()
            assert pre.body["return_token_ids"] is True
            rid = pre.headers["X-Request-Id"]
            assert (seen["content-type"], seen["x-request-id"], seen["cache-control"]) == (
                "text/event-stream; charset=utf-8",
                rid,
                "no-cache",
            )
            params = json.loads(p.answered[rid])["kv_transfer_params"]
            assert dec.body == {**body, "prompt": [*PROMPT_IDS, 7], "max_tokens": 3} | {
                "kv_transfer_params": params
            }
            first, *rest, usage, done = events
            assert first["choices"][0] | {"id": first["id"]} == {
                "index": 0,
                "text": " A",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": PROMPT_IDS,
                "token_ids": [7],
                "id": f"cmpl-{rid}",
            }
            assert [(e["id"], e["created"]) for e in rest] == [(f"cmpl-{rid}", CREATED)] * 3
            assert [c["token_ids"] for e in rest for c in e["choices"]] == [[8], [9], [10]]
            assert all(c.get("prompt_token_ids") is None for e in rest for c in e["choices"])
            assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            assert done == "[DONE]"

    run(scenario())
    [event] = requests_logged(logs)
    assert (event["outcome"], event["status"], event["served"]) == ("ok", 200, "early_first_token")
    assert (event["prefill_status"], event["decode_status"]) == (200, 200)


def test_a_decode_that_fails_after_the_first_event_ends_the_stream_with_its_error(
    logs: list[MutableMapping[str, Any]],
) -> None:
    dead = error(500, "InternalServerError", "engine dead")

    async def dies(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response(dead, status=500)

    async def scenario() -> None:
        async with backends(("P", prefill), ("D", dies)) as (p, d), proxy([p], [d]) as url:
            first, err, done = await stream(url, STREAMED, None)
            assert first["choices"][0]["token_ids"] == [7]
            assert err == error(500, "InternalServerError", f"decode {d.url}: engine dead")
            assert done == "[DONE]"

    run(scenario())
    [event] = requests_logged(logs)
    assert (event["outcome"], event["status"], event["served"]) == (
        "InternalServerError",
        200,
        "early_first_token",
    )
    assert event["error"].endswith(": engine dead")


def test_without_the_switch_the_decode_sends_the_first_token() -> None:
    gate = asyncio.Event()
    gate.set()

    async def scenario() -> None:
        async with (
            backends(("P", prefill), ("D", decode_after(gate))) as (p, d),
            proxy([p], [d], early_first_token=False) as url,
        ):
            events = await stream(url, STREAMED, None)
            [pre], [dec] = p.posts(), d.posts()
            rid = pre.headers["X-Request-Id"]
            params = json.loads(p.answered[rid])["kv_transfer_params"]
            assert dec.body == {**STREAMED, "kv_transfer_params": params}
            assert [c["token_ids"] for e in events[:-2] for c in e["choices"]] == [[8], [9], [10]]

    run(scenario())


async def stops(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    """A prefill whose one token was a stop: no KV held, no kv_transfer_params."""
    reply = prefill_reply(request.headers["X-Request-Id"], finish_reason="stop")
    reply["kv_transfer_params"] = None
    return web.json_response(reply)


@pytest.mark.parametrize("body", [STREAMED, {**STREAMED, "stream": False}])
def test_a_prefill_whose_token_was_a_stop_leaves_the_prompt_to_the_decode(
    logs: list[MutableMapping[str, Any]], body: dict[str, Any]
) -> None:
    client = {**body, "kv_transfer_params": {"kvguard_deadline_s": 4}}

    async def scenario() -> None:
        async with backends(("P", stops), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, client)
            assert reply.status == 200
            [dec] = d.posts()
            assert dec.body == {k: v for k, v in client.items() if k != "kv_transfer_params"}
            assert reply.data == d.answered[reply.headers["X-Request-Id"]]

    run(scenario())
    [event] = requests_logged(logs)
    assert (event["outcome"], event["served"]) == ("ok", "decode_only")


async def answers_json(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    return web.json_response({"choices": []})


async def dies_after_one(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b'data: {"choices": []}\n\ndata: {"cho')
    await asyncio.sleep(0.05)  # let the bytes reach the proxy before the close
    assert request.transport is not None
    request.transport.close()
    return out


@pytest.mark.parametrize(
    ("handler", "type_", "detail"),
    [
        (answers_json, "UpstreamProtocolError", "reply is application/json, not events"),
        (
            dies_after_one,
            "UpstreamDisconnectedError",
            "connection closed before the reply was complete",
        ),
    ],
)
def test_a_decode_that_cannot_continue_the_stream_ends_it_with_its_error(
    handler: Any, type_: str, detail: str
) -> None:
    async def scenario() -> None:
        async with backends(("P", prefill), ("D", handler)) as (p, d), proxy([p], [d]) as url:
            first, *rest, err, done = await stream(url, STREAMED, None)
            assert first["choices"][0]["token_ids"] == [7]
            assert rest == ([{"choices": []}] if handler is dies_after_one else [])
            assert err == error(502, type_, f"decode {d.url}: {detail}")
            assert done == "[DONE]"

    run(scenario())


@pytest.mark.parametrize("choices", [[], [1], None, "x"])
def test_a_prefill_reply_without_params_or_a_stop_is_502(choices: object) -> None:
    async def odd(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        return web.json_response({"choices": choices, "kv_transfer_params": None})

    async def scenario() -> None:
        async with backends(("P", odd), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            reply = await post(url, COMPLETIONS, STREAMED)
            assert reply.json() == error(
                502,
                "UpstreamProtocolError",
                f"prefill {p.url}: prefill returned no kv_transfer_params",
            )
            assert d.posts() == []

    run(scenario())


def test_an_event_the_decode_ends_without_its_blank_line_is_rewritten_too() -> None:
    async def unterminated(backend: Backend, request: web.Request, body: Any) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"id": "cmpl-d", "created": 1, "choices": []}')  # no blank line
        await out.write_eof()
        return out

    async def scenario() -> None:
        async with backends(("P", prefill), ("D", unterminated)) as (p, d), proxy([p], [d]) as url:
            first, last = await stream(url, STREAMED, None)
            assert last == {"id": first["id"], "created": CREATED, "choices": []}

    run(scenario())


def test_the_prefill_is_asked_for_ids_the_client_did_not_ask_for() -> None:
    body = {k: v for k, v in STREAMED.items() if k != "return_token_ids"}
    gate = asyncio.Event()
    gate.set()

    async def scenario() -> None:
        async with (
            backends(("P", prefill), ("D", decode_after(gate))) as (p, d),
            proxy([p], [d]) as url,
        ):
            first, *_ = await stream(url, body, None)
            [pre], [dec] = p.posts(), d.posts()
            assert pre.body["return_token_ids"] is True
            assert "return_token_ids" not in dec.body
            assert dec.body["prompt"] == [*PROMPT_IDS, 7]
            choice = first["choices"][0]
            assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (
                " A",
                None,
                None,
            )

    run(scenario())


def test_a_chats_prefill_is_capped_by_max_completion_tokens_too() -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def scenario() -> None:
        async with backends(("P", vllm), ("D", vllm)) as (p, d), proxy([p], [d]) as url:
            assert (await post(url, CHAT_COMPLETIONS, chat)).status == 200
            [pre] = p.posts()
            assert (pre.body["max_tokens"], pre.body["max_completion_tokens"]) == (1, 1)
            assert "return_token_ids" not in pre.body  # a chat takes the two steps

    run(scenario())
