"""Interpreter exit: engines kept alive end without aborting, and pytest ends normally.

A library thread that returns from a GIL-releasing engine call while the
interpreter finalizes is ended by CPython with pthread_exit, whose unwind
meets a noexcept frame of the engine's binding: std::terminate, status 134.
``ENGINE_EXIT`` ends those threads from an atexit hook. The embedding program
(``embed_exit.py``) makes that return certain: it kills its frozen peer from
module teardown, with an engine quarantined and a probe of the peer stuck.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import coverage
import pytest
from mooncake_helpers import requires_mooncake, wait_until
from structlog.testing import capture_logs

from transfer import _engine
from transfer._engine import ExitGate

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def _kill_if_decode_child(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a decode service (the program's frozen child)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"kvguard.decode.service" in cmdline:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)


@pytest.mark.mooncake
@requires_mooncake
@pytest.mark.parametrize("status", [0, 3])
def test_an_application_exits_with_its_status_while_an_engine_is_quarantined(
    status: int,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "embed_exit.py"), str(status)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out.decode().splitlines()
    peer = [int(line.split()[1]) for line in lines if line.startswith("peer ")]
    for pid in peer:
        _kill_if_decode_child(pid)
    stderr = err.decode(errors="replace")
    assert "terminate called" not in stderr, stderr[-2000:]
    assert proc.returncode == status, (proc.returncode, out.decode()[-2000:], stderr[-2000:])
    # Non-vacuous: the engine still held the entries and a probe was stuck at
    # exit, and the program's own atexit and finalization both ran, in order.
    assert "probe silent" in lines and "quarantined 1" in lines, lines
    order = [
        line
        for line in lines
        if line in ("app atexit ran", "finalizer killed the peer", "finalizer done")
    ]
    assert order == ["app atexit ran", "finalizer killed the peer", "finalizer done"], lines
    assert any(
        "engine_calls_unblocked_at_exit" in line and "sockets_shut=1" in line for line in lines
    )


@pytest.mark.mooncake
@requires_mooncake
def test_after_the_exit_hook_a_backend_refuses_work_and_its_loop_has_ended() -> None:
    program = """
from transfer import BackendClosed, KVCache, KVLayout, build_plan
from transfer._engine import ENGINE_EXIT
from transfer.mooncake import MooncakeBackend

src = KVCache(KVLayout(1, 4, 4096))
b = MooncakeBackend("127.0.0.1")
b.register(src)
peer = KVCache(src.layout).peer_info("127.0.0.1:1")
b.add_peer(peer)
assert ENGINE_EXIT.close() == (0, 0)
assert not b._loop.thread.is_alive()
op = b.submit(build_plan(src, peer, [0], [0]))
assert op.done and op.quiesced and isinstance(op.error, BackendClosed), op.error
print("refused:", op.error)
b.close()
print("engine released:", b.engine is None and b._loop._engine is None)
"""
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stdout.decode().splitlines()
    assert "refused: the interpreter is exiting" in lines, lines
    assert "engine released: True" in lines, lines


def _blocked_reading(thread: threading.Thread) -> bool:
    reads = _engine._READ_SYSCALLS[os.uname().machine]
    path = f"/proc/self/task/{thread.native_id}/syscall"
    return _engine._blocked_read_fd(path, reads) is not None


def test_exit_gate_shuts_down_the_socket_a_tracked_thread_blocks_reading(all_levels: None) -> None:
    ours, theirs = socket.socketpair()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(ours.recv(1)), daemon=True)
    gate = ExitGate()
    gate.track(reader)
    reader.start()
    try:
        assert wait_until(lambda: _blocked_reading(reader), 5.0)
        with capture_logs() as logs:
            assert gate.close() == (1, 0)
        assert got == [b""]  # the read ended: the socket was shut down, not closed
        assert ours.fileno() >= 0
        assert [e["event"] for e in logs] == ["engine_calls_unblocked_at_exit"]
        assert gate.closing
        assert gate.close() == (0, 0)  # idempotent: nothing left to end
    finally:
        ours.close()
        theirs.close()


def test_exit_gate_wakes_a_tracked_thread_that_waits_for_work() -> None:
    wake = threading.Event()
    gate = ExitGate()
    waiter = threading.Thread(target=wake.wait, daemon=True)
    gate.track(waiter, wake.set)
    waiter.start()
    assert gate.close() == (0, 0)
    assert wake.is_set() and not waiter.is_alive()


def test_exit_gate_leaves_a_thread_blocked_on_anything_but_a_socket(
    monkeypatch: pytest.MonkeyPatch, all_levels: None
) -> None:
    monkeypatch.setattr(_engine, "_EXIT_WAIT_S", 0.3)
    r, w = os.pipe()
    got: list[bytes] = []
    reader = threading.Thread(
        target=lambda: got.append(os.read(r, 1)), name="pipe-reader", daemon=True
    )
    gate = ExitGate()
    gate.track(reader)
    reader.start()
    try:
        assert wait_until(lambda: _blocked_reading(reader), 5.0)
        with capture_logs() as logs:
            assert gate.close() == (0, 1)
        assert [(e["event"], e["threads"]) for e in logs] == [
            ("engine_threads_alive_at_exit", ["pipe-reader"])
        ]
        os.write(w, b"x")  # the pipe is intact: the thread reads what comes
        reader.join(5.0)
        assert got == [b"x"]
    finally:
        os.close(r)
        os.close(w)


def test_coverage_run_of_pytest_writes_its_data(tmp_path: Path) -> None:
    # pytest ends through its own cleanup and atexit, so coverage saves its data.
    data = tmp_path / ".coverage"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "coverage",
            "run",
            f"--data-file={data}",
            "--source=lifecycle",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_lifecycle.py",
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    assert data.is_file()
    measured = coverage.CoverageData(basename=str(data))
    measured.read()
    machine = str(ROOT / "lifecycle" / "_lifecycle.py")
    assert machine in measured.measured_files(), sorted(measured.measured_files())
    assert measured.lines(machine), "no line of lifecycle/_lifecycle.py was recorded"
