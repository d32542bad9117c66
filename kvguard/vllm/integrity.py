"""Loaded KV verified end to end: the decode's blocks hold what the prefill wrote.

The decode asks for it with each push (``Push.verify``). The prefill digests
the bytes it writes for the load when it submits the transfer (its blocks are
held, unchanged; the engine reads them meanwhile) and sends the digest with
an ok ``Result``. When that Result arrives nothing of the prefill writes the
decode's blocks any more, and the decode digests the same bytes in them
(``transfer.checksum``, torch on the cache's device). A different digest, or
none, fails the load with ``LoadEnd.INTEGRITY``: vLLM's
``kv_load_failure_policy`` then fails or recomputes the request, and never
decodes from KV that is not the prefill's.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import msgspec
import structlog

from transfer.cache import KVCache
from transfer.checksum import BlockSums, region_digest
from transfer.plan import BlockSlice

from .protocol import Result, truncate
from .states import LoadEnd

__all__ = ["Part", "Verifier", "source_digest"]

_log = structlog.get_logger("kvguard.vllm.integrity")

Part = tuple[int, int]  # (offset, length) of each block written


def source_digest(
    cache: KVCache,
    blocks: Sequence[int],
    part: BlockSlice | None,
    early: Future[BlockSums] | None = None,
) -> bytes:
    """The prefill's digest of what it writes: ``blocks``' source slice; empty
    (the decode then fails the load) where none can be made. ``early``: the
    hold's blocks read as it began, weighed here for whole blocks it has;
    still queued, it is cancelled and the blocks read here (never a wait
    for more than the one read running)."""
    cut = None if part is None else (part.src_offset, part.length)
    sums = None
    if early is not None and part is None and not early.cancel():
        try:
            sums = early.result()  # done, or running: its end is near
        except Exception as exc:  # the blocks are read below
            _log.warning("early_sums_failed", error=str(exc))
    try:
        if sums is not None and all(b in sums for b in blocks):
            return sums.digest(blocks)
        return region_digest(cache, blocks, cut)
    except Exception as exc:  # any: a raise here would lose the load's Result
        _log.error("digest_failed", blocks=len(blocks), part=cut, error=str(exc))
        return b""


class Verifier:
    """The decode's half, on the receiver's thread: what each load's digest
    covers, from its ``expect`` until it is reported."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._covers: dict[str, tuple[list[int], Part | None]] = {}  # load id -> blocks, part

    def expect(self, load_id: str, blocks: list[int], part: Part | None) -> None:
        """``load_id`` loads into ``blocks``, ``part`` of each (None: whole);
        an id still loading keeps its first cover, as the core keeps its first load."""
        self._covers.setdefault(load_id, (blocks, part))

    def done(self, load_id: str) -> None:
        """``load_id`` was reported: a later Result for it is not checked."""
        self._covers.pop(load_id, None)

    def cover(self, load_id: str) -> tuple[list[int], Part | None] | None:
        """The blocks and part ``load_id``'s digest covers, while it loads."""
        return self._covers.get(load_id)

    def pending(self) -> int:
        return len(self._covers)

    def checked(self, res: Result) -> Result:
        """``res``, or for an ok Result of a load expected here whose digest
        differs from this side's blocks' (or is missing), a failed one."""
        cover = self._covers.get(res.load_id) if res.ok else None
        if cover is None:
            return res
        try:
            mine = region_digest(self.cache, *cover)
        except Exception as exc:  # any (bad ids, a device error): a raise would lose the Result
            mine, why = b"", f"cannot digest the blocks here: {exc}"
        else:
            why = (
                "the prefill sent no digest"
                if not res.digest
                else f"digest {res.digest.hex()} from the prefill, {mine.hex()} here"
            )
        if mine and res.digest == mine:
            return res
        _log.warning("kv_integrity_mismatch", request=res.load_id, detail=why)
        return msgspec.structs.replace(
            res, ok=False, reason=LoadEnd.INTEGRITY.value, detail=truncate(why)
        )
