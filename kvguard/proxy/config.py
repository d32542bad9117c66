"""The proxy's settings and their command-line options.

Imports neither aiohttp nor anything heavy: ``kvguard --help`` builds its
parser from :func:`add_arguments`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_DECODE_TIMEOUT_S",
    "DEFAULT_HEALTH_INTERVAL_S",
    "DEFAULT_HEALTH_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_PREFILL_TIMEOUT_S",
    "ProxyConfig",
    "add_arguments",
    "config_from_args",
]

# Where --api-key comes from when not given (as vLLM's VLLM_API_KEY).
API_KEY_ENV = "KVGUARD_API_KEY"
# The prefill leg when the client states no time of its own: the OpenAI
# SDKs' default timeout, so a client on defaults and the proxy give up
# together. Under load a prefill queues behind others for minutes and still
# completes; a shorter proxy deadline would fail it (issue 33: 24 of 64 at
# 32 concurrent requests with 30 s). A client's X-Stainless-Timeout bounds
# both legs (protocol.client_timeout).
DEFAULT_PREFILL_TIMEOUT_S = 600.0
# A decode streams up to max_tokens tokens, its KV load included.
DEFAULT_DECODE_TIMEOUT_S = 300.0
# Establishing a TCP connection to a backend (within each leg's deadline).
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# One /health probe of one backend, and how often each is probed.
DEFAULT_HEALTH_TIMEOUT_S = 5.0
DEFAULT_HEALTH_INTERVAL_S = 2.0
# Any body the proxy holds in memory: a client's request, a prefill's reply,
# a non-streamed decode reply, one server-sent event.
DEFAULT_MAX_BODY_BYTES = 32 << 20


def _base_url(role: str, url: str) -> str:
    """``http(s)://HOST:PORT`` without a trailing slash, or ValueError naming ``url``."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"{role} URL {url!r}: {exc}") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"{role} URL {url!r}: expected http://HOST:PORT (or https), no path")
    if port is None:
        raise ValueError(f"{role} URL {url!r}: no port")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class ProxyConfig:
    """Where the proxy sends each leg and how long each may take.

    ``prefill_urls`` and ``decode_urls`` are non-empty and normalised to
    ``http(s)://HOST:PORT``; every timeout is finite and positive. A bad
    value raises ValueError naming it, and no config exists.
    """

    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    # The whole prefill leg: connect, send, the complete JSON reply.
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    # The whole decode leg: connect, send, the last byte of the (streamed) reply.
    decode_timeout_s: float = DEFAULT_DECODE_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # How often each backend's /health is probed; one that fails is skipped.
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    # Non-empty: /v1/* needs ``Authorization: Bearer <api_key>`` (401 else),
    # passed on to the servers, which may check the same key (vLLM --api-key).
    api_key: str = field(default="", repr=False)
    # A streamed completion's first token is the prefill's, sent as soon as
    # it answers (``first_token``); False: the decode's, after the handover.
    early_first_token: bool = True

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if isinstance(urls, str) or not urls:
                raise ValueError(f"{role} URLs: need a non-empty list, got {urls!r}")
            normal = tuple(_base_url(role, u) for u in urls)
            object.__setattr__(self, f"{role}_urls", normal)
        for f in fields(self):
            if f.name.endswith(("_timeout_s", "_interval_s")):
                value = getattr(self, f.name)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{f.name} must be a number, got {value!r}")
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"{f.name} must be finite and > 0, got {value!r}")
        n = self.max_body_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"max_body_bytes must be a positive integer, got {n!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvguard proxy``."""
    for flag, role in (("--prefill", "prefill"), ("--decode", "decode")):
        parser.add_argument(
            flag,
            dest=f"{role}_urls",
            nargs="+",
            action="extend",
            required=True,
            metavar="URL",
            help=f"{role} servers, http://HOST:PORT, used round-robin (repeatable)",
        )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="listen port (default 8000; 0: any free port)"
    )
    for flag, default, what in (
        ("--prefill-timeout-s", DEFAULT_PREFILL_TIMEOUT_S, "deadline of the prefill leg"),
        (
            "--decode-timeout-s",
            DEFAULT_DECODE_TIMEOUT_S,
            "deadline of the decode leg, stream included",
        ),
        ("--connect-timeout-s", DEFAULT_CONNECT_TIMEOUT_S, "TCP connect to a backend"),
        ("--health-timeout-s", DEFAULT_HEALTH_TIMEOUT_S, "one backend's /health probe"),
        (
            "--health-interval-s",
            DEFAULT_HEALTH_INTERVAL_S,
            "how often each backend's /health is probed (one that fails is skipped)",
        ),
    ):
        parser.add_argument(
            flag, type=float, default=default, metavar="S", help=f"{what} (default %(default)s)"
        )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help="largest request, reply or event held in memory (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
        "unset: none), passed on to the servers",
    )
    parser.add_argument(
        "--no-early-first-token",
        dest="early_first_token",
        action="store_false",
        help="stream a completion's first token from the decode, after the KV handover, "
        "instead of the prefill's token as soon as the prefill answers",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="structlog level on stderr; one event per request (default info)",
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The :class:`ProxyConfig` of parsed ``kvguard proxy`` options (ValueError if bad)."""
    names: Sequence[str] = [f.name for f in fields(ProxyConfig)]
    return ProxyConfig(**{name: getattr(args, name) for name in names})
