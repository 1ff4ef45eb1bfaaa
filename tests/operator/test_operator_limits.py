"""The tenant limits beside the budget through the operator (``render_config`` and
``quota_status``, called directly; no cluster):

- ``maxConcurrentRequests`` and ``maxKvShare`` reach the published document, also for a quota
  whose keys come from a Secret (its TenantConfig is rebuilt with the merged digests);
- with n ready sidecars each gets ``max(1, floor(limit / n))`` of ``maxConcurrentRequests``,
  with or without a ``budgetStore``; ``maxKvShare`` is a fraction of each engine, not divided;
- a ``maxKvShare`` below one block of the policy's ``totalKvBlocks`` refuses the quota
  ``InvalidSpec`` with the parser's message (a rule that spans two objects: no CEL can see it);
- ``status.limits`` says what is in force (the per-sidecar share too), and is ``None`` — a
  merge patch's delete — once the limits are lifted or the quota is not published;
- the policy webhook refuses (422) a spec change that would make a stored quota's
  ``maxKvShare`` less than one block (``handlers.admit_policy``, with a fake API): the quota
  would otherwise be dropped silently at the next pass.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf
import pytest

from tokenfair.config import api_key_digest, loads_config
from tokenfair_operator import PolicyView, QuotaView, handlers, quota_status, render_config, runtime
from tokenfair_operator.reconcile import Reconciler

T0 = "2026-01-01T00:00:0{}Z"
NOW = "2026-01-01T00:01:00Z"
BASE = {
    "policyName": "pool",
    "weight": 1.0,
    "burstServiceTokens": 48_000,
    "sustainedServiceTokensPerSecond": 180_000,
}


def policy(spec: dict[str, Any] | None = None) -> PolicyView:
    return PolicyView("pool", "ns", "uid-pool", 1, T0.format(0), spec or {})


def quota(name: str, second: int = 1, **spec: Any) -> QuotaView:
    return QuotaView(name, "ns", f"uid-{name}", 1, T0.format(second), {**BASE, **spec})


def test_limits_reach_the_document_also_with_a_key_secret() -> None:
    quotas = [
        quota("chat", 1, maxConcurrentRequests=8, maxKvShare=0.25),
        quota("keyed", 2, maxConcurrentRequests=3, apiKeySecretRef={"name": "keys"}),
        quota("plain", 3),
    ]
    rendering = render_config(policy(), quotas, {"keyed": (api_key_digest("sk-1"),)})
    config = loads_config(rendering.secret_data["config.yaml"])
    chat, keyed, plain = config.tenants
    assert (chat.max_concurrent_requests, chat.max_kv_share) == (8, 0.25)
    assert (keyed.max_concurrent_requests, keyed.max_kv_share) == (3, None)
    assert keyed.api_key_sha256 == (api_key_digest("sk-1"),)
    assert (plain.max_concurrent_requests, plain.max_kv_share) == (None, None)


def test_concurrency_is_divided_across_ready_sidecars_kv_share_is_not() -> None:
    quotas = [quota("chat", 1, maxConcurrentRequests=8, maxKvShare=0.25),
              quota("few", 2, maxConcurrentRequests=2)]  # fmt: skip
    for spec in ({}, {"budgetStore": {"redis": {"url": "redis://r:6379"}}}):
        rendering = render_config(policy(spec), quotas, {}, ready_replicas=3)
        chat, few = loads_config(rendering.configmap_data["config.yaml"]).tenants
        assert chat.max_concurrent_requests == 2  # floor(8 / 3)
        assert few.max_concurrent_requests == 1  # floor(2 / 3) = 0: each sidecar still runs 1
        assert chat.max_kv_share == 0.25


def test_a_kv_share_below_one_block_is_an_invalid_spec() -> None:
    rendering = render_config(
        policy({"totalKvBlocks": 500}), [quota("tiny", 1, maxKvShare=0.001), quota("ok", 2)], {}
    )
    verdict = rendering.verdicts["tiny"]
    assert (verdict.accepted, verdict.reason) == (False, "InvalidSpec")
    assert verdict.message == (
        "TenantQuota 'tiny': spec.maxKvShare: maxKvShare x totalKvBlocks must be at least one KV "
        "block, or the tenant could never run a request (got 0.001 x 500)"
    )
    assert rendering.verdicts["ok"].accepted


def test_status_says_the_limits_in_force_and_drops_them_when_lifted() -> None:
    limited = quota("chat", 1, maxConcurrentRequests=8, maxKvShare=0.25)
    rendering = render_config(policy(), [limited], {}, ready_replicas=3)
    status = quota_status(limited, rendering.verdicts["chat"], rendering, now=NOW)
    assert status["limits"] == {
        "maxConcurrentRequests": 8,
        "maxConcurrentRequestsPerSidecar": 2,
        "maxKvShare": 0.25,
    }
    lifted = QuotaView("chat", "ns", "uid-chat", 2, T0.format(1), dict(BASE), status)
    rendering = render_config(policy(), [lifted], {})
    assert quota_status(lifted, rendering.verdicts["chat"], rendering, now=NOW)["limits"] is None
    refused = quota("bad", 1, maxKvShare=0.0001)
    rendering = render_config(policy(), [refused], {})
    assert quota_status(refused, rendering.verdicts["bad"], rendering, now=NOW)["limits"] is None


class StoredQuotas:
    """``list_quotas``, the one read the policy webhook makes."""

    def __init__(self, quotas: list[QuotaView]) -> None:
        self.quotas = quotas
        self.reads: list[str] = []

    def list_quotas(self, namespace: str) -> list[QuotaView]:
        self.reads.append(namespace)
        return [q for q in self.quotas if q.namespace == namespace]


def admit_policy(
    api: StoredQuotas, spec: dict[str, Any], old_spec: dict[str, Any] | None = None
) -> None:
    memo = kopf.Memo()
    memo[runtime.RECONCILER] = Reconciler(cast(Any, api))
    old = {"spec": old_spec or {"totalKvBlocks": 4096}}
    asyncio.run(
        handlers.admit_policy(
            name="pool",
            namespace="ns",
            spec=cast(kopf.Spec, spec),
            memo=memo,
            operation="UPDATE",
            old=old,
            new={"spec": spec},
        )
    )


def test_a_policy_change_that_would_drop_a_limited_quota_is_refused() -> None:
    other_policy = QuotaView("other", "ns", "uid-o", 1, T0.format(3),
                             {**BASE, "policyName": "elsewhere", "maxKvShare": 0.001})  # fmt: skip
    broken = quota("broken", 4, weight=-1.0, maxKvShare=0.001)  # refused in its own status
    api = StoredQuotas([quota("chat", 1, maxKvShare=0.01), quota("plain", 2), other_policy, broken])
    admit_policy(api, {"totalKvBlocks": 100})  # 0.01 x 100 = 1 block: still valid
    with pytest.raises(kopf.AdmissionError) as refused:
        admit_policy(api, {"totalKvBlocks": 99})  # 0.99 of a block: chat could never run
    message = str(refused.value)
    assert refused.value.code == 422
    assert "spec.totalKvBlocks" in message
    assert "TenantQuota 'chat': spec.maxKvShare" in message
    assert "0.01 x 99" in message
    assert api.reads == ["ns", "ns"]
    # A metadata-only update reads nothing; a spec that does not parse is refused before.
    admit_policy(api, {"totalKvBlocks": 99}, old_spec={"totalKvBlocks": 99})
    with pytest.raises(kopf.AdmissionError, match="totalKvBlocks"):
        admit_policy(api, {"totalKvBlocks": -5})
    assert api.reads == ["ns", "ns"]
