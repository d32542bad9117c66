"""Timers of the core: request deadlines and retry backoffs.

A min-heap with lazy deletion: cancelling is free (the owner's state makes
the item stale), firing is O(log n), and the heap is rebuilt from its live
items whenever stale ones are the majority, so its size stays proportional
to live requests (I8), not to traffic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Timers"]

T = TypeVar("T")

# Below this size a heap is never compacted: rebuilding it costs more than
# the few stale items it would drop.
_COMPACT_MIN = 64


class Timers(Generic[T]):
    """Items due at a time, popped in time order, then insertion order."""

    __slots__ = ("_heap", "_live", "_seq", "_stale")

    _heap: list[tuple[float, int, T]]  # (due, unique seq, item); seq breaks ties FIFO
    _live: Callable[[T, float], bool]  # is (item, due) still wanted? False: stale
    _seq: int  # next seq
    _stale: int  # items known stale (discard() calls) still in the heap; <= len(_heap)

    def __init__(self, live: Callable[[T, float], bool]) -> None:
        self._heap = []
        self._live = live
        self._seq = 0
        self._stale = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, item: T) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, item))

    def discard(self) -> None:
        """Note that one item went stale; compact when stale items dominate."""
        self._stale += 1
        heap = self._heap
        if len(heap) >= _COMPACT_MIN and 2 * self._stale > len(heap):
            live = self._live
            self._heap = [x for x in heap if live(x[2], x[0])]
            heapq.heapify(self._heap)
            self._stale = 0

    def pop_due(self, now: float) -> list[T]:
        """Every live item due at or before ``now``, in due order."""
        heap, live, out = self._heap, self._live, []
        while heap and heap[0][0] <= now:
            due, _, item = heapq.heappop(heap)
            if live(item, due):
                out.append(item)
            elif self._stale:
                self._stale -= 1
        return out

    def next_due(self) -> float | None:
        """When the earliest live item is due (stale items at the top are dropped)."""
        heap, live = self._heap, self._live
        while heap and not live(heap[0][2], heap[0][0]):
            heapq.heappop(heap)
            if self._stale:
                self._stale -= 1
        return heap[0][0] if heap else None
