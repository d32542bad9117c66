"""Fuzz the transport boundary: what a peer sends, and the plans built from it.

Whatever arrives -- random bytes, valid messages with one field corrupted,
requests of any shape, plans against a peer whose regions do not match its
buffers -- the outcome is either a valid value or a typed rejection
(PeerProtocolError, InvalidPlan, RemoteRangeRejected) naming what is wrong.
Nothing crashes, the receiver keeps serving, and an accepted plan writes
exactly the requested destination blocks: not one byte elsewhere. The
channel itself (frames, ids, deadlines) is tested in test_control_channel.py.

Each fuzz test draws valid inputs as well as broken ones, checks an accepted
valid input against what it must parse to, and counts its outcomes
(``Outcomes``): a run in which some outcome -- accepted or rejected -- did not
occur in a real share of the examples fails, so no assert goes unreached.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st
from mooncake_helpers import receiver, requires_mooncake, wait_until
from structlog.testing import capture_logs

from kvguard.decode.service import ReceiverProcess
from transfer import (
    InvalidPlan,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerInfo,
    PeerProtocolError,
    Region,
    RemoteRangeRejected,
    build_plan,
)
from transfer.peer_protocol import (
    DIGEST_SIZE,
    MAX_ADDR,
    MAX_LIST_LEN,
    MAX_PEER_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_SESSION_ID_LEN,
    REPLY_OF,
    ChecksumRequest,
    ErrorReply,
    block_digest_bytes,
    decode_reply,
    parse_request,
    peer_info_from_message,
    peer_info_to_message,
)

LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=32)  # K and V: 2 buffers
SID = "10.0.0.2:15000"
INT64 = 1 << 63
REQUESTS = ("peer", "checksum", "zero", "ping")

# Integers where parsers and int64 arithmetic break.
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 7, 8, 255, 4096, 2**31, 2**32, INT64 - 1, INT64, 2**64 - 1, 2**64, -(2**63)]
)
WIRE_INTS = st.one_of(EDGE_INTS.filter(lambda i: i < 2**64), st.integers(-(2**63), 2**64 - 1))
WIRE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    WIRE_INTS,
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
)
WIRE_VALUES = st.recursive(
    WIRE_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


class Outcomes:
    """What each example of a fuzz test came to; ``require`` fails the test
    unless each outcome it names occurred in at least ``share`` of them.

    The strategies aim at a third to a half of each; hypothesis's draws are
    not independent, and over 30 random runs of 50 examples the rarest
    outcome of a test fell to 6-10%: 3% keeps a random run from failing on
    chance while still failing a strategy that stopped producing an outcome.
    """

    def __init__(self, *names: str) -> None:
        self.names = names
        self.seen: Counter[str] = Counter()

    def __call__(self, name: str) -> None:
        assert name in self.names, name
        event(name)
        self.seen[name] += 1

    def require(self, share: float = 0.03) -> None:
        total = sum(self.seen.values())
        low = {n: self.seen[n] for n in self.names if self.seen[n] < share * total}
        assert total and not low, f"outcomes {dict(self.seen)} of {total} examples: too few {low}"


SESSION_IDS = st.one_of(
    st.just(SID),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40),
)


@st.composite
def valid_peers(draw: st.DrawFn, layout: KVLayout | None = None) -> PeerInfo:
    """A PeerInfo the wire format must accept: any layout (or ``layout``),
    buffers in any address order with gaps, covered by one region, one region
    each, or those and decoys, anywhere below 2**63."""
    if layout is None:
        layout = KVLayout(
            draw(st.integers(1, 3)),
            draw(st.integers(1, 16)),
            draw(st.sampled_from([8, 32, 4096])),
            draw(st.booleans()),
        )
    size = layout.buffer_bytes
    offsets, at = [], 0
    for _ in range(layout.num_buffers):
        offsets.append(at)
        at += size + draw(st.sampled_from([0, 1, 64, 4096]))
    decoys = draw(st.integers(0, 3))
    span = at + decoys * 8192
    start = draw(st.one_of(st.integers(1, 1 << 44), st.just(MAX_ADDR - span)))
    bases = [start + o for o in offsets]
    if draw(st.booleans()):
        regions = [Region(start, offsets[-1] + size)]
    else:
        regions = [Region(b, size) for b in bases]
    regions += [Region(start + at + k * 8192, 16) for k in range(decoys)]
    return PeerInfo(
        draw(SESSION_IDS),
        tuple(draw(st.permutations(regions))),
        layout,
        block_base=tuple(draw(st.permutations(bases))),
    )


def _message_of(cache: KVCache) -> dict[str, Any]:
    return dict(msgspec.msgpack.decode(peer_info_to_message(cache.peer_info(SID))))


def _check_accepted(info: PeerInfo) -> None:
    """What a parsed peer message guarantees, checked independently of the parser."""
    sid = info.session_id
    assert 0 < len(sid) <= MAX_SESSION_ID_LEN and sid.isascii() and sid.isprintable()
    assert not any(c.isspace() for c in sid)
    spans = sorted((r.base, r.end) for r in info.regions)
    assert spans and all(type(b) is int and 1 <= b < e <= MAX_ADDR for b, e in spans)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    assert len(info.block_base) == info.layout.num_buffers
    size = info.layout.buffer_bytes
    buffers = sorted((b, b + size) for b in info.block_base)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(buffers))  # disjoint
    for base in info.block_base:
        assert type(base) is int
        assert any(r.contains(base, size) for r in info.regions)


# -- the peer message -----------------------------------------------------------------


@given(st.one_of(st.binary(max_size=300), st.text(max_size=30)))
@example(b"")
@example(b"\xff\xfe\x00")
@example(b"\xc1")  # never used in msgpack
@example(b"\x91" * 100_000)  # deep nesting
@example(b"\xdd\xff\xff\xff\xff")  # a 4-billion-item list header, no items
@example(b"x" * (MAX_PEER_MESSAGE_BYTES + 1))
def test_random_bytes_are_rejected_typed(raw: Any) -> None:
    with pytest.raises(PeerProtocolError):  # random bytes are never a valid message
        peer_info_from_message(raw)


@given(valid_peers())
def test_every_valid_peer_message_parses_to_exactly_what_was_sent(info: PeerInfo) -> None:
    got = peer_info_from_message(peer_info_to_message(info))
    assert got == info
    _check_accepted(got)


_PATHS = [
    ("kvguard",),
    ("type",),
    ("session_id",),
    ("layout",),
    ("layout", "num_layers"),
    ("layout", "num_blocks"),
    ("layout", "block_bytes"),
    ("layout", "kv_split"),
    ("regions",),
    ("regions", 0),
    ("regions", 0, 0),
    ("regions", 0, 1),
    ("regions", 1),
    ("block_base",),
    ("block_base", 0),
    ("block_base", 1),
]


def _set(msg: dict[str, Any], path: tuple[Any, ...], value: object) -> None:
    target: Any = msg
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


@st.composite
def corrupted_messages(draw: st.DrawFn) -> bytes:
    """A valid peer message with one to three fields replaced, dropped or added."""
    msg = dict(msgspec.msgpack.decode(peer_info_to_message(draw(valid_peers(LAYOUT)))))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "drop", "add", "shift", "copy"]))
        path = draw(st.sampled_from(_PATHS))
        try:
            if action == "replace":
                _set(msg, path, draw(WIRE_VALUES))
            elif action == "drop":
                target: Any = msg
                for key in path[:-1]:
                    target = target[key]
                del target[path[-1]]
            elif action == "add":
                msg[draw(st.text(max_size=8))] = draw(WIRE_VALUES)
            elif action == "copy":  # one base or region where another is: overlap
                msg["block_base"][1] = msg["block_base"][0]
            else:  # move an address or a length by a few bytes or a few blocks
                target = msg
                for key in path[:-1]:
                    target = target[key]
                if type(target[path[-1]]) is int:
                    target[path[-1]] += draw(st.sampled_from([-4096, -32, -1, 1, 32, 4096]))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier corruption removed the path: keep what we have
    try:
        return pack(msg)
    except OverflowError:  # shifted past what msgpack can carry
        assume(False)
        raise


# A peer message as it arrives: valid (with what it must parse to) or corrupted.
PEER_MESSAGES = st.one_of(
    valid_peers(LAYOUT).map(lambda info: (peer_info_to_message(info), info)),
    corrupted_messages().map(lambda raw: (raw, None)),
)


def test_corrupted_peer_messages_are_rejected_typed_or_valid() -> None:
    outcomes = Outcomes("accepted", "rejected")

    @given(PEER_MESSAGES)
    def run(arrival: tuple[bytes, PeerInfo | None]) -> None:
        raw, sent = arrival
        try:
            info = peer_info_from_message(raw)
        except PeerProtocolError as exc:
            assert sent is None, f"a valid message was refused: {exc}"
            assert str(exc)  # names what is wrong
            outcomes("rejected")
            return
        assert sent is None or info == sent
        _check_accepted(info)
        outcomes("accepted")

    run()
    outcomes.require()


def _spread(n: int, size: int) -> list[int]:
    return [(1 << 40) + i * 2 * size for i in range(n)]


DROP = object()  # a field to leave out
# Mutation of a valid message (LAYOUT: 2 buffers of 256 bytes) -> the exact error.
REJECTED: dict[str, tuple[dict[str, Any], str]] = {
    "bool as int": ({"kvguard": True}, r"Expected `int`, got `bool` - at `\$\.kvguard`"),
    "bool as block count": (
        {"layout": {"num_layers": 1, "num_blocks": True, "block_bytes": 32}},
        r"Expected `int`, got `bool` - at `\$\.layout\.num_blocks`",
    ),
    "wrong version": ({"kvguard": 2}, r"Invalid enum value 2 - at `\$\.kvguard`"),
    "float address": ({"block_base": [1.5, 4096]}, r"got `float` - at `\$\.block_base\[0\]`"),
    "str session id": ({"session_id": 12345}, r"Expected `str`, got `int` - at `\$\.session_id`"),
    "session id with space": ({"session_id": "10.0.0.2 :1"}, r"matching regex .* `\$\.session_id`"),
    "session id with newline": ({"session_id": "10.0.0.2:1\n"}, r"`\$\.session_id`"),
    "session id too long": ({"session_id": "h" * 300}, r"length <= 256 - at `\$\.session_id`"),
    "region not a pair": ({"regions": [[1, 2, 3]]}, r"length 2, got 3 - at `\$\.regions\[0\]`"),
    "zero region length": ({"regions": [[4096, 0]]}, r">= 1 - at `\$\.regions\[0\]\[1\]`"),
    "address past int64": (
        {"block_base": [INT64, 1]},
        r"<= 9223372036854775807 - at `\$\.block_base\[0\]`",
    ),
    "no regions": ({"regions": []}, r"length >= 1 - at `\$\.regions`"),
    "wrong type tag": ({"type": "command"}, r"Invalid value 'command' - at `\$\.type`"),
    "unknown field": ({"extra": 1}, r"unknown field `extra`"),
    "null layout": ({"layout": None}, r"Expected `object`, got `None` - at `\$\.layout`"),
    "missing field": ({"layout": DROP}, r"missing required field `layout`"),
    "huge list": (
        {"block_base": list(range(1, MAX_LIST_LEN + 2))},
        r"length <= 65536 - at `\$\.block_base`",
    ),
    "too few bases": ({"block_base": [1 << 40]}, r"1 block bases for 2 buffers"),
    "duplicate regions": (
        {"regions": [[1 << 40, 1 << 20], [1 << 40, 1 << 20]], "block_base": _spread(2, 256)},
        r"regions\[0\] and regions\[1\] overlap at 0x10000000000",
    ),
    "overlapping regions": (
        {"regions": [[1 << 40, 4096], [(1 << 40) + 4095, 4096]], "block_base": _spread(2, 256)},
        r"regions\[0\] and regions\[1\] overlap",
    ),
    "region past int64": ({"regions": [[INT64 - 8, 16]]}, r"regions\[0\] ends past 2\*\*63"),
    "buffers sharing one base": (
        {"regions": [[1 << 40, 1 << 20]], "block_base": [1 << 40, 1 << 40]},
        r"buffers\[0\] and buffers\[1\] overlap at 0x10000000000",
    ),
    "overlapping buffers": (
        {"regions": [[1 << 40, 1 << 20]], "block_base": [1 << 40, (1 << 40) + 255]},
        r"buffers\[0\] and buffers\[1\] overlap",
    ),
    "buffer outside every region": (
        {"regions": [[1 << 40, 256]], "block_base": [1 << 40, 1 << 41]},
        r"buffer 1 \[0x20000000000, \+0x100\) lies in no advertised region",
    ),
    "buffer straddling a region end": (
        {"regions": [[1 << 40, 300]], "block_base": [(1 << 40) + 100, 1 << 41]},
        r"buffer 0 .* lies in no advertised region",
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_each_malformed_peer_message_gets_its_exact_error(case: str) -> None:
    change, match = REJECTED[case]
    msg = {**_message_of(KVCache(LAYOUT)), **change}
    msg = {k: v for k, v in msg.items() if v is not DROP}
    with pytest.raises(PeerProtocolError, match=match) as info:
        peer_info_from_message(pack(msg))
    assert info.value.reason.name == "INVALID_REQUEST"


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"x" * (MAX_PEER_MESSAGE_BYTES + 1), r"is 1048577 bytes, limit 1048576"),
        (b"", r"not valid msgpack: Input data was truncated"),
        (b"\xc1", r"not valid msgpack: .*invalid opcode"),
        ("{}", r"must be bytes, got str"),
        (b"\x93\x01\x02\x03", r"Expected `object`, got `array`"),
    ],
)
def test_frames_that_are_not_a_message_get_their_exact_error(raw: Any, match: str) -> None:
    with pytest.raises(PeerProtocolError, match=match):
        peer_info_from_message(raw)


def test_truncated_and_padded_messages_are_rejected() -> None:
    good = peer_info_to_message(KVCache(LAYOUT).peer_info(SID))
    for cut in range(len(good)):
        with pytest.raises(PeerProtocolError, match=r"truncated|Expected|missing|length"):
            peer_info_from_message(good[:cut])
    with pytest.raises(PeerProtocolError, match="trailing characters"):
        peer_info_from_message(good + b"\x00")


def test_a_full_size_peer_message_parses_in_linear_time() -> None:
    """Issue 10: a 281 KB message took 260 s (every buffer against every region)."""
    size = 64
    decoys = [[(1 << 40) + 2 * i, 1] for i in range(38_000)]  # every buffer is past them
    bases = [(1 << 41) + i * size for i in range(MAX_LIST_LEN)]
    msg = {
        **_message_of(KVCache(LAYOUT)),
        "layout": {"num_layers": MAX_LIST_LEN // 2, "num_blocks": 1, "block_bytes": size},
        "regions": [*decoys, [1 << 41, size * MAX_LIST_LEN]],
        "block_base": bases,
    }
    raw = pack(msg)
    assert 900_000 < len(raw) <= MAX_PEER_MESSAGE_BYTES
    start = time.process_time()
    info = peer_info_from_message(raw)
    assert time.process_time() - start < 2.0  # ~0.2 s here; quadratic was hours
    assert len(info.block_base) == MAX_LIST_LEN
    msg["block_base"] = [1 << 41] * MAX_LIST_LEN  # and all at one base: refused as fast
    start = time.process_time()
    with pytest.raises(PeerProtocolError, match=r"buffers\[0\] and buffers\[1\] overlap"):
        peer_info_from_message(pack(msg))
    assert time.process_time() - start < 2.0


# -- requests to the receiver -----------------------------------------------------------


@st.composite
def request_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "shaped", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "random":
        return pack(draw(WIRE_VALUES))
    msg: dict[str, object] = {"cmd": draw(st.one_of(st.sampled_from(REQUESTS), WIRE_VALUES))}
    if draw(st.booleans()):
        msg["blocks"] = draw(
            st.one_of(st.lists(st.one_of(st.integers(-3, 12), WIRE_INTS), max_size=6), WIRE_VALUES)
        )
    if draw(st.booleans()):
        msg[draw(st.text(max_size=6))] = draw(WIRE_VALUES)
    return pack(msg)


VALID_REQUESTS = st.one_of(
    st.sampled_from([{"cmd": "peer"}, {"cmd": "zero"}, {"cmd": "ping"}]),
    st.lists(st.integers(0, LAYOUT.num_blocks - 1), max_size=8).map(
        lambda blocks: {"cmd": "checksum", "blocks": blocks}
    ),
)
# A request frame as it arrives: valid (with the request it is) or anything.
FRAMES = st.one_of(
    VALID_REQUESTS.map(lambda req: (pack(req), req)),
    request_frames().map(lambda frame: (frame, None)),
)


def test_requests_parse_or_are_rejected_typed() -> None:
    outcomes = Outcomes("accepted", "rejected")

    @given(FRAMES)
    def run(arrival: tuple[bytes, dict[str, Any] | None]) -> None:
        frame, sent = arrival
        try:
            req = parse_request(frame, num_blocks=LAYOUT.num_blocks)
        except PeerProtocolError as exc:
            assert sent is None, f"a valid request was refused: {exc}"
            outcomes("rejected")
            return
        tag = req.__struct_config__.tag
        assert tag in REQUESTS
        if isinstance(req, ChecksumRequest):
            assert all(type(b) is int and 0 <= b < LAYOUT.num_blocks for b in req.blocks)
        if sent is not None:
            assert tag == sent["cmd"]
            assert list(getattr(req, "blocks", [])) == sent.get("blocks", [])
        outcomes("accepted")

    run()
    outcomes.require()


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (pack({"cmd": "rm -rf"}), r"Invalid value 'rm -rf' - at `\$\.cmd`"),
        (pack({"cmd": "checksum", "blocks": [8]}), r"blocks\[0\] = 8 >= 8 blocks"),
        (pack({"cmd": "checksum", "blocks": [1, -1]}), r">= 0 - at `\$\.blocks\[1\]`"),
        (pack({"cmd": "checksum", "blocks": [True]}), r"got `bool` - at `\$\.blocks\[0\]`"),
        (pack({"cmd": "checksum", "blocks": "all"}), r"Expected `array`, got `str`"),
        (pack({"cmd": "checksum"}), r"missing required field `blocks`"),
        (pack({"cmd": "zero", "force": True}), r"unknown field `force`"),
        (pack({"cmd": "checksum", "blocks": [0] * (MAX_LIST_LEN + 1)}), r"length <= 65536"),
        (b"\x81\xa3cmd", r"truncated"),
        (b"\xff\xfe", r"Expected `object`, got `int`"),
        (b"x" * (MAX_REQUEST_BYTES + 1), r"request is 1048577 bytes, limit 1048576"),
    ],
)
def test_each_malformed_request_gets_its_exact_error(frame: bytes, match: str) -> None:
    with pytest.raises(PeerProtocolError, match=match):
        parse_request(frame, num_blocks=LAYOUT.num_blocks)


def _bare_receiver(layout: KVLayout = LAYOUT) -> Any:
    """A Receiver without an engine: ``handle`` only touches its cache."""
    from kvguard.decode.service import Receiver

    rx = object.__new__(Receiver)
    rx.cache = KVCache(layout)
    rx.cache.fill_seeded(5)
    rx.peer_info = rx.cache.peer_info(SID)
    return rx


def test_receiver_handle_never_crashes_and_touches_nothing() -> None:
    rx = _bare_receiver()
    outcomes = Outcomes("answered", "refused")

    @given(FRAMES)
    def run(arrival: tuple[bytes, dict[str, Any] | None]) -> None:
        frame, sent = arrival
        rx.cache.fill_seeded(5)
        before = [t.clone() for t in rx.cache.tensors]
        reply = decode_reply(rx.handle(frame))  # always a schema-valid reply
        if isinstance(reply, ErrorReply):
            assert sent is None, f"a valid request was refused: {reply}"
            assert reply.error == "PeerProtocolError", reply  # typed, never a stray exception
            outcomes("refused")
        else:
            req = msgspec.msgpack.decode(frame)  # accepted, so it is a request
            tag = reply.__struct_config__.tag
            assert tag == req["cmd"]  # a reply carries its request's tag
            if tag == "checksum":
                assert reply.digests == block_digest_bytes(rx.cache, req["blocks"])
            outcomes("answered")
        zeroed = not isinstance(reply, ErrorReply) and reply.__struct_config__.tag == "zero"
        for old, new in zip(before, rx.cache.tensors, strict=True):
            assert torch.equal(new, torch.zeros_like(new) if zeroed else old)

    run()
    outcomes.require()


# -- plans against hostile peers ----------------------------------------------------------


@pytest.fixture(scope="module")
def local() -> Iterator[tuple[LocalBackend, KVCache, KVCache]]:
    src = KVCache(LAYOUT)
    src.fill_seeded(9)
    dst = KVCache(LAYOUT)
    backend = LocalBackend(workers=1)
    backend.register_source(src)
    backend.register_peer(SID, dst)
    yield backend, src, dst
    backend.close()


@st.composite
def hostile_peers(draw: st.DrawFn, dst: KVCache, how: str | None = None) -> PeerInfo:
    """The destination's real PeerInfo with its regions and bases tampered with
    (``how``, or drawn); "honest" and "lie" leave the bases alone otherwise."""
    real = dst.peer_info(SID)
    size = LAYOUT.buffer_bytes
    blk = LAYOUT.block_bytes
    regions = list(real.regions)
    tamper = how is None
    if how is None:
        how = draw(st.sampled_from(["honest", "lie", "shrink", "split", "drop", "garbage"]))
    if how == "shrink":  # advertise less than was registered
        i = draw(st.integers(0, len(regions) - 1))
        lo = draw(st.integers(0, 4)) * blk
        hi = draw(st.integers(0, 4)) * blk
        assume(lo + hi < size)
        regions[i] = Region(regions[i].base + lo, size - lo - hi)
    elif how == "split":  # a hole in the middle of a buffer
        i = draw(st.integers(0, len(regions) - 1))
        cut = draw(st.integers(1, LAYOUT.num_blocks - 1)) * blk
        r = regions.pop(i)
        regions += [Region(r.base, cut - blk), Region(r.base + cut, size - cut)]
    elif how == "drop" and len(regions) > 1:
        regions.pop(draw(st.integers(0, len(regions) - 1)))
    elif how == "garbage":
        regions.append(Region(draw(EDGE_INTS), draw(EDGE_INTS)))
    bases: list[Any] = list(real.block_base)  # a float among them is part of the attack
    if how == "lie":  # advertise memory it does not have, and a buffer in it
        i = draw(st.integers(0, len(bases) - 1))
        bases[i] = max(real.block_base) + 16 * size
        regions.append(Region(bases[i], size))
    elif tamper and draw(st.booleans()):
        i = draw(st.integers(0, len(bases) - 1))
        bases[i] = draw(
            st.one_of(
                st.sampled_from([-blk, -1, blk, 1, size]).map(lambda d: bases[i] + d),
                EDGE_INTS,
                st.floats(allow_nan=False),
            )
        )
    return PeerInfo(SID, tuple(regions), LAYOUT, block_base=tuple(bases))


BLOCK_IDS = st.one_of(st.integers(-2, LAYOUT.num_blocks + 1), EDGE_INTS, st.booleans(), st.floats())


# Mostly a real batch limit; the rest are what must be refused.
LIMITS = st.one_of(st.integers(1, 4), st.integers(-1, 3), EDGE_INTS, st.just(True))


def test_plans_against_hostile_peers_write_only_requested_blocks(
    local: tuple[LocalBackend, KVCache, KVCache],
) -> None:
    outcomes = Outcomes("refused by the plan", "refused by the backend", "written")

    @settings(max_examples=2 * settings.default.max_examples)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        _plan_against_a_hostile_peer(local, data, outcomes)

    run()
    outcomes.require()


def _plan_against_a_hostile_peer(
    local: tuple[LocalBackend, KVCache, KVCache], data: st.DataObject, outcomes: Outcomes
) -> None:
    backend, src, dst = local
    # "honest": a true peer and a good request, which must be written; "lie":
    # the peer advertises a buffer it does not have, which the backend must
    # refuse; "hostile": anything, refused typed or written exactly.
    kind = data.draw(st.sampled_from(["honest", "lie", "hostile", "hostile"]), label="kind")
    peer = data.draw(hostile_peers(dst, None if kind == "hostile" else kind), label="peer")
    low = 0 if kind == "hostile" else 1
    n = data.draw(st.integers(low, LAYOUT.num_blocks + low), label="n")
    if kind != "hostile" or data.draw(st.booleans(), label="well-formed ids"):
        dst_blocks: list[Any] = data.draw(st.permutations(range(LAYOUT.num_blocks)))[:n]
        src_blocks: list[Any] = data.draw(
            st.lists(
                st.integers(0, LAYOUT.num_blocks - 1),
                min_size=len(dst_blocks),
                max_size=len(dst_blocks),
            )
        )
    else:
        dst_blocks = data.draw(st.lists(BLOCK_IDS, max_size=n))
        src_blocks = data.draw(st.lists(BLOCK_IDS, max_size=n + 1))
    limit = data.draw(LIMITS if kind == "hostile" else st.integers(1, 4), label="limit")
    try:
        plan = build_plan(src, peer, src_blocks, dst_blocks, max_batch_entries=limit)
    except InvalidPlan as exc:  # RemoteRangeRejected included
        assert kind == "hostile", f"a {kind} plan was refused: {exc}"
        assert exc.reason.name == "INVALID_REQUEST"
        outcomes("refused by the plan")
        return
    # Accepted: every entry is a real, in-region, int64-safe range...
    for batch in plan.batches:
        assert 1 <= len(batch.lengths) <= limit
        for d, length in zip(batch.dst, batch.lengths, strict=True):
            assert type(d) is int and d > 0 and d + length <= INT64
            assert any(r.contains(d, length) for r in peer.regions)
    # ...and running it writes exactly the requested blocks where the peer said
    # they are, and not one byte anywhere else.
    for t in dst.tensors:
        t.zero_()
    op = backend.submit(plan)
    real_regions = dst.regions()
    if not all(
        any(r.contains(d, n) for r in real_regions)
        for b in plan.batches
        for d, n in zip(b.dst, b.lengths, strict=True)
    ):
        # The peer advertised memory it does not have: only it can be hurt, and
        # the engine (here the local backend) refuses the write, typed.
        with pytest.raises(RemoteRangeRejected):
            op.result(timeout=10.0)
        assert kind != "honest"
        outcomes("refused by the backend")
        return
    assert kind != "lie", "a write to a buffer the peer does not have went through"
    op.result(timeout=10.0)
    expected = [torch.zeros_like(t) for t in dst.tensors]
    real = dst.buffer_bases()
    for i, base in enumerate(peer.block_base):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            addr = base + d * LAYOUT.block_bytes
            # The real buffer holding it (the check above: there is exactly one).
            (j,) = [k for k, b in enumerate(real) if b <= addr < b + LAYOUT.buffer_bytes]
            off = addr - real[j]
            expected[j][off : off + LAYOUT.block_bytes] = src.block(i, s)
    for want, got in zip(expected, dst.tensors, strict=True):
        assert torch.equal(want, got), "a byte outside the requested blocks changed"
    outcomes("written")


GOOD_IDS = st.lists(st.integers(0, LAYOUT.num_blocks - 1), min_size=1, max_size=6, unique=True)
BAD_IDS = st.one_of(  # one thing wrong: none, a duplicate, one out of range
    st.just([]),
    GOOD_IDS.map(lambda b: [*b, b[0]]),
    GOOD_IDS.map(lambda b: [*b, LAYOUT.num_blocks]),
    GOOD_IDS.map(lambda b: [-1, *b]),
)
# What arrives and is asked for, named by the outcome it must have (any: a
# corrupted message, which the parser may refuse or accept).
PLAN_INPUTS = st.one_of(
    st.tuples(
        st.just("planned"),
        valid_peers(LAYOUT).map(lambda i: (peer_info_to_message(i), i)),
        GOOD_IDS,
    ),
    st.tuples(
        st.just("refused by the plan"),
        valid_peers(LAYOUT).map(lambda i: (peer_info_to_message(i), i)),
        BAD_IDS,
    ),
    st.tuples(st.just("any"), corrupted_messages().map(lambda raw: (raw, None)), GOOD_IDS),
)


def test_plans_from_parsed_messages_stay_inside_advertised_regions() -> None:
    src = KVCache(LAYOUT)
    outcomes = Outcomes("planned", "refused by the parser", "refused by the plan")

    @given(PLAN_INPUTS)
    def run(case: tuple[str, tuple[bytes, PeerInfo | None], list[int]]) -> None:
        want, (raw, _), dst_blocks = case
        try:
            peer = peer_info_from_message(raw)
        except PeerProtocolError:
            assert want == "any"
            outcomes("refused by the parser")
            return
        try:
            plan = build_plan(src, peer, list(range(len(dst_blocks))), dst_blocks)
        except InvalidPlan as exc:
            assert want != "planned", f"a good plan was refused: {exc}"
            outcomes("refused by the plan")
            return
        assert want != "refused by the plan", dst_blocks
        assert plan.num_blocks == len(dst_blocks)
        for batch in plan.batches:
            for d, length in zip(batch.dst, batch.lengths, strict=True):
                assert d > 0 and d + length <= INT64
                assert any(r.contains(d, length) for r in peer.regions)
        outcomes("planned")

    run()
    outcomes.require()


# -- a real receiver process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_receiver() -> Iterator[ReceiverProcess]:
    with receiver(LAYOUT) as proc:
        yield proc


@requires_mooncake
@pytest.mark.mooncake
def test_real_receiver_answers_garbage_typed_and_keeps_serving(
    live_receiver: ReceiverProcess,
) -> None:
    outcomes = Outcomes("answered", "refused")

    @settings(max_examples=25)
    @given(FRAMES)
    def run(arrival: tuple[bytes, dict[str, Any] | None]) -> None:
        frame, sent = arrival
        with contextlib.suppress(PeerProtocolError):  # a valid zero would wipe the shared cache
            tag = parse_request(frame, num_blocks=LAYOUT.num_blocks).__struct_config__.tag
            assume(tag != "zero")
        try:
            reply = live_receiver.send_raw(frame, timeout=10.0)
        except PeerProtocolError as exc:
            assert sent is None, f"a valid request was refused: {exc}"
            assert "decode service error PeerProtocolError" in str(exc)
            outcomes("refused")
        else:  # a valid request, answered with its own kind of reply
            req = parse_request(frame, num_blocks=LAYOUT.num_blocks)
            assert set(reply) == set(REPLY_OF[type(req)].__struct_fields__), reply
            if isinstance(req, ChecksumRequest):
                assert len(reply["digests"]) == DIGEST_SIZE * len(req.blocks)
            outcomes("answered")
        assert live_receiver.request({"cmd": "ping"}, timeout=10.0)["pid"] == live_receiver.pid

    run()
    outcomes.require()


@pytest.mark.parametrize(
    "base", [INT64 - 128, INT64, 2**64 - 1024, -1024, 0, 1000.5], ids=lambda b: repr(b)
)
def test_peer_addresses_past_int64_are_refused_typed(base: int | float) -> None:
    """Plans compute addresses in int64: a peer advertising buffers at or past 2**63
    is refused by the wire format, and a PeerInfo built some other way is refused
    by the plan -- never overflowed, wrapped or truncated."""
    src = KVCache(LAYOUT)
    size = LAYOUT.buffer_bytes
    bases: tuple[Any, ...] = (base, base + size)  # a float is part of the attack
    peer = PeerInfo(SID, (Region(int(base), 2 * size),), LAYOUT, block_base=bases)
    with pytest.raises(RemoteRangeRejected, match=r"\[1, 2\*\*63\)"):
        build_plan(src, peer, [0, 1], [0, 1])
    msg = _message_of(src)
    msg["regions"], msg["block_base"] = [[int(base), 2 * size]], list(bases)
    with pytest.raises(
        PeerProtocolError, match=r"at `\$\.(regions|block_base)\[|ends past 2\*\*63"
    ):
        peer_info_from_message(pack(msg))


# -- the address the engine is given ---------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "wildcard"),
    [
        ("0.0.0.0", True),
        ("0.0.0.0:17777", True),
        ("::", True),
        ("[::]:17777", True),
        ("", True),
        ("127.0.0.1", False),
        ("127.0.0.1:17777", False),
        ("10.241.3.2", False),
        ("::1", False),
        ("[::1]:17777", False),
        ("decode-0.internal:17777", False),
    ],
)
def test_wildcard_addresses_are_recognised(address: str, wildcard: bool) -> None:
    from transfer.mooncake import is_wildcard

    assert is_wildcard(address) is wildcard


@requires_mooncake
@pytest.mark.mooncake
def test_backend_on_a_wildcard_address_warns_loudly(all_levels: None) -> None:
    from transfer.mooncake import MooncakeBackend

    with capture_logs() as logs:
        MooncakeBackend("127.0.0.1", max_inflight=1).close()
        assert not [r for r in logs if r["event"] == "wildcard_address"]
        MooncakeBackend("0.0.0.0", max_inflight=1).close()
    (warning,) = [r for r in logs if r["event"] == "wildcard_address"]
    assert warning["log_level"] == "warning" and warning["local_ip"] == "0.0.0.0"
    assert "no authentication" in warning["problem"]


@requires_mooncake
@pytest.mark.mooncake
def test_receiver_on_a_wildcard_address_warns_on_stderr_and_still_serves() -> None:
    with receiver(KVLayout(1, 4, 64), ip="0.0.0.0") as proc:
        assert proc.peer.session_id.startswith("0.0.0.0:")
        assert proc.request({"cmd": "ping"})["pid"] == proc.pid
        assert wait_until(lambda: "wildcard_address" in proc.stderr_tail(20_000), 5.0)
