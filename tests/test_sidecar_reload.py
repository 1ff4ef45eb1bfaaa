"""Hot reload of the config file and the sidecar's settings sources.

Behaviours: a valid change (new version, new key, new weight) applies while a request is queued and
another runs — neither is dropped; an invalid change is refused, counted in
``tokenfair_config_reloads_total{result="invalid"}`` and the last good config stays; the
``sidecar:`` section is read from a TokenfairConfig document and checked (unknown keys, bad values,
cross-field rules); the estimator's arithmetic; request records replay through the trace reader.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    start,
    wait_for,
)

from tokenfair_sidecar.config import ConfigError, PolicyConfig, config_to_document
from tokenfair_sidecar.records import read_trace
from tokenfair_sidecar.server import load_sidecar_file
from tokenfair_sidecar.server.auth import key_sha256
from tokenfair_sidecar.server.estimate import EstimateError, chars4, decode_tokens
from tokenfair_sidecar.server.settings import SidecarSettings, settings_from_section

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sidecar-standalone.yaml"


def write_config(path: Path, document: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(document), encoding="utf-8")


async def test_valid_reload_applies_without_dropping_requests_and_invalid_is_refused(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # KV held only while running (factor 1); queued requests may wait 60 model s.
    policy = PolicyConfig(max_interactive_wait_ms=60_000, kv_residency_factor=1.0)
    config = keyed_config(policy)
    path = tmp_path / "tokenfair.yaml"
    document = config_to_document(config)
    write_config(path, document)
    loaded = load_sidecar_file(path)
    settings = SidecarSettings(time_scale=10.0, max_in_flight=1, reload_interval_s=0.02,
                               records_path=str(tmp_path / "records.jsonl"))  # fmt: skip
    clients = await start(
        aiohttp_client, loaded.config, settings, config_path=path, config_sha256=loaded.sha256
    )
    sidecar, proxy = clients.sidecar, clients.proxy
    # 1000 + 4 * 750 = 4000 service tokens: 89 model ms, 0.89 s real at time_scale 10.
    running = asyncio.create_task(
        proxy.post(
            "/v1/completions", json=completion_body(1000, 750), headers={"Authorization": CHAT}
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    queued = asyncio.create_task(
        proxy.post("/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT})
    )
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 1)

    tenants: list[dict[str, Any]] = document["tenants"]  # type: ignore[assignment]
    tenants[0]["weight"] = 3.0
    tenants[0]["apiKeySha256"] = [key_sha256("sk-rotated")]
    write_config(path, {**document, "version": "test-2"})
    assert await wait_for(lambda: sidecar.config.version == "test-2")
    assert sidecar.scheduler.tenants["tenant_chat_pro"].config.weight == 3.0
    assert sidecar.scheduler.books().queued_requests == 1  # still queued, not dropped

    path.write_text("apiVersion: tokenfair.io/v1alpha1\nkind: TokenfairConfig\ntenants: 3\n")
    invalid = sidecar.metrics.reloads.labels("invalid")
    assert await wait_for(lambda: invalid._value.get() == 1)
    assert sidecar.config.version == "test-2"

    assert (await running).status == 200
    assert (await queued).status == 200
    # The old key was rotated out with the reload; the new one works.
    old = await proxy.post(
        "/v1/completions", json=completion_body(1, 1), headers={"Authorization": CHAT}
    )
    assert old.status == 401
    new = await proxy.post(
        "/v1/completions",
        json=completion_body(1, 1),
        headers={"Authorization": "Bearer sk-rotated"},
    )
    assert new.status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    metrics = await (await clients.admin.get("/metrics")).text()
    assert 'tokenfair_config_reloads_total{result="applied"} 1.0' in metrics
    assert 'tokenfair_config_reloads_total{result="invalid"} 1.0' in metrics
    assert 'version="test-2"' in metrics
    assert len(read_trace(tmp_path / "records.jsonl")) == 3


def test_sidecar_section_is_read_and_checked(tmp_path: Path) -> None:
    loaded = load_sidecar_file(EXAMPLE)
    assert [t.tenant_id for t in loaded.config.tenants] == [
        "tenant_chat_pro",
        "tenant_ide_assist",
        "tenant_batch_rag",
    ]
    assert loaded.config.tenant("tenant_chat_pro").api_key_sha256 == (
        key_sha256("sk-local-chat-pro"),
    )
    settings = settings_from_section(loaded.section)
    assert settings.listen == "127.0.0.1:8080"
    assert settings.backend == "costmodel"
    with pytest.raises(ConfigError, match="unknown field"):
        settings_from_section({"listn": "x"})
    with pytest.raises(ConfigError, match=r"sidecar\.timeScale: must be > 0"):
        settings_from_section({"timeScale": 0})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        settings_from_section({"listen": "8080"})
    with pytest.raises(ConfigError, match="upstream URL"):
        settings_from_section({"backend": "openai"})
    with pytest.raises(ConfigError, match="defaultDecodeTokens"):
        settings_from_section({"defaultDecodeTokens": 10, "maxDecodeTokens": 5})


def test_prompt_and_decode_estimates() -> None:
    # 9 characters -> ceil(9 / 4) = 3 tokens.
    assert chars4({"prompt": "123456789"}) == 3
    assert chars4({"prompt": ["1234", "5678"]}) == 2
    # Per message ceil(chars / 4) + 4: (ceil(5 / 4) + 4) + (ceil(8 / 4) + 4) = 6 + 6.
    messages = [
        {"role": "system", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "12345678"}]},
    ]
    assert chars4({"messages": messages}) == 12
    assert decode_tokens({}, default=256, cap=1000) == 256
    assert decode_tokens({"max_tokens": 7, "max_completion_tokens": 9}, 256, 1000) == 9
    for bad in (0, -1, 1.5, "7", True, 1001):
        with pytest.raises(EstimateError) as caught:
            decode_tokens({"max_tokens": bad}, 256, 1000)
        assert caught.value.param == "max_tokens"
