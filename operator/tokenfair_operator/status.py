"""The ``status`` the operator writes to each object, from a :class:`~.render.Rendering`.

Pure. Fields beyond the conditions: ``observedGeneration`` (the generation the status describes),
``configVersion`` (the published document holding the object), and for a TenantQuota its
effective ``tenantId``; for a SchedulingPolicy the ``tenants`` count and the names of the
ConfigMap and Secret it publishes, and ``budgetShares``, the number of ready sidecars each
tenant's budgets were divided across (at least 1). Fields the operator does not own
(``usage``) are left alone.
"""

from __future__ import annotations

from typing import Any

from .conditions import ACCEPTED, CONFIG_PUBLISHED, Check, conditions_for
from .model import PolicyView, QuotaView, configmap_name, secret_name
from .render import Rendering, Verdict

POLICY_NOT_FOUND = "PolicyNotFound"


def quota_status(
    quota: QuotaView, verdict: Verdict, rendering: Rendering | None, *, now: str
) -> dict[str, Any]:
    """Status of one quota; ``rendering`` is None when its policy does not exist."""
    accepted = Check(ACCEPTED, verdict.accepted, verdict.reason, verdict.message)
    version = rendering.version if rendering is not None and verdict.accepted else ""
    if not verdict.accepted:
        published = Check(CONFIG_PUBLISHED, False, "NotAccepted", verdict.message)
    elif version:
        published = Check(
            CONFIG_PUBLISHED,
            True,
            "Published",
            f"tenant {quota.tenant_id!r} is in config version {version} of policy "
            f"{quota.policy_name!r} (ConfigMap {configmap_name(quota.policy_name)})",
        )
    else:  # accepted but nothing published: cannot happen (an accepted tenant makes a document)
        published = Check(CONFIG_PUBLISHED, False, "NotPublished", "no config document")
    return {
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


def orphan_verdict(quota: QuotaView) -> Verdict:
    """The verdict for a quota whose policy does not exist (or is being deleted)."""
    return Verdict(
        False,
        POLICY_NOT_FOUND,
        f"TenantQuota {quota.name!r}: spec.policyName: SchedulingPolicy {quota.policy_name!r} "
        f"does not exist in namespace {quota.namespace!r}",
    )


def policy_status(policy: PolicyView, rendering: Rendering, *, now: str) -> dict[str, Any]:
    """Status of one policy after rendering it."""
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
        "conditions": conditions_for(
            accepted,
            published,
            generation=policy.generation,
            previous=policy.status.get("conditions", []),
            now=now,
        ),
    }
    return status


def differs(current: Any, wanted: dict[str, Any]) -> bool:
    """True when writing ``wanted`` would change ``current`` (only keys we own are compared)."""
    if not isinstance(current, dict):
        return True
    return any(current.get(key) != value for key, value in wanted.items())
