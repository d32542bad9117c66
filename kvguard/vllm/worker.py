"""The connector's worker side: one per tensor parallel rank, it owns the engine and the threads.

``register_kv_caches`` registers the rank's KV tensors with its own Mooncake
engine (a ``KVCache``) and starts the prefill's ``PrefillSender`` or the
decode's ``DecodeReceiver``. Each step ``bind`` hands them the scheduler
side's ``KVGuardMetadata`` (before the forward), and ``get_transfer_results``
tells vLLM what ended: the prefill's released holds (``finished_sending``),
the decode's loads (``finished_recving``, ``failed_recving``) and the blocks
of failed loads a prefill may still write (load errors, until it cannot).

A decode load goes forward through one module each, never back: its
``LoadMeta`` to ``ranks.Pairing`` (its legs, each with its prefill rank's
endpoint), the legs to ``decode_legs.DecodeLegs`` (the request's outcome
across them), then each leg to ``DecodeReceiver.expect``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from kvguard.curve import warn_unauthenticated
from scheduler import RetryPolicy
from transfer import FaultInjectingBackend, FaultKind, FaultPlan, KVCache
from transfer.affinity import parse_cpus, threads_on
from transfer.backend import TransferBackend
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import peer_message_of

from .decode_legs import DecodeLegs, Verdict
from .decode_loads import DecodeReceiver
from .idle import doorbell_route
from .integrity import Verifier
from .kv_views import check_groups, describe
from .metadata import KVGuardMetadata, LoadMeta
from .prefill_pushes import PrefillSender
from .ranks import BadEndpoint, Pairing, RankHeads
from .settings import Settings
from .states import LoadEnd
from .stats import KVGuardConnectorStats
from .stats_sampling import WorkerStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KVGuardWorker"]

logger = init_logger(__name__)
_log = structlog.get_logger("kvguard.vllm")

_PORT_RANGE: Final = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux;
    an empty range elsewhere)."""
    try:
        with open(_PORT_RANGE) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 0, -1
    return low, high


def _attention(spec: object) -> bool:
    """Whether every layer of a KV cache group's spec is attention (has per-layer views)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(isinstance(s, AttentionSpec) for s in spec.kv_cache_specs.values())
    return isinstance(spec, AttentionSpec)


class KVGuardWorker:
    """The worker side of ``KVGuardConnector``, for one rank of one engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: Settings,
        *,
        producer: bool,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self.settings = settings
        self.is_producer = producer
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        # Set by register_kv_caches.
        self.cache: KVCache | None = None
        self.backend: MooncakeBackend | None = None
        self.sender: PrefillSender | None = None
        self.receiver: DecodeReceiver | None = None
        self.rank = RankHeads(0, 1, 1)  # this worker's rank and KV heads
        self.head_major = False  # heads outermost in a block: a rank's heads are one slice
        self.compat = ""  # this engine's KV layout, as peers compare it
        self._pairing = Pairing(self.rank, self.head_major)  # decode: legs of each load
        self._legs = DecodeLegs()  # decode: loads in flight or fenced, by leg
        self._verdicts: list[Verdict] = []  # decode: loads failed before asking, to report
        # decode: blocks of failed loads still written, for vLLM's invalid-block
        # path (see get_transfer_results)
        self._invalid: set[int] = set()
        # decode, MLA: loads whose prefill holds them on ranks no decode rank
        # loads from -> (those ranks' endpoints, the prefill's request, group)
        self._spares: dict[str, tuple[list[str], str, int]] = {}
        self._stats: WorkerStats | None = None

    # -- start -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._kv_cache_config is not None:
            check_groups(
                [
                    (
                        type(g.kv_cache_spec).__name__,
                        len(g.layer_names),
                        _attention(g.kv_cache_spec),
                    )
                    for g in self._kv_cache_config.kv_cache_groups
                ]
            )
        names = sorted(kv_caches)
        views = [kv_caches[n] for n in names]
        cfg = self._vllm_config
        # A kernel block size below --block-size splits each block in dim 0:
        # kv_views regroups the scheduler's blocks, as vLLM's own connectors do.
        total = self._kv_cache_config.num_blocks if self._kv_cache_config else views[0].shape[0]
        # The layout vLLM's model runner allocated the views in.
        layout_name = cfg.cache_config.get_resolved_kv_cache_layout().name
        geo = describe(views, layout_name, int(total))
        self.rank = RankHeads(
            get_tensor_model_parallel_rank(),
            self.tp_size,
            cfg.model_config.get_total_num_kv_heads(),
        )
        # A rank's heads one run of every unit of a block: a share is one slice.
        self.head_major = geo.head_run and geo.heads == self.rank.count
        self._pairing = Pairing(self.rank, self.head_major, geo.label, geo.layout.block_bytes)
        # What a peer's blocks must match, byte for byte: not the block count,
        # nor (heads one run) how many heads each rank holds.
        self.compat = (
            f"{geo.fingerprint(len(names), self.head_major)}"
            f"/block_size={cfg.cache_config.block_size}/kv_heads={self.rank.heads}"
        )
        layout = geo.layout
        num_blocks, block_bytes = layout.num_blocks, layout.block_bytes
        self.cache = geo.cache()
        # Every thread started below inherits the widened mask; this one keeps its own.
        with threads_on(parse_cpus(self.settings.cpus)):
            self._start()
        assert self.backend is not None
        logger.info(
            "KVGuardConnector %s rank %d/%d (KV heads %d-%d): %d units (%s) x %d blocks x %d "
            "bytes (%s), Mooncake session %s%s",
            "producer" if self.is_producer else "consumer",
            self.rank.rank,
            self.tp_size,
            self.rank.first,
            self.rank.first + self.rank.count - 1,
            layout.num_buffers,
            geo.unit,
            num_blocks,
            block_bytes,
            self.compat,
            self.backend.session_id,
            f", control {self.sender.endpoint}" if self.sender else "",
        )

    def make_backend(self) -> MooncakeBackend:
        """This rank's Mooncake engine (a hook for tests)."""
        return self.settings.make_backend()

    def make_verifier(self) -> Verifier | None:
        """Decode: what checks each load's bytes (``integrity``), None where
        ``kvguard_verify`` is off (a hook for tests)."""
        assert self.cache is not None
        return Verifier(self.cache) if self.settings.verify else None

    def _start(self) -> None:
        """The backend and the sender or receiver, with every thread they start."""
        assert self.cache is not None
        self.backend = self.make_backend()
        self.backend.register(self.cache)
        s = self.settings
        bell, _ = doorbell_route(self._vllm_config, self.is_producer, s.idle_wait_ms)
        if self.is_producer:
            mover: TransferBackend = self.backend
            if s.fault_rate > 0 and s.fault_rank in (-1, self.rank.rank):
                kinds = [FaultKind(k) for k in s.fault_kinds]
                mover = FaultInjectingBackend(
                    self.backend, FaultPlan(s.fault_seed, s.fault_rate, kinds)
                )
            keys = s.server_keys()
            if keys is None:
                warn_unauthenticated("vllm prefill control", s.host)
            port = s.control_port + self.rank.rank  # rank 0's is the one peers are told
            low, high = _ephemeral_ports()
            if low <= port <= high:
                # A decode dialling it while nothing listens (a restart) may
                # connect to itself; the kernel also hands it out as a source.
                _log.warning(
                    "control_port_ephemeral",
                    port=port,
                    ephemeral=f"{low}-{high}",
                    rank=self.rank.rank,
                )
            self.sender = PrefillSender(
                mover,
                self.cache,
                f"tcp://{'*' if s.host != '127.0.0.1' else s.host}:{port}",
                workers=s.inflight(),
                retry=RetryPolicy(max_attempts=s.max_attempts),
                compat=self.compat,
                renew_s=s.hold_s,
                max_hold_s=s.max_hold_s,
                heads=self.rank,
                head_major=self.head_major,
                curve=keys,
                sum_early=s.verify,
                bell=bell,
            )
        else:
            info = self.cache.peer_info(self.backend.session_id)
            self.receiver = DecodeReceiver(
                peer_message_of(info),
                heartbeat_s=s.heartbeat_s,
                heartbeat_timeout_s=s.heartbeat_timeout_s,
                compat=self.compat,
                heads=(self.rank.first, self.rank.count),
                verify=self.make_verifier(),
                curve=s.client_keys(),
                bell=bell,
            )

    # -- each step -------------------------------------------------------------

    def bind(self, meta: KVGuardMetadata) -> None:
        """Start this step's holds and loads (see ``KVGuardConnector.bind_connector_metadata``)."""
        if self.sender is not None:
            for hold in meta.holds:
                self.sender.hold(hold.request_id, hold.block_ids, hold.deadline)
        receiver = self.receiver
        if receiver is None:
            return
        for load in meta.loads:
            self._expect(receiver, load)
        for forget in meta.forgets:
            for url, fan_in in self._pairing.ranks_of(forget.source):
                receiver.forget(url, forget.source.request_id, forget.group * fan_in)
        for rid in meta.cancels:
            for leg_id in self._legs.legs(rid):
                receiver.cancel(leg_id)
        for source in meta.renews:
            for url in self._pairing.urls(source):
                receiver.renew(url, source.request_id)

    def _expect(self, receiver: DecodeReceiver, load: LoadMeta) -> None:
        """One load, forward: its legs (``ranks``), their request (``decode_legs``),
        each leg asked (``decode_loads``); the prefill's spare ranks are
        told to let go once it ends (``_let_go``)."""
        try:
            asks = self._pairing.asks(load.request_id, load.source)
        except BadEndpoint as exc:
            self._refuse(load, LoadEnd.BAD_ENDPOINT, str(exc))
            return
        except ValueError as exc:  # tensor parallel sizes that cannot pair
            self._refuse(load, LoadEnd.INCOMPATIBLE, str(exc))
            return
        if not self._legs.start(load.request_id, load.block_ids, [a.leg_id for a in asks]):
            return
        remote = load.source.request_id
        for a in asks:
            group = load.group * a.fan_in
            receiver.expect(a.leg_id, a.url, remote, load.block_ids, load.deadline, group, a.part)
        spare = self._pairing.spare_urls(load.source)  # MLA: ranks no one loads from
        if spare:
            self._spares[load.request_id] = (spare, remote, load.group)

    def _refuse(self, load: LoadMeta, end: LoadEnd, why: str) -> None:
        """A load that cannot start: failed at once, nothing was asked."""
        verdict = self._legs.refused(load.request_id, load.block_ids, end, why)
        if verdict is not None:
            logger.error("kvguard: KV load of %s cannot start: %s", load.request_id, why)
            self._verdicts.append(verdict)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self.sender is not None:
            results.finished_sending = self.sender.take_released()
        if self.receiver is not None:
            # A load reported in finished_recving gives its blocks back to vLLM
            # (at once for a finished request). A failed load whose blocks may
            # still be written (a fenced leg, or legs still running) must not:
            # its blocks go out as load errors instead. vLLM fails the request
            # now (policy fail) or holds it for recompute, and keeps the blocks
            # until finished_recving, which comes once every leg is over and
            # the receiver says nothing writes them.
            verdicts: list[Verdict | None] = list(self._verdicts)
            self._verdicts.clear()
            for out in self.receiver.take_finished():
                if not out.ok:
                    logger.warning(
                        "kvguard: KV load of %s failed (%s: %s) after %.3fs%s",
                        out.request_id,
                        out.reason,
                        out.detail,
                        out.latency_s,
                        "; its blocks stay out of use until the prefill lets go"
                        if out.fenced
                        else "",
                    )
                verdicts.append(self._legs.reported(out))
            verdicts += map(self._legs.released, self.receiver.take_released())
            for v in verdicts:
                if v is None:
                    continue
                if not v.final:
                    self._invalid.update(v.blocks)
                    continue
                results.finished_recving.add(v.request_id)
                self._let_go(self.receiver, v)
                if v.outcome.ok:
                    self.on_loaded(v.request_id, v.blocks)
                else:
                    results.failed_recving.add(v.request_id)
        return results

    def _let_go(self, receiver: DecodeReceiver, v: Verdict) -> None:
        """``v``'s load is over: the prefill's spare ranks may let go of it,
        as its rank loaded from did, unless that rank keeps it for another
        decode (a refusal), which may load from them (another TP size)."""
        spare = self._spares.pop(v.request_id, None)
        if spare is None or v.outcome.end.keeps_hold:
            return
        urls, remote, group = spare
        for url in urls:
            receiver.forget(url, remote, group)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def on_loaded(self, request_id: str, blocks: list[int]) -> None:
        """A load succeeded: ``blocks`` hold the prefill's KV. A hook for tests."""
        return

    def get_kv_connector_stats(self, meta: object) -> KVGuardConnectorStats | None:
        """The rank's kvguard figures since the last step (``stats_sampling``);
        None when nothing changed. ``meta``: the step's metadata, still bound."""
        if self.cache is None:
            return None
        if self._stats is None:
            self._stats = WorkerStats(self.cache.layout)
        loads = meta.loads if isinstance(meta, KVGuardMetadata) else []
        started = [(load.request_id, len(load.block_ids)) for load in loads]
        outcomes = self._legs if self.receiver is not None else None
        return self._stats.sample(
            self.sender, outcomes, started, self._legs.in_use(), time.monotonic()
        )

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.backend is not None:
            self.backend.close()
