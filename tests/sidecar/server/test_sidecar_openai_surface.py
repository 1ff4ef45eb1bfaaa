"""The OpenAI surface beyond chat and completions, over real HTTP on loopback.

Behaviours: ``GET /v1/models`` authenticated like every route, answered from config
(``servedModelNames``) by the cost-model engine and relayed from the upstream by the openai
backend (no admission: nothing queued, charged or recorded; the upstream's own key sent, never
the tenant's; a slow upstream is a bounded ``504``); ``POST /v1/embeddings`` admitted at a
prefill-only cost (every input of the four shapes counts, token IDs exactly; decode 0), answered
by the cost-model engine with deterministic unit vectors (floats or little-endian float32 in
base64, the same values) and relayed by the openai backend, settled from ``usage.prompt_tokens``;
token-ID prompts on ``/v1/completions`` counted one token per ID (a batch of lists generating
per prompt) and refused by name when malformed; the upstream key file (read at start, refused
when unreadable or empty, never in ``/status``); the settings' parsing; the optional IETF
``RateLimit-Policy`` / ``RateLimit`` fields. Every test ends with the scheduler's books at zero.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from sidecar_support import (
    BATCH,
    CHAT,
    KEYS,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    keyed_config,
    records_of,
    start,
)

from tokenfair.config import ConfigError
from tokenfair.core.cost import CostModel
from tokenfair.server import make_backend
from tokenfair.server.backends.openai import request_headers
from tokenfair.server.estimate import MAX_BATCH_INPUTS, MAX_TOKEN_ID
from tokenfair.server.ratelimit import ietf_ratelimit_fields
from tokenfair.server.runtime_settings import (
    UPSTREAM_API_KEY_FILE_ENV,
    SidecarSettings,
    read_upstream_api_key,
    settings_from_section,
)

pytestmark = pytest.mark.virtual_time

ServerFactory = Callable[..., Awaitable[TestServer]]
UPSTREAM_KEY = "sk-upstream-secret-0123456789"
MODELS = {
    "object": "list",
    "data": [{"id": "meta-llama/Llama-3-8B", "object": "model", "created": 1, "owned_by": "vllm"}],
}


class FakeUpstream:
    """A real aiohttp server standing in for vLLM: records what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.models_delay_s = 0.0
        self.models_status = 200

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def _seen(self, request: web.Request) -> bytes:
        body = await request.read()
        self.seen.append((request.method, request.path, dict(request.headers), body))
        return body

    async def models(self, request: web.Request) -> web.Response:
        await self._seen(request)
        if self.models_delay_s:
            await asyncio.sleep(self.models_delay_s)
        if self.models_status != 200:
            return web.json_response({"error": "unauthorized"}, status=self.models_status)
        return web.json_response(MODELS, headers={"x-upstream": "vllm"})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = json.loads(await self._seen(request))
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [0.5, 0.5]} for i in range(len(inputs))
        ]
        usage = {"prompt_tokens": 11, "total_tokens": 11}
        return web.json_response({"object": "list", "data": data, "model": "e", "usage": usage})

    async def completions(self, request: web.Request) -> web.Response:
        await self._seen(request)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        choice = {"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}
        return web.json_response({"object": "text_completion", "choices": [choice], "usage": usage})


async def start_openai(
    aiohttp_client: ClientFactory,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    upstream: FakeUpstream,
    **settings: Any,
) -> Clients:
    server = await aiohttp_server(upstream.app())
    key_file = tmp_path / "upstream-key"
    key_file.write_text(UPSTREAM_KEY + "\n")  # a trailing newline, as `kubectl create secret`
    return await start(
        aiohttp_client,
        keyed_config(),
        SidecarSettings(
            backend="openai",
            upstream_url=str(server.make_url("")).rstrip("/"),
            upstream_api_key_file=str(key_file),
            records_path=str(tmp_path / "records.jsonl"),
            engine_metrics="off",  # the fake upstream counts every request; it has no /metrics
            **settings,
        ),
    )


# -- GET /v1/models -----------------------------------------------------------------------------


async def test_models_from_config_with_the_costmodel_engine(aiohttp_client: ClientFactory) -> None:
    settings = SidecarSettings(time_scale=0.01, served_model_names=("small", "large"))
    clients = await start(aiohttp_client, keyed_config(), settings)
    proxy = clients.proxy
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}):
        response = await proxy.get("/v1/models", headers=headers)
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_api_key"
    response = await proxy.get("/v1/models", headers={"Authorization": CHAT})
    assert response.status == 200
    listed = await response.json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["small", "large"]
    assert all(m["object"] == "model" and m["owned_by"] == "tokenfair" for m in listed["data"])
    # Listing is not model work: nothing admitted or counted.
    assert clients.sidecar.outcomes.tenant_counts == {}
    # Other methods on the route are still 404s.
    assert (await proxy.post("/v1/models", headers={"Authorization": CHAT})).status == 404


async def test_models_relayed_from_the_upstream_with_its_own_key(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    upstream = FakeUpstream()
    clients = await start_openai(aiohttp_client, aiohttp_server, tmp_path, upstream)
    proxy = clients.proxy
    assert (await proxy.get("/v1/models")).status == 401
    assert upstream.seen == []  # an unauthenticated client never reaches the upstream
    response = await proxy.get("/v1/models", headers={"Authorization": BATCH})
    assert response.status == 200
    assert await response.json() == MODELS
    assert response.headers["x-upstream"] == "vllm"
    [(method, path, headers, _)] = upstream.seen
    assert (method, path) == ("GET", "/v1/models")
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert KEYS["tenant_batch_rag"] not in json.dumps(headers)
    assert clients.sidecar.outcomes.tenant_counts == {}
    assert not Path(tmp_path / "records.jsonl").exists() or not records_of(clients.sidecar)
    # The key is nowhere in /status.
    status = await (await clients.admin.get("/status")).text()
    assert UPSTREAM_KEY not in status


async def test_many_clients_listing_models_cost_the_upstream_one_request(
    aiohttp_client: ClientFactory,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Concurrent ``GET /v1/models`` share one relay, and a fresh answer is reused: a tenant
    cannot turn the listing into upstream load. (Freshness set to an hour: the count does not
    depend on how fast this machine runs the twenty requests.)"""
    monkeypatch.setattr("tokenfair.server.backends.openai.MODELS_FRESH_S", 3600.0)
    upstream = FakeUpstream()
    upstream.models_delay_s = 0.05  # the relay is still in flight when the others ask
    clients = await start_openai(aiohttp_client, aiohttp_server, tmp_path, upstream)
    responses = await asyncio.gather(
        *(clients.proxy.get("/v1/models", headers={"Authorization": CHAT}) for _ in range(20))
    )
    assert [r.status for r in responses] == [200] * 20
    assert [await r.json() for r in responses] == [MODELS] * 20
    assert len(upstream.seen) == 1


async def test_the_upstream_refusing_the_sidecars_key_is_a_502(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """A ``401`` from the upstream refuses the sidecar's own key, not the client's: relayed as
    is, the client would take its own (valid) key for a bad one."""
    upstream = FakeUpstream()
    upstream.models_status = 401
    clients = await start_openai(aiohttp_client, aiohttp_server, tmp_path, upstream)
    response = await clients.proxy.get("/v1/models", headers={"Authorization": CHAT})
    assert response.status == 502
    assert (await response.json())["error"]["code"] == "upstream_error"
    upstream.models_status = 200  # a failure is not kept: the next client asks again
    response = await clients.proxy.get("/v1/models", headers={"Authorization": CHAT})
    assert response.status == 200
    assert len(upstream.seen) == 2


async def test_a_slow_upstream_models_list_is_a_bounded_504(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    upstream = FakeUpstream()
    upstream.models_delay_s = 30.0
    clients = await start_openai(
        aiohttp_client, aiohttp_server, tmp_path, upstream, upstream_read_timeout_s=0.2
    )
    response = await clients.proxy.get("/v1/models", headers={"Authorization": CHAT})
    assert response.status == 504
    error = (await response.json())["error"]
    assert error["code"] == "upstream_timeout"
    assert "127.0.0.1" not in error["message"]


# -- POST /v1/embeddings ------------------------------------------------------------------------


async def test_costmodel_embeddings_cost_prefill_only_and_are_deterministic(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    records = tmp_path / "records.jsonl"
    settings = SidecarSettings(time_scale=0.01, embedding_dimensions=8, records_path=str(records))
    clients = await start(aiohttp_client, keyed_config(), settings)
    proxy = clients.proxy
    auth = {"Authorization": CHAT}
    # Each input counts: "x" * 8 is 2 tokens (chars4), so the batch is 2 + 2 + 1 = 5 (the
    # estimator counts the batch's characters together: ceil(20 / 4)); token IDs count one each;
    # plus one token per input (its start token).
    cases = [
        ("x" * 8, 2 + 1, 1),
        (["x" * 8, "y" * 8, "zzzz"], 5 + 3, 3),
        ([1, 2, 3], 3 + 1, 1),
        ([[1, 2], [3], [4, 5, 6, 7]], 7 + 3, 3),
    ]
    for value, tokens, inputs in cases:
        response = await proxy.post(
            "/v1/embeddings", json={"model": "e", "input": value}, headers=auth
        )
        assert response.status == 200, await response.text()
        answer = await response.json()
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert [d["index"] for d in answer["data"]] == list(range(inputs))
        for item in answer["data"]:
            vector = item["embedding"]
            assert len(vector) == 8
            assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [r["prefill_tokens"] for r in rows] == [3, 8, 4, 10]
    assert all(r["decode_tokens"] == 0 and r["actual_decode_tokens"] == 0 for r in rows)
    assert all(r["status_code"] == 200 for r in rows)

    # Deterministic; `dimensions` asked for; base64 holds the same float32 values.
    body: dict[str, Any] = {"model": "e", "input": ["alpha", "beta"], "dimensions": 4}
    first = await (await proxy.post("/v1/embeddings", json=body, headers=auth)).json()
    again = await (await proxy.post("/v1/embeddings", json=body, headers=auth)).json()
    assert first["data"] == again["data"]
    assert first["data"][0]["embedding"] != first["data"][1]["embedding"]
    encoded = await (
        await proxy.post("/v1/embeddings", json={**body, "encoding_format": "base64"}, headers=auth)
    ).json()
    for plain, packed in zip(first["data"], encoded["data"], strict=True):
        raw = base64.b64decode(packed["embedding"])
        assert list(struct.unpack("<4f", raw)) == plain["embedding"]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": "e"}, "input", "input: required"),
        ({"input": 7}, "input", "input: must be a string"),
        ({"input": [1, -1]}, "input", "input[1]: a token ID must be an integer"),
        ({"input": [[1], [True]]}, "input", "input[1][0]: a token ID"),
        ({"input": [[1], 2]}, "input", "input[1]: must be a list of token IDs"),
        ({"input": ["a", 2]}, "input", "input[1]: must be a string"),
        ({"input": [MAX_TOKEN_ID + 1]}, "input", f"0..{MAX_TOKEN_ID}"),
        ({"input": ["a"] * (MAX_BATCH_INPUTS + 1)}, "input", f"at most {MAX_BATCH_INPUTS}"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions: must be an integer"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "float, base64"),
    ],
)
async def test_bad_embeddings_are_400_naming_the_field(
    aiohttp_client: ClientFactory, body: dict[str, Any], param: str, says: str
) -> None:
    clients = await start(aiohttp_client, keyed_config())
    response = await clients.proxy.post(
        "/v1/embeddings", json=body, headers={"Authorization": CHAT}
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert says in error["message"]
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


async def test_openai_embeddings_pass_through_and_settle_from_usage(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    upstream = FakeUpstream()
    clients = await start_openai(aiohttp_client, aiohttp_server, tmp_path, upstream)
    body = {"model": "e", "input": ["x" * 40, "y" * 40], "stream": True}
    response = await clients.proxy.post(
        "/v1/embeddings", json=body, headers={"Authorization": CHAT}
    )
    assert response.status == 200
    answer = await response.json()
    assert len(answer["data"]) == 2
    assert answer["usage"]["prompt_tokens"] == 11
    [(_, path, headers, sent)] = upstream.seen
    assert path == "/v1/embeddings"
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    # Not a stream (no include_usage spliced in): the body goes as the client sent it.
    assert json.loads(sent) == body
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    [row] = records_of(clients.sidecar)
    # Estimated ceil(80 / 4) = 20 prompt tokens + 2 inputs, decode 0; settled at the reported 11.
    assert (row["prefill_tokens"], row["decode_tokens"]) == (22, 0)
    assert row["actual_prefill_tokens"] == 11
    assert row["actual_service_tokens"] == 11


# -- token-ID prompts on /v1/completions ----------------------------------------------------------


async def test_token_id_prompts_count_one_token_per_id(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    records = tmp_path / "records.jsonl"
    clients = await start(
        aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01, records_path=str(records))
    )
    auth = {"Authorization": CHAT}
    one = await clients.proxy.post(
        "/v1/completions", headers=auth, json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
    )
    assert one.status == 200
    assert (await one.json())["usage"]["prompt_tokens"] == 3
    batch = await clients.proxy.post(
        "/v1/completions",
        headers=auth,
        json={"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 4},
    )
    assert batch.status == 200
    # Two prompts of 2 and 1 IDs: 3 prompt tokens, each prompt generating its own 4 tokens.
    assert (await batch.json())["usage"]["prompt_tokens"] == 3
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [(r["prefill_tokens"], r["decode_tokens"]) for r in rows] == [(3, 4), (3, 8)]


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([1, 2.5], "prompt[1]: a token ID must be an integer"),
        ([1, -1], "prompt[1]: a token ID must be an integer"),
        ([[0], [1, "2"]], "prompt[1][1]: a token ID"),
        ([[0], 1], "prompt[1]: must be a list of token IDs"),
        ([False], "prompt[0]: a token ID"),
        ([[1]] * (MAX_BATCH_INPUTS + 1), f"at most {MAX_BATCH_INPUTS} prompts"),
    ],
)
async def test_bad_token_id_prompts_are_400_naming_the_element(
    aiohttp_client: ClientFactory, prompt: object, says: str
) -> None:
    clients = await start(aiohttp_client, keyed_config())
    response = await clients.proxy.post(
        "/v1/completions", headers={"Authorization": CHAT}, json={"model": "m", "prompt": prompt}
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "prompt")
    assert says in error["message"]
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


# -- the upstream's API key -----------------------------------------------------------------------


async def test_the_upstream_key_replaces_the_tenants_on_completions(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    upstream = FakeUpstream()
    clients = await start_openai(aiohttp_client, aiohttp_server, tmp_path, upstream)
    response = await clients.proxy.post(
        "/v1/completions",
        headers={"Authorization": CHAT},
        json={"model": "m", "prompt": "hi", "max_tokens": 2},
    )
    assert response.status == 200
    [(_, _, headers, _)] = upstream.seen
    assert headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert KEYS["tenant_chat_pro"] not in json.dumps(headers)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


def test_the_tenants_authorization_is_replaced_never_forwarded() -> None:
    client = CIMultiDict(
        [("authorization", "Bearer sk-tenant"), ("X-Custom", "1"), ("x-tokenfair-priority", "b")]
    )
    with_key = request_headers(client, "sk-up")
    assert [v for n, v in with_key if n.lower() == "authorization"] == ["Bearer sk-up"]
    assert ("X-Custom", "1") in with_key
    without = request_headers(client)
    assert not [n for n, _ in without if n.lower() in ("authorization", "x-tokenfair-priority")]


def test_the_upstream_key_file_is_read_at_start_or_refused_by_name(tmp_path: Path) -> None:
    cost = CostModel()
    key = tmp_path / "key"
    key.write_text("  sk-abc \n")
    assert read_upstream_api_key(str(key)) == "sk-abc"
    settings = SidecarSettings(backend="openai", upstream_url="http://127.0.0.1:1")
    # From the environment variable when the setting is unset.
    backend = make_backend(settings, cost, {UPSTREAM_API_KEY_FILE_ENV: str(key)})
    assert backend.name == "openai"
    refused = [
        (tmp_path / "missing", "cannot read"),
        (tmp_path / "empty", "is empty"),
        (tmp_path / "blank", "is empty"),
        (tmp_path / "spaced", "visible ASCII"),
    ]
    (tmp_path / "empty").write_text("")
    (tmp_path / "blank").write_text(" \n\t\n")
    (tmp_path / "spaced").write_text("sk-secret part\n")
    for path, says in refused:
        with pytest.raises(ConfigError, match=says) as caught:
            make_backend(settings, cost, {UPSTREAM_API_KEY_FILE_ENV: str(path)})
        assert str(path) in str(caught.value)
        assert f"${UPSTREAM_API_KEY_FILE_ENV}" in str(caught.value)  # where it was named
        assert "secret" not in str(caught.value)  # the file's content is never shown
    # The setting wins over the environment; the costmodel engine never reads it.
    with pytest.raises(ConfigError, match="upstreamApiKeyFile: cannot read"):
        make_backend(
            SidecarSettings(
                backend="openai",
                upstream_url="http://127.0.0.1:1",
                upstream_api_key_file=str(tmp_path / "missing"),
            ),
            cost,
            {UPSTREAM_API_KEY_FILE_ENV: str(key)},
        )
    make_backend(SidecarSettings(), cost, {UPSTREAM_API_KEY_FILE_ENV: str(tmp_path / "missing")})


# -- settings -------------------------------------------------------------------------------------


def test_new_settings_parse_and_refuse_by_name() -> None:
    settings = settings_from_section(
        {
            "servedModelNames": ["a", "b"],
            "embeddingDimensions": 1536,
            "ietfRateLimitHeaders": True,
            "upstreamApiKeyFile": "/run/secrets/upstream/key",
        }
    )
    assert settings.served_model_names == ("a", "b")
    assert settings.embedding_dimensions == 1536
    assert settings.ietf_ratelimit_headers is True
    assert settings.upstream_api_key_file == "/run/secrets/upstream/key"
    defaults = SidecarSettings()
    assert (defaults.served_model_names, defaults.ietf_ratelimit_headers) == (
        ("tokenfair-costmodel",),
        False,
    )
    bad_sections: list[tuple[dict[str, object], str]] = [
        ({"servedModelNames": []}, "sidecar.servedModelNames"),
        ({"servedModelNames": "a"}, "sidecar.servedModelNames"),
        ({"embeddingDimensions": 0}, "sidecar.embeddingDimensions"),
        ({"embeddingDimensions": 10**6}, "sidecar.embeddingDimensions"),
        ({"ietfRateLimitHeaders": "yes"}, "sidecar.ietfRateLimitHeaders"),
        ({"upstreamApiKeyFile": ""}, "sidecar.upstreamApiKeyFile"),
    ]
    for section, says in bad_sections:
        with pytest.raises(ConfigError, match=says):
            settings_from_section(section)


# -- IETF RateLimit fields ------------------------------------------------------------------------


def test_ietf_fields_follow_the_drafts_structured_field_syntax() -> None:
    fields = ietf_ratelimit_fields(5000, 1090, 5.0, 3.91)
    assert fields == {
        "RateLimit-Policy": '"service-tokens";q=5000;qu="service-tokens";w=5',
        "RateLimit": '"service-tokens";r=1090;t=4',
    }
    # A window under a second is still a positive integer.
    assert ietf_ratelimit_fields(10, 0, 0.01, 0.0)["RateLimit-Policy"].endswith(";w=1")


async def test_ietf_fields_are_sent_when_enabled(aiohttp_client: ClientFactory) -> None:
    config = keyed_config(burst_service_tokens=5000, sustained_service_tokens_per_second=1000.0)
    settings = SidecarSettings(time_scale=0.01, ietf_ratelimit_headers=True)
    clients = await start(aiohttp_client, config, settings)
    response = await clients.proxy.post(
        "/v1/completions",
        headers={"Authorization": CHAT},
        json={"model": "m", "prompt": "x" * 40, "max_tokens": 5},
    )
    assert response.status == 200
    # Burst 5000 refilled at 1000/s: a 5 s window in model time, 0.05 s real: w=1.
    assert response.headers["RateLimit-Policy"] == '"service-tokens";q=5000;qu="service-tokens";w=1'
    # A served answer's OpenAI-named headers are converted with its own mix too: 10 prompt
    # tokens + 5 max_tokens = 15 usage tokens for 10 + 4 * 5 = 30 service tokens.
    assert response.headers["x-tokenfair-ratelimit-limit-service-tokens"] == "5000"
    assert response.headers["x-ratelimit-limit-tokens"] == "2500"
    remaining = response.headers["x-tokenfair-ratelimit-remaining-service-tokens"]
    assert int(response.headers["x-ratelimit-remaining-tokens"]) == int(remaining) // 2
    assert response.headers["RateLimit"].startswith(f'"service-tokens";r={remaining};t=')
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
