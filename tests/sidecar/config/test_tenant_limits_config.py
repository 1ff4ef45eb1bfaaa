"""The tenant limits beside the budget in the config parser: ``maxConcurrentRequests`` (an
integer in [1, 1000000]) and ``maxKvShare`` (a fraction of ``totalKvBlocks`` in (0, 1], at least
one block): each bad value is refused naming the field and its rule; unset means no limit and
renders nothing; set, they survive the round trip through a rendered document and ``--set``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tokenfair.config import (
    Config,
    ConfigError,
    TenantConfig,
    apply_overrides,
    config_to_document,
    load_config,
    parse_documents,
)

TENANT = {
    "tenantId": "tenant_chat_pro",
    "weight": 2.0,
    "burstServiceTokens": 48000,
    "sustainedServiceTokensPerSecond": 180000,
}


def write(tmp_path: Path, tenant: dict[str, object], total_kv_blocks: int = 1600) -> Path:
    doc = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TokenfairConfig",
        "policy": {"totalKvBlocks": total_kv_blocks},
        "tenants": [tenant],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("maxConcurrentRequests", 0, "must be in [1, 1000000] (got 0)"),
        ("maxConcurrentRequests", -2, "must be in [1, 1000000] (got -2)"),
        ("maxConcurrentRequests", 1_000_001, "must be in [1, 1000000] (got 1000001)"),
        ("maxConcurrentRequests", 2.5, "must be an integer"),
        ("maxConcurrentRequests", "4", "must be an integer"),
        ("maxConcurrentRequests", True, "must be an integer"),
        ("maxKvShare", 0, "must be in (0, 1] (got 0)"),
        ("maxKvShare", 1.5, "must be in (0, 1] (got 1.5)"),
        ("maxKvShare", -0.2, "must be in (0, 1] (got -0.2)"),
        ("maxKvShare", "half", "must be a number"),
    ],
)
def test_a_bad_limit_is_named_with_its_rule(
    tmp_path: Path, field: str, value: object, rule: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, {**TENANT, field: value}))
    assert f"config.yaml: tenants[0].{field}: {rule}" in str(caught.value)


def test_a_kv_share_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, {**TENANT, "maxKvShare": 0.001}, total_kv_blocks=500))
    message = str(caught.value)
    assert "tenants[0].maxKvShare: maxKvShare x totalKvBlocks must be at least one KV block" in (
        message
    )
    assert "(got 0.001 x 500)" in message
    # One block exactly is enough.
    loaded = load_config(write(tmp_path, {**TENANT, "maxKvShare": 0.002}, total_kv_blocks=500))
    assert loaded.tenants[0].max_kv_share == 0.002


def test_limits_load_render_and_read_back(tmp_path: Path) -> None:
    limited = {**TENANT, "maxConcurrentRequests": 8, "maxKvShare": 0.25}
    config = load_config(write(tmp_path, limited))
    tenant = config.tenants[0]
    assert (tenant.max_concurrent_requests, tenant.max_kv_share) == (8, 0.25)
    document = config_to_document(config)
    rendered = document["tenants"][0]  # type: ignore[index]
    assert rendered["maxConcurrentRequests"] == 8
    assert rendered["maxKvShare"] == 0.25
    assert parse_documents([document]) == config


def test_unset_limits_are_none_and_render_nothing(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TENANT))
    assert config.tenants[0] == TenantConfig("tenant_chat_pro", 2.0, 48000, 180000.0)
    rendered = config_to_document(config)["tenants"][0]  # type: ignore[index]
    assert "maxConcurrentRequests" not in rendered
    assert "maxKvShare" not in rendered


def test_set_gives_and_checks_limits(tmp_path: Path) -> None:
    config: Config = load_config(write(tmp_path, TENANT))
    changed = apply_overrides(
        config,
        [
            "tenants.tenant_chat_pro.maxConcurrentRequests=3",
            "tenants.tenant_chat_pro.maxKvShare=0.5",
        ],
    )
    assert changed.tenants[0] == dataclasses.replace(
        config.tenants[0], max_concurrent_requests=3, max_kv_share=0.5
    )
    with pytest.raises(ConfigError, match=r"maxKvShare: must be in \(0, 1\] \(got 2\)"):
        apply_overrides(config, ["tenants.tenant_chat_pro.maxKvShare=2"])
