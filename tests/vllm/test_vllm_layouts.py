"""Every KV cache layout vLLM 0.32 resolves, moved between two processes over
the real Mooncake engine, for every tensor parallel pairing the layout allows.

The views are vLLM's own (``create_kv_cache_views``, through
``tests/vllm/layout_peer.vllm_views``), described by ``kvguard.vllm.kv_views``
exactly as the connector's ``register_kv_caches`` does. The prefill ranks
live in this process on one engine; each decode rank is a
``tests.vllm.layout_peer`` child with its own engine. After the legs'
plans (``tests/layout_helpers.tp_plans``: ``ranks.legs``,
``ranks.block_slice``, ``build_plan``) land, each decode head's bytes in
every layer equal the prefill's, head for head. A pairing the layout
cannot do is refused naming both sizes and the layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvguard.vllm.kv_views import KVGeometry, describe
from kvguard.vllm.ranks import RankHeads
from tests.layout_helpers import LAYOUTS, tp_plans
from tests.mooncake_helpers import prefill_backend, requires_mooncake
from tests.vllm.layout_peer import WAIT, Peer, head_digests, kernel_of, vllm_views
from transfer import KVCache
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import peer_info_from_message

pytestmark = [pytest.mark.mooncake, requires_mooncake]

HEADS, LAYERS, SRC_BLOCKS, DST_BLOCKS = 4, 3, 6, 8
SRC, DST = [0, 1, 2, 5], [3, 4, 5, 7]  # a run of three blocks and a lone one
HEAD_RUN = ("LBHNC", "BHLNC")  # a rank's heads are one run of each unit
ROWS: list[str] = []  # the table printed at the end (docs: layout x TP -> bytes equal)


@pytest.fixture(scope="module")
def backend() -> Iterator[MooncakeBackend]:
    with prefill_backend() as b:
        yield b
    print("\n| layout | variant | prefill TP -> decode TP | bytes equal | entries/request |")
    print("|---|---|---|---|---|")
    print("\n".join(ROWS))


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    try:
        for _ in range(4):
            started.append(Peer())
        yield started
    finally:
        for p in started:
            p.stop()


def _views(name: str, blocks: int, heads: int, variant: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"name": name, "layers": LAYERS, "blocks": blocks, "heads": heads}
    if variant == "kernel":
        kw["kernel"] = 8  # --block-size 16 on kernel blocks of 8
    elif variant == "padded":
        kw["padded_page"] = heads * 16 * 32 + 256  # the page plus 256 bytes
    elif variant == "mla":
        kw["mla"] = True
    return kw


PAIRS = [(1, 1), (2, 2), (4, 4), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
CASES = (
    [(n, "plain", p, d) for n in LAYOUTS for p, d in PAIRS]
    + [(n, "kernel", p, d) for n in ("LBHNC", "LBNHC") for p, d in [(1, 1), (2, 2), (2, 1)]]
    + [(n, "padded", p, d) for n in ("LBHNC", "BLHNC", "BLNHC") for p, d in PAIRS[:5]]
    + [(n, "mla", p, d) for n in LAYOUTS for p, d in [(1, 1), (2, 2), (1, 2), (2, 4), (2, 1)]]
    + [(n, "mla", 4, 2) for n in ("LBHNC", "BLHNC")]
)


@pytest.mark.parametrize(("name", "variant", "p_size", "d_size"), CASES)
def test_every_head_lands_once_and_intact(
    backend: MooncakeBackend,
    peers: list[Peer],
    name: str,
    variant: str,
    p_size: int,
    d_size: int,
) -> None:
    heads = 1 if variant == "mla" else HEADS
    prefill: list[tuple[KVGeometry, KVCache]] = []
    prefill_views: list[list[torch.Tensor]] = []
    try:
        for _ in range(p_size):
            kw = _views(name, SRC_BLOCKS, max(1, heads // p_size), variant)
            raw, views = vllm_views(**kw)
            raw.random_(-128, 127)
            geo = describe(views, name, SRC_BLOCKS)
            cache = geo.cache()
            backend.register(cache)
            prefill.append((geo, cache))
            prefill_views.append(views)
        entries = 0
        for d in range(d_size):
            me = RankHeads(d, d_size, heads)
            reply = peers[d].ask(
                {"op": "setup", "views": _views(name, DST_BLOCKS, me.count, variant)}
            )
            info = peer_info_from_message(bytes.fromhex(reply["peer"]))
            backend.add_peer(info)
            pairs = name in HEAD_RUN and variant in ("plain", "padded")
            if variant == "mla":  # one latent head on every rank: any sizes pair
                pairs = True
            if p_size != d_size and not pairs:
                why = rf"size {p_size} and decode size {d_size}.*(the {name}|MLA)"
                with pytest.raises(ValueError, match=why):
                    tp_plans(name, prefill, me, info, SRC, DST)
                ROWS.append(f"| {name} | {variant} | {p_size} -> {d_size} | refused | - |")
                return
            for _, plan in tp_plans(name, prefill, me, info, SRC, DST):
                entries += plan.num_entries
                op = backend.submit(plan)
                op.result(timeout=WAIT)
                assert op.wait_quiesced(5.0)
            got = peers[d].ask({"op": "heads", "blocks": DST})["heads"]
            for i, s in enumerate(SRC):
                for h in range(me.count):  # head for head, every layer's bytes of it
                    head = me.first + h
                    if variant == "mla":
                        p = d % p_size  # its one prefill rank
                    else:
                        p = d if p_size == d_size else head // (heads // p_size)
                    mine = RankHeads(p, p_size, heads)  # MLA: head 0 everywhere
                    views = prefill_views[p]
                    want = head_digests(views, [s], kernel_of(views, SRC_BLOCKS))[0]
                    assert got[i][h] == want[head - mine.first], (name, variant, s, head)
        ROWS.append(f"| {name} | {variant} | {p_size} -> {d_size} | yes | {entries} |")
    finally:
        for _, cache in prefill:
            backend.unregister(cache)
