"""vLLM's six KV cache layouts as kvguard buffers (kvguard.vllm.kv_views), and
tensor parallel copies between them through plans (LocalBackend): no vLLM
needed; tests/vllm/test_vllm_layouts.py does the same over two processes and
the real engine, with vLLM's own views."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch

from kvguard.vllm.admission import Admission, Refusal
from kvguard.vllm.kv_views import LayoutError, describe
from kvguard.vllm.protocol import Push
from kvguard.vllm.ranks import RankHeads
from tests.layout_helpers import (
    HEAD_RUN,
    LAYOUTS,
    block_of,
    head_bytes,
    make_views,
    tp_plans,
)
from tests.test_checksum import reference, rows_of
from transfer import KVCache, KVLayout, build_plan
from transfer.checksum import region_digest
from transfer.local import LocalBackend
from transfer.peer_protocol import peer_message_of

L, H, N, C = 3, 4, 4, 8  # layers, KV heads, tokens per block, head content (bf16)
# (layout, kernel blocks per block, padded page): every shape vLLM allows.
CASES = [(name, 1, None) for name in LAYOUTS] + [
    ("LBHNC", 2, None),
    ("LBNHC", 2, None),
    ("LBHNC", 1, 320),
    ("BLHNC", 1, 320),
    ("BLNHC", 1, 320),
]
_PEER = peer_message_of(KVCache(KVLayout(1, 1, 64)).peer_info("127.0.0.1:1"))
ENTRIES = {"layer": L, "head": L * H, "block": 1}  # engine entries per block


@pytest.mark.parametrize(("name", "kernel", "pad"), CASES)
def test_units_cover_each_block_exactly(name: str, kernel: int, pad: int | None) -> None:
    raw, views = make_views(name, L, 5, H, N, C, kernel=kernel, padded_page=pad)
    geo = describe(views, name, 5)
    assert geo.layout.num_buffers == ENTRIES[geo.unit]
    assert geo.head_run == (name in HEAD_RUN and kernel == 1)
    # blocks touch unless pages are padded, or heads lie outside blocks (LHBNC: each
    # head's pages of neighbouring blocks touch too)
    assert geo.layout.dense == (pad is None)
    cache = geo.cache()
    assert len(cache.regions()) == 1 and cache.regions()[0].length == raw.numel()
    for b in range(5):
        raw.zero_()
        for v in views:
            block_of(v, b, kernel).view(torch.uint8).fill_(1)
        moved = torch.cat([cache.block(i, b) for i in range(geo.layout.num_buffers)])
        assert int(moved.sum()) == int(raw.sum()) == L * H * N * C * 2  # every byte of block b
        if pad is None:
            assert bool((moved == 1).all())  # and nothing else


@pytest.mark.parametrize(("name", "kernel", "pad"), CASES)
def test_every_layout_is_one_group_and_digests_as_the_reference(
    name: str, kernel: int, pad: int | None
) -> None:
    """vLLM lays every layer out in one allocation a constant stride apart, so
    a digest reads all of a block run's buffers in one torch call (see
    ``KVCache.groups``), and gets the digest that the per-buffer definition gives."""
    raw, views = make_views(name, L, 5, H, N, C, kernel=kernel, padded_page=pad)
    raw.random_(-128, 127, generator=torch.Generator().manual_seed(5))
    cache = describe(views, name, 5).cache()
    assert [len(g) for g in cache.groups()] == [cache.layout.num_buffers]
    blocks, length = [4, 1, 2], cache.layout.block_bytes
    for part in (None, (length // 2, length // 4 // 4 * 4)):
        assert region_digest(cache, blocks, part) == reference(rows_of(cache, blocks, part))


@pytest.mark.parametrize(("name", "kernel", "pad"), CASES)
def test_a_plan_moves_each_block_to_its_destination_only(
    name: str, kernel: int, pad: int | None
) -> None:
    src_raw, src_views = make_views(name, L, 6, H, N, C, kernel=kernel, padded_page=pad)
    _, dst_views = make_views(name, L, 9, H, N, C, kernel=kernel, padded_page=pad)
    src_raw.random_(-128, 127)
    src, dst = describe(src_views, name, 6), describe(dst_views, name, 9)
    s_blocks, d_blocks = [0, 1, 2, 5], [3, 4, 5, 0]
    with closing(LocalBackend()) as backend:
        src_cache, dst_cache = src.cache(), dst.cache()
        backend.register_source(src_cache)
        info = backend.register_peer("decode", dst_cache)
        plan = build_plan(src_cache, info, s_blocks, d_blocks)
        # contiguous runs coalesce only where blocks touch
        runs = 2 if src.layout.dense and dst.layout.dense else len(s_blocks)
        assert plan.num_entries == runs * src.layout.num_buffers
        backend.submit(plan).result(timeout=10)
    for sv, dv in zip(src_views, dst_views, strict=True):
        for s, d in zip(s_blocks, d_blocks, strict=True):
            got, want = block_of(dv, d, kernel), block_of(sv, s, kernel)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bf16 NaNs
        for d in set(range(9)) - set(d_blocks):
            assert not block_of(dv, d, kernel).view(torch.uint8).any()


PAIRINGS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize(("p_size", "d_size"), PAIRINGS)
def test_tensor_parallel_pairings_move_every_head_once(name: str, p_size: int, d_size: int) -> None:
    blocks = 4
    prefill = []
    for _ in range(p_size):
        raw, views = make_views(name, L, blocks, H // p_size, N, C)
        raw.random_(-128, 127)
        geo = describe(views, name, blocks)
        prefill.append((geo, geo.cache(), views))
    s_blocks, d_blocks = [0, 1, 3], [2, 0, 1]
    with closing(LocalBackend()) as backend:
        for _, cache, _ in prefill:
            backend.register_source(cache)
        for d in range(d_size):
            me = RankHeads(d, d_size, H)
            _, dviews = make_views(name, L, blocks, me.count, N, C)
            dgeo = describe(dviews, name, blocks)
            info = backend.register_peer(f"decode{d}", dgeo.cache())
            ranks = [(g, c) for g, c, _ in prefill]
            if p_size != d_size and name not in HEAD_RUN:
                with pytest.raises(ValueError, match=f"size {p_size} and decode size {d_size}"):
                    tp_plans(name, ranks, me, info, s_blocks, d_blocks)
                continue
            for _, plan in tp_plans(name, ranks, me, info, s_blocks, d_blocks):
                backend.submit(plan).result(timeout=10)
            for s, dst in zip(s_blocks, d_blocks, strict=True):
                for h in range(me.count):  # head for head, every layer
                    head = me.first + h
                    p = head // (H // p_size)
                    want = head_bytes(prefill[p][2], s, head - p * (H // p_size), 1)
                    assert head_bytes(dviews, dst, h, 1) == want, (name, s, dst, head)


def test_a_strided_layout_round_trips_and_refuses_a_short_stride() -> None:
    lay = KVLayout(2, 8, 100, kv_split=False, block_stride=128)
    assert KVLayout.from_dict(lay.to_dict()) == lay
    assert lay.buffer_bytes == 7 * 128 + 100 and not lay.dense
    with pytest.raises(ValueError, match="block_stride must be 0 or an int >= block_bytes"):
        KVLayout(2, 8, 100, block_stride=64)


def test_views_that_fit_no_layout_are_refused_naming_it() -> None:
    _, views = make_views("LHBNC", L, 4, H, N, C)
    with pytest.raises(LayoutError, match="unknown KV cache layout 'HND'"):
        describe(views, "HND", 4)
    with pytest.raises(LayoutError, match="LBHNC: a layer's block"):
        describe(views, "LBHNC", 4)  # heads outside blocks: not one run
    with pytest.raises(LayoutError, match="do not group into 3 blocks"):
        describe(views, "LHBNC", 3)
    with pytest.raises(LayoutError, match="layer 1's view"):
        describe([views[0], views[1][:, :2]], "LHBNC", 4)


def test_the_layout_is_in_the_fingerprint_and_a_mismatch_is_refused_naming_both() -> None:
    prints = {}
    for name in LAYOUTS:
        _, views = make_views(name, L, 4, H, N, C)
        geo = describe(views, name, 4)
        prints[name] = geo.fingerprint(L, geo.head_run)
        assert f"/{name}/" in prints[name]
    assert len(set(prints.values())) == len(LAYOUTS)
    _, kviews = make_views("LBHNC", L, 4, H, N, C, kernel=2)
    assert describe(kviews, "LBHNC", 4).label == "LBHNC (2 kernel blocks a block)"
    prefill = Admission(prints["LBHNC"], None, True, 1024)
    push = Push(
        request_id="r",
        load_id="r",
        blocks=[0],
        peer=_PEER,
        expires_at=1.0,
        compat=prints["BLHNC"],
    )
    with pytest.raises(Refusal, match=r"decode '.*/BLHNC/.*', prefill '.*/LBHNC/"):
        prefill.admit(push, 1)


def test_fill_seeded_fills_a_strided_cache_deterministically() -> None:
    for name, pad in (("LBHNC", None), ("BLHNC", 320)):
        caches = []
        for _ in range(2):
            _, views = make_views(name, L, 4, H, N, C, padded_page=pad)
            cache = describe(views, name, 4).cache()
            cache.fill_seeded(3)
            caches.append(cache)
        assert caches[0].blocks_equal(caches[1], [0, 1, 2, 3], [0, 1, 2, 3]) == []
        assert bool(caches[0].block(0, 3).any())
