"""A real etcd server for tests: Debian's ``etcd-server``, on a temporary data
directory, on loopback or inside a test's network namespace, stopped by pid.

etcd 3.4 serves the v3 API's JSON gateway on its client URL, so keys are
listed and deleted with the standard library (``EtcdServer.keys``,
``EtcdServer.delete_prefix``), no client package needed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_unavailable() -> str | None:
    """Why etcd tests cannot run here, or None."""
    if not os.path.exists(ETCD):
        return "etcd is not installed (Debian package etcd-server)"
    return None


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # the range [prefix, prefix_end) is every key under prefix
    return base64.b64encode(bytes(raw)).decode()


class EtcdServer:
    """One etcd member. ``url`` is what Mooncake takes: ``etcd://host:port``."""

    def __init__(self, host: str, port: int, exec_prefix: Sequence[str] = ()) -> None:
        self.host, self.port = host, port
        self._exec = list(exec_prefix)  # e.g. ["ip", "netns", "exec", NAME]
        self._dir = Path(tempfile.mkdtemp(prefix="kvguard-etcd-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, timeout: float = 20.0) -> EtcdServer:
        peer = f"http://{self.host}:{self.port + 1}"
        self._proc = subprocess.Popen(
            [
                *self._exec,
                ETCD,
                "--name",
                "kvguard-test",
                "--data-dir",
                str(self._dir / "data"),
                "--listen-client-urls",
                self.client_url,
                "--advertise-client-urls",
                self.client_url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"kvguard-test={peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self._dir / "etcd.log", "wb"),  # noqa: SIM115 - closed with the process
        )
        end = time.monotonic() + timeout
        while not self._healthy():
            if self._proc.poll() is not None or time.monotonic() > end:
                log = (self._dir / "etcd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"etcd pid {self._proc.pid} did not become healthy:\n{log}")
            time.sleep(0.1)
        return self

    def _call(self, path: str, body: dict[str, object]) -> dict[str, object]:
        argv = [
            *self._exec,
            "python3",
            "-c",
            "import sys, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
            "sys.argv[1], data=sys.argv[2].encode(), method='POST'), timeout=3); "
            "sys.stdout.write(r.read().decode())",
            self.client_url + path,
            json.dumps(body),
        ]
        if not self._exec:  # no namespace to enter: ask directly
            req = urllib.request.Request(
                self.client_url + path, data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(req, timeout=3) as r:
                return dict(json.loads(r.read()))
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
        return dict(json.loads(out.stdout))

    def _healthy(self) -> bool:
        try:
            self._call("/v3/kv/range", {"key": _b64("kvguard-health")})
        except (OSError, ValueError, subprocess.SubprocessError):
            return False
        return True

    def keys(self, prefix: str = "") -> list[str]:
        body: dict[str, object] = {
            "key": _b64(prefix or "\0"),
            "range_end": _prefix_end(prefix) if prefix else _b64("\0"),
            "keys_only": True,
        }
        reply = self._call("/v3/kv/range", body)
        kvs = reply.get("kvs") or []
        assert isinstance(kvs, list)
        return sorted(base64.b64decode(kv["key"]).decode() for kv in kvs)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; how many there were."""
        reply = self._call(
            "/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        )
        return int(str(reply.get("deleted", 0)))

    def stop(self) -> None:
        """SIGKILL by pid and reap: tests own what they start."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def etcd_server(host: str = "127.0.0.1", port: int | None = None) -> Iterator[EtcdServer]:
    import socket

    if port is None:
        with socket.socket() as s:  # a free even/odd pair is likely next to a free port
            s.bind((host, 0))
            port = s.getsockname()[1]
    with EtcdServer(host, port) as server:
        yield server
