"""Prometheus metrics of a Scheduler, on a registry the caller owns.

    registry = prometheus_client.CollectorRegistry()
    register_metrics(scheduler, registry)      # before the first submit
    server = serve_metrics(registry, port=9400)  # or expose `registry` your way

Counters and gauges are read from ``Scheduler.metrics()`` at scrape time,
so they are exact whenever the collector was registered. The latency
histogram is fed by ``Scheduler.add_observer`` and only sees requests that
end after registration. A stuck request is never invisible, counted in
no metric: it stays in ``kvguard_live_requests`` and ages
``kvguard_oldest_live_request_seconds`` until its deadline fails it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lifecycle import FailureReason, TransferState

from ._records import Finished, MetricsSnapshot
from ._scheduler import Scheduler

__all__ = [
    "LATENCY_BUCKETS",
    "MetricsServer",
    "SchedulerCollector",
    "register_metrics",
    "serve_metrics",
]

# Seconds. From a local memcpy (sub-ms) to a frozen peer's deadline (tens of s).
LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_OUTCOME: Final = {TransferState.DONE: "done", TransferState.FAILED: "failed"}
_LIVE_STATES: Final = (TransferState.PENDING, TransferState.TRANSFERRING)


def _families(m: MetricsSnapshot | None) -> Iterator[Metric]:
    """Every family the collector exports; with samples when given a snapshot.

    Every label combination is always present (zeros included), so a
    failure reason seen for the first time is a rate, not a new series.
    """
    transfers = CounterMetricFamily(
        "kvguard_transfers",
        "Requests that reached a terminal state, by outcome and failure reason "
        '(reason="" when done).',
        labels=("outcome", "reason"),
    )
    live = GaugeMetricFamily(
        "kvguard_live_requests", "Requests not yet terminal, by state.", labels=("state",)
    )
    oldest = GaugeMetricFamily(
        "kvguard_oldest_live_request_seconds",
        "Age of the oldest non-terminal request (0 when none).",
    )
    quarantined = GaugeMetricFamily(
        "kvguard_quarantined_requests",
        "Terminal requests whose blocks wait for a backend operation to quiesce.",
    )
    nbytes = CounterMetricFamily(
        "kvguard_transfer_bytes", "Bytes moved by requests that ended DONE."
    )
    peers = CounterMetricFamily("kvguard_peer_lost", "Times a decode peer went from alive to lost.")
    if m is not None:
        transfers.add_metric(["done", ""], m.done)
        for reason in FailureReason:
            transfers.add_metric(["failed", reason.name], m.failed_by_reason.get(reason.name, 0))
        for state in _LIVE_STATES:
            live.add_metric([state.name], m.live_by_state.get(state.name, 0))
        oldest.add_metric([], m.oldest_live_age_s)
        quarantined.add_metric([], m.quarantined)
        nbytes.add_metric([], m.bytes_done)
        peers.add_metric([], m.peers_lost)
    yield from (transfers, live, oldest, quarantined, nbytes, peers)


class SchedulerCollector(Collector):
    """Exports one scheduler; build it with register_metrics()."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        # Not on any registry: collect() yields it next to the snapshot families.
        self._latency = Histogram(
            "kvguard_transfer_seconds",
            "Submit to terminal, by outcome.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        for outcome in _OUTCOME.values():
            self._latency.labels(outcome)  # both series exist from the start
        scheduler.add_observer(self._observe)

    def _observe(self, fin: Finished) -> None:
        # Runs on the scheduler's callback thread, in order: cheap, no lock of ours.
        self._latency.labels(_OUTCOME[fin.state]).observe(fin.latency_s)

    def describe(self) -> Iterator[Metric]:
        # Lets the registry reject a second collector exporting the same names.
        yield from _families(None)
        yield from self._latency.describe()

    def collect(self) -> Iterator[Metric]:
        yield from _families(self._scheduler.metrics())
        yield from self._latency.collect()


def register_metrics(scheduler: Scheduler, registry: CollectorRegistry) -> SchedulerCollector:
    """Export ``scheduler`` on ``registry``; unregister with ``registry.unregister``."""
    collector = SchedulerCollector(scheduler)
    registry.register(collector)
    return collector


class MetricsServer:
    """``/metrics`` over HTTP in a daemon thread; close() stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread, addr: str) -> None:
        self._server = server
        self._thread = thread
        self.addr = addr
        self.port: int = server.server_port  # the real one when asked for port 0

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` (port 0: any free port).

    Loopback by default: metrics name peers and request counts, so exposing
    them beyond the host is the embedding application's decision.
    """
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread, addr)
