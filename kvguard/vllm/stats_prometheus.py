"""kvguard's figures on vLLM's Prometheus ``/metrics``: ``vllm:kvguard_*``, per engine.

The API server records every step's ``KVGuardConnectorStats`` (``stats``)
here; docs/vllm.md's "Metrics" table describes each series.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from lifecycle import FailureReason
from scheduler.metrics import LATENCY_BUCKETS

from .stats import DONE, FAILED, OUTCOMES, SEP, KVGuardConnectorStats

__all__ = ["KVGuardPromMetrics"]


class KVGuardPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvguard_*`` metrics, one labelled series set per engine.

    This engine's role comes from its ``kv_role``; every (outcome, "") series
    and its bytes and time series exist from the start, at zero, so a first
    failure is a rate and not a new series.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kv_role = getattr(self._kv_transfer_config, "kv_role", None)
        role = "prefill" if kv_role == "kv_producer" else "decode"
        self._transfers = self._counter_cls(
            name="vllm:kvguard_transfers",
            documentation="kvguard transfers that ended, by role, outcome and failure reason "
            '(reason="" unless failed). Prefill: a held request\'s push ended done or '
            "failed, or its hold ended expired (no decode asked), aborted (the decode "
            "will not ask) or refused (a push that could not start). Decode: a load "
            "ended loaded or failed.",
            labelnames=[*labelnames, "role", "outcome", "reason"],
        )
        self._bytes = self._counter_cls(
            name="vllm:kvguard_transfer_bytes",
            documentation="KV bytes moved by kvguard transfers that ended done (prefill) "
            "or loaded (decode).",
            labelnames=[*labelnames, "role"],
        )
        self._seconds = self._histogram_cls(
            name="vllm:kvguard_transfer_seconds",
            documentation="kvguard transfer time by role and outcome. Prefill: a push's "
            "submit to kvguard's terminal state (done or failed). Decode: asking the "
            "prefill to the load's outcome (loaded or failed).",
            buckets=list(LATENCY_BUCKETS),
            labelnames=[*labelnames, "role", "outcome"],
        )
        self._gauges = {
            "held_blocks": "KV blocks kvguard keeps for transfers: prefill, finished "
            "requests' blocks waiting for or in a push; decode, blocks of loads in flight.",
            "quarantined_blocks": "KV blocks kept out of use because a peer may still write "
            "them: prefill, blocks of pushes that ended before their engine writes quiesced; "
            "decode, blocks of loads that failed without the prefill's word (fenced) until "
            "it lets go or is known gone.",
            "oldest_live_load_seconds": "Age of the oldest transfer in flight (prefill: a "
            "push kvguard has not ended; decode: a load with no outcome); 0 when none.",
        }
        self._gauge_metrics = {
            name: self._gauge_cls(
                name=f"vllm:kvguard_{name}",
                documentation=doc,
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            for name, doc in self._gauges.items()
        }
        # kvguard's own failure reasons are known; a decode also reports the
        # prefill's refusals and its own (timeout, peer_lost, ...) as they come.
        failed = [r.value for r in FailureReason] if role == "prefill" else []
        for values in per_engine_labelvalues.values():
            for outcome in OUTCOMES[role]:
                for reason in failed if outcome == FAILED else [""]:
                    self._transfers.labels(*values, role, outcome, reason)
            self._bytes.labels(*values, role)
            self._seconds.labels(*values, role, DONE[role])
            for gauge in self._gauge_metrics.values():
                gauge.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Checked whole first: a bad payload raises before any metric moved.
        data = KVGuardConnectorStats(data=transfer_stats_data).data
        engine = self.per_engine_labelvalues[engine_idx]
        for name, n in data["transfers"].items():
            self._transfers.labels(*engine, *name.split(SEP, 2)).inc(n)
        for role, nbytes in data["bytes"].items():
            self._bytes.labels(*engine, role).inc(nbytes)
        for name, samples in data["seconds"].items():
            series = self._seconds.labels(*engine, *name.split(SEP, 1))
            for s in samples:
                series.observe(s)
        for gauge, value in data["gauges"].items():
            self._gauge_metrics[gauge].labels(*engine).set(value)
