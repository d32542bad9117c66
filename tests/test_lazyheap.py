"""The core's one lazy-deletion heap, alone: order, stale items, compaction."""

from __future__ import annotations

import pytest

from scheduler import _lazyheap
from scheduler._lazyheap import LazyHeap


class Item:
    def __init__(self, name: str) -> None:
        self.name = name
        self.wanted = True


def names(items: list[Item]) -> list[str]:
    return [i.name for i in items]


def heap_of(*keyed: tuple[float, str]) -> tuple[LazyHeap[float, Item], dict[str, Item]]:
    heap: LazyHeap[float, Item] = LazyHeap(lambda i: i.wanted)
    items = {}
    for key, name in keyed:
        items[name] = Item(name)
        heap.push(key, items[name])
    return heap, items


def test_pop_takes_the_smallest_key_first_and_equal_keys_in_insertion_order() -> None:
    heap, _ = heap_of((2.0, "c"), (1.0, "a"), (1.0, "b"), (3.0, "d"))
    out = []
    while (item := heap.pop()) is not None:
        out.append(item.name)
    assert out == ["a", "b", "c", "d"]
    assert len(heap) == 0 and heap.pop() is None and heap.next_key() is None


def test_pop_due_takes_every_live_item_at_or_below_the_limit() -> None:
    heap, items = heap_of((1.0, "a"), (2.0, "b"), (2.0, "c"), (3.0, "d"))
    items["b"].wanted = False
    heap.discard()
    assert names(heap.pop_due(2.0)) == ["a", "c"]
    assert (len(heap), heap._stale) == (1, 0)  # b left the heap and took its count
    assert heap.next_key() == 3.0
    assert heap.pop_due(2.999) == []


def test_stale_items_on_top_are_dropped_by_next_key_and_pop() -> None:
    heap, items = heap_of((1.0, "a"), (2.0, "b"), (3.0, "c"))
    for name in ("a", "b"):
        items[name].wanted = False
        heap.discard()
    assert (heap.next_key(), len(heap), heap._stale) == (3.0, 1, 0)
    items["c"].wanted = False
    heap.discard()
    assert (heap.pop(), len(heap), heap._stale) == (None, 0, 0)


def test_the_count_never_goes_below_zero_for_an_unannounced_stale_item() -> None:
    heap, items = heap_of((1.0, "a"), (2.0, "b"))
    items["a"].wanted = False  # no discard()
    assert heap.pop() is items["b"]
    assert heap._stale == 0


def test_compaction_waits_for_a_stale_majority_of_a_large_enough_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_lazyheap, "_COMPACT_MIN", 4)
    heap, items = heap_of(*((float(k), f"i{k}") for k in range(4)))
    seen = []
    for name in ("i0", "i1", "i2"):
        items[name].wanted = False
        heap.discard()
        seen.append((len(heap), heap._stale))
    # 2 of 4 is no majority; 3 of 4 is, and 4 items are enough to compact.
    assert seen == [(4, 1), (4, 2), (1, 0)]
    assert names(heap.pop_due(10.0)) == ["i3"]


def test_a_heap_below_the_minimum_is_never_compacted() -> None:
    heap, items = heap_of(*((float(k), f"i{k}") for k in range(_lazyheap._COMPACT_MIN - 1)))
    for item in items.values():
        item.wanted = False
        heap.discard()
    assert (len(heap), heap._stale) == (_lazyheap._COMPACT_MIN - 1,) * 2
    assert heap.pop() is None
    assert (len(heap), heap._stale) == (0, 0)


def test_integer_keys_order_a_priority_queue() -> None:
    queue: LazyHeap[int, str] = LazyHeap(lambda _: True)
    for priority, name in ((0, "low"), (5, "high"), (5, "high2"), (1, "mid")):
        queue.push(-priority, name)  # higher priority first
    assert [queue.pop() for _ in range(4)] == ["high", "high2", "mid", "low"]
