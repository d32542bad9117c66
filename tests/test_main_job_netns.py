"""The main job across two hosts: ``kvguard decode`` in one network namespace,
``kvguard run --decode`` in the other, in each metadata mode (issue 12).

etcd runs inside the decode namespace on its veth address (Debian's
``etcd-server``, a temporary data directory, stopped by pid). Every case
checks what ``kvguard run`` itself checks and reports in its ``--json``
summary -- every request terminal, nothing released before the engine let
go of it, every DONE request verified byte for byte -- and that nothing is
left running: the namespaces are deleted with whatever still runs inside.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_helpers import EtcdServer, etcd_unavailable
from mooncake_helpers import requires_mooncake
from netns_helpers import NetnsPair, netns_metadata_server, netns_unavailable

from transfer.metadata import metadata_keys

UNAVAILABLE = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.mooncake,
    requires_mooncake,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]
needs_etcd = pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))

REPO = Path(__file__).resolve().parents[1]
SHAPE = ["--layers=2", "--blocks=256", "--block-bytes=4096"]
ENV = {**os.environ, "MC_FORCE_TCP": "1", "PYTHONPATH": str(REPO)}
CONTROL_PORT = 17555  # the namespace is ours: nothing else listens there
ENGINE_NAME_PORT = 17777  # the decode's session name in a metadata mode


@contextlib.contextmanager
def decode_service(pair: NetnsPair, metadata: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvguard decode`` in the decode namespace; yields (process, control address)."""
    name = ["--ip", f"{pair.decode.addr}:{ENGINE_NAME_PORT}"] if metadata != "P2PHANDSHAKE" else []
    proc = subprocess.Popen(
        [
            *pair.exec_argv(pair.decode),
            sys.executable,
            "-m",
            "kvguard.cli",
            "decode",
            f"--listen={pair.decode.addr}:{CONTROL_PORT}",
            f"--metadata={metadata}",
            *name,
            *SHAPE,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        found = re.search(r"listening on tcp://(\S+) for engine session", line)
        assert found, f"kvguard decode did not start: {line!r} {proc.stderr.read()[-2000:]}"
        yield proc, found.group(1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def start_run(
    pair: NetnsPair, address: str, metadata: str, tmp: Path, *args: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    summary, journal = tmp / "summary.json", tmp / "journal.jsonl"
    for f in (summary, journal):
        f.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            *pair.exec_argv(pair.prefill),
            sys.executable,
            "-m",
            "kvguard.cli",
            "run",
            f"--decode={address}",
            f"--metadata={metadata}",
            "--blocks-per-request=8",
            "--no-progress",
            f"--json={summary}",
            f"--journal={journal}",
            *SHAPE,
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    return proc, summary, journal


def finish(proc: subprocess.Popen[str], summary: Path, timeout: float = 180) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert summary.exists(), out[-3000:]
    result: dict[str, Any] = json.loads(summary.read_text())
    result["_rc"], result["_out"] = proc.returncode, out[-3000:]
    return result


def wait_started(journal: Path, transitions: int, timeout: float = 60) -> None:
    """Until the run has journaled ``transitions`` transitions (it is mid-run)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if journal.exists() and journal.read_text().count("\n") >= transitions:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run journaled fewer than {transitions} transitions")


def assert_job_ok(result: dict[str, Any], requests: int) -> None:
    """What kvguard run promises, from its own summary."""
    assert result["_rc"] == 0, result["_out"]
    assert result["done"] + result["failed"] == requests, result
    assert result["non_terminal"] == 0, result
    assert result["released_before_quiesce"] == 0, result
    assert result["integrity_errors"] == 0, result
    assert (result["unverified"], result["unverified_alive"]) == (0, 0), result
    assert result["verified"] == result["done"], result


@contextlib.contextmanager
def metadata_store(pair: NetnsPair, mode: str) -> Iterator[tuple[str, EtcdServer | None]]:
    if mode == "p2p":
        yield "P2PHANDSHAKE", None
    elif mode == "http":
        pytest.importorskip("aiohttp")  # the wheel's HTTP metadata server needs it
        with netns_metadata_server(pair, pair.decode) as url:
            yield url, None
    else:
        etcd = EtcdServer(pair.decode.addr, 2379, pair.exec_argv(pair.decode))
        with etcd:
            yield etcd.url, etcd


@pytest.mark.parametrize("mode", ["p2p", "http", pytest.param("etcd", marks=needs_etcd)])
def test_each_metadata_mode_verifies_every_request(tmp_path: Path, mode: str) -> None:
    with NetnsPair() as pair, metadata_store(pair, mode) as (url, etcd):
        with decode_service(pair, url) as (service, address):
            if etcd is not None:  # the decode published itself in the store
                name = f"{pair.decode.addr}:{ENGINE_NAME_PORT}"
                assert set(metadata_keys(name)) <= set(etcd.keys("mooncake/"))
            proc, summary, _ = start_run(pair, address, url, tmp_path, "--requests=60")
            result = finish(proc, summary)
            assert_job_ok(result, 60)
            assert result["done"] == 60
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=30) == 0
        if etcd is not None:  # a clean stop takes its keys with it
            assert etcd.keys("mooncake/rpc_meta/" + pair.decode.addr) == []


@needs_etcd
def test_link_cut_and_restored_mid_run_over_etcd(tmp_path: Path) -> None:
    with (
        NetnsPair() as pair,
        metadata_store(pair, "etcd") as (url, _),
        decode_service(pair, url) as (_, address),
    ):
        proc, summary, journal = start_run(
            pair, address, url, tmp_path, "--requests=300", "--deadline=1"
        )
        wait_started(journal, 40)
        pair.set_link(False, pair.decode)  # a silent partition: only timeouts tell
        time.sleep(3)
        pair.set_link(True, pair.decode)
        result = finish(proc, summary)
        # Restored: the same decode service serves the next run in full.
        again_proc, again_summary, _ = start_run(
            pair, address, url, tmp_path / "again", "--requests=30"
        )
        again = finish(again_proc, again_summary)
    assert_job_ok(again, 30)
    assert again["done"] == 30
    assert_job_ok(result, 300)
    # Requests caught by the cut end at their deadline (TIMEOUT) or as PEER_LOST;
    # after the restore new requests go through again.
    assert result["done"] > 0 and result["failed"] > 0, result
    assert set(result["by_reason"]) <= {"TIMEOUT", "PEER_LOST"}, result
    keys = ("done", "failed", "by_reason", "p50_ms", "p99_ms", "wall_s")
    print("link cut 3 s mid-run:", json.dumps({k: result[k] for k in keys}))


@needs_etcd
def test_decode_restarted_under_its_name_after_sigkill_behind_etcd(tmp_path: Path) -> None:
    with NetnsPair() as pair, metadata_store(pair, "etcd") as (url, etcd):
        assert etcd is not None
        name = f"{pair.decode.addr}:{ENGINE_NAME_PORT}"
        with decode_service(pair, url) as (service, address):
            proc, summary, _ = start_run(pair, address, url, tmp_path, "--requests=30")
            assert_job_ok(finish(proc, summary), 30)
            os.kill(service.pid, signal.SIGKILL)  # no destructor: its keys stay behind
            service.wait()
        assert set(metadata_keys(name)) <= set(etcd.keys("mooncake/"))
        t0 = time.monotonic()
        with decode_service(pair, url) as (service, address):  # same name, same port
            restarted_s = time.monotonic() - t0
            proc, summary, _ = start_run(pair, address, url, tmp_path, "--requests=30")
            result = finish(proc, summary)
            assert_job_ok(result, 30)
            assert result["done"] == 30
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=30) == 0
    print(f"restart under {name}: serving again {restarted_s:.1f}s after the restart began")


@needs_etcd
def test_etcd_stopped_mid_run(tmp_path: Path) -> None:
    with NetnsPair() as pair, metadata_store(pair, "etcd") as (url, etcd):
        assert etcd is not None
        with decode_service(pair, url) as (service, address):
            proc, summary, journal = start_run(
                pair, address, url, tmp_path, "--requests=300", "--deadline=1"
            )
            wait_started(journal, 40)
            etcd.stop()  # SIGKILL by pid, mid-run
            stopped_at = time.monotonic()
            result = finish(proc, summary)
            ended_s = time.monotonic() - stopped_at
            # The decode service outlives its store: it still serves and stops cleanly.
            service.send_signal(signal.SIGTERM)
            assert service.wait(timeout=60) == 0
    assert_job_ok(result, 300)
    print(
        f"etcd stopped mid-run: done {result['done']} failed {result['failed']} "
        f"{result['by_reason']}; the run ended {ended_s:.1f}s later"
    )
