"""Process fixtures for the real-engine tests.

The prefill side runs in the test process (a ``MooncakeBackend``); every
decode peer is a ``python -m kvguard.decode.service`` child owned by pid through
``ReceiverProcess``, so a test can kill or freeze it. Everything started here
is stopped in a ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvguard.decode.service import ReceiverProcess
from transfer import KVCache, KVLayout
from transfer.mooncake import MooncakeBackend, import_engine
from transfer.peer_protocol import block_digests


def _mooncake_importable() -> bool:
    try:
        import_engine()  # quiet: the engine's glog lines only with KVGUARD_ENGINE_LOG=1
    except ImportError:
        return False
    return True


MOONCAKE = _mooncake_importable()
# In CI (CI set, as .ci/run does) a missing engine is a failure: the tests run
# and fail with the EngineError that says what is missing, instead of skipping.
requires_mooncake = pytest.mark.skipif(
    not MOONCAKE and not os.environ.get("CI"),
    reason="mooncake.engine not importable (wheel or libibverbs1 missing)",
)

# The prefill engine's MC_TRANSFER_TIMEOUT: the engine minimum, so a call to a
# frozen peer returns (and its op quiesces) after ~5 s instead of 30 s.
PREFILL_TRANSFER_TIMEOUT_S = 5


@contextlib.contextmanager
def prefill_backend(**kwargs: Any) -> Iterator[MooncakeBackend]:
    """A MooncakeBackend in this process, closed on exit."""
    kwargs.setdefault("transfer_timeout_s", PREFILL_TRANSFER_TIMEOUT_S)
    backend = MooncakeBackend(**kwargs)
    try:
        yield backend
    finally:
        backend.close()


@contextlib.contextmanager
def receiver(
    layout: KVLayout, backend: MooncakeBackend | None = None, **kwargs: Any
) -> Iterator[ReceiverProcess]:
    """A started receiver child, added to ``backend`` as a peer; killed and
    reaped by pid on exit."""
    with ReceiverProcess(layout, **kwargs) as proc:
        if backend is not None:
            backend.add_peer(proc.peer)
        try:
            yield proc
        finally:
            if backend is not None:
                backend.remove_peer(proc.peer.session_id)


def assert_intact(
    src: KVCache, peer: ReceiverProcess, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> None:
    """Every destination block equals its source block, byte for byte (I7)."""
    want = block_digests(src, src_blocks)
    got = peer.checksums(dst_blocks)
    bad = [d for d, w, g in zip(dst_blocks, want, got, strict=True) if w != g]
    assert not bad, f"{len(bad)} of {len(dst_blocks)} destination blocks differ: {bad[:10]}"


def zero_digest(layout: KVLayout) -> str:
    """The digest of an all-zero block."""
    return block_digests(
        KVCache(KVLayout(layout.num_layers, 1, layout.block_bytes, layout.kv_split)), [0]
    )[0]


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def http_metadata_server(timeout: float = 20.0) -> Iterator[str]:
    """The wheel's HTTP metadata server in a child; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host=127.0.0.1",
            f"--port={port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/metadata"
    try:

        def up() -> bool:
            try:
                urllib.request.urlopen(f"{url}?key=probe", timeout=0.5)
            except urllib.error.HTTPError:
                return True  # 404 for an unknown key: it answers
            except OSError:
                return False
            return True

        if not wait_until(up, timeout, 0.05):
            raise TimeoutError(f"metadata server pid {proc.pid} not up within {timeout}s")
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# A decode service's cache: small enough for a test, the flags of `kvguard decode`.
SMALL = {"layers": 2, "blocks": 64, "block_bytes": 4096}


def decode_service(*extra: str) -> tuple[subprocess.Popen[str], str]:
    """A ``kvguard decode --listen=127.0.0.1:0`` child of ``SMALL``'s layout
    (plus ``extra`` flags) and the address it listens on, once it does."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard.cli",
            "decode",
            "--listen=127.0.0.1:0",
            f"--layers={SMALL['layers']}",
            f"--blocks={SMALL['blocks']}",
            f"--block-bytes={SMALL['block_bytes']}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "MC_FORCE_TCP": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once it listens
    match = re.search(r"listening on tcp://(\S+) for engine session", line)
    if match is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"kvguard decode did not start: {line!r}")
    return proc, match.group(1)
