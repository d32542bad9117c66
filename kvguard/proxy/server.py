"""The proxy's HTTP server (aiohttp): its routes, each request's two legs in
order, and serving the app until it is stopped.

The legs themselves -- deadlines, errors, relaying the decode's reply -- are
``legs``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import structlog
from aiohttp import web

from .config import ProxyConfig
from .first_token import FirstToken, eligible, prefill_asks
from .legs import ClientGone, Proxy
from .protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Failure,
    ProxyError,
    Served,
    client_timeout,
    decode_alone,
    decode_request,
    parse_client_body,
    prefill_request,
    upstream_http_error,
)
from .record import Record

__all__ = ["make_app", "run_proxy", "serve"]

log = structlog.get_logger("kvguard.proxy")

_PROXY: Final = web.AppKey("kvguard_proxy", Proxy)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    rec = Record(uuid.uuid4().hex, request.path)
    try:
        allowed = client_timeout(request.headers)  # both legs end within it
        body = await _client_body(request, proxy.config.max_body_bytes)
        headers = _upstream_headers(request, rec.request_id)
        early = proxy.config.early_first_token and eligible(request.path, body)
        prefill_body = prefill_request(request.path, body)
        reply, params = await _prefill(
            proxy,
            request.path,
            prefill_asks(prefill_body) if early else prefill_body,
            headers,
            rec,
            allowed,
        )
        first = FirstToken.of(reply, params) if early and params else None
        leg = proxy.decode_pool.pick()
        assert leg is not None  # a pool of one or more, nothing tried
        leg = leg.within(rec.left(allowed))
        with rec.leg(leg):
            if first is not None and params is not None:
                rec.served = Served.EARLY_FIRST_TOKEN
                bodies = body, first.decode_body(body, params)
                out, error = await proxy.decode_after(request, leg, first, bodies, headers, rec)
            else:
                # Its one token ended the request: the decode computes the
                # prompt itself and ends where the prefill did.
                rec.served = Served.TWO_STEP if params else Served.DECODE_ONLY
                decode_body = decode_request(body, params) if params else decode_alone(body)
                out, error = await proxy.decode(request, leg, decode_body, headers, rec)
    except ProxyError as err:
        rec.emit(err.type, err.status, err.message)
        return _error_response(err, rec.request_id)
    except ClientGone as gone:  # the leg in flight was closed on the way out
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


async def _prefill(
    proxy: Proxy,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rec: Record,
    allowed: float | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The prefill leg, on the next prefill that is up; one that cannot even
    be connected to (nothing was sent) is marked down and the next one tried.
    It ends within the ``allowed`` seconds the client waits (None: no limit)."""
    tried: set[str] = set()
    while True:
        leg = proxy.prefill_pool.pick(tried)
        assert leg is not None  # the loop ends before every one was tried
        try:
            with rec.leg(leg):
                return await proxy.prefill(leg.within(rec.left(allowed)), path, body, headers, rec)
        except ProxyError as err:
            tried.add(leg.url)
            if err.type != Failure.UNREACHABLE.type or len(tried) == len(proxy.prefills):
                raise
            proxy.prefill_pool.mark(leg.url, err.message)
            log.warning("prefill_retried", request_id=rec.request_id, failed=leg.url)


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


async def _health(request: web.Request) -> web.StreamResponse:
    """``GET /health``: 200 only when every backend answers its own ``/health``."""
    proxy = request.app[_PROXY]
    legs = [*proxy.prefills, *proxy.decodes]
    problems = [p for p in await asyncio.gather(*(proxy.probe(leg) for leg in legs)) if p]
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


@web.middleware
async def _authorized(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """With an API key, /v1/* answers 401 to a request without its bearer
    token (compared in constant time); /health stays open, as vLLM's."""
    key = request.app[_PROXY].config.api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            log.warning("proxy_unauthorized", path=request.path, remote=request.remote)
            why = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            return _error_response(ProxyError.of(Failure.UNAUTHORIZED, why))
    return await handler(request)


def make_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application.

    Serve it with ``handler_cancellation=True`` (as :func:`serve` and
    :func:`run_proxy` do), or a client's disconnect does not cancel its legs.
    """
    proxy = Proxy(config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_authorized])
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
