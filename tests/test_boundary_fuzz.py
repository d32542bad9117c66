"""Fuzz the transport boundary: what a peer sends, and the plans built from it.

Whatever arrives -- random bytes, valid messages with one field corrupted,
command lines of any shape, plans against a peer whose regions do not match
its buffers -- the outcome is either a valid value or a typed rejection
(PeerProtocolError, InvalidPlan, RemoteRangeRejected). Nothing crashes, the
receiver keeps serving, and an accepted plan writes exactly the requested
destination blocks: not one byte elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from mooncake_helpers import receiver, requires_mooncake, wait_until
from structlog.testing import capture_logs

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
    COMMANDS,
    MAX_MESSAGE_BYTES,
    MAX_SESSION_ID_LEN,
    parse_command,
    peer_info_from_message,
    peer_info_to_message,
)
from transfer.receiver import ReceiverProcess

LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=32)  # K and V: 2 buffers
SID = "10.0.0.2:15000"
INT64 = 1 << 63

# Integers where parsers and int64 arithmetic break.
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 7, 8, 255, 4096, 2**31, 2**32, INT64 - 1, INT64, 2**64 - 1, 2**64, -(2**63)]
)
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    EDGE_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def _message_of(cache: KVCache) -> dict[str, Any]:
    return dict(json.loads(peer_info_to_message(cache.peer_info(SID))))


def _check_accepted(info: PeerInfo) -> None:
    """What a parsed peer message guarantees, checked independently of the parser."""
    sid = info.session_id
    assert 0 < len(sid) <= MAX_SESSION_ID_LEN and sid.isascii() and sid.isprintable()
    assert not any(c.isspace() for c in sid)
    spans = sorted((r.base, r.end) for r in info.regions)
    assert spans and all(type(b) is int and 1 <= b < e <= 2**64 for b, e in spans)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    assert len(info.block_base) == info.layout.num_buffers
    size = info.layout.buffer_bytes
    for base in info.block_base:
        assert type(base) is int
        assert any(r.contains(base, size) for r in info.regions)


# -- the peer message -----------------------------------------------------------------


@given(st.one_of(st.binary(max_size=300), st.text(max_size=300)))
@example(b"")
@example(b"\xff\xfe\x00")
@example("[" * 100_000)  # deep nesting
@example('{"kvguard": 1e999}')
@example("x" * (MAX_MESSAGE_BYTES + 1))
def test_random_bytes_are_rejected_typed(raw: str | bytes) -> None:
    try:
        info = peer_info_from_message(raw)
    except PeerProtocolError:
        return
    _check_accepted(info)  # pragma: no cover -- random bytes are never a valid message


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
def corrupted_messages(draw: st.DrawFn) -> str:
    """A valid peer message with one to three fields replaced, dropped or added."""
    msg = _message_of(KVCache(LAYOUT))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "drop", "add", "shift"]))
        path = draw(st.sampled_from(_PATHS))
        try:
            if action == "replace":
                _set(msg, path, draw(JSON_VALUES))
            elif action == "drop":
                target: Any = msg
                for key in path[:-1]:
                    target = target[key]
                del target[path[-1]]
            elif action == "add":
                msg[draw(st.text(max_size=8))] = draw(JSON_VALUES)
            else:  # move an address or a length by a few bytes or a few blocks
                target = msg
                for key in path[:-1]:
                    target = target[key]
                if type(target[path[-1]]) is int:
                    target[path[-1]] += draw(st.sampled_from([-4096, -32, -1, 1, 32, 4096]))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier corruption removed the path: keep what we have
    return json.dumps(msg)


@given(corrupted_messages())
def test_corrupted_peer_messages_are_rejected_typed_or_valid(raw: str) -> None:
    try:
        info = peer_info_from_message(raw)
    except PeerProtocolError as exc:
        assert str(exc)  # names what is wrong
        return
    _check_accepted(info)


# -- receiver commands ------------------------------------------------------------------


@st.composite
def command_lines(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.sampled_from(["random", "shaped", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "random":
        return json.dumps(draw(JSON_VALUES))
    msg: dict[str, object] = {
        "cmd": draw(st.one_of(st.sampled_from(sorted(COMMANDS)), JSON_VALUES))
    }
    if draw(st.booleans()):
        msg["blocks"] = draw(
            st.one_of(st.lists(st.one_of(st.integers(-3, 12), EDGE_INTS), max_size=6), JSON_VALUES)
        )
    if draw(st.booleans()):
        msg["id"] = draw(st.one_of(st.integers(-2, 2**64), JSON_VALUES))
    if draw(st.booleans()):
        msg[draw(st.text(max_size=6))] = draw(JSON_VALUES)
    return json.dumps(msg)


@given(command_lines())
def test_commands_parse_or_are_rejected_typed(line: str | bytes) -> None:
    try:
        command = parse_command(line, num_blocks=LAYOUT.num_blocks)
    except PeerProtocolError:
        return
    assert command.cmd in COMMANDS
    assert all(type(b) is int and 0 <= b < LAYOUT.num_blocks for b in command.blocks)
    assert command.id is None or (type(command.id) is int and 0 <= command.id < INT64)
    if "blocks" not in COMMANDS[command.cmd]:
        assert command.blocks == ()


def _bare_receiver() -> Any:
    """A Receiver without an engine: ``handle`` and ``serve`` only touch its cache."""
    from transfer.receiver import Receiver

    rx = object.__new__(Receiver)
    rx.cache = KVCache(LAYOUT)
    rx.cache.fill_seeded(5)
    return rx


@pytest.fixture(scope="module")
def bare_receiver() -> Any:
    return _bare_receiver()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=command_lines())
def test_receiver_handle_never_crashes_and_touches_nothing(
    bare_receiver: Any, line: str | bytes
) -> None:
    rx = bare_receiver
    rx.cache.fill_seeded(5)
    before = [t.clone() for t in rx.cache.tensors]
    reply_line, keep = rx.handle(line)
    reply = json.loads(reply_line)
    assert isinstance(reply, dict) and isinstance(reply["ok"], bool)
    if not reply["ok"]:
        assert reply["error"] == "PeerProtocolError", reply  # typed, never a stray exception
        assert keep
    zeroed = reply["ok"] and reply["cmd"] == "zero"
    for old, new in zip(before, rx.cache.tensors, strict=True):
        assert torch.equal(new, torch.zeros_like(new) if zeroed else old)
    if reply["ok"] and reply["cmd"] == "checksum":
        assert len(reply["digests"]) == len(json.loads(line)["blocks"])
    assert keep == (not reply["ok"] or reply["cmd"] != "exit")


@given(st.lists(st.one_of(command_lines(), st.just(b"x" * (MAX_MESSAGE_BYTES + 10))), max_size=8))
@settings(max_examples=30)
def test_receiver_serve_answers_every_line_until_exit(lines: list[str | bytes]) -> None:
    rx = _bare_receiver()
    wire = [ln.encode() if isinstance(ln, str) else ln for ln in lines]
    wire = [ln.replace(b"\n", b" ").replace(b"\r", b" ") for ln in wire]
    stdin = io.BytesIO(b"".join(ln + b"\n" for ln in wire))
    stdout = io.StringIO()
    rx.serve(stdin, stdout)  # returns at exit or end of input; never raises
    replies = [json.loads(r) for r in stdout.getvalue().splitlines()]
    answered = [ln for ln in wire if ln.strip()]
    exits = [i for i, r in enumerate(replies) if r.get("ok") is True and r.get("cmd") == "exit"]
    if exits:
        assert exits[0] == len(replies) - 1  # nothing answered after exit
    else:
        assert len(replies) == len(answered)
    assert all(r["ok"] or r["error"] == "PeerProtocolError" for r in replies)


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
def hostile_peers(draw: st.DrawFn, dst: KVCache) -> PeerInfo:
    """The destination's real PeerInfo with its regions and bases tampered with."""
    real = dst.peer_info(SID)
    size = LAYOUT.buffer_bytes
    blk = LAYOUT.block_bytes
    regions = list(real.regions)
    how = draw(st.sampled_from(["honest", "shrink", "split", "drop", "garbage"]))
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
    if draw(st.booleans()):
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


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plans_against_hostile_peers_write_only_requested_blocks(
    local: tuple[LocalBackend, KVCache, KVCache], data: st.DataObject
) -> None:
    backend, src, dst = local
    peer = data.draw(hostile_peers(dst), label="peer")
    n = data.draw(st.integers(0, LAYOUT.num_blocks + 1), label="n")
    if data.draw(st.booleans(), label="well-formed ids"):
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
    limit = data.draw(st.one_of(st.integers(-1, 3), EDGE_INTS, st.just(True)), label="limit")
    try:
        plan = build_plan(src, peer, src_blocks, dst_blocks, max_batch_entries=limit)
    except InvalidPlan as exc:  # RemoteRangeRejected included
        assert exc.reason.name == "INVALID_REQUEST"
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
        return
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


@given(corrupted_messages(), st.lists(st.integers(-1, LAYOUT.num_blocks), max_size=6))
def test_plans_from_parsed_messages_stay_inside_advertised_regions(
    raw: str, dst_blocks: list[int]
) -> None:
    try:
        peer = peer_info_from_message(raw)
    except PeerProtocolError:
        return
    src = KVCache(LAYOUT)
    try:
        plan = build_plan(src, peer, list(range(len(dst_blocks))), dst_blocks)
    except InvalidPlan:
        return
    for batch in plan.batches:
        for d, length in zip(batch.dst, batch.lengths, strict=True):
            assert d > 0 and d + length <= INT64
            assert any(r.contains(d, length) for r in peer.regions)


# -- a real receiver process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_receiver() -> Iterator[ReceiverProcess]:
    with receiver(LAYOUT) as proc:
        yield proc


@requires_mooncake
@pytest.mark.mooncake
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=command_lines())
def test_real_receiver_answers_garbage_typed_and_keeps_serving(
    live_receiver: ReceiverProcess, line: str | bytes
) -> None:
    wire = line.encode() if isinstance(line, str) else line
    wire = wire.replace(b"\n", b" ").replace(b"\r", b" ")
    assume(wire.strip())
    # A valid exit would end the shared receiver: every other line is fair game.
    with contextlib.suppress(PeerProtocolError):
        assume(parse_command(wire, num_blocks=LAYOUT.num_blocks).cmd != "exit")
    try:
        reply = live_receiver.send_raw(wire, timeout=10.0)
    except PeerProtocolError as exc:
        assert "PeerProtocolError" in str(exc)
    else:
        assert reply["ok"] is True
    assert live_receiver.request({"cmd": "ping"}, timeout=10.0)["pid"] == live_receiver.pid


@pytest.mark.parametrize(
    "base", [INT64 - 128, INT64, 2**64 - 1024, -1024, 0, 1000.5], ids=lambda b: repr(b)
)
def test_peer_addresses_past_int64_are_refused_typed(base: int | float) -> None:
    """Plans compute addresses in int64: a peer advertising buffers at or past 2**63
    (which the message format still allows: engine addresses are uint64) is
    refused, never overflowed, wrapped or truncated."""
    src = KVCache(LAYOUT)
    size = LAYOUT.buffer_bytes
    bases: tuple[Any, ...] = (base, base + size)  # a float is part of the attack
    peer = PeerInfo(SID, (Region(int(base), 2 * size),), LAYOUT, block_base=bases)
    with pytest.raises(RemoteRangeRejected, match=r"\[1, 2\*\*63\)"):
        build_plan(src, peer, [0, 1], [0, 1])
    if type(base) is int and base >= 1 and base + 2 * size <= 2**64:
        msg = _message_of(src)
        msg["regions"], msg["block_base"] = [[base, 2 * size]], list(bases)
        parsed = peer_info_from_message(json.dumps(msg))  # the wire format accepts it...
        with pytest.raises(RemoteRangeRejected):  # ...the plan does not
            build_plan(src, parsed, [0, 1], [0, 1])


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


@pytest.fixture
def all_levels() -> Iterator[None]:
    """conftest filters below ERROR; let warnings through for capture_logs."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        yield
    finally:
        structlog.configure(wrapper_class=old)


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
    # stdout carries the peer protocol: the warning must not land there.
    with receiver(KVLayout(1, 4, 64), ip="0.0.0.0") as proc:
        assert proc.peer.session_id.startswith("0.0.0.0:")
        assert proc.request({"cmd": "ping"})["pid"] == proc.pid
        assert wait_until(lambda: "wildcard_address" in proc.stderr_tail(20_000), 5.0)
