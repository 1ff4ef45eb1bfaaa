"""The outcome sink: every request's one outcome counted, recorded, logged and traced, and
given to the fairness signal, behind one object that never raises.

A request's :class:`~tokenfair.server.lifecycle.Lifecycle` reports to :class:`Outcomes` at
admission (:meth:`Outcomes.admission`: the scaling signal), at dispatch
(:meth:`Outcomes.dispatched`) and once at its end (:meth:`Outcomes.completed`); the proxy app's
middleware reports a request answered before admission (:meth:`Outcomes.observe_unadmitted`).
Each step is guarded on its own: a failure while counting (a bug, logged) does not stop the
record, nor a failure of the record the access-log line, the span or the fairness signal; a
record that cannot be written is counted in ``tokenfair_records_dropped_total``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Final

from tokenfair.config import PriorityClass
from tokenfair.core import Decision, Lane, Request
from tokenfair.core.demand import DemandGauge
from tokenfair.core.jobs import LANE_OF
from tokenfair.records.live import NO_USAGE, Usage, encode_record, minimal_record
from tokenfair.server.accesslog import (
    CURRENT_SCOPE,
    NO_FACTS,
    SERVED_FIELDS,
    AccessLog,
    RequestFacts,
    RequestScope,
    UtcTimestamps,
    bounded,
)
from tokenfair.server.errors import INTERNAL_ERROR
from tokenfair.server.fairness_signal import FairnessSignal
from tokenfair.server.metrics import LANE_NAMES, LaneSeries, Metrics
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.tracing import RequestTracer, wall_ns_of

if TYPE_CHECKING:
    from tokenfair.server.clock import ModelClock
    from tokenfair.server.lifecycle import Pricing

log = logging.getLogger("tokenfair.sidecar")

REFUSAL_STATUSES: Final = frozenset({400, 429, 503})
"""Statuses of a request never dispatched that count as refused (``400`` never admissible,
``429`` a gate, ``503`` draining); the same statuses after dispatch are the upstream's."""


class Outcomes:
    """The one outcome sink of a sidecar (metrics series, per-tenant counters for ``/status``,
    records, access log, tracing, the fairness signal and the scaling signal). Its reports of
    admission and of an outcome never raise; :meth:`dispatched` (counted while the request is
    served) may, and the proxy answers that request ``500 internal_error``."""

    def __init__(
        self,
        metrics: Metrics,
        clock: ModelClock,
        fairness: FairnessSignal,
        demand: DemandGauge,
        pricing: Pricing,
        access_log: AccessLog | None,
        policy_name: str,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.fairness = fairness
        self.demand = demand
        self.pricing = pricing
        self.access_log = access_log
        self.policy_name = policy_name
        self.record_writer: RecordWriter | None = None
        """Set by the app's records context when records are on."""
        self.tracer: RequestTracer | None = None
        """Set by the app's tracing context when tracing is on."""
        self.tenant_counts: dict[str, Counter[str]] = {}
        """Per tenant: served, refused, cancelled, backend_errors, would_refuse, admitted."""
        self._series_cache: dict[tuple[str, PriorityClass], LaneSeries] = {}
        self._timestamps = UtcTimestamps()

    def admission(self, request: Request, decision: Decision | None) -> None:
        """Admission decided ``request``: queued (``decision`` None) or refused (possibly in
        shadow mode); the scaling signal counts what was offered. Never raises."""
        try:
            if decision is None:
                cost = self.pricing.cost
                tokens = cost.service_tokens(request.prefill_tokens, request.decode_tokens)
                self.demand.admitted(LANE_OF[request.priority_class], tokens, self.clock.now_ms())
            else:
                self.demand.refused(decision, self.clock.now_ms())
        except Exception:
            log.exception("request %s: the scaling signal failed to count it", request.request_id)

    def _series(self, tenant_id: str, priority_class: PriorityClass) -> LaneSeries:
        key = (tenant_id, priority_class)
        series = self._series_cache.get(key)
        if series is None:
            lane = LANE_NAMES[Lane.of(priority_class)]
            series = self._series_cache[key] = self.metrics.lane_series(tenant_id, lane)
        return series

    def dispatched(self, decision: Decision) -> None:
        """A request was dispatched: its lane's admitted, estimated tokens and queue wait."""
        series = self._series(decision.tenant_id, decision.priority_class)
        series.admitted += 1
        series.estimated_tokens += decision.service_tokens
        series.queue_wait.observe(decision.queue_wait_ms / 1000.0)

    def completed(
        self,
        request: Request,
        decision: Decision | None,
        *,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None = None,
        usage: Usage | None = None,
        facts: RequestFacts | None = None,
    ) -> None:
        """Count, measure and record one request's outcome, then log and trace it and give it to
        the fairness signal (called once per request, by :meth:`Lifecycle.complete
        <tokenfair.server.lifecycle.Lifecycle.complete>`). Never raises, and this is the one
        place that makes sure of it: each step is guarded here, whatever guards it has of its
        own (:meth:`record` never raises: a record it cannot write is counted as dropped), so a
        failing step (a bug, logged) stops none of the others. A request without a decision
        (which cannot happen: the lifecycle logs it) is recorded alone."""
        if usage is None:
            usage = NO_USAGE
        if decision is None:
            self.record(request, None, status_code=status_code, reason=reason)
            return
        try:
            self.count(request, decision, status_code, reason, actual_service_tokens, usage)
        except Exception:
            log.exception("request %s: counting its outcome failed; its record is still written",
                          request.request_id)  # fmt: skip
        self.record(request, decision, status_code=status_code, reason=reason, usage=usage)
        try:
            self.observe(request, decision, status_code=status_code, reason=reason,
                         actual_service_tokens=actual_service_tokens, usage=usage,
                         facts=facts)  # fmt: skip
        except Exception:  # its own guards failed (a bug): the fairness signal still sees it
            log.exception("request %s: its access-log line or span failed", request.request_id)
        try:
            self.fairness.completed(decision, status_code)
        except Exception:  # its own guard failed (a bug)
            log.exception("request %s: the fairness signal failed", request.request_id)

    def count(
        self,
        request: Request,
        decision: Decision,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None,
        usage: Usage,
    ) -> None:
        """The counting step of :meth:`completed`: the lane's metrics series and the tenant's
        counters for ``/status`` (a failure here is guarded by :meth:`completed`)."""
        tenant = request.tenant_id
        series = self._series(tenant, request.priority_class)
        counts = self.tenant_counts.get(tenant)
        if counts is None:
            counts = self.tenant_counts[tenant] = Counter()
        if status_code == 499:
            series.cancelled += 1
            counts["cancelled"] += 1
        elif decision.dispatch_ms is None and status_code in REFUSAL_STATUSES:
            # Never dispatched: refused at admission (429, or 400 never admissible), shed from
            # the queue (429) or taken out of it by a drain (503 draining). A dispatched
            # request's 400, 429 or 503 is the upstream's answer, not a refusal.
            series.count_refused(reason)
            counts["refused"] += 1
        elif reason.startswith("upstream_") or reason == INTERNAL_ERROR or status_code >= 500:
            # Upstream faults (502, 504, a stream cut after its 200, usage not believed on a
            # 200, the upstream's own 5xx), the sidecar's own failures (500 internal_error, or
            # a 200 it could not settle) and requests the drain cut (503 drain_aborted).
            series.count_backend_error(reason)
            counts["backend_errors"] += 1
        else:
            counts["served"] += 1
        if decision.would_refuse:
            series.count_would_refuse(decision.reason)
            counts["would_refuse"] += 1
        if decision.dispatch_ms is not None:
            counts["admitted"] += 1
            settled = (
                decision.service_tokens
                if actual_service_tokens is None
                else (actual_service_tokens)
            )
            series.actual_tokens += settled
            if usage.prompt_tokens is not None:
                series.prompt_tokens += usage.prompt_tokens
            if usage.completion_tokens is not None:
                series.completion_tokens += usage.completion_tokens
            e2e_ms = usage.e2e_ms
            if e2e_ms is None:
                e2e_ms = self.clock.now_ms() - request.arrival_ms
            series.e2e.observe(e2e_ms / 1000.0)
        if usage.ttft_ms is not None:
            series.observe_ttft(usage.ttft_ms / 1000.0)
            decision.ttft_ms = round(usage.ttft_ms, 2)

    def observe(
        self,
        request: Request,
        decision: Decision,
        *,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None = None,
        usage: Usage = NO_USAGE,
        facts: RequestFacts | None = None,
    ) -> None:
        """Write the request's access-log line and, with tracing on, its span
        (:mod:`~tokenfair.server.accesslog`, :mod:`~tokenfair.server.tracing`),
        and mark its scope accounted. Never raises."""
        scope = CURRENT_SCOPE.get()
        if scope is not None:
            scope.accounted = True
        access, tracer = self.access_log, self.tracer
        if (access is None or not access.enabled()) and tracer is None:
            return
        try:
            facts = facts or NO_FACTS
            clock = self.clock
            now_ms = clock.now_ms()
            scale = clock.time_scale
            settled = 0
            if decision.dispatch_ms is not None:  # it ran
                settled = (
                    decision.service_tokens
                    if actual_service_tokens is None
                    else actual_service_tokens
                )
            e2e_model_ms = usage.e2e_ms if usage.e2e_ms is not None else now_ms - request.arrival_ms
            ttft_ms = usage.ttft_ms
            now_s = time.time()
            values = (
                self._timestamps(now_s),
                request.request_id,
                request.tenant_id,
                request.priority_class,
                scope.method if scope is not None else "POST",
                bounded(facts.route) or (scope.route if scope is not None else None),
                bounded(facts.model),
                status_code,
                reason,
                decision.gate,
                request.prefill_tokens,
                request.decode_tokens,
                decision.service_tokens,
                usage.prompt_tokens,
                usage.completion_tokens,
                settled,
                round(decision.queue_wait_ms * scale, 3),
                None if ttft_ms is None else round(ttft_ms * scale, 3),
                round(e2e_model_ms * scale, 3),
            )
        except Exception:
            log.exception("request %s: building its access log line failed", request.request_id)
            return
        if access is not None:
            access.emit_served(values)
        if tracer is not None:
            try:
                now_ns = int(now_s * 1e9)
                tracer.request_span(
                    dict(zip(SERVED_FIELDS, values, strict=True)), request, decision, facts,
                    start_ms=request.arrival_ms if scope is None else scope.arrival_ms,
                    now_ms=now_ms, now_ns=now_ns, time_scale=scale, scope=scope,
                )  # fmt: skip
            except Exception:
                log.exception("request %s: its span failed", request.request_id)

    def observe_unadmitted(self, scope: RequestScope, status_code: int, reason: str | None
                           ) -> None:  # fmt: skip
        """The access-log line and span of a request answered before admission (by the
        proxy app's middleware: nothing accounted it). Never raises."""
        access, tracer = self.access_log, self.tracer
        if (access is None or not access.enabled()) and tracer is None:
            return
        try:
            now_ms = self.clock.now_ms()
            now_s = time.time()
            fields: dict[str, Any] = {
                "time": self._timestamps(now_s),
                "request_id": None,
                "tenant": None,
                "priority_class": None,
                "method": scope.method,
                "route": scope.route,
                "model": None,
                "status": status_code,
                "reason": reason,
                "e2e_ms": round((now_ms - scope.arrival_ms) * self.clock.time_scale, 3),
            }
        except Exception:
            log.exception("an unadmitted request's access log line failed")
            return
        if access is not None:
            access.emit(fields)
        if tracer is not None:
            try:
                now_ns = int(now_s * 1e9)
                start = wall_ns_of(scope.arrival_ms, now_ms, now_ns, self.clock.time_scale)
                tracer.span(fields, start_ns=start, end_ns=now_ns, events=[],
                            traceparent=scope.traceparent, tracestate=scope.tracestate)  # fmt: skip
            except Exception:
                log.exception("an unadmitted request's span failed")

    def record(
        self,
        request: Request,
        decision: Decision | None,
        *,
        status_code: int,
        reason: str,
        usage: Usage = NO_USAGE,
    ) -> None:
        """Write the request's record, if records are on. Never raises: a record that cannot
        be encoded, or has no decision (which cannot happen: the lifecycle logs it), is written
        minimal (:func:`minimal_record`), and one that cannot be queued at all is counted in
        ``tokenfair_records_dropped_total`` (both logged)."""
        writer = self.record_writer
        if writer is None:
            return
        try:
            line: str | None = None
            if decision is not None:
                try:
                    line = encode_record(request, decision, self.policy_name,
                                         status_code=status_code, reason=reason,
                                         usage=usage)  # fmt: skip
                except Exception:
                    log.exception("request %s: its record could not be encoded; writing a "
                                  "minimal one", request.request_id)  # fmt: skip
            if line is None:
                line = minimal_record(request, self.policy_name, status_code=status_code,
                                      reason=reason)  # fmt: skip
            writer.write(line)
        except Exception:
            log.exception("request %s: its record could not be written; counted as dropped",
                          request.request_id)  # fmt: skip
            try:
                self.metrics.records_dropped.inc()
            except Exception:
                log.exception("counting a dropped record failed")
