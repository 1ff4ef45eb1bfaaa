"""The request-cost estimate (``server/estimate.py``) and the body-shape bound before it.

Behaviours: ``n`` and ``best_of`` multiply the decode estimate (the prompt is charged once);
their bounds are 400s naming the param; the text of ``tools``, ``functions``,
``response_format``, ``tool_choice`` and of messages' ``name``, ``tool_calls`` and
``function_call`` counts as prompt characters (compact JSON); malformed ones are 400s naming
them; token-ID prompts count one token per ID, bounded (IDs in ``0..2**31-1``, batches of at
most 2048); an embeddings ``input`` costs its prompt tokens only (decode 0), every input
counted; an image part costs a bounded ``IMAGE_TOKENS`` whatever its base64's length; decode is
the larger of ``max_tokens`` and ``max_completion_tokens``; a body nested over
``max_json_depth`` or holding over ``max_json_values`` values is a 400
``body_too_complex`` naming the rule, with the books untouched, over real HTTP on loopback.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
from sidecar_support import CHAT, ZERO_BOOKS, ClientFactory, keyed_config, records_of, start

from tokenfair.server.estimate import (
    IMAGE_TOKENS,
    MAX_BATCH_INPUTS,
    MAX_CHOICES,
    MAX_TOKEN_ID,
    BodyShapeError,
    EstimateError,
    NotUtf8Error,
    chars4,
    check_json_shape,
    check_raw_values,
    ends_at_its_bound,
    estimate,
    estimate_embeddings,
    utf8_text,
)
from tokenfair.server.runtime_settings import SidecarSettings


def compact(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def test_n_and_best_of_multiply_decode_not_prefill() -> None:
    body: dict[str, Any] = {"prompt": "x" * 40, "max_tokens": 100}
    assert estimate(body, chars4, 256, 8192) == estimate({**body, "n": 1}, chars4, 256, 8192)
    one = estimate(body, chars4, 256, 8192)
    assert (one.prefill_tokens, one.decode_tokens) == (10, 100)
    # n = 128 choices of up to 100 tokens each: 12,800 decode tokens, the prompt once.
    many = estimate({**body, "n": MAX_CHOICES}, chars4, 256, 8192)
    assert (many.prefill_tokens, many.decode_tokens) == (10, 12_800)
    # best_of sequences are generated, n returned: charged for best_of.
    best = estimate({**body, "n": 2, "best_of": 5}, chars4, 256, 8192)
    assert best.decode_tokens == 500
    # Without max_tokens the default applies per sequence: 3 * 256.
    assert estimate({"prompt": "x", "n": 3}, chars4, 256, 8192).decode_tokens == 768


def test_a_batch_of_prompts_is_charged_per_prompt() -> None:
    # Three prompts, n=2, best_of=4: 3 * 4 sequences of up to 10 tokens; every prompt's text.
    batch = {"prompt": ["x" * 8, "y" * 8, "z" * 8], "max_tokens": 10, "n": 2, "best_of": 4}
    cost = estimate(batch, chars4, 256, 8192)
    assert (cost.prefill_tokens, cost.decode_tokens) == (6, 120)
    # Token IDs: one prompt of 3 tokens (one per ID), or two prompts of 2 and 1.
    ids = estimate({"prompt": [1, 2, 3], "max_tokens": 10}, chars4, 256, 8192)
    assert (ids.prefill_tokens, ids.decode_tokens) == (3, 10)
    two = estimate({"prompt": [[1, 2], [3]], "max_tokens": 10, "n": 3}, chars4, 256, 8192)
    assert (two.prefill_tokens, two.decode_tokens) == (3, 60)
    # One string, or a chat: one prompt.
    assert estimate({"prompt": "x" * 8, "max_tokens": 10}, chars4, 256, 8192).decode_tokens == 10
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt": ["a", "b"], "max_tokens": 5}
    assert estimate(chat, chars4, 256, 8192).decode_tokens == 5


@pytest.mark.parametrize(
    "prompt",
    [[1, "a"], [[1], "a"], [[1, -2]], [True], [[1.5]], [{"text": "a"}], 7, {"a": 1}],
)
def test_a_prompt_of_another_shape_is_a_400_naming_it(prompt: object) -> None:
    with pytest.raises(EstimateError) as raised:
        estimate({"prompt": prompt}, chars4, 256, 8192)
    assert raised.value.param == "prompt"


async def test_a_batch_of_prompts_is_charged_through_the_sidecar(
    aiohttp_client: ClientFactory,
) -> None:
    # Burst 5000: one prompt of 40 tokens and 100 decode tokens costs 40 + 4 * 100 = 440; the
    # same 40 tokens as 16 prompts of 10 ask for 16 * 100 decode tokens: 40 + 6400 = 6440.
    config = keyed_config(burst_service_tokens=5000)
    clients = await start(aiohttp_client, config, SidecarSettings(time_scale=0.01))
    one = await clients.proxy.post(
        "/v1/completions",
        json={"model": "m", "prompt": "x" * 160, "max_tokens": 100},
        headers={"Authorization": CHAT},
    )
    assert one.status == 200
    batch = await clients.proxy.post(
        "/v1/completions",
        json={"model": "m", "prompt": ["x" * 10] * 16, "max_tokens": 100},
        headers={"Authorization": CHAT},
    )
    assert batch.status == 400
    error = (await batch.json())["error"]
    assert error["code"] == "request_over_tenant_burst"
    assert "6440" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"n": "2"}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 10**6}, "best_of"),
        ({"n": 4, "best_of": 2}, "best_of"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"functions": "f"}, "functions"),
        ({"response_format": "json"}, "response_format"),
        ({"tool_choice": 3}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages[0].name"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "function_call": "f"}]}, "messages[0].function_call"),
    ],
)
def test_bad_choice_and_tool_fields_name_the_param(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(EstimateError) as raised:
        estimate({"prompt": "x", **extra}, chars4, 256, 8192)
    assert raised.value.param == param
    assert param.split("[")[0] in str(raised.value)


def test_tools_schemas_and_tool_calls_count_as_prompt_text() -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string", "description": "é" * 900}}}
    tools = [{"type": "function", "function": {"name": "search", "parameters": schema}}]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    tool_calls = [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "a" * 4000}}
    ]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "content": "r" * 40, "name": "search", "tool_call_id": "c1"},
    ]
    body = {
        "messages": messages,
        "tools": tools,
        "response_format": response_format,
        "tool_choice": {"type": "function", "function": {"name": "search"}},
    }
    structured = compact(tools) + compact(response_format) + compact(body["tool_choice"])
    # Per message ceil(chars / 4) + 4; the definitions once, ceil(chars / 4).
    expected = (
        math.ceil(structured / 4)
        + (math.ceil(2 / 4) + 4)
        + (math.ceil(compact(tool_calls) / 4) + 4)
        + (math.ceil((40 + len("search")) / 4) + 4)
    )
    assert chars4(body) == expected
    # The 900-character description counts as characters (not escaped to \u00e9, 6 each).
    assert chars4(body) > 900 * 2 // 4 + 4000 // 4
    # Legacy completions: the prompt plus the definitions; a string tool_choice is its text.
    legacy = {"prompt": "x" * 8, "functions": [{"name": "f", "parameters": schema}]}
    assert chars4(legacy) == math.ceil((8 + compact(legacy["functions"])) / 4)
    assert chars4({"prompt": "x" * 8, "tool_choice": "auto"}) == math.ceil(12 / 4)


def test_body_shape_limits() -> None:
    check_json_shape({"a": [1, {"b": [2, 3]}]}, max_depth=4, max_values=7)
    with pytest.raises(BodyShapeError) as raised:
        check_json_shape({"a": [1, {"b": [2, 3]}]}, max_depth=3, max_values=100)
    assert raised.value.rule == "max_json_depth"
    with pytest.raises(BodyShapeError) as raised:
        check_json_shape({"a": [1, {"b": [2, 3]}]}, max_depth=10, max_values=6)
    assert raised.value.rule == "max_json_values"
    # Scalars and empty containers pass any limit that counts them.
    check_json_shape("x", max_depth=1, max_values=1)
    check_json_shape([], max_depth=1, max_values=1)


def flat(item: bytes, count: int) -> bytes:
    return b'{"model":"m","messages":[' + b",".join([item] * count) + b"]}"


@pytest.mark.parametrize(
    "raw",
    [flat(b"{}", 349_000), flat(b"[]", 349_000), flat(b"1", 520_000), flat(b'""', 349_000)],
    ids=["empty-objects", "empty-arrays", "numbers", "empty-strings"],
)
def test_a_body_of_many_values_is_refused_before_it_is_parsed(raw: bytes) -> None:
    assert len(raw) <= 1 << 20
    with pytest.raises(BodyShapeError) as raised:
        check_raw_values(raw, 20_000)
    assert raised.value.rule == "max_json_values"


def test_values_are_counted_outside_strings_only() -> None:
    # A prompt of 100,000 commas, brackets and escaped quotes is one string: one value.
    text = json.dumps({"model": "m", "prompt": 'a, [b] {c} "d" ' * 25_000}).encode()
    check_raw_values(text, 20)
    # 1 + 19 commas + 1 bracket = 21 structural values: over 20, within 21.
    twenty = json.dumps({"model": "m", "prompt": [f"p{i}" for i in range(18)]}).encode()
    check_raw_values(twenty, 21)
    with pytest.raises(BodyShapeError):
        check_raw_values(twenty, 20)
    # Never fewer than the parsed body's values (what the estimate walks).
    body = {"a": [[], {}, [1, {"b": "x,y"}]], "c": {"d": [True, None]}}
    raw = json.dumps(body).encode()
    # The walk: the body, its 2 members, a's 3, [1, {...}]'s 2, {"b"}'s 1, c's 1, d's 2.
    check_json_shape(body, 10, 12)
    with pytest.raises(BodyShapeError):
        check_json_shape(body, 10, 11)
    # The text: 1 + 5 commas + 8 opening brackets = 14 (the comma in "x,y" not counted).
    check_raw_values(raw, 14)
    with pytest.raises(BodyShapeError):
        check_raw_values(raw, 13)


UNCLOSED_ESCAPED_QUOTES = b'{"model":"m","prompt":"' + b"," * 20_001 + b'\\"' * 300_000
"""A string that never closes, full of escaped quotes, after 20,001 commas (so the first, cheap
count is over the limit): a scan that retried a string from each later quote took time
quadratic in them (60 KB: 36 s; this 620 KB: hours)."""


def test_an_unclosed_string_of_escaped_quotes_is_counted_in_linear_time() -> None:
    for raw in (UNCLOSED_ESCAPED_QUOTES, b'{"a":"' + b'\\",' * 20_000):
        started = time.perf_counter()
        check_raw_values(raw, 20_000)  # outside strings: `{:,:` — few values; the parser fails
        assert time.perf_counter() - started < 5.0  # ~10 ms; the quadratic scan took hours
        with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
            json.loads(raw)


async def test_an_unclosed_string_of_escaped_quotes_is_a_prompt_400(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    started = time.perf_counter()
    response = await clients.proxy.post(
        "/v1/completions", data=UNCLOSED_ESCAPED_QUOTES, headers={"Authorization": CHAT}
    )
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_json"
    assert time.perf_counter() - started < 10.0
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


def test_more_strings_than_twice_the_limit_are_refused_unparsed() -> None:
    # 40,001 strings can be at most 20,000 keys and 20,000 values... plus one: over 20,000.
    raw = b"[" + b",".join([b'"\\\\"'] * 40_001) + b"]"
    with pytest.raises(BodyShapeError):
        check_raw_values(raw, 40_001 // 2)


def test_keys_are_not_counted_as_values() -> None:
    # 5,001 messages of role and content: 1 + 3 + 5,001 * 3 = 15,007 values, 20,006 strings
    # (keys included): under the 20,000 values, though over 20,000 string literals.
    messages = [{"role": "user", "content": "hi, there"} for _ in range(5_001)]
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    raw = json.dumps(body, separators=(",", ":")).encode()
    check_json_shape(body, 64, 20_000)
    check_raw_values(raw, 20_000)


async def test_a_chat_under_the_values_limit_passes_the_body_checks(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    messages = [{"role": "user", "content": "hi, there"} for _ in range(5_001)]
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 1},
        headers={"Authorization": CHAT},
    )
    # Parsed and estimated (35,007 prompt tokens: over the lesson's KV cache, a 400 of the
    # scheduler's, not of the body checks).
    error = (await response.json())["error"]
    assert error["code"] == "request_over_kv_capacity", error


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-16", "utf-32-le", "utf-32"])
def test_utf16_and_utf32_bodies_are_not_utf8(codec: str) -> None:
    # json.loads(bytes) would read these (it detects UTF-16/32), while the value count reads
    # the bytes as UTF-8: refused before any counting (RFC 8259 section 8.1).
    text = '{"model":"m","prompt":"x\u5c00","a":[' + ",".join(["{}"] * 100) + "]}"
    with pytest.raises(NotUtf8Error, match="UTF-8"):
        utf8_text(text.encode(codec))


def test_utf8_text() -> None:
    assert utf8_text('{"p":"é"}'.encode()) == '{"p":"é"}'
    with pytest.raises(NotUtf8Error, match="RFC 8259"):
        utf8_text(b'{"p":"\xff"}')


async def test_a_utf16_body_is_a_400_naming_utf8(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    # 170,000 empty objects: in UTF-8 over the values limit; as UTF-16 read whole by the parser.
    text = '{"model":"m","prompt":"x\u5c00","a":[' + ",".join(["{}"] * 170_000) + '],"b":"y"}'
    for codec in ("utf-16-le", "utf-32-be"):
        response = await clients.proxy.post(
            "/v1/completions", data=text.encode(codec)[: 1 << 20], headers={"Authorization": CHAT}
        )
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["code"] == "invalid_json"
        assert "UTF-8" in error["message"]
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        ({"model": "m", "messages": [{}] * 234_000}, "max_json_values"),
        (
            {"model": "m", "prompt": "x", "metadata": json.loads("[" * 65 + "]" * 65)},
            "max_json_depth",
        ),
    ],
)
async def test_a_body_too_complex_is_400_naming_the_rule(
    aiohttp_client: ClientFactory, body: dict[str, Any], rule: str
) -> None:
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    response = await clients.proxy.post(
        "/v1/chat/completions", data=json.dumps(body), headers={"Authorization": CHAT}
    )
    assert response.status == 400
    payload = await response.json()
    assert payload["error"]["code"] == "body_too_complex"
    assert rule in payload["error"]["message"]
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


async def test_n_is_charged_through_the_sidecar(aiohttp_client: ClientFactory) -> None:
    # A burst of 5000 service tokens: 40 + 4 * 100 = 440 for one choice passes; with n=16,
    # 40 + 4 * 1600 = 6440 is over the burst (refused, not run as if it were one choice).
    config = keyed_config(burst_service_tokens=5000)
    clients = await start(aiohttp_client, config, SidecarSettings(time_scale=0.01))
    body = {"model": "m", "prompt": "x" * 160, "max_tokens": 100}
    one = await clients.proxy.post("/v1/completions", json=body, headers={"Authorization": CHAT})
    assert one.status == 200
    many = await clients.proxy.post(
        "/v1/completions", json={**body, "n": 16}, headers={"Authorization": CHAT}
    )
    # Never admissible (over the burst, lending off): 400 naming the cost and the limit.
    assert many.status == 400
    payload = await many.json()
    assert payload["error"]["code"] == "request_over_tenant_burst"
    assert "6440" in payload["error"]["message"]
    assert "burst of 5000" in payload["error"]["message"]
    bad = await clients.proxy.post(
        "/v1/completions", json={**body, "n": 1000}, headers={"Authorization": CHAT}
    )
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "n"


IMAGE_400_KB = "data:image/png;base64," + base64.b64encode(bytes(300_000)).decode()


def image_chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": list(parts)}]}


def test_image_parts_cost_a_bounded_count_each_not_their_base64() -> None:
    """A 400 KB base64 image was ~4 prompt tokens (the message's framing); each image part now
    costs IMAGE_TOKENS (OpenAI's most for one image: 8 tiles of 170 + 85), whatever its
    encoding's length, and text parts still count their characters."""
    assert IMAGE_TOKENS == 8 * 170 + 85
    image = {"type": "image_url", "image_url": {"url": IMAGE_400_KB, "detail": "high"}}
    text = {"type": "text", "text": "x" * 40}
    assert chars4(image_chat(text)) == 10 + 4
    assert chars4(image_chat(text, image)) == 10 + IMAGE_TOKENS + 4
    assert chars4(image_chat(image, text, image)) == 10 + 2 * IMAGE_TOKENS + 4
    small = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    assert chars4(image_chat(small)) == IMAGE_TOKENS + 4  # a URL costs what the image does
    untyped = {"image_url": {"url": IMAGE_400_KB}}
    assert chars4(image_chat(untyped)) == IMAGE_TOKENS + 4
    for kind in ("input_image", "image_embeds", "image_pil"):
        assert chars4(image_chat({"type": kind, kind: "..."})) == IMAGE_TOKENS + 4
    assert chars4(image_chat({"type": "refusal", "refusal": "no"})) == 4  # not an image


@pytest.mark.parametrize(
    ("limits", "decode"),
    [
        ({"max_tokens": 8000, "max_completion_tokens": 1}, 8000),
        ({"max_tokens": 1, "max_completion_tokens": 8000}, 8000),
        ({"max_tokens": 300}, 300),
        ({"max_completion_tokens": 300}, 300),
        ({}, 256),
    ],
)
def test_decode_is_the_larger_of_the_two_limits(limits: dict[str, int], decode: int) -> None:
    """vLLM's legacy completions endpoint knows only max_tokens (max_completion_tokens is an
    ignored extra field), its chat endpoint prefers max_completion_tokens: the reservation
    covers whichever a server runs."""
    body = {"model": "m", "prompt": "x" * 40, **limits}
    assert estimate(body, chars4, 256, 8192).decode_tokens == decode


def test_both_limits_are_checked_when_both_are_set() -> None:
    body = {"model": "m", "prompt": "x", "max_completion_tokens": 5}
    for bad, rule in ((0, "integer >= 1"), (9000, "<= 8192"), ("7", "integer >= 1")):
        with pytest.raises(EstimateError, match=rule) as refused:
            estimate({**body, "max_tokens": bad}, chars4, 256, 8192)
        assert refused.value.param == "max_tokens"


async def test_max_tokens_under_max_completion_tokens_is_reserved_in_full(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    """/v1/completions with max_tokens 8000 and max_completion_tokens 1 reserved 1 decode
    token while vLLM generates up to 8000: now 8000 (the request's record says so)."""
    settings = SidecarSettings(time_scale=0.001, records_path=str(tmp_path / "records.jsonl"))
    clients = await start(aiohttp_client, keyed_config(), settings)
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 8000, "max_completion_tokens": 1}
    headers = {"Authorization": CHAT}
    response = await clients.proxy.post("/v1/completions", json=body, headers=headers)
    assert response.status == 200
    (record,) = records_of(clients.sidecar)
    assert record["decode_tokens"] == 8000
    assert record["service_tokens"] == 10 + 4 * 8000  # the estimate charged at admission


def test_token_ids_count_exactly_and_are_bounded() -> None:
    def cost(prompt: object, max_tokens: int = 4) -> tuple[int, int]:
        body = {"prompt": prompt, "max_tokens": max_tokens}
        result = estimate(body, chars4, 16, 8192)
        return result.prefill_tokens, result.decode_tokens

    assert cost([1, 2, 3]) == (3, 4)
    assert cost([[1, 2], [3], []]) == (3, 12)  # three prompts, each generating 4
    assert cost([MAX_TOKEN_ID, 0]) == (2, 4)
    assert cost([[7]] * MAX_BATCH_INPUTS) == (MAX_BATCH_INPUTS, 4 * MAX_BATCH_INPUTS)
    for prompt, says in [
        ([MAX_TOKEN_ID + 1], "prompt[0]: a token ID must be an integer in 0..2147483647"),
        ([1, True], "prompt[1]: a token ID"),
        ([[1], [2, None]], "prompt[1][1]: a token ID"),
        ([[1]] * (MAX_BATCH_INPUTS + 1), f"prompt: at most {MAX_BATCH_INPUTS} prompts"),
        (["a"] * (MAX_BATCH_INPUTS + 1), f"prompt: at most {MAX_BATCH_INPUTS} prompts"),
    ]:
        with pytest.raises(EstimateError, match=re.escape(says)) as caught:
            cost(prompt)
        assert caught.value.param == "prompt"


def test_embeddings_cost_prefill_only() -> None:
    def cost(value: object) -> tuple[int, int]:
        result = estimate_embeddings({"input": value}, chars4)
        return result.prefill_tokens, result.decode_tokens

    # Tokens plus one per input (its start token): no input is free.
    assert cost("x" * 9) == (3 + 1, 0)
    assert cost(["x" * 8, "y" * 8]) == (4 + 2, 0)
    assert cost([5, 6, 7]) == (3 + 1, 0)
    assert cost([[5], [6, 7]]) == (3 + 2, 0)
    assert cost(["a"] * 2048) >= (2048, 0)
    for empty, named in (("", "input"), ([], "input"), (["a", ""], "input[1]"),
                         ([[1], []], "input[1]")):  # fmt: skip
        with pytest.raises(EstimateError, match=rf"^{re.escape(named)}: must not be empty") as bad:
            estimate_embeddings({"input": empty}, chars4)
        assert bad.value.param == "input"
    with pytest.raises(EstimateError, match="input: required") as caught:
        estimate_embeddings({}, chars4)
    assert caught.value.param == "input"
    with pytest.raises(EstimateError) as caught:
        estimate_embeddings({"input": "a", "dimensions": True}, chars4)
    assert caught.value.param == "dimensions"


def depth(value: object) -> int:
    """Nesting depth of parsed JSON: a container is one level more than its deepest child."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def test_the_raw_brackets_bound_the_depth_the_walk_would_find() -> None:
    # The proxy skips check_json_shape's walk when these are within max_json_depth: they must
    # never be below the depth it would find.
    body = {"a": [[], {}, [1, {"b": "x,y"}]], "c": {"d": [True, None]}}
    assert check_raw_values(json.dumps(body).encode(), 100) == 8 >= depth(body) == 4
    # Brackets inside strings count too (an upper bound, no string scan).
    assert check_raw_values(json.dumps({"p": "[{ }]"}).encode(), 100) == 3
    # On the exact count's path (over the first bound) as well.
    quoted = json.dumps({"p": "," * 50, "q": [[[1]]]}).encode()
    assert check_raw_values(quoted, 10) == 4 == depth(json.loads(quoted))
    for nest in range(1, 70):
        nested: object = 1
        for level in range(nest):
            nested = [nested] if level % 2 else {"k": nested}
        assert check_raw_values(json.dumps(nested).encode(), 1000) >= depth(nested) == nest


CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "chat", "bounded"),
    [
        ({"messages": CHAT_MESSAGES, "max_tokens": 64}, True, True),
        ({"messages": CHAT_MESSAGES, "max_completion_tokens": 64}, True, True),
        ({"prompt": "def f():", "max_tokens": 8}, False, True),
        ({"prompt": ["def f():"], "max_tokens": 8}, False, True),
        ({"prompt": [1, 2, 3], "max_tokens": 8}, False, True),  # one prompt of token IDs
        ({"messages": CHAT_MESSAGES}, True, False),  # no bound of its own
        ({"messages": CHAT_MESSAGES, "max_tokens": 64, "n": 2}, True, False),
        ({"prompt": "def f():", "max_tokens": 8, "best_of": 3}, False, False),
        ({"prompt": ["a", "b"], "max_tokens": 8}, False, False),  # two prompts: 2 tokens a step
        ({"prompt": "def f():", "max_tokens": True}, False, False),  # a boolean is no bound
        # A legacy completion is bounded by max_tokens only (vLLM ignores the other there),
        # and its prompts are its prompt's (a messages beside it is ignored).
        ({"prompt": "def f():", "max_completion_tokens": 10}, False, False),
        ({"prompt": "x", "max_tokens": None, "max_completion_tokens": 10}, False, False),
        ({"prompt": ["a", "b"], "messages": CHAT_MESSAGES, "max_tokens": 10}, False, False),
    ],
)
def test_a_request_ends_by_its_own_bound_with_one_sequence_of_one_prompt(
    body: dict[str, object], chat: bool, bounded: bool
) -> None:
    assert ends_at_its_bound(body, chat=chat) is bounded
