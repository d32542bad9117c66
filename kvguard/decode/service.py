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
and reaps it by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Final

import msgspec
import structlog

from transfer.backend import PeerInfo
from transfer.cache import KVCache
from transfer.errors import PeerProtocolError
from transfer.layout import KVLayout
from transfer.metadata import clear_stale
from transfer.mooncake import P2P_HANDSHAKE, MooncakeBackend, is_wildcard
from transfer.peer_protocol import (
    DIGEST_SIZE,
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
from .control import ControlServer, DecodeClient, endpoint_of

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
        receiver = Receiver(layout, ip=name, metadata=args.metadata, device=args.device)
    except Exception as exc:  # the parent reads the typed error on stderr
        print(f"kvguard decode: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    with contextlib.ExitStack() as closing:
        closing.callback(receiver.close)
        try:
            server = ControlServer(args.listen, receiver.handle)
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


# -- parent side -------------------------------------------------------------------


class ReceiverProcess:
    """A ``python -m kvguard.decode.service`` child, owned by pid. A context manager.

    It listens on an ipc socket in a private directory (a path, so it is
    reachable from any network namespace). Entering starts it and waits (at
    most ``ready_timeout_s``) for its peer message; leaving kills and reaps it
    whatever state it is in. Its output (glog noise) goes to a temporary
    file, quoted when something fails.
    """

    _proc: subprocess.Popen[bytes] | None  # None until started
    _client: DecodeClient | None  # None until started
    _stderr: IO[bytes]  # the child's stdout and stderr
    _peer: PeerInfo | None  # set once the child answered with a valid peer message
    _frozen: bool  # SIGSTOP sent and no SIGCONT since

    def __init__(
        self,
        layout: KVLayout,
        *,
        ip: str = "127.0.0.1",
        metadata: str = P2P_HANDSHAKE,
        ready_timeout_s: float = 60.0,
        reply_timeout_s: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.layout = layout
        self._dir = tempfile.mkdtemp(prefix="kvguard-rx-")
        self.endpoint = f"ipc://{self._dir}/control"
        self._argv = [
            sys.executable,
            "-m",
            "kvguard.decode.service",
            f"--listen={self.endpoint}",
            "--exit-with-stdin",
            f"--layers={layout.num_layers}",
            f"--blocks={layout.num_blocks}",
            f"--block-bytes={layout.block_bytes}",
            f"--ip={ip}",
            f"--metadata={metadata}",
            *([] if layout.kv_split else ["--no-kv-split"]),
        ]
        self._env = {**os.environ, "MC_FORCE_TCP": "1", **(env or {})}
        self._ready_timeout_s = ready_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._proc = None
        self._client = None
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- owned; close() closes it
        self._peer = None
        self._frozen = False

    def __enter__(self) -> ReceiverProcess:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> PeerInfo:
        """Start the child and return the PeerInfo it advertises."""
        if self._proc is not None:
            raise RuntimeError(f"receiver already started (pid {self._proc.pid})")
        self._proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=self._stderr,
            stderr=self._stderr,
            env=self._env,
        )
        self._client = DecodeClient(self.endpoint, timeout_s=self._reply_timeout_s)
        self._peer = self._client.peer(timeout=self._ready_timeout_s, alive=self.check_alive)
        return self._peer

    @property
    def client(self) -> DecodeClient:
        if self._client is None:
            raise RuntimeError("receiver not started")
        return self._client

    @property
    def peer(self) -> PeerInfo:
        if self._peer is None:
            raise RuntimeError("receiver not started")
        return self._peer

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("receiver not started")
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def frozen(self) -> bool:
        return self._frozen

    # -- requests ------------------------------------------------------------------------

    def request(
        self, command: Mapping[str, object], timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one request (``{"cmd": name, **fields}``) and return its reply's fields.

        PeerProtocolError for an error reply, a reply of the wrong kind or a
        child that exited; ServiceTimeout (a TimeoutError) when no reply comes
        in time (a frozen child).
        """
        try:
            body = msgspec.msgpack.encode(dict(command))
        except (TypeError, ValueError, OverflowError) as exc:
            raise PeerProtocolError(f"request not encodable: {exc}") from exc
        reply = self.client.call_raw(body, timeout=timeout, alive=self.check_alive)
        if reply.__struct_config__.tag != command.get("cmd"):
            raise PeerProtocolError(f"{type(reply).__name__} in reply to {command.get('cmd')!r}")
        return msgspec.structs.asdict(reply)

    def send_raw(self, frame: bytes, timeout: float | None = None) -> dict[str, Any]:
        """Send ``frame`` unvalidated as one request (tests of the child's validation)."""
        reply = self.client.call_raw(frame, timeout=timeout, alive=self.check_alive)
        return msgspec.structs.asdict(reply)

    def checksums(self, blocks: Sequence[int]) -> list[str]:
        """sha256 hex of each destination block (``peer_protocol.block_digests``)."""
        raw = self.client.checksums(list(blocks), alive=self.check_alive)
        return [raw[i : i + DIGEST_SIZE].hex() for i in range(0, len(raw), DIGEST_SIZE)]

    def zero(self) -> None:
        self.client.zero(alive=self.check_alive)

    # -- signals -------------------------------------------------------------------------

    def freeze(self) -> None:
        """SIGSTOP the child and wait until the kernel reports it stopped."""
        self._signal(signal.SIGSTOP)
        self._frozen = True
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and _proc_state(self.pid) not in ("T", None):
            time.sleep(0.001)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)
        self._frozen = False

    def kill(self) -> None:
        """SIGKILL the child (SIGCONT first if frozen) and reap it. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:  # not reaped, so the pid is still ours
            if self._frozen:
                self._signal(signal.SIGCONT)
                self._frozen = False
            self._signal(signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        """Kill and reap the child, then release its stdin, socket directory and output."""
        try:
            self.kill()
        finally:
            if self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.close()
            if self._client is not None:
                self._client.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._stderr.close()

    def stderr_tail(self, limit: int = 2000) -> str:
        if self._stderr.closed:
            return ""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read().decode(errors="replace")

    def check_alive(self) -> None:
        """Raise PeerProtocolError once the child has exited (a wait need not run out)."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            raise PeerProtocolError(
                f"receiver pid {proc.pid} exited (code {proc.returncode}); "
                f"output: {self.stderr_tail(800)!r}"
            )

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
            os.kill(proc.pid, sig)


def _proc_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat ("T" when stopped); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
