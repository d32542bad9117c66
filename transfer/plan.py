"""Turn (source block, destination block) pairs into a validated TransferPlan.

Everything is checked before anything is built, and a plan that exists is
safe to hand to the engine: every entry lies inside one source buffer and
inside one region the peer advertised (the engine's legacy protocol writes
out-of-range addresses silently), no destination byte is written twice, and
no batch exceeds the per-peer entry limit the engine survives.

Coalescing: pairs are sorted by source block (each pair stays a pair), and a
maximal run where both the source and the destination ids go up by one
becomes one entry per buffer. Runs are found once and replayed over every
buffer, so planning costs O(blocks) Python steps plus O(runs x buffers)
vectorised address arithmetic. Runs are not merged across buffers: each
buffer is its own registered region, and one engine entry must stay inside
one region.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import Batch, PeerInfo, TransferPlan
from .cache import KVCache
from .errors import InvalidPlan, RemoteRangeRejected
from .layout import KVLayout, _is_int
from .regions import RegionIndex

__all__ = [
    "DEFAULT_MAX_BATCH_ENTRIES",
    "MAX_BATCH_ENTRIES_LIMIT",
    "build_plan",
    "plan_entries_naive",
]

# The engine queues 1,024 entries plus 1,024 pending admissions per TCP peer
# and fails the rest (8192 entries in one batch failed outright), and may keep
# failing that peer for a while; stay well below by default.
DEFAULT_MAX_BATCH_ENTRIES = 512
MAX_BATCH_ENTRIES_LIMIT = 2048

# A run: (first source block, first destination block, number of blocks).
# Plans with more entries than this compute their addresses with torch.
_VECTORIZE_ABOVE = 4096
_Run = tuple[int, int, int]

# Addresses are computed in int64 (torch); user-space pointers are < 2**48.
# A peer advertising buffers at or past 2**63 (or at a float) is refused
# typed here instead of overflowing, wrapping or truncating below.
_ADDR_LIMIT = 1 << 63


def build_plan(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    *,
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
) -> TransferPlan:
    """Plan copying ``src`` block ``src_blocks[i]`` to peer block ``dst_blocks[i]``.

    Raises InvalidPlan (RemoteRangeRejected for ranges outside the peer's
    regions) naming the offending value; never returns a partial plan.
    """
    _validate(src, peer, src_blocks, dst_blocks, max_batch_entries)
    if len(src_blocks) == 1:  # a tiny request: same plan, without sorting or coalescing
        return _assemble_one(src, peer, src_blocks[0], dst_blocks[0], max_batch_entries)
    return _assemble(
        src, peer, _coalesce(src_blocks, dst_blocks), len(src_blocks), max_batch_entries
    )


def plan_entries_naive(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
) -> TransferPlan:
    """The uncoalesced baseline: one entry per block per buffer, in the given order.

    Same validation as ``build_plan``; benchmarks compare the two.
    """
    _validate(src, peer, src_blocks, dst_blocks, max_batch_entries)
    runs = [(s, d, 1) for s, d in zip(src_blocks, dst_blocks, strict=True)]
    return _assemble(src, peer, runs, len(src_blocks), max_batch_entries)


# -- validation ----------------------------------------------------------------


def _validate(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    max_batch_entries: int,
) -> None:
    if not _is_int(max_batch_entries) or not 1 <= max_batch_entries <= MAX_BATCH_ENTRIES_LIMIT:
        raise InvalidPlan(
            f"max_batch_entries must be an int in [1, {MAX_BATCH_ENTRIES_LIMIT}], "
            f"got {max_batch_entries!r}"
        )
    if not isinstance(src, KVCache):
        raise InvalidPlan(f"source must be a KVCache, got {type(src).__name__}")
    if not isinstance(peer, PeerInfo):
        raise InvalidPlan(f"peer must be a PeerInfo, got {type(peer).__name__}")
    sid = peer.session_id
    mine, theirs = src.layout, peer.layout
    if not isinstance(theirs, KVLayout):
        raise InvalidPlan(f"peer {sid} advertised no KVLayout: {theirs!r}", peer=sid)
    for field in ("num_layers", "block_bytes", "kv_split"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            raise InvalidPlan(
                f"incompatible layouts: {field} is {a} on the source, {b} on peer {sid}", peer=sid
            )
    if len(peer.block_base) != theirs.num_buffers:
        raise InvalidPlan(
            f"peer {sid} advertised {len(peer.block_base)} buffer bases, "
            f"its layout has {theirs.num_buffers} buffers",
            peer=sid,
        )
    bases = peer.block_base
    top = _ADDR_LIMIT - theirs.buffer_bytes
    if set(map(type, bases)) != {int} or not (min(bases) > 0 and max(bases) <= top):
        for i, base in enumerate(bases):  # the rare bad peer: name the buffer
            if not _is_int(base) or not 0 < base <= top:
                raise RemoteRangeRejected(
                    f"peer {sid} advertised buffer {i} at {base!r} "
                    f"(+{theirs.buffer_bytes} bytes), outside the addresses [1, 2**63) "
                    "a plan can target",
                    peer=sid,
                )
    if len(src_blocks) != len(dst_blocks):
        raise InvalidPlan(
            f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks", peer=sid
        )
    if len(src_blocks) == 0:
        raise InvalidPlan("empty plan: no blocks to transfer", peer=sid)
    _check_ids(src_blocks, mine.num_blocks, "source", sid)
    _check_ids(dst_blocks, theirs.num_blocks, "destination", sid)
    if len(set(dst_blocks)) != len(dst_blocks):
        seen: dict[int, int] = {}
        for i, blk in enumerate(dst_blocks):
            if blk in seen:
                raise InvalidPlan(
                    f"destination block {blk} is written twice (indices {seen[blk]} and {i})",
                    peer=sid,
                )
            seen[blk] = i
    # Source ranges need no region check: the source regions are the source
    # buffers themselves and every block id was just checked against them.
    _check_peer_regions(peer, min(dst_blocks), max(dst_blocks), dst_blocks)


def _check_ids(blocks: Sequence[int], num_blocks: int, side: str, sid: str) -> None:
    # Fast path in C for the common case (all valid: tens of ns per block);
    # the loop below runs only to name the first bad id.
    if set(map(type, blocks)) == {int} and min(blocks) >= 0 and max(blocks) < num_blocks:
        return
    for i, blk in enumerate(blocks):
        if not _is_int(blk):
            raise InvalidPlan(f"{side} block {blk!r} at index {i} is not an int", peer=sid)
        if not 0 <= blk < num_blocks:
            raise InvalidPlan(
                f"{side} block {blk} at index {i} out of range [0, {num_blocks})", peer=sid
            )


def _check_peer_regions(peer: PeerInfo, lo_blk: int, hi_blk: int, blocks: Sequence[int]) -> None:
    """Every destination block range must lie inside one advertised region.

    Fast path: the span from the lowest to the highest block of a buffer fits
    in one region. Otherwise check block by block, which is exact.
    """
    regions = RegionIndex(peer.regions)
    size = peer.layout.block_bytes
    for i, base in enumerate(peer.block_base):
        if regions.contains(base + lo_blk * size, (hi_blk - lo_blk + 1) * size):
            continue
        for blk in blocks:
            addr = base + blk * size
            if not regions.contains(addr, size):
                raise RemoteRangeRejected(
                    f"destination block {blk} of buffer {i} at [{addr:#x}, {addr + size:#x}) "
                    f"lies outside the regions peer {peer.session_id} advertised",
                    peer=peer.session_id,
                )


# -- construction --------------------------------------------------------------


def _coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[_Run]:
    """Maximal runs where source and destination ids both step by one."""
    pairs = sorted(zip(src_blocks, dst_blocks, strict=True))
    runs: list[_Run] = []
    s0, d0 = pairs[0]
    n = 1
    for s, d in pairs[1:]:
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def _assemble(
    src: KVCache, peer: PeerInfo, runs: list[_Run], num_blocks: int, max_batch_entries: int
) -> TransferPlan:
    """Replay the runs over every buffer (buffer-major) and cut into batches."""
    size = src.layout.block_bytes
    src_bases, dst_bases = src.buffer_bases(), peer.block_base
    src_addr: list[int]
    dst_addr: list[int]
    if len(runs) * len(src_bases) <= _VECTORIZE_ABOVE:
        # Small plans (the common, contiguous case): plain ints beat the
        # fixed cost of a handful of torch ops.
        src_addr = [b + s * size for b in src_bases for s, _, _ in runs]
        dst_addr = [b + d * size for b in dst_bases for _, d, _ in runs]
    else:
        cols = list(zip(*runs, strict=True))
        run_src, run_dst = (torch.tensor(col, dtype=torch.int64) for col in cols[:2])
        # Addresses fit int64 (user-space pointers are < 2**48).
        src_base = torch.tensor(src_bases, dtype=torch.int64).unsqueeze(1)
        dst_base = torch.tensor(dst_bases, dtype=torch.int64).unsqueeze(1)
        src_addr = (src_base + run_src * size).flatten().tolist()
        dst_addr = (dst_base + run_dst * size).flatten().tolist()
    lengths = [n * size for _, _, n in runs] * len(src_bases)
    m = max_batch_entries
    batches = tuple(
        Batch(tuple(src_addr[i : i + m]), tuple(dst_addr[i : i + m]), tuple(lengths[i : i + m]))
        for i in range(0, len(lengths), m)
    )
    nbytes = num_blocks * size * src.layout.num_buffers
    return TransferPlan(peer=peer.session_id, batches=batches, nbytes=nbytes, num_blocks=num_blocks)


def _assemble_one(
    src: KVCache, peer: PeerInfo, src_blk: int, dst_blk: int, max_batch_entries: int
) -> TransferPlan:
    """``_assemble`` for one validated pair: one entry per buffer."""
    size = src.layout.block_bytes
    s, d = src_blk * size, dst_blk * size
    src_addr = tuple([b + s for b in src.buffer_bases()])
    dst_addr = tuple([b + d for b in peer.block_base])
    lengths = (size,) * len(src_addr)
    m = max_batch_entries
    if len(lengths) <= m:
        batches: tuple[Batch, ...] = (Batch(src_addr, dst_addr, lengths),)
    else:
        batches = tuple(
            Batch(src_addr[i : i + m], dst_addr[i : i + m], lengths[i : i + m])
            for i in range(0, len(lengths), m)
        )
    nbytes = size * src.layout.num_buffers
    return TransferPlan(peer=peer.session_id, batches=batches, nbytes=nbytes, num_blocks=1)
