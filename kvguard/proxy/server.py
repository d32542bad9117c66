"""The proxy's HTTP server (aiohttp): the two legs, their deadlines and errors."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import structlog
from aiohttp import web

from .config import ProxyConfig
from .protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Failure,
    ProxyError,
    decode_request,
    json_type,
    parse_client_body,
    prefill_request,
    upstream_http_error,
)

__all__ = ["make_app", "run_proxy", "serve"]

log = structlog.get_logger("kvguard.proxy")

_SSE: Final = "text/event-stream"
_EVENT_END: Final = b"\n\n"
_DONE_EVENT: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class _Leg:
    """One backend as one leg of a request sees it: its URL and its deadline."""

    name: str  # "prefill" | "decode"
    url: str
    timeout_s: float
    connect_s: float

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
                Failure.TIMEOUT, f"no complete reply within the {self.timeout_s:g} s deadline"
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


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected while ``response`` streamed."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


@dataclass
class _Record:
    """What a request's one log event says: its outcome and each leg's URL, status, time."""

    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    legs: dict[str, object] = field(default_factory=dict)

    @contextlib.contextmanager
    def leg(self, leg: _Leg) -> Iterator[None]:
        self.legs[leg.name] = leg.url
        start = time.monotonic()
        try:
            yield
        finally:
            self.legs[f"{leg.name}_s"] = round(time.monotonic() - start, 6)

    def status(self, leg: _Leg, status: int) -> None:
        self.legs[f"{leg.name}_status"] = status

    def emit(self, outcome: str, status: int | None, error: str | None = None) -> None:
        level = log.info if outcome in ("ok", "client_disconnected") else log.warning
        extra = {} if error is None else {"error": error}
        level(
            "proxy_request",
            request_id=self.request_id,
            endpoint=self.endpoint,
            outcome=outcome,
            status=status,
            total_s=round(time.monotonic() - self.started, 6),
            **self.legs,
            **extra,
        )


class _Proxy:
    """The app's state: the config, round-robin cursors, one client session."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        c = config
        self.prefills = [
            _Leg("prefill", u, c.prefill_timeout_s, c.connect_timeout_s) for u in c.prefill_urls
        ]
        self.decodes = [
            _Leg("decode", u, c.decode_timeout_s, c.connect_timeout_s) for u in c.decode_urls
        ]
        # Independent cursors, as in vLLM's toy proxy; /v1/models has its own
        # so that it does not shift the decodes' rotation.
        self.next_prefill = itertools.cycle(self.prefills).__next__
        self.next_decode = itertools.cycle(self.decodes).__next__
        self.next_models = itertools.cycle(self.decodes).__next__
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app is not running"
        return self._session

    async def session_context(self, app: web.Application) -> AsyncIterator[None]:
        # No connection limit (a queue here would be a hidden deadline) and no
        # cookies shared between clients.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            self._session = session
            yield
            self._session = None

    @contextlib.asynccontextmanager
    async def exchange(
        self, leg: _Leg, method: str, path: str, **kwargs: Any
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

    async def read_body(self, leg: _Leg, resp: aiohttp.ClientResponse) -> bytes:
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
        self, leg: _Leg, path: str, body: dict[str, Any], headers: Mapping[str, str], rec: _Record
    ) -> dict[str, Any]:
        """The prefill's ``kv_transfer_params`` for ``body``."""
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
            raise leg.fail(Failure.BAD_RESPONSE, "prefill returned no kv_transfer_params")
        if not isinstance(params, dict):
            raise leg.fail(
                Failure.BAD_RESPONSE,
                f"prefill returned kv_transfer_params that are not an object: {json_type(params)}",
            )
        return params

    async def decode(
        self,
        request: web.Request,
        leg: _Leg,
        body: dict[str, Any],
        headers: Mapping[str, str],
        rec: _Record,
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

    async def _relay_events(
        self, leg: _Leg, resp: aiohttp.ClientResponse, out: web.StreamResponse
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
                await _write(out, pending)
                return None
            pending += chunk
            cut = pending.rfind(_EVENT_END) + len(_EVENT_END)
            if cut >= len(_EVENT_END):
                events, pending = pending[:cut], pending[cut:]
                done = done or events.endswith(_DONE_EVENT)
                await _write(out, events)
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
        raise _ClientGone(out) from exc


_PROXY: Final = web.AppKey("kvguard_proxy", _Proxy)


def _error_response(err: ProxyError, request_id: str | None = None) -> web.Response:
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    return web.json_response(err.body(), status=err.status, headers=headers)


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    # The same X-Request-Id on both legs: vLLM names its request after it.
    headers = {"X-Request-Id": request_id}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return headers


async def _client_body(request: web.Request, limit: int) -> dict[str, Any]:
    too_big = ProxyError.of(Failure.TOO_LARGE, f"request body exceeds {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge:  # chunked, no Content-Length
        raise too_big from None
    return parse_client_body(data)


async def _generate(request: web.Request) -> web.StreamResponse:
    """``/v1/completions`` and ``/v1/chat/completions``: prefill, then decode."""
    proxy = request.app[_PROXY]
    rec = _Record(uuid.uuid4().hex, request.path)
    try:
        body = await _client_body(request, proxy.config.max_body_bytes)
        headers = _upstream_headers(request, rec.request_id)
        leg = proxy.next_prefill()
        with rec.leg(leg):
            params = await proxy.prefill(
                leg, request.path, prefill_request(request.path, body), headers, rec
            )
        leg = proxy.next_decode()
        with rec.leg(leg):
            out, error = await proxy.decode(
                request, leg, decode_request(body, params), headers, rec
            )
    except ProxyError as err:
        rec.emit(err.type, err.status, err.message)
        return _error_response(err, rec.request_id)
    except _ClientGone as gone:  # the leg in flight was closed on the way out
        rec.emit("client_disconnected", gone.response.status)
        return gone.response
    except asyncio.CancelledError:  # the client left; aiohttp cancels the handler
        rec.emit("client_disconnected", None)
        raise
    if error is not None:  # the 200 was sent before the decode failed
        rec.emit(error.type, out.status, error.message)
    else:
        rec.emit("ok", out.status)
    return out


async def _models(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models``: a decode's answer, passed through."""
    proxy = request.app[_PROXY]
    leg = proxy.next_models()
    try:
        async with proxy.exchange(
            leg, "GET", "/v1/models", headers=_upstream_headers(request, uuid.uuid4().hex)
        ) as resp:
            data = await proxy.read_body(leg, resp)
        if resp.status != 200:
            raise upstream_http_error(f"{leg.name} {leg.url}", resp.status, data)
    except ProxyError as err:
        log.warning("proxy_models", outcome=err.type, status=err.status, error=err.message)
        return _error_response(err)
    content_type = resp.headers.get("Content-Type", "application/json")
    return web.Response(body=data, headers={"Content-Type": content_type})


async def _probe(proxy: _Proxy, leg: _Leg) -> str | None:
    """None if ``leg`` answers ``GET /health`` with 200 in time, else why not."""
    c = proxy.config
    probe = _Leg(leg.name, leg.url, c.health_timeout_s, c.connect_timeout_s)
    try:
        async with proxy.exchange(probe, "GET", "/health") as resp:
            if resp.status == 200:
                return None
            return f"{probe.name} {probe.url}: HTTP {resp.status}"
    except ProxyError as err:
        return err.message


async def _health(request: web.Request) -> web.StreamResponse:
    """``GET /health``: 200 only when every backend answers its own ``/health``."""
    proxy = request.app[_PROXY]
    legs = [*proxy.prefills, *proxy.decodes]
    problems = [p for p in await asyncio.gather(*(_probe(proxy, leg) for leg in legs)) if p]
    if problems:
        err = ProxyError.of(Failure.UNHEALTHY, "unhealthy: " + "; ".join(problems))
        log.warning("proxy_health", outcome=err.type, error=err.message)
        return _error_response(err)
    return web.json_response(
        {
            "status": "ok",
            "prefill": list(proxy.config.prefill_urls),
            "decode": list(proxy.config.decode_urls),
        }
    )


def make_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application.

    Serve it with ``handler_cancellation=True`` (as :func:`serve` and
    :func:`run_proxy` do), or a client's disconnect does not cancel its legs.
    """
    proxy = _Proxy(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[_PROXY] = proxy
    app.cleanup_ctx.append(proxy.session_context)
    app.router.add_post(COMPLETIONS, _generate)
    app.router.add_post(CHAT_COMPLETIONS, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


def _url_of(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def serve(
    config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout_s: float = 5.0
) -> AsyncIterator[str]:
    """Serve the proxy in the running loop; yields its base URL (port 0: any free port).

    On exit it stops listening, gives requests in flight up to
    ``shutdown_timeout_s`` and closes every backend connection.
    """
    runner = web.AppRunner(
        make_app(config),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield _url_of(runner)
    finally:
        await runner.cleanup()


def run_proxy(
    config: ProxyConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the proxy until SIGINT or SIGTERM; ``on_ready`` gets the base URL once it listens.

    Raises OSError when it cannot listen on ``host:port``.
    """

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with serve(config, host, port) as url:
            if on_ready is not None:
                on_ready(url)
            await stop.wait()

    asyncio.run(main())
