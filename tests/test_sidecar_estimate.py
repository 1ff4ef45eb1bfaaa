"""The request-cost estimate (``server/estimate.py``) and the body-shape bound before it.

Behaviours: ``n`` and ``best_of`` multiply the decode estimate (the prompt is charged once);
their bounds are 400s naming the param; the text of ``tools``, ``functions``,
``response_format``, ``tool_choice`` and of messages' ``name``, ``tool_calls`` and
``function_call`` counts as prompt characters (compact JSON); malformed ones are 400s naming
them; a body nested over ``max_json_depth`` or holding over ``max_json_values`` values is a 400
``body_too_complex`` naming the rule, with the books untouched, over real HTTP on loopback.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from test_sidecar_support import CHAT, ZERO_BOOKS, ClientFactory, keyed_config, start

from tokenfair_sidecar.server.estimate import (
    MAX_CHOICES,
    BodyShapeError,
    EstimateError,
    chars4,
    check_json_shape,
    check_raw_values,
    estimate,
)
from tokenfair_sidecar.server.settings import SidecarSettings


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
