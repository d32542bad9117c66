"""What a decode's push must satisfy before the prefill starts a transfer for it.

Everything in a ``Push`` came from a peer: untrusted. ``Admission.admit``
checks it against this prefill rank -- the KV layout fingerprint, the
peer's advertised memory, how many blocks the request holds, which KV heads
the two ranks share -- and either says what to move (the peer, and the
slice of each block) or raises ``Refusal`` with the typed reason the decode
is answered with. Nothing is submitted for a refused push.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer import PeerInfo
from transfer.errors import PeerProtocolError
from transfer.peer_protocol import peer_info_of
from transfer.plan import BlockSlice

from .protocol import Push
from .ranks import RankHeads, block_slice
from .states import LoadEnd

__all__ = ["Admission", "Refusal"]


class Refusal(Exception):
    """A push that cannot start: ``end`` is the load's typed reason."""

    def __init__(self, end: LoadEnd, detail: str) -> None:
        super().__init__(detail)
        self.end, self.detail = end, detail


@dataclass(frozen=True, slots=True)
class Admission:
    """This prefill rank, as a push is checked against it."""

    compat: str  # the KV layout fingerprint a push must carry
    heads: RankHeads | None  # the KV heads this rank holds (None: all)
    head_major: bool  # heads outermost in a block: a share of one is a slice
    block_bytes: int  # of this rank's blocks

    def admit(self, push: Push, held_blocks: int) -> tuple[PeerInfo, BlockSlice | None]:
        """The peer to write to and what of each block (None: whole blocks),
        for a request holding ``held_blocks``; else Refusal."""
        if push.compat != self.compat:
            raise Refusal(
                LoadEnd.INCOMPATIBLE,
                f"KV layouts differ: decode {push.compat!r}, prefill {self.compat!r}",
            )
        try:
            info = peer_info_of(push.peer)
        except PeerProtocolError as exc:
            raise Refusal(LoadEnd.BAD_REQUEST, str(exc)) from exc
        if len(push.blocks) > held_blocks:
            raise Refusal(
                LoadEnd.BAD_REQUEST,
                f"decode asks for {len(push.blocks)} blocks, request {push.request_id} "
                f"has {held_blocks}",
            )
        try:
            part = block_slice(
                self.heads, push.first_head, push.head_count, self.head_major, self.block_bytes
            )
        except ValueError as exc:
            raise Refusal(LoadEnd.INCOMPATIBLE, str(exc)) from exc
        return info, part
