"""Local memory registered with one engine: whole caches, all or nothing, and
the index every plan's sources are checked against.

Over TCP the engine reads unregistered local memory without complaint, so a
source range outside the registered caches is refused before anything is
sent (``check_sources``). A registered cache is kept alive while registered.
Nothing here locks: the backend calls it under its own lock, and decides
when memory may be unregistered at all (never while the engine may touch it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog

from ._engine import code_name
from .backend import TransferOp, TransferPlan, check_ranges
from .cache import KVCache
from .errors import InvalidPlan, RegistrationError
from .regions import Region, RegionIndex

__all__ = ["RegisteredMemory", "check_sources", "unregister_all"]

_log = structlog.get_logger("kvguard.transfer")


class RegisteredMemory:
    """The caches registered with one engine, and the index of their regions."""

    __slots__ = ("_caches", "sources")

    _caches: dict[int, KVCache]  # id -> registered cache, kept alive while registered
    sources: RegionIndex  # every registered region; replaced, never mutated

    def __init__(self) -> None:
        self._caches = {}
        self.sources = RegionIndex(())

    def __contains__(self, cache: object) -> bool:
        return id(cache) in self._caches

    def add(self, engine: Any, cache: KVCache, where: str) -> None:
        """Register every buffer of ``cache`` at location ``where``; all or nothing.

        Raises RegistrationError when the engine refuses a buffer (naming its
        address and code), having undone this call's registrations.
        """
        done: list[int] = []
        for index, region in enumerate(cache.regions()):
            rc = engine.register_memory(region.base, region.length, where)
            if rc != 0:
                for base in done:  # all or nothing: undo this call's registrations
                    if (undo := engine.unregister_memory(base)) != 0:
                        _log.warning("unregister_failed", base=hex(base), rc=code_name(undo))
                raise RegistrationError(
                    f"register_memory of buffer {index} at {region.base:#x} "
                    f"(+{region.length}, location {where!r}) returned {code_name(rc)}",
                    code=rc,
                )
            done.append(region.base)
        self._caches[id(cache)] = cache
        self._reindex()

    def remove(
        self, engine: Any, cache: KVCache, live: Iterable[TransferOp]
    ) -> list[tuple[int, int]]:
        """Forget ``cache`` and unregister its buffers: (base, code) of each refused.

        Raises RegistrationError, changing nothing, while an op of ``live``
        (not yet quiesced) reads from it.
        """
        regions = cache.regions()
        busy = sum(1 for op in live if _reads_from(op.plan, regions))
        if busy:
            raise RegistrationError(
                f"{busy} op(s) reading from {cache!r} are not quiesced yet; "
                "unregister after they are"
            )
        del self._caches[id(cache)]
        self._reindex()
        return [(r.base, rc) for r in regions if (rc := engine.unregister_memory(r.base))]

    def take_all(self) -> list[KVCache]:
        """Forget every cache (the backend closes) and return them, still registered."""
        caches = list(self._caches.values())
        self._caches.clear()
        self._reindex()
        return caches

    def _reindex(self) -> None:
        self.sources = RegionIndex(r for c in self._caches.values() for r in c.regions())


def unregister_all(engine: Any, caches: list[KVCache]) -> None:
    """Unregister every buffer of ``caches``; a refusal is logged, not raised."""
    for cache in caches:
        for region in cache.regions():
            if (rc := engine.unregister_memory(region.base)) != 0:
                _log.warning("unregister_failed", base=hex(region.base), rc=code_name(rc))


def check_sources(plan: TransferPlan, sources: RegionIndex, session: str) -> None:
    outside = f"is not in memory registered with {session}"
    check_ranges(plan, sources, sources=True, error=InvalidPlan, outside=outside)


def _reads_from(plan: TransferPlan, regions: tuple[Region, ...]) -> bool:
    index = RegionIndex(regions)
    return any(index.contains(addr, 1) for b in plan.batches for addr in b.src)
