"""LocalBackend: an in-process backend that copies between registered caches.

It follows the engine contract exactly -- ``submit`` returns at once, the op
gets one result and then quiesces, every failure is a typed TransferError --
so the scheduler and the tests can run without Mooncake, and a single process
can embed prefill and decode side by side.

Addresses are resolved to ``(tensor, offset)`` through the regions of every
registered cache, so the copy is a torch ``copy_`` between views: it works on
any device and never touches memory that was not registered.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from .backend import (
    Batch,
    PeerInfo,
    TransferBackend,
    TransferOp,
    TransferPlan,
    check_destinations,
)
from .cache import KVCache
from .errors import (
    BackendClosed,
    EngineError,
    PeerUnreachable,
    RemoteRangeRejected,
    TransferCancelled,
    TransferError,
)
from .regions import RegionIndex

__all__ = ["LocalBackend"]


class _AddressMap:
    """Immutable index from addresses to (storage tensor, offset): a ``RegionIndex``
    over the caches' registered regions, with the tensor of each."""

    __slots__ = ("_bases", "_index", "_tensors")

    _index: RegionIndex  # over every buffer, in the order of _bases and _tensors
    _bases: list[int]
    _tensors: list[torch.Tensor]  # uint8, starting at the base of the same position

    def __init__(self, caches: list[KVCache]) -> None:
        regions = [r for c in caches for r in c.regions()]
        self._index = RegionIndex(regions)
        self._bases = [r.base for r in regions]
        self._tensors = [t for c in caches for t in c.storage]

    def resolve(self, addr: int, length: int) -> tuple[torch.Tensor, int] | None:
        """The tensor and offset holding [addr, addr + length), if one buffer does."""
        k = self._index.find(addr, length)
        if k is None:
            return None
        return self._tensors[k], addr - self._bases[k]


_EMPTY = _AddressMap([])


class LocalBackend(TransferBackend):
    """Copies plans between KVCaches registered with it, on a small thread pool.

    Sources must be registered (``register_source``) as well as peers, so
    that a plan can only read and write memory this backend was shown. A
    peer's destination ranges must lie in its cache's buffers and, once
    ``add_peer`` gave its advertisement, in the regions it advertised.
    """

    name = "local"

    _lock: threading.Lock  # guards every field below; copies run outside it
    _peers: dict[str, KVCache]
    _sources: dict[int, KVCache]  # id(cache) -> cache
    _peer_maps: dict[str, _AddressMap]  # destination check: only the peer's own buffers
    _all: _AddressMap  # source check: every registered buffer; replaced, never mutated
    _closed: bool  # once True: no new copies start, in-flight ones stop between batches
    _pool: ThreadPoolExecutor
    _in_worker: threading.local  # .active is True on a pool thread inside _run

    def __init__(self, peers: Mapping[str, KVCache] | None = None, *, workers: int = 4) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self._lock = threading.Lock()
        self._peers = {}
        self._sources = {}
        self._peer_maps = {}
        self._all = _EMPTY
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvguard-local")
        self._in_worker = threading.local()
        for session_id, cache in (peers or {}).items():
            self.register_peer(session_id, cache)

    # -- registration -------------------------------------------------------------

    def register_peer(self, session_id: str, cache: KVCache) -> PeerInfo:
        """Make ``cache`` the destination known as ``session_id``; returns what it advertises."""
        with self._lock:
            self._peers[session_id] = cache
            self._peer_maps[session_id] = _AddressMap([cache])
            self._reindex()
        return cache.peer_info(session_id)

    def unregister_peer(self, session_id: str) -> None:
        with self._lock:
            self._peers.pop(session_id, None)
            self._peer_maps.pop(session_id, None)
            self.remove_peer(session_id)
            self._reindex()

    def register_source(self, cache: KVCache) -> None:
        """Allow plans to read from ``cache``."""
        with self._lock:
            self._sources[id(cache)] = cache
            self._reindex()

    def unregister_source(self, cache: KVCache) -> None:
        with self._lock:
            self._sources.pop(id(cache), None)
            self._reindex()

    def _reindex(self) -> None:
        caches = {id(c): c for c in (*self._peers.values(), *self._sources.values())}
        self._all = _AddressMap(list(caches.values()))

    # -- TransferBackend ----------------------------------------------------------

    def submit(self, plan: TransferPlan) -> TransferOp:
        op = TransferOp(plan)
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("closed")
                self._pool.submit(self._run, op)
        except RuntimeError:  # closed, or the pool shut down under us
            op._resolve(self._closed_error(plan.peer))
            op._quiesce()
        return op

    def probe(self, peer: str) -> None:
        with self._lock:
            if self._closed:
                raise PeerUnreachable(f"{self} is closed", peer=peer)
            if peer not in self._peers:
                raise PeerUnreachable(f"unknown peer {peer!r}", peer=peer)

    def close(self) -> None:
        """Stop accepting work; in-flight ops fail at their next batch. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Waiting from a pool thread (a callback calling close) would deadlock.
        self._pool.shutdown(wait=not getattr(self._in_worker, "active", False))

    def __repr__(self) -> str:
        return f"LocalBackend(peers={sorted(self._peers)})"

    # -- worker -------------------------------------------------------------------

    def _closed_error(self, peer: str) -> BackendClosed:
        return BackendClosed(f"LocalBackend is closed: transfer to {peer} stopped", peer=peer)

    def _run(self, op: TransferOp) -> None:
        # The op gets exactly one result and then quiesces, whatever happens;
        # the placeholder survives only a BaseException escaping the copy.
        self._in_worker.active = True
        error: TransferError | None = TransferError("local copy interrupted", peer=op.plan.peer)
        try:
            self._copy(op)
            error = None
        except TransferError as exc:
            error = exc
        except Exception as exc:
            error = EngineError(f"local copy failed: {exc!r}", peer=op.plan.peer)
            error.__cause__ = exc
        finally:
            op._resolve(error)
            op._quiesce()
            self._in_worker.active = False

    def _copy(self, op: TransferOp) -> None:
        peer = op.plan.peer
        with self._lock:
            dst_map = self._peer_maps.get(peer)
            src_map = self._all
            advertised = self.advertised_regions(peer)
        if dst_map is None:
            raise PeerUnreachable(f"unknown peer {peer!r}", peer=peer)
        if advertised is not None:  # whole plan, before any byte is copied
            check_destinations(op.plan, advertised)
        for index, batch in enumerate(op.plan.batches):
            if op.cancelled:
                raise TransferCancelled(
                    f"transfer to {peer} cancelled before batch {index}", peer=peer
                )
            if self._closed:  # a racy read is fine: the next batch sees it
                raise self._closed_error(peer)
            pairs = self._resolve_batch(batch, index, src_map, dst_map, peer)
            for dst, src in pairs:
                dst.copy_(src)

    @staticmethod
    def _resolve_batch(
        batch: Batch, index: int, src_map: _AddressMap, dst_map: _AddressMap, peer: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination view, source view) per entry; a batch is checked whole before
        any of it is written."""
        pairs = []
        for src, dst, n in zip(batch.src, batch.dst, batch.lengths, strict=True):
            s = src_map.resolve(src, n)
            if s is None:
                raise RemoteRangeRejected(
                    f"batch {index}: source [{src:#x}, +{n}) is in no registered region",
                    peer=peer,
                )
            d = dst_map.resolve(dst, n)
            if d is None:
                raise RemoteRangeRejected(
                    f"batch {index}: destination [{dst:#x}, +{n}) is outside peer {peer}",
                    peer=peer,
                )
            pairs.append((d[0][d[1] : d[1] + n], s[0][s[1] : s[1] + n]))
        return pairs
