"""The peer table has one owner, ``TransferBackend``, and every backend uses it.

``add_peer`` records what a peer advertised, ``remove_peer`` forgets it and
``advertised_regions`` answers from the same table, for LocalBackend,
MooncakeBackend and FaultInjectingBackend (which keeps no table of its own:
its peers are the inner backend's). What a missing advertisement means stays
each backend's own: LocalBackend then bounds writes by the peer's cache only,
MooncakeBackend sends nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from mooncake_helpers import prefill_backend, requires_mooncake

from transfer import (
    FaultInjectingBackend,
    FaultPlan,
    KVCache,
    KVLayout,
    LocalBackend,
    PeerInfo,
    RemoteRangeRejected,
    TransferBackend,
    TransferOp,
    TransferPlan,
    build_plan,
)
from transfer.mooncake import MooncakeBackend
from transfer.regions import Region

LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=64)
SID = "127.0.0.1:9"  # never listened on: no test below sends a byte to it


def _narrow(info: PeerInfo, blocks: int) -> PeerInfo:
    """``info`` advertising only the first ``blocks`` blocks of each buffer."""
    regions = tuple(Region(r.base, blocks * LAYOUT.block_bytes) for r in info.regions)
    return dataclasses.replace(info, regions=regions)


def _table_round_trip(backend: TransferBackend, info: PeerInfo) -> None:
    """add, replace, refuse a non-PeerInfo leaving the table as it was, remove."""
    assert backend.advertised_regions(SID) is None
    backend.add_peer(info)
    regions = backend.advertised_regions(SID)
    assert regions is not None and len(regions) == LAYOUT.num_buffers
    end = LAYOUT.buffer_bytes
    assert all(regions.contains(r.base, end) for r in info.regions)
    backend.add_peer(_narrow(info, 2))  # a new advertisement replaces the old one
    narrowed = backend.advertised_regions(SID)
    assert narrowed is not None and narrowed is not regions
    assert not any(narrowed.contains(r.base, end) for r in info.regions)
    assert all(narrowed.contains(r.base, 2 * LAYOUT.block_bytes) for r in info.regions)
    with pytest.raises(TypeError, match="add_peer needs a PeerInfo, got dict"):
        backend.add_peer({"session_id": SID})  # type: ignore[arg-type]
    assert backend.advertised_regions(SID) is narrowed
    backend.remove_peer(SID)
    assert backend.advertised_regions(SID) is None
    backend.remove_peer(SID)  # forgetting an unknown peer is a no-op
    assert backend.advertised_regions("nobody") is None


@pytest.fixture
def local() -> Iterator[tuple[LocalBackend, KVCache, KVCache]]:
    src, dst = KVCache(LAYOUT), KVCache(LAYOUT)
    backend = LocalBackend(workers=1)
    backend.register_source(src)
    backend.register_peer(SID, dst)
    yield backend, src, dst
    backend.close()


def test_local_backend_keeps_its_peers_in_the_base_table(
    local: tuple[LocalBackend, KVCache, KVCache],
) -> None:
    backend, src, dst = local
    info = dst.peer_info(SID)
    _table_round_trip(backend, info)
    # The table bounds what runs: block 3 lies past a two-block advertisement.
    plan = build_plan(src, info, [0], [3])
    backend.add_peer(_narrow(info, 2))
    with pytest.raises(RemoteRangeRejected, match=r"batch 0: destination \[0x.*outside every"):
        backend.submit(plan).result(timeout=10.0)
    # Without an advertisement the peer's own cache is the only bound.
    backend.remove_peer(SID)
    src.fill_seeded(3)
    backend.submit(plan).result(timeout=10.0)
    assert src.blocks_equal(dst, [0], [3]) == []
    # Unregistering the peer forgets its advertisement too.
    backend.add_peer(info)
    backend.unregister_peer(SID)
    assert backend.advertised_regions(SID) is None


def test_fault_backend_answers_from_the_inner_table(
    local: tuple[LocalBackend, KVCache, KVCache],
) -> None:
    inner, _, dst = local
    faults = FaultInjectingBackend(inner, FaultPlan.script([]))
    _table_round_trip(faults, dst.peer_info(SID))
    faults.add_peer(dst.peer_info(SID))
    assert inner.advertised_regions(SID) is faults.advertised_regions(SID) is not None
    assert faults._advertised == {}  # no second table
    faults.remove_peer(SID)
    assert inner.advertised_regions(SID) is None


@pytest.mark.mooncake
@requires_mooncake
def test_mooncake_backend_keeps_its_peers_in_the_base_table() -> None:
    src, dst = KVCache(LAYOUT), KVCache(LAYOUT)
    backend: MooncakeBackend
    with prefill_backend() as backend:
        backend.register(src)
        info = dst.peer_info(SID)  # addresses only: nothing is ever sent to it
        _table_round_trip(backend, info)
        plan = build_plan(src, info, [0], [3])
        op = backend.submit(plan)  # removed: no advertisement, nothing sent
        with pytest.raises(RemoteRangeRejected, match=f"no regions known for peer '{SID}'"):
            op.result(timeout=0)
        assert op.quiesced and backend.in_flight == 0
        backend.add_peer(_narrow(info, 2))
        op = backend.submit(plan)
        with pytest.raises(RemoteRangeRejected, match=r"outside every region .* nothing sent"):
            op.result(timeout=0)
        assert op.quiesced and backend.in_flight == 0
        backend.unregister(src)


class _Double(TransferBackend):
    """A test double in the usual shape: its own __init__, no call to the base's."""

    def __init__(self) -> None:
        self.submitted: list[TransferPlan] = []

    def submit(self, plan: TransferPlan) -> TransferOp:
        self.submitted.append(plan)
        return TransferOp(plan)

    def probe(self, peer: str) -> None:
        return None

    def close(self) -> None:
        return None


def test_a_backend_that_skips_the_base_init_still_has_a_peer_table() -> None:
    # The Scheduler calls add_peer on whatever backend it is given.
    _table_round_trip(_Double(), KVCache(LAYOUT).peer_info(SID))
    with pytest.raises(TypeError, match="Can't instantiate abstract class TransferBackend"):
        TransferBackend()  # type: ignore[abstract]
