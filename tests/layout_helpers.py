"""KV cache views in each of vLLM's six layouts, and tensor parallel copies between them.

``make_views`` lays a flat int8 buffer out as vLLM 0.32's ``allocate_kv_cache``
does (``compute_layout_strides``: a stride permutation of the logical
``[L, B, H, N, C]``, padded pages, kernel blocks), without importing vLLM;
the tests under tests/vllm/ build the same views with vLLM's own
``create_kv_cache_views``. ``tp_plans`` is what the connector does for one
decode rank: its legs (``ranks.legs``), each leg's slice (``ranks.block_slice``),
the plan (``transfer.plan.build_plan``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvguard.vllm.kv_views import KVGeometry
from kvguard.vllm.ranks import RankHeads, block_slice, legs
from transfer import KVCache, TransferPlan, build_plan
from transfer.backend import PeerInfo

# vLLM's KVCacheLayout values: logical axis of each physical position.
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUTS = tuple(ORDERS)
HEAD_RUN = ("LBHNC", "BHLNC")  # a rank's heads are one run of every unit


def make_views(
    name: str,
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    content: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    kernel: int = 1,
    padded_page: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the flat int8 buffer, one ``[blocks * kernel, heads, tokens // kernel, content]``
    view per layer); ``content`` in ``dtype`` elements."""
    order = ORDERS[name]
    cb = content * torch.empty(0, dtype=dtype).element_size()
    shape = (layers, blocks * kernel, heads, tokens // kernel, cb)
    strides = [0] * 5
    grid_end = max(order.index(0), order.index(1)) + 1
    cur = 1
    for pos, dim in reversed(tuple(enumerate(order))):
        if padded_page is not None and pos == grid_end - 1:
            cur = max(cur, padded_page)
        strides[dim] = cur
        cur = strides[dim] * shape[dim]
    size = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, shape, strides)
    return raw, [view5[i].view(dtype) for i in range(layers)]


def block_of(view: torch.Tensor, block: int, kernel: int) -> torch.Tensor:
    """Scheduler block ``block`` of one layer's view: its ``kernel`` kernel blocks."""
    return view[block * kernel : (block + 1) * kernel]


def tp_plans(
    name: str,
    prefill: Sequence[tuple[KVGeometry, KVCache]],
    decode: RankHeads,
    dst: PeerInfo,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> list[tuple[int, TransferPlan]]:
    """(prefill rank, plan) of each leg of a load on ``decode`` from the
    prefill ranks ``prefill``: what each prefill rank writes to it."""
    head_run = prefill[0][0].head_run  # as the connector's worker decides it
    out = []
    for leg in legs(decode, len(prefill), head_run, prefill[0][0].label):
        mine = RankHeads(leg.prefill_rank, len(prefill), decode.heads)
        geo, cache = prefill[leg.prefill_rank]
        whole = (decode.first, decode.count) == (mine.first, mine.count)
        part = (
            None
            if whole
            else block_slice(mine, decode.first, decode.count, head_run, geo.layout.block_bytes)
        )
        out.append((leg.prefill_rank, build_plan(cache, dst, src_blocks, dst_blocks, part=part)))
    return out


def head_bytes(views: Sequence[torch.Tensor], block: int, head: int, kernel: int) -> bytes:
    """Every layer's bytes of one head of one block (a rank's own head index)."""
    return b"".join(
        block_of(v, block, kernel)[:, head].contiguous().view(torch.uint8).numpy().tobytes()
        for v in views
    )
