"""vLLM's per-layer KV cache views as kvguard buffers: which bytes of each block move.

vLLM 0.32 allocates one flat buffer and views it as one ``[B, H, N, C]``
tensor per layer (``create_kv_cache_views``), laid out by one of six stride
orders (``vllm/v1/kv_cache_layout.py``). kvguard moves a block as one engine
entry per *unit* of it, a unit being the largest part of the block that is
one run of bytes, the same in every layout of that name:

* ``LBHNC``, ``LBNHC`` (layers outermost): one unit per layer, the layer's
  page of the block (``block_stride`` apart: padded pages leave gaps);
* ``LHBNC`` (heads outside blocks): one unit per layer and head;
* ``BLHNC``, ``BLNHC``, ``BHLNC`` (blocks outermost): one unit per block,
  every layer's page of it (padding between pages moves along).

With kernel blocks smaller than ``--block-size`` a view has ``B * R`` kernel
blocks: ``num_blocks`` regroups them, ``R`` kernel blocks to a block.

Tensor parallel ranks of different sizes need a rank's heads to be one run
of each unit (heads outermost in it: ``LBHNC`` and ``BHLNC`` without kernel
blocks, whatever the head count, so that both sides agree); ``head_run``
says so and ``ranks`` does the head math. No vLLM import: the layout is given by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from transfer import KVCache, KVLayout

__all__ = ["HEAD_RUN", "UNITS", "KVGeometry", "LayoutError", "check_groups", "describe"]

# Layout name -> what one engine entry of a block holds.
UNITS: Final = {
    "LBHNC": "layer",
    "LBNHC": "layer",
    "LHBNC": "head",
    "BLHNC": "block",
    "BLNHC": "block",
    "BHLNC": "block",
}

# Layouts whose unit has heads outermost: a rank's share of a block is one run.
HEAD_RUN: Final = ("LBHNC", "BHLNC")


class LayoutError(ValueError):
    """KV cache views kvguard cannot describe as buffers; names the layout and the view."""


def check_groups(groups: Sequence[tuple[str, int, bool]]) -> None:
    """Refuse, at start, a model kvguard would load only part of: ``groups``
    are vLLM's KV cache groups as (spec kind, layers, attention). One group
    of attention layers is moved whole; several groups (hybrid attention,
    sliding window beside full, mamba state) are not (no ``SupportsHMA``),
    nor a group that is not attention. LayoutError names every group's kind."""
    if len(groups) == 1 and groups[0][2]:
        return
    kinds = ", ".join(f"{kind} ({n} layers)" for kind, n, _ in groups) or "none"
    raise LayoutError(
        "KVGuardConnector moves one KV cache group of attention layers; this model has "
        f"{len(groups)}: {kinds}. Hybrid models (several groups, or mamba state) are not "
        "supported: nothing would load their other groups"
    )


@dataclass(frozen=True)
class KVGeometry:
    """Where each block's bytes are: ``layout.num_buffers`` units of
    ``layout.block_bytes``, unit ``i`` of block ``b`` at ``bases[i] + b * layout.stride``."""

    name: str  # vLLM's layout name, e.g. "LBHNC"
    unit: str  # "layer", "head" or "block" (UNITS)
    layout: KVLayout
    bases: tuple[int, ...]
    storage: tuple[torch.Tensor, ...]  # the allocations the units lie in: what is registered
    heads: int  # KV heads in this rank's views
    head_run: bool  # a rank's heads are one run of every unit (heads outermost in it)
    page: tuple[int, ...]  # one layer's block, logical [R, H, N, C] in the views' dtype
    dtype: torch.dtype

    @property
    def label(self) -> str:
        """The layout's name, and its kernel blocks if a block has several."""
        r = self.page[0]
        return self.name if r == 1 else f"{self.name} ({r} kernel blocks a block)"

    def cache(self) -> KVCache:
        """The views' memory as a ``KVCache`` (strided views, nothing copied)."""
        return KVCache.over(self.layout, self.storage, self.bases)

    def fingerprint(self, layers: int, sliced: bool) -> str:
        """What a peer's blocks must match: the layout by name, and each
        layer's block shape (without heads where a rank's share is a slice, ``sliced``)."""
        r, h, n, c = self.page
        shape = ((r,) if r > 1 else ()) + ((n, c) if sliced else (h, n, c))
        head = "head x " if sliced else ""
        return f"{self.dtype}/{self.name}/{head}{'x'.join(map(str, shape))}/layers={layers}"


def describe(views: Sequence[torch.Tensor], name: str, num_blocks: int) -> KVGeometry:
    """The geometry of per-layer ``[B, H, N, C]`` views (layer order) laid out by
    ``name``, with ``num_blocks`` scheduler blocks. LayoutError names the layout
    and the view or stride that does not fit it."""
    unit = UNITS.get(name)
    if unit is None:
        raise LayoutError(f"unknown KV cache layout {name!r}; kvguard knows {sorted(UNITS)}")
    if not views:
        raise LayoutError(f"no KV cache views to describe ({name})")
    pages = [_bytes5(v, num_blocks, name, i) for i, v in enumerate(views)]
    first = pages[0]
    for i, p in enumerate(pages):
        if p.shape != first.shape or p.stride() != first.stride() or p.device != first.device:
            raise LayoutError(
                f"{name}: layer {i}'s view {tuple(p.shape)} {p.stride()} on {p.device} "
                f"differs from layer 0's {tuple(first.shape)} {first.stride()} on {first.device}"
            )
    _, r, h, n, c = first.shape
    s_b, s_r, s_h, s_n, s_c = first.stride()
    ptrs = [p.data_ptr() for p in pages]
    page = ((r, h, n, c), (s_r, s_h, s_n, s_c))
    if unit == "layer":
        block_bytes, bases = _dense_run(name, "a layer's block", *page), ptrs
    elif unit == "head":
        block_bytes = _dense_run(name, "a layer's head", (r, n, c), (s_r, s_n, s_c))
        bases = [p + k * s_h for p in ptrs for k in range(h)]
    else:
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        if any(p != ptrs[0] + i * step for i, p in enumerate(ptrs)):
            raise LayoutError(f"{name}: layers are not evenly spaced in a block: {ptrs}")
        dims = ((len(ptrs), r, h, n, c), (step, s_r, s_h, s_n, s_c))
        if _is_dense(*dims):
            block_bytes = len(ptrs) * r * h * n * c
        else:  # padded pages: the gaps between layers move with the block
            one = _dense_run(name, "a layer's block", *page)
            if step < one:
                raise LayoutError(f"{name}: layer pages of {one} bytes are {step} bytes apart")
            block_bytes = (len(ptrs) - 1) * step + one
        bases = [ptrs[0]]

    # Heads outermost in a unit, decided by the layout (a size-1 dim's stride
    # says nothing), so that ranks holding different head counts agree.
    head_run = name in HEAD_RUN and r == 1
    if block_bytes > s_b and num_blocks > 1:
        raise LayoutError(
            f"{name}: a block's {unit} holds {block_bytes} bytes but blocks are {s_b} bytes apart"
        )
    layout = KVLayout(
        len(bases), num_blocks, block_bytes, kv_split=False, block_stride=max(s_b, block_bytes)
    )
    if layout.dense:
        layout = KVLayout(len(bases), num_blocks, block_bytes, kv_split=False)
    dtype = views[0].dtype
    size = views[0].element_size()
    return KVGeometry(
        name=name,
        unit=unit,
        layout=layout,
        bases=tuple(bases),
        storage=_storage(views),
        heads=h,
        head_run=head_run,
        page=(r, h, n, c // size),
        dtype=dtype,
    )


def _bytes5(v: torch.Tensor, num_blocks: int, name: str, i: int) -> torch.Tensor:
    """Layer ``i``'s view as uint8 ``[B, R, H, N, C]`` (R kernel blocks per block)."""
    if v.dim() != 4 or v.stride(-1) != 1:
        raise LayoutError(
            f"{name}: layer {i}'s KV cache view {tuple(v.shape)} {v.stride()} is not "
            "[B, H, N, C] with C innermost"
        )
    raw = v.view(torch.uint8) if v.dtype != torch.uint8 else v
    kernel = int(raw.shape[0])
    if kernel % num_blocks:
        raise LayoutError(
            f"{name}: layer {i}'s {kernel} kernel blocks do not group into {num_blocks} blocks"
        )
    shape = (num_blocks, kernel // num_blocks, *raw.shape[1:])
    return raw.view(shape)


def _live(sizes: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int, int]]:
    """(stride, size, position) of the dims of more than one element, innermost first."""
    dims = enumerate(zip(sizes, strides, strict=True))
    return sorted((st, sz, k) for k, (sz, st) in dims if sz > 1)


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for stride, size, _ in _live(sizes, strides):
        if stride != expect:
            return False
        expect *= size
    return True


def _dense_run(name: str, what: str, sizes: Sequence[int], strides: Sequence[int]) -> int:
    if not _is_dense(sizes, strides):
        raise LayoutError(
            f"{name}: {what} {tuple(sizes)} with byte strides {tuple(strides)} is not one run"
        )
    total = 1
    for s in sizes:
        total *= s
    return total


def _storage(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The distinct allocations under ``views``, each as one uint8 tensor."""
    out: dict[int, torch.Tensor] = {}
    for v in views:
        st = v.untyped_storage()
        if st.data_ptr() not in out:
            whole = torch.empty(0, dtype=torch.uint8, device=v.device)
            out[st.data_ptr()] = whole.set_(st, 0, (st.nbytes(),), (1,))
    return tuple(out.values())
