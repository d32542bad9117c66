"""ZeroMQ CURVE on kvguard's control channels: only peers holding an allowed key talk.

Without keys, anyone who reaches a control port is a peer: it can ask a
prefill to write KV into any memory a Mooncake session advertises, or give
up another decode's hold by its request id (docs/security.md). With keys,
each channel's server side (a vLLM prefill's control endpoint, the
``kvguard decode`` service) has a key pair and a directory of the public keys
it allows; each client (a vLLM decode, the ``kvguard run`` job) has its own
pair and the server's public key. CURVE encrypts and authenticates every
frame; a client whose key is not allowed never completes its handshake, so
not one of its messages is read. Each denial is logged (``curve_denied``)
and counted (``Guard.denied``); the client's link reports it at once.

Keys are ZeroMQ's certificate files (``zmq.auth``): ``kvguard keygen DIR
NAME`` writes ``NAME.key`` (the public key, to hand out) and
``NAME.key_secret`` (the pair, kept). ``ServerKeys.load`` and
``ClientKeys.load`` read them; a bad path or file is a ValueError naming it.
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["ClientKeys", "Guard", "ServerKeys", "keygen", "secure_client", "warn_unauthenticated"]

_log = structlog.get_logger("kvguard.curve")


def _pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) of a ``.key_secret`` file."""
    try:
        public, secret = zmq.auth.load_certificate(Path(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE key pair from {str(path)!r}: {exc}") from None
    if not secret:
        raise ValueError(f"{str(path)!r} holds no secret key: give the NAME.key_secret file")
    return public, secret


def _public(path: str | Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(Path(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE public key from {str(path)!r}: {exc}") from None
    return public


def _both(who: str, names: tuple[str, str], paths: tuple[object, object]) -> bool:
    """Whether ``who`` has keys: both paths (True) or neither (False);
    ValueError names both settings when only one is given."""
    if not any(paths):
        return False
    if not all(paths):
        raise ValueError(
            f"{who}'s CURVE keys need both {names[0]} and {names[1]}, "
            f"got {paths[0]!r} and {paths[1]!r}"
        )
    return True


@dataclass(frozen=True)
class ServerKeys:
    """A server's pair and the public keys (z85) of the clients it allows."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]  # empty: no client may talk

    @classmethod
    def load(cls, secret_file: str | Path, allowed_dir: str | Path) -> ServerKeys:
        """Its pair from ``secret_file``; every ``*.key`` in ``allowed_dir``."""
        public, secret = _pair(secret_file)
        folder = Path(allowed_dir)
        if not folder.is_dir():
            raise ValueError(f"no directory of allowed CURVE public keys at {str(folder)!r}")
        allowed = frozenset(_public(p) for p in sorted(folder.glob("*.key")))
        if not allowed:
            _log.warning("curve_no_client_allowed", directory=str(folder))
        return cls(public, secret, allowed)

    @classmethod
    def configured(
        cls, who: str, names: tuple[str, str], secret: str | None, allowed: str | None
    ) -> ServerKeys | None:
        """``load`` where both settings ``names`` are given, None where neither is."""
        if not _both(who, names, (secret, allowed)):
            return None
        assert secret and allowed
        return cls.load(secret, allowed)


@dataclass(frozen=True)
class ClientKeys:
    """A client's pair and the public key of the server it talks to."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, secret_file: str | Path, server_file: str | Path) -> ClientKeys:
        public, secret = _pair(secret_file)
        return cls(public, secret, _public(server_file))

    @classmethod
    def configured(
        cls, who: str, names: tuple[str, str], secret: str | None, server: str | None
    ) -> ClientKeys | None:
        """``load`` where both settings ``names`` are given, None where neither is."""
        if not _both(who, names, (secret, server)):
            return None
        assert secret and server
        return cls.load(secret, server)


def secure_client(sock: zmq.Socket[bytes], keys: ClientKeys) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of ``keys.server``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server


class Guard:
    """The server side of one ZeroMQ context: its ZAP handler admits the
    allowed keys only, and ``secure`` makes a socket a CURVE server."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: ServerKeys) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self._denied = 0
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", self)

    @property
    def denied(self) -> int:
        """Handshakes refused so far: clients without an allowed key."""
        with self._lock:
            return self._denied

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question, on its thread: is ``key`` (z85) allowed?"""
        if key in self.keys.allowed:
            return True
        # Logged before counted: whoever sees the count can find the event.
        _log.warning("curve_denied", key=key.decode("ascii", "replace"), domain=domain)
        with self._lock:
            self._denied += 1
        return False

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not yet bound) a CURVE server with this context's keys."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) into ``directory``;
    FileExistsError rather than overwrite a key."""
    folder = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a key name is a plain file name, got {name!r}")
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists: keygen does not overwrite a key")
    folder.mkdir(parents=True, exist_ok=True)
    made_public, made_secret = zmq.auth.create_certificates(folder, name)
    Path(made_secret).chmod(0o600)
    return Path(made_public), Path(made_secret)


def warn_unauthenticated(channel: str, host: str) -> None:
    """Log ``control_unauthenticated`` for a channel without keys that
    listens beyond loopback: anyone on that network is a peer."""
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        _log.warning(
            "control_unauthenticated",
            channel=channel,
            host=host,
            fix="configure CURVE keys (kvguard keygen; docs/security.md)",
        )
