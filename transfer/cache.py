"""The torch tensors that hold a paged KV cache laid out by a ``KVLayout``.

``KVCache`` binds a layout to memory: one contiguous uint8 tensor per buffer,
on any device, or (``KVCache.over``) strided views of larger allocations, for
a layout whose blocks are not dense pages (``KVLayout.block_stride``). It
gives the addresses a backend registers and a peer advertises, and compares
block contents after a transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from .backend import PeerInfo
from .layout import KVLayout, _is_int
from .regions import Region

__all__ = ["KVCache"]


def _as_bytes(t: torch.Tensor, index: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"KVCache buffer {index} is not a tensor: {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"KVCache buffer {index} is not contiguous (strides {t.stride()})")
    return t.reshape(-1).view(torch.uint8)


class KVCache:
    """Paged KV cache: one contiguous uint8 torch tensor per buffer (layer x K/V).

    Works for any device: addresses come from ``data_ptr`` and copies and
    comparisons stay in torch, so CUDA tensors never round-trip to the host
    except for the final "which blocks differ" answer.
    """

    __slots__ = ("_bases", "_groups", "device", "layout", "storage", "tensors")

    layout: KVLayout
    # uint8, len == layout.num_buffers: contiguous and 1-D where the cache
    # allocated or wrapped them, (num_blocks, block_bytes) views with strides
    # (layout.stride, 1) for ``over``
    tensors: tuple[torch.Tensor, ...]
    # uint8, contiguous, 1-D: what is registered (``regions``); the buffers
    # themselves for a dense cache, the allocations they lie in for ``over``
    storage: tuple[torch.Tensor, ...]
    device: torch.device  # every tensor lives here
    _bases: tuple[int, ...]  # data_ptr of each tensor; fixed for the tensors' lifetime
    # every buffer once, in order: runs of neighbours equally far apart in one
    # allocation as (count, num_blocks, block_bytes) views (``groups``)
    _groups: tuple[torch.Tensor, ...]

    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device | None = None,
        tensors: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Allocate zeroed buffers on ``device`` (default CPU), or wrap ``tensors``.

        Wrapped tensors may have any dtype and shape; each must be contiguous
        and hold exactly ``layout.buffer_bytes`` bytes. ``device``, if given,
        must match theirs.
        """
        if not isinstance(layout, KVLayout):
            raise ValueError(f"KVCache needs a KVLayout, got {type(layout).__name__}")
        if not layout.dense:
            raise ValueError(f"KVCache of a strided {layout} needs KVCache.over")
        want = torch.device(device) if device is not None else None
        if tensors is None:
            dev = want if want is not None else torch.device("cpu")
            views = tuple(
                torch.zeros(layout.buffer_bytes, dtype=torch.uint8, device=dev)
                for _ in range(layout.num_buffers)
            )
        else:
            if len(tensors) != layout.num_buffers:
                raise ValueError(
                    f"KVCache needs {layout.num_buffers} tensors for {layout}, got {len(tensors)}"
                )
            views = tuple(_as_bytes(t, i) for i, t in enumerate(tensors))
            for i, v in enumerate(views):
                if v.numel() != layout.buffer_bytes:
                    raise ValueError(
                        f"KVCache buffer {i} holds {v.numel()} bytes, "
                        f"layout needs {layout.buffer_bytes}"
                    )
            dev = views[0].device
            for i, v in enumerate(views):
                if v.device != dev:
                    raise ValueError(f"KVCache buffer {i} is on {v.device}, buffer 0 on {dev}")
            if want is not None and _normalize(want) != _normalize(dev):
                raise ValueError(f"KVCache tensors are on {dev}, device={want} was asked")
        self._bind(layout, views, views, dev)

    @classmethod
    def over(
        cls, layout: KVLayout, storage: Sequence[torch.Tensor], bases: Sequence[int]
    ) -> KVCache:
        """A cache whose buffer ``i`` starts at address ``bases[i]`` inside one of
        ``storage`` (the allocations to register: any dtype, contiguous), block
        ``b`` ``b * layout.stride`` bytes further. Nothing is copied: the
        buffers are strided views. ValueError names a buffer lying in no
        allocation, or allocations on different devices."""
        if not isinstance(layout, KVLayout):
            raise ValueError(f"KVCache needs a KVLayout, got {type(layout).__name__}")
        if len(bases) != layout.num_buffers:
            raise ValueError(
                f"KVCache needs {layout.num_buffers} buffer bases for {layout}, got {len(bases)}"
            )
        store = tuple(_as_bytes(t, i) for i, t in enumerate(storage))
        if not store:
            raise ValueError("KVCache.over needs at least one storage tensor")
        dev = store[0].device
        for i, t in enumerate(store):
            if t.device != dev:
                raise ValueError(f"KVCache storage {i} is on {t.device}, storage 0 on {dev}")
        size, shape = layout.buffer_bytes, (layout.num_blocks, layout.block_bytes)
        views = []
        for i, base in enumerate(bases):
            home = next(
                (t for t in store if t.data_ptr() <= base <= t.data_ptr() + t.numel() - size),
                None,
            )
            if home is None:
                raise ValueError(
                    f"KVCache buffer {i} [{base:#x}, +{size:#x}) lies in no storage tensor"
                )
            offset = home.storage_offset() + base - home.data_ptr()
            views.append(torch.as_strided(home, shape, (layout.stride, 1), offset))
        cache = cls.__new__(cls)
        cache._bind(layout, tuple(views), store, dev)
        return cache

    def _bind(
        self,
        layout: KVLayout,
        views: tuple[torch.Tensor, ...],
        storage: tuple[torch.Tensor, ...],
        dev: torch.device,
    ) -> None:
        self.layout = layout
        self.tensors = views
        self.storage = storage
        self.device = dev
        self._bases = tuple(v.data_ptr() for v in views)
        self._groups = _groups(views, layout)
        # Overlapping buffers would alias blocks and be refused at registration.
        spans = sorted((b, i) for i, b in enumerate(self._bases))
        for (b0, i0), (b1, i1) in pairwise(spans):
            if b0 + layout.buffer_bytes > b1:
                raise ValueError(f"KVCache buffers {i0} and {i1} overlap in memory")

    def __repr__(self) -> str:
        return f"KVCache({self.layout}, device={self.device})"

    # -- addresses --------------------------------------------------------------

    def buffer_bases(self) -> tuple[int, ...]:
        return self._bases

    def regions(self) -> tuple[Region, ...]:
        """What a backend registers: one region per buffer (layout order) for a
        dense cache, one per storage tensor for ``over``."""
        return tuple(Region(t.data_ptr(), t.numel()) for t in self.storage)

    def rows(self, buffer: int) -> torch.Tensor:
        """Buffer ``buffer`` as a (num_blocks, block_bytes) uint8 view."""
        lay = self.layout
        return self.tensors[buffer].view(lay.num_blocks, lay.block_bytes)

    def groups(self) -> tuple[torch.Tensor, ...]:
        """The buffers, in order, as few 3-D (count, num_blocks, block_bytes)
        uint8 views as their placement allows: one for buffers equally far
        apart in one allocation (vLLM's layers), one per buffer at worst. One
        torch call then reads a block run in every buffer of a group: each
        call may wait for the GIL (up to 5 ms beside a busy thread)."""
        return self._groups

    def _check(self, buffer: int, block: int) -> None:
        if not _is_int(buffer) or not 0 <= buffer < self.layout.num_buffers:
            raise IndexError(f"buffer {buffer!r} out of range [0, {self.layout.num_buffers})")
        if not _is_int(block) or not 0 <= block < self.layout.num_blocks:
            raise IndexError(f"block {block!r} out of range [0, {self.layout.num_blocks})")

    def block_addr(self, buffer: int, block: int) -> int:
        self._check(buffer, block)
        return self._bases[buffer] + block * self.layout.stride

    def block(self, buffer: int, block: int) -> torch.Tensor:
        """A view (not a copy) of one block's bytes."""
        self._check(buffer, block)
        return self.rows(buffer)[block]

    def peer_info(self, session_id: str) -> PeerInfo:
        """What this cache advertises when it is the destination of transfers."""
        return PeerInfo(session_id, self.regions(), self.layout, block_base=self._bases)

    # -- contents ---------------------------------------------------------------

    def fill_seeded(self, seed: int) -> None:
        """Fill every buffer with deterministic pseudo-random bytes.

        Deterministic for a given seed, layout and device type. Writes int64
        words where alignment allows (~8x faster than bytewise; each word
        carries 63 random bits), so hundreds of MiB take a fraction of a second.
        """
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        if self.storage is not self.tensors:  # ``over``: every registered byte, gaps too
            for t in self.storage:
                _fill(t, gen)
            return
        for t in self.tensors:
            _fill(t, gen)

    def blocks_equal(
        self, other: KVCache, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> list[int]:
        """Compare ``self[src_blocks[i]]`` with ``other[dst_blocks[i]]`` in every buffer.

        Returns the sorted distinct destination block ids whose bytes differ in
        any buffer; an empty list means the transfer is intact (every destination
        block equals its source block).
        """
        a, b = self.layout, other.layout
        if (a.num_layers, a.block_bytes, a.kv_split) != (b.num_layers, b.block_bytes, b.kv_split):
            raise ValueError(f"cannot compare blocks of incompatible layouts {a} and {b}")
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(
                f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
            )
        if not src_blocks:
            return []
        src_idx = _block_index(src_blocks, a.num_blocks, "source", self.device)
        dst_idx = _block_index(dst_blocks, b.num_blocks, "destination", other.device)
        differs = torch.zeros(len(dst_blocks), dtype=torch.bool, device=self.device)
        for i in range(a.num_buffers):
            lhs = self.rows(i).index_select(0, src_idx)
            rhs = other.rows(i).index_select(0, dst_idx)
            differs |= (lhs != rhs.to(self.device)).any(dim=1)
        bad = differs.nonzero().flatten().tolist()
        return sorted({int(dst_blocks[i]) for i in bad})


def _groups(views: Sequence[torch.Tensor], layout: KVLayout) -> tuple[torch.Tensor, ...]:
    out = []
    first = 0
    while first < len(views):
        home = views[first]
        step, end = 0, first + 1
        if end < len(views) and _same_storage(views[end], home):
            step = views[end].data_ptr() - home.data_ptr()
        while (
            end < len(views)
            and step > 0
            and _same_storage(views[end], home)
            and views[end].data_ptr() - views[end - 1].data_ptr() == step
        ):
            end += 1
        count = end - first
        shape = (count, layout.num_blocks, layout.block_bytes)
        stride = (step if count > 1 else 0, layout.stride, 1)  # a lone buffer has no step
        out.append(torch.as_strided(home, shape, stride, home.storage_offset()))
        first = end
    return tuple(out)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Two storages may wrap one address with different sizes (from_buffer, DLPack):
    # a view of one must not reach past it.
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return bool(sa.data_ptr() == sb.data_ptr() and sa.nbytes() == sb.nbytes())


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    """Pseudo-random bytes into contiguous uint8 ``t``, int64 words where aligned."""
    words = t.numel() // 8 if t.storage_offset() % 8 == 0 else 0
    if words:
        t[: words * 8].view(torch.int64).random_(generator=gen)
    if words * 8 < t.numel():
        t[words * 8 :].random_(0, 256, generator=gen)


def _normalize(dev: torch.device) -> tuple[str, int]:
    # "cuda" and "cuda:0" name the same device when 0 is current; compare by
    # type and resolved index.
    if dev.type == "cuda" and dev.index is None:
        return ("cuda", torch.cuda.current_device())
    return (dev.type, dev.index if dev.index is not None else 0)


def _block_index(
    blocks: Sequence[int], num_blocks: int, side: str, device: torch.device
) -> torch.Tensor:
    for blk in blocks:
        if not _is_int(blk) or not 0 <= blk < num_blocks:
            raise ValueError(f"{side} block {blk!r} out of range [0, {num_blocks})")
    return torch.tensor(list(blocks), dtype=torch.int64, device=device)
