"""The destination block allocator of ``kvguard run``: a serving engine's free list.

A decode engine hands out KV blocks from a free list that returns freed blocks
at its tail (vLLM's ``FreeKVCacheBlockQueue``, SGLang's token-to-KV pool):
with requests of similar size freed roughly in order, a new request mostly
gets runs of consecutive blocks, which a plan coalesces into few engine
entries. ``fragmentation`` makes it worse on purpose: each freed block goes
back at a random position of the list with that probability, so at 1.0 a
long run degrades towards one engine entry per block — the worst case the
engine's per-entry cost can meet.
"""

from __future__ import annotations

import random
import threading
from collections import deque

__all__ = ["BlockAllocator", "runs"]


class BlockAllocator:
    """Free destination blocks, FIFO. Blocks come back only through ``free``."""

    def __init__(self, num_blocks: int, *, fragmentation: float = 0.0, seed: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks!r}")
        if not 0.0 <= fragmentation <= 1.0:
            raise ValueError(f"fragmentation must be in [0, 1], got {fragmentation!r}")
        self._free: deque[int] = deque(range(num_blocks))  # head: next to hand out
        self._fragmentation = fragmentation
        self._rng = random.Random(seed)  # only ever used under _cv
        self._cv = threading.Condition()

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int, timeout: float) -> list[int] | None:
        """``n`` blocks from the head, or None if they are not free within ``timeout``."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._free) >= n, timeout):
                return None
            return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        with self._cv:
            for b in blocks:
                if self._fragmentation and self._rng.random() < self._fragmentation:
                    self._free.insert(self._rng.randrange(len(self._free) + 1), b)
                else:
                    self._free.append(b)
            self._cv.notify_all()


def runs(blocks: list[int]) -> int:
    """How many maximal runs of consecutive ids ``blocks`` holds (>= 1 if any)."""
    return sum(1 for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1] + 1)
