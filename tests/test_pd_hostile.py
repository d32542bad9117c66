"""The prefill's control endpoint against what a hostile or broken peer sends.

Anyone who reaches a prefill's control port can send it frames. A raw
ZeroMQ DEALER sends what hypothesis makes: random bytes, msgpack maps with
every kind tag and fields of every type and size, extra envelope frames,
well-formed pushes and aborts for requests and loads that are not theirs.
After each example the sender's thread lives, logged no loop error, never
touched the request it holds for the real decode, and answered only with
well-formed failed ``Result``s; at the end the real decode's load still
lands byte for byte. Then the cases hypothesis would rarely build: a
replayed push of a load that ended, a frame over the size limit. What a
peer that knows a request's ids can do without keys (give up its hold, or
its load in flight: ZeroMQ's routing ids are no credential, a reconnect
hands them over) is what CURVE keys stop (tests/test_pd_auth.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import structlog
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import LogCapture

from kvguard.vllm.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Push,
    Renew,
    decode_from_prefill,
    encode,
)
from kvguard.vllm.states import LoadEnd
from tests.pd_pair import Pair

VICTIM = f"victim-{uuid.uuid4().hex}"  # held for the real decode: no frame may touch it
VICTIM_BLOCKS = [1, 2, 3]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = (
    "request_id",
    "load_id",
    "blocks",
    "peer",
    "expires_at",
    "compat",
    "group",
    "first_head",
    "head_count",
    "verify",
    "ok",
    "reason",
)
_maps = st.builds(
    lambda kind, fields: msgspec.msgpack.encode({"kind": kind, **fields}),
    st.sampled_from(["push", "abort", "renew", "result", "", "PUSH"]),
    st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6),
)
_ids = st.text(min_size=1, max_size=20)


def _push_for(pair: Pair) -> st.SearchStrategy[bytes]:
    """Well-formed pushes and aborts for requests and loads that are not the attacker's."""
    peer = pair.receiver.peer
    return st.one_of(
        st.builds(
            lambda rid, lid, blocks: encode(Push(rid, lid, blocks, peer, time.time() + 5)),
            _ids,
            _ids,
            st.lists(st.integers(0, 2**62), max_size=8),
        ),
        # An abort or forget naming VICTIM would end its hold: without keys
        # a request id is all a decode shows (test_pd_auth.py: with keys, no).
        st.builds(lambda rid, lid: encode(Abort(rid, lid)), _ids, _ids | st.just("")),
        st.builds(lambda rid: encode(Renew(rid)), _ids | st.just(VICTIM)),
    )


class Attacker:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def replies(self, wait_s: float) -> list[bytes]:
        out, end = [], time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            out.append(self.sock.recv())
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def target() -> Iterator[tuple[Pair, Attacker, LogCapture]]:
    cap = LogCapture()
    old = structlog.get_config()
    structlog.configure(processors=[cap])
    pair = Pair()
    attacker = Attacker(pair.sender.endpoint)
    pair.sender.hold(VICTIM, VICTIM_BLOCKS, time.monotonic() + 300)
    try:
        yield pair, attacker, cap
    finally:
        attacker.close()
        pair.close()
        structlog.configure(**old)


def _intact(pair: Pair, cap: LogCapture) -> None:
    assert pair.sender._thread.is_alive()
    assert not [e for e in cap.entries if e["event"] == "sender_loop_error"], cap.entries
    pair.poll()
    assert VICTIM not in pair.released and pair.sender.holding() >= 1


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_hostile_frames_touch_nothing_and_get_only_failed_results(
    target: tuple[Pair, Attacker, LogCapture], data: st.DataObject
) -> None:
    pair, attacker, cap = target
    frames = st.one_of(st.binary(max_size=300), _maps, _push_for(pair))
    sent = data.draw(st.lists(frames, min_size=1, max_size=5))
    for body in sent:
        extra = data.draw(st.sampled_from([[], [b""], [b"x", b"y"]]))
        attacker.send([*extra, body])
    for raw in attacker.replies(0.03):
        res = decode_from_prefill(raw)  # a well-formed Result, nothing else
        assert not res.ok and res.request_id != VICTIM, res
    _intact(pair, cap)


def test_after_the_storm_the_real_load_still_lands(
    target: tuple[Pair, Attacker, LogCapture],
) -> None:
    pair, attacker, cap = target
    attacker.send([b"\x00" * 64])
    attacker.send([msgspec.msgpack.encode({"kind": "push", "request_id": VICTIM})])
    attacker.replies(0.05)
    _intact(pair, cap)
    pair.receiver.expect("d1", pair.sender.endpoint, VICTIM, [9, 4, 11], time.monotonic() + 10)
    pair.until(lambda: "d1" in pair.outcomes and VICTIM in pair.released)
    assert pair.outcomes["d1"].end is LoadEnd.LOADED
    assert pair.src.blocks_equal(pair.dst, VICTIM_BLOCKS, [9, 4, 11]) == []


def test_a_replayed_push_of_an_ended_load_starts_nothing() -> None:
    pair = Pair()
    attacker = Attacker(pair.sender.endpoint)
    try:
        assert pair.load("r1", [1, 2], [5, 6]).end is LoadEnd.LOADED
        pushed = pair.sender.stats.pushed
        replay = Push("r1", "r1", [5, 6], pair.receiver.peer, time.time() + 5, verify=True)
        attacker.send([encode(replay)])
        (raw,) = attacker.replies(2.0)
        res = decode_from_prefill(raw)
        assert (res.request_id, res.load_id, res.ok, res.reason) == (
            "r1",
            "r1",
            False,
            LoadEnd.UNKNOWN_REQUEST.value,
        )
        assert pair.sender.stats.pushed == pushed
    finally:
        attacker.close()
        pair.close()


def test_a_frame_over_the_limit_drops_the_sender_and_nothing_else() -> None:
    """ZeroMQ drops a connection whose frame announces more than MAXMSGSIZE,
    before buffering it: the sender never reads it, and serves the others."""
    pair = Pair()
    attacker = Attacker(pair.sender.endpoint)
    try:
        attacker.send([b"\x00" * (MAX_FRAME_BYTES + 1)])
        assert attacker.replies(0.2) == []
        assert pair.load("r1", [1, 2], [5, 6]).end is LoadEnd.LOADED
    finally:
        attacker.close()
        pair.close()
