"""The decode side of ``kvguard run`` on real Mooncake: a receiver process."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from transfer import KVCache, KVLayout, PeerInfo
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import block_digests
from transfer.receiver import ReceiverProcess

if TYPE_CHECKING:
    from .run import RunConfig

__all__ = ["MooncakeDecode", "start_mooncake_decode"]

# Engine calls stuck on a frozen peer return after MC_TRANSFER_TIMEOUT; the
# minimum the engine accepts keeps their blocks quarantined for 5 s, not 30.
_ENGINE_TIMEOUT_S = 5


class MooncakeDecode:
    """A ``python -m transfer.receiver`` child, verified over its stdin/stdout."""

    def __init__(self, layout: KVLayout, reply_timeout_s: float) -> None:
        self._proc = ReceiverProcess(layout)
        self.peer: PeerInfo = self._proc.start()
        self._reply_timeout_s = reply_timeout_s
        self._lock = threading.Lock()  # one command at a time on the pipe
        self._gone = False  # killed, frozen or unresponsive: stop asking

    def verify(self, src: KVCache, src_blocks: list[int], dst_blocks: list[int]) -> bool | None:
        with self._lock:
            if self._gone:
                return None
            try:
                reply = self._proc.request(
                    {"cmd": "checksum", "blocks": dst_blocks}, timeout=self._reply_timeout_s
                )
            except (TimeoutError, OSError, RuntimeError, ValueError):
                self._gone = True
                return None
        theirs = reply.get("digests")
        return theirs == block_digests(src, src_blocks)

    def kill(self) -> None:
        with self._lock:
            self._gone = True
        self._proc.kill()

    def freeze(self) -> None:
        self._gone = True
        self._proc.freeze()

    def close(self) -> None:
        self._proc.close()


def start_mooncake_decode(
    cfg: RunConfig, layout: KVLayout
) -> tuple[MooncakeBackend, MooncakeDecode]:
    decode = MooncakeDecode(layout, reply_timeout_s=max(2.0, cfg.deadline_s))
    try:
        backend = MooncakeBackend(transfer_timeout_s=_ENGINE_TIMEOUT_S)
    except BaseException:
        decode.close()
        raise
    return backend, decode
