"""Is anything listening at a lost prefill's control port? Proof, or silence.

A dropped link says only that the prefill is silent: killed, or frozen, or
cut off. A frozen one still writes on thaw, so its loads stay fenced; only
proof that nothing listens lets their blocks go. A plain TCP connect is
that proof when it is refused, or when the socket connected to itself (TCP
self-connect: dialling a port nothing listens on from that same port) --
which is told from a NAT hairpin to a live listener by echoing a nonce. A
connect that times out or fails otherwise proves nothing.
"""

from __future__ import annotations

import socket
import uuid
from typing import Final
from urllib.parse import urlsplit

__all__ = ["PROBE_TIMEOUT_S", "gone"]

PROBE_TIMEOUT_S: Final = 0.2


def _echoes(sock: socket.socket) -> bool:
    """Does what ``sock`` sends come back to it? Only on a socket connected
    to itself: equal addresses alone can also be a NAT hairpin to a live
    (perhaps frozen) listener, which sends nothing back."""
    nonce = uuid.uuid4().bytes
    try:
        sock.sendall(nonce)
        got = b""
        while len(got) < len(nonce):
            part = sock.recv(len(nonce) - len(got))
            if not part:
                return False
            got += part
    except OSError:  # a timeout included: nothing came back
        return False
    return got == nonce


def gone(endpoint: str) -> bool:
    """Does nothing listen at ``endpoint``'s port? Refused, or connected to
    itself (TCP self-connect, which happens only where nothing listens).
    Unreachable or slow is silence, not proof."""
    parts = urlsplit(endpoint)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), PROBE_TIMEOUT_S) as s:
            return s.getsockname() == s.getpeername() and _echoes(s)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
