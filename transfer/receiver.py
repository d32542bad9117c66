"""The decode side of a transfer: a destination KVCache behind its own engine.

``Receiver`` owns the destination cache, registers it with a MooncakeBackend
and advertises it as one peer message (``transfer.peer_protocol``).

Run as a process::

    python -m transfer.receiver --layers L --blocks B --block-bytes N [--no-kv-split]

it prints that message as its first stdout line once it is ready, then
answers one JSON line per command line on stdin (``peer_protocol.COMMANDS``)
until ``exit`` or end of input, so it never outlives the parent that holds
its stdin. A malformed command gets a typed error line, never a crash.

``ReceiverProcess`` is the parent side: it starts one, parses its message
strictly with a timeout, and on exit always kills and reaps it by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, BinaryIO, Final, TextIO

import structlog

from .backend import PeerInfo
from .errors import PeerProtocolError
from .layout import KVCache, KVLayout
from .mooncake import P2P_HANDSHAKE, MooncakeBackend
from .peer_protocol import (
    COMMANDS,
    MAX_MESSAGE_BYTES,
    Command,
    block_digests,
    check_reply,
    encode_error,
    encode_reply,
    load_message,
    parse_command,
    parse_reply,
    peek_command_id,
    peer_info_from_message,
    peer_info_to_message,
)

__all__ = ["Receiver", "ReceiverProcess", "main"]


class Receiver:
    """A registered destination cache and the engine that exposes it."""

    cache: KVCache  # zeroed at start; written only by peers' transfers and "zero"
    backend: MooncakeBackend  # registers the cache; never submits
    peer_info: PeerInfo  # what the message advertises

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

    def message(self) -> str:
        return peer_info_to_message(self.peer_info)

    def handle(self, line: str | bytes) -> tuple[str, bool]:
        """Answer one command line: (reply line, keep serving)."""
        try:
            command = parse_command(line, num_blocks=self.cache.layout.num_blocks)
            fields = _HANDLERS[command.cmd](self, command)
        except Exception as exc:  # typed errors and surprises alike become a reply
            return encode_error(exc, peek_command_id(line)), True
        return encode_reply(command, **fields), command.cmd != "exit"

    def serve(self, stdin: BinaryIO, stdout: TextIO) -> None:
        """Answer commands until ``exit`` or end of input."""
        while True:
            line = stdin.readline(MAX_MESSAGE_BYTES + 1)
            if not line:
                return  # the parent closed our stdin, or died
            if len(line) > MAX_MESSAGE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # drop the rest of the line
                    line = stdin.readline(MAX_MESSAGE_BYTES)
                reply = encode_error(
                    PeerProtocolError(f"command line longer than {MAX_MESSAGE_BYTES} bytes")
                )
                keep = True
            elif not line.strip():
                continue
            else:
                reply, keep = self.handle(line)
            stdout.write(reply + "\n")
            stdout.flush()
            if not keep:
                return

    def close(self) -> None:
        self.backend.close()


def _zero(receiver: Receiver, command: Command) -> dict[str, object]:
    for t in receiver.cache.tensors:
        t.zero_()
    return {}


# Command name -> handler; the keys are exactly peer_protocol.COMMANDS.
_HANDLERS: Final[Mapping[str, Callable[[Receiver, Command], dict[str, object]]]] = {
    "checksum": lambda r, c: {"digests": block_digests(r.cache, c.blocks)},
    "zero": _zero,
    "ping": lambda r, c: {"pid": os.getpid()},
    "exit": lambda r, c: {},
}
if _HANDLERS.keys() != COMMANDS.keys():  # a command without a handler fails at import
    raise ImportError(f"receiver handlers {sorted(_HANDLERS)} != commands {sorted(COMMANDS)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m transfer.receiver",
        description="Serve a destination KV cache over Mooncake; print its peer message.",
    )
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--no-kv-split", action="store_true", help="one buffer per layer (MLA)")
    parser.add_argument("--ip", default="127.0.0.1")
    parser.add_argument("--metadata", default=P2P_HANDSHAKE)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    # This process is an application and its stdout carries the peer
    # protocol: log records (a wildcard-address warning, say) go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        layout = KVLayout(args.layers, args.blocks, args.block_bytes, not args.no_kv_split)
        receiver = Receiver(layout, ip=args.ip, metadata=args.metadata, device=args.device)
    except Exception as exc:  # the parent reads a typed error instead of a peer message
        print(encode_error(exc), flush=True)
        return 2
    try:
        print(receiver.message(), flush=True)
        receiver.serve(sys.stdin.buffer, sys.stdout)
    finally:
        receiver.close()
    return 0


# -- parent side -------------------------------------------------------------------

_EOF: Final = b""  # the reader thread's last item: the child's stdout closed


class ReceiverProcess:
    """A ``python -m transfer.receiver`` child, owned by pid. A context manager.

    Entering starts it and waits (at most ``ready_timeout_s``) for its peer
    message; leaving kills and reaps it whatever state it is in. Its stderr
    (glog noise) goes to a temporary file, quoted when something fails.
    """

    _proc: subprocess.Popen[bytes] | None  # None until started
    _lines: queue.Queue[bytes]  # stdout lines from the reader thread; _EOF last
    _reader: threading.Thread | None
    _stderr: IO[bytes]
    _peer: PeerInfo | None  # set once the child printed a valid message
    _frozen: bool  # SIGSTOP sent and no SIGCONT since
    _next_id: int  # id of the last command sent

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
        self._argv = [
            sys.executable,
            "-m",
            "transfer.receiver",
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
        self._lines = queue.Queue()
        self._reader = None
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- owned; close() closes it
        self._peer = None
        self._frozen = False
        self._next_id = 0

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
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
        )
        stdout = self._proc.stdout
        assert stdout is not None  # Popen with stdout=PIPE
        self._reader = threading.Thread(
            target=_pump, args=(stdout, self._lines), name=f"receiver-{self.pid}", daemon=True
        )
        self._reader.start()
        line = self._next_line(self._ready_timeout_s, "its peer message")
        self._peer = peer_info_from_message(line)
        return self._peer

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

    # -- commands ----------------------------------------------------------------------

    def request(
        self, command: Mapping[str, object], timeout: float | None = None
    ) -> dict[str, object]:
        """Send one command and return its reply; PeerProtocolError for an error reply,
        TimeoutError when no reply comes in time (a frozen child).

        Replies to earlier commands that timed out are recognised by their id
        and dropped.
        """
        self._next_id += 1
        cid = self._next_id
        self._write(json.dumps({**command, "id": cid}).encode())
        deadline = time.monotonic() + (self._reply_timeout_s if timeout is None else timeout)
        what = f"a reply to {command.get('cmd')!r}"
        while True:
            msg = load_message(self._next_line(deadline - time.monotonic(), what), "reply")
            if msg.get("id") == cid:
                return check_reply(msg)

    def send_raw(self, line: bytes, timeout: float | None = None) -> dict[str, object]:
        """Send ``line`` unvalidated (tests of the child's validation) and parse the reply."""
        self._write(line)
        raw = self._next_line(self._reply_timeout_s if timeout is None else timeout, "a reply")
        return parse_reply(raw)

    def checksums(self, blocks: Sequence[int]) -> list[str]:
        """sha256 hex of each destination block (``peer_protocol.block_digests``)."""
        reply = self.request({"cmd": "checksum", "blocks": list(blocks)})
        digests = reply.get("digests")
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise PeerProtocolError(f"checksum reply without digests: {str(reply)[:200]}")
        if len(digests) != len(blocks):
            raise PeerProtocolError(f"{len(digests)} digests for {len(blocks)} blocks")
        return [str(d) for d in digests]

    def zero(self) -> None:
        self.request({"cmd": "zero"})

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
        """Kill and reap the child, then release pipes, reader and stderr file."""
        try:
            self.kill()
        finally:
            proc = self._proc
            if proc is not None:
                for pipe in (proc.stdin, proc.stdout):
                    if pipe is not None:
                        pipe.close()
            if self._reader is not None:
                self._reader.join(timeout=5.0)
            self._stderr.close()

    def stderr_tail(self, limit: int = 2000) -> str:
        if self._stderr.closed:
            return ""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read().decode(errors="replace")

    def _write(self, line: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise RuntimeError("receiver not started")
        proc.stdin.write(line + b"\n")
        proc.stdin.flush()

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
            os.kill(proc.pid, sig)

    def _next_line(self, timeout: float, what: str) -> bytes:
        try:
            line = self._lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise TimeoutError(
                f"receiver pid {self.pid} sent no {what} within {timeout:.1f}s"
            ) from None
        if line == _EOF:
            self._lines.put(_EOF)  # later readers see the end too
            code = self._proc.poll() if self._proc is not None else None
            raise PeerProtocolError(
                f"receiver pid {self.pid} exited (code {code}) before {what}; "
                f"stderr: {self.stderr_tail(800)!r}"
            )
        return line


def _pump(stdout: IO[bytes], lines: queue.Queue[bytes]) -> None:
    try:
        for line in iter(lambda: stdout.readline(MAX_MESSAGE_BYTES + 1), b""):
            lines.put(line)
    except (OSError, ValueError):  # closed under us by close()
        pass
    finally:
        lines.put(_EOF)


def _proc_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat ("T" when stopped); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
