"""The engine in the loop: the sidecar reads the model server's own state, over real HTTP.

Behaviours under test:

- the metrics parser: vLLM's page (HELP/TYPE lines, labels, several series of one name summed,
  the KV ratio averaged, ``vllm:cache_config_info``'s labels), SGLang's, custom names; a page
  without the KV-usage metric gives no report; values out of range are clamped;
- ``/v1/models``' ``max_model_len`` and ``/openapi.json``'s POST routes;
- a live sidecar (``openai`` backend) in front of a fake engine (a real aiohttp server): it adopts
  the engine's block size and block count, its KV gates see the engine's usage (``/status``
  ``kv``, ``tokenfair_kv_occupancy_ratio``), a route the engine lacks is ``404
  route_not_served`` and a ``max_tokens`` past the context ``400 context_length_exceeded``, both
  before admission (nothing queued, charged or recorded as served); when the engine's metrics
  stop answering, the gates fall back to the books visibly (``/status``, the
  ``tokenfair_engine_metrics_fresh`` gauge) and come back when it answers again;
- a report goes stale on the engine state's clock, and a slow read of the engine's models and
  routes never holds it fresh longer than the stale limit and one failed poll (virtual time);
- the settings: ``engineMetrics`` modes, custom names required for ``custom``, bounds by name,
  ``kvPromptRatio`` (``learned`` or ``off``).

Timing: the poller runs every 20 ms against a loopback server; tests wait for the conditions
(generous deadlines), never for a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from clock_support import ManualClock, run_virtual
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    keyed_config,
    start,
)

from tokenfair.config import ConfigError, PolicyConfig
from tokenfair.config.document import load_documents
from tokenfair.server.clock import ModelClock
from tokenfair.server.engine_state import (
    ENGINES,
    LIMITS_REFRESH_S,
    EngineMetricNames,
    EngineState,
    parse_engine_metrics,
    parse_models,
    parse_routes,
)
from tokenfair.server.runtime_settings import SidecarSettings, settings_from_section

pytestmark = pytest.mark.virtual_time

ServerFactory = Callable[..., Awaitable[TestServer]]

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",num_gpu_blocks="2048",num_cpu_blocks="None"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1234.0
"""  # noqa: E501 - one exposition line, as vLLM writes it

SGLANG_PAGE = """\
sglang:token_usage{model_name="m"} 0.4
sglang:num_running_reqs{model_name="m"} 7
sglang:num_queue_reqs{model_name="m"} 5
"""


def test_vllms_page_is_read_summed_and_averaged() -> None:
    report = parse_engine_metrics(VLLM_PAGE, ENGINES["vllm"])
    assert report is not None
    assert report.kv_usage_ratio == 0.5  # the two ranks' ratios averaged
    assert (report.running, report.waiting) == (4.0, 2.0)  # summed over the ranks
    assert (report.block_size, report.num_blocks) == (32, 2048)
    assert parse_engine_metrics(VLLM_PAGE, ENGINES["sglang"]) is None  # no such names there


def test_sglang_custom_missing_and_out_of_range() -> None:
    report = parse_engine_metrics(SGLANG_PAGE, ENGINES["sglang"])
    assert report is not None
    assert (report.kv_usage_ratio, report.running, report.waiting) == (0.4, 7.0, 5.0)
    assert report.block_size is None
    custom = EngineMetricNames(kv_usage_ratio=("my_kv",), running=(), waiting=("my_queue",))
    page = "my_kv 1.7\nmy_queue -3\nmy_kv_other 0.1\n"
    custom_report = parse_engine_metrics(page, custom)
    assert custom_report is not None
    assert (custom_report.kv_usage_ratio, custom_report.waiting) == (1.0, 0.0)  # clamped
    assert custom_report.running is None  # not named: not known
    for broken in ("", "my_kv NaN\n", "my_kv abc\n", "# my_kv 0.5\n", "my_kv_x 0.5\n"):
        assert parse_engine_metrics(broken, custom) is None, broken


def test_models_and_routes() -> None:
    models = {
        "data": [
            {"id": "tiny", "max_model_len": 4096},
            {"id": "no-length"},
            {"id": "bad", "max_model_len": True},
            "garbage",
        ]
    }
    assert parse_models(json.dumps(models).encode()) == {"tiny": 4096}
    assert parse_models(b"not json") == {}
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": {}},
        "/v1/models": {"get": {}},
        "/health": {},
    }
    assert parse_routes(json.dumps({"paths": paths}).encode()) == frozenset(
        {"/v1/chat/completions"}
    )
    assert parse_routes(b"[]") is None


def test_settings_by_name() -> None:
    settings = settings_from_section({"engineMetrics": "sglang", "engineMetricsPath": "/m"})
    assert (settings.engine_metrics, settings.engine_metrics_path) == ("sglang", "/m")
    assert settings.kv_prompt_ratio == "learned"
    assert settings_from_section({"kvPromptRatio": "off"}).kv_prompt_ratio == "off"
    assert settings.kv_decode_booking == "upfront"
    assert settings_from_section({"kvDecodeBooking": "engine"}).kv_decode_booking == "engine"
    assert settings_from_section({"kvDecodeBooking": "peak"}).kv_decode_booking == "peak"
    refused: list[tuple[dict[str, object], str]] = [
        ({"engineMetrics": "prometheus"}, "sidecar.engineMetrics: must be one of auto"),
        ({"engineMetricsPath": "metrics"}, "sidecar.engineMetricsPath: must be a path"),
        ({"engineMetricsIntervalSeconds": 0}, "sidecar.engineMetricsIntervalSeconds: must be in"),
        ({"engineKvUsageMetric": "kv usage"}, "sidecar.engineKvUsageMetric: must be a Prom"),
        ({"engineMetrics": "custom"}, "engineMetrics: custom needs engineKvUsageMetric"),
        ({"kvPromptRatio": 2}, r"sidecar\.kvPromptRatio: must be one of learned, off \(got 2\)"),
        (
            {"kvDecodeBooking": "lazy"},
            r"sidecar\.kvDecodeBooking: must be one of upfront, engine, peak \(got 'lazy'\)",
        ),
        (
            {"kvDecodeBooking": False},
            r"sidecar\.kvDecodeBooking: must be one of upfront, engine, peak",
        ),
    ]
    for section, message in refused:
        with pytest.raises(ConfigError, match=message):
            settings_from_section(section)


async def test_reports_go_stale_after_stale_s_on_the_engine_states_clock() -> None:
    clock = ManualClock()
    answers: list[tuple[int, bytes]] = [(200, VLLM_PAGE.encode())]
    stale: list[str] = []

    async def get(path: str, timeout_s: float, most_bytes: int) -> tuple[int, bytes]:
        return answers[-1]

    engine = EngineState(
        get, engine="vllm", custom=None, metrics_path="/metrics", interval_s=1.0, stale_s=2.5,
        on_report=lambda report: None, on_stale=stale.append, on_limits=lambda limits: None,
        clock=clock,
    )  # fmt: skip
    await engine.poll_once()
    assert (engine.fresh, engine.last_at_s) == (True, 0.0)
    answers.append((503, b""))  # the engine stops answering
    clock.advance(2.5)
    await engine.poll_once()
    assert (engine.fresh, stale) == (True, [])  # 2.5 s old: not older than stale_s yet
    clock.advance(0.001)
    await engine.poll_once()
    assert not engine.fresh
    assert stale == ["GET /metrics: HTTP 503"]
    answers.append((200, VLLM_PAGE.encode()))
    clock.advance(10.0)
    await engine.poll_once()
    assert engine.fresh
    assert engine.last_at_s == pytest.approx(12.501)


def test_a_slow_read_of_the_engines_limits_never_holds_a_report_fresh_longer() -> None:
    # The engine's /v1/models and /openapi.json hang for their whole timeouts (never read: they
    # are asked again every LIMITS_REFRESH_S), and its metrics stop answering just before the
    # second ask. The last report is declared stale on time: the stale limit and one failed
    # poll, the horizon kvDecodeBooking: engine's allowance covers. (When the limits were read
    # in the poller's loop, the report stayed fresh for 11.25 s here.) Virtual time.
    settings = SidecarSettings()
    interval_s, stale_s = settings.engine_metrics_interval_s, settings.engine_metrics_stale_s
    stale_after_s = stale_s + max(1.0, interval_s) + interval_s  # as server/sidecar.py has it

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        reports: list[float] = []
        stale: list[float] = []

        async def get(path: str, timeout_s: float, most_bytes: int) -> tuple[int, bytes]:
            if path != "/metrics" or loop.time() - start >= LIMITS_REFRESH_S - 0.1:
                await asyncio.sleep(timeout_s)  # no answer within its timeout
                raise TimeoutError(path)
            return 200, VLLM_PAGE.encode()

        engine = EngineState(
            get, engine="vllm", custom=None, metrics_path="/metrics", interval_s=interval_s,
            stale_s=stale_s, on_report=lambda report: reports.append(loop.time() - start),
            on_stale=lambda problem: stale.append(loop.time() - start),
            on_limits=lambda limits: None, clock=ModelClock(),
        )  # fmt: skip
        poller = asyncio.create_task(engine.run())
        await asyncio.sleep(2 * LIMITS_REFRESH_S)
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        last = max(reports)
        return last, min(at for at in stale if at > last)

    last_report_s, stale_at_s = run_virtual(run())
    assert last_report_s > LIMITS_REFRESH_S - 1.0  # polled throughout the first limits' read
    assert stale_at_s - last_report_s <= stale_after_s + 1e-6


def test_an_unquoted_off_in_yaml_is_off() -> None:
    # YAML 1.1 reads an unquoted `off` as the boolean false: each setting with an `off` mode
    # takes it as `off`; true names no mode and is refused, naming the field.
    (document,) = load_documents("sidecar:\n  kvPromptRatio: off\n  engineMetrics: off\n"
                                 "  accessLog: off\n")  # fmt: skip
    assert isinstance(document, dict)
    assert document["sidecar"]["kvPromptRatio"] is False
    settings = settings_from_section(document["sidecar"])
    assert (settings.kv_prompt_ratio, settings.engine_metrics, settings.access_log) == (
        "off", "off", "off",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"sidecar\.kvPromptRatio: must be one of .*\(got True\)"):
        settings_from_section({"kvPromptRatio": True})


class FakeEngine:
    """A real aiohttp server standing in for vLLM: metrics, models, routes, completions."""

    def __init__(self) -> None:
        self.kv_usage = 0.0
        self.metrics_status = 200
        self.requests: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="down")
        page = (
            f'vllm:kv_cache_usage_perc{{model_name="tiny"}} {self.kv_usage}\n'
            'vllm:num_requests_running{model_name="tiny"} 0\n'
            'vllm:num_requests_waiting{model_name="tiny"} 0\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="2000"} 1.0\n'
        )
        return web.Response(text=page, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 4096}]})

    async def openapi(self, request: web.Request) -> web.Response:
        paths: dict[str, Any] = {
            "/v1/chat/completions": {"post": {}},
            "/v1/completions": {"post": {}},
        }
        return web.json_response({"openapi": "3.1.0", "paths": paths})

    async def chat(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        message = {"role": "assistant", "content": "hi"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return web.json_response({"object": "chat.completion", "choices": [choice], "usage": usage})


async def eventually(condition: Callable[[], Awaitable[bool]], budget_s: float = 20.0) -> None:
    """Wait until ``condition()`` holds (polled; a generous deadline for a loaded machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while not await condition():
        assert loop.time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


async def status_of(clients: Clients) -> dict[str, Any]:
    response = await clients.admin.get("/status")
    return dict(await response.json())


async def start_engine_sidecar(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, engine: FakeEngine
) -> Clients:
    server = await aiohttp_server(engine.app())
    settings = SidecarSettings(
        backend="openai",
        upstream_url=str(server.make_url("")).rstrip("/"),
        engine_metrics_interval_s=0.02,
        engine_metrics_stale_s=0.2,
    )
    return await start(aiohttp_client, keyed_config(PolicyConfig()), settings)


async def test_the_sidecar_sees_the_engines_kv_and_falls_back_to_the_books(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    engine = FakeEngine()
    engine.kv_usage = 0.5
    clients = await start_engine_sidecar(aiohttp_client, aiohttp_server, engine)

    async def sees_the_engine() -> bool:
        kv = (await status_of(clients))["kv"]
        return bool(kv["source"] == "engine" and kv["view_blocks"] == 1000)

    await eventually(sees_the_engine)
    status = await status_of(clients)
    # The engine's geometry, not the config's 1600 blocks of 16 tokens.
    assert (status["kv"]["total_blocks"], status["kv"]["block_tokens"]) == (2000, 32)
    assert status["engine"]["fresh"] is True
    assert status["engine"]["max_model_len"] == {"tiny": 4096}
    metrics = await (await clients.admin.get("/metrics")).text()
    assert "tokenfair_engine_metrics_fresh 1.0" in metrics
    assert "tokenfair_kv_occupancy_ratio 0.5" in metrics
    assert "tokenfair_kv_resident_blocks 0.0" in metrics  # the books hold nothing

    engine.metrics_status = 503  # the engine's metrics stop answering

    async def falls_back() -> bool:
        kv = (await status_of(clients))["kv"]
        return bool(kv["source"] == "books" and kv["view_blocks"] == 0)

    await eventually(falls_back)
    status = await status_of(clients)
    assert status["engine"]["problem"] == "GET /metrics: HTTP 503"
    metrics = await (await clients.admin.get("/metrics")).text()
    assert "tokenfair_engine_metrics_fresh 0.0" in metrics
    engine.metrics_status = 200
    await eventually(sees_the_engine)
    # A request through it is served and settled as usual.
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        headers={"Authorization": CHAT},
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_what_the_engine_would_refuse_is_refused_before_admission(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    engine = FakeEngine()
    clients = await start_engine_sidecar(aiohttp_client, aiohttp_server, engine)

    async def limits_known() -> bool:
        return bool((await status_of(clients))["engine"]["max_model_len"])

    await eventually(limits_known)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    too_long = await clients.proxy.post(
        "/v1/chat/completions", json={**chat, "max_tokens": 5000}, headers={"Authorization": CHAT}
    )
    assert too_long.status == 400
    error = (await too_long.json())["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert "4096" in error["message"]
    embeddings = await clients.proxy.post(
        "/v1/embeddings", json={"model": "tiny", "input": "hi"}, headers={"Authorization": CHAT}
    )
    assert embeddings.status == 404
    assert (await embeddings.json())["error"]["code"] == "route_not_served"
    assert engine.requests == []  # neither reached the engine
    fits = await clients.proxy.post(
        "/v1/chat/completions", json={**chat, "max_tokens": 4000}, headers={"Authorization": CHAT}
    )
    assert fits.status == 200  # the prompt's fit is the engine's to judge
    assert engine.requests == ["/v1/chat/completions"]
    assert clients.sidecar.outcomes.tenant_counts["tenant_chat_pro"]["served"] == 1
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_the_costmodel_engine_is_never_polled(tmp_path: Path) -> None:
    from tokenfair.core.cost import CostModel
    from tokenfair.server import Sidecar, make_backend

    settings = SidecarSettings()
    backend = make_backend(settings, CostModel())
    sidecar = Sidecar(settings, keyed_config(), backend)
    assert sidecar.engine is None  # no engine to ask: no poller, books alone
