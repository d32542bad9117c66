"""Messages between a kvguard prefill sender and a decode receiver.

One ZeroMQ frame each, msgpack through msgspec, strictly typed and bounded.
The decode side's DEALER talks to the prefill side's ROUTER::

    decode -> prefill   Push    push request R's KV into these blocks of my load L
    decode -> prefill   Abort   give up load L of R (answered by a Result),
                                or never load R (not answered)
    decode -> prefill   Renew   a request that will load R still queues here:
                                keep holding R (not answered)
    prefill -> decode   Result  load L of R is over: ok, or why not; sent only
                                once nothing of the prefill writes L's blocks
                                (kvguard released the transfer: terminal AND
                                quiesced), or none ever will (never started,
                                refused, unknown); an aborted load is
                                remembered, so a push read later is refused

The peer advertisement inside ``Push`` is ``transfer.peer_protocol``'s
``PeerMessage``, checked by ``peer_info_of`` like every other peer.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from kvguard.decode.control import tcp_address, tcp_url
from transfer.checksum import DIGEST_BYTES
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import MAX_LIST_LEN, PeerMessage

__all__ = [
    "MAX_FRAME_BYTES",
    "Abort",
    "DecodeMessage",
    "Push",
    "Renew",
    "Result",
    "check",
    "decode_from_decode",
    "decode_from_prefill",
    "encode",
    "ids_of",
    "prefill_url",
    "truncate",
]

MAX_FRAME_BYTES: Final = 2 << 20  # a Push with MAX_LIST_LEN blocks and regions fits
_MAX_ID: Final = 512

_RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_ID)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
_Heads = Annotated[int, msgspec.Meta(ge=0, le=(1 << 16))]


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class Push(_Message, frozen=True, tag="push"):
    """Push the prefill request ``request_id``'s KV into ``blocks`` of ``peer``.

    ``load_id`` names the decode's own request: several decode requests may
    load one prefill request (n > 1), each with its own blocks, and each is
    answered by a ``Result`` naming its load, so no load is marked loaded by
    another's transfer. ``blocks`` are the decode's block ids, in token
    order; they receive the last ``len(blocks)`` blocks of the prefill's
    request (a decode-side prefix hit needs fewer). ``expires_at`` is wall
    clock (``time.time()``): the prefill starts nothing for this push after
    it, however late the push is read (a frozen prefill reads it on thaw).
    ``compat`` is the decode's KV layout fingerprint; the prefill refuses a
    push whose layout is not its own. ``first_head`` and ``head_count`` are
    the KV heads the decode rank holds (tensor parallel, ``ranks``); the
    prefill rank writes the heads both hold, or whole blocks where they hold
    the same (``head_count`` 0: whatever the prefill holds).
    """

    request_id: _RequestId
    load_id: _RequestId
    blocks: Annotated[list[_BlockId], msgspec.Meta(max_length=MAX_LIST_LEN)]
    peer: PeerMessage
    expires_at: Annotated[float, msgspec.Meta(gt=0)]
    compat: Annotated[str, msgspec.Meta(max_length=256)] = ""
    # Loads of ``request_id`` this decode asked for together (its n > 1
    # children scheduled in one step): the hold waits for all of them.
    group: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST_LEN)] = 1
    first_head: _Heads = 0
    head_count: _Heads = 0
    # Send a ``transfer.checksum`` digest of the bytes written with an ok Result.
    verify: bool = False


class Abort(_Message, frozen=True, tag="abort"):
    """The decode gave up ``load_id`` of ``request_id`` (answered by a
    ``Result`` once nothing writes its blocks), or with ``load_id`` empty,
    one decode request of ``request_id``'s group will never load it (not
    answered). ``group``: the group's size as the decode knows it (the
    client's n), so a forget read before any push does not end a hold that
    the group's other requests will still load."""

    request_id: _RequestId
    load_id: Annotated[str, msgspec.Meta(max_length=_MAX_ID)] = ""
    group: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST_LEN)] = 1


class Renew(_Message, frozen=True, tag="renew"):
    """A decode request that will load ``request_id`` still waits in the
    decode's queue: keep holding it (up to the prefill's own cap). Not answered."""

    request_id: _RequestId


class Result(_Message, frozen=True, tag="result"):
    """``load_id`` of ``request_id`` is over and nothing of the prefill's
    writes its blocks any more: ``ok``, or why not. ``digest``: for a push
    that asked to verify, the ``transfer.checksum`` digest of exactly the
    bytes the prefill wrote (empty otherwise, or when it could not make one)."""

    request_id: _RequestId
    load_id: _RequestId
    ok: bool
    reason: Annotated[str, msgspec.Meta(max_length=64)] = ""
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    digest: Annotated[bytes, msgspec.Meta(max_length=DIGEST_BYTES)] = b""


class _Ids(msgspec.Struct, frozen=True):
    """What a reply needs from a message that failed validation."""

    request_id: _RequestId
    load_id: Annotated[str, msgspec.Meta(max_length=_MAX_ID)] = ""


DecodeMessage = Push | Abort | Renew

_encoder: Final = msgspec.msgpack.Encoder()
_from_decode: Final = msgspec.msgpack.Decoder(DecodeMessage)
_from_prefill: Final = msgspec.msgpack.Decoder(Result)
_ids: Final = msgspec.msgpack.Decoder(_Ids)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _check(raw: bytes) -> None:
    if len(raw) > MAX_FRAME_BYTES:
        raise PeerProtocolError(f"frame of {len(raw)} bytes, limit {MAX_FRAME_BYTES}")


def decode_from_decode(raw: bytes) -> Push | Abort | Renew:
    """Parse what a decode side sent; PeerProtocolError names what is wrong."""
    _check(raw)
    try:
        return _from_decode.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerProtocolError(f"bad message from decode: {exc}") from exc


def ids_of(raw: bytes) -> tuple[str, str] | None:
    """(request id, load id) of a message that failed ``decode_from_decode``,
    when they parse, so the prefill can answer the load instead of leaving
    the decode to wait out its deadline."""
    if len(raw) > MAX_FRAME_BYTES:
        return None
    try:
        ids = _ids.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return (ids.request_id, ids.load_id) if ids.load_id else None


def decode_from_prefill(raw: bytes) -> Result:
    _check(raw)
    try:
        return _from_prefill.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerProtocolError(f"bad message from prefill: {exc}") from exc


def check(msg: Push | Abort | Renew) -> None:
    """What the prefill will check of ``msg`` (ids, sizes), checked before
    it is sent: PeerProtocolError names what is wrong."""
    decode_from_decode(encode(msg))


def prefill_url(endpoint: str) -> str:
    """A prefill's control endpoint from a request's parameters (untrusted):
    ``tcp://HOST:PORT`` or ``HOST:PORT`` only, parsed by ``tcp_address``;
    ValueError names anything else (an ``inproc://`` or ``ipc://`` link would
    never report a drop, so its loads could stay fenced for good)."""
    return tcp_url(*tcp_address(endpoint))


def truncate(text: str, limit: int = 1024) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
