"""OpenTelemetry tracing of the sidecar, through the real SDK (in-memory exporter) and the real
OTLP/HTTP exporter.

* One span per request, refusals and requests answered before admission included; its name and
  GenAI attributes (``gen_ai.operation.name``, ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens`` /
  ``output_tokens``), ``error.type`` for failures, kind SERVER, the client's ``traceparent``
  as parent; events ``tokenfair.admission``, ``tokenfair.dispatch``,
  ``tokenfair.first_token``, ``tokenfair.settlement`` in time order inside the span
  (``tokenfair.admission`` alone for a refusal at the door, ``tokenfair.left_queue`` for a
  request that left the queue without running).
* Tracing off: no tracer, nothing done per request.
* The OTLP exporter posts the spans (protobuf) to the configured endpoint, flushed at shutdown.
* Tracing asked for without the ``tracing`` extra: a start-up ``ConfigError`` naming it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    start,
    wait_for,
)

from tokenfair.config import ConfigError, PolicyConfig
from tokenfair.core.cost import CostModel
from tokenfair.server import create_app, make_backend
from tokenfair.server.runtime_settings import SidecarSettings

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


@pytest.fixture
def exporter() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield provider, memory
    provider.shutdown()


def event_names(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


async def test_one_span_per_request_with_genai_attributes_and_lifecycle_events(
    aiohttp_client: ClientFactory, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, memory = exporter
    # Burst 5000: the second 4000-token request is refused at the door (see test_sidecar_app).
    config = keyed_config(
        PolicyConfig(), burst_service_tokens=5000, sustained_service_tokens_per_second=1000.0
    )
    settings = SidecarSettings(time_scale=1.0, tracing=True)
    clients = await start(aiohttp_client, config, settings, tracer_provider=provider)
    proxy = clients.proxy
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    body = completion_body(1000, 750)
    served = await proxy.post(
        "/v1/completions", json=body, headers={"Authorization": CHAT, "traceparent": traceparent}
    )
    assert served.status == 200
    await served.read()
    refused = await proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert refused.status == 429
    unauthenticated = await proxy.post("/v1/chat/completions", json=body)
    assert unauthenticated.status == 401
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS

    spans = memory.get_finished_spans()
    assert len(spans) == 3  # one per request, refusals included
    ok, shed, invalid = spans

    assert ok.name == "text_completion m"
    assert ok.kind is SpanKind.SERVER
    assert ok.context is not None
    assert ok.parent is not None
    assert format(ok.context.trace_id, "032x") == TRACE_ID  # joined the client's trace
    assert format(ok.parent.span_id, "016x") == PARENT_SPAN_ID
    attributes = dict(ok.attributes or {})
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.provider.name"] == "tokenfair.costmodel"
    assert attributes["gen_ai.request.model"] == "m"
    assert attributes["gen_ai.request.max_tokens"] == 750
    assert attributes["gen_ai.usage.input_tokens"] == 1000
    assert attributes["gen_ai.usage.output_tokens"] == 750
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/v1/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["tokenfair.request_id"] == served.headers["x-request-id"]
    assert attributes["tokenfair.tenant"] == "tenant_chat_pro"
    assert attributes["tokenfair.priority_class"] == "interactive"
    assert attributes["tokenfair.reason"] == "admitted"
    assert attributes["tokenfair.service_tokens.estimated"] == 4000
    assert attributes["tokenfair.service_tokens.settled"] == 4000
    assert "error.type" not in attributes
    assert ok.status.status_code is StatusCode.UNSET
    assert event_names(ok) == [
        "tokenfair.admission", "tokenfair.dispatch", "tokenfair.first_token",
        "tokenfair.settlement",
    ]  # fmt: skip
    times = [event.timestamp for event in ok.events]
    assert ok.start_time is not None
    assert ok.end_time is not None
    assert ok.start_time <= times[0] <= times[1] <= times[2] <= times[3] <= ok.end_time
    # The engine ran ~89 ms for 4000 service tokens: the first token comes after that much.
    assert times[2] - times[1] >= 50_000_000
    assert dict(ok.events[0].attributes or {}) == {"tokenfair.admission.result": "queued"}
    settlement = dict(ok.events[3].attributes or {})
    assert settlement == {
        "tokenfair.settlement": "as_reported", "tokenfair.service_tokens.settled": 4000,
    }  # fmt: skip

    assert shed.name == "text_completion"  # never ran: no model
    assert shed.parent is None
    attributes = dict(shed.attributes or {})
    assert attributes["http.response.status_code"] == 429
    assert attributes["error.type"] == "shed_tenant_token_quota"
    assert attributes["tokenfair.gate"] == "admission"
    assert attributes["tokenfair.service_tokens.settled"] == 0
    assert "gen_ai.usage.input_tokens" not in attributes
    assert shed.status.status_code is StatusCode.UNSET  # a 4xx is the client's, not an error
    assert event_names(shed) == ["tokenfair.admission"]
    assert dict(shed.events[0].attributes or {}) == {
        "tokenfair.admission.result": "refused", "tokenfair.gate": "admission",
        "tokenfair.reason": "shed_tenant_token_quota",
    }  # fmt: skip

    assert invalid.name == "chat"
    attributes = dict(invalid.attributes or {})
    assert attributes["http.response.status_code"] == 401
    assert attributes["error.type"] == "invalid_api_key"
    assert "tokenfair.tenant" not in attributes
    assert event_names(invalid) == []


async def test_a_request_that_leaves_the_queue_has_a_left_queue_event(
    aiohttp_client: ClientFactory, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, memory = exporter
    clients = await start(
        aiohttp_client,
        keyed_config(),
        SidecarSettings(time_scale=1.0, max_in_flight=1, tracing=True),
        tracer_provider=provider,
    )
    proxy, sidecar = clients.proxy, clients.sidecar
    # The first request holds the one slot until the test lets it go: the second is queued
    # behind it however fast or slow this machine is.
    gate = asyncio.Event()
    respond = sidecar.backend.respond

    async def held(call: Any) -> Any:
        await gate.wait()
        return await respond(call)

    sidecar.backend.respond = held  # type: ignore[method-assign]
    running = asyncio.create_task(proxy.post(
        "/v1/completions", json=completion_body(1000, 750), headers={"Authorization": CHAT}
    ))  # fmt: skip
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    leaving = asyncio.create_task(proxy.post(
        "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
    ))  # fmt: skip
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 1)
    leaving.cancel()  # the client goes away while queued
    with pytest.raises(asyncio.CancelledError):
        await leaving
    # The server learns of the closed connection a loop turn or more later (later still on a
    # loaded machine): release the slot only once the request has left the queue, or the
    # dispatcher may start it first and it leaves while running instead.
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 0, budget_s=30)
    gate.set()
    assert (await running).status == 200
    assert await books_when_settled(sidecar, budget_s=30) == ZERO_BOOKS
    # A span ends when its request's handler finishes writing it, after the books settle.
    assert await wait_for(lambda: len(memory.get_finished_spans()) == 2, budget_s=30)
    spans = memory.get_finished_spans()
    (left,) = [s for s in spans if dict(s.attributes or {})["http.response.status_code"] == 499]
    assert event_names(left) == ["tokenfair.admission", "tokenfair.left_queue"]
    assert dict(left.events[1].attributes or {}) == {"tokenfair.reason": "cancelled"}


async def test_tracing_off_makes_no_tracer(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, keyed_config())
    assert clients.sidecar.outcomes.tracer is None
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 2), headers={"Authorization": CHAT}
    )
    assert response.status == 200


async def test_the_otlp_exporter_posts_the_spans_to_the_endpoint(
    aiohttp_client: ClientFactory,
) -> None:
    received: list[ExportTraceServiceRequest] = []

    async def collect(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector_app = web.Application()
    collector_app.router.add_post("/v1/traces", collect)
    collector = await aiohttp_client(collector_app)
    endpoint = str(collector.make_url("/v1/traces"))
    settings = SidecarSettings(time_scale=0.01, tracing=True, tracing_endpoint=endpoint)
    clients = await start(aiohttp_client, keyed_config(), settings)
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": CHAT},
    )
    assert response.status == 200
    await clients.proxy.close()  # the app's cleanup flushes and shuts the exporter down
    spans = [
        span
        for message in received
        for resource_spans in message.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    assert [span.name for span in spans] == ["chat x"]
    resource = {
        a.key: a.value.string_value for a in received[0].resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "tokenfair-sidecar"


def test_tracing_without_the_extra_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # What an install without the `tracing` extra looks like to the import system.
    for name in list(sys.modules):
        if name.startswith("opentelemetry.sdk") or name.startswith("opentelemetry.exporter"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter", None)
    settings = SidecarSettings(tracing=True)
    config = keyed_config()
    backend = make_backend(settings, CostModel.from_policy(config.policy))
    with pytest.raises(
        ConfigError, match=r"install the tracing extra, pip install 'tokenfair\[tracing\]'"
    ):
        create_app(settings, config, backend)
