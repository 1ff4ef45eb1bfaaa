"""Requests that can never pass get a 400 (SDKs do not retry it), those that may pass later a
429 with an honest ``Retry-After``.

Behaviours: a request whose own KV blocks pass its class watermark of the whole cache is
``400 request_over_kv_capacity``, whatever the cache holds; one costing more than its tenant's
burst is ``400 request_over_tenant_burst`` with lending off, and stays a ``429
shed_tenant_token_quota`` with ``Retry-After`` when lending of idle capacity is on; both are
recorded with their reason and counted as refused, with the books untouched. The core's own
decisions are unchanged for every policy (the simulator and the lesson parity see the 429s);
:meth:`Scheduler.never_admissible` restates them for the lesson's admission policy too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sidecar_support import (
    CHAT,
    PATIENT_POLICY,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    start,
)

from tokenfair_sidecar.config import PolicyConfig
from tokenfair_sidecar.core import Decision, Request, make_scheduler
from tokenfair_sidecar.core.scheduler import OVER_KV_CAPACITY, OVER_TENANT_BURST
from tokenfair_sidecar.server.settings import SidecarSettings


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_over_burst_is_400_recorded_with_its_reason(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # Burst 5000; 1000 + 4 * 1001 = 5004 service tokens can never be in the bucket.
    path = tmp_path / "records.jsonl"
    settings = SidecarSettings(time_scale=0.01, records_path=str(path))
    clients = await start(aiohttp_client, keyed_config(burst_service_tokens=5000), settings)
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1000, 1001), headers={"Authorization": CHAT}
    )
    assert response.status == 400
    payload = await response.json()
    assert payload["error"]["code"] == OVER_TENANT_BURST
    assert "5004 service tokens" in payload["error"]["message"]
    assert "burstServiceTokens" in payload["error"]["message"]
    assert "Retry-After" not in response.headers
    # 1000 + 4 * 1000 = 5000 fits the burst exactly: served.
    served = await clients.proxy.post(
        "/v1/completions", json=completion_body(1000, 1000), headers={"Authorization": CHAT}
    )
    assert served.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    assert clients.sidecar.recorder is not None
    clients.sidecar.recorder.flush()
    outcomes = [(r["status_code"], r["reason"]) for r in records(path)]
    assert outcomes == [(400, OVER_TENANT_BURST), (200, "admitted")]
    metrics = await (await clients.admin.get("/metrics")).text()
    assert f'reason="{OVER_TENANT_BURST}"' in metrics


async def test_over_burst_with_lending_on_is_not_refused_as_never(
    aiohttp_client: ClientFactory,
) -> None:
    # Lending is on: capacity nobody within budget uses may run it, so it is never a 400; here
    # the server is idle, and the same request that was a 400 above is served on lent capacity.
    policy = replace(PATIENT_POLICY, lend_idle_capacity=True)
    clients = await start(aiohttp_client, keyed_config(policy, burst_service_tokens=5000))
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1000, 1001), headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


def test_an_over_burst_refusal_with_lending_on_stays_a_429() -> None:
    # Lending on: a refusal at the budget gate is "not now" (lent capacity may come free), so
    # never_admissible leaves it alone and the client gets the 429 with its Retry-After.
    policy = replace(PATIENT_POLICY, lend_idle_capacity=True)
    config = keyed_config(policy, burst_service_tokens=5000)
    scheduler = make_scheduler("tokenfair", config)
    over = Request("over", "tenant_chat_pro", 0.0, 1000, 1001, "interactive")
    quota = Decision("over", "tenant_chat_pro", "interactive", 429, "shed_tenant_token_quota",
                     "admission", 5004, 0.0, retry_after_ms=700.0)  # fmt: skip
    assert scheduler.never_admissible(over, quota) is None
    # The same refusal with lending off: never.
    strict = make_scheduler("tokenfair", keyed_config(PATIENT_POLICY, burst_service_tokens=5000))
    never = strict.never_admissible(over, quota)
    assert never is not None
    assert (never.status_code, never.reason) == (400, OVER_TENANT_BURST)
    assert never.observed == {"request_service_tokens": 5004, "burst_service_tokens": 5000}


@pytest.mark.parametrize("policy_name", ["service_token_drr_with_admission", "tokenfair"])
def test_never_admissible_restates_only_what_no_state_could_admit(policy_name: str) -> None:
    # 100 blocks of 16 tokens, interactive watermark 0.9: at most 90 blocks (1440 tokens).
    policy = PolicyConfig(total_kv_blocks=100)
    scheduler = make_scheduler(policy_name, keyed_config(policy))
    big = Request("big", "tenant_chat_pro", 0.0, 1400, 100, "interactive")
    refusal = scheduler.submit(big, 0.0)
    assert refusal is not None
    assert refusal.reason == "shed_kv_watermark"
    never = scheduler.never_admissible(big, refusal)
    assert never is not None
    assert (never.status_code, never.reason) == (400, OVER_KV_CAPACITY)
    assert never.observed == {"request_kv_blocks": 94, "max_kv_blocks": 90}
    assert refusal.status_code == 429  # the core's own decision is left as it was
    # 88 blocks fit an empty cache: a KV refusal of it (the cache busy) is only "not now".
    small = Request("small", "tenant_chat_pro", 0.0, 1300, 100, "interactive")
    fake = replace(refusal, request_id="small")
    assert scheduler.never_admissible(small, fake) is None
    assert scheduler.books() == ZERO_BOOKS
