"""Shadow mode live through the sidecar: real HTTP over loopback, the cost-model backend.

Behaviours: one request sequence under ``Enforce`` and under ``Shadow`` gives the same
decisions in the records — each ``429``/``400`` of Enforce is a ``200`` record with the same
reason and gate and ``would_refuse: true`` under Shadow, and the client got its answer; Shadow
refuses nothing; ``tokenfair_shadow_refusals_total`` counts them by reason; the books end at
zero (served beside them). A reload from Enforce to Shadow while a request waits in the queue
drops nothing, and the next refusal is served.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from sidecar_support import (
    CHAT,
    IDE,
    PATIENT_POLICY,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    one_running_one_queued,
    records_of,
    start,
)

from tokenfair.config import Config, PolicyConfig, build_config
from tokenfair.config.document import Enforcement
from tokenfair.server import LoadedFile
from tokenfair.server.reload import apply_config
from tokenfair.server.runtime_settings import SidecarSettings

# chat: burst 5000 service tokens, refilled at 0.001 a second (never, within a test). Each
# 1000 + 4 * 250 = 2000-token request is charged at dispatch: two fit, the third is refused
# shed_tenant_token_quota, and one of 5004 tokens can never fit (400 over burst). ide is not
# limited and is served throughout.
SEQUENCE: list[tuple[str, int, int]] = [
    (CHAT, 1000, 250),
    (IDE, 100, 20),
    (CHAT, 1000, 250),
    (CHAT, 1000, 250),
    (IDE, 100, 20),
    (CHAT, 1000, 1001),
    (CHAT, 1000, 250),
    (IDE, 100, 20),
]


def tight_config(policy: PolicyConfig) -> Config:
    base = keyed_config(policy)
    tenants = [
        replace(t, burst_service_tokens=5000, sustained_service_tokens_per_second=0.001)
        if t.tenant_id == "tenant_chat_pro"
        else t
        for t in base.tenants
    ]
    return build_config(policy, tenants, "test-1")


async def run_sequence(
    aiohttp_client: ClientFactory, tmp_path: Path, enforcement: Enforcement
) -> tuple[list[int], list[dict[str, Any]], str]:
    path = tmp_path / f"{enforcement}.jsonl"
    settings = SidecarSettings(time_scale=0.01, records_path=str(path))
    policy = replace(PATIENT_POLICY, enforcement=enforcement)
    clients = await start(aiohttp_client, tight_config(policy), settings)
    statuses = []
    for authorization, prompt, output in SEQUENCE:  # one at a time: no timing in the decisions
        response = await clients.proxy.post(
            "/v1/completions",
            json=completion_body(prompt, output),
            headers={"Authorization": authorization},
        )
        await response.read()
        statuses.append(response.status)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    status = await (await clients.admin.get("/status")).json()
    assert status["enforcement"] == enforcement
    # (two refusals for the budget and one over the burst)
    assert status["tenants"]["tenant_chat_pro"]["counts"].get("would_refuse", 0) == (
        3 if enforcement == "Shadow" else 0
    )
    metrics = await (await clients.admin.get("/metrics")).text()
    return statuses, records_of(clients.sidecar), metrics


async def test_shadow_records_the_decisions_of_enforce_and_refuses_nothing(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    enforced_status, enforced, enforced_metrics = await run_sequence(
        aiohttp_client, tmp_path, "Enforce"
    )
    shadow_status, shadowed, shadow_metrics = await run_sequence(aiohttp_client, tmp_path, "Shadow")
    assert enforced_status == [200, 200, 200, 429, 200, 400, 429, 200]
    assert shadow_status == [200] * len(SEQUENCE)
    assert len(enforced) == len(shadowed) == len(SEQUENCE)
    for enforce, shadow in zip(enforced, shadowed, strict=True):
        assert (shadow["reason"], shadow["gate"]) == (enforce["reason"], enforce["gate"])
        if enforce["status_code"] == 200:
            assert "would_refuse" not in shadow
            assert "would_refuse" not in enforce
        else:
            assert shadow["would_refuse"] is True
            assert shadow["status_code"] == 200
            # (the values their gate saw: the same keys; a bucket's level moves with real time)
            assert shadow["observed"].keys() == enforce["observed"].keys()
            assert shadow["dispatch_ms"] is not None  # it ran
            assert shadow["actual_service_tokens"] is not None
    reasons = [r["reason"] for r in shadowed if r.get("would_refuse")]
    assert reasons == ["shed_tenant_token_quota", "request_over_tenant_burst",
                       "shed_tenant_token_quota"]  # fmt: skip
    assert "tokenfair_shadow_refusals_total{" not in enforced_metrics
    assert (
        'tokenfair_shadow_refusals_total{lane="interactive",reason="shed_tenant_token_quota",'
        'tenant="tenant_chat_pro"} 2' in shadow_metrics
    )
    assert "tokenfair_refused_requests_total{" not in shadow_metrics


async def test_a_reload_to_shadow_drops_nothing_queued(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # One request runs (0.89 s real at time_scale 10), one waits (max_in_flight 1); per-tenant
    # queue bound 1: a third is queue_full under Enforce. The switch to Shadow keeps the
    # waiting one, and the next request the bound refuses is served.
    policy = replace(PATIENT_POLICY, max_queued_requests_per_tenant=1)
    settings = SidecarSettings(
        time_scale=10.0, max_in_flight=1, records_path=str(tmp_path / "r.jsonl")
    )
    clients = await start(aiohttp_client, keyed_config(policy), settings)
    sidecar = clients.sidecar
    running, queued = await one_running_one_queued(clients.proxy, sidecar)
    refused = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
    )
    assert refused.status == 429
    shadow = keyed_config(replace(policy, enforcement="Shadow"))
    apply_config(sidecar, LoadedFile(replace(shadow, version="test-2"), {}, "2"))
    assert sidecar.scheduler.books().queued_requests == 1  # the waiting request is still there
    served = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
    )
    assert served.status == 200
    first, second = await asyncio.gather(running, queued)
    assert (first.status, second.status) == (200, 200)
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    outcomes = [(r["status_code"], r["reason"], r.get("would_refuse", False))
                for r in records_of(sidecar)]  # fmt: skip
    assert sorted(outcomes) == sorted([
        (429, "queue_full", False), (200, "queue_full", True),
        (200, "admitted", False), (200, "admitted", False),
    ])  # fmt: skip
