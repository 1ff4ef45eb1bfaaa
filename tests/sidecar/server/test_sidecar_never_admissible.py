"""Requests that can never pass get a 400 (SDKs do not retry it), those that may pass later a
429 with an honest ``Retry-After``.

Behaviours: a request whose own KV blocks pass its class watermark of the whole cache is
``400 request_over_kv_capacity``, whatever the cache holds; one costing more than its tenant's
burst is ``400 request_over_tenant_burst`` with lending off, and stays a ``429
shed_tenant_token_quota`` with ``Retry-After`` when lending of idle capacity is on; both are
recorded with their reason and counted as refused, with the books untouched. The core's own
decisions are unchanged for every policy (the simulator and the lesson parity see the 429s);
:meth:`Scheduler.never_admissible` is a static check of the request, made by the sidecar before
the scheduler's gates, so the 400 comes whatever the load (with the queue full too), and a
pool-wide budget store keeps an over-burst request a 429.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
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
    start,
)

from tokenfair.config import PolicyConfig
from tokenfair.config.budget_store import BudgetStoreConfig
from tokenfair.core import Request, make_scheduler
from tokenfair.core.scheduler import OVER_KV_CAPACITY, OVER_TENANT_BURST
from tokenfair.server.runtime_settings import SidecarSettings


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
    assert clients.sidecar.outcomes.record_writer is not None
    clients.sidecar.outcomes.record_writer.flush()
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


def test_an_over_burst_request_with_lending_on_is_not_never() -> None:
    # Lending on: the budget gate's refusal is "not now" (lent capacity may come free), so
    # never_admissible leaves it alone and the client gets the 429 with its Retry-After.
    policy = replace(PATIENT_POLICY, lend_idle_capacity=True)
    config = keyed_config(policy, burst_service_tokens=5000)
    scheduler = make_scheduler("tokenfair", config)
    over = Request("over", "tenant_chat_pro", 0.0, 1000, 1001, "interactive")
    assert scheduler.never_admissible(over) is None
    # Lending off: never.
    strict = make_scheduler("tokenfair", keyed_config(PATIENT_POLICY, burst_service_tokens=5000))
    never = strict.never_admissible(over)
    assert never is not None
    assert (never.status_code, never.reason) == (400, OVER_TENANT_BURST)
    assert never.observed == {"request_service_tokens": 5004, "burst_service_tokens": 5000}
    assert strict.books() == ZERO_BOOKS  # a pure check: nothing was submitted


def test_an_over_burst_request_with_a_budget_store_is_not_never() -> None:
    # A pool-wide budget may hold more than this sidecar's bucket: "not now", the 429 stands.
    config = replace(
        keyed_config(PATIENT_POLICY, burst_service_tokens=5000),
        budget_store=BudgetStoreConfig("redis://127.0.0.1:9"),
    )
    scheduler = make_scheduler("tokenfair", config)
    over = Request("over", "tenant_chat_pro", 0.0, 1000, 1001, "interactive")
    assert scheduler.never_admissible(over) is None


@pytest.mark.parametrize("policy_name", ["service_token_drr_with_admission", "tokenfair"])
def test_never_admissible_restates_only_what_no_state_could_admit(policy_name: str) -> None:
    # 100 blocks of 16 tokens, interactive watermark 0.9: at most 90 blocks (1440 tokens).
    policy = PolicyConfig(total_kv_blocks=100)
    scheduler = make_scheduler(policy_name, keyed_config(policy))
    big = Request("big", "tenant_chat_pro", 0.0, 1400, 100, "interactive")
    never = scheduler.never_admissible(big)
    assert never is not None
    assert (never.status_code, never.reason) == (400, OVER_KV_CAPACITY)
    assert never.observed == {"request_kv_blocks": 94, "max_kv_blocks": 90}
    # The core's own decision is unchanged (the simulator sees the 429).
    refusal = scheduler.submit(big, 0.0)
    assert refusal is not None
    assert (refusal.status_code, refusal.reason) == (429, "shed_kv_watermark")
    # 88 blocks fit an empty cache: only "not now" when the cache is busy.
    small = Request("small", "tenant_chat_pro", 0.0, 1300, 100, "interactive")
    assert scheduler.never_admissible(small) is None
    assert scheduler.books() == ZERO_BOOKS


def test_a_policy_without_admission_gates_never_says_never() -> None:
    scheduler = make_scheduler("request_count_no_admission", keyed_config(PolicyConfig(
        total_kv_blocks=100)), )  # fmt: skip
    big = Request("big", "tenant_chat_pro", 0.0, 100_000, 100_000, "interactive")
    assert scheduler.never_admissible(big) is None


async def test_never_admissible_is_400_with_the_queue_full(aiohttp_client: ClientFactory) -> None:
    # The queue holds one request and holds it; a request that can never pass must still get
    # its 400 (not queue_full's 429 + Retry-After, which a client would retry for nothing).
    policy = replace(
        PATIENT_POLICY, max_queued_requests=1, max_queued_requests_per_tenant=1,
        kv_residency_factor=1.0,
    )  # fmt: skip
    clients = await start(
        aiohttp_client,
        keyed_config(policy, burst_service_tokens=5000),
        SidecarSettings(time_scale=10.0, max_in_flight=1),
    )
    proxy, sidecar = clients.proxy, clients.sidecar
    running, queued = await one_running_one_queued(proxy, sidecar)
    full = await proxy.post(
        "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
    )
    assert full.status == 429
    assert (await full.json())["error"]["tokenfair_reason"] == "queue_full"
    over_burst = await proxy.post(
        "/v1/completions", json=completion_body(1000, 1001), headers={"Authorization": CHAT}
    )
    assert over_burst.status == 400
    assert (await over_burst.json())["error"]["code"] == OVER_TENANT_BURST
    max_blocks = math.floor(policy.interactive_kv_watermark * policy.total_kv_blocks)
    over_kv = await proxy.post(
        "/v1/completions",
        json=completion_body((max_blocks + 1) * policy.kv_block_tokens, 1),
        headers={"Authorization": IDE},
    )
    assert over_kv.status == 400
    message = (await over_kv.json())["error"]["message"]
    assert f"at most {max_blocks}:" in message
    assert "Retry-After" not in over_kv.headers
    assert (await running).status == 200
    assert (await queued).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS


async def test_over_burst_with_a_budget_store_stays_a_429(aiohttp_client: ClientFactory) -> None:
    # The store is unreachable (the sidecar falls back to its share of the split), but the
    # pool's budget could admit the request once it is back: a 429 with Retry-After, not 400.
    budget_store = BudgetStoreConfig(
        "redis://127.0.0.1:9", replicas=1, timeout_ms=50.0, probe_interval_ms=20.0
    )
    config = replace(keyed_config(burst_service_tokens=5000), budget_store=budget_store)
    clients = await start(aiohttp_client, config)
    response = await clients.proxy.post(
        "/v1/completions", json=completion_body(1000, 1001), headers={"Authorization": CHAT}
    )
    assert response.status == 429
    assert (await response.json())["error"]["tokenfair_reason"] == "shed_tenant_token_quota"
    assert "Retry-After" in response.headers
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_the_400_names_large_numbers_as_integers(aiohttp_client: ClientFactory) -> None:
    # A million-token burst and a request of 4 million: no `1e+06` in the message.
    policy = replace(PATIENT_POLICY, total_kv_blocks=10**7)
    clients = await start(aiohttp_client, keyed_config(policy, burst_service_tokens=1_000_000))
    response = await clients.proxy.post(
        "/v1/completions",
        json={"model": "m", "prompt": "x" * 40, "max_tokens": 8192, "n": 128},
        headers={"Authorization": CHAT},
    )
    assert response.status == 400
    message = (await response.json())["error"]["message"]
    cost = clients.sidecar.scheduler.cost.service_tokens(10, 8192 * 128)
    assert f"costs {cost} service tokens" in message
    assert "burst of 1000000 " in message
    assert "e+" not in message
