"""Free ports for the servers the vLLM tests and benchmarks start."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

# Ports for servers that listen, below the kernel's ephemeral range
# (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default): a port
# the kernel picked (bind to 0) is one it hands out again as a client
# connection's source port, and the many connections of these tests would
# take it from a server that restarts on it, or has not bound it yet.
_PORTS = range(20000, 32000)
_handed: set[int] = set()
_port_rng = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port where ``span`` consecutive ports are free (a TP prefill listens on
    ``kvguard_control_port`` + rank), none handed out before in this process."""
    for _ in range(1000):
        port = _port_rng.randrange(_PORTS.start, _PORTS.stop - span)
        ports = range(port, port + span)
        if not _handed.intersection(ports) and all(map(_bindable, ports)):
            _handed.update(ports)
            return port
    raise RuntimeError(f"no {span} free consecutive ports in {_PORTS}")
