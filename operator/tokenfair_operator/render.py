"""Render one SchedulingPolicy and its TenantQuotas into the sidecar's config document.

Pure: no Kubernetes I/O. Every rule is the sidecar's own (``tokenfair_sidecar.config``:
``parse_policy``, ``parse_tenant``, ``build_config``); the operator only adds the rules that span
objects, which the sidecar cannot see: the policy must exist, tenant ids are unique within a
policy (the older TenantQuota keeps the id: by ``creationTimestamp``, then the one already
accepted, then name), a referenced
key Secret must exist and hold at least one key, and ``spec.selector`` must be a well-formed
label selector (:func:`~.selector.parse_selector`; a malformed one refuses the policy).

Outputs, for a policy with at least one accepted tenant:

* ``configmap_data`` — ``{"config.yaml": <TokenfairConfig document without API-key hashes>}``;
* ``secret_data`` — ``{"config.yaml": <the same document with the hashes>}``;
* every tenant's budgets divided across ``ready_replicas`` sidecars (:mod:`.budgets`): each
  sidecar enforces its share, so the pool as a whole honours the TenantQuota;
* ``version`` — the first 16 hex digits of SHA-256 over the canonical JSON of the document
  (sorted keys, hashes included), so any content change, key rotations too, changes it and an
  unchanged world renders byte-identical output (the operator then writes nothing).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import yaml

from tokenfair_sidecar.config import (
    ConfigError,
    PolicyConfig,
    TenantConfig,
    build_config,
    config_to_document,
    loads_config,
    parse_policy,
    parse_tenant,
)

from .budgets import split_budgets
from .model import CONFIG_KEY, PolicyView, QuotaView
from .selector import parse_selector

VERSION_HEX_DIGITS: Final = 16


@dataclass(frozen=True, slots=True)
class KeyProblem:
    """Why a TenantQuota's key Secret gave no keys (reason is a condition reason)."""

    reason: str
    message: str


KeyLookup = tuple[str, ...] | KeyProblem
"""SHA-256 hex digests read from a quota's key Secret, or why there are none."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one TenantQuota made it into the document; ``reason`` is a condition reason."""

    accepted: bool
    reason: str
    message: str
    tenant: TenantConfig | None = None


@dataclass(frozen=True, slots=True)
class Rendering:
    """The outcome of :func:`render_config`; ``version`` is empty when nothing can be published."""

    policy_error: str | None
    verdicts: Mapping[str, Verdict]
    """Per TenantQuota name."""
    configmap_data: Mapping[str, str] = field(default_factory=dict)
    secret_data: Mapping[str, str] = field(default_factory=dict)
    version: str = ""
    tenants: int = 0
    replicas: int = 1
    """Ready sidecars the budgets were divided across (at least 1)."""


def sha256_hex(api_key: str) -> str:
    """The digest the sidecar compares a presented key against: SHA-256 of the UTF-8 key with
    surrounding white space removed (``kubectl create secret --from-file`` keeps a newline)."""
    return hashlib.sha256(api_key.strip().encode()).hexdigest()


def render_config(
    policy: PolicyView,
    quotas: Sequence[QuotaView],
    key_hashes: Mapping[str, KeyLookup],
    ready_replicas: int = 1,
) -> Rendering:
    """Judge every quota of ``policy`` and render the document of the accepted ones.

    ``key_hashes`` maps a quota name to what its ``apiKeySecretRef`` Secret held; a quota with a
    reference but no entry counts as a missing Secret. Quotas are judged whole; the document
    holds each tenant's share for one of ``ready_replicas`` sidecars (0 counts as 1).
    """
    where = f"SchedulingPolicy {policy.name!r}: spec"
    try:
        policy_config = parse_policy(policy.spec, where)
        # The sidecar ignores the selector (an operator-only field); its rules are ours.
        parse_selector(policy.spec.get("selector"), f"{where}.selector")
    except ConfigError as exc:
        refused = Verdict(False, "PolicyInvalid", f"SchedulingPolicy {policy.name!r} is invalid")
        return Rendering(str(exc), {q.name: refused for q in quotas})

    verdicts: dict[str, Verdict] = {}
    accepted: list[TenantConfig] = []
    owner_of: dict[str, str] = {}  # tenant id -> quota name holding it
    for quota in sorted(quotas, key=_seniority):
        verdict = _judge(policy_config, quota, key_hashes, accepted, owner_of)
        verdicts[quota.name] = verdict
        if verdict.tenant is not None:
            accepted.append(verdict.tenant)
            owner_of[verdict.tenant.tenant_id] = quota.name
    if not accepted:
        return Rendering(None, verdicts)
    # The document lists tenants by creation, then name: never by status, which changes as
    # passes go by and would reorder (and re-version) an unchanged world.
    in_order = [
        tenant
        for quota in sorted(quotas, key=lambda q: (q.created, q.name))
        if (tenant := verdicts[quota.name].tenant) is not None
    ]
    replicas = max(1, ready_replicas)
    shares = [split_budgets(tenant, replicas) for tenant in in_order]
    return _publishable(policy_config, shares, verdicts, replicas)


def _seniority(quota: QuotaView) -> tuple[str, bool, str]:
    """Older first. ``creationTimestamp`` has one-second resolution, so within a second a quota
    already accepted goes first (a newcomer never takes an id from a working tenant), then the
    name decides."""
    accepted = any(
        c.get("type") == "Accepted" and c.get("status") == "True"
        for c in quota.status.get("conditions", [])
    )
    return (quota.created, not accepted, quota.name)


def _judge(
    policy: PolicyConfig,
    quota: QuotaView,
    key_hashes: Mapping[str, KeyLookup],
    accepted: Sequence[TenantConfig],
    owner_of: Mapping[str, str],
) -> Verdict:
    where = f"TenantQuota {quota.name!r}: spec"
    try:
        tenant = parse_tenant(quota.spec, where, default_id=quota.name)
    except ConfigError as exc:
        return Verdict(False, "InvalidSpec", str(exc))
    if (other := owner_of.get(tenant.tenant_id)) is not None:
        return Verdict(
            False,
            "DuplicateTenantId",
            f"{where}.tenantId: tenant id {tenant.tenant_id!r} is already used by TenantQuota "
            f"{other!r} of policy {quota.policy_name!r} (tenant ids are unique per policy)",
        )
    if (secret := quota.key_secret) is not None:
        lookup = key_hashes.get(quota.name, KeyProblem("KeySecretNotFound", ""))
        if isinstance(lookup, KeyProblem):
            message = lookup.message or f"Secret {secret!r} not found"
            return Verdict(False, lookup.reason, f"{where}.apiKeySecretRef: {message}")
        merged = tuple(dict.fromkeys((*tenant.api_key_sha256, *lookup)))
        tenant = TenantConfig(
            tenant_id=tenant.tenant_id,
            weight=tenant.weight,
            burst_service_tokens=tenant.burst_service_tokens,
            sustained_service_tokens_per_second=tenant.sustained_service_tokens_per_second,
            priority_class=tenant.priority_class,
            api_key_sha256=merged,
        )
    try:  # the sidecar's cross-tenant rules (e.g. one API key, two tenants)
        build_config(policy, [*accepted, tenant])
    except ConfigError as exc:
        return Verdict(False, "ConflictingApiKey", f"{where}: {exc}")
    return Verdict(True, "Valid", "accepted", tenant)


def _publishable(
    policy: PolicyConfig,
    tenants: Sequence[TenantConfig],
    verdicts: Mapping[str, Verdict],
    replicas: int,
) -> Rendering:
    unversioned = config_to_document(build_config(policy, tenants))
    canonical = json.dumps(unversioned, sort_keys=True, separators=(",", ":"))
    version = hashlib.sha256(canonical.encode()).hexdigest()[:VERSION_HEX_DIGITS]
    full = config_to_document(build_config(policy, tenants, version))
    public = {**full, "tenants": [_without_keys(t) for t in _tenant_entries(full)]}
    secret_text = yaml.safe_dump(full, sort_keys=False)
    public_text = yaml.safe_dump(public, sort_keys=False)
    # Read both back with the sidecar's loader: what we publish is what a sidecar accepts.
    loads_config(secret_text, "rendered Secret")
    loads_config(public_text, "rendered ConfigMap")
    return Rendering(
        None,
        verdicts,
        configmap_data={CONFIG_KEY: public_text},
        secret_data={CONFIG_KEY: secret_text},
        version=version,
        tenants=len(tenants),
        replicas=replicas,
    )


def _tenant_entries(document: Mapping[str, object]) -> list[Mapping[str, object]]:
    entries = document["tenants"]
    assert isinstance(entries, list)
    return entries


def _without_keys(entry: Mapping[str, object]) -> dict[str, object]:
    return {key: value for key, value in entry.items() if key != "apiKeySha256"}
