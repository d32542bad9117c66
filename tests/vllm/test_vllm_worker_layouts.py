"""The connector's layout choices: what it asks vLLM for, and what its worker
makes of each layout vLLM may resolve anyway (views from vLLM's own
``create_kv_cache_views``, a real Mooncake engine, no server)."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvguard.vllm.worker as worker_module
from kvguard.vllm.actions import LoadOutcome
from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.kv_views import LayoutError, describe
from kvguard.vllm.metadata import ForgetMeta, KVGuardMetadata, LoadMeta, Source
from kvguard.vllm.ranks import Pairing, RankHeads
from kvguard.vllm.settings import Settings
from kvguard.vllm.states import LoadEnd
from kvguard.vllm.worker import KVGuardWorker
from tests.layout_helpers import LAYOUTS
from tests.mooncake_helpers import requires_mooncake
from tests.vllm.layout_peer import vllm_views

HEADS, LAYERS, BLOCKS = 4, 3, 6


def _config(name: str, tp: int, mla: bool = False) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=f"layouts-{uuid.uuid4()}"),
        max_concurrent_batches=1,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=1),
        model_config=SimpleNamespace(
            use_mla=mla, get_total_num_kv_heads=lambda: 1 if mla else HEADS
        ),
        cache_config=SimpleNamespace(
            block_size=16, get_resolved_kv_cache_layout=lambda: KVCacheLayout[name]
        ),
    )


def test_the_connector_asks_for_lbhnc_except_for_mla() -> None:
    assert KVGuardConnector.get_required_kvcache_layout(_config("LBHNC", 1)) == "LBHNC"
    assert KVGuardConnector.get_required_kvcache_layout(_config("LBHNC", 1, mla=True)) is None
    no_model = SimpleNamespace(model_config=None)
    assert KVGuardConnector.get_required_kvcache_layout(no_model) is None  # type: ignore[arg-type]


# vLLM splits a block into kernel blocks only in the layer-major LB... layouts.
_LAYOUT_KERNELS = [(n, None) for n in LAYOUTS] + [(n, 8) for n in LAYOUTS if n.startswith("LB")]


@requires_mooncake
@pytest.mark.parametrize(("name", "kernel"), _LAYOUT_KERNELS)
def test_the_worker_registers_every_layout_by_its_units(
    name: str, kernel: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "get_tensor_model_parallel_rank", lambda: 1)
    _, views = vllm_views(name, LAYERS, BLOCKS, HEADS // 2, kernel=kernel)
    kv = {f"model.layers.{i}.attn": v for i, v in enumerate(views)}
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    blocks = KVCacheConfig(  # the scheduler's blocks, in one group
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[_group(spec, LAYERS)]
    )
    w = KVGuardWorker(_config(name, 2), Settings.of({}), producer=False, kv_cache_config=blocks)
    try:
        w.register_kv_caches(kv)
        geo = describe(views, name, BLOCKS)
        assert w.cache is not None and w.cache.layout == geo.layout
        assert w.head_major == (name in ("LBHNC", "BHLNC") and kernel is None)
        assert f"/{name}/" in w.compat and ("head x " in w.compat) == w.head_major
        assert (w.rank.first, w.rank.count) == (2, 2)
        assert w.backend is not None and len(w.cache.regions()) == 1
    finally:
        w.shutdown()


def _group(spec: Any, layers: int) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(layers)], spec)


def test_hybrid_models_are_refused_at_start_naming_each_group() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64
    )
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    cases = [
        ([_group(full, 2), _group(window, 2)], r"has 2: FullAttentionSpec \(2 layers\), Sliding"),
        ([_group(mamba, 3)], r"has 1: MambaSpec \(3 layers\)"),
    ]
    for groups, match in cases:
        config: Any = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        w = KVGuardWorker(
            _config("LBHNC", 1), Settings.of({}), producer=True, kv_cache_config=config
        )
        with pytest.raises(LayoutError, match=match):
            w.register_kv_caches({})
        assert w.backend is None  # refused before any engine started


class _Receiver:
    """What the worker asks of its ``DecodeReceiver``, recorded; outcomes fed by the test."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.finished: list[LoadOutcome] = []
        self.released: list[str] = []

    def expect(self, *args: Any) -> None:
        self.calls.append(("expect", *args))

    def forget(self, *args: Any) -> None:
        self.calls.append(("forget", *args))

    def take_finished(self) -> list[LoadOutcome]:
        out, self.finished = self.finished, []
        return out

    def take_released(self) -> list[str]:
        out, self.released = self.released, []
        return out


def test_an_mla_decode_rank_tells_the_prefills_spare_ranks_once_its_load_is_over() -> None:
    """MLA, prefill TP 4, decode TP 2: decode rank 1 loads from prefill rank 1
    alone and, once the load is over, tells rank 3 (which holds the same
    blocks) to let go; after a refusal it does not (the prefill keeps the
    request for another decode, which may load from rank 3)."""
    w = KVGuardWorker(_config("LBHNC", 2, mla=True), Settings.of({}), producer=False)
    w.rank = RankHeads(1, 2, 1)
    w._pairing = Pairing(w.rank, head_major=False)
    fake = _Receiver()
    w.receiver = fake  # type: ignore[assignment]
    ep, due = "tcp://127.0.0.1:17600", time.monotonic() + 10

    def load(rid: str, src: str, group: int = 1) -> LoadMeta:
        return LoadMeta(rid, [3, 4], Source(ep, src, 4), due, group)

    w.bind(KVGuardMetadata(loads=[load("d1", "p1", 2), load("d2", "p2")]))
    assert fake.calls == [
        ("expect", "d1", "tcp://127.0.0.1:17601", "p1", [3, 4], due, 2, None),
        ("expect", "d2", "tcp://127.0.0.1:17601", "p2", [3, 4], due, 1, None),
    ]  # nothing told before a load is over
    fake.calls.clear()
    fake.finished = [
        LoadOutcome("d1", LoadEnd.LOADED, "", 0.1),
        LoadOutcome("d2", LoadEnd.REFUSED, "no room", 0.1),
    ]
    results = w.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"d1", "d2"}, {"d2"})
    assert fake.calls == [("forget", "tcp://127.0.0.1:17603", "p1", 2)]
    fake.calls.clear()
    # A decode request that will never load tells every rank holding it.
    w.bind(KVGuardMetadata(forgets=[ForgetMeta(Source(ep, "p3", 4), 2)]))
    assert fake.calls == [
        ("forget", "tcp://127.0.0.1:17601", "p3", 2),
        ("forget", "tcp://127.0.0.1:17603", "p3", 2),
    ]
    assert w._spares == {}  # each load's spares told once, then dropped


def test_a_load_released_before_the_worker_took_its_fenced_report_still_finishes() -> None:
    """The receiver thread may report a load fenced and lift its fence (a
    killed prefill's port is refused at once) between the worker's two
    takes: after ``take_finished``, before ``take_released``. The release
    then comes a step before its report. The request must still finish when
    the report comes (CI: it was lost, the request waited for good and its
    blocks never came back)."""
    w = KVGuardWorker(_config("LBHNC", 1), Settings.of({}), producer=False)
    w.rank = RankHeads(0, 1, HEADS)
    w._pairing = Pairing(w.rank, head_major=False)
    fake = _Receiver()
    w.receiver = fake  # type: ignore[assignment]
    source = Source("tcp://127.0.0.1:17600", "p1", 1)
    w.bind(KVGuardMetadata(loads=[LoadMeta("d1", [3, 4], source, time.monotonic() + 10, 1)]))
    fake.released = ["d1"]  # its report came after this step's take_finished
    results = w.get_transfer_results(set())
    assert (results.finished_recving, w.get_block_ids_with_load_errors()) == (set(), set())
    fake.finished = [LoadOutcome("d1", LoadEnd.PEER_LOST, "prefill gone", 0.1, fenced=True)]
    results = w.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"d1"}, {"d1"})
    assert w.get_block_ids_with_load_errors() == set()  # finished at once: no load errors
    assert w._legs.in_use() == {}
