"""The tenant limits beside the budget through the live sidecar (aiohttp test server, costmodel
backend): a request held by its tenant's ``maxConcurrentRequests`` while another tenant is
served at once, that expires with ``429 shed_tenant_concurrency`` and the limit's headers; a
request above its tenant's ``maxKvShare`` of the pool answered ``400
request_over_tenant_kv_share`` before admission. The records name the limit. Books end at
zero."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from sidecar_support import (
    CHAT,
    IDE,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    lesson_tenants_with_keys,
    records_of,
    start,
    wait_for,
)

from tokenfair.config import Config, PolicyConfig, build_config
from tokenfair.server.runtime_settings import SidecarSettings

pytestmark = pytest.mark.virtual_time

# A batching engine (4 slots): a request that finds a slot free is predicted to wait 0, so the
# held one is admitted, and only its tenant's limit keeps it from starting.
POLICY = PolicyConfig(max_interactive_wait_ms=300.0, max_batch_requests=4)


def limited_config(policy: PolicyConfig = POLICY, **chat_limits: object) -> Config:
    tenants = [
        replace(t, **chat_limits) if t.tenant_id == "tenant_chat_pro" else t  # type: ignore[arg-type]
        for t in lesson_tenants_with_keys()
    ]
    return build_config(policy, tenants, "test-limits")


async def test_a_request_held_by_its_concurrency_limit_waits_then_gets_429(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    config = limited_config(max_concurrent_requests=1)
    settings = SidecarSettings(
        time_scale=1.0, max_in_flight=4, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, config, settings)
    proxy, sidecar = clients.proxy, clients.sidecar
    # 8000 + 4 x 8000 = 40000 service tokens (within the burst): ~0.9 model s alone at 45 per ms,
    # far past the 300 ms the held request may wait, whatever the machine's speed.
    long = asyncio.create_task(
        proxy.post(
            "/v1/completions", json=completion_body(8000, 8000), headers={"Authorization": CHAT}
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    held = asyncio.create_task(
        proxy.post("/v1/completions", json=completion_body(10, 4), headers={"Authorization": CHAT})
    )
    assert await wait_for(lambda: sidecar.scheduler.queued_total == 1)
    # Another tenant is not delayed by the held request: it is served while that one waits.
    other = await proxy.post(
        "/v1/completions", json=completion_body(10, 4), headers={"Authorization": IDE}
    )
    assert other.status == 200
    assert not held.done()
    answer = await held
    assert answer.status == 429
    error = (await answer.json())["error"]
    assert error["tokenfair_reason"] == "shed_tenant_concurrency"
    assert error["type"] == "requests"
    assert "max_concurrent_requests=1" in error["message"]
    assert answer.headers["x-tokenfair-limit-concurrent-requests"] == "1"
    assert answer.headers["x-tokenfair-running-requests"] == "1"
    assert int(answer.headers["retry-after-ms"]) >= 1
    assert float(answer.headers["x-tokenfair-queue-wait-ms"]) >= 300.0
    assert (await long).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    (record,) = [r for r in records_of(sidecar) if r["reason"] == "shed_tenant_concurrency"]
    assert (record["gate"], record["status_code"]) == ("queue", 429)
    assert record["observed"]["max_concurrent_requests"] == 1


async def test_a_request_above_its_tenants_kv_share_gets_400(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # 1600 blocks of 16 tokens; a tenth is 160 blocks = 2560 tokens.
    # Waits long enough that a loaded machine's event-loop lag never expires the served ones.
    config = limited_config(replace(POLICY, max_interactive_wait_ms=60_000.0), max_kv_share=0.1)
    settings = SidecarSettings(time_scale=0.01, records_path=str(tmp_path / "records.jsonl"))
    clients = await start(aiohttp_client, config, settings)
    proxy, sidecar = clients.proxy, clients.sidecar
    answer = await proxy.post(
        "/v1/completions", json=completion_body(2000, 1000), headers={"Authorization": CHAT}
    )
    assert answer.status == 400
    error = (await answer.json())["error"]
    assert error["code"] == "request_over_tenant_kv_share"
    assert "at most 160 (maxKvShare)" in error["message"]
    # Within the share, and for another tenant at any size the cache takes, it is served.
    small = await proxy.post(
        "/v1/completions", json=completion_body(1000, 500), headers={"Authorization": CHAT}
    )
    assert small.status == 200
    other = await proxy.post(
        "/v1/completions", json=completion_body(2000, 1000), headers={"Authorization": IDE}
    )
    assert other.status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    (record,) = [r for r in records_of(sidecar) if r["status_code"] == 400]
    assert record["reason"] == "request_over_tenant_kv_share"


async def test_held_requests_start_as_their_tenants_running_ones_end(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    """With waits long enough, every request held by ``maxConcurrentRequests`` is served once
    the one running ends (the dispatcher is woken by the end), never two at once, and the
    records of those that waited say which limit held them."""
    policy = replace(POLICY, max_interactive_wait_ms=60_000.0)
    tenants = [
        replace(t, max_concurrent_requests=1) if t.tenant_id == "tenant_chat_pro" else t
        for t in lesson_tenants_with_keys()
    ]
    settings = SidecarSettings(
        time_scale=0.01, max_in_flight=4, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, build_config(policy, tenants, "t"), settings)
    proxy, sidecar = clients.proxy, clients.sidecar
    answers = await asyncio.gather(
        *(
            proxy.post(
                "/v1/completions", json=completion_body(200, 50), headers={"Authorization": CHAT}
            )
            for _ in range(4)
        )
    )
    assert [a.status for a in answers] == [200] * 4
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    # Never two at once: on virtual time each request runs from its dispatch to its end
    # (arrival + e2e, settled in the same instant) and the next starts no sooner.
    runs = sorted((r["dispatch_ms"], r["arrival_ms"] + r["e2e_ms"]) for r in records_of(sidecar))
    assert len(runs) == 4
    for (_, end), (start_next, _) in itertools.pairwise(runs):
        assert start_next >= end - 0.01, runs
    held = [r for r in records_of(sidecar) if "held_by_max_concurrent_requests" in r["observed"]]
    assert len(held) >= 1
