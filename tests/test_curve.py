"""kvguard.curve: key files, and the decode service's control channel under CURVE.

Real ZeroMQ on loopback: a client holding an allowed key is answered; one
with another key, or with none, is never read (the handler is not called),
gets a ``ServiceTimeout`` and is counted and logged as denied. Key files
that cannot be used are refused naming the path.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
from mooncake_helpers import SMALL, decode_service, requires_mooncake
from structlog.testing import capture_logs

from kvguard.cli import main
from kvguard.curve import ClientKeys, Guard, ServerKeys, keygen, warn_unauthenticated
from kvguard.decode.control import ControlClient, ControlServer, ServiceTimeout


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """server, allowed client ``ok`` (its public key in allowed/), stranger ``other``."""
    keygen(tmp_path, "server")
    keygen(tmp_path, "ok")
    keygen(tmp_path, "other")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.key").write_bytes((tmp_path / "ok.key").read_bytes())
    return tmp_path


def test_keygen_writes_a_public_key_and_a_private_pair_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keygen", str(tmp_path / "k"), "decode-a"]) == 0
    public, secret = tmp_path / "k" / "decode-a.key", tmp_path / "k" / "decode-a.key_secret"
    assert capsys.readouterr().out == (
        f"kvguard keygen: public key {public} (hand it out), key pair {secret} (keep it)\n"
    )
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert "secret-key" not in public.read_text() and "secret-key" in secret.read_text()
    before = secret.read_bytes()
    assert main(["keygen", str(tmp_path / "k"), "decode-a"]) == 2
    assert capsys.readouterr().err == (
        f"kvguard keygen: {public} exists: keygen does not overwrite a key\n"
    )
    assert secret.read_bytes() == before
    with pytest.raises(ValueError, match=r"a key name is a plain file name, got '\.\./x'"):
        keygen(tmp_path, "../x")


def test_unusable_key_files_are_refused_naming_the_path(keys: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read a CURVE key pair from '.*/nope'"):
        ServerKeys.load(keys / "nope", keys / "allowed")
    with pytest.raises(ValueError, match=r"'.*/server\.key' holds no secret key"):
        ServerKeys.load(keys / "server.key", keys / "allowed")
    with pytest.raises(ValueError, match=r"no directory of allowed CURVE public keys at '.*/x'"):
        ServerKeys.load(keys / "server.key_secret", keys / "x")
    with pytest.raises(ValueError, match=r"cannot read a CURVE public key from '.*/gone\.key'"):
        ClientKeys.load(keys / "ok.key_secret", keys / "gone.key")
    server = ServerKeys.load(keys / "server.key_secret", keys / "allowed")
    client = ClientKeys.load(keys / "ok.key_secret", keys / "server.key")
    assert server.allowed == {client.public} and client.server == server.public


def _served(keys: Path) -> tuple[ControlServer, list[bytes]]:
    seen: list[bytes] = []

    def handle(body: bytes) -> bytes:
        seen.append(body)
        return b"pong:" + body

    server = ControlServer(
        "127.0.0.1:0", handle, curve=ServerKeys.load(keys / "server.key_secret", keys / "allowed")
    )
    return server, seen


@pytest.mark.usefixtures("all_levels")
def test_only_a_client_with_an_allowed_key_is_read(keys: Path) -> None:
    server, seen = _served(keys)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    ok = ControlClient(
        server.endpoint, curve=ClientKeys.load(keys / "ok.key_secret", keys / "server.key")
    )
    strangers: list[ControlClient] = []
    try:
        assert ok.request(b"a", timeout=10.0) == b"pong:a"
        with capture_logs() as logs:
            # Made under capture: a client dials (and is denied) as it is made.
            other = ControlClient(
                server.endpoint,
                curve=ClientKeys.load(keys / "other.key_secret", keys / "server.key"),
            )
            strangers += [other, ControlClient(server.endpoint)]
            for client in strangers:
                # Never read: no reply, or, once ZeroMQ dropped the denied
                # connection, nowhere to queue the request.
                match = r"no reply from tcp://127\.0\.0\.1:|is not taking requests"
                with pytest.raises(ServiceTimeout, match=match):
                    client.request(b"evil", timeout=0.5)
            # The ZAP thread may answer after the client gave up (a loaded
            # host): wait for its verdict while the logs are still captured.
            deadline = time.monotonic() + 10.0
            while server.guard is not None and server.guard.denied < 1:
                assert time.monotonic() < deadline, "no handshake was denied within 10 s"
                time.sleep(0.01)
        assert seen == [b"a"]  # neither stranger was read
        assert server.guard is not None and server.guard.denied >= 1
        denied = [e for e in logs if e["event"] == "curve_denied"]
        assert denied and denied[0]["key"] == ClientKeys.load(
            keys / "other.key_secret", keys / "server.key"
        ).public.decode("ascii")
        assert ok.request(b"b", timeout=10.0) == b"pong:b"  # the service goes on
    finally:
        for client in (ok, *strangers):
            client.close()
        stop.set()
        thread.join(5)
        server.close()


LOOPBACK = [("127.0.0.1", False), ("[::1]", False), ("localhost", False), ("127.0.0.2", False)]


@pytest.mark.usefixtures("all_levels")
@pytest.mark.parametrize(
    ("host", "warned"), [("10.0.0.1", True), ("0.0.0.0", True), ("[fd00::1]", True), *LOOPBACK]
)
def test_no_keys_beyond_loopback_is_warned_once_naming_the_channel(host: str, warned: bool) -> None:
    with capture_logs() as logs:
        warn_unauthenticated("prefill control", host)
    expected = [
        {
            "event": "control_unauthenticated",
            "channel": "prefill control",
            "host": host,
            "fix": "configure CURVE keys (kvguard keygen; docs/security.md)",
            "log_level": "warning",
        }
    ]
    assert logs == (expected if warned else [])


@requires_mooncake
@pytest.mark.mooncake
def test_kvguard_run_drives_a_keyed_decode_service_and_a_keyless_run_is_refused(
    keys: Path,
) -> None:
    """The CLI end to end: ``kvguard decode --curve-secret --curve-allowed``
    serves ``kvguard run --decode --curve-secret --curve-server`` (every
    request verified); a run with another key, or none, gets no answer and
    fails typed within its connect deadline."""
    proc, address = decode_service(
        f"--curve-secret={keys / 'server.key_secret'}", f"--curve-allowed={keys / 'allowed'}"
    )
    try:
        small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()] + ["--no-progress"]
        keyed = [
            "--curve-secret",
            str(keys / "ok.key_secret"),
            "--curve-server",
            str(keys / "server.key"),
        ]
        base = ["run", "--decode", address, "--requests", "20", "--blocks-per-request", "4"]
        assert main([*base, *small, *keyed]) == 0
        stranger = ["--curve-secret", str(keys / "other.key_secret")]
        assert main([*base, *small, *stranger, "--curve-server", str(keys / "server.key")]) == 2
        assert main([*base, *small]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "../x"])
def test_keygen_refuses_names_that_are_not_plain_file_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError) as info:
        keygen(tmp_path, name)
    assert str(info.value) == f"a key name is a plain file name, got {name!r}"
    assert list(tmp_path.iterdir()) == []


def test_keygen_makes_missing_directories(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path / "a" / "b", "k")
    assert (public.name, secret.name) == ("k.key", "k.key_secret")
    assert public.parent == tmp_path / "a" / "b"


@pytest.mark.usefixtures("all_levels")
def test_an_empty_allowed_directory_is_warned_and_lets_no_client_in(keys: Path) -> None:
    empty = keys / "none"
    empty.mkdir()
    with capture_logs() as logs:
        server = ServerKeys.load(keys / "server.key_secret", empty)
    assert server.allowed == frozenset()
    assert logs == [
        {"event": "curve_no_client_allowed", "directory": str(empty), "log_level": "warning"}
    ]
    with capture_logs() as logs:
        ServerKeys.load(keys / "server.key_secret", keys / "allowed")
    assert logs == []


@pytest.mark.usefixtures("all_levels")
def test_the_guard_counts_and_logs_each_denial_once(keys: Path) -> None:
    import zmq

    server = ServerKeys.load(keys / "server.key_secret", keys / "allowed")
    ok = ClientKeys.load(keys / "ok.key_secret", keys / "server.key")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    guard = Guard(ctx, server)
    try:
        with capture_logs() as logs:
            assert guard.callback("*", ok.public) is True
            assert guard.callback("*", b"stranger-key") is False
            assert guard.callback("dom", b"\xffbad") is False
        assert guard.denied == 2
        assert logs == [
            {"event": "curve_denied", "key": "stranger-key", "domain": "*", "log_level": "warning"},
            {"event": "curve_denied", "key": "\ufffdbad", "domain": "dom", "log_level": "warning"},
        ]
    finally:
        guard.close()
        ctx.term()
