"""The early first token: a streamed completion's first token is the prefill's, sent at once.

A two-step PD proxy asks the prefill for one token and throws it away; the
client's first token then waits for the KV transfer and the decode's first
step. Here, for a streamed ``/v1/completions`` request of one choice, the
proxy sends the client the prefill's token as its first event as soon as
the prefill answers, and the decode continues from it: its prompt is the
prompt's token ids and that token, its ``max_tokens`` one less, and its
connector loads the prompt's KV (the prefill's ``kvguard_tokens``) and
computes the one token's KV in its first step, as it would have computed
the prompt's last. The handover leaves the client's time to first token.

Only where the client cannot tell: every field of the body must be in
:data:`NEUTRAL` (where it must have a value that no token of the output
depends on: one choice, no logprobs, no stop strings, no penalty or seed
that counts the output) or :data:`CONTINUABLE` (the rest carry over to a
decode that starts one token later). Anything else -- chat (whose prompt
cannot be given as token ids), a grammar, a field this table does not
know -- takes the two-step path unchanged. So does a prefill that is not
kvguard's (no ``kvguard_tokens``), whose token ended the request, or whose
token has no text of its own (it ends inside a character) from a server
that returns text.

The decode's events are rewritten so that the client sees one completion:
the first event's id and creation time, its prompt's token ids once, and
usage counted as the client's request (the prompt one token shorter, the
completion one token longer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvguard.vllm.params import TEXT, TOKENS

from .protocol import COMPLETIONS, only_choice

__all__ = ["CONTINUABLE", "NEUTRAL", "FirstToken", "eligible", "prefill_asks"]

# Fields whose value must be one of these: any other makes the output depend
# on where it starts (n > 1: one token for n choices; logprobs: the prefill's
# are not asked; stop strings can span the first token; penalties and a seed
# count the output tokens, which the decode's would lack the first of).
NEUTRAL: Final[Mapping[str, tuple[object, ...]]] = {
    "stream": (True,),
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "stop": (None, []),
    "seed": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "suffix": (None,),
    # The decode's detokenizer starts after the first token: with special
    # tokens kept and unspaced it would not know the first was one.
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
}
# Fields that carry over to the decode as they are (``max_tokens`` and
# ``min_tokens`` one less; ``prompt`` becomes token ids).
CONTINUABLE: Final = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "min_tokens",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "return_token_ids",
        "user",
        "priority",
        "cache_salt",
        "request_id",
        "kv_transfer_params",
    }
)
# Fields the decode drops: its prompt is the prefill's token ids, already
# truncated and with the tokenizer's special tokens.
_PROMPT_FIELDS: Final = ("truncate_prompt_tokens", "add_special_tokens")


def eligible(path: str, body: Mapping[str, Any]) -> bool:
    """Whether the client's ``body`` to ``path`` may get the prefill's first token."""
    if path != COMPLETIONS:
        return False
    for key, value in body.items():
        if key in NEUTRAL:
            if not any(value == ok and type(value) is type(ok) for ok in NEUTRAL[key]):
                return False
        elif key not in CONTINUABLE and key not in _PROMPT_FIELDS:
            return False
    prompt, most, least = body.get("prompt"), body.get("max_tokens"), body.get("min_tokens")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
    )
    # max_tokens stated: vLLM's default (16) would count from the decode's
    # start. A min_tokens above it is the decode's 400, which the two steps
    # return before any event.
    return (
        body.get("stream") is True
        and one_prompt
        and type(most) is int
        and most >= 2
        and (least is None or (type(least) is int and least <= most))
    )


def prefill_asks(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body for an eligible request: its prompt and token as ids."""
    return {**body, "return_token_ids": True}


def _ints(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


@dataclass(frozen=True)
class FirstToken:
    """The prefill's sampled token and what the client's first event says."""

    id: str  # the completion's (both legs carry the proxy's X-Request-Id)
    created: int
    model: str
    prompt: list[int]  # the prompt's token ids, as the prefill computed them
    token: int
    text: str

    @classmethod
    def of(cls, reply: Mapping[str, Any], params: Mapping[str, Any]) -> FirstToken | None:
        """The token of a prefill ``reply`` the decode can continue from, else None."""
        choice = only_choice(reply)
        if choice is None:
            return None
        prompt, token = _ints(choice.get("prompt_token_ids")), _ints(choice.get("token_ids"))
        text = choice.get("text")
        if (
            prompt is None
            or token is None
            or len(token) != 1
            or choice.get("finish_reason") != "length"  # "stop": the request ends here
            or params.get(TOKENS) != len(prompt)  # a prefill that says what it holds
            or not isinstance(text, str)
            # vLLM holds back a token that ends inside a character (its text
            # is empty); a decode starting after it would print the prompt.
            or (not text and params.get(TEXT) is not False)
            or not isinstance(reply.get("id"), str)
            or type(reply.get("created")) is not int
            or not isinstance(reply.get("model"), str)
        ):
            return None
        return cls(reply["id"], reply["created"], reply["model"], prompt, token[0], text)

    def event(self, body: Mapping[str, Any]) -> bytes:
        """The client's first server-sent event, as vLLM streams a completion's."""
        ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": self.prompt if ids else None,
            "token_ids": [self.token] if ids else None,
        }
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if _continuous_usage(body):
            chunk["usage"] = _usage(len(self.prompt), 1)
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def decode_body(self, body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """The decode leg's body: continue after this token, on the prompt's KV."""
        out = {k: v for k, v in body.items() if k not in _PROMPT_FIELDS}
        out["prompt"] = [*self.prompt, self.token]
        out["kv_transfer_params"] = dict(params)
        out["max_tokens"] = body["max_tokens"] - 1  # an int >= 2 (``eligible``)
        if type(least := body.get("min_tokens")) is int and least > 0:
            out["min_tokens"] = least - 1
        return out

    def rewrite(self, events: bytes) -> bytes:
        """Whole decode events as the client's completion: this id and
        creation time, no second prompt, usage counted from the client's prompt."""
        out = []
        for event in events.split(b"\n\n"):
            out.append(self._event(event) if event.startswith(b"data: {") else event)
        return b"\n\n".join(out)

    def _event(self, event: bytes) -> bytes:
        try:
            chunk = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event  # not the decode's JSON: passed on as it came
        if not isinstance(chunk, dict) or "error" in chunk:
            return event
        if "id" in chunk:
            chunk["id"], chunk["created"] = self.id, self.created
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict) and "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None  # the first event had them
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if type(prompt) is int and type(completion) is int:
                usage |= _usage(prompt - 1, completion + 1)
        return b"data: " + json.dumps(chunk).encode()


def _continuous_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return (
        isinstance(options, dict)
        and bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats"))
    )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
