"""A min-heap with lazy deletion: the core's timers and its admission queue.

Deadlines, retry backoffs (keyed by due time) and the queue of requests
waiting for a slot (keyed by priority) all drop items long before they
come up: a request that ends takes its deadline and its queue place with
it. Removing from the middle of a heap is O(n), so nothing is removed:
the owner's state makes an item stale (its ``live`` predicate turns
False), the owner says so with ``discard()``, and stale items are skipped
when they reach the top. The heap is rebuilt from its live items whenever
stale ones are the majority, so its size stays proportional to live
requests, not to traffic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["LazyHeap"]

K = TypeVar("K", int, float)
T = TypeVar("T")

# Below this size a heap is never compacted: rebuilding it costs more than
# the few stale items it would drop.
_COMPACT_MIN = 64


class LazyHeap(Generic[K, T]):
    """Items by key, smallest first, then in insertion order; stale ones skipped."""

    __slots__ = ("_heap", "_live", "_seq", "_stale")

    _heap: list[tuple[K, int, T]]  # (key, unique seq, item); seq breaks ties FIFO
    _live: Callable[[T], bool]  # is the item still wanted? False: stale
    _seq: int  # the last seq handed out
    _stale: int  # items discard() announced that are still in the heap; <= len(_heap)

    def __init__(self, live: Callable[[T], bool]) -> None:
        self._heap = []
        self._live = live
        self._seq = 0
        self._stale = 0

    def __len__(self) -> int:
        """Items held, stale ones included (what the memory bound is about)."""
        return len(self._heap)

    def push(self, key: K, item: T) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (key, self._seq, item))

    def discard(self) -> None:
        """One item just went stale; compact when stale items are the majority."""
        self._stale += 1
        heap = self._heap
        if len(heap) >= _COMPACT_MIN and 2 * self._stale > len(heap):
            live = self._live
            self._heap = [x for x in heap if live(x[2])]
            heapq.heapify(self._heap)
            self._stale = 0

    def _dropped(self) -> None:
        # A stale item left the heap. The count only steers compaction, so
        # it never goes below zero, whatever the owner announced.
        if self._stale:
            self._stale -= 1

    def pop(self) -> T | None:
        """The live item with the smallest key, taken out; None if there is none."""
        heap, live = self._heap, self._live
        while heap:
            item = heapq.heappop(heap)[2]
            if live(item):
                return item
            self._dropped()
        return None

    def pop_due(self, limit: K) -> list[T]:
        """Every live item keyed at or below ``limit``, taken out, smallest first."""
        heap, live, out = self._heap, self._live, []
        while heap and heap[0][0] <= limit:
            item = heapq.heappop(heap)[2]
            if live(item):
                out.append(item)
            else:
                self._dropped()
        return out

    def next_key(self) -> K | None:
        """The smallest key of a live item (stale items on top are dropped)."""
        heap, live = self._heap, self._live
        while heap and not live(heap[0][2]):
            heapq.heappop(heap)
            self._dropped()
        return heap[0][0] if heap else None
