"""Two hosts on one machine: network namespaces joined by a veth pair.

``NetnsPair`` creates two namespaces (prefill and decode), each with ``lo``
up and one end of a veth pair carrying a private address (10.241.x.1/24 and
10.241.x.2/24). Everything lives inside namespaces it created: the host's
interfaces and routes are never touched. ``close()`` kills every process
still inside either namespace (``ip netns pids``) and deletes both, which
deletes the veth pair with them.

Both sides run as child processes inside their namespace (``ip netns exec``
execs, so the child's pid is the Python process itself and is killed by pid):

* decode: ``python -m kvguard.decode.service --ip <addr>`` (``netns_receiver``);
* prefill: this file run as a script (``PrefillDriver``): a MooncakeBackend
  bound to its namespace's address and a ``Scheduler``, driven by one JSON
  command per stdin line, answering one JSON line each on stdout.

Every timestamp the driver reports is ``time.monotonic()``: CLOCK_MONOTONIC
is system-wide (network namespaces do not change clocks), so the test
process compares them with its own.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler import MetricsSnapshot

IP = shutil.which("ip") or "/usr/sbin/ip"
DRIVER = Path(__file__).resolve()

# -- availability ---------------------------------------------------------------------


@functools.cache
def netns_unavailable() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"kvgprobe{os.getpid()}{random.randrange(1 << 16):04x}"
    add = subprocess.run([IP, "netns", "add", name], capture_output=True, text=True)
    if add.returncode != 0:
        return f"`ip netns add` failed: {add.stderr.strip() or add.returncode}"
    subprocess.run([IP, "netns", "del", name], capture_output=True)
    return None


# -- the namespaces -------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def netns_pids(name: str) -> list[int]:
    proc = _ip("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


_OURS = re.compile(r"^kvg(\d+)x[0-9a-f]{4}[pd]$")


def _delete_netns(name: str) -> None:
    """Kill every process inside ``name`` (by pid), then delete it."""
    for _ in range(50):
        pids = netns_pids(name)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces left by test runs whose process no longer exists."""
    stale = [
        name
        for name in netns_list()
        if (m := _OURS.match(name)) is not None and not os.path.exists(f"/proc/{m.group(1)}")
    ]
    for name in stale:
        _delete_netns(name)
    return stale


@dataclass(frozen=True, slots=True)
class Side:
    netns: str
    veth: str
    addr: str  # without the prefix length


class NetnsPair:
    """Two namespaces joined by a veth pair; a context manager that always cleans up."""

    prefill: Side
    decode: Side

    def __init__(self) -> None:
        # The creator's pid is in the name: a run killed before its cleanup
        # leaves namespaces that the next run recognises and removes.
        tag = f"{os.getpid()}x{random.randrange(1 << 16):04x}"
        net = random.randrange(1, 255)  # namespaced, so it can never clash with the host
        self.prefill = Side(f"kvg{tag}p", "kvgp", f"10.241.{net}.1")
        self.decode = Side(f"kvg{tag}d", "kvgd", f"10.241.{net}.2")
        self._created: list[str] = []

    def __enter__(self) -> NetnsPair:
        try:
            self.create()
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

    def create(self) -> None:
        sweep_stale()
        p, d = self.prefill, self.decode
        for side in (p, d):
            _ip("netns", "add", side.netns)
            self._created.append(side.netns)
            _ip("-n", side.netns, "link", "set", "lo", "up")
        # Created inside the prefill namespace with its peer end born in the
        # decode namespace: the veth pair never exists in the host namespace.
        _ip("-n", p.netns, "link", "add", p.veth, "type", "veth", "peer", "name", d.veth)
        _ip("-n", p.netns, "link", "set", d.veth, "netns", d.netns)
        for side in (p, d):
            _ip("-n", side.netns, "addr", "add", f"{side.addr}/24", "dev", side.veth)
            _ip("-n", side.netns, "link", "set", side.veth, "up")

    def set_link(self, up: bool, side: Side | None = None) -> None:
        """Bring one end of the veth up or down; either end down cuts both directions.

        Down on the prefill end removes its route: connects fail at once with
        ENETUNREACH. Down on the decode end leaves the prefill side a route
        into a dead wire: packets vanish silently, like a partition behind a
        switch, and only timeouts tell.
        """
        side = side or self.prefill
        _ip("-n", side.netns, "link", "set", side.veth, "up" if up else "down")

    def exec_argv(self, side: Side) -> list[str]:
        return [IP, "netns", "exec", side.netns]

    def close(self) -> None:
        """Kill whatever still runs inside, then delete both namespaces. Idempotent."""
        for name in reversed(self._created):
            _delete_netns(name)
        self._created.clear()


@contextlib.contextmanager
def netns_metadata_server(pair: NetnsPair, side: Side, timeout: float = 20.0) -> Iterator[str]:
    """The wheel's HTTP metadata server inside ``side``'s namespace, on its veth address.

    Yields the metadata URL; the server is killed by pid and reaped on exit.
    """
    port = random.randrange(20000, 30000)  # the namespace is ours: nothing else listens
    proc = subprocess.Popen(
        [
            *pair.exec_argv(side),
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            f"--host={side.addr}",
            f"--port={port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + timeout
        while True:
            listening = subprocess.run(
                [*pair.exec_argv(side), "ss", "-Hltn", f"sport = :{port}"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if listening:
                break
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"metadata server pid {proc.pid} not listening on :{port}")
            time.sleep(0.1)
        yield f"http://{side.addr}:{port}/metadata"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def metadata_delete(pair: NetnsPair, side: Side, url: str, key: str) -> int:
    """DELETE ``key`` on the metadata server at ``url``, from inside ``side``; the HTTP status.

    A process killed with SIGKILL never removes its ``mooncake/rpc_meta/<name>``
    key, and the wheel's server refuses to register that name again while the
    key exists: whoever restarts the process deletes it first.
    """
    code = (
        "import sys, urllib.error, urllib.parse, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '?key=' + "
        "urllib.parse.quote(sys.argv[2], safe=''), method='DELETE')\n"
        "try:\n"
        "    print(urllib.request.urlopen(req, timeout=5).status)\n"
        "except urllib.error.HTTPError as exc:\n"
        "    print(exc.code)\n"
    )
    out = subprocess.run(
        [*pair.exec_argv(side), sys.executable, "-c", code, url, key],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout.strip() or -1)


# -- the decode side ------------------------------------------------------------------


def netns_receiver(pair: NetnsPair, layout: Any, *, ip: str | None = None, **kwargs: Any) -> Any:
    """A ReceiverProcess (not started) whose child runs inside the decode namespace.

    ``ip`` defaults to the decode side's veth address (with a metadata
    server: the session name, ``"addr:port"``).
    """
    from kvguard.decode.service import ReceiverProcess

    proc = ReceiverProcess(layout, ip=ip or pair.decode.addr, **kwargs)
    # `ip netns exec` execs the command: the pid ReceiverProcess owns and
    # kills is still the receiver's own.
    proc._argv = [*pair.exec_argv(pair.decode), *proc._argv]
    return proc


# -- the prefill side: parent half -----------------------------------------------------

_EOF = b""


class PrefillDriver:
    """This file as a child process inside the prefill namespace; owned by pid."""

    def __init__(
        self,
        pair: NetnsPair,
        layout: Any,
        *,
        workers: int = 4,
        probe_interval_s: float = 0.25,
        probe_timeout_s: float = 1.0,
        transfer_timeout_s: int = 5,
        metadata: str = "P2PHANDSHAKE",
        local_ip: str | None = None,
        ready_timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._argv = [
            *pair.exec_argv(pair.prefill),
            sys.executable,
            str(DRIVER),
            f"--ip={local_ip or pair.prefill.addr}",
            f"--metadata={metadata}",
            f"--layers={layout.num_layers}",
            f"--blocks={layout.num_blocks}",
            f"--block-bytes={layout.block_bytes}",
            f"--workers={workers}",
            f"--probe-interval={probe_interval_s}",
            f"--probe-timeout={probe_timeout_s}",
            f"--transfer-timeout={transfer_timeout_s}",
        ]
        self._ready_timeout_s = ready_timeout_s
        self._env = {**os.environ, "MC_FORCE_TCP": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- closed by close()
        self.session_id = ""

    def __enter__(self) -> PrefillDriver:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
        )
        assert self._proc.stdout is not None
        self._reader = threading.Thread(
            target=_pump, args=(self._proc.stdout, self._lines), daemon=True
        )
        self._reader.start()
        ready = self._reply(self._ready_timeout_s, "its ready line")
        self.session_id = str(ready["session_id"])

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def request(self, cmd: str, *, reply_timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        proc.stdin.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        proc.stdin.flush()
        return self._reply(reply_timeout, f"a reply to {cmd!r}")

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"prefill driver sent no {what} in {timeout}s; stderr: {self.stderr_tail()}"
            ) from None
        if line == _EOF:
            self._lines.put(_EOF)
            raise RuntimeError(f"prefill driver exited before {what}; stderr: {self.stderr_tail()}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"prefill driver error: {reply}; stderr: {self.stderr_tail()}")
        return reply

    def stderr_tail(self, limit: int = 3000) -> str:
        if self._stderr.closed:
            return ""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read().decode(errors="replace")

    def close(self) -> None:
        """Kill (by pid) and reap the child; release pipes and the stderr file. Idempotent."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)
        if not self._stderr.closed:
            self._stderr.close()


def _pump(stdout: IO[bytes], lines: queue.Queue[bytes]) -> None:
    try:
        for line in iter(stdout.readline, b""):
            lines.put(line)
    except (OSError, ValueError):
        pass
    finally:
        lines.put(_EOF)


# -- the prefill side: child half ------------------------------------------------------


@dataclass(slots=True)
class _Record:
    rid: str
    src: list[int]
    dst: list[int]
    slot: int
    submitted_at: float
    deadline_at: float
    terminal_at: float | None = None
    state: str | None = None
    reason: str | None = None
    error: str | None = None
    released_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "src": self.src,
            "dst": self.dst,
            "submitted_at": self.submitted_at,
            "deadline_at": self.deadline_at,
            "terminal_at": self.terminal_at,
            "state": self.state,
            "reason": self.reason,
            "error": self.error,
            "released_at": self.released_at,
        }


class _Driver:
    """A scheduler over a MooncakeBackend, driven one JSON command at a time."""

    def __init__(self, args: argparse.Namespace) -> None:
        from scheduler import Finished, RetryPolicy, Scheduler
        from transfer import KVCache, KVLayout
        from transfer.mooncake import MooncakeBackend

        self.layout = KVLayout(args.layers, args.blocks, args.block_bytes)
        self.backend = MooncakeBackend(
            args.ip,
            metadata=args.metadata,
            transfer_timeout_s=args.transfer_timeout,
            probe_timeout_s=args.probe_timeout,
        )
        self.src = KVCache(self.layout)
        self.src.fill_seeded(11)
        self.backend.register(self.src)
        self.blocks_per_request = 8
        self._lock = threading.Lock()
        self._free = list(range(self.layout.num_blocks // self.blocks_per_request))
        self._slot_free = threading.Condition(self._lock)
        self._records: dict[str, _Record] = {}
        self._rng = random.Random(3)
        self._load: threading.Thread | None = None
        self._load_stop = threading.Event()
        self._load_error: str | None = None

        def release(rid: str, fin: Finished) -> None:
            with self._lock:
                rec = self._records[rid]
                rec.released_at = time.monotonic()
                self._free.append(rec.slot)
                self._slot_free.notify_all()

        self.sched = Scheduler(
            self.backend,
            self.src,
            workers=args.workers,
            default_deadline_s=5.0,
            retry=RetryPolicy(max_attempts=2),
            release=release,
            probe_interval_s=args.probe_interval,
        )
        self.sched.add_observer(self._on_finished)

    def _on_finished(self, fin: Any) -> None:
        now = time.monotonic()
        with self._lock:
            rec = self._records.get(fin.request_id)
            if rec is None:  # submit() failed fast before the record was stored
                return
            rec.terminal_at = now
            rec.state = fin.state.name
            rec.reason = fin.reason.name if fin.reason is not None else None
            rec.error = repr(fin.error)[:300] if fin.error is not None else None

    # -- submitting ---------------------------------------------------------------

    def _submit_one(self, rid: str, peer: str, deadline_s: float, wait: float) -> bool:
        with self._slot_free:
            if not self._slot_free.wait_for(lambda: bool(self._free), wait):
                return False
            slot = self._free.pop(0)
        k = self.blocks_per_request
        first = self._rng.randrange(self.layout.num_blocks - k + 1)
        src = list(range(first, first + k))
        dst = list(range(slot * k, slot * k + k))
        now = time.monotonic()
        rec = _Record(rid, src, dst, slot, now, now + deadline_s)
        with self._lock:
            self._records[rid] = rec
        # The observer may fire inside submit() (a peer known lost): the
        # record exists first, so the outcome is never lost.
        self.sched.submit(rid, src, dst, peer=peer, deadline_s=deadline_s)
        return True

    def _load_loop(self, prefix: str, peer: str, window: int, deadline_s: float) -> None:
        n = 0
        try:
            while not self._load_stop.is_set():
                with self._lock:
                    live = sum(
                        1
                        for r in self._records.values()
                        if r.rid.startswith(prefix) and r.terminal_at is None
                    )
                if live >= window:
                    time.sleep(0.002)
                    continue
                if self._submit_one(f"{prefix}{n:06d}", peer, deadline_s, 0.05):
                    n += 1
                    time.sleep(0.002)  # a serving loop's pace, not a busy loop
        except Exception as exc:  # reported by stop_load
            self._load_error = repr(exc)

    # -- commands -----------------------------------------------------------------

    def handle(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        from transfer.peer_protocol import block_digests, peer_info_from_message

        cmd = msg["cmd"]
        if cmd == "add_peer":
            info = peer_info_from_message(bytes.fromhex(msg["message"]))
            self.sched.add_peer(info)
            return {"session_id": info.session_id}
        if cmd == "batch":
            rids = []
            for i in range(int(msg["count"])):
                rid = f"{msg['prefix']}{i:06d}"
                if not self._submit_one(rid, msg["peer"], float(msg["deadline_s"]), 30.0):
                    raise RuntimeError(f"no free destination slot for {rid}")
                rids.append(rid)
            return {"rids": rids}
        if cmd == "start_load":
            self._load_stop.clear()
            self._load = threading.Thread(
                target=self._load_loop,
                args=(msg["prefix"], msg["peer"], int(msg["window"]), float(msg["deadline_s"])),
                daemon=True,
            )
            self._load.start()
            return {}
        if cmd == "stop_load":
            self._load_stop.set()
            if self._load is not None:
                self._load.join(10.0)
            return {"error": self._load_error}
        if cmd == "wait_terminal":
            # Every request submitted so far terminal (not yet released).
            end = time.monotonic() + float(msg["timeout"])
            while time.monotonic() < end:
                with self._lock:
                    if all(r.terminal_at is not None for r in self._records.values()):
                        return {"terminal": True}
                time.sleep(0.01)
            return {"terminal": False}
        if cmd == "drain":
            drained = self.sched.drain(float(msg["timeout"]))
            return {"drained": drained}
        if cmd == "records":
            return {"records": self._records_of(msg.get("prefix", ""))}
        if cmd == "records_and_metrics":
            # One moment's: no release ran between or during the two metrics
            # reads around the records (a quiescence may end a quarantine).
            end = time.monotonic() + float(msg["timeout"])
            while True:
                m = self.sched.metrics()
                recs = self._records_of(msg.get("prefix", ""))
                again = self.sched.metrics()
                moved = (m.released, m.releasing) != (again.released, again.releasing)
                if (not moved and again.releasing == 0) or time.monotonic() > end:
                    return {"records": recs, "metrics": self._metrics_of(again)}
                time.sleep(0.01)
        if cmd == "digests":
            return {"digests": block_digests(self.src, msg["blocks"])}
        if cmd == "peer_alive":
            return {"alive": self.sched.peer_alive(msg["peer"])}
        if cmd == "metrics":
            return self._metrics_of(self.sched.metrics())
        raise ValueError(f"unknown driver command {cmd!r}")

    def _records_of(self, prefix: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_json() for r in self._records.values() if r.rid.startswith(prefix)]

    def _metrics_of(self, m: MetricsSnapshot) -> dict[str, Any]:
        return {
            "done": m.done,
            "failed_by_reason": m.failed_by_reason,
            "live_by_state": m.live_by_state,
            "quarantined": m.quarantined,
            "released": m.released,
            "released_before_quiesce": m.released_before_quiesce,
            "double_releases": m.double_releases,
            "peers_lost": m.peers_lost,
            "backend_in_flight": self.backend.in_flight,
        }

    def close(self) -> None:
        self._load_stop.set()
        self.sched.close(timeout=1.0)
        self.backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvguard prefill driver (netns tests)")
    parser.add_argument("--ip", required=True)
    parser.add_argument("--metadata", default="P2PHANDSHAKE")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--probe-interval", type=float, default=0.25)
    parser.add_argument("--probe-timeout", type=float, default=1.0)
    parser.add_argument("--transfer-timeout", type=int, default=5)
    args = parser.parse_args(argv)

    import logging

    import structlog

    # stdout carries the protocol: log records go to stderr.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    out = sys.stdout
    try:
        driver = _Driver(args)
    except Exception as exc:
        out.write(json.dumps({"ok": False, "error": repr(exc)}) + "\n")
        out.flush()
        return 2
    try:
        ready = {"ok": True, "session_id": driver.backend.session_id, "pid": os.getpid()}
        out.write(json.dumps(ready) + "\n")
        out.flush()
        for line in sys.stdin:
            if not line.strip():
                continue
            msg = json.loads(line)
            if msg.get("cmd") == "exit":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                break
            try:
                reply = {"ok": True, **driver.handle(msg)}
            except Exception as exc:
                reply = {"ok": False, "error": repr(exc)}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
