"""The parent side of a decode service: a ``python -m kvguard.decode.service``
child, owned by pid.

``ReceiverProcess`` starts one on a private ipc socket, asks for its peer
message with a deadline, and on exit always kills and reaps it by pid. Tests,
``kvguard run`` and the examples use it to hold a real decode peer they can
freeze, thaw and kill.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any

import msgspec

from transfer.backend import PeerInfo
from transfer.errors import PeerProtocolError
from transfer.layout import KVLayout
from transfer.mooncake import P2P_HANDSHAKE
from transfer.peer_protocol import DIGEST_SIZE

from .control import DecodeClient

__all__ = ["ReceiverProcess"]


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
