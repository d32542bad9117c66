"""The connector's wire messages (kvguard.vllm.protocol): bounded, typed, strict.

Anything read from a peer is untrusted: a frame over the limit, a field of
the wrong type or range, or an unknown field is a PeerProtocolError naming
what is wrong, and a push that fails validation still yields the ids its
answer needs when they parse.
"""

from __future__ import annotations

import msgspec
import pytest

from kvguard.vllm.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Push,
    Renew,
    Result,
    decode_from_decode,
    decode_from_prefill,
    encode,
    ids_of,
    truncate,
)
from transfer import KVCache, KVLayout, LocalBackend
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import peer_message_of


@pytest.fixture(scope="module")
def peer() -> object:
    backend = LocalBackend(workers=1)
    try:
        info = backend.register_peer("decode:1", KVCache(KVLayout(1, 4, 64, kv_split=False)))
        return peer_message_of(info)
    finally:
        backend.close()


def test_every_message_round_trips(peer: object) -> None:
    push = Push("r1", "d1", [3, 1], peer, 1e9, "f32/2x4", 2)  # type: ignore[arg-type]
    for msg in (push, Abort("r1", "d1"), Abort("r1"), Renew("r1")):
        assert decode_from_decode(encode(msg)) == msg
    res = Result("r1", "d1", False, "timeout", "late")
    assert decode_from_prefill(encode(res)) == res


def frame(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kind": "push", "request_id": "r", "load_id": "d", "blocks": [-1]}, "blocks"),
        ({"kind": "abort", "request_id": ""}, "request_id"),
        ({"kind": "renew", "request_id": "r", "extra": 1}, "extra"),
        ({"kind": "nope", "request_id": "r"}, "nope"),
        ({"kind": "abort", "request_id": "r" * 513}, "request_id"),
    ],
)
def test_a_bad_decode_message_is_a_peer_protocol_error_naming_the_field(
    fields: dict[str, object], why: str
) -> None:
    with pytest.raises(PeerProtocolError, match="bad message from decode") as info:
        decode_from_decode(frame(**fields))
    assert why in str(info.value)


def test_push_expiry_and_group_are_bounded(peer: object) -> None:
    good = msgspec.to_builtins(Push("r", "d", [1], peer, 5.0))  # type: ignore[arg-type]
    for key, bad in (("expires_at", 0.0), ("group", 0), ("group", 1 << 20)):
        with pytest.raises(PeerProtocolError, match=key):
            decode_from_decode(msgspec.msgpack.encode({**good, key: bad}))


def test_a_bad_prefill_message_is_a_peer_protocol_error() -> None:
    with pytest.raises(PeerProtocolError, match=r"bad message from prefill.*load_id"):
        decode_from_prefill(frame(kind="result", request_id="r", ok=True))
    with pytest.raises(PeerProtocolError, match="bad message from prefill"):
        decode_from_prefill(b"\xc1")


@pytest.mark.parametrize("parse", [decode_from_decode, decode_from_prefill])
def test_a_frame_over_the_limit_is_refused_before_parsing(parse: object) -> None:
    with pytest.raises(PeerProtocolError) as info:
        parse(b"\x00" * (MAX_FRAME_BYTES + 1))  # type: ignore[operator]
    assert str(info.value) == f"frame of {MAX_FRAME_BYTES + 1} bytes, limit {MAX_FRAME_BYTES}"
    with pytest.raises(PeerProtocolError, match="bad message"):  # at the limit: parsed
        parse(b"\x00" * MAX_FRAME_BYTES)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (frame(kind="push", request_id="r1", load_id="d1", blocks="x"), ("r1", "d1")),
        (frame(kind="push", request_id="r1"), None),  # no load to answer
        (frame(kind="push", request_id="r1", load_id=""), None),
        (frame(kind="push", request_id="", load_id="d1"), None),
        (frame(kind="push", request_id=7, load_id="d1"), None),
        (b"\xc1", None),
        (frame(request_id="r1", load_id="d1", pad="x" * MAX_FRAME_BYTES), None),
    ],
)
def test_ids_of_recovers_only_ids_that_parse(raw: bytes, want: tuple[str, str] | None) -> None:
    assert ids_of(raw) == want


def test_truncate_keeps_short_text_and_marks_the_cut() -> None:
    assert truncate("abc", 3) == "abc"
    assert truncate("abcd", 3) == "..."
    assert truncate("abcdefgh", 6) == "abc..."
    assert truncate("x" * 1024) == "x" * 1024
    assert truncate("x" * 1025) == "x" * 1021 + "..."


def test_ids_of_reads_a_frame_exactly_at_the_limit() -> None:
    base = len(frame(request_id="r1", load_id="d1", pad="")) - 1 + 5  # str32 header
    raw = frame(request_id="r1", load_id="d1", pad="x" * (MAX_FRAME_BYTES - base))
    assert len(raw) == MAX_FRAME_BYTES
    assert ids_of(raw) == ("r1", "d1")
