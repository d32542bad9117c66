"""Checksums of KV blocks, computed with torch where the blocks are.

A load is verified end to end: the sender digests exactly the bytes it wrote
(``region_digest`` over its source blocks and slice), the receiver the same
bytes in its own blocks once the engine is done, and the two must agree.
Both run the same torch calls on the tensors' own device, so a CUDA cache is
read by CUDA kernels and only the 16-byte result reaches the host.

It is a transport checksum, not a cryptographic hash (as SGLang's Adler-32
over transferred KV): it catches what a transfer gets wrong, not a forger.

* A *row* is one block's slice ``[offset, offset + length)`` in one buffer;
  rows are taken buffer by buffer, blocks in the order given. Equal digests
  need both sides to list the same bytes in the same order, nothing else
  (their block ids, block sizes and devices may differ).
* A row's bytes, as little-endian int32 words (bytes where ``length`` is not
  a multiple of 4), are cut into ``parts`` equal runs (16, or what divides
  the word count) and each run summed modulo 2**32.
* Each run's sum is multiplied by its own odd pseudo-random weight (splitmix64
  of its index over all rows) and the products summed modulo 2**64, twice
  with independent weights: 16 bytes.

What that guarantees: any change to one word changes both sums (an odd
weight times a nonzero difference below 2**32 is never 0 modulo 2**64); a
block written into the wrong place, swapped, stale or half written, or a
part of a row moved to another part (a tensor parallel head written at
another head's offset), changes them except with probability about 2**-64
per sum. Cost: on a host, one pass over the rows where a load's blocks are a
few runs of neighbours or runs long enough that a copy costs more than one
call per run (a host), else one gather of them first; then one weighting of
the run sums (a sixteenth of a row each; the weights are a prefix of a table
kept per device). Buffers equally far apart in one
allocation (vLLM's layers) are read together (``KVCache.groups``): the torch
calls, each of which may wait for the GIL, number per run, not per buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from .cache import KVCache

__all__ = ["DIGEST_BYTES", "BlockSums", "region_digest"]

DIGEST_BYTES: Final = 16
_PARTS: Final = 16
_CHUNK_BYTES: Final = 32 << 20  # rows gathered at once on the device
_MAX_RUNS: Final = 8  # at most this many runs of neighbour blocks: sliced, not gathered
# On a host, a run this long is summed where it lies: a gather copies it at
# memory speed (19 ms for 54 MB here, 8x the sum), a slice costs one call
# (microseconds). A device gathers any number of runs in one cheap kernel.
_HOST_SLICE_BYTES: Final = 16 << 10
_SEEDS: Final = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)  # one per 8-byte half
_TABLE_MAX: Final = 1 << 19  # weights kept per device (8 MiB); more are made per digest


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic):
# 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 and 0x94D049BB133111EB, minus 2**64.
_GOLDEN: Final = -7046029254386353131
_M1: Final = -4658895280553007687
_M2: Final = -7723592293110705685


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _fresh_weights(count: int, device: torch.device) -> torch.Tensor:
    """Odd splitmix64 outputs for indices ``[0, count)``, a row per seed of
    ``_SEEDS`` (one set of torch calls for both; the seeds are Python ints: a
    tensor of them would be a copy to the device, waiting for its queue)."""
    z = torch.arange(count, dtype=torch.int64, device=device) * _GOLDEN
    return _mix(torch.stack([z + seed for seed in _SEEDS]))  # seeds are below 2**63


# Weights depend on the index alone, so a load's are a prefix of a table kept
# per device: one call (a slice) instead of seventeen, each of which may wait
# for the GIL beside vLLM's busy threads. Replaced, never changed in place, so
# a reader on another thread keeps a whole table.
_tables: dict[torch.device, torch.Tensor] = {}


def _weights(count: int, device: torch.device) -> torch.Tensor:
    """``_fresh_weights(count, device)``, from the device's table where it fits."""
    if count > _TABLE_MAX:
        return _fresh_weights(count, device)
    table = _tables.get(device)
    if table is None or table.shape[1] < count:
        size = min(_TABLE_MAX, 1 << max(10, (count - 1).bit_length()))
        table = _tables[device] = _fresh_weights(size, device)
    return table[:, :count]


def _on_words(group: torch.Tensor, offset: int) -> bool:
    """Every row of ``group`` from ``offset`` starts on a 4-byte boundary."""
    return not ((group.storage_offset() + offset) % 4 or group.stride(0) % 4 or group.stride(1) % 4)


def _singles(group: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``group``'s buffers as groups of one."""
    _, rows, length = group.shape
    step, first = group.stride(0), group.storage_offset()
    shape, stride = (1, rows, length), (0, group.stride(1), 1)
    return tuple(
        torch.as_strided(group, shape, stride, first + i * step) for i in range(len(group))
    )


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return (z ^ _shr(z, 31)) | 1


def _runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``blocks`` as runs [lo, hi) of neighbours, in order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def _joined(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``tensors`` joined along ``dim``, without a call for one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def region_digest(
    cache: KVCache, blocks: Sequence[int], part: tuple[int, int] | None = None
) -> bytes:
    """The checksum of ``blocks``' bytes ``part`` (offset, length; None: whole
    blocks) in every buffer of ``cache`` (see the module's docstring).

    ValueError names a block id out of range or a part outside a block.
    """
    return _weigh([s.view(-1) for s in _group_sums(cache, blocks, part)], cache.device)


class BlockSums:
    """Whole blocks' run sums, read once (while the blocks are held, before
    anyone asks for them) and weighed for any of those blocks later:
    ``digest(some)`` is ``region_digest(cache, some)`` without reading the
    blocks again. They take 64 bytes per block and buffer (a thousandth of a
    64 KiB row).

    Valid only while nothing writes the blocks: the holder's to ensure.
    """

    def __init__(self, cache: KVCache, blocks: Sequence[int]) -> None:
        """ValueError names a block id out of range."""
        self.device = cache.device
        self._sums = _group_sums(cache, blocks, None)  # per group: (buffers, blocks, parts)
        self._where: dict[int, int] = {}  # block id -> its row in the sums (the first)
        for i, blk in enumerate(blocks):
            self._where.setdefault(blk, i)

    def __contains__(self, block: object) -> bool:
        return block in self._where

    def digest(self, blocks: Sequence[int]) -> bytes:
        """``region_digest`` of whole ``blocks``; KeyError names one not read here."""
        rows = []
        for blk in blocks:
            if blk not in self._where:
                raise KeyError(f"block {blk!r} is not among the blocks summed")
            rows.append(self._where[blk])
        if not rows:
            return bytes(DIGEST_BYTES)
        (lo, hi), *more = _runs(rows)
        if more:
            ids = torch.tensor(rows, dtype=torch.int64, device=self.device)
            picked = [s.index_select(1, ids).view(-1) for s in self._sums]
        else:  # one run (a decode that has none of them, or a prefix): sliced
            picked = [s[:, lo:hi].reshape(-1) for s in self._sums]
        return _weigh(picked, self.device)


def _weigh(sums: list[torch.Tensor], dev: torch.device) -> bytes:
    """The digest of run sums (int32, in order): each one's sum modulo 2**32
    times its weight, summed modulo 2**64, once per seed."""
    if not sums:
        return bytes(DIGEST_BYTES)
    flat = _joined(sums, 0).to(torch.int64) & 0xFFFFFFFF
    acc = (flat * _weights(flat.numel(), dev)).sum(dim=1)  # one per seed
    return b"".join((v % (1 << 64)).to_bytes(8, "little") for v in acc.tolist())  # one sync


def _group_sums(
    cache: KVCache, blocks: Sequence[int], part: tuple[int, int] | None
) -> list[torch.Tensor]:
    """The run sums (int32) of ``blocks``' ``part``, per group of buffers read
    together, each ``(buffers, len(blocks), parts)``: in digest order once
    flattened; none for no blocks.

    ValueError names a block id out of range or a part outside a block.
    """
    lay = cache.layout
    offset, length = (0, lay.block_bytes) if part is None else part
    if not (offset >= 0 and length > 0 and offset + length <= lay.block_bytes):
        raise ValueError(f"part {part!r} is not inside a block of {lay.block_bytes} bytes")
    for i, blk in enumerate(blocks):  # bool and float ids are bugs, not blocks
        if type(blk) is not int or not 0 <= blk < lay.num_blocks:
            raise ValueError(f"blocks[{i}] = {blk!r} out of range [0, {lay.num_blocks})")
    if not blocks:
        return []  # no rows: both sums are 0
    word = 4 if length % 4 == 0 else 1
    words = length // word
    parts = next(n for n in (_PARTS, 8, 4, 2, 1) if words % n == 0)
    dev = cache.device
    # A group whose rows are not all on a word boundary would be copied whole
    # to be read as words: read such a group buffer by buffer, as bytes too
    # (summed across buffers at once they took 4x as long here).
    groups = tuple(
        one
        for g in cache.groups()
        for one in ((g,) if word == 4 and _on_words(g, offset) else _singles(g))
    )
    runs = _runs(blocks)
    sliced = len(runs) <= _MAX_RUNS or (
        dev.type == "cpu" and length * len(blocks) >= _HOST_SLICE_BYTES * len(runs)
    )
    if not sliced:  # scattered small runs: gather a bounded chunk at a time
        step = max(1, _CHUNK_BYTES // (length * max(len(g) for g in groups)))
        ids = [
            torch.tensor(blocks[lo : lo + step], dtype=torch.int64, device=dev)
            for lo in range(0, len(blocks), step)
        ]
    # A torch call per group and run, not per buffer: each call that computes
    # releases the GIL and may wait up to 5 ms to take it back beside vLLM's
    # busy threads. Views and slices keep it, so: ``view``, not ``reshape``
    # or ``flatten`` (rows end in contiguous bytes), and no ``cat`` of one.
    sums: list[torch.Tensor] = []
    for group in groups:
        view = group[:, :, offset : offset + length]
        pieces = (
            [view[:, lo:hi] for lo, hi in runs]
            if sliced
            else [view.index_select(1, i) for i in ids]
        )
        totals = []
        for rows in pieces:
            if word == 4 and (
                rows.storage_offset() % 4 or rows.stride(0) % 4 or rows.stride(1) % 4
            ):
                rows = rows.clone(memory_format=torch.contiguous_format)  # off a word: copied
            data = rows.view(torch.int32) if word == 4 else rows
            n, r = data.shape[:2]
            totals.append(data.view(n, r, parts, words // parts).sum(dim=3, dtype=torch.int32))
        sums.append(_joined(totals, 1))  # buffer by buffer, rows in the order given
    return sums
