"""Hot reload of the config file and the sidecar's settings sources.

Behaviours: a valid change (new version, new key, new weight) applies while a request is queued and
another runs — neither is dropped; an invalid change is refused, counted in
``tokenfair_config_reloads_total{result="invalid"}`` and the last good config stays; the
``sidecar:`` section is read from a TokenfairConfig document and checked (unknown keys, bad values,
cross-field rules); the estimator's arithmetic; request records replay through the trace reader;
the hot-path rewrites keep their output: ``decision_to_json`` equals ``dataclasses.asdict`` (key
order included), ``include_usage`` spliced into a raw body decodes to the body plus the option,
and the buffered record writer writes every line once. The watcher survives anything: a
400-digit integer and 5,000-deep YAML are refused by name, an unexpected failure while applying
is counted (``result="error"``) and logged once and retried every tick until it applies (a key
revocation after all that still takes effect), and an unreadable file is read again on the next
tick without its mtime changing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import REPO_ROOT
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    one_running_one_queued,
    start,
    wait_for,
)

from tokenfair.config import (
    Config,
    ConfigError,
    PolicyConfig,
    api_key_digest,
    config_to_document,
    document,
    files,
)
from tokenfair.core import Decision
from tokenfair.records.codec import decision_to_json, read_trace
from tokenfair.server import LoadedFile, load_sidecar_file
from tokenfair.server.backends.openai import with_include_usage
from tokenfair.server.estimate import EstimateError, chars4, decode_tokens
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.reload import ConfigWatcher
from tokenfair.server.runtime_settings import (
    SidecarSettings,
    loads_sidecar_file,
    settings_from_section,
)

pytestmark = pytest.mark.virtual_time

EXAMPLE = REPO_ROOT / "examples" / "sidecar-standalone.yaml"


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
    # One running (0.89 s real at time_scale 10), one queued behind it.
    running, queued = await one_running_one_queued(proxy, sidecar)

    tenants: list[dict[str, Any]] = document["tenants"]  # type: ignore[assignment]
    tenants[0]["weight"] = 3.0
    tenants[0]["apiKeySha256"] = [api_key_digest("sk-rotated")]
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
    await assert_key_rotated(proxy)
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
        api_key_digest("sk-local-chat-pro"),
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
    for url, rule in (
        ("127.0.0.1:8000", "must start with http:// or https://"),
        ("http://user:pw@vllm:8000", "must not carry credentials"),
        ("http://vllm:8000/v1?x=1", "must not have a query"),
        ("http://vllm:99999", "not a valid URL"),
    ):
        with pytest.raises(ConfigError, match=rf"^upstreamUrl: {rule}"):
            settings_from_section({"backend": "openai", "upstreamUrl": url})
    settings = settings_from_section({"backend": "openai", "upstreamUrl": "https://vllm/base/"})
    assert settings.upstream_url == "https://vllm/base/"
    with pytest.raises(ConfigError, match="defaultDecodeTokens"):
        settings_from_section({"defaultDecodeTokens": 10, "maxDecodeTokens": 5})


@pytest.mark.parametrize("key", ["timeScale", "maxInFlight", "listen", "backend"])
def test_a_sidecar_section_alias_bomb_makes_a_short_error_message(key: str) -> None:
    """The reviewer's alias bomb in the ``sidecar:`` section: nested lists of 10**6 strings,
    read from the file, shown bounded in the error (a message of 100 MB before)."""
    anchors = ['&a0 ["xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx"]']
    anchors += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    bomb = f"[{', '.join(anchors)}]"  # a few hundred bytes of YAML
    document = EXAMPLE.read_text(encoding="utf-8").replace(
        "sidecar:\n", f"sidecar:\n  bomb: {bomb}\n", 1
    )
    loaded = loads_sidecar_file(document.encode(), "bomb.yaml")
    with pytest.raises(ConfigError) as caught:
        settings_from_section({key: loaded.section["bomb"]})
    assert f"sidecar.{key}: must be" in str(caught.value)
    assert len(str(caught.value)) < 500


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


def test_decision_to_json_is_asdict_field_by_field() -> None:
    decision = Decision(
        "r-1", "tenant_chat_pro", "batch", 429, "shed_tenant_token_quota", "budget", 1360, 12.5,
        0.25, 3.0, 0.0, None, 840.0, None, {"bucket_service_tokens": 17.5},
    )  # fmt: skip
    for policy in (None, "tokenfair"):
        expected = dataclasses.asdict(decision)
        del expected["would_refuse"]  # written only when set (shadow mode)
        if policy is not None:
            expected = {"policy": policy, **expected}
        got = decision_to_json(decision, policy)
        assert list(got.items()) == list(expected.items())
        assert got["observed"] is not decision.observed  # a copy, as asdict makes


def test_include_usage_is_spliced_into_the_raw_body() -> None:
    for body in ({"prompt": "x", "stream": True}, {}):
        raw = b"  " + json.dumps(body).encode()
        spliced = with_include_usage(raw)
        assert spliced is not None
        assert json.loads(spliced) == {**body, "stream_options": {"include_usage": True}}
    # UTF-16 is valid JSON for json.loads but does not start with "{": no splice.
    assert with_include_usage(json.dumps({"a": 1}).encode("utf-16")) is None


def test_buffered_record_writer_writes_each_line_once(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"

    async def write_three() -> None:
        writer = RecordWriter(path)
        writer.write('{"n":1}')
        writer.write('{"n":2}')
        assert path.read_text() == ""  # queued until the loop turns
        await asyncio.sleep(0)
        assert path.read_text() == '{"n":1}\n{"n":2}\n'
        writer.write('{"n":3}')
        writer.close()  # flushes what is queued

    asyncio.run(write_three())
    assert path.read_text().splitlines() == ['{"n":1}', '{"n":2}', '{"n":3}']


def deep_yaml(levels: int) -> str:
    """A config document whose version is a list nested ``levels`` deep (flow style)."""
    return (
        "apiVersion: tokenfair.io/v1alpha1\nkind: TokenfairConfig\n"
        f"version: {'[' * levels}{']' * levels}\ntenants: []\n"
    )


async def test_the_watcher_survives_anything_and_applies_a_later_revocation(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = keyed_config()
    path = tmp_path / "tokenfair.yaml"
    document = config_to_document(config)
    write_config(path, document)
    loaded = load_sidecar_file(path)
    settings = SidecarSettings(time_scale=0.01, reload_interval_s=0.02)
    clients = await start(
        aiohttp_client, loaded.config, settings, config_path=path, config_sha256=loaded.sha256
    )
    sidecar, proxy = clients.sidecar, clients.proxy
    reloads = sidecar.metrics.reloads

    def count(result: str) -> float:
        value: float = reloads.labels(result)._value.get()
        return value

    # A 401-digit integer: a ConfigError naming the field, not an OverflowError.
    tenants: list[dict[str, Any]] = document["tenants"]  # type: ignore[assignment]
    huge = [dict(tenants[0], weight=10**400), *tenants[1:]]
    path.write_text(yaml.safe_dump({**document, "tenants": huge}), encoding="utf-8")
    assert await wait_for(lambda: count("invalid") == 1)
    assert "weight: must be at most" in caplog.text
    # 5,000 levels of YAML nesting: a ConfigError, not a RecursionError.
    path.write_text(deep_yaml(5000), encoding="utf-8")
    assert await wait_for(lambda: count("invalid") == 2)
    assert "nested too deeply" in caplog.text

    # Applying fails unexpectedly three times (an injected fault in the core's reconfigure):
    # counted and logged once, retried on every tick without the file changing, then applied.
    reconfigure = sidecar.scheduler.reconfigure
    calls: list[str] = []

    def flaky(new_config: Config, now_ms: float) -> None:
        calls.append(new_config.version)
        if len(calls) <= 3:
            raise RuntimeError("injected reconfigure failure")
        reconfigure(new_config, now_ms)

    monkeypatch.setattr(sidecar.scheduler, "reconfigure", flaky)
    revoked = [dict(tenants[0], apiKeySha256=[api_key_digest("sk-rotated")]), *tenants[1:]]
    path.write_text(
        yaml.safe_dump({**document, "version": "test-2", "tenants": revoked}), encoding="utf-8"
    )
    assert await wait_for(lambda: sidecar.config.version == "test-2")
    assert calls == ["test-2"] * 4
    assert count("error") == 1
    logged = [r for r in caplog.records if "injected reconfigure failure" in r.getMessage()]
    assert len(logged) == 1  # once, with its traceback
    assert logged[0].exc_info is not None
    assert count("applied") == 1
    await assert_key_rotated(proxy)  # the revocation applies
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    metrics = await (await clients.admin.get("/metrics")).text()
    assert 'tokenfair_config_reloads_total{result="error"} 1.0' in metrics


def test_an_unreadable_file_is_retried_every_tick_until_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that cannot be read (EACCES until a chmod, which changes no mtime) is reported
    once and read again on each tick, then applied. Read failures are injected: the tests run
    as root, whom file modes do not stop."""
    path = tmp_path / "tokenfair.yaml"
    write_config(path, config_to_document(keyed_config()))
    applied: list[str] = []
    refused: list[str] = []
    failed: list[str] = []
    watcher = ConfigWatcher(path, "", applied_version(applied), refused.append, failed.append)
    readable = False
    real_read = files.read_regular

    def read_regular(file: str | Path, max_bytes: int) -> bytes:
        if Path(file) == path and not readable:
            raise PermissionError(13, "Permission denied")
        return real_read(file, max_bytes)

    monkeypatch.setattr(document, "read_regular", read_regular)
    write_config(path, {**config_to_document(keyed_config()), "version": "test-2"})
    for _ in range(3):
        watcher.tick()
    assert refused == [f"{path}: cannot read (Permission denied)"]  # once, not per tick
    readable = True  # the chmod: nothing about the file's stat changes
    watcher.tick()
    assert applied == ["test-2"]
    assert not failed
    watcher.tick()  # nothing changed since: nothing happens
    assert applied == ["test-2"]
    assert len(refused) == 1


def applied_version(versions: list[str]) -> Callable[[LoadedFile], None]:
    return lambda loaded: versions.append(loaded.config.version)


async def assert_key_rotated(proxy: Any) -> None:
    """The reload rotated tenant_chat_pro's key: the old one is refused, the new one served."""
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
