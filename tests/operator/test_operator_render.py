"""Rendering one SchedulingPolicy and its TenantQuotas into the sidecar's config document.

Behaviours under test (``tokenfair_operator.render_config``, called directly):

- the lesson's three TenantQuota manifests and an empty policy render a ConfigMap document that
  the sidecar's own ``parse_documents`` reads back as the lesson's tenants at ``PolicyConfig()``;
- API-key digests go to the Secret's document only, merged from inline ``apiKeySha256`` and the
  key Secret; the ConfigMap's document holds none;
- the version is a content hash: independent of the order quotas are listed in, changed by any
  content change (a weight, a key rotation);
- replica-aware: with n ready sidecars each tenant's budgets in the document are its 1/n share
  (the quotas are still judged whole), and the version changes with n;
- refusals, each naming the field and rule: a duplicate tenant id (the older quota keeps it;
  within one second of creationTimestamp, the one already accepted), a
  missing or empty key Secret, one API key claimed by two tenants, an invalid spec that bypassed
  CEL, an invalid policy (every quota refused); no accepted tenant -> nothing to publish.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import yaml
from repo_paths import TEST_DATA

from tokenfair.config import PolicyConfig, TenantConfig, api_key_digest, loads_config
from tokenfair.sim.scenarios import LESSON_TENANTS
from tokenfair_operator import KeyProblem, PolicyView, QuotaView, render_config
from tokenfair_operator.render import KeyLookup

LESSON = TEST_DATA / "operator" / "lesson-tenants.yaml"
T0 = "2026-01-01T00:00:0{}Z"


def manifests() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(LESSON.read_text()) if d]


def policy(spec: dict[str, Any] | None = None) -> PolicyView:
    return PolicyView("pool", "ns", "uid-pool", 1, T0.format(0), spec or {})


def quota(name: str, spec: dict[str, Any], second: int = 1) -> QuotaView:
    return QuotaView(name, "ns", f"uid-{name}", 1, T0.format(second), spec)


def lesson_quotas() -> list[QuotaView]:
    docs = [d for d in manifests() if d["kind"] == "TenantQuota"]
    return [quota(d["metadata"]["name"], d["spec"], i) for i, d in enumerate(docs, start=1)]


def test_lesson_renders_a_document_the_sidecar_accepts() -> None:
    rendering = render_config(policy(), lesson_quotas(), {})

    assert rendering.policy_error is None
    assert all(v.accepted for v in rendering.verdicts.values())
    config = loads_config(rendering.configmap_data["config.yaml"])
    assert config.policy == PolicyConfig()
    # Creation order chat, ide, batch (seconds 1..3) is the lesson's order, hence DRR order.
    assert config.tenants == LESSON_TENANTS
    assert config.version == rendering.version
    assert len(rendering.version) == 16
    assert rendering.tenants == 3


def test_key_digests_only_in_the_secret() -> None:
    inline = hashlib.sha256(b"inline-key").hexdigest()
    quotas = lesson_quotas()
    chat = quotas[0]
    spec = {**chat.spec, "apiKeySha256": [inline], "apiKeySecretRef": {"name": "chat-keys"}}
    quotas[0] = quota(chat.name, spec, 1)
    from_secret = (api_key_digest("secret-key\n"),)

    rendering = render_config(policy(), quotas, {chat.name: from_secret})

    secret_cfg = loads_config(rendering.secret_data["config.yaml"])
    public_cfg = loads_config(rendering.configmap_data["config.yaml"])
    # Inline digests first, then the Secret's; the trailing newline is not part of the key.
    assert secret_cfg.tenant("tenant_chat_pro").api_key_sha256 == (
        inline,
        hashlib.sha256(b"secret-key").hexdigest(),
    )
    assert all(not t.api_key_sha256 for t in public_cfg.tenants)
    assert "apiKeySha256" not in rendering.configmap_data["config.yaml"]
    assert public_cfg.version == secret_cfg.version == rendering.version


def test_version_ignores_listing_order_and_follows_content() -> None:
    quotas = lesson_quotas()
    base = render_config(policy(), quotas, {}).version

    assert render_config(policy(), list(reversed(quotas)), {}).version == base
    heavier = [quota(quotas[0].name, {**quotas[0].spec, "weight": 3.0}, 1), *quotas[1:]]
    assert render_config(policy(), heavier, {}).version != base
    keyed = [quota(quotas[0].name, {**quotas[0].spec, "apiKeySha256": ["a" * 64]}, 1), *quotas[1:]]
    assert render_config(policy(), keyed, {}).version != base
    assert render_config(policy({"maxBatchWaitMs": 5000}), quotas, {}).version != base


def test_document_does_not_depend_on_status() -> None:
    # Same second for all three: the order is by name, whichever were accepted before (a status
    # changes between passes; the document must not, or every pass would re-version it).
    fresh = [quota(q.name, dict(q.spec), second=1) for q in lesson_quotas()]
    accepted = {"conditions": [{"type": "Accepted", "status": "True"}]}
    chat, ide, rag = fresh  # by name: batch-rag, chat-pro, ide-assist
    ide_seen = QuotaView(ide.name, "ns", ide.uid, 1, ide.created, ide.spec, accepted)

    before = render_config(policy(), fresh, {})
    after = render_config(policy(), [chat, ide_seen, rag], {})

    assert after.version == before.version
    assert after.configmap_data == before.configmap_data


def test_duplicate_tenant_id_refuses_the_younger_quota() -> None:
    older = quota("a-old", {**QUOTA_SPEC, "tenantId": "shared"}, second=1)
    younger = quota("z-young", {**QUOTA_SPEC, "tenantId": "shared"}, second=2)
    # Listed youngest first: the verdict follows creation time, not listing order.
    rendering = render_config(policy(), [younger, older], {})

    assert rendering.verdicts["a-old"].accepted
    refused = rendering.verdicts["z-young"]
    assert refused.reason == "DuplicateTenantId"
    assert "spec.tenantId" in refused.message
    assert "'a-old'" in refused.message
    assert rendering.tenants == 1


def test_within_one_second_the_accepted_quota_keeps_its_id() -> None:
    # creationTimestamp has one-second resolution: same second, and "a-new" sorts first by
    # name, but "z-holder" already holds the id (Accepted=True), so it keeps it.
    accepted = {"conditions": [{"type": "Accepted", "status": "True"}]}
    spec = {**QUOTA_SPEC, "tenantId": "t"}
    holder = QuotaView("z-holder", "ns", "u1", 1, T0.format(1), spec, accepted)
    newcomer = quota("a-new", spec, second=1)

    rendering = render_config(policy(), [newcomer, holder], {})

    assert rendering.verdicts["z-holder"].accepted
    assert rendering.verdicts["a-new"].reason == "DuplicateTenantId"


QUOTA_SPEC: dict[str, Any] = {
    "policyName": "pool",
    "weight": 1.0,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100.0,
}


@pytest.mark.parametrize(
    ("lookup", "reason"),
    [
        (None, "KeySecretNotFound"),
        (KeyProblem("KeySecretNotFound", "Secret 'k' not found"), "KeySecretNotFound"),
        (KeyProblem("KeySecretEmpty", "Secret 'k' holds no API key"), "KeySecretEmpty"),
    ],
)
def test_key_secret_problems_refuse_the_quota(lookup: KeyLookup | None, reason: str) -> None:
    keyed = quota("keyed", {**QUOTA_SPEC, "apiKeySecretRef": {"name": "k"}})
    plain = quota("plain", QUOTA_SPEC | {"tenantId": "other"})
    lookups = {} if lookup is None else {"keyed": lookup}

    rendering = render_config(policy(), [keyed, plain], lookups)

    verdict = rendering.verdicts["keyed"]
    assert (verdict.accepted, verdict.reason) == (False, reason)
    assert "apiKeySecretRef" in verdict.message
    assert rendering.verdicts["plain"].accepted


def test_one_key_two_tenants_refuses_the_second() -> None:
    digest = "b" * 64
    first = quota("first", {**QUOTA_SPEC, "apiKeySha256": [digest]}, 1)
    second = quota("second", {**QUOTA_SPEC, "apiKeySha256": [digest]}, 2)

    rendering = render_config(policy(), [first, second], {})

    assert rendering.verdicts["first"].accepted
    assert rendering.verdicts["second"].reason == "ConflictingApiKey"
    assert "is also a key of tenant 'first'" in rendering.verdicts["second"].message


def test_invalid_quota_spec_is_refused_with_the_sidecars_message() -> None:
    bad = quota("bad", {**QUOTA_SPEC, "weight": 0})
    good = quota("good", QUOTA_SPEC)

    rendering = render_config(policy(), [bad, good], {})

    assert rendering.verdicts["bad"].reason == "InvalidSpec"
    assert "spec.weight: must be > 0" in rendering.verdicts["bad"].message
    assert loads_config(rendering.configmap_data["config.yaml"]).tenants == (
        TenantConfig("good", 1.0, 1000, 100.0),
    )


def test_invalid_policy_refuses_every_quota_and_publishes_nothing() -> None:
    # Passes each field's CEL bounds but breaks the cross-field rule (as if CEL were bypassed).
    rendering = render_config(
        policy({"batchKvWatermark": 0.95, "interactiveKvWatermark": 0.9}), lesson_quotas(), {}
    )

    assert rendering.policy_error is not None
    assert "batchKvWatermark" in rendering.policy_error
    assert {v.reason for v in rendering.verdicts.values()} == {"PolicyInvalid"}
    assert (rendering.version, dict(rendering.configmap_data)) == ("", {})


def test_no_accepted_tenant_publishes_nothing() -> None:
    rendering = render_config(policy(), [quota("bad", {**QUOTA_SPEC, "weight": -1})], {})
    assert rendering.policy_error is None
    assert (rendering.version, rendering.tenants) == ("", 0)
    assert render_config(policy(), [], {}).version == ""


def test_budgets_are_divided_across_ready_sidecars() -> None:
    whole = render_config(policy(), lesson_quotas(), {}, ready_replicas=1)
    # 0 ready sidecars counts as 1: the first pod to come up gets the whole quota.
    assert render_config(policy(), lesson_quotas(), {}, ready_replicas=0).version == whole.version

    shared = render_config(policy(), lesson_quotas(), {}, ready_replicas=4)

    assert shared.replicas == 4
    assert shared.version != whole.version
    chat = loads_config(shared.configmap_data["config.yaml"]).tenant("tenant_chat_pro")
    assert chat.burst_service_tokens == 12_000  # 48000 // 4
    assert chat.sustained_service_tokens_per_second == 45_000.0  # 180000 / 4
    assert chat.weight == 2.0  # weights are relative: unchanged


def test_enforcement_passes_through_to_the_document() -> None:
    # Shadow mode (issue 32): the policy's and a quota's own enforcement reach the sidecars'
    # document; without it the document (and its version) is the one rendered before.
    before = render_config(policy(), lesson_quotas(), {})
    enforce = render_config(policy({"enforcement": "Enforce"}), lesson_quotas(), {})
    assert enforce.version == before.version
    quotas = lesson_quotas()
    first = quotas[0]
    quotas[0] = quota(first.name, {**first.spec, "enforcement": "Enforce"}, 1)
    shadow = render_config(policy({"enforcement": "Shadow"}), quotas, {})
    assert shadow.policy_error is None
    config = loads_config(shadow.configmap_data["config.yaml"])
    assert config.policy.enforcement == "Shadow"
    assert [t.enforcement for t in config.tenants] == ["Enforce", None, None]
    assert shadow.version != before.version
    refused = render_config(policy({"enforcement": "DryRun"}), lesson_quotas(), {})
    assert refused.policy_error is not None
    assert "enforcement: must be one of Enforce, Shadow" in refused.policy_error
