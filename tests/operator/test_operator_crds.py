"""The CRDs in ``crds/`` agree with the sidecar's config contract (one source of truth).

Behaviours under test, reading the YAML files directly (no cluster):

- SchedulingPolicy's spec properties are exactly ``config.POLICY_FIELDS`` plus ``selector`` and
  ``budgetStore`` (whose defaults and bounds are ``tokenfair.config.budget_store``'s), and
  TenantQuota's exactly ``config.TENANT_FIELDS`` plus ``policyName`` and ``apiKeySecretRef``;
- the policy defaults, read back through the sidecar's ``parse_policy``, equal ``PolicyConfig()``;
- every number is bounded on both sides, and each bound agrees with the sidecar's parser: an
  inclusive bound is accepted by it, an exclusive one refused;
- TenantQuota's required fields are the ``TenantConfig`` fields without a default (tenantId
  excepted: it defaults to the object's name) plus ``policyName``; priorityClass's enum is
  ``PRIORITY_CLASSES`` with the dataclass default;
- API surface: group/version, status subresource, short name ``tq``, category ``tokenfair``,
  a Ready printer column from the condition and the message at priority 1, CEL rules with
  messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml
from repo_paths import REPO_ROOT

from tokenfair.config import (
    POLICY_FIELDS,
    PRIORITY_CLASSES,
    TENANT_FIELDS,
    ConfigError,
    PolicyConfig,
    TenantConfig,
    parse_policy,
    parse_tenant,
)
from tokenfair.config.budget_store import BudgetStoreConfig, parse_budget_store

CRDS = REPO_ROOT / "crds"


def load(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"tokenfair.io_{name}.yaml").read_text())
    assert isinstance(crd, dict)
    return crd


def version(crd: dict[str, Any]) -> dict[str, Any]:
    (only,) = crd["spec"]["versions"]
    assert isinstance(only, dict)
    return only


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema = version(crd)["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert isinstance(schema, dict)
    return schema


POLICY = load("schedulingpolicies")
QUOTA = load("tenantquotas")
POLICY_SPEC = spec_schema(POLICY)
QUOTA_SPEC = spec_schema(QUOTA)
NUMBER_TYPES = ("integer", "number")
# Valid company for one field pushed to a bound: the cross-field rules stay satisfiable.
POLICY_COMPANY = {
    "interactiveKvWatermark": 1.0,
    "batchKvWatermark": 0.01,
    "maxQueuedRequests": 10_000_000,
    "maxQueuedRequestsPerTenant": 1,
    "maxBatchRequests": 65_536,
}
QUOTA_BASE = {"weight": 1.0, "burstServiceTokens": 1, "sustainedServiceTokensPerSecond": 1.0}


def test_policy_properties_are_the_config_fields() -> None:
    assert set(POLICY_SPEC["properties"]) == {*POLICY_FIELDS, "selector", "budgetStore"}


def test_budget_store_defaults_and_bounds_are_the_sidecars() -> None:
    store = POLICY_SPEC["properties"]["budgetStore"]["properties"]
    spec = {"redis": {"url": "redis://r:6379", "secretRef": {"name": "s"}}}
    numbers = (
        "leaseMs",
        "timeoutMs",
        "probeIntervalMs",
        "fairnessSyncMs",
        "fairnessLeaseServiceTokens",
    )
    defaults = {key: store[key]["default"] for key in (*numbers, "fairness")}
    assert parse_budget_store({**spec, **defaults}) == BudgetStoreConfig("redis://r:6379")
    for key in numbers:
        parse_budget_store({**spec, key: store[key]["minimum"]})
        parse_budget_store({**spec, key: store[key]["maximum"]})
        with pytest.raises(ConfigError, match=key):
            parse_budget_store({**spec, key: store[key]["maximum"] * 2})
    assert set(store["redis"]["properties"]) == {"url", "secretRef"}


def test_quota_properties_are_the_tenant_fields() -> None:
    assert set(QUOTA_SPEC["properties"]) == {*TENANT_FIELDS, "policyName", "apiKeySecretRef"}


def test_policy_defaults_are_the_lessons() -> None:
    defaults = {key: POLICY_SPEC["properties"][key]["default"] for key in POLICY_FIELDS}
    assert parse_policy(defaults) == PolicyConfig()
    # An empty spec defaults to {} so the API server fills in every parameter.
    assert POLICY_SPEC["default"] == {}


def test_quota_required_fields_are_the_dataclass_fields_without_default() -> None:
    yaml_name = {attr: key for key, (attr, _) in TENANT_FIELDS.items()}
    no_default = {
        yaml_name[f.name]
        for f in dataclasses.fields(TenantConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert set(QUOTA_SPEC["required"]) == (no_default - {"tenantId"}) | {"policyName"}


def test_priority_class_enum_and_default() -> None:
    prop = QUOTA_SPEC["properties"]["priorityClass"]
    assert tuple(prop["enum"]) == PRIORITY_CLASSES
    default = next(
        f.default for f in dataclasses.fields(TenantConfig) if f.name == "priority_class"
    )
    assert prop["default"] == default


def number_fields(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, p) for k, p in spec["properties"].items() if p.get("type") in NUMBER_TYPES]


@pytest.mark.parametrize(
    ("key", "prop"),
    number_fields(POLICY_SPEC) + number_fields(QUOTA_SPEC),
    ids=[k for k, _ in number_fields(POLICY_SPEC) + number_fields(QUOTA_SPEC)],
)
def test_every_number_is_bounded(key: str, prop: dict[str, Any]) -> None:
    assert "minimum" in prop, key
    assert "maximum" in prop, key


def parse_field(kind: str, key: str, value: float) -> None:
    if kind == "policy":
        parse_policy({**POLICY_COMPANY, key: value})
    else:
        parse_tenant({**QUOTA_BASE, key: value}, "spec", default_id="t")


BOUND_CASES = [
    ("policy", key, prop) for key, prop in number_fields(POLICY_SPEC) if key in POLICY_FIELDS
] + [("quota", key, prop) for key, prop in number_fields(QUOTA_SPEC)]


@pytest.mark.parametrize(("kind", "key", "prop"), BOUND_CASES, ids=[k for _, k, _ in BOUND_CASES])
def test_bounds_agree_with_the_sidecar_parser(kind: str, key: str, prop: dict[str, Any]) -> None:
    parse_field(kind, key, prop["maximum"])  # the CRD's maximum is a value the sidecar takes
    if prop.get("exclusiveMinimum"):
        with pytest.raises(ConfigError, match=key):
            parse_field(kind, key, prop["minimum"])
    else:
        parse_field(kind, key, prop["minimum"])
    if prop["type"] == "integer":  # and the sidecar refuses one below the CRD's lowest integer
        lowest = prop["minimum"] + (1 if prop.get("exclusiveMinimum") else 0)
        with pytest.raises(ConfigError, match=key):
            parse_field(kind, key, lowest - 1)


@pytest.mark.parametrize("crd", [POLICY, QUOTA], ids=["SchedulingPolicy", "TenantQuota"])
def test_api_surface(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert spec["group"] == "tokenfair.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["tokenfair"]
    served = version(crd)
    assert served["name"] == "v1alpha1"
    assert served["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in served["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Message"]["priority"] == 1
    assert columns["Message"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].message'
    rules = spec_schema(crd)["x-kubernetes-validations"]
    assert rules
    assert all(rule["message"] for rule in rules)


def test_quota_short_name_and_columns() -> None:
    assert QUOTA["spec"]["names"]["shortNames"] == ["tq"]
    columns = {c["name"] for c in version(QUOTA)["additionalPrinterColumns"]}
    assert {"Weight", "Priority", "Admitted"} <= columns
