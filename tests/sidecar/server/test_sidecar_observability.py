"""The sidecar's access log, its new metrics and the CLI flags of its observability settings.

* Access log: exactly one line per request on ``tokenfair.access`` — served (usage, estimate and
  settlement, timings, route, model), refused at admission (429, with its gate and reason),
  answered before admission (401, 404: no tenant, the error code as reason) — in JSON by
  default, logfmt with ``text``, nothing with ``off``; a logger that fails costs neither the
  request's record, its metrics nor its slot (the books end at zero).
* Metrics (real scrapes over loopback): end-to-end latency, prompt and completion tokens and
  TTFT per tenant and lane, requests in flight (a running and a queued one count, then none),
  the ``process_*`` family (Linux).
* Flags: ``--served-model-name``, ``--embedding-dimensions``, ``--upstream-api-key-file``,
  ``--ietf-ratelimit-headers``, ``--access-log``, ``--tracing``, ``--tracing-endpoint`` land in
  the settings over the file's ``sidecar:`` section, checked by the section's own parsers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import pytest
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    one_running_one_queued,
    start,
)

from tokenfair.config import ConfigError, PolicyConfig
from tokenfair.server.accesslog import ACCESS_LOGGER, AccessLog, format_line
from tokenfair.server.runtime_settings import SidecarSettings, settings_from_section

SERVED_FIELDS = {
    "time", "request_id", "tenant", "priority_class", "method", "route", "model", "status",
    "reason", "gate", "prompt_tokens_estimated", "completion_tokens_estimated",
    "service_tokens_estimated", "prompt_tokens", "completion_tokens", "service_tokens_settled",
    "queue_wait_ms", "ttft_ms", "e2e_ms",
}  # fmt: skip


def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (None if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric != name:
            continue
        found = dict(
            part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part
        )
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    return None


async def test_one_json_line_per_request_served_refused_and_unadmitted(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    # Burst 5000, refill 1000 tokens/s; each request is 1000 + 4 * 750 = 4000 service tokens, so
    # the second finds 1000 + e in the bucket and cannot wait the 3000 - e ms (limit 420 ms).
    config = keyed_config(
        PolicyConfig(), burst_service_tokens=5000, sustained_service_tokens_per_second=1000.0
    )
    clients = await start(aiohttp_client, config, SidecarSettings(time_scale=1.0))
    proxy = clients.proxy
    body = completion_body(1000, 750)
    served = await proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert served.status == 200
    await served.read()
    refused = await proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert refused.status == 429
    assert (await proxy.post("/v1/completions", json=body)).status == 401
    assert (await proxy.get("/nowhere")).status == 404
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS

    records = access_lines(caplog)
    assert len(records) == 4
    lines = [json.loads(r.getMessage()) for r in records]
    assert [line["status"] for line in lines] == [200, 429, 401, 404]
    for record, line in zip(records, lines, strict=True):
        assert record.access == line  # type: ignore[attr-defined]

    ok = lines[0]
    assert set(ok) == SERVED_FIELDS
    assert ok["request_id"] == served.headers["x-request-id"]
    assert (ok["tenant"], ok["priority_class"]) == ("tenant_chat_pro", "interactive")
    assert (ok["method"], ok["route"], ok["model"]) == ("POST", "/v1/completions", "m")
    assert (ok["reason"], ok["gate"]) == ("admitted", "dispatch")
    assert ok["prompt_tokens_estimated"] == 1000
    assert ok["completion_tokens_estimated"] == 750
    assert ok["service_tokens_estimated"] == 4000
    # The cost-model engine reports the prompt as estimated and generates max_tokens.
    assert (ok["prompt_tokens"], ok["completion_tokens"]) == (1000, 750)
    assert ok["service_tokens_settled"] == 4000
    assert 0 <= ok["queue_wait_ms"] <= ok["ttft_ms"] <= ok["e2e_ms"]
    assert ok["time"].endswith("Z")

    shed = lines[1]
    assert shed["request_id"] == refused.headers["x-request-id"]
    assert (shed["status"], shed["reason"], shed["gate"]) == (
        429,
        "shed_tenant_token_quota",
        "admission",
    )
    assert shed["route"] == "/v1/completions"
    assert shed["model"] is None  # never ran: the body's model is the backend call's
    assert shed["service_tokens_estimated"] == 4000
    assert shed["service_tokens_settled"] == 0
    assert shed["prompt_tokens"] is None
    assert shed["ttft_ms"] is None

    for line, reason in ((lines[2], "invalid_api_key"), (lines[3], "not_found")):
        assert line["reason"] == reason
        assert line["request_id"] is None
        assert line["tenant"] is None
        assert line["e2e_ms"] >= 0
    assert lines[3]["method"] == "GET"


async def test_text_format_and_off(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(
        time_scale=0.01, access_log="text"))  # fmt: skip
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json={"model": "my model", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 3},
        headers={"Authorization": CHAT},
    )  # fmt: skip
    assert response.status == 200
    await response.read()
    (record,) = access_lines(caplog)
    text = record.getMessage()
    assert " tenant=tenant_chat_pro " in text
    assert ' model="my model" ' in text  # quoted: it holds a space
    assert " status=200 reason=admitted " in text
    assert " route=/v1/chat/completions " in text
    assert " completion_tokens=3 " in text
    caplog.clear()

    quiet = await start(aiohttp_client, keyed_config(), SidecarSettings(
        time_scale=0.01, access_log="off"))  # fmt: skip
    assert quiet.sidecar.outcomes.access_log is None
    response = await quiet.proxy.post(
        "/v1/completions", json=completion_body(10, 2), headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert (await quiet.proxy.post("/v1/completions", json=completion_body(1, 1))).status == 401
    assert access_lines(caplog) == []


def test_logfmt_values() -> None:
    fields: dict[str, Any] = {"a": None, "b": 'say "hi"', "c": 1.5, "d": 2.0, "e": "", "f": 7}
    assert format_line(fields, "text") == 'a=null b="say \\"hi\\"" c=1.5 d=2 e="" f=7'
    assert json.loads(format_line(fields, "json")) == fields


class FailingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("the access logger broke")


async def test_a_failing_access_logger_loses_neither_record_metrics_nor_slot(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    logger = logging.getLogger(ACCESS_LOGGER)
    failing = FailingFilter()
    logger.addFilter(failing)
    try:
        records = tmp_path / "records.jsonl"
        clients = await start(aiohttp_client, keyed_config(), SidecarSettings(
            time_scale=0.01, records_path=str(records)))  # fmt: skip
        for _ in range(2):
            response = await clients.proxy.post(
                "/v1/completions", json=completion_body(10, 2), headers={"Authorization": CHAT}
            )
            assert response.status == 200
        assert (
            await clients.proxy.post("/v1/completions", json=completion_body(1, 1))
        ).status == 401
        assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
        text = await (await clients.admin.get("/metrics")).text()
    finally:
        logger.removeFilter(failing)
    assert sample(text, "tokenfair_admitted_requests_total", tenant="tenant_chat_pro") == 2.0
    failures = [r for r in caplog.records if "access log line failed" in r.getMessage()]
    assert len(failures) == 3
    await clients.proxy.close()  # the records file is closed (flushed) by the app's cleanup
    assert len(records.read_text().splitlines()) == 2


def test_access_log_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="json or text"):
        AccessLog("xml")
    with pytest.raises(ConfigError, match=r"sidecar\.accessLog: must be one of json, text, off"):
        settings_from_section({"accessLog": "xml"})


async def test_latency_tokens_ttft_per_tenant_in_flight_and_process_metrics(
    aiohttp_client: ClientFactory,
) -> None:
    # time_scale 10: the first request runs 89 model ms = 0.89 s of real time, so the second
    # reaches the queue behind it even on a loaded machine (at 1.0 it once finished first).
    clients = await start(
        aiohttp_client, keyed_config(), SidecarSettings(time_scale=10.0, max_in_flight=1)
    )
    proxy, sidecar, admin = clients.proxy, clients.sidecar, clients.admin
    running, queued = await one_running_one_queued(proxy, sidecar)
    text = await (await admin.get("/metrics")).text()
    assert sample(text, "tokenfair_in_flight_requests") == 2.0  # one running, one queued
    assert (await running).status == 200
    assert (await queued).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    text = await (await admin.get("/metrics")).text()
    assert sample(text, "tokenfair_in_flight_requests") == 0.0
    chat = {"tenant": "tenant_chat_pro", "lane": "interactive"}
    # Usage as the cost-model engine reported it: 1000 + 10 prompt, 750 + 10 completion tokens.
    assert sample(text, "tokenfair_prompt_tokens_total", **chat) == 1010.0
    assert sample(text, "tokenfair_completion_tokens_total", **chat) == 760.0
    assert sample(text, "tokenfair_e2e_request_latency_seconds_count", **chat) == 2.0
    assert sample(text, "tokenfair_time_to_first_token_seconds_count", **chat) == 2.0
    # The first ran ~89 model ms (4000 service tokens at 45 tokens/ms): past the 0.05 s bound.
    assert sample(text, "tokenfair_e2e_request_latency_seconds_bucket", le="0.05", **chat) in (
        0.0, 1.0,
    )  # fmt: skip
    assert sample(text, "tokenfair_e2e_request_latency_seconds_bucket", le="600.0", **chat) == 2.0
    assert sample(text, "tokenfair_ttft_seconds_count", lane="interactive") == 2.0
    if sys.platform == "linux":
        for name in (
            "process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
            "process_max_fds", "process_start_time_seconds", "process_virtual_memory_bytes",
        ):  # fmt: skip
            value = sample(text, name)
            assert value is not None, name
            assert value > 0, name


def parse_flags(*argv: str) -> argparse.Namespace:
    from tokenfair.commands import sidecar as command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    return parser.parse_args(["sidecar", "--config", "x.yaml", *argv])


def test_flags_of_the_file_only_settings_and_observability() -> None:
    from tokenfair.commands.sidecar import settings_for

    section = {"accessLog": "text", "servedModelNames": ["from-file"], "tracing": True}
    assert settings_for(parse_flags(), section).served_model_names == ("from-file",)
    settings = settings_for(
        parse_flags(
            "--served-model-name", "a", "--served-model-name", "b",
            "--embedding-dimensions", "768", "--upstream-api-key-file", "/run/key",
            "--ietf-ratelimit-headers", "--access-log", "off", "--no-tracing",
            "--tracing-endpoint", "http://collector:4318/v1/traces",
        ),
        section,
    )  # fmt: skip
    assert settings.served_model_names == ("a", "b")
    assert settings.embedding_dimensions == 768
    assert settings.upstream_api_key_file == "/run/key"
    assert settings.ietf_ratelimit_headers is True
    assert settings.access_log == "off"
    assert settings.tracing is False
    assert settings.tracing_endpoint == "http://collector:4318/v1/traces"
    defaults = settings_for(parse_flags(), {})
    assert (defaults.access_log, defaults.tracing, defaults.tracing_endpoint) == (
        "json",
        False,
        None,
    )
    with pytest.raises(
        ConfigError, match=r"--embedding-dimensions: must be in \[1, 16384\] \(got 0\)"
    ):
        settings_for(parse_flags("--embedding-dimensions", "0"), {})
    with pytest.raises(ConfigError, match="--tracing-endpoint: must be an http"):
        settings_for(parse_flags("--tracing-endpoint", "collector:4318"), {})
    with pytest.raises(SystemExit):
        parse_flags("--access-log", "xml")


async def test_client_chosen_text_is_bounded_in_the_access_log(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's ``model`` and path are cut to ``MAX_FIELD_CHARS``: no access-log line grows
    with them (a 200 KB ``model`` would otherwise be a 200 KB line)."""
    from tokenfair.server.accesslog import MAX_FIELD_CHARS

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    long_model = "m" * 200_000
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json={"model": long_model, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 3},
        headers={"Authorization": CHAT},
    )  # fmt: skip
    assert response.status == 200
    await response.read()
    lost = await clients.proxy.get("/" + "p" * 4000, headers={"Authorization": CHAT})
    assert lost.status == 404
    served, unrouted = (json.loads(r.getMessage()) for r in access_lines(caplog))
    assert served["model"] == "m" * (MAX_FIELD_CHARS - 1) + "…"
    assert len(unrouted["route"]) == MAX_FIELD_CHARS
    assert all(len(r.getMessage()) < 2048 for r in access_lines(caplog))
