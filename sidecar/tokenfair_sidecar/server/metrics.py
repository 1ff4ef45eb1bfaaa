"""Prometheus metrics of one sidecar, in a per-app ``CollectorRegistry`` (never the global one).

Counters (labels ``tenant``, ``lane`` and, for refusals, ``reason``):

* ``tokenfair_admitted_requests_total`` — dispatched to the backend;
* ``tokenfair_refused_requests_total`` — refused: the core's reasons (``shed_kv_watermark``,
  ``shed_queue_wait_slo``, ``shed_tenant_token_quota``, ``queue_full``, ``shed_queue_timeout``)
  and ``draining``;
* ``tokenfair_cancelled_requests_total`` — the client went away (queued or mid-response);
* ``tokenfair_backend_errors_total`` (``code``: ``upstream_error``, ``upstream_timeout``);
* ``tokenfair_estimated_service_tokens_total`` (charged at dispatch) and
  ``tokenfair_actual_service_tokens_total`` (settled at completion);
* ``tokenfair_invalid_requests_total`` (``status``: 400, 401, 413) — before any tenant is charged;
* ``tokenfair_config_reloads_total`` (``result``: ``applied``, ``invalid``).

Histograms, in model seconds (equal to real seconds at ``time_scale`` 1):
``tokenfair_queue_wait_seconds`` (labels ``tenant``, ``lane``: the operator reports each
tenant's p99 from it; tenants are bounded by the config, so the series are too) and
``tokenfair_ttft_seconds`` (label ``lane``).

Read from the scheduler at scrape time (so always current, and free per request):
``tokenfair_queued_requests{lane}``, ``tokenfair_running_requests``,
``tokenfair_kv_resident_blocks``, ``tokenfair_kv_occupancy_ratio``, ``tokenfair_draining``, and
``tokenfair_config_info{version, sha256}`` (value 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenfair_sidecar.core import Lane, Scheduler

LANE_NAMES: Final = {Lane.INTERACTIVE: "interactive", Lane.BATCH: "batch"}
LATENCY_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _SchedulerCollector(Collector):
    def __init__(self, state: Callable[[], tuple[Scheduler, bool, str, str]]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        scheduler, draining, version, sha256 = self._state()
        queued = GaugeMetricFamily(
            "tokenfair_queued_requests", "Requests waiting in a lane.", labels=["lane"]
        )
        for lane, name in LANE_NAMES.items():
            queued.add_metric([name], scheduler.queued_count[lane])
        yield queued
        yield GaugeMetricFamily(
            "tokenfair_running_requests", "Requests running on the backend.", scheduler.running
        )
        yield GaugeMetricFamily(
            "tokenfair_kv_resident_blocks", "KV blocks reserved.", scheduler.resident_blocks
        )
        yield GaugeMetricFamily(
            "tokenfair_kv_occupancy_ratio",
            "Reserved KV blocks over total KV blocks.",
            scheduler.resident_blocks / scheduler.policy.total_kv_blocks,
        )
        yield GaugeMetricFamily("tokenfair_draining", "1 while draining.", 1.0 if draining else 0.0)
        info = GaugeMetricFamily(
            "tokenfair_config_info", "The config in force.", labels=["version", "sha256"]
        )
        info.add_metric([version, sha256], 1.0)
        yield info


class Metrics:
    """Every metric of one sidecar; ``registry`` is what ``/metrics`` renders."""

    def __init__(self, state: Callable[[], tuple[Scheduler, bool, str, str]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        tenant_lane = ["tenant", "lane"]
        self.admitted = Counter(
            "tokenfair_admitted_requests", "Requests dispatched.", tenant_lane, registry=registry
        )
        self.refused = Counter(
            "tokenfair_refused_requests",
            "Requests refused, by reason.",
            [*tenant_lane, "reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            "tokenfair_cancelled_requests",
            "Requests whose client went away.",
            tenant_lane,
            registry=registry,
        )
        self.backend_errors = Counter(
            "tokenfair_backend_errors",
            "Requests the backend failed.",
            [*tenant_lane, "code"],
            registry=registry,
        )
        self.estimated_tokens = Counter(
            "tokenfair_estimated_service_tokens",
            "Service tokens charged at dispatch (estimates).",
            tenant_lane,
            registry=registry,
        )
        self.actual_tokens = Counter(
            "tokenfair_actual_service_tokens",
            "Service tokens settled at completion (actual usage).",
            tenant_lane,
            registry=registry,
        )
        self.invalid = Counter(
            "tokenfair_invalid_requests",
            "Requests rejected before admission.",
            ["status"],
            registry=registry,
        )
        self.reloads = Counter(
            "tokenfair_config_reloads", "Config reload attempts.", ["result"], registry=registry
        )
        self.queue_wait = Histogram(
            "tokenfair_queue_wait_seconds",
            "Time from arrival to dispatch.",
            tenant_lane,
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.ttft = Histogram(
            "tokenfair_ttft_seconds",
            "Time from arrival to the first response byte.",
            ["lane"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        registry.register(_SchedulerCollector(state))
