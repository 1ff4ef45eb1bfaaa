"""The official ``openai`` Python SDK against a real sidecar over loopback (cost-model engine).

Behaviours: ``client.models.list()`` lists the configured model names; ``client.embeddings.
create`` works with the SDK's default ``encoding_format`` (base64, decoded by the SDK) and with
token-ID input; ``client.completions.create`` with token-ID prompts (one list, and a batch of
lists) reports one prompt token per ID; a refusal raises ``openai.RateLimitError`` whose
``code`` is ``rate_limit_exceeded``, ``type`` ``tokens`` and whose body carries our reason in
``tokenfair_reason``; the SDK's retry takes each wait from our ``retry-after-ms`` (to the
millisecond, not the whole seconds of ``Retry-After``), and the sidecar sees exactly the
attempts the SDK made, the last one served. No wall-clock duration is asserted: the wait the SDK
computed is observed through its own ``_calculate_retry_timeout``, the attempts through the
sidecar's counters and an HTTP event hook.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from sidecar_support import (
    KEYS,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    keyed_config,
    start,
)

from tokenfair.config import PolicyConfig
from tokenfair.server.runtime_settings import SidecarSettings


@asynccontextmanager
async def sdk(clients: Clients, max_retries: int, seen: list[int] | None = None
              ) -> AsyncIterator[Any]:  # fmt: skip
    """An ``AsyncOpenAI`` client of ``tenant_chat_pro`` pointed at the sidecar; ``seen`` gets
    the status of every HTTP response (each attempt)."""

    async def on_response(response: Any) -> None:
        if seen is not None:
            seen.append(response.status_code)

    http_client = openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]})
    client = openai.AsyncOpenAI(
        base_url=str(clients.proxy.make_url("/v1")),
        api_key=KEYS["tenant_chat_pro"],
        max_retries=max_retries,
        http_client=http_client,
    )
    async with client:
        yield client


async def test_models_embeddings_and_token_id_completions(aiohttp_client: ClientFactory) -> None:
    settings = SidecarSettings(
        time_scale=0.01, served_model_names=("tf-small",), embedding_dimensions=8
    )
    clients = await start(aiohttp_client, keyed_config(), settings)
    async with sdk(clients, max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tf-small"]

        # The SDK asks for base64 by default and decodes the float32 bytes itself.
        embedded = await client.embeddings.create(model="tf-small", input=["hello", "world"])
        assert [len(d.embedding) for d in embedded.data] == [8, 8]
        assert embedded.usage.prompt_tokens == 3 + 2  # ceil(10 characters / 4) + 2 inputs
        as_floats = await client.embeddings.create(
            model="tf-small", input=["hello", "world"], encoding_format="float"
        )
        assert [d.embedding for d in as_floats.data] == [d.embedding for d in embedded.data]
        by_ids = await client.embeddings.create(model="tf-small", input=[[1, 2, 3], [4]])
        assert by_ids.usage.prompt_tokens == 4 + 2  # one per ID, one per input

        one = await client.completions.create(model="tf-small", prompt=[1, 2, 3], max_tokens=4)
        assert one.usage is not None
        assert one.usage.prompt_tokens == 3
        batch = await client.completions.create(
            model="tf-small", prompt=[[1, 2], [3]], max_tokens=4
        )
        assert batch.usage is not None
        assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (3, 8)

        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tf-small", prompt=[1, -2], max_tokens=4)
        assert (bad.value.code, bad.value.param) == ("invalid_value", "prompt")
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_rate_limit_error_and_the_sdk_retry_honour_retry_after_ms(
    aiohttp_client: ClientFactory,
) -> None:
    # Burst 5000 refilled at 2000/s (time_scale 1: model ms are real ms); each request is
    # 1000 + 4 * 750 = 4000 service tokens. After the first, the bucket holds ~1000: the next
    # needs 3000 more, 1500 ms of refill, of which it may wait 420 in the queue: refused with a
    # retry ~1080 ms later (Retry-After rounds that up to 2 s; retry-after-ms keeps it).
    config = keyed_config(
        PolicyConfig(), burst_service_tokens=5000, sustained_service_tokens_per_second=2000.0
    )
    clients = await start(aiohttp_client, config, SidecarSettings(time_scale=1.0))
    counts = clients.sidecar.outcomes.tenant_counts
    body: dict[str, Any] = {"model": "m", "prompt": "x" * 4000, "max_tokens": 750}

    async with sdk(clients, max_retries=0) as client:
        first = await client.completions.create(**body)
        assert first.usage is not None
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(**body)
    refused = caught.value
    assert refused.status_code == 429
    assert (refused.code, refused.type, refused.param) == ("rate_limit_exceeded", "tokens", None)
    assert isinstance(refused.body, dict)
    assert refused.body["tokenfair_reason"] == "shed_tenant_token_quota"
    headers = refused.response.headers
    retry_ms = int(headers["retry-after-ms"])
    assert 0 < retry_ms <= 1080
    assert int(headers["Retry-After"]) == -(-retry_ms // 1000)  # whole seconds, rounded up
    assert counts["tenant_chat_pro"]["refused"] == 1  # max_retries=0: one attempt

    # With retries: the SDK computes each wait from retry-after-ms and retries; the bucket has
    # refilled by then, and the request is served. (The hint is the core's prediction: on a
    # loaded machine the first retry may land a millisecond short and get a 1 ms hint; the SDK
    # then retries again, also as told.)
    waits: list[tuple[str | None, float]] = []
    seen: list[int] = []
    async with sdk(clients, max_retries=3, seen=seen) as client:
        calculate = client._calculate_retry_timeout

        def spy(remaining: int, options: Any, response_headers: Any = None) -> float:
            timeout: float = calculate(remaining, options, response_headers)
            hint = None if response_headers is None else response_headers.get("retry-after-ms")
            waits.append((hint, timeout))
            return timeout

        client._calculate_retry_timeout = spy
        served = await client.completions.create(**body)
    assert served.usage is not None
    # One wait per refused attempt, then the 200; at least one retry, within max_retries.
    assert 2 <= len(seen) <= 4
    assert seen == [429] * (len(seen) - 1) + [200]
    assert len(waits) == len(seen) - 1
    for hint, timeout in waits:
        assert hint is not None
        assert timeout == int(hint) / 1000  # our hint to the millisecond, no backoff or jitter
    assert 0 < int(waits[0][0] or 0) <= 1080
    # The sidecar saw exactly the attempts the SDK made.
    assert counts["tenant_chat_pro"]["refused"] == 1 + len(waits)
    assert counts["tenant_chat_pro"]["served"] == 2
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
