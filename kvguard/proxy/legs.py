"""The proxy's two legs as aiohttp client calls: each backend with its deadline,
the errors a leg ends in, and the decode's reply relayed to the client.

``Proxy`` holds what every request shares (the config, the round-robin
cursors, one client session); ``Leg`` is one backend as one leg sees it. A
leg's aiohttp error or timeout becomes the client's ``ProxyError``, named
after the leg and its URL; each leg notes what it did in the request's
``record.Record``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import aiohttp
import structlog
from aiohttp import web

from .backends import Pool
from .config import ProxyConfig
from .first_token import FirstToken
from .protocol import (
    CLIENT_TIMEOUT_HEADER,
    Failure,
    ProxyError,
    json_type,
    only_choice,
    upstream_http_error,
)
from .record import Record

__all__ = ["IDLE_CONNECTION_S", "ClientGone", "Leg", "Proxy"]

log = structlog.get_logger("kvguard.proxy")

# Below vLLM's own idle timeout for a kept-alive connection (uvicorn's,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE: 5 s).
IDLE_CONNECTION_S: Final = 2.0
_SSE: Final = "text/event-stream"
_EVENT_END: Final = b"\n\n"
_DONE_EVENT: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Leg:
    """One backend as one leg of a request sees it: its URL and its deadline."""

    name: str  # "prefill" | "decode"
    url: str
    timeout_s: float
    connect_s: float
    bound: str = "deadline"  # what set timeout_s, for the error's message

    def within(self, client_s: float | None) -> Leg:
        """This leg ending by the earlier of its own deadline and the
        ``client_s`` seconds left of the time the client allows."""
        if client_s is None or client_s >= self.timeout_s:
            return self
        return replace(
            self,
            timeout_s=max(client_s, 1e-3),  # spent: the leg times out at once
            bound=f"the client allows ({CLIENT_TIMEOUT_HEADER})",
        )

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_s)

    def fail(self, failure: Failure, detail: str) -> ProxyError:
        return ProxyError.of(failure, f"{self.name} {self.url}: {detail}")

    def failure_of(self, exc: BaseException) -> ProxyError:
        """The client's error for an aiohttp error or timeout of this leg.

        Subclass order matters: a connect timeout is an OSError and a
        TimeoutError; a refused connection an OSError.
        """
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            within = min(self.connect_s, self.timeout_s)
            return self.fail(Failure.TIMEOUT, f"no connection within {within:g} s")
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            return self.fail(
                Failure.TIMEOUT, f"no complete reply within the {self.timeout_s:g} s {self.bound}"
            )
        if isinstance(exc, aiohttp.ClientConnectorError):
            # errno > 0: the socket's (refused, unreachable); else a resolver's.
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            return self.fail(Failure.UNREACHABLE, f"cannot connect ({reason})")
        if isinstance(
            exc,
            (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError),
        ):
            return self.fail(
                Failure.DISCONNECTED, "connection closed before the reply was complete"
            )
        return self.fail(Failure.BAD_RESPONSE, f"{type(exc).__name__}: {exc}")


class ClientGone(Exception):
    """Writing to the client failed: it disconnected while ``response`` streamed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class Proxy:
    """The app's state: the config, round-robin cursors, one client session."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        c = config
        self.prefills = [
            Leg("prefill", u, c.prefill_timeout_s, c.connect_timeout_s) for u in c.prefill_urls
        ]
        self.decodes = [
            Leg("decode", u, c.decode_timeout_s, c.connect_timeout_s) for u in c.decode_urls
        ]
        # Independent cursors, as in vLLM's toy proxy; /v1/models has its own
        # so that it does not shift the decodes' rotation. A backend known
        # down is skipped (``backends``).
        self.prefill_pool = Pool("prefill", self.prefills)
        self.decode_pool = Pool("decode", self.decodes)
        self.next_models = itertools.cycle(self.decodes).__next__
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app is not running"
        return self._session

    async def session_context(self, app: web.Application) -> AsyncIterator[None]:
        # No connection limit (a queue here would be a hidden deadline) and no
        # cookies shared between clients. An idle connection is closed here
        # before the server closes it: one sent on as the server closes it
        # fails the leg ("connection closed before the reply was complete",
        # 1 of 64 requests at 32 concurrent in a bench run with aiohttp's 15 s).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S)
        async with aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            self._session = session
            watch = asyncio.create_task(self._watch())
            try:
                yield
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
                self._session = None

    async def probe(self, leg: Leg) -> str | None:
        """None if ``leg`` answers ``GET /health`` with 200 in time, else why not."""
        c = self.config
        probe = Leg(leg.name, leg.url, c.health_timeout_s, c.connect_timeout_s)
        try:
            async with self.exchange(probe, "GET", "/health") as resp:
                if resp.status == 200:
                    return None
                return f"{probe.name} {probe.url}: HTTP {resp.status}"
        except ProxyError as err:
            return err.message

    async def _watch(self) -> None:
        """Probe every backend each ``health_interval_s``: skip those down."""
        pools = [(self.prefill_pool, leg) for leg in self.prefills]
        pools += [(self.decode_pool, leg) for leg in self.decodes]
        while True:
            whys = await asyncio.gather(*(self.probe(leg) for _, leg in pools))
            for (pool, leg), why in zip(pools, whys, strict=True):
                pool.mark(leg.url, why)
            await asyncio.sleep(self.config.health_interval_s)

    @contextlib.asynccontextmanager
    async def exchange(
        self, leg: Leg, method: str, path: str, **kwargs: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request to ``leg``; aiohttp errors become the leg's :class:`ProxyError`.

        Whatever ends it early -- an error, the client's disconnect cancelling
        the handler -- closes the connection instead of pooling it, so the
        backend sees the abort (vLLM then aborts the request).
        """
        try:
            async with self.session.request(
                method, leg.url + path, timeout=leg.timeout, **kwargs
            ) as resp:
                try:
                    yield resp
                except BaseException:
                    resp.close()
                    raise
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
            raise leg.failure_of(exc) from exc

    async def read_body(self, leg: Leg, resp: aiohttp.ClientResponse) -> bytes:
        limit = self.config.max_body_bytes
        too_big = leg.fail(Failure.BAD_RESPONSE, f"reply exceeds {limit} bytes")
        if resp.content_length is not None and resp.content_length > limit:
            raise too_big
        data = bytearray()
        async for chunk in resp.content.iter_any():
            data += chunk
            if len(data) > limit:
                raise too_big
        return bytes(data)

    # ==== the two legs ========================================================

    async def prefill(
        self, leg: Leg, path: str, body: dict[str, Any], headers: Mapping[str, str], rec: Record
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The prefill's reply to ``body`` and its ``kv_transfer_params``: None
        where its one token ended the request (a stop token: it held no KV)."""
        async with self.exchange(leg, "POST", path, json=body, headers=headers) as resp:
            rec.status(leg, resp.status)
            data = await self.read_body(leg, resp)
        if resp.status != 200:
            raise upstream_http_error(f"{leg.name} {leg.url}", resp.status, data)
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise leg.fail(Failure.BAD_RESPONSE, "reply is not a JSON object")
        params = reply.get("kv_transfer_params")
        if not params:
            if (choice := only_choice(reply)) is not None and choice.get("finish_reason") == "stop":
                return reply, None
            raise leg.fail(Failure.BAD_RESPONSE, "prefill returned no kv_transfer_params")
        if not isinstance(params, dict):
            raise leg.fail(
                Failure.BAD_RESPONSE,
                f"prefill returned kv_transfer_params that are not an object: {json_type(params)}",
            )
        return reply, params

    async def decode(
        self,
        request: web.Request,
        leg: Leg,
        body: dict[str, Any],
        headers: Mapping[str, str],
        rec: Record,
    ) -> tuple[web.StreamResponse, ProxyError | None]:
        """The decode's reply relayed to the client, and the error that cut it short."""
        async with self.exchange(leg, "POST", request.path, json=body, headers=headers) as resp:
            rec.status(leg, resp.status)
            if resp.status != 200:
                data = await self.read_body(leg, resp)
                raise upstream_http_error(f"{leg.name} {leg.url}", resp.status, data)
            reply_headers = {
                "Content-Type": resp.headers.get("Content-Type", "application/json"),
                "X-Request-Id": rec.request_id,
            }
            if resp.content_type != _SSE:
                # One JSON document: read it whole, so a decode that dies
                # midway is a clean error, not a truncated 200.
                data = await self.read_body(leg, resp)
                return web.Response(body=data, headers=reply_headers), None
            out = web.StreamResponse(headers={**reply_headers, "Cache-Control": "no-cache"})
            await out.prepare(request)
            error = await self._relay_events(leg, resp, out)
            with contextlib.suppress(ConnectionResetError):
                await out.write_eof()
            return out, error

    async def decode_after(
        self,
        request: web.Request,
        leg: Leg,
        first: FirstToken,
        bodies: tuple[dict[str, Any], dict[str, Any]],
        headers: Mapping[str, str],
        rec: Record,
    ) -> tuple[web.StreamResponse, ProxyError | None]:
        """The prefill's ``first`` token streamed to the client at once, then
        the decode's continuation (``bodies``: the client's, the decode's);
        the error that cut the stream short."""
        body, decode_body = bodies
        out = web.StreamResponse(
            headers={
                "Content-Type": f"{_SSE}; charset=utf-8",
                "X-Request-Id": rec.request_id,
                "Cache-Control": "no-cache",
            }
        )
        await out.prepare(request)
        await _write(out, first.event(body))
        try:
            async with self.exchange(
                leg, "POST", request.path, json=decode_body, headers=headers
            ) as resp:
                rec.status(leg, resp.status)
                if resp.status != 200:
                    data = await self.read_body(leg, resp)
                    raise upstream_http_error(f"{leg.name} {leg.url}", resp.status, data)
                if resp.content_type != _SSE:
                    why = f"reply is {resp.content_type}, not events"
                    raise leg.fail(Failure.BAD_RESPONSE, why)
                error = await self._relay_events(leg, resp, out, first.rewrite)
        except ProxyError as err:  # before the decode's first event: the stream ends here
            error = err
            await _write(out, err.sse_event() + _DONE_EVENT)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out, error

    async def _relay_events(
        self,
        leg: Leg,
        resp: aiohttp.ClientResponse,
        out: web.StreamResponse,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> ProxyError | None:
        """Forward whole server-sent events; on a decode failure end with an error event.

        Only whole events are forwarded, so the client never sees half an
        event followed by the error.
        """
        limit = self.config.max_body_bytes
        pending = b""
        done = False  # the decode sent [DONE]: the stream is complete for the client
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
                if done:
                    return None
                error = leg.failure_of(exc)
                break
            if not chunk:  # the decode ended its reply
                await _write(out, pending if rewrite is None else rewrite(pending))
                return None
            pending += chunk
            cut = pending.rfind(_EVENT_END) + len(_EVENT_END)
            if cut >= len(_EVENT_END):
                events, pending = pending[:cut], pending[cut:]
                done = done or events.endswith(_DONE_EVENT)
                await _write(out, events if rewrite is None else rewrite(events))
            elif len(pending) > limit:
                error = leg.fail(Failure.BAD_RESPONSE, f"event exceeds {limit} bytes")
                break
        resp.close()
        await _write(out, error.sse_event() + _DONE_EVENT)
        return error


async def _write(out: web.StreamResponse, data: bytes) -> None:
    if not data:
        return
    try:
        await out.write(data)
    except ConnectionResetError as exc:  # aiohttp's "cannot write to closing transport"
        raise ClientGone(out) from exc
