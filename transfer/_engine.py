"""The Mooncake engine binding: import, environment, construction, return codes.

Everything here touches ``mooncake.engine`` or the process environment the
engine reads; ``mooncake.py`` builds the backend on top. The ``mooncake``
package is imported on first use, so ``transfer`` imports on hosts without
the wheel. ``ENGINE_EXIT`` ends the threads that call the engine before the
interpreter finalizes, and ``keep_forever`` leaks what the engine may still touch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import ipaddress
import os
import re
import socket
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, Final

import structlog
import torch

from .errors import EngineError, RegistrationError
from .metadata import P2P_HANDSHAKE

__all__ = [
    "DEFAULT_MAX_PEER_ENTRIES",
    "DEFAULT_TRANSFER_TIMEOUT_S",
    "ENGINE_CODES",
    "ENGINE_EXIT",
    "ENGINE_LOG_ENV",
    "ENGINE_PEER_LIMITS",
    "MIN_TRANSFER_TIMEOUT_S",
    "P2P_HANDSHAKE",
    "code_name",
    "engine_peer_budget",
    "engine_stderr",
    "import_engine",
    "is_wildcard",
    "keep_forever",
    "location",
    "make_engine",
]

_log = structlog.get_logger("kvguard.transfer")

MIN_TRANSFER_TIMEOUT_S: Final = 5  # the engine clamps MC_TRANSFER_TIMEOUT to at least this
DEFAULT_TRANSFER_TIMEOUT_S: Final = 30
# The TCP transport's per-peer limits (tcp_transport in the engine) and their defaults.
ENGINE_PEER_LIMITS: Final[Mapping[str, int]] = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": 1024,
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": 1024,
}
# Kept for callers that import it: the default budget with the engine defaults.
DEFAULT_MAX_PEER_ENTRIES: Final = sum(ENGINE_PEER_LIMITS.values())
ENGINE_LOG_ENV: Final = "KVGUARD_ENGINE_LOG"  # "1": keep the engine's INFO/WARNING lines

# error.h: what register_memory, unregister_memory, send_probe and initialize
# return. transfer_submit_write returns an id (0 or (uint64)-1 when refused);
# transfer_check_status 0 running, 1 done, -1 failed, -2 timed out.
ENGINE_CODES: Final[Mapping[int, str]] = {
    0: "OK",
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
}


def code_name(rc: int | None) -> str:
    if rc is None:
        return "no answer"
    return f"{rc} {ENGINE_CODES.get(rc, 'unknown code')}"


# torch device type -> engine location string; "{i}" is the device index.
_LOCATIONS: Final[Mapping[str, str]] = {"cpu": "*", "cuda": "cuda:{i}"}

# os.environ is process-global and the engine reads it while it is built.
_ENV_LOCK = threading.Lock()


def import_engine() -> ModuleType:
    """Import ``mooncake.engine`` with its glog INFO/WARNING lines silenced.

    The library reads MC_LOG_LEVEL once, when it loads (measured: setting it
    later, or GLOG_minloglevel at any time, changes nothing). Set
    KVGUARD_ENGINE_LOG=1, or MC_LOG_LEVEL yourself, to keep the engine's lines.
    """
    if os.environ.get(ENGINE_LOG_ENV, "") not in ("1", "true", "yes"):
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return importlib.import_module("mooncake.engine")


# A glog line ("E1202 17:56:57.717640 26389 file.cpp:1098] ...") or glog's
# one-time preamble: what the engine prints to fd 2, bypassing MC_LOG_LEVEL
# for its ERROR-level start-up notes.
_GLOG_LINE: Final = re.compile(
    rb"^(WARNING: Logging before InitGoogleLogging\(\)|[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\])"
)


@contextlib.contextmanager
def engine_stderr() -> Iterator[list[str]]:
    """Keep the engine's glog lines off the terminal while the block runs.

    The engine writes them to fd 2 from C++ (out of sys.stderr's reach): fd 2
    points at a temporary file meanwhile; other writes there are put back, and
    the glog lines go to the caller, to show where they explain (an engine
    that refused to start). KVGUARD_ENGINE_LOG=1 leaves fd 2 alone.
    """
    glog: list[str] = []
    if os.environ.get(ENGINE_LOG_ENV, "") in ("1", "true", "yes"):
        yield glog
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield glog
            finally:
                os.dup2(saved, 2)
            sink.seek(0)
            for line in sink.read(1 << 20).splitlines(keepends=True):
                if _GLOG_LINE.match(line):
                    glog.append(line.decode(errors="replace"))
                else:
                    os.write(2, line)
    finally:
        os.close(saved)


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    return max(low, value)


def engine_peer_budget() -> int:
    """Entries the TCP transport holds per peer: queued plus pending admission."""
    return sum(_env_int(name, default, 1) for name, default in ENGINE_PEER_LIMITS.items())


def make_engine(
    local_ip: str,
    metadata: str,
    protocol: str,
    device_name: str,
    force_tcp: bool,
    transfer_timeout_s: int | None,
) -> tuple[Any, float, int]:
    """The initialized engine, its transfer timeout and its per-peer entry limit."""
    try:
        engine_module = import_engine()
    except ImportError as exc:
        raise EngineError(
            "mooncake.engine is not importable: install kvguard[cpu] (or kvguard[gpu] "
            "on a CUDA host) and the libibverbs1 system package"
        ) from exc
    with _ENV_LOCK:
        saved = os.environ.get("MC_TRANSFER_TIMEOUT")
        if force_tcp:
            os.environ["MC_FORCE_TCP"] = "1"
        if transfer_timeout_s is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
        try:
            # What this engine reads while it is built, read at the same moment.
            timeout_s = _env_int(
                "MC_TRANSFER_TIMEOUT", DEFAULT_TRANSFER_TIMEOUT_S, MIN_TRANSFER_TIMEOUT_S
            )
            budget = engine_peer_budget()
            with engine_stderr() as captured:
                engine = engine_module.TransferEngine()
                rc = engine.initialize(local_ip, metadata, protocol, device_name)
                if rc != 0:
                    engine = None  # its destructor has more to say: capture that too
        finally:
            # Restoring keeps other engines' defaults.
            if saved is None:
                os.environ.pop("MC_TRANSFER_TIMEOUT", None)
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = saved
    if rc != 0:
        said = "".join(captured[-5:])  # the engine's own words on why, kept when it fails
        raise RegistrationError(
            f"TransferEngine.initialize({local_ip!r}, {metadata!r}, {protocol!r}, "
            f"{device_name!r}) returned {code_name(rc)}"
            + (f"; the engine said:\n{said}" if said else ""),
            peer=metadata,
            code=rc,
        )
    return engine, float(timeout_s), budget


def is_wildcard(local_ip: str) -> bool:
    """True for an address that means "every interface": 0.0.0.0, ::, [::]:port, ""."""
    host = local_ip.strip()
    if host.startswith("["):  # [v6]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # v4:port or name:port
        host = host.partition(":")[0]
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return False


def location(device: torch.device) -> str:
    template = _LOCATIONS.get(device.type)
    if template is None:
        raise RegistrationError(f"the engine cannot register {device.type} memory")
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return template.format(i=index)


# -- interpreter exit ---------------------------------------------------------------
#
# send_probe, transfer_submit_write and transfer_check_status release the GIL
# (pybind11's gil_scoped_release) and take it back on return, from that
# object's destructor, which is noexcept. A daemon thread that asks for the
# GIL once the interpreter is finalizing is ended by CPython with
# pthread_exit (3.11, measured), whose forced unwind reaches that noexcept
# frame: std::terminate, "terminate called without an active exception",
# SIGABRT, exit status 134 -- after the application's own atexit ran. A probe
# of a frozen peer sits in send_probe for up to 60 s (the engine's
# SO_RCVTIMEO), and the loop of an engine still holding entries polls it
# until the process ends, so an exit can meet either. ENGINE_EXIT ends them
# from an atexit hook instead, while threads may still take the GIL: no
# engine call starts after it, the loops return, and a call stuck reading a
# socket has that socket shut down so that it returns at once (measured:
# send_probe to a frozen peer returns -102 ERR_SOCKET within a millisecond).

# System call numbers of read, recvfrom and recvmsg: what a thread blocked in
# an engine call waiting for a peer's answer is in.
_READ_SYSCALLS: Final[Mapping[str, frozenset[int]]] = {
    "x86_64": frozenset({0, 45, 47}),
    "aarch64": frozenset({63, 207, 212}),
}
_EXIT_GRACE_S: Final = 0.1  # a loop pass, a call about to return: they end by themselves
_EXIT_WAIT_S: Final = 3.0  # past the grace, calls blocked reading a socket are unblocked
_EXIT_POLL_S: Final = 0.02


class ExitGate:
    """The threads that call the engine with the GIL released, and their end.

    A thread is tracked before it starts and checks ``closing`` before each
    engine call; ``close`` (the atexit hook, registered with the first thread)
    sets it, wakes the tracked threads, waits for them to end and shuts down
    the socket of any still blocked reading one. It never ends the process:
    the application's exit status and the rest of its finalization stand.
    """

    closing: bool  # set once by close(): no engine call may start after it
    _lock: threading.Lock
    _threads: weakref.WeakKeyDictionary[threading.Thread, Callable[[], None] | None]  # (L) -> wake
    _hooked: bool  # (L) close() is registered with atexit

    def __init__(self) -> None:
        self.closing = False
        self._lock = threading.Lock()
        self._threads = weakref.WeakKeyDictionary()
        self._hooked = False

    def track(self, thread: threading.Thread, wake: Callable[[], None] | None = None) -> None:
        """Have ``close`` end ``thread`` (calling ``wake`` first, if given)."""
        with self._lock:
            self._threads[thread] = wake
            if not self._hooked:
                atexit.register(self.close)
                self._hooked = True

    def close(self) -> tuple[int, int]:
        """End the tracked threads; return (sockets shut down, threads still alive).
        Idempotent."""
        with self._lock:
            self.closing = True
            tracked = [(t, w) for t, w in self._threads.items() if t.is_alive()]
        for _, wake in tracked:
            if wake is not None:
                wake()
        now = time.monotonic()
        alive = _join([t for t, _ in tracked], now + _EXIT_GRACE_S)
        unblocked = 0
        deadline = now + _EXIT_WAIT_S
        while alive and time.monotonic() < deadline:
            unblocked += sum(_shut_blocked_read(t) for t in alive)
            alive = _join(alive, min(deadline, time.monotonic() + _EXIT_POLL_S))
        if alive:
            _log.warning(
                "engine_threads_alive_at_exit",
                threads=[t.name for t in alive],
                sockets_shut=unblocked,
                risk="a thread that returns from the engine while the interpreter finalizes "
                "aborts the process (terminate called without an active exception)",
            )
        elif unblocked:
            _log.info("engine_calls_unblocked_at_exit", sockets_shut=unblocked)
        return unblocked, len(alive)


def _join(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Wait until ``deadline`` for ``threads``; the ones still alive."""
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def _blocked_read_fd(path: str, reads: frozenset[int]) -> int | None:
    """The file descriptor the thread of ``path`` (its /proc syscall file) is
    blocked reading, if it is blocked in a read."""
    try:
        with open(path) as f:
            fields = f.read().split()
        nr, fd = int(fields[0]), int(fields[1], 16)  # "running" for a thread on a CPU
    except (OSError, ValueError, IndexError):
        return None
    return fd if nr in reads else None


def _shut_blocked_read(thread: threading.Thread) -> bool:
    """Shut down the socket ``thread`` is blocked reading; True if it did.

    The descriptor is duplicated and checked again after: if the thread
    still blocks on the same number, the duplicate is its socket (a number
    reused meanwhile would belong to another call of the same thread).
    """
    reads = _READ_SYSCALLS.get(os.uname().machine)
    if reads is None or thread.native_id is None:
        return False
    path = f"/proc/self/task/{thread.native_id}/syscall"
    fd = _blocked_read_fd(path, reads)
    if fd is None:
        return False
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        same = stat.S_ISSOCK(os.fstat(dup).st_mode) and _blocked_read_fd(path, reads) == fd
        sock = socket.socket(fileno=dup) if same else None
    except OSError:
        sock = None
    if sock is None:
        os.close(dup)
        return False
    with sock:  # closes the duplicate only
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more: the call returns by itself
            return False
    return True


ENGINE_EXIT: Final = ExitGate()


def keep_forever(obj: object) -> None:
    """Leak ``obj`` and everything it references until the process ends.

    For engines and memory the engine may still read or write: keeping them
    in a module global is not enough, since interpreter shutdown clears
    module globals and would free them, or run the engine's destructor,
    under the engine's threads.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
