"""Optional OpenTelemetry tracing: one span per proxy request, exported over OTLP/HTTP.

Off by default (``tracing: true`` / ``--tracing``). The OpenTelemetry packages are the
``tracing`` extra (``pip install 'tokenfair[tracing]'``), imported only when tracing is on: a
sidecar asked to trace without them refuses to start (:func:`check_tracing_available`).

The exporter is the SDK's ``OTLPSpanExporter`` (protobuf over HTTP) behind a
``BatchSpanProcessor``; ``tracingEndpoint`` / ``--tracing-endpoint`` sets its URL (the full
traces URL, e.g. ``http://otel-collector:4318/v1/traces``), else the SDK's own variables apply
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, headers, timeout), as
do ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service name by default
``tokenfair-sidecar``) and ``OTEL_TRACES_SAMPLER`` (every request by default).

The span is written when the request's outcome is accounted — once, from the same place as
its access-log line (:mod:`~tokenfair.server.accesslog`) — with the times it had: it
starts at the request's arrival and ends at its end, and its events carry the times they
happened (model times converted to the wall clock). Nothing is done per request while tracing
is off, and a span that fails is logged, never raised into the request.

The span follows the OpenTelemetry GenAI semantic conventions (development status, moved to
the ``semantic-conventions-genai`` repository), as a gateway that serves the inference call:

* name ``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat gpt-x``; the operation alone
  when the model is unknown: a request refused before its body was read, or before it ran);
  kind ``SERVER`` (the span of the sidecar answering its client; it joins the client's trace
  when the request carries a W3C ``traceparent``);
* ``gen_ai.operation.name`` — ``chat`` (``/v1/chat/completions``), ``text_completion``
  (``/v1/completions``), ``embeddings`` (``/v1/embeddings``), else the route;
  ``gen_ai.provider.name`` — ``openai`` for the ``openai`` backend (an OpenAI-compatible
  API), ``tokenfair.costmodel`` for the embedded engine; ``gen_ai.request.model``;
  ``gen_ai.request.max_tokens`` (the completion tokens admission charged);
  ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens`` (the usage the backend
  reported); ``error.type`` — the reason of an outcome other than ``admitted`` with a status of
  400 or more (the span's status is ERROR for 5xx only, as for HTTP server spans);
* ``http.request.method``, ``http.route``, ``http.response.status_code``;
* ``tokenfair.*``: ``request_id``, ``tenant``, ``priority_class``, ``reason``, ``gate``,
  ``service_tokens.estimated``, ``service_tokens.settled``, ``queue_wait_ms``, ``ttft_ms``.

Events, in time order: ``tokenfair.admission`` (``tokenfair.admission.result``: ``queued``
or ``refused``, with the gate and reason of a refusal), ``tokenfair.dispatch``
(``tokenfair.queue_wait_ms``) or ``tokenfair.left_queue`` (``tokenfair.reason``: expired,
cancelled, drained), ``tokenfair.first_token``, ``tokenfair.settlement``
(``tokenfair.settlement``: ``as_reported``, ``at_estimate`` or ``core_failed``, and the settled
service tokens).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from tokenfair.config import ConfigError
from tokenfair.core.reasons import Reason
from tokenfair.server.backends import BACKENDS

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from tokenfair.core import Decision, Request
    from tokenfair.server.accesslog import RequestFacts, RequestScope

log = logging.getLogger("tokenfair.sidecar")

DEFAULT_SERVICE_NAME: Final = "tokenfair-sidecar"
INSTRUMENTATION_NAME: Final = "tokenfair.sidecar"
FLUSH_ON_CLOSE_MS: Final = 2000
"""At shutdown, how long the last spans may take to export (an unreachable collector must not
hold the exit much past the drain)."""
MISSING_EXTRA: Final = (
    "tracing is on (tracing / --tracing) but the OpenTelemetry packages are not installed: "
    "install the tracing extra, pip install 'tokenfair[tracing]' "
    "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"
)

OPERATIONS: Final[Mapping[str, str]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
"""``gen_ai.operation.name`` by route (the semantic conventions' well-known values)."""
KNOWN_ROUTES: Final = frozenset(OPERATIONS) | {"/v1/models"}
"""Routes written as ``http.route``: the proxy's own (a low-cardinality attribute)."""


def check_tracing_available() -> None:
    """:class:`ConfigError` naming the ``tracing`` extra when its packages cannot be imported."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{MISSING_EXTRA} ({exc})") from None


def otlp_tracer_provider(endpoint: str | None) -> TracerProvider:
    """A provider exporting over OTLP/HTTP in batches (``endpoint`` None: the SDK's variables)."""
    check_tracing_available()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the default name.
    resource = Resource.create({"service.name": DEFAULT_SERVICE_NAME}).merge(
        OTELResourceDetector().detect()
    )
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer:
    """Writes the span of each request (see the module docstring) through ``provider``."""

    def __init__(self, provider: TracerProvider, backend_name: str, *, owned: bool) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.owned = owned
        """Shut down by :meth:`close` (False: the caller's, e.g. a test's in-memory one)."""
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        # `gen_ai.provider.name`: the backend registry's (a name it does not hold, as given)
        kind = BACKENDS.get(backend_name)
        self.provider_name = backend_name if kind is None else kind.genai_provider
        self._propagator = TraceContextTextMapPropagator()
        self._server: Any = trace.SpanKind.SERVER
        self._error_status: Any = trace.Status(trace.StatusCode.ERROR)

    def span(
        self,
        fields: Mapping[str, Any],
        *,
        start_ns: int,
        end_ns: int,
        events: list[tuple[str, int, dict[str, Any]]],
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        """Write one finished span: ``fields`` are the access-log fields of the request,
        ``events`` ``(name, wall ns, attributes)`` in time order."""
        route = fields.get("route") or ""
        # A known route names the operation; any other path (chosen by the client, perhaps
        # unauthenticated) must not become a span name or attribute: "request", no http.route.
        operation = OPERATIONS.get(route, "request")
        model = fields.get("model")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": self.provider_name,
            "http.request.method": fields.get("method") or "POST",
            "http.response.status_code": fields["status"],
        }
        if route in KNOWN_ROUTES:
            attributes["http.route"] = route
        optional = (
            ("gen_ai.request.model", model),
            ("gen_ai.request.max_tokens", fields.get("completion_tokens_estimated")),
            ("gen_ai.usage.input_tokens", fields.get("prompt_tokens")),
            ("gen_ai.usage.output_tokens", fields.get("completion_tokens")),
            ("tokenfair.request_id", fields.get("request_id")),
            ("tokenfair.tenant", fields.get("tenant")),
            ("tokenfair.priority_class", fields.get("priority_class")),
            ("tokenfair.reason", fields.get("reason")),
            ("tokenfair.gate", fields.get("gate")),
            ("tokenfair.service_tokens.estimated", fields.get("service_tokens_estimated")),
            ("tokenfair.service_tokens.settled", fields.get("service_tokens_settled")),
            ("tokenfair.queue_wait_ms", fields.get("queue_wait_ms")),
            ("tokenfair.ttft_ms", fields.get("ttft_ms")),
        )
        attributes.update((key, value) for key, value in optional if value is not None)
        status = fields["status"]
        reason = fields.get("reason")
        if status >= 400 and reason and reason != Reason.ADMITTED:
            attributes["error.type"] = reason
        context = None
        if traceparent:
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            context = self._propagator.extract(carrier)
        name = f"{operation} {model}" if isinstance(model, str) and model else operation
        span = self.tracer.start_span(
            name, context=context, kind=self._server, attributes=attributes, start_time=start_ns
        )
        for event, at_ns, event_attributes in events:
            span.add_event(event, event_attributes, timestamp=at_ns)
        if status >= 500:
            span.set_status(self._error_status)
        span.end(end_time=end_ns)

    def request_span(
        self,
        fields: Mapping[str, Any],
        request: Request,
        decision: Decision,
        facts: RequestFacts,
        *,
        start_ms: float,
        now_ms: float,
        now_ns: int,
        time_scale: float,
        scope: RequestScope | None,
    ) -> None:
        """The span of a request that reached admission: its events from its lifecycle's
        times (model ms, read with ``now_ms`` at ``now_ns``), then :meth:`span`."""

        def at(model_ms: float) -> int:
            return wall_ns_of(model_ms, now_ms, now_ns, time_scale)

        admitted_at = at(facts.admission_ms if facts.admission_ms is not None else start_ms)
        events: list[tuple[str, int, dict[str, Any]]] = []
        if facts.queued:
            events.append(("tokenfair.admission", admitted_at,
                           {"tokenfair.admission.result": "queued"}))  # fmt: skip
        else:
            events.append(("tokenfair.admission", admitted_at, {
                "tokenfair.admission.result": "refused",
                "tokenfair.gate": decision.gate,
                "tokenfair.reason": decision.reason,
            }))  # fmt: skip
        if decision.dispatch_ms is not None:
            events.append(("tokenfair.dispatch", at(decision.dispatch_ms),
                           {"tokenfair.queue_wait_ms": fields["queue_wait_ms"]}))  # fmt: skip
            ttft_ms = fields.get("ttft_ms")
            if ttft_ms is not None:  # wall ms after the arrival
                arrival_ns = at(request.arrival_ms)
                events.append(("tokenfair.first_token", arrival_ns + round(ttft_ms * 1e6), {}))
            events.append(("tokenfair.settlement", now_ns, {
                "tokenfair.settlement": facts.settlement or "unknown",
                "tokenfair.service_tokens.settled": fields["service_tokens_settled"],
            }))  # fmt: skip
        elif facts.queued:
            events.append(("tokenfair.left_queue", now_ns, {"tokenfair.reason": fields["reason"]}))
        # In their order, never going back: times converted from two clocks read apart may
        # disagree by a hair.
        for i in range(1, len(events)):
            name, at_ns, event_attributes = events[i]
            events[i] = (name, max(at_ns, events[i - 1][1]), event_attributes)
        self.span(
            fields,
            start_ns=min(at(start_ms), events[0][1]),
            end_ns=now_ns,
            events=events,
            traceparent=None if scope is None else scope.traceparent,
            tracestate=None if scope is None else scope.tracestate,
        )

    async def close(self) -> None:
        """Export what is pending and shut the provider down, waiting at most
        :data:`FLUSH_ON_CLOSE_MS`: the exporter's retries against an unreachable collector
        (up to its own timeout, 10 s by default) must not hold the drain. The shutdown runs on
        a daemon thread of its own, so one still retrying does not keep the process alive."""
        if not self.owned:
            return
        provider = self.provider
        done = threading.Event()

        def shutdown() -> None:
            try:
                provider.shutdown()
            except Exception:
                log.exception("tracing: shutting the exporter down failed")
            finally:
                done.set()

        threading.Thread(target=shutdown, name="tokenfair-tracing-shutdown", daemon=True).start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_ON_CLOSE_MS / 1000.0
        while not done.is_set() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if not done.is_set():
            log.warning("tracing: the last spans were not exported within %d ms; dropped",
                        FLUSH_ON_CLOSE_MS)  # fmt: skip


def wall_ns_of(model_ms: float, now_model_ms: float, now_wall_ns: int, time_scale: float) -> int:
    """The wall-clock time (ns since the epoch) of a model time, given a pair read together."""
    return now_wall_ns - round((now_model_ms - model_ms) * time_scale * 1_000_000)
