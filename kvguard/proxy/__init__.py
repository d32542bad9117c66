"""kvguard's PD proxy: one OpenAI endpoint in front of prefill and decode servers.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` runs in two legs,
the protocol of vLLM's toy PD proxy (:mod:`kvguard.proxy.protocol`):

1. prefill (round-robin over ``prefill_urls``): the body with
   ``max_tokens`` 1, ``stream`` false and ``kv_transfer_params``
   ``{"do_remote_decode": true, ...}`` plus the client's ``kvguard_*`` keys;
   its reply must carry ``kv_transfer_params`` unless its one token ended
   the request (then the decode computes the prompt itself);
2. decode (round-robin over ``decode_urls``): the client's body with exactly
   those ``kv_transfer_params``; its reply goes back to the client, streamed
   as server-sent events when the decode streams, one JSON document otherwise.

A streamed completion's first event is the prefill's token, sent as soon as
the prefill answers, and the decode continues after it
(:mod:`kvguard.proxy.first_token`; ``--no-early-first-token`` turns it off).

Both legs carry the same ``X-Request-Id`` (a fresh one per request, also
returned to the client) and the client's ``Authorization`` header.
``GET /v1/models`` is a decode's, passed through; ``GET /health`` is 200 only
when every backend answers its own ``/health`` with 200.

Interface (stable; the server-mode tests drive it)::

    kvguard proxy --prefill URL [URL ...] --decode URL [URL ...]
                  [--host 127.0.0.1] [--port 8000] [--prefill-timeout-s 600]
                  [--decode-timeout-s 300] [--connect-timeout-s 5]
                  [--health-timeout-s 5] [--max-body-bytes 33554432]
                  [--api-key KEY] [--no-early-first-token] [--log-level info]

    prints "kvguard proxy: listening on http://HOST:PORT" on stdout once it
    listens (--port 0: any free port), serves until SIGINT/SIGTERM, exit 0;
    exit 2 on a bad option or an address it cannot listen on.

    from kvguard.proxy import ProxyConfig, make_app, run_proxy, serve
    config = ProxyConfig(["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
    async with serve(config) as url: ...  # in a running loop, port 0
    run_proxy(config, "127.0.0.1", 8000)  # blocking, until SIGINT/SIGTERM
    make_app(config)                      # the aiohttp app; serve it with
                                          # handler_cancellation=True

Errors are OpenAI-style, ``{"error": {"message", "type", "param": null,
"code": <status>}}``, the message starting with the leg and its URL
(``prefill http://...: ``), and each leg has a deadline:

=========================================  ======  ==========================
what went wrong                            status  type
=========================================  ======  ==========================
body not a JSON object, or a client's      400     BadRequestError
``kvguard_*`` key bad (``params``)
``/v1/*`` without ``--api-key``'s bearer    401     AuthenticationError
body over ``max_body_bytes``               413     RequestTooLargeError
a leg: cannot connect                      502     UpstreamUnreachableError
a leg: no connection / reply in time       504     UpstreamTimeoutError
a leg: HTTP error                          its     its (message passed through)
a leg: connection closed mid-reply         502     UpstreamDisconnectedError
prefill: no ``kv_transfer_params``,        502     UpstreamProtocolError
any leg: a reply too large or not JSON
``/health``: a backend is not healthy      503     ServiceUnavailableError
=========================================  ======  ==========================

A decode that fails after its 200 went out (mid-stream) ends the stream with
the error as one more event, then ``data: [DONE]``, as vLLM does with its own
mid-stream errors. A client that disconnects cancels the leg in flight: its
connection to the backend is closed, so vLLM aborts the request. One
structlog event per request, ``proxy_request``: request id, outcome (``ok``,
an error type, ``client_disconnected``), status, each leg's URL, status and
seconds. The library configures no logging; ``kvguard proxy`` does.

Importing this package loads nothing else; aiohttp only when a name of
:mod:`kvguard.proxy.server` is first used.
"""

from typing import TYPE_CHECKING

from lifecycle._lazy import lazy_exports

# The public names, once: module -> what it defines. Imported on first use
# (PEP 562): the command line builds its parser from ``config`` without
# importing aiohttp.
_EXPORTS = {
    ".config": ("ProxyConfig",),
    ".protocol": ("Failure", "ProxyError"),
    ".server": ("make_app", "run_proxy", "serve"),
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_lazy.py: they agree)
    from .config import ProxyConfig as ProxyConfig
    from .protocol import Failure as Failure
    from .protocol import ProxyError as ProxyError
    from .server import make_app as make_app
    from .server import run_proxy as run_proxy
    from .server import serve as serve
