"""The decode side of a transfer: a destination KVCache behind its own engine.

``Receiver`` owns the destination cache, registers it with a MooncakeBackend
and answers the control requests of ``peer_protocol`` (what it advertises,
block digests, zero, ping). ``serve`` puts it on a ``control.ControlServer``
until stopped. Run as a process::

    python -m kvguard.decode.service --listen HOST:PORT|ipc://PATH --layers L --blocks B \\
        --block-bytes N [--no-kv-split] [--ip ENGINE_IP] [--exit-with-stdin]

(``kvguard decode`` is the same service.) It prints one line once it
listens, serves until SIGINT/SIGTERM -- or, with ``--exit-with-stdin``, until
its stdin closes, so it never outlives the parent that holds it -- and then
stops listening and releases its engine. A malformed request gets a typed
error reply, never a crash.

``ReceiverProcess`` is the parent side: it starts one on a private ipc
socket, asks for its peer message with a deadline, and on exit always kills
and reaps it by pid (``process``; re-exported here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Final

import structlog

from kvguard.curve import ServerKeys, warn_unauthenticated
from transfer.backend import PeerInfo
from transfer.cache import KVCache
from transfer.layout import KVLayout
from transfer.metadata import clear_stale
from transfer.mooncake import P2P_HANDSHAKE, MooncakeBackend, is_wildcard
from transfer.peer_protocol import (
    REPLY_OF,
    ChecksumReply,
    ChecksumRequest,
    PeerRequest,
    PingReply,
    PingRequest,
    Reply,
    Request,
    ZeroReply,
    ZeroRequest,
    block_digest_bytes,
    encode,
    error_reply,
    parse_request,
    peer_message_of,
)

from .args import add_service_arguments
from .control import ControlServer, endpoint_of, tcp_address
from .process import ReceiverProcess

__all__ = ["Receiver", "ReceiverProcess", "add_service_arguments", "main", "run_service"]

_log = structlog.get_logger("kvguard.decode")
_WILDCARD: Final = "the control channel has no authentication and accepts every interface"


class Receiver:
    """A registered destination cache and the engine that exposes it."""

    cache: KVCache  # zeroed at start; written only by peers' transfers and "zero"
    backend: MooncakeBackend  # registers the cache; never submits
    peer_info: PeerInfo  # what the peer message advertises

    def __init__(
        self,
        layout: KVLayout,
        *,
        ip: str = "127.0.0.1",
        metadata: str = P2P_HANDSHAKE,
        device: str = "cpu",
    ) -> None:
        self.cache = KVCache(layout, device=device)
        # A receiver never submits: one idle worker is enough.
        self.backend = MooncakeBackend(ip, metadata=metadata, max_inflight=1)
        try:
            self.backend.register(self.cache)
        except BaseException:
            self.backend.close()
            raise
        self.peer_info = self.cache.peer_info(self.backend.session_id)

    def handle(self, frame: bytes) -> bytes:
        """Answer one request frame with one reply frame; never raises."""
        try:
            req = parse_request(frame, num_blocks=self.cache.layout.num_blocks)
            reply = _HANDLERS[type(req)](self, req)
        except Exception as exc:  # typed errors and surprises alike become a reply
            reply = error_reply(exc)
        return encode(reply)

    def close(self) -> None:
        self.backend.close()


def _zero(receiver: Receiver, req: Request) -> Reply:
    for t in receiver.cache.tensors:
        t.zero_()
    return ZeroReply()


def _checksum(receiver: Receiver, req: Request) -> Reply:
    assert isinstance(req, ChecksumRequest)  # the dispatch table's key
    return ChecksumReply(block_digest_bytes(receiver.cache, req.blocks))


# Request type -> handler; the keys are exactly peer_protocol.REPLY_OF's.
_HANDLERS: Final[Mapping[type[Request], Callable[[Receiver, Request], Reply]]] = {
    PeerRequest: lambda r, q: peer_message_of(r.peer_info),
    ChecksumRequest: _checksum,
    ZeroRequest: _zero,
    PingRequest: lambda r, q: PingReply(os.getpid()),
}
if _HANDLERS.keys() != REPLY_OF.keys():  # a request without a handler fails at import
    raise ImportError(f"receiver handlers {sorted(map(str, _HANDLERS))} != requests")


# -- the service ----------------------------------------------------------------------


def _engine_ip(args: argparse.Namespace) -> str:
    """The engine's address: --ip, else the --listen host (where peers reach this host)."""
    endpoint = endpoint_of(args.listen)
    host = endpoint[len("tcp://") :].rpartition(":")[0] if endpoint.startswith("tcp://") else ""
    if host and is_wildcard(host):
        # Both listen on every interface then (docs/security.md); say so, loudly.
        _log.warning("wildcard_address", listen=args.listen, problem=_WILDCARD)
        if args.ip is None:  # "0.0.0.0:port" is no address a peer can use
            raise ValueError(f"--listen {args.listen} needs --ip: the address peers use")
    return str(args.ip or host.strip("[]") or "127.0.0.1")


def _server_keys(args: argparse.Namespace) -> ServerKeys | None:
    """The control channel's CURVE keys (both flags), or None: unauthenticated,
    which ``warn_unauthenticated`` says beyond loopback."""
    secret, allowed = getattr(args, "curve_secret", None), getattr(args, "curve_allowed", None)
    names = ("--curve-secret", "--curve-allowed")
    if (keys := ServerKeys.configured("the decode service", names, secret, allowed)) is not None:
        return keys
    endpoint = endpoint_of(args.listen)
    if endpoint.startswith("tcp://"):
        warn_unauthenticated("decode service control", tcp_address(endpoint)[0])
    return None


def run_service(args: argparse.Namespace, out: IO[str]) -> int:
    """Serve until SIGINT/SIGTERM (or stdin closes); release everything on the way out."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        layout = KVLayout(args.layers, args.blocks, args.block_bytes, not args.no_kv_split)
        name = _engine_ip(args)
        # Coming back under a name whose last holder was SIGKILLed: its keys
        # are still in the store (transfer.metadata); they can only be stale.
        clear_stale(args.metadata, name)
        keys = _server_keys(args)
        receiver = Receiver(layout, ip=name, metadata=args.metadata, device=args.device)
    except Exception as exc:  # the parent reads the typed error on stderr
        print(f"kvguard decode: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    with contextlib.ExitStack() as closing:
        closing.callback(receiver.close)
        try:
            server = ControlServer(args.listen, receiver.handle, curve=keys)
        except OSError as exc:
            print(f"kvguard decode: {exc}", file=sys.stderr, flush=True)
            return 2
        closing.callback(server.close)
        if args.exit_with_stdin:
            threading.Thread(target=_stop_at_eof, args=(stop,), daemon=True).start()
        mib = layout.total_bytes / (1 << 20)
        print(
            f"kvguard decode: listening on {server.endpoint} for engine session "
            f"{receiver.peer_info.session_id}: {layout.num_buffers} buffers x "
            f"{layout.num_blocks} blocks x {layout.block_bytes} bytes ({mib:.0f} MiB)",
            file=out,
            flush=True,
        )
        server.serve(stop)
    return 0


def _stop_at_eof(stop: threading.Event) -> None:
    with contextlib.suppress(OSError, ValueError):
        while sys.stdin.buffer.read(1 << 16):
            pass
    stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvguard.decode.service",
        description="Serve a destination KV cache over Mooncake and a control channel.",
    )
    add_service_arguments(parser)
    args = parser.parse_args(argv)
    # Log records (a wildcard-address warning, say) go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    return run_service(args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
