"""The config contract: YAML files on disk through ``load_config`` and ``--set`` overrides.

Behaviours under test:

* every rule a single field or a whole document can break is refused with a :class:`ConfigError`
  whose message names the file, the field and the rule (empty tenant id, non-positive weight and
  budgets, watermark order, decode weight, unknown keys at every level, duplicate tenant ids,
  unknown priority class, no tenants, wrong apiVersion/kind, invalid YAML, missing file; a
  400-digit integer, YAML nested 5,000 deep or an integer of 5,000 digits), and a message shows
  a bad value bounded (a YAML alias bomb of 10**6 strings makes a short message);
* a multi-document file of plain manifests (one SchedulingPolicy, TenantQuotas) reads as the
  user would ``kubectl apply`` it: ``tenantId`` defaults to ``metadata.name`` and may hold
  underscores that Kubernetes names cannot;
* a ``TokenfairConfig`` document renders and reads back to an equal :class:`Config`;
* ``--set`` overrides change a policy key or a tenant field and refuse unknown keys and bad values.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml

from tokenfair.config import (
    SHOWN_CHARS,
    Config,
    ConfigError,
    PolicyConfig,
    TenantConfig,
    api_key_digest,
    apply_overrides,
    config_to_document,
    load_config,
    parse_documents,
    shown,
)
from tokenfair.server.auth import Authenticator

GOOD_TENANT = {
    "tenantId": "tenant_chat_pro",
    "weight": 2.0,
    "burstServiceTokens": 48000,
    "sustainedServiceTokensPerSecond": 180000,
    "priorityClass": "interactive",
}


def config_file(
    tmp_path: Path,
    policy: Mapping[str, object] | None = None,
    tenants: Sequence[Mapping[str, object]] | None = None,
    **document: object,
) -> Path:
    """Write a ``TokenfairConfig`` document to ``tmp_path/config.yaml`` and return its path."""
    doc: dict[str, object] = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TokenfairConfig",
        "policy": dict(policy or {}),
        "tenants": [GOOD_TENANT] if tenants is None else [dict(t) for t in tenants],
        **document,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_a_good_document_loads_with_defaults_for_missing_policy_keys(tmp_path: Path) -> None:
    config = load_config(config_file(tmp_path, policy={"maxBatchWaitMs": 5000}))
    assert config.policy == dataclasses.replace(PolicyConfig(), max_batch_wait_ms=5000.0)
    assert config.tenants == (TenantConfig("tenant_chat_pro", 2.0, 48000, 180000.0, "interactive"),)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("tenantId", "", "must be a non-empty string"),
        ("tenantId", "   ", "must be a non-empty string"),
        ("tenantId", " padded", "must not start or end with white space"),
        ("weight", 0, "must be > 0"),
        ("weight", -1.5, "must be > 0"),
        ("weight", "heavy", "must be a number"),
        ("burstServiceTokens", 0, "must be > 0"),
        ("burstServiceTokens", -48000, "must be > 0"),
        ("burstServiceTokens", 1.5, "must be an integer"),
        ("sustainedServiceTokensPerSecond", 0, "must be > 0"),
        ("sustainedServiceTokensPerSecond", -1, "must be > 0"),
        ("priorityClass", "realtime", "must be one of interactive, batch"),
    ],
)
def test_bad_tenant_field_is_named_with_its_rule(
    tmp_path: Path, field: str, value: object, rule: str
) -> None:
    tenant = {**GOOD_TENANT, field: value}
    message = load_error(config_file(tmp_path, tenants=[tenant]))
    assert f"config.yaml: tenants[0].{field}: {rule}" in message


@pytest.mark.parametrize(
    "missing", ["weight", "burstServiceTokens", "sustainedServiceTokensPerSecond", "tenantId"]
)
def test_missing_tenant_field_is_named(tmp_path: Path, missing: str) -> None:
    tenant = {k: v for k, v in GOOD_TENANT.items() if k != missing}
    message = load_error(config_file(tmp_path, tenants=[tenant]))
    assert "tenants[0]: missing required field(s)" in message
    assert missing in message


@pytest.mark.parametrize(
    ("batch", "interactive"),
    [
        (0.95, 0.90),  # batch above interactive
        (0.0, 0.90),  # batch not above 0 (caught by the (0, 1] field rule first)
        (0.65, 1.2),  # interactive above 1
    ],
)
def test_watermarks_must_be_ordered_inside_zero_one(
    tmp_path: Path, batch: float, interactive: float
) -> None:
    policy = {"batchKvWatermark": batch, "interactiveKvWatermark": interactive}
    message = load_error(config_file(tmp_path, policy=policy))
    assert "KvWatermark" in message
    assert ("0 < batchKvWatermark <= interactiveKvWatermark <= 1" in message) or (
        "must be in (0, 1]" in message
    )


def test_watermark_order_message_names_both_values(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, policy={"batchKvWatermark": 0.95}))
    assert message == (
        f"{tmp_path / 'config.yaml'}: policy.batchKvWatermark: watermarks must satisfy "
        "0 < batchKvWatermark <= interactiveKvWatermark <= 1 (got batch 0.95, interactive 0.9)"
    )


def test_equal_watermarks_are_allowed(tmp_path: Path) -> None:
    policy = {"batchKvWatermark": 0.8, "interactiveKvWatermark": 0.8}
    assert load_config(config_file(tmp_path, policy=policy)).policy.batch_kv_watermark == 0.8


@pytest.mark.parametrize("value", [0, -4, float("inf"), True])
def test_decode_weight_must_be_a_positive_number(tmp_path: Path, value: object) -> None:
    message = load_error(config_file(tmp_path, policy={"decodeWeight": value}))
    assert "policy.decodeWeight: must be" in message


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"totalKvBlocks": 0}, "totalKvBlocks: must be > 0"),
        ({"baseQuantumTokens": -1}, "baseQuantumTokens: must be > 0"),
        ({"serviceTokensPerMs": 0}, "serviceTokensPerMs: must be > 0"),
        ({"maxBatchWaitMs": 0}, "maxBatchWaitMs: must be > 0"),
        ({"batchMinShare": 0.6}, "batchMinShare: must be in [0, 0.5]"),
        ({"batchRateMarginSigmas": -0.5}, "batchRateMarginSigmas: must be in [0, 4]"),
        ({"batchRateMarginSigmas": "high"}, "batchRateMarginSigmas: must be a number"),
        (
            {"maxQueuedRequests": 10, "maxQueuedRequestsPerTenant": 11},
            "maxQueuedRequestsPerTenant: must be <= maxQueuedRequests",
        ),
    ],
)
def test_bad_policy_values_are_named(tmp_path: Path, policy: dict[str, object], field: str) -> None:
    assert f"policy.{field}" in load_error(config_file(tmp_path, policy=policy))


def test_unknown_policy_key(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, policy={"maxBatchWait": 5000}))
    assert "policy: unknown field(s) maxBatchWait" in message
    assert "maxBatchWaitMs" in message  # the known keys are listed, so the typo is obvious


def test_unknown_tenant_key(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, tenants=[{**GOOD_TENANT, "wieght": 2}]))
    assert "tenants[0]: unknown field(s) wieght" in message


def test_unknown_document_key(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, tenant=[GOOD_TENANT]))
    assert "document 1 (TokenfairConfig): unknown field(s) tenant" in message


def test_duplicate_tenant_ids(tmp_path: Path) -> None:
    other = {**GOOD_TENANT, "weight": 1.0}
    message = load_error(config_file(tmp_path, tenants=[GOOD_TENANT, other]))
    assert "tenants[1].tenantId: duplicate tenant id 'tenant_chat_pro' (also tenants[0])" in (
        message
    )


def test_no_tenants(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, tenants=[]))
    assert "tenants: at least one tenant is required" in message


def test_bad_api_version(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, apiVersion="tokenfair.io/v1"))
    assert "apiVersion must be tokenfair.io/v1alpha1 (got 'tokenfair.io/v1')" in message


def test_bad_kind(tmp_path: Path) -> None:
    message = load_error(config_file(tmp_path, kind="TenantQuotas"))
    assert "kind must be TokenfairConfig, TenantQuota or SchedulingPolicy" in message
    assert "'TenantQuotas'" in message


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: tokenfair.io/v1alpha1\ntenants: [\n", encoding="utf-8")
    assert load_error(path).startswith(f"{path}: invalid YAML:")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("---\n", encoding="utf-8")
    assert load_error(path) == f"{path}: no YAML documents"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    assert load_error(path) == f"{path}: cannot read (No such file or directory)"


MANIFESTS = """\
apiVersion: tokenfair.io/v1alpha1
kind: SchedulingPolicy
metadata:
  name: shared-pool
spec:
  maxBatchWaitMs: 5000
  batchMinShare: 0.2
  selector: {matchLabels: {app: llm}}   # resolved by the operator, ignored standalone
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: tenant-chat-pro
spec:
  weight: 2
  burstServiceTokens: 48000
  sustainedServiceTokensPerSecond: 180000
---
# an empty document between separators is skipped
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: batch-rag
spec:
  tenantId: tenant_batch_rag
  weight: 1
  burstServiceTokens: 28000
  sustainedServiceTokensPerSecond: 60000
  priorityClass: batch
  policyName: shared-pool
"""


def test_multi_document_manifests(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS, encoding="utf-8")
    config = load_config(path)
    assert config.policy == dataclasses.replace(
        PolicyConfig(), max_batch_wait_ms=5000.0, batch_min_share=0.2
    )
    assert config.tenants == (
        # No spec.tenantId: the id is metadata.name.
        TenantConfig("tenant-chat-pro", 2.0, 48000, 180000.0, "interactive"),
        # spec.tenantId wins, and may hold the underscores a Kubernetes name cannot.
        TenantConfig("tenant_batch_rag", 1.0, 28000, 60000.0, "batch"),
    )


def test_manifest_errors_name_the_object(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS.replace("weight: 1\n", "weight: 0\n"), encoding="utf-8")
    assert "TenantQuota 'batch-rag': spec.weight: must be > 0 (got 0)" in load_error(path)


def test_two_policies_in_one_file_are_refused(tmp_path: Path) -> None:
    policy_doc = MANIFESTS.split("---\n")[0]
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS + "---\n" + policy_doc, encoding="utf-8")
    assert "the policy is defined twice" in load_error(path)


def test_manifest_without_a_name(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS.replace("  name: batch-rag\n", "  labels: {}\n"), encoding="utf-8")
    assert "metadata.name must be a non-empty string" in load_error(path)


def test_config_document_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS, encoding="utf-8")
    original = load_config(path)
    keyed = dataclasses.replace(
        original.tenants[0], api_key_sha256=("ab" * 32,)
    )  # key hashes render only when present: cover both shapes
    original = Config(original.policy, (keyed, original.tenants[1]), version="rev-7")
    document = config_to_document(original)
    assert document["kind"] == "TokenfairConfig"
    assert parse_documents([document]) == original
    # ... and through a real YAML file, as the operator writes it.
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(document), encoding="utf-8")
    assert load_config(rendered) == original


# -- --set overrides -----------------------------------------------------------------------------


@pytest.fixture
def base_config(tmp_path: Path) -> Config:
    path = tmp_path / "tenants.yaml"
    path.write_text(MANIFESTS, encoding="utf-8")
    return load_config(path)


def test_set_policy_key(base_config: Config) -> None:
    changed = apply_overrides(base_config, ["maxBatchWaitMs=7000", "decodeWeight=2.5"])
    assert changed.policy == dataclasses.replace(
        base_config.policy, max_batch_wait_ms=7000.0, decode_weight=2.5
    )
    assert changed.tenants == base_config.tenants


def test_set_tenant_field(base_config: Config) -> None:
    changed = apply_overrides(base_config, ["tenants.tenant_batch_rag.weight=2"])
    assert changed.tenant("tenant_batch_rag").weight == 2.0
    assert changed.tenant("tenant-chat-pro") == base_config.tenant("tenant-chat-pro")
    assert changed.policy == base_config.policy


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("maxBatchWait=5000", "--set maxBatchWait: unknown parameter"),
        ("tenants.nobody.weight=2", "--set tenants.nobody.weight: unknown tenant"),
        ("tenants.tenant_batch_rag.wieght=2", "unknown tenant field"),
        ("tenants.tenant_batch_rag.tenantId=x", "unknown tenant field"),
        ("maxBatchWaitMs", "expected key=value"),
        ("maxBatchWaitMs=soon", "maxBatchWaitMs: must be a number (got 'soon')"),
        ("maxBatchWaitMs=-1", "maxBatchWaitMs: must be > 0 (got -1)"),
        ("batchKvWatermark=0.95", "0 < batchKvWatermark <= interactiveKvWatermark <= 1"),
        ("tenants.tenant_batch_rag.weight=0", "--set tenants.tenant_batch_rag.weight: must be > 0"),
        (
            "tenants.tenant_batch_rag.priorityClass=realtime",
            "priorityClass: must be one of interactive, batch",
        ),
    ],
)
def test_set_refuses_bad_keys_and_values(
    base_config: Config, assignment: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        apply_overrides(base_config, [assignment])
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("policy", "tenant", "field"),
    [
        ({"totalKvBlocks": 10**400}, {}, "totalKvBlocks"),
        ({"maxBatchWaitMs": 10**400}, {}, "maxBatchWaitMs"),
        ({}, {"weight": 10**400}, "weight"),
        ({}, {"burstServiceTokens": -(10**400)}, "burstServiceTokens"),
    ],
)
def test_huge_integers_are_refused_by_name(
    tmp_path: Path, policy: dict[str, object], tenant: dict[str, object], field: str
) -> None:
    # 401 digits: float() of it overflows, and the core would fail on it at runtime.
    path = config_file(tmp_path, policy=policy, tenants=[{**GOOD_TENANT, **tenant}])
    with pytest.raises(ConfigError, match=rf"{field}: must be at most 9007199254740992"):
        load_config(path)


@pytest.mark.parametrize(
    "text",
    [
        "tenants: " + "[" * 5000 + "]" * 5000 + "\n",  # nesting past the stack
        "version: " + "9" * 5000 + "\n",  # more digits than Python converts
    ],
    ids=["5000-deep", "5000-digits"],
)
def test_yaml_the_parser_cannot_hold_is_invalid_yaml(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("apiVersion: tokenfair.io/v1alpha1\nkind: TokenfairConfig\n" + text)
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path)


def alias_bomb(levels: int) -> str:
    """A YAML flow value of a few hundred bytes that builds nested lists of ``10**levels``
    strings (each level an anchor aliased ten times by the next): the reviewer's case."""
    parts = ["&a0 [" + ", ".join(['"xxxxxxxx"'] * 10) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ("tenant", "weight"),
        ("tenant", "priorityClass"),
        ("tenant", "apiKeySha256"),
        ("tenant", "tenantId"),
        ("policy", "decodeWeight"),
        ("document", "kind"),
        ("document", "apiVersion"),
    ],
)
def test_an_alias_bomb_makes_a_short_error_message(tmp_path: Path, where: str, field: str) -> None:
    """Error messages show a value bounded (a few levels, items and characters): 10**6
    strings behind one field make a message of a few hundred characters, not 100 MB."""
    placeholder = "ALIAS_BOMB_HERE"
    if where == "tenant":
        path = config_file(tmp_path, tenants=[{**GOOD_TENANT, field: placeholder}])
    elif where == "policy":
        path = config_file(tmp_path, policy={field: placeholder})
    elif field == "kind":
        path = config_file(tmp_path, kind=placeholder)
    else:
        path = config_file(tmp_path, apiVersion=placeholder)
    text = path.read_text(encoding="utf-8")
    assert text.count(placeholder) == 1
    path.write_text(text.replace(placeholder, alias_bomb(6)), encoding="utf-8")
    message = load_error(path)
    assert field in message
    assert len(message) < 500, len(message)


def test_shown_bounds_any_value() -> None:
    nested: list[object] = ["x" * 10_000]
    for _ in range(50):
        nested = [nested] * 10
    values: list[object] = [nested, "y" * 1_000_000, 10**5000, {str(i): i for i in range(10**5)}]
    for value in values:
        assert len(shown(value)) <= SHOWN_CHARS
    assert shown(10**5000) == "<an integer of 16610 bits>"
    assert shown("soon") == "'soon'"  # a short value as repr shows it
    assert shown([1, 2.5, None]) == "[1, 2.5, None]"


def test_one_api_key_digest_for_the_operator_and_the_sidecar() -> None:
    """A key as a Secret stores it (a trailing newline) and as a client presents it digest
    alike: SHA-256 of the UTF-8 key without the white space around it, the digest docs give as
    `printf %s "$KEY" | sha256sum`; the sidecar's check finds the tenant by it."""
    expected = hashlib.sha256("sk-ü-1".encode()).hexdigest()
    assert api_key_digest("sk-ü-1\n") == api_key_digest("  sk-ü-1") == expected
    tenant = TenantConfig(
        "tenant_chat_pro", 2.0, 48000, 180000.0, "interactive", api_key_sha256=(expected,)
    )
    config = Config(PolicyConfig(), (tenant,))
    auth = Authenticator(config)
    assert auth.authenticate("Bearer sk-ü-1", None) is tenant
    assert auth.authenticate("Bearer sk-ü-2", None) is None
