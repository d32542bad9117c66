"""Messages between a kvguard prefill sender and a decode receiver.

One ZeroMQ frame each, msgpack through msgspec, strictly typed and bounded.
The decode side's DEALER talks to the prefill side's ROUTER::

    decode -> prefill   Push    push request R's KV into these blocks of mine
    decode -> prefill   Abort   forget R (the decode gave up or was aborted)
    prefill -> decode   Result  R is over: ok, or why not; sent only after
                                kvguard released R's blocks (terminal AND
                                quiesced), so no write can follow it

The peer advertisement inside ``Push`` is ``transfer.peer_protocol``'s
``PeerMessage``, checked by ``peer_info_of`` like every other peer.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from transfer.errors import PeerProtocolError
from transfer.peer_protocol import MAX_LIST_LEN, PeerMessage

__all__ = [
    "MAX_FRAME_BYTES",
    "Abort",
    "DecodeMessage",
    "Push",
    "Result",
    "decode_from_decode",
    "decode_from_prefill",
    "encode",
]

MAX_FRAME_BYTES: Final = 2 << 20  # a Push with MAX_LIST_LEN blocks and regions fits
_MAX_ID: Final = 512

_RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class Push(_Message, frozen=True, tag="push"):
    """Push the prefill request ``request_id``'s KV into ``blocks`` of ``peer``.

    ``blocks`` are the decode's block ids, in token order; they receive the
    last ``len(blocks)`` blocks of the prefill's request (a decode-side prefix
    hit needs fewer). ``deadline_s``: seconds the decode still waits.
    """

    request_id: _RequestId
    blocks: Annotated[list[_BlockId], msgspec.Meta(max_length=MAX_LIST_LEN)]
    peer: PeerMessage
    deadline_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]


class Abort(_Message, frozen=True, tag="abort"):
    request_id: _RequestId


class Result(_Message, frozen=True, tag="result"):
    request_id: _RequestId
    ok: bool
    reason: Annotated[str, msgspec.Meta(max_length=64)] = ""
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


DecodeMessage = Push | Abort

_encoder: Final = msgspec.msgpack.Encoder()
_from_decode: Final = msgspec.msgpack.Decoder(DecodeMessage)
_from_prefill: Final = msgspec.msgpack.Decoder(Result)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _check(raw: bytes) -> None:
    if len(raw) > MAX_FRAME_BYTES:
        raise PeerProtocolError(f"frame of {len(raw)} bytes, limit {MAX_FRAME_BYTES}")


def decode_from_decode(raw: bytes) -> Push | Abort:
    """Parse what a decode side sent; PeerProtocolError names what is wrong."""
    _check(raw)
    try:
        return _from_decode.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerProtocolError(f"bad message from decode: {exc}") from exc


def decode_from_prefill(raw: bytes) -> Result:
    _check(raw)
    try:
        return _from_prefill.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerProtocolError(f"bad message from prefill: {exc}") from exc


def truncate(text: str, limit: int = 1024) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
