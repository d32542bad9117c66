"""Every ``kv_transfer_params`` key kvguard reads or writes, parsed and checked here once.

``kv_transfer_params`` is the dict a request carries through vLLM, the
client and the PD proxy (vLLM's toy proxy or ``kvguard.proxy``)::

    client -> prefill   {"do_remote_decode": true, "kvguard_deadline_s": 5, ...}
    prefill -> client   prefill_reply(): {"do_remote_prefill": true,
                        "kvguard_endpoint": ..., "kvguard_request_id": ...,
                        "kvguard_deadline_s": ..., "kvguard_hold_s": ...,
                        "kvguard_tp_size": ..., "kvguard_tokens": ...,
                        "kvguard_prompt_digest": ..., "kvguard_text": ...}
    proxy -> decode     those, plus "kvguard_loads": n for a client's n > 1

Each key is a constant here; no other module of the connector or the proxy
spells one. A value comes from a client or a peer and is untrusted:
``load_ask`` turns a decode's into a ``LoadAsk`` (a ``Source`` and its
numbers), where a value that is not what the key needs gets the server's
default (``kvguard_deadline_s``, ``kvguard_hold_s``), is ignored with a log
line naming the key and value (``kvguard_loads``), or, where no load can
work without it (``kvguard_tp_size``), becomes the ``Source``'s
``problem``, which names the key and value and fails the load when the
worker reads it.

No vLLM here: the proxy imports the keys it sets from this module.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import structlog

__all__ = [
    "CLIENT_KEYS",
    "CLIENT_PREFIX",
    "DEADLINE_S",
    "DO_REMOTE_DECODE",
    "DO_REMOTE_PREFILL",
    "ENDPOINT",
    "HOLD_S",
    "LOADS",
    "MAX_LOADS",
    "MAX_TP_SIZE",
    "PREFILL_KV_TRANSFER_PARAMS",
    "PROMPT_DIGEST",
    "REQUEST_ID",
    "TEXT",
    "TOKENS",
    "TP_SIZE",
    "LoadAsk",
    "Source",
    "client_problem",
    "deadline_s",
    "load_ask",
    "loaded_tokens",
    "loading_started",
    "prefill_reply",
    "prompt_digest",
    "source_of",
    "wants_hold",
    "wants_load",
]

_log = structlog.get_logger("kvguard.vllm")

# vLLM's own keys (every P/D connector's): the prefill is asked to keep its
# KV for a remote decode; the decode is told its KV comes from a remote prefill.
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
# What every prefill is asked (vLLM's toy PD proxy's body, so either proxy
# works with either set of servers): compute the prompt, hold its KV for a
# remote decode, and say in the reply where to find it.
PREFILL_KV_TRANSFER_PARAMS: Final[Mapping[str, Any]] = MappingProxyType(
    {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
# kvguard's keys. A client's keys with this prefix reach the prefill through
# a proxy; the rest are the proxy's and the servers' to set.
CLIENT_PREFIX: Final = "kvguard_"
ENDPOINT: Final = "kvguard_endpoint"  # prefill: its rank 0's control endpoint
REQUEST_ID: Final = "kvguard_request_id"  # prefill: the request that holds the KV
DEADLINE_S: Final = "kvguard_deadline_s"  # client: asked; prefill: what it used
HOLD_S: Final = "kvguard_hold_s"  # prefill: how long it holds unasked (a decode renews)
TP_SIZE: Final = "kvguard_tp_size"  # prefill: its tensor parallel size
# prefill: how many prompt tokens its held KV covers. A decode whose prompt
# is longer (the proxy's early first token: the prompt and the prefill's
# sampled token) loads these and computes the rest.
TOKENS: Final = "kvguard_tokens"
# prefill: ``prompt_digest`` of those tokens, so that a decode loads only
# KV computed for its own prompt.
PROMPT_DIGEST: Final = "kvguard_prompt_digest"
# prefill: whether its server returns text (false: --skip-tokenizer-init,
# every token's text is empty). A proxy reads an empty text from a server
# that does as a token that ends inside a character.
TEXT: Final = "kvguard_text"
# proxy -> decode: how many decode requests load the prefill request (the
# client's n): vLLM may step between adding n > 1 children, so a group
# cannot be counted by the children seen so far.
LOADS: Final = "kvguard_loads"

# The kvguard_* keys a client may set (a proxy answers any other with HTTP 400).
CLIENT_KEYS: Final = frozenset({DEADLINE_S})

MAX_LOADS: Final = 1024
MAX_TP_SIZE: Final = 1024
_MIN_RENEW_S: Final = 0.1
_QUOTE: Final = 64  # how much of a bad value a message quotes


def _quote(value: object) -> str:
    return repr(value)[:_QUOTE]


@dataclass(frozen=True, slots=True)
class Source:
    """A prefill request as a decode names it: whom its load asks."""

    endpoint: str  # the prefill rank 0's control endpoint, as given (``ranks`` parses it)
    request_id: str  # the prefill's request id
    tp_size: int  # the prefill's tensor parallel size, in [1, MAX_TP_SIZE]; 0 iff problem
    problem: str = ""  # why no load can use it, naming the key and value; "" if one can

    @property
    def key(self) -> tuple[str, str]:
        """The prefill request itself, whatever its TP size says."""
        return self.endpoint, self.request_id


@dataclass(frozen=True, slots=True)
class LoadAsk:
    """A decode request's ``kv_transfer_params`` that ask for a load, parsed."""

    source: Source
    deadline_s: float  # the load's deadline from allocation, > 0, capped by the server
    renew_s: float  # how often a request queued here renews the prefill's hold, >= 0.1
    declared: int  # the client's n (``kvguard_loads``) when > 1; else 0


def wants_hold(params: Mapping[str, Any] | None) -> bool:
    """Prefill: does the request ask for its KV to be held for a remote decode?"""
    return bool(params and params.get(DO_REMOTE_DECODE))


def wants_load(params: Mapping[str, Any] | None) -> bool:
    """Decode: does the request ask to load its KV from a kvguard prefill, and
    has it not started that load yet?"""
    return bool(
        params
        and params.get(DO_REMOTE_PREFILL)
        and isinstance(params.get(ENDPOINT), str)
        and isinstance(params.get(REQUEST_ID), str)
    )


def prompt_digest(tokens: Sequence[int]) -> str:
    """The token ids a prefill's KV is of, as a 128-bit BLAKE2b hex digest
    (each id 8 bytes little-endian, so both hosts agree whatever their order)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def loaded_tokens(params: Mapping[str, Any], prompt: Sequence[int]) -> int:
    """Decode: how many tokens of its ``prompt`` to load from the prefill; 0
    where the prefill's KV is of another prompt.

    The prefill's ``kvguard_tokens``; the whole prompt where it is absent (a
    client or proxy that sends the prefill's prompt as it was). A value that
    is not an int in [1, len(prompt)] cannot be what a prefill of this
    prompt held: logged, and the whole prompt asked for, as without it.
    Those tokens must be the ones the prefill computed
    (``kvguard_prompt_digest``): else the KV would be another prompt's,
    whole blocks of it in the right places, which no check of the bytes can
    tell. The mismatch is logged and nothing loaded: the decode computes
    the prompt itself, and the prefill is told to let go.
    """
    if not prompt:  # embeddings: nothing to load by token
        return 0
    tokens = params.get(TOKENS, len(prompt))
    if not (type(tokens) is int and 0 < tokens <= len(prompt)):
        _log.warning(
            "kv_tokens_ignored", key=TOKENS, value=_quote(tokens), want=f"int in [1, {len(prompt)}]"
        )
        tokens = len(prompt)
    digest = params.get(PROMPT_DIGEST)
    if digest is not None and digest != prompt_digest(prompt[:tokens]):
        _log.warning("kv_prompt_mismatch", key=PROMPT_DIGEST, value=_quote(digest), tokens=tokens)
        return 0
    return tokens


def loading_started(params: MutableMapping[str, Any]) -> None:
    """Decode: the request's one load started (or never will): ``wants_load``
    is False from now on."""
    params[DO_REMOTE_PREFILL] = False


def deadline_s(params: Mapping[str, Any], default: float, cap: float) -> float:
    """A client's ``kvguard_deadline_s``, capped by ``cap`` (it pins blocks on
    both engines); ``default`` if it is not a number > 0. The prefill returns
    the value it used, so both sides agree on it."""
    value = params.get(DEADLINE_S, default)
    try:
        asked = float(value)
    except (TypeError, ValueError):
        asked = math.nan
    if asked > 0:  # nan is not
        return min(asked, cap)
    _log.warning("kv_deadline_ignored", key=DEADLINE_S, value=_quote(value), used=default)
    return default


def client_problem(params: Mapping[str, Any]) -> str:
    """What is wrong with a client's own ``kvguard_*`` keys, "" if nothing: a
    key only a server sets, or a deadline that is not a finite number > 0.
    ``kvguard proxy`` answers it with HTTP 400; a server asked directly uses
    its default deadline (``deadline_s``) and ignores the rest."""
    for key, value in params.items():
        if not (isinstance(key, str) and key.startswith(CLIENT_PREFIX)):
            continue
        if key not in CLIENT_KEYS:
            mine = ", ".join(sorted(CLIENT_KEYS))
            return f"kv_transfer_params[{_quote(key)}] is the servers' to set (a client's: {mine})"
        if not (type(value) in (int, float) and math.isfinite(value) and value > 0):
            return f"kv_transfer_params[{key!r}] must be a number > 0, got {_quote(value)}"
    return ""


def _renew_s(params: Mapping[str, Any], hold_s: float) -> float:
    """A third of the prefill's ``kvguard_hold_s`` (``hold_s`` if it is not a
    finite number), at least ``_MIN_RENEW_S``."""
    try:
        hold = float(params.get(HOLD_S, hold_s))
    except (TypeError, ValueError):
        hold = hold_s
    if not math.isfinite(hold):
        hold = hold_s
    return max(hold / 3, _MIN_RENEW_S)


def source_of(params: Mapping[str, Any]) -> Source:
    """Whom a request that ``wants_load`` loads from; a TP size that is not
    an int in [1, MAX_TP_SIZE] is the source's ``problem``."""
    tp = params.get(TP_SIZE, 1)
    if type(tp) is int and 0 < tp <= MAX_TP_SIZE:
        return Source(params[ENDPOINT], params[REQUEST_ID], tp)
    problem = f"{TP_SIZE} from the prefill must be an int in [1, {MAX_TP_SIZE}], got {_quote(tp)}"
    return Source(params[ENDPOINT], params[REQUEST_ID], 0, problem)


def _declared(params: Mapping[str, Any]) -> int:
    loads = params.get(LOADS, 1)
    if type(loads) is int and 0 < loads <= MAX_LOADS:
        return loads if loads > 1 else 0
    # A hint: ignored, named, the load goes on as an undeclared one.
    _log.warning(
        "kv_loads_ignored", key=LOADS, value=_quote(loads), want=f"int in [1, {MAX_LOADS}]"
    )
    return 0


def load_ask(
    params: Mapping[str, Any], *, deadline: float, max_deadline: float, hold: float
) -> LoadAsk:
    """Parse the params of a request that ``wants_load``, once: ``deadline``,
    ``max_deadline`` and ``hold`` are the server's settings in seconds."""
    return LoadAsk(
        source_of(params),
        deadline_s(params, deadline, max_deadline),
        _renew_s(params, hold),
        _declared(params),
    )


def prefill_reply(
    *,
    endpoint: str,
    request_id: str,
    deadline: float,
    hold: float,
    tp_size: int,
    prompt: Sequence[int],
    text: bool = True,
) -> dict[str, Any]:
    """What a prefill that holds the KV of a request's ``prompt`` returns: the decode's params."""
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        ENDPOINT: endpoint,
        REQUEST_ID: request_id,
        DEADLINE_S: deadline,
        HOLD_S: hold,
        TP_SIZE: tp_size,
        TOKENS: len(prompt),
        PROMPT_DIGEST: prompt_digest(prompt),
        TEXT: text,
    }
