from __future__ import annotations

import pytest

from kvguard.run.workload import BlockAllocator, runs


def test_clean_free_list_hands_out_runs() -> None:
    pool = BlockAllocator(64)
    first = pool.take(16, timeout=0)
    assert first == list(range(16))
    second = pool.take(16, timeout=0)
    pool.free(first)  # freed in order, back at the tail
    assert runs(pool.take(32, timeout=0) or []) == 1  # 32..63: one run
    assert runs(pool.take(16, timeout=0) or []) == 1  # the freed 0..15
    assert second == list(range(16, 32))


def test_fragmentation_scatters_the_free_list() -> None:
    clean, frag = BlockAllocator(1024), BlockAllocator(1024, fragmentation=1.0, seed=3)
    for pool in (clean, frag):
        for _ in range(40):  # churn: take and free 16 at a time
            got = pool.take(16, timeout=0)
            assert got is not None and len(set(got)) == 16
            pool.free(got)
    clean_runs = runs(clean.take(16, timeout=0) or [])
    frag_runs = runs(frag.take(16, timeout=0) or [])
    assert clean_runs == 1
    assert frag_runs >= 8  # nearly one entry per block


def test_take_waits_no_longer_than_its_timeout_and_loses_nothing() -> None:
    pool = BlockAllocator(8)
    got = pool.take(8, timeout=0)
    assert got is not None
    assert pool.take(1, timeout=0.01) is None
    pool.free(got)
    assert sorted(pool.take(8, timeout=0) or []) == list(range(8))
    assert len(pool) == 0


@pytest.mark.parametrize(("n", "frag"), [(0, 0.0), (4, -0.1), (4, 1.5)])
def test_bad_arguments_are_named(n: int, frag: float) -> None:
    with pytest.raises(ValueError, match=repr(n) if n < 1 else repr(frag)):
        BlockAllocator(n, fragmentation=frag)
