"""The sidecar in front of a real engine: ``tokenfair sidecar --backend openai`` as a process,
vLLM's CPU build serving the tiny model behind it (``make vllm``), the official ``openai`` SDK
in front.

Behaviours:

- ``client.models.list()`` through the sidecar lists the engine's model with its
  ``max_model_len``, as vLLM itself answers; without a key it is ``401``;
- ``/v1/chat/completions`` and ``/v1/completions``, not streamed: the client gets vLLM's answer,
  and the request's record is ``200 admitted`` with exactly the usage vLLM reported
  (``actual_prefill_tokens`` = ``prompt_tokens``, ``actual_decode_tokens`` =
  ``completion_tokens``), which is also exactly what vLLM's own counters
  ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` grew by;
- the same routes streamed, read to the end of the response, with
  ``stream_options.include_usage`` (the client gets the usage event, the record equals it) and
  without (the client gets no usage event; the sidecar asked the engine for it and the record
  carries it, equal to the counters' growth for that one request);
- streams read by the SDK's own ``Stream``, which closes the response as soon as it reads
  ``[DONE]``, :data:`SDK_STREAMS` of them eight at a time: every one is recorded ``200
  admitted`` with the usage the client saw, and their records add up to the counters' growth;
- the sidecar's config describes the engine: its ``kvBlockTokens`` and ``totalKvBlocks`` are the
  block size and count vLLM reports, and a request's booked blocks follow them, its prompt at
  the ratio of vLLM's prompt count to the sidecar's estimate learned from the usage reported.

One engine per session (the ``vllm`` fixture) and one sidecar per module; requests are small
(``max_tokens`` 4-16) and, but for the SDK's streams, sequential, so each one's counter growth
is its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from engine_support import (
    EngineSidecar,
    EngineTokens,
    engine_tokens_after,
    sidecar_in_front_of,
    wait_until,
)
from vllm_support import VllmServer

SDK_STREAMS = 512
"""Streams read by the SDK's ``Stream``, 128 of each kind, ``max_tokens`` 4 (15-25 s). A completed
stream recorded ``499 cancelled`` was measured in 0.2-3.5 % of such streams here (1 to 18 of
512 per run): 512 streams see it at least once with probability 1 - 0.995^512 = 92 % at 0.5 %."""
SDK_CONCURRENCY = 8
CHAT_MESSAGES = [{"role": "user", "content": "Summarise the queue of the batch tenant."}]
PROMPT = "Every tenant gets a fair share of the service"


@pytest.fixture(scope="module")
def sidecar(vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSidecar]:
    with sidecar_in_front_of(vllm, tmp_path_factory.mktemp("sidecar")) as running:
        yield running


@pytest.fixture
def client(sidecar: EngineSidecar) -> Iterator[openai.OpenAI]:
    with sidecar.client() as sdk:
        yield sdk


def usage_of(record: dict[str, Any]) -> EngineTokens:
    return EngineTokens(record["actual_prefill_tokens"], record["actual_decode_tokens"])


def outcome(record: dict[str, Any]) -> tuple[int, str]:
    return record["status_code"], record["reason"]


def test_models_through_the_sidecar_are_the_engines(
    vllm: VllmServer, sidecar: EngineSidecar, client: openai.OpenAI
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [vllm.model]
    assert (models[0].model_extra or {})["max_model_len"] == vllm.max_model_len_tokens == 4096
    with (
        openai.OpenAI(base_url=f"{sidecar.proxy}/v1", api_key="sk-unknown", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()


def test_config_describes_the_engine(vllm: VllmServer, sidecar: EngineSidecar,
                                     client: openai.OpenAI) -> None:  # fmt: skip
    assert (vllm.block_size_tokens, vllm.kv_blocks) == (32, 512)
    # Nothing else booked (an earlier test's request is settled), then one request: its booked
    # KV is in the engine's blocks, ceil((prompt + max_tokens) / 32) of 512.
    books = wait_until(sidecar.status, lambda s: s["books"]["resident_kv_blocks"] == 0)
    assert books["books"]["resident_kv_blocks"] == 0
    prompt = "x " * 100  # the sidecar's estimate: ceil(200 characters / 4) = 50 tokens
    for request_id in ("kv-1", "kv-2"):
        # The gates see nothing in use: the books and the engine's last KV report (read by the
        # sidecar's poller, asynchronously) both past the previous request; a report read while
        # it still held its blocks left a correction of them, and the record read twice them.
        kv = wait_until(sidecar.status, lambda s: s["kv"]["gate_blocks"] == 0)["kv"]
        assert (kv["gate_blocks"], kv["correction_blocks"]) == (0, 0)
        # The prompt ratio the books count a prompt at (learned from vLLM's reported usage).
        ratio = kv["gate_prompt_ratio"]
        assert ratio == round(min(4.0, max(0.5, kv["prompt_ratio"])), 4)
        client.completions.create(
            model=vllm.model, prompt=prompt, max_tokens=8,
            extra_headers={"x-request-id": request_id},
        )  # fmt: skip
        record = sidecar.record(request_id)
        assert outcome(record) == (200, "admitted")
        assert record["prefill_tokens"] == 50  # the record keeps the estimate
        blocks = math.ceil((math.ceil(50 * ratio) + 8) / 32)
        assert record["kv_occupancy_ratio"] == round(blocks / 512, 4)  # records keep 4 places
        # vLLM counts this prompt otherwise than the estimate: the next one is booked at it.
        assert record["actual_prefill_tokens"] != 50
    assert ratio != 1.0


def test_json_routes_record_the_engines_usage(
    vllm: VllmServer, sidecar: EngineSidecar, client: openai.OpenAI
) -> None:
    for route in ("chat", "completions"):
        request_id = f"json-{route}"
        before = EngineTokens.read(vllm)
        if route == "chat":
            response: Any = client.chat.completions.create(
                model=vllm.model, messages=CHAT_MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                extra_headers={"x-request-id": request_id},
            )  # fmt: skip
            assert response.choices[0].message.role == "assistant"
        else:
            response = client.completions.create(
                model=vllm.model, prompt=PROMPT, max_tokens=8,
                extra_headers={"x-request-id": request_id},
            )  # fmt: skip
            assert isinstance(response.choices[0].text, str)
        assert response.model == vllm.model
        reported = EngineTokens(response.usage.prompt_tokens, response.usage.completion_tokens)
        assert 0 < reported.generation <= 8
        record = sidecar.record(request_id)
        assert outcome(record) == (200, "admitted"), record
        assert usage_of(record) == reported
        assert engine_tokens_after(vllm, before, reported) == reported


def stream_create(client: openai.OpenAI, vllm: VllmServer, route: str, include_usage: bool,
                  request_id: str, raw: bool, max_tokens: int = 16) -> Any:  # fmt: skip
    """Start one streamed request of ``route`` (``chat``/``completions``); the SDK's ``Stream``,
    or with ``raw`` its ``with_streaming_response`` context manager."""
    extra: dict[str, Any] = {
        "extra_headers": {"x-request-id": request_id},
        "stream": True,
        "max_tokens": max_tokens,
    }
    if include_usage:
        extra["stream_options"] = {"include_usage": True}
    if route == "chat":
        chat = client.chat.completions.with_streaming_response if raw else client.chat.completions
        return chat.create(model=vllm.model, messages=CHAT_MESSAGES, **extra)  # type: ignore[arg-type]
    completions = client.completions.with_streaming_response if raw else client.completions
    return completions.create(model=vllm.model, prompt=PROMPT, **extra)


def stream_to_its_end(client: openai.OpenAI, vllm: VllmServer, route: str, include_usage: bool,
                      request_id: str) -> tuple[int, EngineTokens | None]:  # fmt: skip
    """One streamed request read to the end of the response body (as ``curl`` or any client
    that reads until the server ends the response does; the SDK's ``Stream`` instead closes at
    ``[DONE]``): the number of content events and the usage event's figures (None: none)."""
    events = []
    with stream_create(client, vllm, route, include_usage, request_id, raw=True) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    usages = [e["usage"] for e in events if e.get("usage")]
    assert len(usages) <= 1, f"{request_id}: {len(usages)} usage events"
    usage = (
        EngineTokens(usages[0]["prompt_tokens"], usages[0]["completion_tokens"]) if usages else None
    )
    return sum(1 for e in events if e.get("choices")), usage


def sdk_stream(client: openai.OpenAI, vllm: VllmServer, route: str, include_usage: bool,
               request_id: str) -> tuple[int, EngineTokens | None]:  # fmt: skip
    """One streamed request (``max_tokens`` 4) read with the SDK's own ``Stream``, which closes
    the response at ``[DONE]``: the number of content chunks and the usage chunk's figures
    (None: none)."""
    content_chunks, usage = 0, None
    stream = stream_create(client, vllm, route, include_usage, request_id, raw=False, max_tokens=4)
    with stream:
        for chunk in stream:
            content_chunks += 1 if chunk.choices else 0
            if chunk.usage is not None:
                assert usage is None, f"{request_id}: two usage chunks"
                usage = EngineTokens(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return content_chunks, usage


STREAM_KINDS = [(route, usage) for route in ("chat", "completions") for usage in (True, False)]


def test_streams_record_the_engines_usage(
    vllm: VllmServer, sidecar: EngineSidecar, client: openai.OpenAI
) -> None:
    for round_ in range(2):
        for route, include_usage in STREAM_KINDS:
            request_id = f"stream-{route}-{'usage' if include_usage else 'plain'}-{round_}"
            before = EngineTokens.read(vllm)
            events, client_usage = stream_to_its_end(client, vllm, route, include_usage, request_id)
            assert events > 0
            if include_usage:
                assert client_usage is not None, f"{request_id}: no usage event"
            else:
                # The sidecar asked the engine for usage; that event is not the client's.
                assert client_usage is None, f"{request_id}: a usage event not asked for"
            record = sidecar.record(request_id)
            assert outcome(record) == (200, "admitted"), record
            # What the engine counted for this one request is what the record says it reported.
            engine = engine_tokens_after(vllm, before, usage_of(record))
            assert usage_of(record) == engine, (request_id, record)
            assert client_usage in (None, engine)


def test_completed_sdk_streams_are_recorded_200(
    vllm: VllmServer, sidecar: EngineSidecar, client: openai.OpenAI
) -> None:
    # The SDK closes the response as soon as it reads `[DONE]`: a stream the client completed
    # must still be recorded 200 with the usage the engine reported, never 499.
    before = EngineTokens.read(vllm)
    jobs = [
        (f"sdk-{i}-{route}-{'usage' if include_usage else 'plain'}", route, include_usage)
        for i in range(SDK_STREAMS // len(STREAM_KINDS))
        for route, include_usage in STREAM_KINDS
    ]
    with ThreadPoolExecutor(SDK_CONCURRENCY) as pool:
        seen = list(pool.map(lambda job: sdk_stream(client, vllm, job[1], job[2], job[0]), jobs))
    for (request_id, _, include_usage), (chunks, usage) in zip(jobs, seen, strict=True):
        assert chunks > 0, request_id
        assert (usage is not None) == include_usage, request_id
    records = [sidecar.record(request_id) for request_id, _, _ in jobs]
    recorded_otherwise = [
        (job[0], outcome(record))
        for job, record in zip(jobs, records, strict=True)
        if outcome(record) != (200, "admitted")
    ]
    assert recorded_otherwise == [], (
        f"{len(recorded_otherwise)} of {len(jobs)} completed streams recorded as something "
        f"other than 200 admitted: {recorded_otherwise}"
    )
    for (request_id, _, _), record, (_, usage) in zip(jobs, records, seen, strict=True):
        assert usage in (None, usage_of(record)), (request_id, record)
    total = EngineTokens(
        sum(r["actual_prefill_tokens"] for r in records),
        sum(r["actual_decode_tokens"] for r in records),
    )
    assert engine_tokens_after(vllm, before, total) == total
