"""The sidecar app over real HTTP on loopback (aiohttp test server, costmodel backend).

Behaviours: API-key authentication (401 without/with an unknown key, trusted tenant header only
when enabled), lowering the class by header (never raising it), OpenAI-compatible answers with
usage and SSE streaming, bad input (malformed JSON, oversized body, invalid max_tokens, unknown
route) never leaking a reservation, refusals as 429 in OpenAI's shape (``code:
rate_limit_exceeded``) with the gate's reason in ``tokenfair_reason``, a Retry-After and a
retry-after-ms derived from the gate, rate-limit headers in usage tokens (converted with the
request's own mix) beside the exact service-token view, queue expiry, a client leaving the queue,
the admin endpoints and per-app metrics (queue wait per tenant and lane); the
``x-tokenfair-queue-wait-ms`` header (the recorded queue wait in wall ms, on served answers and
on expiry 429s) and request ids that end in a valid client ``x-request-id`` yet stay unique when
a client reuses its id. Every test ends with the scheduler's books at zero.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sidecar_support import (
    BATCH,
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    one_running_one_queued,
    records_of,
    start,
    wait_for,
)

from tokenfair import native
from tokenfair.config import PolicyConfig, build_config
from tokenfair.records.codec import read_trace
from tokenfair.server.reload import apply_config
from tokenfair.server.runtime_settings import LoadedFile, SidecarSettings

CHAT_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 8,
}


def error_code(payload: dict[str, Any]) -> str:
    code: str = payload["error"]["code"]
    return code


def refusal_reason(payload: dict[str, Any]) -> str:
    """A 429's gate reason: OpenAI's ``code`` is ``rate_limit_exceeded``, ours is beside it."""
    error = payload["error"]
    assert (error["code"], error["param"]) == ("rate_limit_exceeded", None)
    reason: str = error["tokenfair_reason"]
    assert error["type"] == ("tokens" if reason == "shed_tenant_token_quota" else "requests")
    return reason


async def test_unauthenticated_requests_get_401_and_valid_keys_are_served(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, keyed_config())
    proxy = clients.proxy
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": "Basic x"}):
        response = await proxy.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
        assert response.status == 401
        assert error_code(await response.json()) == "invalid_api_key"
    # The trusted header names a tenant only when the mode is on; here it is off.
    response = await proxy.post(
        "/v1/chat/completions", json=CHAT_BODY, headers={"x-tokenfair-tenant": "tenant_chat_pro"}
    )
    assert response.status == 401
    response = await proxy.post(
        "/v1/chat/completions", json=CHAT_BODY, headers={"Authorization": CHAT}
    )
    assert response.status == 200
    payload = await response.json()
    # "hello there" is 11 characters: ceil(11 / 4) = 3 tokens + 4 framing tokens per message.
    assert payload["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    assert payload["object"] == "chat.completion"
    assert len(payload["choices"][0]["message"]["content"].split()) == 8
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_trusted_tenant_header_when_enabled(aiohttp_client: ClientFactory) -> None:
    settings = SidecarSettings(time_scale=0.01, trusted_tenant_header="x-tokenfair-tenant")
    clients = await start(aiohttp_client, keyed_config(), settings)
    response = await clients.proxy.post(
        "/v1/completions",
        json=completion_body(10, 5),
        headers={"x-tokenfair-tenant": "tenant_ide_assist"},
    )
    assert response.status == 200
    assert clients.sidecar.outcomes.tenant_counts["tenant_ide_assist"]["served"] == 1
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 5), headers={"x-tokenfair-tenant": "nobody"}
    )
    assert response.status == 401


async def test_priority_header_may_lower_the_class_never_raise_it(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, keyed_config())
    proxy = clients.proxy
    response = await proxy.post(
        "/v1/completions",
        json=completion_body(10, 5),
        headers={"Authorization": BATCH, "x-tokenfair-priority": "interactive"},
    )
    assert response.status == 400
    payload = await response.json()
    assert payload["error"]["param"] == "x-tokenfair-priority"
    response = await proxy.post(
        "/v1/completions",
        json=completion_body(10, 5),
        headers={"Authorization": CHAT, "x-tokenfair-priority": "batch"},
    )
    assert response.status == 200
    assert clients.sidecar.metrics.series[("tenant_chat_pro", "batch")].admitted == 1
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (json.dumps(completion_body(1, 0)).encode(), 400, "invalid_value", "max_tokens"),
        (json.dumps(completion_body(1, True)).encode(), 400, "invalid_value", "max_tokens"),
        (json.dumps(completion_body(1, 8193)).encode(), 400, "invalid_value", "max_tokens"),
        (
            json.dumps({"prompt": "x", "max_completion_tokens": "9"}).encode(),
            400,
            "invalid_value",
            "max_completion_tokens",
        ),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "invalid_value", "stream"),
        (json.dumps({"messages": "hi"}).encode(), 400, "invalid_value", "messages"),
        (json.dumps({"prompt": "x" * 2048}).encode(), 413, "request_too_large", None),
    ],
)
async def test_bad_input_is_refused_without_leaking(
    aiohttp_client: ClientFactory, body: bytes, status: int, code: str, param: str | None
) -> None:
    settings = SidecarSettings(time_scale=0.01, max_body_bytes=1024)
    clients = await start(aiohttp_client, keyed_config(), settings)
    response = await clients.proxy.post(
        "/v1/completions", data=body, headers={"Authorization": CHAT}
    )
    assert response.status == status
    payload = await response.json()
    assert error_code(payload) == code
    assert payload["error"]["param"] == param
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS
    # Nothing broke: the next request is served.
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1, 1), headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_unknown_routes_are_404_and_admin_routes_are_not_on_the_proxy(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, keyed_config())
    for path in ("/v1/embeddings", "/metrics", "/status", "/healthz"):
        response = await clients.proxy.get(path)
        assert response.status == 404
        assert error_code(await response.json()) == "not_found"
    assert (await clients.admin.get("/healthz")).status == 200
    assert (await clients.admin.get("/readyz")).status == 200


async def test_streaming_sends_sse_chunks_usage_and_done(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, keyed_config())
    body = {
        **CHAT_BODY,
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await clients.proxy.post(
        "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    text = await response.text()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # 40 tokens in at most 16 chunks: ceil(40 / 16) = 3 words per chunk -> 14 chunks.
    content = [c for c in chunks if c["choices"]]
    assert len(content) == 14
    words = "".join(c["choices"][0]["delta"]["content"] for c in content).split()
    assert len(words) == 40
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 40, "total_tokens": 47}
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_budget_refusal_derives_retry_after_and_ratelimit_headers(
    aiohttp_client: ClientFactory,
) -> None:
    # Burst 5000, refill 1000 tokens/s; each request is 1000 + 4 * 750 = 4000 service tokens.
    # The lesson's policy: interactive requests may wait 420 ms.
    config = keyed_config(
        PolicyConfig(), burst_service_tokens=5000, sustained_service_tokens_per_second=1000.0
    )
    clients = await start(aiohttp_client, config, SidecarSettings(time_scale=1.0))
    proxy = clients.proxy
    body = completion_body(1000, 750)
    first = await proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert first.status == 200
    second = await proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert second.status == 429
    assert refusal_reason(await second.json()) == "shed_tenant_token_quota"
    # After the first dispatch the bucket held 5000 - 4000 = 1000 and refills 1 token/ms; e ms
    # later the second needs (4000 - 1000 - e) ms of refill, minus the 420 ms it may wait:
    # retry = 2580 - e ms, so Retry-After = 3 s for any e below 580 ms (the first ran ~98 ms),
    # and retry-after-ms is the same wait to the millisecond (ceil).
    assert second.headers["Retry-After"] == "3"
    assert 2000 < int(second.headers["retry-after-ms"]) <= 2580
    # The exact bucket in service tokens: burst 5000, level 1000 + e.
    assert second.headers["x-tokenfair-ratelimit-limit-service-tokens"] == "5000"
    remaining = int(second.headers["x-tokenfair-ratelimit-remaining-service-tokens"])
    assert 1000 <= remaining < 1580
    # OpenAI's names in usage tokens, with this request's mix: (1000 + 750) / 4000 = 0.4375.
    assert second.headers["x-ratelimit-limit-tokens"] == "2187"  # floor(5000 * 0.4375)
    usage_remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert remaining * 1750 // 4000 <= usage_remaining <= (remaining + 1) * 1750 // 4000
    reset = second.headers["x-tokenfair-ratelimit-reset-service-tokens"]
    assert second.headers["x-ratelimit-reset-tokens"] == reset
    assert "RateLimit" not in second.headers  # the IETF fields are off by default
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_oversized_requests_are_shed_at_the_kv_gate(aiohttp_client: ClientFactory) -> None:
    # 100 KV blocks of 16 tokens; interactive watermark 0.9 -> at most 90 blocks = 1440 tokens.
    # 1400 + 100 tokens need ceil(1500 / 16) = 94 blocks: no state of the cache could hold
    # them, so it is a 400 (not retried by SDKs), recorded and counted with its own reason.
    policy = PolicyConfig(total_kv_blocks=100)
    clients = await start(aiohttp_client, keyed_config(policy))
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1400, 100), headers={"Authorization": CHAT}
    )
    assert response.status == 400
    payload = await response.json()
    assert error_code(payload) == "request_over_kv_capacity"
    assert "needs 94 KV blocks" in payload["error"]["message"]
    assert "at most 90" in payload["error"]["message"]
    assert "Retry-After" not in response.headers
    assert clients.sidecar.outcomes.tenant_counts["tenant_chat_pro"]["refused"] == 1
    # 1300 + 100 tokens need 88 blocks: it fits an empty cache, so a refusal is only "not now".
    # Here the cache is empty: it is served.
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1300, 100), headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_queue_full_expiry_and_cancellation(aiohttp_client: ClientFactory) -> None:
    # KV stays resident only as long as the request runs (factor 1), to keep the test short.
    policy = PolicyConfig(
        max_queued_requests=1,
        max_queued_requests_per_tenant=1,
        max_interactive_wait_ms=60_000,
        kv_residency_factor=1.0,
    )
    # time_scale 10: a 4000-token request runs 4000 / 45 = 89 model ms = 0.89 s of real time.
    clients = await start(
        aiohttp_client, keyed_config(policy), SidecarSettings(time_scale=10.0, max_in_flight=1)
    )
    proxy, sidecar = clients.proxy, clients.sidecar
    long, queued = await one_running_one_queued(proxy, sidecar)
    full = await proxy.post(
        "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
    )
    assert full.status == 429
    assert refusal_reason(await full.json()) == "queue_full"
    # The queued client goes away: it leaves the queue and its reservation with it.
    queued.cancel()
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 0)
    assert sidecar.outcomes.tenant_counts["tenant_chat_pro"]["cancelled"] == 1
    assert (await long).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS


async def test_queued_request_past_its_wait_limit_gets_429(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # Interactive requests may wait 1000 model ms (time_scale 1: real ms). The running one costs
    # 4000 + 4 * 4000 = 20000 service tokens (444 ms); the one behind it (1000 + 4 = 1004) is
    # admitted: it would start after those 444 ms. Then a reload cuts its tenant's burst to 500,
    # below its cost, so no refill can ever cover it: a prediction proved wrong, and it expires
    # when its 1000 ms are up (the reload has 444 ms to land first, ample on a busy machine).
    policy = PolicyConfig(max_interactive_wait_ms=1000)
    config = keyed_config(policy)
    settings = SidecarSettings(
        time_scale=1.0, max_in_flight=1, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, config, settings)
    proxy, sidecar = clients.proxy, clients.sidecar
    long = asyncio.create_task(
        proxy.post(
            "/v1/completions", json=completion_body(4000, 4000), headers={"Authorization": CHAT}
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    late = asyncio.create_task(
        proxy.post(
            "/v1/completions", json=completion_body(1000, 1), headers={"Authorization": CHAT}
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.queued_total == 1)
    shrunk = [
        replace(t, burst_service_tokens=500) if t.tenant_id == "tenant_chat_pro" else t
        for t in config.tenants
    ]
    apply_config(sidecar, LoadedFile(build_config(policy, shrunk, "test-2"), {}, "2"))
    answer = await late
    assert answer.status == 429
    assert refusal_reason(await answer.json()) == "shed_queue_timeout"
    assert float(answer.headers["x-tokenfair-queue-wait-ms"]) >= 1000.0
    assert (await long).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    # The record says the wait the client was told (time_scale 1: model ms are real ms).
    (expired,) = [r for r in records_of(sidecar) if r["reason"] == "shed_queue_timeout"]
    assert expired["retry_after_ms"] > 0
    assert math.ceil(expired["retry_after_ms"]) == int(answer.headers["retry-after-ms"])


async def test_status_and_metrics_report_books_and_counters(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, keyed_config())
    for _ in range(3):
        response = await clients.proxy.post(
            "/v1/completions", json=completion_body(100, 10), headers={"Authorization": CHAT}
        )
        assert response.status == 200
    await clients.proxy.post("/v1/completions", json=completion_body(1, 1))  # 401
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    status = await (await clients.admin.get("/status")).json()
    assert status["core"] == ("compiled" if native.status().active else "interpreted")
    assert status["books"] == {
        "queued_requests": 0,
        "queued_service_tokens": 0,
        "queued_kv_blocks": 0,
        "running_requests": 0,
        "resident_kv_blocks": 0,
    }
    chat = status["tenants"]["tenant_chat_pro"]
    assert chat["counts"] == {"admitted": 3, "served": 3}
    # 3 requests of 100 + 4 * 10 = 140 service tokens each.
    assert chat["served_service_tokens"] == 420
    assert status["config"]["version"] == "test-1"
    text = await (await clients.admin.get("/metrics")).text()
    assert (
        'tokenfair_admitted_requests_total{lane="interactive",tenant="tenant_chat_pro"} 3.0' in text
    )
    estimated = (
        'tokenfair_estimated_service_tokens_total{lane="interactive",tenant="tenant_chat_pro"}'
    )
    assert f"{estimated} 420.0" in text
    assert 'tokenfair_invalid_requests_total{status="401"} 1.0' in text
    assert 'tokenfair_ttft_seconds_count{lane="interactive"} 3.0' in text
    # Queue wait is per tenant and lane (the operator's per-tenant p99 reads it).
    wait = 'tokenfair_queue_wait_seconds_count{lane="interactive",tenant="tenant_chat_pro"}'
    assert f"{wait} 3.0" in text
    assert 'tokenfair_queued_requests{lane="batch"} 0.0' in text
    assert 'tokenfair_config_info{sha256="",version="test-1"} 1.0' in text


async def test_request_id_and_queue_wait_headers(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # KV held only while running (factor 1); queued requests may wait 60 model s. At time_scale 10
    # a 1000 + 4 * 750 = 4000-token request runs 4000 / 45 = 89 model ms = 0.89 s real.
    policy = PolicyConfig(max_interactive_wait_ms=60_000, kv_residency_factor=1.0)
    records = tmp_path / "records.jsonl"
    settings = SidecarSettings(time_scale=10.0, max_in_flight=1, records_path=str(records))
    clients = await start(aiohttp_client, keyed_config(policy), settings)
    proxy, sidecar = clients.proxy, clients.sidecar

    def post(request_id: str | None, prompt_tokens: int, max_tokens: int) -> Any:
        headers = {"Authorization": CHAT}
        if request_id is not None:
            headers["x-request-id"] = request_id
        return proxy.post(
            "/v1/completions", json=completion_body(prompt_tokens, max_tokens), headers=headers
        )

    long = asyncio.create_task(post("tenant_chat_pro-000001", 1000, 750))
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    # The same client id while the first runs: both are accepted, each under its own id.
    twin = asyncio.create_task(post("tenant_chat_pro-000001", 10, 10))
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 1)
    long_response, twin_response = await long, await twin
    assert (long_response.status, twin_response.status) == (200, 200)
    long_id, twin_id = long_response.headers["x-request-id"], twin_response.headers["x-request-id"]
    assert long_id.endswith("-tenant_chat_pro-000001")
    assert twin_id.endswith("-tenant_chat_pro-000001")
    assert long_id != twin_id
    # Not valid (a space; 129 characters; empty; a slash): a generated id without it.
    for bad in ("has space", "a" * 129, "", "a/b"):
        response = await post(bad, 1, 1)
        assert response.status == 200
        assert not response.headers["x-request-id"].endswith(f"-{bad}")
        assert response.headers["x-request-id"] not in (long_id, twin_id)
    # Reused after the first finished: still a new, unique id.
    again = await post("tenant_chat_pro-000001", 1, 1)
    assert again.headers["x-request-id"].endswith("-tenant_chat_pro-000001")
    assert again.headers["x-request-id"] not in (long_id, twin_id)
    assert await books_when_settled(sidecar) == ZERO_BOOKS

    # The header is the recorded queue wait (model ms) times time_scale (10 real ms per model
    # ms), to 3 decimals; the twin waited behind the 89 model ms request.
    assert sidecar.outcomes.record_writer is not None
    sidecar.outcomes.record_writer.flush()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in records.read_text().splitlines():
        record = json.loads(line)
        by_id.setdefault(record["request_id"], []).append(record)
    # One record per id (so the file replays), three of them carrying the client's id.
    assert all(len(rows) == 1 for rows in by_id.values())
    assert sum(1 for rid in by_id if rid.endswith("-tenant_chat_pro-000001")) == 3
    assert len(read_trace(records)) == len(by_id)
    twin_wait_ms = by_id[twin_id][0]["queue_wait_ms"]
    assert twin_wait_ms > 0
    assert twin_response.headers["x-tokenfair-queue-wait-ms"] == f"{twin_wait_ms * 10:.3f}"
    long_wait_ms = by_id[long_id][0]["queue_wait_ms"]
    assert long_response.headers["x-tokenfair-queue-wait-ms"] == f"{long_wait_ms * 10:.3f}"
