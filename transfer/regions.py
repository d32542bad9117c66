"""Registered memory ranges, and the one answer to "does this range lie in one?".

A range ``[addr, addr + length)`` is inside a set of regions when a single
region holds all of it: one engine entry must stay inside one registered
buffer, so a range across two adjacent regions is outside, and so is an
empty range. Nested and overlapping regions are allowed, and answered the
same way everywhere: plans, backends and peer messages all ask
``RegionIndex``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Region", "RegionIndex"]


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory range: [base, base + length)."""

    base: int
    length: int

    @property
    def end(self) -> int:
        return self.base + self.length

    def contains(self, addr: int, length: int) -> bool:
        """This region alone holds the non-empty range (``RegionIndex``: a set of them)."""
        return length > 0 and self.base <= addr and addr + length <= self.end


class RegionIndex:
    """Immutable set of regions: which one holds [addr, addr + length), if any?

    O(log regions) per range (one bisect), so checking a plan is linear in its
    entries. Any region holding the range starts at or before ``addr``; among
    those, the one reaching furthest holds it if any does. So the index keeps,
    for each prefix of the regions sorted by base, the furthest end in it.
    """

    __slots__ = ("_holder", "_reach", "_starts")

    _starts: list[int]  # bases of the non-empty regions, sorted
    _reach: list[int]  # _reach[i]: the furthest end of the regions at _starts[: i + 1]
    _holder: list[int]  # _holder[i]: position, in the order given, of a region ending at _reach[i]

    def __init__(self, regions: Iterable[Region]) -> None:
        # An empty (or negative) region holds no range: left out.
        spans = sorted(
            [(r.base, r.base + r.length, i) for i, r in enumerate(regions) if r.length > 0]
        )
        self._starts = [base for base, _, _ in spans]
        self._reach = reach = []
        self._holder = holder = []
        far, k = 0, -1
        for _, end, i in spans:
            if k < 0 or end > far:
                far, k = end, i
            reach.append(far)
            holder.append(k)

    def __len__(self) -> int:
        return len(self._starts)

    def find(self, addr: int, length: int) -> int | None:
        """The position, in the order given, of a region holding the range; None if none."""
        i = bisect_right(self._starts, addr) - 1
        if i < 0 or length <= 0 or addr + length > self._reach[i]:
            return None
        return self._holder[i]

    def contains(self, addr: int, length: int) -> bool:
        return self.find(addr, length) is not None

    def first_outside(self, addrs: Iterable[int], lengths: Iterable[int]) -> tuple[int, int] | None:
        """The first (addr, length) pair no single region holds, if any."""
        # ``find`` inlined: this loop runs once per entry of every plan sent.
        starts, reach = self._starts, self._reach
        for addr, length in zip(addrs, lengths, strict=True):
            i = bisect_right(starts, addr) - 1
            if i < 0 or length <= 0 or addr + length > reach[i]:
                return addr, length
        return None
