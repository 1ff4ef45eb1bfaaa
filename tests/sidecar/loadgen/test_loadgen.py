"""`tokenfair loadgen` against a real stub OpenAI-compatible server on loopback.

Behaviours under test:
- prompts are sized so the sidecar's default estimator reads exactly ``prefill_tokens``;
- requests leave in arrival order and never before their scaled send time;
- every request carries its own tenant's ``Authorization: Bearer`` key, its request id, and
  ``x-tokenfair-priority: batch`` when the record is batch;
- the report has `tokenfair simulate`'s shape and counts, with 429 ``error.code``s in
  ``shed_reasons``, ``Retry-After`` and the queue-wait header scaled to model time;
- streaming: TTFT is the first SSE chunk and usage is read from the final chunk;
- per-request and whole-run timeouts and refused connections become counted outcomes;
- ``--records`` lines replay through ``records.read_trace``;
- bad flags exit 2 with a message naming the flag;
- KV occupancy is not visible to a client: without ``--admin`` the report says it was not
  measured (``null``, "not measured live"); with ``--admin`` the sidecar's ``/metrics`` gauge is
  sampled during the run and the peak is the largest sample; an admin port that answers
  nothing useful leaves the figure unmeasured with the reason on stderr;
- end to end: `tokenfair sidecar` (costmodel backend, subprocess) under the noisy-neighbor
  workload never refuses an interactive request and serves every batch one (as the `tokenfair`
  policy does in `tokenfair simulate`), and its admin port's KV gauge, sampled live, peaks
  above 0 and at most 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pty
import socket
import struct
import sys
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from loopback_support import free_ports

from tokenfair import cli
from tokenfair.config import PolicyConfig, build_config, config_to_document
from tokenfair.core import Request
from tokenfair.loadgen import (
    CHARS_PER_TOKEN,
    CLIENT_TIMEOUT,
    CONNECTION_ERROR,
    FALLBACK_MODEL,
    KV_GAUGE,
    NOT_SENT,
    QUEUE_WAIT_HEADER,
    LoadgenSettings,
    gauge_value,
    prompt_for,
    replay,
    to_decision,
)
from tokenfair.records.codec import read_trace
from tokenfair.sim.report import summarize
from tokenfair.sim.scenarios import LESSON_TENANTS, noisy_neighbor

KEYS = {"tenant_a": "key-a", "tenant_b": "key-b", "tenant_c": "key-c"}
LESSON_KEYS = {
    "tenant_chat_pro": "key-chat",
    "tenant_ide_assist": "key-ide",
    "tenant_batch_rag": "key-batch",
}


@dataclass
class Seen:
    request_id: str
    tenant_id: str
    authorization: str
    priority: str | None
    body: dict[str, Any]


@dataclass
class Stub:
    """A small OpenAI-compatible ``/v1/completions`` server; behaviour chosen per tenant."""

    tenants_by_key: dict[str, str]
    refuse: dict[str, str] = field(default_factory=dict)
    """tenant -> error code of a 429 (with ``Retry-After: 2``)."""
    hang: set[str] = field(default_factory=set)
    """Tenants whose requests get no answer until ``release`` is set."""
    answer_delay_s: float = 0.0
    stream_gap_s: float = 0.0
    """Pause between the first SSE chunk and the rest."""
    queue_wait_ms: float | None = None
    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    kv_values: list[float] = field(default_factory=list)
    """Values of the KV gauge its ``/metrics`` serves, one per scrape, the last repeated."""
    scrapes: int = 0
    models_listed: tuple[str, ...] = ("tiny-llama", "other")
    models_asked: int = 0

    async def models(self, request: web.Request) -> web.Response:
        """The target's model list (a sidecar relays its engine's), asked with a tenant's key."""
        authorization = request.headers.get("Authorization", "")
        if authorization.removeprefix("Bearer ") not in self.tenants_by_key:
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        self.models_asked += 1
        listed = [{"id": model, "object": "model"} for model in self.models_listed]
        return web.json_response({"object": "list", "data": listed})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.kv_values:
            return web.Response(text="# nothing here\n")
        value = self.kv_values[min(self.scrapes, len(self.kv_values) - 1)]
        self.scrapes += 1
        text = (
            "# HELP tokenfair_kv_resident_blocks KV blocks reserved.\n"
            "tokenfair_kv_resident_blocks 12.0\n"
            f"# TYPE {KV_GAUGE} gauge\n{KV_GAUGE} {value}\n"
        )
        return web.Response(text=text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        authorization = request.headers.get("Authorization", "")
        tenant = self.tenants_by_key.get(authorization.removeprefix("Bearer "))
        if tenant is None:
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        body = await request.json()
        self.seen.append(
            Seen(
                request.headers["x-request-id"],
                tenant,
                authorization,
                request.headers.get("x-tokenfair-priority"),
                body,
            )
        )
        if tenant in self.refuse:
            return web.json_response(
                {"error": {"message": "no", "type": "x", "code": self.refuse[tenant]}},
                status=429,
                headers={"Retry-After": "2"},
            )
        if tenant in self.hang:
            await self.release.wait()
        await asyncio.sleep(self.answer_delay_s)
        headers = {}
        if self.queue_wait_ms is not None:
            headers[QUEUE_WAIT_HEADER] = str(self.queue_wait_ms)
        usage = {
            "prompt_tokens": math.ceil(len(body["prompt"]) / CHARS_PER_TOKEN),
            "completion_tokens": body["max_tokens"],
        }
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": usage}, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"text":"a"}]}\n\n')
        await asyncio.sleep(self.stream_gap_s)
        for _ in range(3):
            await response.write(b'data: {"choices":[{"text":"b"}]}\n\n')
        final = {"choices": [], "usage": usage}
        await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


StubFactory = Callable[..., Awaitable[tuple[Stub, str]]]


@pytest.fixture
async def stub_server(
    aiohttp_server: Callable[[web.Application], Awaitable[TestServer]],
) -> AsyncIterator[StubFactory]:
    stubs: list[Stub] = []

    async def start(**options: Any) -> tuple[Stub, str]:
        stub = Stub(**options)
        stubs.append(stub)
        app = web.Application()
        app.router.add_post("/v1/completions", stub.completions)
        app.router.add_get("/metrics", stub.metrics)
        app.router.add_get("/v1/models", stub.models)
        server = await aiohttp_server(app)
        return stub, f"http://127.0.0.1:{server.port}"

    yield start
    for stub in stubs:  # let hung handlers finish before the server shuts down
        stub.release.set()


def by_tenant(keys: dict[str, str]) -> dict[str, str]:
    return {key: tenant for tenant, key in keys.items()}


@pytest.mark.parametrize("prefill_tokens", [0, 1, 7, 280, 3200])
def test_prompt_size_matches_the_sidecars_estimator(prefill_tokens: int) -> None:
    estimate = pytest.importorskip("tokenfair.server.estimate")
    assert len(prompt_for(prefill_tokens)) == prefill_tokens * CHARS_PER_TOKEN
    assert estimate.chars4({"prompt": prompt_for(prefill_tokens)}) == prefill_tokens


async def test_sends_in_timeline_order_never_early_with_each_tenants_key(
    stub_server: StubFactory,
) -> None:
    stub, url = await stub_server(tenants_by_key=by_tenant(KEYS))
    # Listed out of order; 60 ms (30 wall ms at time scale 0.5) apart.
    requests = [
        Request("r-4", "tenant_a", 240, 10, 5, "interactive"),
        Request("r-1", "tenant_b", 0, 20, 6, "batch"),
        Request("r-3", "tenant_c", 180, 30, 7, "interactive"),
        Request("r-2", "tenant_a", 120, 40, 8, "interactive"),
        Request("r-0", "tenant_c", 60, 50, 9, "batch"),
    ]
    settings = LoadgenSettings(target_url=url, time_scale=0.5)
    result = await replay(requests, KEYS, settings)

    assert [s.request_id for s in stub.seen] == ["r-1", "r-0", "r-2", "r-3", "r-4"]
    for seen in stub.seen:
        assert seen.authorization == f"Bearer {KEYS[seen.tenant_id]}"
    # Batch records ask for the batch class; interactive ones send no priority header.
    assert {s.request_id: s.priority for s in stub.seen} == {
        "r-0": "batch",
        "r-1": "batch",
        "r-2": None,
        "r-3": None,
        "r-4": None,
    }
    sent = {o.request.request_id: o for o in result.observations}
    for request in requests:
        assert sent[request.request_id].request.tenant_id == request.tenant_id
        # Scheduled at arrival * 0.5 wall ms, e.g. r-4 at 120 ms; never sent before it.
        offset = sent[request.request_id].sent_offset_ms
        assert offset is not None
        assert offset >= request.arrival_ms * 0.5
    bodies = {s.request_id: s.body for s in stub.seen}
    assert bodies["r-2"]["max_tokens"] == 8
    assert len(bodies["r-2"]["prompt"]) == 40 * CHARS_PER_TOKEN
    assert "stream" not in bodies["r-2"]
    # No --model: the target's first listed model, asked once, with a tenant's key.
    assert {s.body["model"] for s in stub.seen} == {"tiny-llama"}
    assert stub.models_asked == 1
    assert result.completed


async def test_a_given_model_is_sent_as_is_and_a_target_listing_none_gets_a_warning(
    stub_server: StubFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stub, url = await stub_server(tenants_by_key=by_tenant(KEYS))
    requests = [Request("r-0", "tenant_a", 0, 10, 5, "interactive")]
    await replay(requests, KEYS, LoadgenSettings(target_url=url, model="mine"))
    assert [s.body["model"] for s in stub.seen] == ["mine"]
    assert stub.models_asked == 0
    empty, empty_url = await stub_server(tenants_by_key=by_tenant(KEYS), models_listed=())
    await replay(requests, KEYS, LoadgenSettings(target_url=empty_url))
    assert [s.body["model"] for s in empty.seen] == [FALLBACK_MODEL]
    assert "--model not given and GET" in caplog.text
    assert "lists no model: pass --model NAME" in caplog.text


async def test_noisy_neighbor_report_counts_and_shed_reasons(stub_server: StubFactory) -> None:
    stub, url = await stub_server(
        tenants_by_key=by_tenant(LESSON_KEYS), refuse={"tenant_batch_rag": "shed_kv_watermark"}
    )
    config, requests = noisy_neighbor()
    settings = LoadgenSettings(
        target_url=url, time_scale=0.01, decode_weight=config.policy.decode_weight
    )
    result = await replay(requests, LESSON_KEYS, settings)
    assert len(stub.seen) == 60
    decisions = [to_decision(o, settings) for o in result.observations]
    summary = summarize(decisions)

    # 18 batch + 24 chat + 18 ide; every batch request refused by the stub.
    assert summary["total_requests"] == 60
    assert summary["admitted_requests"] == 42
    assert summary["shed_429_requests"] == 18
    assert summary["shed_reasons"] == {"shed_kv_watermark": 18}
    tenants = summary["tenants"]
    assert tenants["tenant_batch_rag"]["admitted"] == 0
    assert tenants["tenant_batch_rag"]["shed_429"] == 18
    # chat: 280 + 4 * 90 = 640 per request, x24 = 15360; ide: 420 + 4 * 60 = 660, x18 = 11880.
    assert tenants["tenant_chat_pro"]["admitted_service_tokens"] == 15_360
    assert tenants["tenant_ide_assist"]["admitted_service_tokens"] == 11_880
    refused = [d for d in decisions if d.tenant_id == "tenant_batch_rag"]
    # Retry-After: 2 s of wall time at time scale 0.01 is 2000 / 0.01 = 200000 model ms.
    assert {d.retry_after_ms for d in refused} == {200_000.0}
    assert {d.gate for d in refused} == {"admission"}
    admitted = [d for d in decisions if d.admitted]
    # The stub reports usage = the estimate (prompt sized by the same rule), so actual == estimate.
    assert all(d.actual_service_tokens == d.service_tokens for d in admitted)


async def test_times_are_scaled_back_to_model_time(stub_server: StubFactory) -> None:
    _, url = await stub_server(
        tenants_by_key=by_tenant(KEYS), answer_delay_s=0.05, queue_wait_ms=12.5
    )
    settings = LoadgenSettings(target_url=url, time_scale=0.5)
    result = await replay([Request("r", "tenant_a", 0, 8, 2, "interactive")], KEYS, settings)
    decision = to_decision(result.observations[0], settings)
    assert decision.status_code == 200
    assert decision.reason == "admitted"
    # The stub waits 50 wall ms before answering: at least 50 / 0.5 = 100 model ms.
    assert decision.ttft_ms >= 100.0
    # 12.5 wall ms reported by the header / 0.5 = 25 model ms.
    assert decision.queue_wait_ms == 25.0
    # usage: 8 prompt + 4 * 2 decode = 16 service tokens.
    assert decision.actual_service_tokens == 16


async def test_streaming_ttft_is_the_first_chunk_and_usage_the_last(
    stub_server: StubFactory,
) -> None:
    stub, url = await stub_server(tenants_by_key=by_tenant(KEYS), stream_gap_s=0.2)
    settings = LoadgenSettings(target_url=url, time_scale=1.0, stream=True)
    result = await replay([Request("s", "tenant_b", 0, 12, 3, "batch")], KEYS, settings)
    observation = result.observations[0]
    assert stub.seen[0].body["stream"] is True
    assert stub.seen[0].body["stream_options"] == {"include_usage": True}
    assert observation.status_code == 200
    assert observation.ttft_wall_ms is not None
    assert observation.e2e_wall_ms is not None
    # The stub pauses 200 ms after the first chunk: TTFT taken at the last chunk would leave no
    # gap. Half the pause is asserted, not all of it: a loaded machine may read the first chunk
    # late, which shortens the gap the client sees (a 100 ms bound once saw 97 ms).
    assert observation.e2e_wall_ms - observation.ttft_wall_ms >= 100.0
    assert (observation.prompt_tokens, observation.completion_tokens) == (12, 3)
    # 12 + 4 * 3 = 24 service tokens, from the final chunk's usage.
    assert to_decision(observation, settings).actual_service_tokens == 24


async def test_request_timeouts_are_counted(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(KEYS), hang={"tenant_c"})
    requests = [
        Request("a-0", "tenant_a", 0, 10, 1, "interactive"),
        Request("c-0", "tenant_c", 0, 10, 1, "batch"),
        Request("c-1", "tenant_c", 5, 10, 1, "batch"),
    ]
    settings = LoadgenSettings(target_url=url, request_timeout_s=0.2)
    result = await replay(requests, KEYS, settings)
    summary = summarize(to_decision(o, settings) for o in result.observations)
    assert summary["admitted_requests"] == 1
    assert summary["shed_reasons"] == {CLIENT_TIMEOUT: 2}
    assert summary["shed_429_requests"] == 0
    assert result.completed


async def test_run_timeout_cancels_in_flight_and_unsent(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(KEYS), hang={"tenant_c"})
    requests = [
        Request("c-0", "tenant_c", 0, 10, 1, "batch"),  # hangs past the run's end
        Request("a-late", "tenant_a", 60_000, 10, 1, "interactive"),  # due after the run's end
    ]
    settings = LoadgenSettings(target_url=url, timeout_s=0.3)
    result = await replay(requests, KEYS, settings)
    reasons = {o.request.request_id: o.reason for o in result.observations}
    assert reasons == {"c-0": CLIENT_TIMEOUT, "a-late": NOT_SENT}
    assert not result.completed


async def test_refused_connection_is_counted() -> None:
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = LoadgenSettings(target_url=f"http://127.0.0.1:{port}")
    result = await replay([Request("r", "tenant_a", 0, 1, 1, "interactive")], KEYS, settings)
    assert result.observations[0].reason == CONNECTION_ERROR
    assert result.observations[0].status_code == 0


async def test_cli_json_report_and_records_replay(stub_server: StubFactory, tmp_path: Path) -> None:
    _, url = await stub_server(
        tenants_by_key=by_tenant(LESSON_KEYS),
        refuse={"tenant_batch_rag": "shed_tenant_token_quota"},
    )
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("tenant_chat_pro: key-chat\ntenant_ide_assist: wrong\n")
    records = tmp_path / "live.jsonl"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenfair.cli",
        "loadgen",
        "--target",
        url,
        "--scenario",
        "noisy-neighbor",
        "--keys",
        str(keys_file),
        "--key",
        "tenant_ide_assist=key-ide",  # overrides the file's wrong key
        "--key",
        "tenant_batch_rag=key-batch",
        "--time-scale",
        "0.01",
        "--stream",
        "--format",
        "json",
        "--records",
        str(records),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    report = json.loads(stdout)
    assert set(report) == {"experiment", "decode_weight", "comparison", "run"}
    assert report["run"]["time_scale"] == 0.01
    assert report["run"]["completed"] is True
    live = report["comparison"]["live"]
    assert live["total_requests"] == 60
    assert live["admitted_requests"] == 42  # 24 chat + 18 ide; the 18 batch refused
    assert live["shed_reasons"] == {"shed_tenant_token_quota": 18}
    assert live["tenants"]["tenant_ide_assist"]["admitted"] == 18  # the --key override worked
    # No --admin: the client cannot see KV, so the figure is not measured (not a made-up 0.0).
    assert live["peak_kv_occupancy_ratio"] is None
    assert report["run"]["kv_occupancy"] == {"measured": False}

    replayed = read_trace(records)
    assert len(replayed) == 60
    by_id = {r.request.request_id: r for r in replayed}
    # chat-00 is 280 prompt + 90 output tokens; the stub's usage echoes both.
    assert by_id["chat-00"].actual_prefill_tokens == 280
    assert by_id["chat-00"].actual_decode_tokens == 90
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert {line["policy"] for line in lines} == {"live"}


async def test_cli_table_has_simulates_layout(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(LESSON_KEYS))
    args = ["--target", url, "--scenario", "noisy-neighbor", "--time-scale", "0.01"]
    for tenant, key in LESSON_KEYS.items():
        args += ["--key", f"{tenant}={key}"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenfair.cli",
        "loadgen",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, stderr.decode()
    lines = stdout.decode().splitlines()
    assert "TTFT in model ms (wall ms / time scale)" in lines[0]
    assert lines[1] == "live: admitted 60/60, shed 0"
    assert lines[2].endswith("; peak admitted KV not measured live")
    assert lines[3].split() == [
        "tenant",
        "submitted",
        "admitted",
        "shed",
        "service",
        "tokens",
        "p50",
        "TTFT",
        "p99",
        "TTFT",
    ]
    assert lines[4].split()[:4] == ["tenant_batch_rag", "18", "18", "0"]


def test_gauge_value_reads_one_unlabelled_sample() -> None:
    text = (
        "# HELP tokenfair_kv_occupancy_ratio Reserved KV blocks over total KV blocks.\n"
        "# TYPE tokenfair_kv_occupancy_ratio gauge\n"
        "tokenfair_kv_occupancy_ratio_other 0.9\n"
        "tokenfair_kv_occupancy_ratio 0.4163\n"
    )
    assert gauge_value(text, KV_GAUGE) == 0.4163
    assert gauge_value('tokenfair_kv_occupancy_ratio{pod="a"} 0.5 1700000000\n', KV_GAUGE) == 0.5
    assert gauge_value("tokenfair_running_requests 3\n", KV_GAUGE) is None


async def test_kv_gauge_is_sampled_during_the_run(stub_server: StubFactory) -> None:
    # The first scrape reads 0.1, the second 0.62, every later one 0.3. The sampler reads once
    # when the run starts and once after it ends, so at least the first two are read.
    stub, url = await stub_server(
        tenants_by_key=by_tenant(KEYS), answer_delay_s=0.1, kv_values=[0.1, 0.62, 0.3]
    )
    settings = LoadgenSettings(target_url=url, admin_url=url, kv_sample_s=0.01)
    result = await replay([Request("r", "tenant_a", 0, 8, 2, "interactive")], KEYS, settings)
    assert result.kv is not None
    assert result.kv.error == ""
    assert result.kv.samples == stub.scrapes >= 2
    assert result.kv.peak == 0.62
    # Without admin_url nothing is sampled.
    plain = await replay(
        [Request("s", "tenant_a", 0, 8, 2, "interactive")], KEYS, LoadgenSettings(url)
    )
    assert plain.kv is None


async def _loadgen_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenfair.cli",
        "loadgen",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_cli_reports_the_sampled_kv_peak(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(LESSON_KEYS), kv_values=[0.25, 0.5])
    args = ["--target", url, "--admin", url, "--kv-sample-ms", "10"]
    args += ["--scenario", "noisy-neighbor", "--time-scale", "0.001"]
    args += [f"--key={tenant}={key}" for tenant, key in LESSON_KEYS.items()]
    code, stdout, stderr = await _loadgen_cli(*args, "--format", "json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["comparison"]["live"]["peak_kv_occupancy_ratio"] == 0.5
    kv = report["run"]["kv_occupancy"]
    assert kv["measured"] is True
    assert kv["peak"] == 0.5
    assert kv["samples"] >= 2
    assert kv["source"] == f"{url}/metrics {KV_GAUGE}"
    assert kv["sample_interval_ms"] == 10
    code, stdout, stderr = await _loadgen_cli(*args)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[1].startswith("KV occupancy: ")
    assert lines[3].endswith("; peak admitted KV 0.5000")


async def test_cli_admin_without_the_gauge_leaves_kv_unmeasured(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(LESSON_KEYS))  # /metrics has no gauge
    args = ["--target", url, "--admin", url, "--scenario", "noisy-neighbor"]
    args += ["--time-scale", "0.001", "--format", "json"]
    args += [f"--key={tenant}={key}" for tenant, key in LESSON_KEYS.items()]
    code, stdout, stderr = await _loadgen_cli(*args)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["comparison"]["live"]["peak_kv_occupancy_ratio"] is None
    assert report["run"]["kv_occupancy"]["measured"] is False
    assert "KV occupancy sampling stopped" in stderr
    assert f"no {KV_GAUGE} sample" in stderr


async def test_cli_progress_bar_on_a_terminal_only(stub_server: StubFactory) -> None:
    _, url = await stub_server(tenants_by_key=by_tenant(LESSON_KEYS))
    args = ["-m", "tokenfair.cli", "loadgen", "--target", url]
    args += ["--scenario", "noisy-neighbor", "--time-scale", "0.001", "--format", "json"]
    args += [f"--key={tenant}={key}" for tenant, key in LESSON_KEYS.items()]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=slave,
            env={k: v for k, v in os.environ.items() if k not in ("CI", "TQDM_DISABLE")},
        )
        os.close(slave)
        slave = -1
        stdout, _ = await asyncio.wait_for(process.communicate(), timeout=60)
        os.set_blocking(master, False)
        terminal = b""
        with contextlib.suppress(OSError):  # EIO / EAGAIN: all read
            while chunk := os.read(master, 65536):
                terminal += chunk
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert process.returncode == 0, terminal
    assert json.loads(stdout)["comparison"]["live"]["total_requests"] == 60
    assert b"loadgen" in terminal
    assert b"/60" in terminal
    # On a pipe, nothing on stderr.
    code, _, stderr = await _loadgen_cli(*args[3:])
    assert code == 0
    assert stderr == ""


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    record = {
        "request_id": "r",
        "tenant_id": "tenant_a",
        "arrival_ms": 2000,
        "prefill_tokens": 1,
        "decode_tokens": 1,
        "priority_class": "interactive",
    }
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--time-scale", "0"], "--time-scale"),
        (["--time-scale", "nan"], "--time-scale"),
        (["--concurrency-limit", "0"], "--concurrency-limit"),
        (["--concurrency-limit", "2.5"], "--concurrency-limit: must be an integer (got 2.5)"),
        (["--time-scale", "fast"], "--time-scale: must be a number (got 'fast')"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--timeout", "0"], "--timeout"),
        # The only request is due at 2000 ms * 1.0 = 2 s; a 1 s run cannot reach it.
        (["--timeout", "1"], "--timeout"),
        (["--key", "tenant_a"], "--key"),
        (["--keys", "/nonexistent/keys.yaml"], "--keys"),
        (["--target", "ftp://127.0.0.1:1"], "--target"),
        (["--decode-weight", "-4"], "--decode-weight"),
        (["--admin", "127.0.0.1:9090"], "--admin"),
        (["--kv-sample-ms", "0"], "--kv-sample-ms"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    extra: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["loadgen", "--target", "http://127.0.0.1:1", "--trace", str(_trace(tmp_path))]
    argv += ["--key", "tenant_a=key-a", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenfair loadgen: error: ")
    assert flag in err


def test_a_tenant_without_a_key_is_a_flag_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["loadgen", "--target", "http://127.0.0.1:1", "--trace", str(_trace(tmp_path))]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--key/--keys" in err
    assert "tenant_a" in err


def test_scenario_and_trace_are_exclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["loadgen", "--target", "http://127.0.0.1:1", "--scenario", "noisy-neighbor"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--trace", str(_trace(tmp_path))])
    assert exit_info.value.code == 2
    assert "--trace" in capsys.readouterr().err


def test_cli_exits_1_when_the_endpoint_is_unreachable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trace = _trace(tmp_path)
    argv = ["loadgen", "--target", f"http://127.0.0.1:{port}", "--trace", str(trace)]
    # The only request is due at 2000 ms; at time scale 0.001 that is 2 wall ms.
    argv += ["--key", "tenant_a=key-a", "--time-scale", "0.001", "--format", "json"]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["comparison"]["live"]["shed_reasons"] == {CONNECTION_ERROR: 1}
    assert "1 request(s) got no HTTP response" in captured.err


E2E_TIME_SCALE = 2.0


async def _tokenfair(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenfair.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_noisy_neighbor_through_a_live_sidecar(tmp_path: Path) -> None:
    # The lesson's tenants and policy, each with the SHA-256 digest of its local key.
    tenants = [
        dataclasses.replace(
            tenant,
            api_key_sha256=(hashlib.sha256(LESSON_KEYS[tenant.tenant_id].encode()).hexdigest(),),
        )
        for tenant in LESSON_TENANTS
    ]
    config_path = tmp_path / "sidecar.yaml"
    config_path.write_text(
        yaml.safe_dump(config_to_document(build_config(PolicyConfig(), tenants)))
    )
    proxy_port, admin_port = free_ports(2)
    listen = f"127.0.0.1:{proxy_port}"
    # Time scale 2 (half speed): wall-clock overhead counts 1 / time_scale in model time. At 1.0
    # about one run in ten on a 2-core machine at load ~8 refused a few interactive requests
    # (predicted waits past 420 ms); at 0.5 and below most runs did.
    sidecar = await _tokenfair(
        "sidecar",
        "--config",
        str(config_path),
        "--listen",
        listen,
        "--admin-listen",
        f"127.0.0.1:{admin_port}",
        "--backend",
        "costmodel",
        "--time-scale",
        str(E2E_TIME_SCALE),
        "--drain-grace",
        "1",
        "--log-level",
        "WARNING",
    )
    try:
        assert sidecar.stdout is not None
        ready = await asyncio.wait_for(sidecar.stdout.readline(), timeout=30)
        assert ready.startswith(b"tokenfair sidecar ready"), ready
        args = ["--target", f"http://{listen}", "--scenario", "noisy-neighbor", "--stream"]
        for tenant, key in LESSON_KEYS.items():
            args += ["--key", f"{tenant}={key}"]
        args += ["--admin", f"http://127.0.0.1:{admin_port}"]
        loadgen = await _tokenfair(
            "loadgen", *args, "--time-scale", str(E2E_TIME_SCALE), "--format", "json"
        )
        stdout, stderr = await asyncio.wait_for(loadgen.communicate(), timeout=60)
        assert loadgen.returncode == 0, stderr.decode()
    finally:
        if sidecar.returncode is None:
            sidecar.terminate()  # SIGTERM: the sidecar drains (grace 1 s) and exits
        try:
            await asyncio.wait_for(sidecar.communicate(), timeout=30)
        except TimeoutError:
            sidecar.kill()
            await sidecar.wait()
            raise
    report = json.loads(stdout)
    live = report["comparison"]["live"]
    # The sidecar's own KV gauge, sampled during the run: batch work held KV at some sample.
    assert report["run"]["kv_occupancy"]["measured"] is True, report["run"]
    assert 0 < live["peak_kv_occupancy_ratio"] <= 1
    tenants_report = live["tenants"]
    # The scenario's counts: 24 chat + 18 ide interactive requests, 18 batch ones.
    for tenant_id, submitted in (("tenant_chat_pro", 24), ("tenant_ide_assist", 18)):
        assert tenants_report[tenant_id]["submitted"] == submitted
        assert tenants_report[tenant_id]["admitted"] == submitted, live["shed_reasons"]
        assert tenants_report[tenant_id]["shed_429"] == 0
    # `tokenfair simulate --scenario noisy-neighbor --policy tokenfair` serves all 18 batch ones.
    assert tenants_report["tenant_batch_rag"]["admitted"] == 18, live["shed_reasons"]
