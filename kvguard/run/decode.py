"""The decode side of ``kvguard run`` as the job sees it, and its local stand-in.

The job only writes to the decode side's peer and asks it for digests;
``make_decode`` picks the in-process stand-in (LocalBackend) or a Mooncake
decode service, importing Mooncake only when asked for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from transfer import KVCache, KVLayout, PeerInfo, TransferBackend
from transfer.local import LocalBackend
from transfer.peer_protocol import block_digest_bytes

from .records import RunConfig

__all__ = ["Decode", "LocalDecode", "RegisterSource", "make_decode"]


class Decode(Protocol):
    """The decode side as the run sees it: a peer to write to and to verify."""

    peer: PeerInfo

    def digests(self, blocks: list[int]) -> bytes | None:
        """Digests of destination blocks (kvguard.run.verify); None if it cannot answer."""

    def kill(self) -> None: ...

    def freeze(self) -> None: ...

    def close(self) -> None: ...


class LocalDecode:
    """Decode side inside this process, on the LocalBackend."""

    def __init__(self, backend: LocalBackend, layout: KVLayout) -> None:
        self._backend = backend
        self._cache = KVCache(layout)
        self.peer = backend.register_peer("local-decode", self._cache)
        self._dead = False

    def digests(self, blocks: list[int]) -> bytes | None:
        return None if self._dead else block_digest_bytes(self._cache, blocks)

    def kill(self) -> None:
        self._dead = True
        self._backend.unregister_peer(self.peer.session_id)

    def freeze(self) -> None:
        raise ValueError("--freeze-decode-after needs --backend mooncake")

    def close(self) -> None:
        pass


RegisterSource = Callable[[KVCache], None]


def make_decode(cfg: RunConfig, layout: KVLayout) -> tuple[TransferBackend, Decode, RegisterSource]:
    """The backend to write through, the decode side it writes to, and how the
    source cache is registered with that backend (each backend has its own)."""
    if cfg.backend == "local":
        local = LocalBackend(workers=cfg.workers)
        return local, LocalDecode(local, layout), local.register_source
    # Imported here: the local backend must work where Mooncake cannot load.
    from .mooncake_decode import start_mooncake_decode

    mooncake, decode = start_mooncake_decode(cfg, layout)
    return mooncake, decode, mooncake.register
