"""Stale metadata keys of a killed engine, cleared before a restart under its name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from etcd_helpers import etcd_server, etcd_unavailable

from transfer.metadata import MetadataMode, clear_stale, metadata_keys, mode_of


@pytest.mark.parametrize(
    ("conn", "mode"),
    [
        ("P2PHANDSHAKE", MetadataMode.P2P),
        ("http://10.0.0.2:8080/metadata", MetadataMode.HTTP),
        ("etcd://10.0.0.2:2379", MetadataMode.ETCD),
        ("10.0.0.2:2379", MetadataMode.ETCD),  # the engine's default scheme
        ("redis://h:6379", MetadataMode.REDIS),
    ],
)
def test_mode_of(conn: str, mode: MetadataMode) -> None:
    assert mode_of(conn) is mode


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(ValueError, match="'gopher://x'"):
        mode_of("gopher://x")


def test_keys_follow_the_cluster_id(monkeypatch: pytest.MonkeyPatch) -> None:
    assert metadata_keys("h:1") == ("mooncake/rpc_meta/h:1", "mooncake/ram/h:1")
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "blue/")
    assert metadata_keys("h:1") == ("mooncake/blue/rpc_meta/h:1", "mooncake/blue/ram/h:1")


def test_p2p_has_nothing_to_clear() -> None:
    assert clear_stale("P2PHANDSHAKE", "127.0.0.1:1") == 0


@pytest.mark.mooncake
@pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))
def test_a_killed_engine_leaves_keys_that_block_its_name_until_cleared() -> None:
    code = textwrap.dedent(
        """
        import os, sys, time
        os.environ["MC_FORCE_TCP"] = "1"
        from mooncake.engine import TransferEngine
        e = TransferEngine()
        print(e.initialize(sys.argv[1], sys.argv[2], "tcp", ""), flush=True)
        time.sleep(60)
        """
    )
    name = "127.0.0.1:17321"
    with etcd_server() as etcd:
        first = subprocess.Popen(
            [sys.executable, "-c", code, name, etcd.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert first.stdout is not None and first.stdout.readline().strip() == "0"
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
        assert etcd.keys("mooncake/") == sorted(metadata_keys(name))  # left behind
        assert clear_stale(etcd.url, name) == 2
        assert etcd.keys("mooncake/") == []
        third = subprocess.run(
            [sys.executable, "-c", code.replace("time.sleep(60)", ""), name, etcd.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert third.stdout.strip() == "0"  # the name is usable again
