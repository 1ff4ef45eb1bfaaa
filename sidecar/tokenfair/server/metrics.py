"""Prometheus metrics of one sidecar, in a per-app ``CollectorRegistry`` (never the global one).

Counters (labels ``tenant``, ``lane`` and, for refusals, ``reason``):

* ``tokenfair_admitted_requests_total`` — dispatched to the backend;
* ``tokenfair_refused_requests_total`` — refused, never dispatched: the core's gates' reasons
  (``shed_*``, ``queue_full``, the never admissible ``request_over_*``) and ``draining`` (an
  upstream's own 400/429/503 is not a refusal); the values are the
  :class:`~tokenfair.core.reasons.Reason` members whose ``counter`` is ``refused``;
* ``tokenfair_shadow_refusals_total`` — shadow mode (``enforcement: Shadow``): requests a gate
  refused and the sidecar served anyway, by the refusal's ``reason`` (they are counted admitted
  too: they ran);
* ``tokenfair_cancelled_requests_total`` — the client went away (queued or mid-response);
* ``tokenfair_backend_errors_total`` (``code``: the ``upstream_*`` reasons, ``internal_error``
  for the sidecar's own failures and ``drain_aborted`` for requests the drain cut — the
  :class:`~tokenfair.core.reasons.Reason` members whose ``counter`` is ``backend_errors`` — and
  ``admitted`` for an upstream's own 5xx answer);
* ``tokenfair_estimated_service_tokens_total`` (charged at dispatch) and
  ``tokenfair_actual_service_tokens_total`` (settled at completion);
* ``tokenfair_prompt_tokens_total`` and ``tokenfair_completion_tokens_total`` — the usage the
  backend reported for requests that ran (``usage.prompt_tokens`` / ``completion_tokens``: the
  tokens clients count); a count that was not reported, or not believed, adds nothing;
* ``tokenfair_invalid_requests_total`` (``status``: 400, 401, 404, 408, 413, 415, 417) — before any
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

The per-tenant series (admitted, cancelled, refused and failed by reason, estimated and actual
tokens, the three histograms) are plain numbers on :class:`LaneSeries` /
:class:`LatencyHistogram`: an update is an addition, where a ``prometheus_client`` child costs a
label check, a lock and ~6 calls (the sidecar updates five per request). Everything runs on the
event-loop thread, so nothing needs a lock. The families of a fixed size (invalid, reloads,
records dropped, refused connections, the scheduler's gauges, ``process_*``) stay in a
``prometheus_client`` registry.

**A scrape never holds the event loop for long** (:meth:`Metrics.chunks`): the registry's few
families first, then the per-tenant families written by :mod:`~tokenfair.server.exposition` in
chunks of :data:`~tokenfair.server.exposition.HISTOGRAM_CHUNK` /
:data:`~tokenfair.server.exposition.COUNTER_CHUNK` series, the admin handler yielding to the
loop between chunks. Each series' label text is escaped once, when the series is made. The
size of a scrape grows with the tenants that sent requests (~5.7 KB per tenant and lane; idle
tenants have no series): ~11 MB at 2,000 active tenants (one lane each), written in ~0.06 s of
CPU spread over ~350 chunks of well under a millisecond each (measured on the 2-core machine;
``prometheus_client`` took ~3.3 s, in one piece).

Read from the scheduler at scrape time (so always current, and free per request):
``tokenfair_queued_requests{lane}``, ``tokenfair_running_requests``,
``tokenfair_kv_resident_blocks`` (the books: reserved blocks), ``tokenfair_kv_occupancy_ratio``
(what the KV gates see: the books corrected by the engine's last report, see
:mod:`~tokenfair.server.engine_state`), ``tokenfair_draining``, and
``tokenfair_config_info{version, sha256}`` (value 1).
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenfair.core import Lane, Scheduler
from tokenfair.server.exposition import (
    HISTOGRAM_CHUNK,
    counter_chunks,
    family_chunks,
    go_float,
    label_value,
    number,
)

if TYPE_CHECKING:
    from tokenfair.server.fairness_signal import FairnessSignal

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
            max(0, scheduler.kv_gate_blocks) / scheduler.policy.total_kv_blocks,
        )
        yield GaugeMetricFamily("tokenfair_draining", "1 while draining.", 1.0 if draining else 0.0)
        info = GaugeMetricFamily(
            "tokenfair_config_info", "The config in force.", labels=["version", "sha256"]
        )
        info.add_metric([version, sha256], 1.0)
        yield info


class DemandCollector(Collector):
    """``tokenfair_demand_ratio{lane}``: the scaling signal (:mod:`tokenfair.core.demand`;
    docs/observability.md#the-scaling-signal), read at scrape time: O(requests held) for the
    running ones, O(1) amortised for the window."""

    def __init__(self, ratios: Callable[[], dict[Lane, float]]) -> None:
        self._ratios = ratios

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tokenfair_demand_ratio",
            "Demand over capacity in service tokens: max(queued + running, offered in the last "
            "wait limit) / (serviceTokensPerMs * wait limit). Above 1: more replicas needed.",
            labels=["lane"],
        )
        for lane, ratio in self._ratios().items():
            family.add_metric([LANE_NAMES[lane]], ratio)
        yield family


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
        "backend_errors",
        "backend_errors_created",
        "cancelled",
        "completion_tokens",
        "created_s",
        "created_text",
        "e2e",
        "estimated_tokens",
        "labels",
        "lane",
        "lane_label",
        "prompt_tokens",
        "queue_wait",
        "refused",
        "refused_created",
        "tenant",
        "tenant_label",
        "tenant_ttft",
        "ttft",
        "would_refuse",
        "would_refuse_created",
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
        self.refused: dict[str, int] = {}
        """Requests never dispatched, by reason (``tokenfair_refused_requests_total``)."""
        self.refused_created: dict[str, float] = {}
        self.would_refuse: dict[str, int] = {}
        """Shadow mode: requests a gate refused and that were served anyway, by reason
        (``tokenfair_shadow_refusals_total``)."""
        self.would_refuse_created: dict[str, float] = {}
        self.backend_errors: dict[str, int] = {}
        """Requests the backend or the sidecar failed, by code
        (``tokenfair_backend_errors_total``)."""
        self.backend_errors_created: dict[str, float] = {}
        self.queue_wait = LatencyHistogram()
        self.tenant_ttft = LatencyHistogram()
        """This tenant's (``tokenfair_time_to_first_token_seconds``)."""
        self.ttft = ttft
        """Shared by every tenant of the lane (``tokenfair_ttft_seconds`` is per lane)."""
        self.e2e = LatencyHistogram(e2e=True)
        self.created_s = time.time()
        # The label text of every sample of this series, escaped once (labels in name order,
        # as prometheus_client writes them: code < lane < le < reason < tenant).
        self.lane_label = f'lane="{label_value(lane)}"'
        self.tenant_label = f'tenant="{label_value(tenant)}"'
        self.labels = f"{self.lane_label},{self.tenant_label}"
        self.created_text = go_float(self.created_s)

    def observe_ttft(self, value_s: float) -> None:
        """Both TTFT histograms (the tenant's, the lane's: the same bounds), bucket found once."""
        tenant, lane = self.tenant_ttft, self.ttft
        bucket = bisect_left(LATENCY_BUCKETS_S, value_s)
        tenant.counts[bucket] += 1
        tenant.sum += value_s
        lane.counts[bucket] += 1
        lane.sum += value_s

    def count_refused(self, reason: str) -> None:
        _count(self.refused, self.refused_created, reason)

    def count_would_refuse(self, reason: str) -> None:
        _count(self.would_refuse, self.would_refuse_created, reason)

    def count_backend_error(self, code: str) -> None:
        _count(self.backend_errors, self.backend_errors_created, code)


def _count(counts: dict[str, int], created: dict[str, float], key: str) -> None:
    """One more of ``key``; its ``_created`` stamp is the time of its first."""
    count = counts.get(key)
    if count is None:
        created[key] = time.time()
        count = 0
    counts[key] = count + 1


class _LaneCollector(Collector):
    """``tokenfair_ttft_seconds`` (per lane) and ``tokenfair_in_flight_requests``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
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


SeriesLines = Callable[[LaneSeries], str]
"""A series' sample lines of one family."""


@dataclass(frozen=True, slots=True)
class _SeriesFamily:
    """One per-tenant family: its ``lines`` (``_total`` lines of a counter, every line of a
    histogram) and, for a counter, its ``_created`` lines."""

    name: str
    documentation: str
    lines: SeriesLines
    created: SeriesLines | None = None

    def chunks(self, series: list[LaneSeries]) -> Iterator[str]:
        if self.created is None:
            return family_chunks(self.name, "histogram", self.documentation, series,
                                 self.lines, HISTOGRAM_CHUNK)  # fmt: skip
        return counter_chunks(self.name, self.documentation, series, self.lines, self.created)


def _counter(name: str, documentation: str, attribute: str) -> _SeriesFamily:
    value = attrgetter(attribute)
    total, created = f"{name}_total{{", f"{name}_created{{"

    def totals(series: LaneSeries) -> str:
        return f"{total}{series.labels}}} {number(value(series))}\n"

    def stamps(series: LaneSeries) -> str:
        return f"{created}{series.labels}}} {series.created_text}\n"

    return _SeriesFamily(name, documentation, totals, stamps)


def _counter_by(name: str, documentation: str, label: str, attribute: str) -> _SeriesFamily:
    """A counter by ``label`` (``reason`` sorts between ``lane`` and ``tenant``, ``code``
    before both: labels are written in name order)."""
    counts, stamps = attrgetter(attribute), attrgetter(f"{attribute}_created")

    def labels(series: LaneSeries, key: str) -> str:
        pair = f'{label}="{label_value(key)}"'
        if label < "lane":
            return f"{pair},{series.labels}"
        return f"{series.lane_label},{pair},{series.tenant_label}"

    def totals(series: LaneSeries) -> str:
        by_key: dict[str, int] = counts(series)
        return "".join([f"{name}_total{{{labels(series, key)}}} {number(count)}\n"
                        for key, count in by_key.items()])  # fmt: skip

    def created(series: LaneSeries) -> str:
        by_key: dict[str, float] = stamps(series)
        return "".join([f"{name}_created{{{labels(series, key)}}} {go_float(at_s)}\n"
                        for key, at_s in by_key.items()])  # fmt: skip

    return _SeriesFamily(name, documentation, totals, created)


def _histogram(name: str, documentation: str, attribute: str) -> _SeriesFamily:
    histogram_of = attrgetter(attribute)
    bucket, count, total = f"{name}_bucket{{", f"{name}_count{{", f"{name}_sum{{"

    def lines(series: LaneSeries) -> str:
        histogram: LatencyHistogram = histogram_of(series)
        head = f'{bucket}{series.lane_label},le="'
        tail = f'",{series.tenant_label}}} '
        out = []
        cumulative = 0
        for le, observed in zip(histogram.le, histogram.counts, strict=True):
            cumulative += observed
            # number()'s fast path inline: ~17 lines a series, ~90 % of a scrape's text
            value = f"{cumulative}.0" if cumulative < 1_000_000 else go_float(cumulative)
            out.append(f"{head}{le}{tail}{value}\n")
        out.append(f"{count}{series.labels}}} {number(cumulative)}\n")
        out.append(f"{total}{series.labels}}} {go_float(histogram.sum)}\n")
        return "".join(out)

    return _SeriesFamily(name, documentation, lines)


_SERIES_FAMILIES: Final = (
    _counter("tokenfair_admitted_requests", "Requests dispatched.", "admitted"),
    _counter("tokenfair_cancelled_requests", "Requests whose client went away.", "cancelled"),
    _counter(
        "tokenfair_estimated_service_tokens",
        "Service tokens charged at dispatch (estimates).",
        "estimated_tokens",
    ),
    _counter(
        "tokenfair_actual_service_tokens",
        "Service tokens settled at completion (actual usage).",
        "actual_tokens",
    ),
    _counter(
        "tokenfair_prompt_tokens",
        "Prompt tokens the backend reported (usage.prompt_tokens) for requests that ran.",
        "prompt_tokens",
    ),
    _counter(
        "tokenfair_completion_tokens",
        "Completion tokens the backend reported (usage.completion_tokens) for requests that ran.",
        "completion_tokens",
    ),
    _counter_by("tokenfair_refused_requests", "Requests refused, by reason.", "reason", "refused"),
    _counter_by(
        "tokenfair_shadow_refusals",
        "Requests a gate refused in shadow mode and served anyway, by reason.",
        "reason",
        "would_refuse",
    ),
    _counter_by(
        "tokenfair_backend_errors", "Requests the backend failed.", "code", "backend_errors"
    ),
    _histogram("tokenfair_queue_wait_seconds", "Time from arrival to dispatch.", "queue_wait"),
    _histogram(
        "tokenfair_time_to_first_token_seconds",
        "Time from arrival to the first response byte.",
        "tenant_ttft",
    ),
    _histogram(
        "tokenfair_e2e_request_latency_seconds",
        "Time from arrival to the end of the answer, for requests that ran.",
        "e2e",
    ),
)
"""Every per-tenant family, in the order a scrape writes them."""

CounterChild = Counter
"""A labelled child of a ``prometheus_client`` counter (``Counter.labels(...)``)."""

TenantFamilies = Callable[[], Iterator[str]]
"""A source of per-tenant families for :meth:`Metrics.add_tenant_families`: a generator of
text chunks, each bounded in work (:func:`~tokenfair.server.exposition.family_chunks`)."""


class Metrics:
    """Every metric of one sidecar; ``registry`` is what ``/metrics`` renders."""

    def __init__(self, state: Callable[[], tuple[Scheduler, bool, str, str]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.invalid = Counter(
            "tokenfair_invalid_requests",
            "Requests rejected before admission.",
            ["status"],
            registry=registry,
        )
        self._invalid_children: dict[int, CounterChild] = {}
        """``invalid``'s child per status, made at its first request (a label check and a
        lookup each time otherwise)."""
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
        self._tenant_families: list[TenantFamilies] = [self._series_chunks]
        registry.register(_LaneCollector(self))
        registry.register(_SchedulerCollector(state))
        ProcessCollector(registry=registry)  # process_*: from /proc (Linux), at scrape time

    def count_invalid(self, status: int) -> None:
        """One more request rejected before admission with ``status``."""
        child = self._invalid_children.get(status)
        if child is None:
            child = self._invalid_children[status] = self.invalid.labels(str(status))
        child.inc()

    def add_tenant_families(self, source: TenantFamilies) -> None:
        """Render ``source``'s families in every scrape, after this module's."""
        self._tenant_families.append(source)

    def chunks(self) -> Iterator[str]:
        """The ``/metrics`` text in chunks, each a bounded amount of work: the registry's
        families of a fixed size in one, then the per-tenant families a few hundred series at
        a time. Iterate it with a yield to the event loop between chunks."""
        yield generate_latest(self.registry).decode()
        for source in self._tenant_families:
            yield from source()

    def render(self) -> str:
        """The whole ``/metrics`` text at once (tests and tools; the admin handler streams
        :meth:`chunks`)."""
        return "".join(self.chunks())

    def _series_chunks(self) -> Iterator[str]:
        series = list(self.series.values())  # made during the scrape: in the next one
        for family in _SERIES_FAMILIES:
            yield from family.chunks(series)

    def lane_series(self, tenant: str, lane: str) -> LaneSeries:
        series = self.series.get((tenant, lane))
        if series is None:
            ttft = self.ttft.get(lane)
            if ttft is None:
                ttft = self.ttft[lane] = LatencyHistogram()
            series = self.series[(tenant, lane)] = LaneSeries(tenant, lane, ttft)
        return series


# -- The live fairness signal (server/fairness_signal.py) -----------------------------------------
# Kept apart from the per-request series above: nothing here is touched per request. The figures
# are the signal's last refresh (every few seconds), so a scrape only copies a few numbers.


class FluidFairnessCollector(Collector):
    """``tokenfair_fluid_*``: the fluid fair-share reference per lane over a sliding window
    (:mod:`~tokenfair.server.fairness_signal`; docs/observability.md#fairness):

    * ``tokenfair_fluid_jain{lane}`` — Jain's index over ``served / fluid reference`` of the
      lane's tenants with a reference in the window (absent while no tenant has one);
    * ``tokenfair_fluid_worst_ratio{lane}`` — the lowest such ratio;
    * ``tokenfair_fluid_served_ratio{lane, tenant}`` — ``served / fluid reference`` of the
      ``fairnessTopTenants`` tenants that received the most in the window, and of
      ``tenant="other"`` (the rest summed): at most ``2 x (fairnessTopTenants + 1)`` series;
    * ``tokenfair_fluid_window_seconds`` — the window's length (model seconds: it grows to
      ``fairnessWindowSeconds`` after start or a reload);
    * ``tokenfair_fluid_late_requests_total`` — requests that ended after the fluid server had
      passed their arrival (they joined it late)."""

    def __init__(self, signal: FairnessSignal) -> None:
        self._signal = signal

    def collect(self) -> Iterator[Metric]:
        signal = self._signal
        latest = signal.latest
        jain = GaugeMetricFamily(
            "tokenfair_fluid_jain",
            "Jain's index over served / fluid fair-share reference of the lane's tenants, over "
            "the fairness window.",
            labels=["lane"],
        )
        worst = GaugeMetricFamily(
            "tokenfair_fluid_worst_ratio",
            "The lowest served / fluid fair-share reference of the lane's tenants, over the "
            "fairness window.",
            labels=["lane"],
        )
        served = GaugeMetricFamily(
            "tokenfair_fluid_served_ratio",
            "Served / fluid fair-share reference over the fairness window, for the tenants that "
            "received the most (the rest summed as tenant other).",
            labels=["lane", "tenant"],
        )
        window_s = 0.0
        if latest is not None and math.isfinite(latest.end_ms):
            window_s = (latest.end_ms - latest.start_ms) / 1000.0
            for lane, figures in latest.lanes.items():
                if figures.jain is not None:
                    jain.add_metric([lane], figures.jain)
                ratio = None if figures.worst is None else figures.worst.served_over_fluid
                if ratio is not None:
                    worst.add_metric([lane], ratio)
                for row in figures.tenants:
                    ratio = row.served_over_fluid
                    if ratio is not None:
                        served.add_metric([lane, row.tenant_id], ratio)
        yield jain
        yield worst
        yield served
        yield GaugeMetricFamily(
            "tokenfair_fluid_window_seconds",
            "Length of the fairness window the tokenfair_fluid_* figures cover (model seconds).",
            window_s,
        )
        yield CounterMetricFamily(
            "tokenfair_fluid_late_requests",
            "Requests that ended after the fluid reference had passed their arrival.",
            signal.late_requests,
        )
