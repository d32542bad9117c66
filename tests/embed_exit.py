"""An embedding application that exits with a Mooncake engine still quarantined.

Run by ``test_shutdown.py``: ``python tests/embed_exit.py STATUS``. It pushes
blocks to a receiver child, freezes the child mid transfer, leaves a probe of
it unanswered, closes its backend (the engine is kept: it still holds the
entries) and exits with STATUS, leaving the child frozen. While the
interpreter finalizes, a module global of this program kills the child: the
engine's calls to it then return, which is when a library thread coming back
from the engine aborted the process ("terminate called without an active
exception", status 134). Lines on stdout tell the test what happened.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

from kvguard.decode.service import ReceiverProcess
from transfer import KVCache, KVLayout, PeerUnreachable, build_plan
from transfer.mooncake import MooncakeBackend

LAYOUT = KVLayout(num_layers=1, num_blocks=64, block_bytes=4096)


class _KillAtFinalization:
    """Kills the frozen child from interpreter finalization (module teardown),
    after atexit, with every callable it needs held on itself."""

    def __init__(self, pid: int) -> None:
        self.pid, self.kill, self.write, self.sleep = pid, os.kill, os.write, time.sleep

    def __del__(self) -> None:
        self.kill(self.pid, signal.SIGCONT)
        self.kill(self.pid, signal.SIGKILL)
        self.write(1, b"finalizer killed the peer\n")
        self.sleep(0.5)  # the engine's calls to the dead peer return meanwhile
        self.write(1, b"finalizer done\n")


def main(status: int) -> int:
    global _killer
    src = KVCache(LAYOUT)
    src.fill_seeded(3)
    backend = MooncakeBackend("127.0.0.1", transfer_timeout_s=5, close_timeout_s=0.3)
    backend.register(src)
    peer = ReceiverProcess(LAYOUT)  # no context manager: it stays frozen past exit
    peer.start()
    print("peer", peer.pid, flush=True)
    _killer = _KillAtFinalization(peer.pid)
    backend.add_peer(peer.peer)
    backend.submit(build_plan(src, peer.peer, [0], [0])).result(timeout=30)
    peer.freeze()
    blocks = list(range(1, 33))
    op = backend.submit(build_plan(src, peer.peer, blocks, blocks))
    deadline = time.monotonic() + 10
    while op.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        backend.probe(peer.peer.session_id, timeout=0.2)
    except PeerUnreachable as exc:
        print("probe", "silent" if "silent" in str(exc) else str(exc), flush=True)
    backend.close()
    print("quarantined", int(not op.quiesced), flush=True)
    atexit.register(os.write, 1, b"app atexit ran\n")
    return status


_killer: _KillAtFinalization | None = None

if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
