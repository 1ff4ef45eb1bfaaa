"""Render one SchedulingPolicy and its TenantQuotas into the sidecar's config document.

Pure: no Kubernetes I/O. Every rule is the sidecar's own (``tokenfair.config``:
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
  sidecar enforces its share, so the pool as a whole honours the TenantQuota — unless the policy
  has a ``spec.budgetStore``: then the budgets are the pool's, whole, and the document's
  ``budgetStore`` section names the store, the key prefix ``tokenfair:<namespace>:<policy>``,
  and ``replicas: ready_replicas`` (the split each sidecar falls back to while the store is
  unreachable); a ``redis.secretRef`` becomes ``passwordEnv:`` :data:`PASSWORD_ENV`;
* every tenant's ``maxConcurrentRequests`` divided the same way, with or without a store
  (:func:`~.budgets.split_concurrency`); ``maxKvShare`` whole, checked against the policy's
  ``totalKvBlocks`` (at least one block, else ``InvalidSpec``);
* ``version`` — the first 16 hex digits of SHA-256 over the canonical JSON of the document
  (sorted keys, hashes included), so any content change, key rotations too, changes it and an
  unchanged world renders byte-identical output (the operator then writes nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from tokenfair.config import (
    ConfigError,
    PolicyConfig,
    TenantConfig,
    build_config,
    config_to_document,
    loads_config,
    parse_policy,
    parse_tenant,
)
from tokenfair.config.budget_store import BudgetStoreConfig, parse_budget_store
from tokenfair.config.document import check_tenant_limits

from .budgets import split_budgets, split_concurrency
from .payload import oversize, pack
from .selector import parse_selector
from .views import CONFIG_KEY, PolicyView, QuotaView

VERSION_HEX_DIGITS: Final = 16
PASSWORD_ENV: Final = "TOKENFAIR_BUDGET_STORE_PASSWORD"
"""The sidecar's environment variable holding the budget store's password (from
``spec.budgetStore.redis.secretRef``)."""


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
    configmap_payload: bytes = b""
    """What the ConfigMap stores under ``config.yaml``: the document, gzip when large
    (:mod:`.payload`)."""
    secret_payload: bytes = b""
    """The same for the Secret's document."""
    publish_error: str | None = None
    """Why nothing can be published though tenants were accepted (``DocumentTooLarge``)."""


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
        store = _budget_store(policy, where, ready_replicas)
    except ConfigError as exc:
        refused = Verdict(False, "PolicyInvalid", f"SchedulingPolicy {policy.name!r} is invalid")
        return Rendering(str(exc), {q.name: refused for q in quotas})

    verdicts: dict[str, Verdict] = {}
    owner_of: dict[str, str] = {}  # tenant id -> quota name holding it
    key_owners: dict[str, TenantConfig] = {}  # API-key digest -> accepted tenant holding it
    for quota in sorted(quotas, key=_seniority):
        verdict = _judge(policy_config, quota, key_hashes, key_owners, owner_of)
        verdicts[quota.name] = verdict
        if verdict.tenant is not None:
            owner_of[verdict.tenant.tenant_id] = quota.name
            key_owners.update(dict.fromkeys(verdict.tenant.api_key_sha256, verdict.tenant))
    if not owner_of:
        return Rendering(None, verdicts)
    # The document lists tenants by creation, then name: never by status, which changes as
    # passes go by and would reorder (and re-version) an unchanged world.
    in_order = [
        tenant
        for quota in sorted(quotas, key=lambda q: (q.created, q.name))
        if (tenant := verdicts[quota.name].tenant) is not None
    ]
    replicas = max(1, ready_replicas)
    in_order = [split_concurrency(tenant, replicas) for tenant in in_order]
    if store is not None:  # pool-wide: every sidecar leases from the whole budgets
        return _publishable(policy_config, in_order, verdicts, replicas, store)
    shares = [split_budgets(tenant, replicas) for tenant in in_order]
    return _publishable(policy_config, shares, verdicts, replicas)


def _budget_store(policy: PolicyView, where: str, ready_replicas: int) -> BudgetStoreConfig | None:
    """The document's ``budgetStore`` from ``spec.budgetStore`` (None without one)."""
    spec = policy.spec.get("budgetStore")
    if spec is None:
        return None
    parsed = parse_budget_store(spec, f"{where}.budgetStore")
    redis = spec.get("redis", {}) if isinstance(spec, Mapping) else {}
    return dataclasses.replace(
        parsed,
        password_env=PASSWORD_ENV if redis.get("secretRef") else parsed.password_env,
        key_prefix=f"tokenfair:{policy.namespace}:{policy.name}",
        replicas=max(1, ready_replicas),
    )


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
    key_owners: Mapping[str, TenantConfig],
    owner_of: Mapping[str, str],
) -> Verdict:
    where = f"TenantQuota {quota.name!r}: spec"
    try:
        tenant = parse_tenant(quota.spec, where, default_id=quota.name)
        check_tenant_limits(tenant, policy, where)  # maxKvShare of the policy's totalKvBlocks
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
        tenant = dataclasses.replace(tenant, api_key_sha256=merged)  # every other field kept
    # The sidecar's cross-tenant rules (e.g. one API key, two tenants), applied to the accepted
    # tenants sharing a key with this one only: all of them would make judging n quotas O(n^2)
    # (17 s at 1,000 quotas); ids are unique already (``owner_of``).
    rivals = {id(t): t for d in tenant.api_key_sha256 if (t := key_owners.get(d)) is not None}
    try:
        build_config(policy, [*rivals.values(), tenant])
    except ConfigError as exc:
        return Verdict(False, "ConflictingApiKey", f"{where}: {exc}")
    return Verdict(True, "Valid", "accepted", tenant)


def _publishable(
    policy: PolicyConfig,
    tenants: Sequence[TenantConfig],
    verdicts: Mapping[str, Verdict],
    replicas: int,
    store: BudgetStoreConfig | None = None,
) -> Rendering:
    unversioned = config_to_document(build_config(policy, tenants, "", store))
    canonical = json.dumps(unversioned, sort_keys=True, separators=(",", ":"))
    version = hashlib.sha256(canonical.encode()).hexdigest()[:VERSION_HEX_DIGITS]
    full = config_to_document(build_config(policy, tenants, version, store))
    public = {**full, "tenants": [_without_keys(t) for t in _tenant_entries(full)]}
    # JSON (which is YAML): the sidecar reads 10,000 tenants of it in ~20 ms, YAML takes ~1 s.
    secret_text = json.dumps(full, separators=(", ", ": "))
    public_text = json.dumps(public, separators=(", ", ": "))
    # Read it back with the sidecar's loader: what we publish is what a sidecar accepts. The
    # ConfigMap's document is the same without the optional key digests, so it passes too (one
    # read of 10,000 tenants costs ~0.25 s of the 1 s budget, docs/operator.md).
    loads_config(secret_text, "rendered Secret")
    public_payload, secret_payload = pack(public_text), pack(secret_text)
    too_large = oversize(CONFIG_KEY, secret_payload, "Secret's") or oversize(
        CONFIG_KEY, public_payload, "ConfigMap's"
    )
    return Rendering(
        None,
        verdicts,
        configmap_data={CONFIG_KEY: public_text},
        secret_data={CONFIG_KEY: secret_text},
        version="" if too_large else version,
        tenants=len(tenants),
        replicas=replicas,
        configmap_payload=public_payload,
        secret_payload=secret_payload,
        publish_error=too_large,
    )


def _tenant_entries(document: Mapping[str, object]) -> list[Mapping[str, object]]:
    entries = document["tenants"]
    assert isinstance(entries, list)
    return entries


def _without_keys(entry: Mapping[str, object]) -> dict[str, object]:
    return {key: value for key, value in entry.items() if key != "apiKeySha256"}
