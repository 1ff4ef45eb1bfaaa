"""The ``status`` the operator writes to each object, from a :class:`~.render.Rendering`.

Pure. Fields beyond the conditions: ``observedGeneration`` (the generation the status describes),
``configVersion`` (the published document holding the object), and for a TenantQuota its
effective ``tenantId`` and, when it has any, its ``limits`` beside the budget; for a
SchedulingPolicy the ``tenants`` count and the names of the ConfigMap and Secret it publishes,
and ``budgetShares``, the number of ready sidecars each tenant's budgets were divided across (at
least 1). Fields the operator does not own (``usage``) are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from tokenfair.config import TenantConfig

from .budgets import split_concurrency
from .conditions import (
    ACCEPTED,
    CONFIG_PUBLISHED,
    PODS_WITHOUT_SIDECAR,
    SIDECARS_INJECTED,
    Check,
    condition_for,
    conditions_for,
)
from .render import Rendering, Verdict
from .views import PolicyView, QuotaView, configmap_name, secret_name

POLICY_NOT_FOUND = "PolicyNotFound"
DOCUMENT_TOO_LARGE = "DocumentTooLarge"
"""The accepted tenants' document does not fit one object even compressed (:mod:`.payload`)."""


def quota_status(
    quota: QuotaView, verdict: Verdict, rendering: Rendering | None, *, now: str
) -> dict[str, Any]:
    """Status of one quota; ``rendering`` is None when its policy does not exist.

    ``configVersion`` is the first published document holding this generation of the quota:
    a quota already published at its generation keeps it while later documents (another
    quota's change) come and go, so one change among 10,000 quotas writes one quota status,
    not 10,000. The policy's ``status.configVersion`` is the current document."""
    accepted = Check(ACCEPTED, verdict.accepted, verdict.reason, verdict.message)
    version = rendering.version if rendering is not None and verdict.accepted else ""
    if version and published_at(quota):
        version = str(quota.status["configVersion"])
    if not verdict.accepted:
        published = Check(CONFIG_PUBLISHED, False, "NotAccepted", verdict.message)
    elif version:
        published = Check(
            CONFIG_PUBLISHED,
            True,
            "Published",
            f"tenant {quota.tenant_id!r} is published since config version {version} of policy "
            f"{quota.policy_name!r} (ConfigMap {configmap_name(quota.policy_name)})",
        )
    elif rendering is not None and rendering.publish_error is not None:
        published = Check(CONFIG_PUBLISHED, False, DOCUMENT_TOO_LARGE, rendering.publish_error)
    else:  # accepted but nothing published: cannot happen (an accepted tenant makes a document)
        published = Check(CONFIG_PUBLISHED, False, "NotPublished", "no config document")
    status = {
        "observedGeneration": quota.generation,
        "tenantId": quota.tenant_id,
        "configVersion": version,
        "conditions": conditions_for(
            accepted,
            published,
            generation=quota.generation,
            previous=quota.status.get("conditions", []),
            now=now,
        ),
    }
    limits: dict[str, Any] = {}
    if version and verdict.tenant is not None and rendering is not None:
        limits = tenant_limits(verdict.tenant, rendering.replicas)
    # Always written, None when there are none: a merge patch's null takes lifted limits away.
    status["limits"] = limits or None
    return status


def tenant_limits(tenant: TenantConfig, replicas: int) -> dict[str, Any]:
    """``status.limits``: the limits beside the budget in force (none: empty), with each of the
    ``replicas`` ready sidecars' share of ``maxConcurrentRequests`` (:mod:`.budgets`)."""
    limits: dict[str, Any] = {}
    if tenant.max_concurrent_requests is not None:
        limits["maxConcurrentRequests"] = tenant.max_concurrent_requests
        share = split_concurrency(tenant, replicas).max_concurrent_requests
        limits["maxConcurrentRequestsPerSidecar"] = share
    if tenant.max_kv_share is not None:
        limits["maxKvShare"] = tenant.max_kv_share
    return limits


def published_at(quota: QuotaView) -> bool:
    """The stored status already has this generation published, with a version."""
    return bool(quota.status.get("configVersion")) and any(
        c.get("type") == CONFIG_PUBLISHED
        and c.get("status") == "True"
        and c.get("observedGeneration") == quota.generation
        for c in quota.status.get("conditions", [])
    )


def orphan_verdict(quota: QuotaView) -> Verdict:
    """The verdict for a quota whose policy does not exist (or is being deleted)."""
    return Verdict(
        False,
        POLICY_NOT_FOUND,
        f"TenantQuota {quota.name!r}: spec.policyName: SchedulingPolicy {quota.policy_name!r} "
        f"does not exist in namespace {quota.namespace!r}",
    )


NAMED_PODS: Final = 5
"""Pods named in the ``SidecarsInjected`` message at most (the count is always given)."""


def injection_check(unprotected: Sequence[str]) -> Check:
    """``SidecarsInjected`` from the names of the policy's labelled Pods without the sidecar."""
    if not unprotected:
        return Check(SIDECARS_INJECTED, True, "AllInjected", "every labelled Pod runs the sidecar")
    named = ", ".join(unprotected[:NAMED_PODS]) + (", ..." if len(unprotected) > NAMED_PODS else "")
    return Check(
        SIDECARS_INJECTED,
        False,
        PODS_WITHOUT_SIDECAR,
        f"{len(unprotected)} Pod(s) labelled tokenfair.io/policy run without the tokenfair "
        f"sidecar and serve every tenant unadmitted: {named} (created while sidecar injection "
        "was unreachable with failurePolicy Ignore; delete them to have them re-created injected)",
    )


def policy_status(
    policy: PolicyView, rendering: Rendering, *, now: str, unprotected: Sequence[str] = ()
) -> dict[str, Any]:
    """Status of one policy after rendering it; ``unprotected`` names its labelled Pods that
    run without the sidecar."""
    if rendering.policy_error is not None:
        accepted = Check(ACCEPTED, False, "InvalidSpec", rendering.policy_error)
        published = Check(CONFIG_PUBLISHED, False, "NotAccepted", rendering.policy_error)
    else:
        accepted = Check(ACCEPTED, True, "Valid", "accepted")
        refused = sum(not v.accepted for v in rendering.verdicts.values())
        if rendering.version:
            published = Check(
                CONFIG_PUBLISHED,
                True,
                "Published",
                f"config version {rendering.version} with {rendering.tenants} tenant(s), budgets "
                f"per sidecar for {rendering.replicas} ready sidecar(s), in ConfigMap "
                f"{configmap_name(policy.name)}; {refused} TenantQuota(s) refused",
            )
        elif rendering.publish_error is not None:  # the last document published stays
            published = Check(CONFIG_PUBLISHED, False, DOCUMENT_TOO_LARGE, rendering.publish_error)
        else:
            published = Check(
                CONFIG_PUBLISHED,
                False,
                "NoAcceptedTenants",
                f"no accepted TenantQuota names policyName {policy.name!r} ({refused} refused); "
                "a config document needs at least one tenant",
            )
    status: dict[str, Any] = {
        "observedGeneration": policy.generation,
        "configVersion": rendering.version or policy.status.get("configVersion", ""),
        "configMapName": configmap_name(policy.name),
        "secretName": secret_name(policy.name),
        "tenants": rendering.tenants,
        "budgetShares": rendering.replicas,
        "conditions": [
            *conditions_for(
                accepted,
                published,
                generation=policy.generation,
                previous=policy.status.get("conditions", []),
                now=now,
            ),
            condition_for(
                injection_check(unprotected),
                generation=policy.generation,
                previous=policy.status.get("conditions", []),
                now=now,
            ),
        ],
    }
    return status


def differs(current: Any, wanted: dict[str, Any]) -> bool:
    """True when writing ``wanted`` would change ``current`` (only keys we own are compared)."""
    if not isinstance(current, dict):
        return True
    return any(current.get(key) != value for key, value in wanted.items())
