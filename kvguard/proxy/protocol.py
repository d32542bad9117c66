"""The two-step PD protocol and the proxy's errors, without any I/O.

The bodies are vLLM's toy PD proxy's
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` in vLLM's
repository), so a server set up for that proxy works behind this one and
the reverse:

* prefill: the client's body with ``stream`` false, ``max_tokens`` 1
  (``max_completion_tokens`` 1 too where vLLM reads it), no ``stream_options``,
  ``min_tokens`` or ``min_completion_tokens`` (a one-token request cannot keep
  them), and :data:`PREFILL_KV_TRANSFER_PARAMS` as ``kv_transfer_params``;
* decode: the client's body unchanged but for ``kv_transfer_params``, which
  are exactly the prefill reply's.

Two additions, both about kvguard's own keys or n > 1:

* the client's ``kvguard_*`` keys of ``kv_transfer_params``
  (``kvguard_deadline_s``) reach the prefill, which echoes what it applied;
* a client's ``n`` > 1: the prefill computes the prompt once (``n`` 1: its
  KV is the same for every choice, and n held copies would pin n times the
  blocks), and the decode's ``kv_transfer_params`` say ``kvguard_loads`` n,
  so it knows how many of its requests load that one (vLLM's API server adds
  the n engine requests one at a time, and the engine may step between).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any, Final

# The kv_transfer_params keys the proxy sets are kvguard.vllm.params' (one
# module owns every key, and imports no vLLM): what every prefill is asked,
# the client's keys that reach the prefill (the rest are the proxy's to set),
# and how many decode requests load one prefill request.
from kvguard.vllm.params import CLIENT_PREFIX as CLIENT_KV_PREFIX
from kvguard.vllm.params import LOADS as KV_LOADS
from kvguard.vllm.params import PREFILL_KV_TRANSFER_PARAMS, client_problem

__all__ = [
    "CHAT_COMPLETIONS",
    "CLIENT_KV_PREFIX",
    "COMPLETIONS",
    "KV_LOADS",
    "PREFILL_DROPPED_FIELDS",
    "PREFILL_KV_TRANSFER_PARAMS",
    "Failure",
    "ProxyError",
    "decode_request",
    "json_type",
    "parse_client_body",
    "prefill_request",
    "upstream_http_error",
]

COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"

PREFILL_DROPPED_FIELDS: Final = ("stream_options", "min_tokens", "min_completion_tokens")


def parse_client_body(data: bytes) -> dict[str, Any]:
    """A client's request body, or a BAD_REQUEST :class:`ProxyError` saying what is wrong."""
    try:
        body = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ProxyError.of(Failure.BAD_REQUEST, f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError.of(
            Failure.BAD_REQUEST, f"request body must be a JSON object, got {json_type(body)}"
        )
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ProxyError.of(
            Failure.BAD_REQUEST,
            f"kv_transfer_params must be a JSON object or null, got {json_type(params)}",
        )
    if params and (problem := client_problem(params)):
        raise ProxyError.of(Failure.BAD_REQUEST, problem)
    return body


def prefill_request(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body for a client's ``body`` to ``path``."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    client_params = body.get("kv_transfer_params") or {}
    out["kv_transfer_params"] = {
        **PREFILL_KV_TRANSFER_PARAMS,
        **{k: v for k, v in client_params.items() if k.startswith(CLIENT_KV_PREFIX)},
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if _choices(body) > 1:
        out["n"] = 1
    # Chat reads max_completion_tokens before max_tokens.
    if path == CHAT_COMPLETIONS or "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_request(
    body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]
) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefill's ``kv_transfer_params``."""
    params = dict(kv_transfer_params)
    if (n := _choices(body)) > 1:
        params[KV_LOADS] = n
    return {**body, "kv_transfer_params": params}


def _choices(body: Mapping[str, Any]) -> int:
    """The client's ``n``; 1 where it is absent or not an int (the decode
    server rejects a bad one, naming it)."""
    n = body.get("n", 1)
    return n if type(n) is int else 1


class Failure(enum.Enum):
    """Why the proxy ended a request: the HTTP status and OpenAI error type it answers.

    One table, so a status never disagrees with its type. An upstream's own
    HTTP error is passed through with its status and type instead.
    """

    BAD_REQUEST = (400, "BadRequestError")  # not a JSON object, or bad kvguard_* keys
    UNAUTHORIZED = (401, "AuthenticationError")  # no or another bearer key (--api-key)
    TOO_LARGE = (413, "RequestTooLargeError")  # over max_body_bytes
    UNREACHABLE = (502, "UpstreamUnreachableError")  # no connection
    DISCONNECTED = (502, "UpstreamDisconnectedError")  # closed before the reply ended
    BAD_RESPONSE = (502, "UpstreamProtocolError")  # a reply the protocol cannot use
    UNHEALTHY = (503, "ServiceUnavailableError")  # /health: a backend is not
    TIMEOUT = (504, "UpstreamTimeoutError")  # no connection or reply within the deadline

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def type(self) -> str:
        return self.value[1]


class ProxyError(Exception):
    """A request the proxy ends with an OpenAI-style error body.

    ``code`` in the body is the HTTP status, as vLLM's own errors have it.
    """

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message

    @classmethod
    def of(cls, failure: Failure, message: str) -> ProxyError:
        return cls(failure.status, failure.type, message)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": None,
                "code": self.status,
            }
        }

    def sse_event(self) -> bytes:
        """The error as a server-sent event, as vLLM streams its own mid-stream errors."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"

    def __repr__(self) -> str:
        return f"ProxyError({self.status}, {self.type!r}, {self.message!r})"


_JSON_TYPES: Final = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type (for error messages)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


# How much of a non-JSON error body an error message quotes.
_QUOTE_CHARS: Final = 500


def upstream_http_error(where: str, status: int, data: bytes) -> ProxyError:
    """A backend's HTTP error, passed through: its status, its type, its message after ``where``.

    vLLM answers ``{"error": {"message", "type", ...}}``; its HTTP layer
    ``{"detail": ...}``; anything else is quoted as text.
    """
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    error = reply.get("error") if isinstance(reply, dict) else None
    type_ = "UpstreamError"
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message = error["message"]
        if isinstance(error.get("type"), str):
            type_ = error["type"]
    elif isinstance(reply, dict) and "detail" in reply:
        detail = reply["detail"]
        message = detail if isinstance(detail, str) else json.dumps(detail)
    else:
        message = data.decode(errors="replace").strip()[:_QUOTE_CHARS]
    # vLLM answers some failures with an empty message (a chat without a tokenizer)
    message = message.strip() or f"HTTP {status}, no message"
    if status < 400:  # a status the protocol has no use for (redirect, 204): not an error to copy
        return ProxyError.of(Failure.BAD_RESPONSE, f"{where}: unexpected HTTP {status}: {message}")
    return ProxyError(status, type_, f"{where}: {message}")
