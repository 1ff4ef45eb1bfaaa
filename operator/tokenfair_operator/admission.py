"""Admission checks CEL cannot make: they span objects. Served by Kopf's webhook server.

A TenantQuota is refused at the door (``kubectl apply`` fails with the message) when:

* ``spec.policyName`` names no SchedulingPolicy in its namespace;
* its tenant id is already held by an older TenantQuota of the same policy;
* ``spec.apiKeySecretRef`` names a missing Secret, or one holding no key;
* any rule of the sidecar's loader fails (bounds CEL already enforces, one API key claimed by two
  tenants).

A SchedulingPolicy's spec change is refused (:func:`policy_refusal`) when a stored TenantQuota of
it would no longer pass the rules that read the policy (``maxKvShare x totalKvBlocks`` at least
one KV block): the next pass would refuse that quota ``InvalidSpec`` and drop its tenant.

The verdict comes from the same :func:`~.render.render_config` the reconciler publishes with, over
the objects as stored now (live reads, not the watch cache: a policy created a millisecond ago
must count). Other quotas' key Secrets are not read (their keys are taken as valid), so only the
candidate's Secret costs a read. The reconciler repeats every check level-based, so anything the
webhook lets through (it fails open when the operator is down) still ends up refused in status.
"""

from __future__ import annotations

import asyncio
import dataclasses

from tokenfair.config import ConfigError, PolicyConfig
from tokenfair.config.document import check_tenant_limits, parse_tenant

from .kube import KubeApi
from .render import KeyLookup, render_config
from .views import QuotaView

# Sorts after any RFC 3339 timestamp: a quota being created is younger than every stored one.
NOT_YET_CREATED = "~"


async def quota_refusal(api: KubeApi, quota: QuotaView, *, creating: bool) -> str | None:
    """Why ``quota`` must not be stored, or None to admit it. A quota being created is younger
    than every stored one (the API server stamps ``creationTimestamp`` before admission, with
    one-second resolution, so the stamp alone cannot say)."""
    policy = await asyncio.to_thread(api.get_policy, quota.namespace, quota.policy_name)
    if policy is None or policy.deleting:
        return (
            f"TenantQuota {quota.name!r}: spec.policyName: SchedulingPolicy "
            f"{quota.policy_name!r} does not exist in namespace {quota.namespace!r} "
            "(create the policy first)"
        )
    stored = await asyncio.to_thread(api.list_quotas, quota.namespace)
    others = [q for q in stored if q.policy_name == quota.policy_name and q.name != quota.name]
    candidate = dataclasses.replace(quota, created=NOT_YET_CREATED) if creating else quota
    lookups: dict[str, KeyLookup] = {q.name: () for q in others}
    if (secret := candidate.key_secret) is not None:
        lookups[candidate.name] = await asyncio.to_thread(
            api.key_hashes, candidate.namespace, secret
        )
    verdict = render_config(policy, [*others, candidate], lookups).verdicts[candidate.name]
    # A broken policy is the policy's problem (its status says so), not this quota's.
    if verdict.accepted or verdict.reason == "PolicyInvalid":
        return None
    return verdict.message


async def policy_refusal(
    api: KubeApi, namespace: str, name: str, policy: PolicyConfig
) -> str | None:
    """Why SchedulingPolicy ``name`` must not take the spec parsed as ``policy``, or None: a
    stored TenantQuota of it whose tenant limits it would break (:func:`check_tenant_limits`,
    e.g. a ``totalKvBlocks`` lowered so that ``maxKvShare`` is under one block). A quota whose
    own spec does not parse is left to its status (it is refused already)."""
    stored = await asyncio.to_thread(api.list_quotas, namespace)
    for quota in sorted(stored, key=lambda q: q.name):
        if quota.policy_name != name:
            continue
        where = f"TenantQuota {quota.name!r}: spec"
        try:
            tenant = parse_tenant(quota.spec, where, default_id=quota.name)
        except ConfigError:
            continue
        try:
            check_tenant_limits(tenant, policy, where)
        except ConfigError as exc:
            return (
                f"SchedulingPolicy {name!r}: spec.totalKvBlocks: {policy.total_kv_blocks} would "
                f"make a TenantQuota of this policy invalid, and its tenant dropped ({exc}); "
                "raise that quota's maxKvShare first"
            )
    return None
