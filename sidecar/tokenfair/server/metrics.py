"""Prometheus metrics of one sidecar, in a per-app ``CollectorRegistry`` (never the global one).

Counters (labels ``tenant``, ``lane`` and, for refusals, ``reason``):

* ``tokenfair_admitted_requests_total`` — dispatched to the backend;
* ``tokenfair_refused_requests_total`` — refused, never dispatched: the core's reasons
  (``shed_kv_watermark``, ``shed_queue_wait_slo``, ``shed_tenant_token_quota``, ``queue_full``,
  ``shed_queue_timeout``), ``request_over_kv_capacity`` / ``request_over_tenant_burst`` (never
  admissible) and ``draining`` (an upstream's own 400/429/503 is not a refusal);
* ``tokenfair_cancelled_requests_total`` — the client went away (queued or mid-response);
* ``tokenfair_backend_errors_total`` (``code``: ``upstream_error``, ``upstream_timeout``,
  ``upstream_aborted``, ``upstream_bad_usage``, ``upstream_too_large``,
  ``upstream_unavailable``, ``internal_error`` for the sidecar's own failures, and
  ``drain_aborted`` for requests the drain cut);
* ``tokenfair_estimated_service_tokens_total`` (charged at dispatch) and
  ``tokenfair_actual_service_tokens_total`` (settled at completion);
* ``tokenfair_prompt_tokens_total`` and ``tokenfair_completion_tokens_total`` — the usage the
  backend reported for requests that ran (``usage.prompt_tokens`` / ``completion_tokens``: the
  tokens clients count); a count that was not reported, or not believed, adds nothing;
* ``tokenfair_invalid_requests_total`` (``status``: 400, 401, 408, 413, 415, 417) — before any
  tenant is charged;
* ``tokenfair_config_reloads_total`` (``result``: ``applied``, ``invalid``, ``error``);
* ``tokenfair_records_dropped_total`` — request records dropped while the records file refused
  writes and the pending buffer was full;
* ``tokenfair_refused_connections_total`` — proxy connections closed at once at
  ``max_client_connections``.

Histograms, in model seconds (equal to real seconds at ``time_scale`` 1), labels ``tenant`` and
``lane`` (tenants are bounded by the config, so the series are too):

* ``tokenfair_queue_wait_seconds`` — arrival to dispatch (the operator reports each tenant's
  p99 from it);
* ``tokenfair_time_to_first_token_seconds`` — arrival to the first response byte;
* ``tokenfair_e2e_request_latency_seconds`` — arrival to the end of the answer, for requests
  that ran (buckets up to 10 minutes: :data:`E2E_BUCKETS_S`);

and ``tokenfair_ttft_seconds`` (label ``lane`` only: the same observations as
``tokenfair_time_to_first_token_seconds`` summed over the lane's tenants, kept for the queries
written against it).

``tokenfair_in_flight_requests`` — proxy requests being handled (head read to answer sent:
reading the body, queued, running) — is counted by the proxy app's middleware.

The ``process_*`` metrics (CPU seconds, resident and virtual memory, open and maximum file
descriptors, start time) are ``prometheus_client``'s :class:`~prometheus_client.ProcessCollector`
on this registry: read from ``/proc`` at scrape time, so Linux only (elsewhere they are absent).

The per-request series (admitted, cancelled, estimated and actual tokens, both histograms) are
plain numbers on :class:`LaneSeries` / :class:`LatencyHistogram`, rendered at scrape time by a
collector: an update is an addition, where a ``prometheus_client`` child costs a label check, a
lock and ~6 calls (the sidecar updates five per request). Everything runs on the event-loop
thread, so nothing needs a lock. The rare ones (refusals, errors, invalid, reloads) stay
``prometheus_client`` counters.

Read from the scheduler at scrape time (so always current, and free per request):
``tokenfair_queued_requests{lane}``, ``tokenfair_running_requests``,
``tokenfair_kv_resident_blocks`` (the books: reserved blocks), ``tokenfair_kv_occupancy_ratio``
(what the KV gates see: the books corrected by the engine's last report, see
:mod:`~tokenfair.server.engine_state`), ``tokenfair_draining``, and
``tokenfair_config_info{version, sha256}`` (value 1).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenfair.core import Lane, Scheduler

LANE_NAMES: Final = {Lane.INTERACTIVE: "interactive", Lane.BATCH: "batch"}
LATENCY_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS_S: Final = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip
"""End-to-end latency buckets: a long batch generation runs for minutes, past
:data:`LATENCY_BUCKETS_S`' 30 s."""


def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The buckets' ``le`` labels as prometheus_client writes them (``0.005``, ``1.0``,
    ``+Inf``)."""
    return (*(repr(float(bound)) for bound in bounds), "+Inf")


_LE: Final = _le_labels(LATENCY_BUCKETS_S)
_E2E_LE: Final = _le_labels(E2E_BUCKETS_S)


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
            "KV blocks in use as the gates see them (the books corrected by the engine's last "
            "report, or the books alone) over total KV blocks.",
            max(0, scheduler.kv_view_blocks) / scheduler.policy.total_kv_blocks,
        )
        yield GaugeMetricFamily("tokenfair_draining", "1 while draining.", 1.0 if draining else 0.0)
        info = GaugeMetricFamily(
            "tokenfair_config_info", "The config in force.", labels=["version", "sha256"]
        )
        info.add_metric([version, sha256], 1.0)
        yield info


class LatencyHistogram:
    """A histogram over :data:`LATENCY_BUCKETS_S`, or over :data:`E2E_BUCKETS_S` with ``e2e``
    (Prometheus semantics: a value lands in every bucket whose upper bound ``le`` is >= it)."""

    __slots__ = ("bounds", "counts", "le", "sum")

    def __init__(self, *, e2e: bool = False) -> None:
        self.bounds = E2E_BUCKETS_S if e2e else LATENCY_BUCKETS_S
        self.le = _E2E_LE if e2e else _LE
        self.counts = [0] * (len(self.bounds) + 1)
        """Per bucket (not cumulative); the last is ``+Inf``."""
        self.sum = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect_left(self.bounds, value_s)] += 1
        self.sum += value_s

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, as the exposition format wants them."""
        out: list[tuple[str, float]] = []
        total = 0
        for le, count in zip(self.le, self.counts, strict=True):
            total += count
            out.append((le, total))
        return out


class LaneSeries:
    """The per-request series of one tenant in one lane."""

    __slots__ = (
        "actual_tokens",
        "admitted",
        "cancelled",
        "completion_tokens",
        "created_s",
        "e2e",
        "estimated_tokens",
        "lane",
        "prompt_tokens",
        "queue_wait",
        "tenant",
        "tenant_ttft",
        "ttft",
    )

    def __init__(self, tenant: str, lane: str, ttft: LatencyHistogram) -> None:
        self.tenant = tenant
        self.lane = lane
        self.admitted = 0
        self.cancelled = 0
        self.estimated_tokens = 0
        self.actual_tokens = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.queue_wait = LatencyHistogram()
        self.tenant_ttft = LatencyHistogram()
        """This tenant's (``tokenfair_time_to_first_token_seconds``)."""
        self.ttft = ttft
        """Shared by every tenant of the lane (``tokenfair_ttft_seconds`` is per lane)."""
        self.e2e = LatencyHistogram(e2e=True)
        self.created_s = time.time()

    def observe_ttft(self, value_s: float) -> None:
        self.tenant_ttft.observe(value_s)
        self.ttft.observe(value_s)


class _RequestCollector(Collector):
    """Renders the :class:`LaneSeries` (same names, help and labels as Counter/Histogram)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        series = list(self._metrics.series.values())
        tenant_lane = ["tenant", "lane"]
        for name, documentation, attribute in _COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=tenant_lane)
            for one in series:
                family.add_metric(
                    [one.tenant, one.lane], getattr(one, attribute), created=one.created_s
                )
            yield family
        for name, documentation, attribute in _HISTOGRAMS:
            histograms = HistogramMetricFamily(name, documentation, labels=tenant_lane)
            for one in series:
                histogram: LatencyHistogram = getattr(one, attribute)
                histograms.add_metric([one.tenant, one.lane], histogram.buckets(), histogram.sum)
            yield histograms
        ttft = HistogramMetricFamily(
            "tokenfair_ttft_seconds", "Time from arrival to the first response byte.",
            labels=["lane"],
        )  # fmt: skip
        for lane, histogram in self._metrics.ttft.items():
            ttft.add_metric([lane], histogram.buckets(), histogram.sum)
        yield ttft
        yield GaugeMetricFamily(
            "tokenfair_in_flight_requests",
            "Proxy requests being handled: reading the body, queued, running or answering.",
            self._metrics.in_flight,
        )


_COUNTERS: Final = (
    ("tokenfair_admitted_requests", "Requests dispatched.", "admitted"),
    ("tokenfair_cancelled_requests", "Requests whose client went away.", "cancelled"),
    (
        "tokenfair_estimated_service_tokens",
        "Service tokens charged at dispatch (estimates).",
        "estimated_tokens",
    ),
    (
        "tokenfair_actual_service_tokens",
        "Service tokens settled at completion (actual usage).",
        "actual_tokens",
    ),
    (
        "tokenfair_prompt_tokens",
        "Prompt tokens the backend reported (usage.prompt_tokens) for requests that ran.",
        "prompt_tokens",
    ),
    (
        "tokenfair_completion_tokens",
        "Completion tokens the backend reported (usage.completion_tokens) for requests that ran.",
        "completion_tokens",
    ),
)
"""(name, help, LaneSeries attribute) of the per-request counters."""

_HISTOGRAMS: Final = (
    ("tokenfair_queue_wait_seconds", "Time from arrival to dispatch.", "queue_wait"),
    (
        "tokenfair_time_to_first_token_seconds",
        "Time from arrival to the first response byte.",
        "tenant_ttft",
    ),
    (
        "tokenfair_e2e_request_latency_seconds",
        "Time from arrival to the end of the answer, for requests that ran.",
        "e2e",
    ),
)
"""(name, help, LaneSeries attribute) of the per-tenant histograms."""


class Metrics:
    """Every metric of one sidecar; ``registry`` is what ``/metrics`` renders."""

    def __init__(self, state: Callable[[], tuple[Scheduler, bool, str, str]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        tenant_lane = ["tenant", "lane"]
        self.refused = Counter(
            "tokenfair_refused_requests",
            "Requests refused, by reason.",
            [*tenant_lane, "reason"],
            registry=registry,
        )
        self.backend_errors = Counter(
            "tokenfair_backend_errors",
            "Requests the backend failed.",
            [*tenant_lane, "code"],
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
        self.records_dropped = Counter(
            "tokenfair_records_dropped",
            "Request records dropped while the records file refused writes.",
            registry=registry,
        )
        self.refused_connections = Counter(
            "tokenfair_refused_connections",
            "Proxy connections closed at once: the connection cap was reached.",
            registry=registry,
        )
        self.series: dict[tuple[str, str], LaneSeries] = {}
        """Per (tenant, lane), created at the tenant's first request in the lane."""
        self.ttft: dict[str, LatencyHistogram] = {}
        self.in_flight = 0
        """Proxy requests being handled (the proxy app's middleware counts them)."""
        registry.register(_RequestCollector(self))
        registry.register(_SchedulerCollector(state))
        ProcessCollector(registry=registry)  # process_*: from /proc (Linux), at scrape time

    def lane_series(self, tenant: str, lane: str) -> LaneSeries:
        series = self.series.get((tenant, lane))
        if series is None:
            ttft = self.ttft.get(lane)
            if ttft is None:
                ttft = self.ttft[lane] = LatencyHistogram()
            series = self.series[(tenant, lane)] = LaneSeries(tenant, lane, ttft)
        return series
