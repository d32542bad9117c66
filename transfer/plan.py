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
one region. A strided layout (``KVLayout.block_stride``: padded pages,
blocks that span every layer) has gaps between neighbouring blocks: each
block is its own entry per buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backend import Batch, PeerInfo, TransferPlan
from .cache import KVCache
from .errors import InvalidPlan, RemoteRangeRejected
from .layout import KVLayout, _is_int
from .regions import RegionIndex

__all__ = [
    "DEFAULT_MAX_BATCH_ENTRIES",
    "MAX_BATCH_ENTRIES_LIMIT",
    "BlockSlice",
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


@dataclass(frozen=True)
class BlockSlice:
    """Part of every block a plan copies: ``length`` bytes at ``src_offset`` of
    each source block go to ``dst_offset`` of its destination block.

    Tensor parallel ranks of different sizes hold different head ranges of one
    block (heads outermost in it): one rank's share of a peer's block is a
    slice, and whole blocks may differ in size between the two sides. Only
    whole blocks coalesce across neighbours; a slice is one entry per block
    and buffer.
    """

    src_offset: int  # >= 0; src_offset + length <= the source's block_bytes
    dst_offset: int  # >= 0; dst_offset + length <= the peer's block_bytes
    length: int  # > 0


# How one block maps onto the other side: (source block size, destination
# block size, source offset, destination offset, bytes copied per block).
_Cut = tuple[int, int, int, int, int]


def build_plan(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    *,
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
    part: BlockSlice | None = None,
) -> TransferPlan:
    """Plan copying ``src`` block ``src_blocks[i]`` to peer block ``dst_blocks[i]``
    (with ``part``, that slice of each block; without, whole blocks of one size).

    Raises InvalidPlan (RemoteRangeRejected for ranges outside the peer's
    regions) naming the offending value; never returns a partial plan.
    """
    cut = _validate(src, peer, src_blocks, dst_blocks, max_batch_entries, part)
    if len(src_blocks) == 1:  # a tiny request: same plan, without sorting or coalescing
        return _assemble_one(src, peer, src_blocks[0], dst_blocks[0], max_batch_entries, cut)
    runs = _coalesce(src_blocks, dst_blocks)
    if not (_whole(cut) and src.layout.dense and peer.layout.dense):
        # slices of neighbouring blocks, or strided blocks, are not contiguous
        runs = [(s + k, d + k, 1) for s, d, n in runs for k in range(n)]
    return _assemble(src, peer, runs, len(src_blocks), max_batch_entries, cut)


def plan_entries_naive(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
    part: BlockSlice | None = None,
) -> TransferPlan:
    """The uncoalesced baseline: one entry per block per buffer, in the given order.

    Same validation as ``build_plan``; benchmarks compare the two.
    """
    cut = _validate(src, peer, src_blocks, dst_blocks, max_batch_entries, part)
    runs = [(s, d, 1) for s, d in zip(src_blocks, dst_blocks, strict=True)]
    return _assemble(src, peer, runs, len(src_blocks), max_batch_entries, cut)


def _whole(cut: _Cut) -> bool:
    src_size, dst_size, src_off, dst_off, length = cut
    return src_off == dst_off == 0 and src_size == dst_size == length


# -- validation ----------------------------------------------------------------


def _validate(
    src: KVCache,
    peer: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    max_batch_entries: int,
    part: BlockSlice | None = None,
) -> _Cut:
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
    for field in ("num_layers", "kv_split") if part else ("num_layers", "block_bytes", "kv_split"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            raise InvalidPlan(
                f"incompatible layouts: {field} is {a} on the source, {b} on peer {sid}", peer=sid
            )
    cut = _cut_of(part, mine.block_bytes, theirs.block_bytes, sid)
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
    return cut


def _cut_of(part: BlockSlice | None, src_size: int, dst_size: int, sid: str) -> _Cut:
    if part is None:
        return (src_size, dst_size, 0, 0, src_size)
    if not isinstance(part, BlockSlice):
        raise InvalidPlan(f"part must be a BlockSlice, got {type(part).__name__}", peer=sid)
    src_off, dst_off, length = part.src_offset, part.dst_offset, part.length
    if not all(map(_is_int, (src_off, dst_off, length))) or length <= 0:
        raise InvalidPlan(f"{part} needs int offsets and a length > 0", peer=sid)
    for side, off, size in (("source", src_off, src_size), ("destination", dst_off, dst_size)):
        if not 0 <= off <= size - length:
            raise InvalidPlan(
                f"{part} does not fit the {side}'s {size}-byte blocks (peer {sid})", peer=sid
            )
    return (src_size, dst_size, src_off, dst_off, length)


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
    size, stride = peer.layout.block_bytes, peer.layout.stride
    for i, base in enumerate(peer.block_base):
        if regions.contains(base + lo_blk * stride, (hi_blk - lo_blk) * stride + size):
            continue
        for blk in blocks:
            addr = base + blk * stride
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
    src: KVCache,
    peer: PeerInfo,
    runs: list[_Run],
    num_blocks: int,
    max_batch_entries: int,
    cut: _Cut,
) -> TransferPlan:
    """Replay the runs over every buffer (buffer-major) and cut into batches.
    A run longer than one block is only ever of whole blocks (``_whole``)."""
    _, _, src_off, dst_off, length = cut
    src_size, dst_size = src.layout.stride, peer.layout.stride
    src_bases = [b + src_off for b in src.buffer_bases()]
    dst_bases = [b + dst_off for b in peer.block_base]
    src_addr: list[int]
    dst_addr: list[int]
    if len(runs) * len(src_bases) <= _VECTORIZE_ABOVE:
        # Small plans (the common, contiguous case): plain ints beat the
        # fixed cost of a handful of torch ops.
        src_addr = [b + s * src_size for b in src_bases for s, _, _ in runs]
        dst_addr = [b + d * dst_size for b in dst_bases for _, d, _ in runs]
    else:
        cols = list(zip(*runs, strict=True))
        run_src, run_dst = (torch.tensor(col, dtype=torch.int64) for col in cols[:2])
        # Addresses fit int64 (user-space pointers are < 2**48).
        src_base = torch.tensor(src_bases, dtype=torch.int64).unsqueeze(1)
        dst_base = torch.tensor(dst_bases, dtype=torch.int64).unsqueeze(1)
        src_addr = (src_base + run_src * src_size).flatten().tolist()
        dst_addr = (dst_base + run_dst * dst_size).flatten().tolist()
    lengths = [n * length for _, _, n in runs] * len(src_bases)
    m = max_batch_entries
    batches = tuple(
        Batch(tuple(src_addr[i : i + m]), tuple(dst_addr[i : i + m]), tuple(lengths[i : i + m]))
        for i in range(0, len(lengths), m)
    )
    nbytes = num_blocks * length * src.layout.num_buffers
    return TransferPlan(peer=peer.session_id, batches=batches, nbytes=nbytes, num_blocks=num_blocks)


def _assemble_one(
    src: KVCache, peer: PeerInfo, src_blk: int, dst_blk: int, max_batch_entries: int, cut: _Cut
) -> TransferPlan:
    """``_assemble`` for one validated pair: one entry per buffer."""
    _, _, src_off, dst_off, length = cut
    s = src_blk * src.layout.stride + src_off
    d = dst_blk * peer.layout.stride + dst_off
    src_addr = tuple([b + s for b in src.buffer_bases()])
    dst_addr = tuple([b + d for b in peer.block_base])
    lengths = (length,) * len(src_addr)
    m = max_batch_entries
    if len(lengths) <= m:
        batches: tuple[Batch, ...] = (Batch(src_addr, dst_addr, lengths),)
    else:
        batches = tuple(
            Batch(src_addr[i : i + m], dst_addr[i : i + m], lengths[i : i + m])
            for i in range(0, len(lengths), m)
        )
    nbytes = length * src.layout.num_buffers
    return TransferPlan(peer=peer.session_id, batches=batches, nbytes=nbytes, num_blocks=1)
