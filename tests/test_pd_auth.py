"""The vLLM connector's control channel with CURVE keys (``kvguard.curve``).

A prefill with keys reads only decodes holding an allowed key: such a decode
loads as without keys; one with another key is denied at its handshake, so
its load fails ``denied`` at once (nothing was sent: unfenced) and the
prefill counts it; a peer with no key cannot even give up a hold by its
request id, which without keys it can (tests/test_pd_hostile.py).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import zmq

from kvguard.curve import ClientKeys, ServerKeys, keygen
from kvguard.vllm.protocol import Abort, encode
from kvguard.vllm.settings import Settings
from kvguard.vllm.states import LoadEnd
from tests.pd_pair import Pair

Keys = tuple[ServerKeys, ClientKeys, ClientKeys]


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """The prefill's keys, an allowed decode's, a stranger's."""
    for name in ("prefill", "decode", "stranger"):
        keygen(tmp_path, name)
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "decode.key").write_bytes((tmp_path / "decode.key").read_bytes())
    server = ServerKeys.load(tmp_path / "prefill.key_secret", tmp_path / "allowed")
    allowed = ClientKeys.load(tmp_path / "decode.key_secret", tmp_path / "prefill.key")
    stranger = ClientKeys.load(tmp_path / "stranger.key_secret", tmp_path / "prefill.key")
    return server, allowed, stranger


def test_a_decode_with_an_allowed_key_loads(
    keys: Keys,
) -> None:
    server, allowed, _ = keys
    pair = Pair(server_keys=server, client_keys=allowed)
    try:
        out = pair.load("r1", [1, 2, 3], [9, 4, 11])
        assert (out.end, out.detail, out.fenced) == (LoadEnd.LOADED, "", False)
        assert pair.sender.stats.denied == 0
    finally:
        pair.close()


def test_a_decode_with_another_key_is_denied_at_once_and_counted(
    keys: Keys,
) -> None:
    server, _, stranger = keys
    pair = Pair(server_keys=server, client_keys=stranger)
    try:
        pair.sender.hold("r1", [1], time.monotonic() + 30)
        pair.receiver.expect("d1", pair.sender.endpoint, "r1", [2], time.monotonic() + 30)
        pair.until(lambda: "d1" in pair.outcomes)
        out = pair.outcomes["d1"]
        assert (out.end, out.fenced) == (LoadEnd.DENIED, False)
        assert out.detail == (
            f"prefill {pair.sender.endpoint}: handshake denied: "
            "this decode's CURVE key is not allowed there"
        )
        assert out.latency_s < 10  # a hang guard: the deadline is 30 s
        pair.until(lambda: pair.sender.stats.denied >= 1)
        assert pair.sender.holding() == 1 and pair.sender.stats.pushed == 0  # nothing read
    finally:
        pair.close()


def test_a_peer_without_a_key_cannot_give_up_a_hold(
    keys: Keys,
) -> None:
    server, allowed, _ = keys
    pair = Pair(server_keys=server, client_keys=allowed)
    try:
        pair.sender.hold("victim", [1, 2], time.monotonic() + 30)
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pair.sender.endpoint)
            # A forget, and an abort: each ends the hold without keys. Never
            # read here (queued until the denial, or refused once it dropped).
            for msg in (Abort("victim", ""), Abort("victim", "x")):
                with contextlib.suppress(zmq.Again):
                    sock.send(encode(msg), flags=zmq.NOBLOCK)
            assert not sock.poll(300)
        pair.poll()
        assert "victim" not in pair.released and pair.sender.holding() == 1
        pair.receiver.expect("d1", pair.sender.endpoint, "victim", [5, 6], time.monotonic() + 10)
        pair.until(lambda: "d1" in pair.outcomes and "victim" in pair.released)
        assert pair.outcomes["d1"].end is LoadEnd.LOADED
    finally:
        pair.close()


def test_connector_settings_name_a_missing_half_and_load_complete_keys(tmp_path: Path) -> None:
    keygen(tmp_path, "p")
    keygen(tmp_path, "d")
    (tmp_path / "ok").mkdir()
    assert Settings.of({}).server_keys() is None and Settings.of({}).client_keys() is None
    half = Settings.of({"kvguard_curve_secret": str(tmp_path / "p.key_secret")})
    with pytest.raises(ValueError) as info:
        half.server_keys()
    assert str(info.value) == (
        "a prefill's CURVE keys need both kvguard_curve_secret and kvguard_curve_allowed, "
        f"got {str(tmp_path / 'p.key_secret')!r} and ''"
    )
    with pytest.raises(ValueError, match="a decode's CURVE keys need both kvguard_curve_secret"):
        half.client_keys()
    full = Settings.of(
        {
            "kvguard_curve_secret": str(tmp_path / "d.key_secret"),
            "kvguard_curve_server": str(tmp_path / "p.key"),
        }
    )
    keys = full.client_keys()
    assert (
        keys is not None
        and keys.server == ClientKeys.load(tmp_path / "p.key_secret", tmp_path / "p.key").public
    )
