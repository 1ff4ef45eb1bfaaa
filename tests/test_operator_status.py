"""Conditions and status the operator writes, and the replica-aware budget split.

Behaviours under test (pure functions, called directly):

- ``conditions_for``: ``Ready`` is true only when ``Accepted`` and ``ConfigPublished`` are, and
  otherwise carries the first false condition's reason and message; ``lastTransitionTime``
  changes only when a condition's status changes; each condition carries observedGeneration;
- ``quota_status``/``policy_status``: observedGeneration, configVersion, tenant id, counts and
  the documented reasons (Published, NotAccepted, PolicyNotFound, NoAcceptedTenants,
  InvalidSpec); an unchanged world yields an identical status (so nothing is written);
- ``split_budgets``: per-replica burst ``max(1, burst // n)`` and sustained ``sustained / n``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tokenfair_operator import (
    Check,
    PolicyView,
    QuotaView,
    conditions_for,
    policy_status,
    quota_status,
    render_config,
    split_budgets,
)
from tokenfair_operator.status import differs, orphan_verdict
from tokenfair_sidecar.config import TenantConfig

T1, T2 = "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"
OK_A = Check("Accepted", True, "Valid", "accepted")
OK_P = Check("ConfigPublished", True, "Published", "in version v1")
SPEC: dict[str, Any] = {
    "policyName": "pool",
    "weight": 1.0,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100.0,
}


def by_type(conditions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conditions}


def test_ready_when_both_true() -> None:
    got = by_type(conditions_for(OK_A, OK_P, generation=3, previous=[], now=T1))
    assert got["Ready"]["status"] == "True"
    assert got["Ready"]["reason"] == "Ready"
    assert got["Ready"]["message"] == "in version v1"
    assert {c["observedGeneration"] for c in got.values()} == {3}
    assert {c["lastTransitionTime"] for c in got.values()} == {T1}


def test_ready_false_carries_the_first_failure() -> None:
    refused = Check("Accepted", False, "DuplicateTenantId", "id taken")
    unpublished = Check("ConfigPublished", False, "NotAccepted", "id taken")
    got = by_type(conditions_for(refused, unpublished, generation=1, previous=[], now=T1))
    assert (got["Ready"]["status"], got["Ready"]["reason"]) == ("False", "DuplicateTenantId")
    got = by_type(conditions_for(OK_A, unpublished, generation=1, previous=[], now=T1))
    assert (got["Ready"]["status"], got["Ready"]["reason"]) == ("False", "NotAccepted")


def test_transition_time_moves_only_on_status_change() -> None:
    first = conditions_for(OK_A, OK_P, generation=1, previous=[], now=T1)
    # Same statuses (a new message even): times stay.
    again = conditions_for(
        OK_A,
        Check("ConfigPublished", True, "Published", "v2"),
        generation=2,
        previous=first,
        now=T2,
    )
    assert {c["lastTransitionTime"] for c in again} == {T1}
    refused = Check("Accepted", False, "InvalidSpec", "bad")
    flipped = by_type(
        conditions_for(
            refused,
            Check("ConfigPublished", False, "NotAccepted", "bad"),
            generation=3,
            previous=again,
            now=T2,
        )
    )
    assert {c["lastTransitionTime"] for c in flipped.values()} == {T2}


def quota(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> QuotaView:
    return QuotaView("q", "ns", "u", 4, T1, spec or SPEC, status or {})


def policy(status: dict[str, Any] | None = None) -> PolicyView:
    return PolicyView("pool", "ns", "pu", 2, T1, {}, status or {})


def test_quota_status_published_and_stable() -> None:
    rendering = render_config(policy(), [quota()], {})
    status = quota_status(quota(), rendering.verdicts["q"], rendering, now=T1)

    assert status["observedGeneration"] == 4
    assert status["tenantId"] == "q"  # no spec.tenantId: the object's name
    assert status["configVersion"] == rendering.version
    assert by_type(status["conditions"])["ConfigPublished"]["reason"] == "Published"
    # Recomputed later over the stored status: identical, so the reconciler writes nothing.
    later = quota_status(quota(status=status), rendering.verdicts["q"], rendering, now=T2)
    assert later == status
    assert not differs(status, later)


def test_orphan_quota_status() -> None:
    status = quota_status(quota(), orphan_verdict(quota()), None, now=T1)
    ready = by_type(status["conditions"])["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PolicyNotFound")
    assert "SchedulingPolicy 'pool' does not exist" in ready["message"]
    assert status["configVersion"] == ""


def test_policy_status_counts_and_reasons() -> None:
    bad = QuotaView("bad", "ns", "b", 1, T2, {**SPEC, "weight": 0})
    rendering = render_config(policy(), [quota(), bad], {})
    status = policy_status(policy(), rendering, now=T1)

    assert status["tenants"] == 1
    assert status["configVersion"] == rendering.version
    assert status["configMapName"] == "tokenfair-pool"
    assert status["secretName"] == "tokenfair-pool-keys"
    assert status["budgetShares"] == 1
    assert "1 TenantQuota(s) refused" in by_type(status["conditions"])["Ready"]["message"]

    empty = policy_status(policy(status), render_config(policy(), [bad], {}), now=T2)
    ready = by_type(empty["conditions"])["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "NoAcceptedTenants")
    assert empty["configVersion"] == rendering.version  # the last published one stays


def test_policy_status_invalid_spec() -> None:
    bad_policy = PolicyView("pool", "ns", "pu", 5, T1, {"batchKvWatermark": 0.99})
    status = policy_status(bad_policy, render_config(bad_policy, [quota()], {}), now=T1)
    accepted = by_type(status["conditions"])["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "batchKvWatermark" in accepted["message"]


LESSON_CHAT = TenantConfig("tenant_chat_pro", 2.0, 48_000, 180_000.0, "interactive", ("c" * 64,))


@pytest.mark.parametrize(
    ("replicas", "burst", "sustained"),
    [
        (1, 48_000, 180_000.0),
        (0, 48_000, 180_000.0),  # no ready pod yet: the first gets the whole quota
        (3, 16_000, 60_000.0),  # 48000 / 3, 180000 / 3
        (7, 6_857, 180_000.0 / 7),  # floor(48000 / 7) = 6857; 7 * 6857 = 47999 <= 48000
        (100_000, 1, 1.8),  # burst < n: each replica still holds 1 token
    ],
)
def test_split_budgets(replicas: int, burst: int, sustained: float) -> None:
    share = split_budgets(LESSON_CHAT, replicas)
    assert share.burst_service_tokens == burst
    assert share.sustained_service_tokens_per_second == pytest.approx(sustained)
    assert (share.weight, share.api_key_sha256) == (LESSON_CHAT.weight, LESSON_CHAT.api_key_sha256)
