"""What a request that ran is settled at, and recorded as, whatever its upstream reports or does
(issue 28 rows 1, 5 and 11; issue 27 "streams end as they ended"), over real HTTP on loopback in
front of the raw upstream of ``raw_upstream_support``.

* Reported usage is bounded by the request: prompt tokens by the model's context
  (``modelContextTokens``) times the prompts, completion tokens by the larger of ``max_tokens``
  and ``max_completion_tokens`` (else the context) times ``max(n, best_of)`` times the prompts,
  0 for embeddings. Beyond a bound: ``200 upstream_bad_usage``, settled **at the bound**,
  counted in ``tokenfair_backend_errors_total`` and logged with the tenant and the request.
* A whole answer cut after its head settles at the usage in the part received, else at the
  estimate (the upstream ran it), never at 0; an error head cut short at 0. A request body
  compressed with gzip and cut before its trailer is ``400 invalid_encoding``.
* Upstream trailers never reach the client as headers.
* A stream whose client leaves once it has the stream's end (``[DONE]``, or the usage event it
  asked for), while the upstream's own end is still awaited, is a ``200`` settled at the usage;
  an upstream that breaks off after ``[DONE]`` ends the client's stream cleanly.

After each: the books at zero and one record per request.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from raw_upstream_support import (
    CONTENT_CHUNKS,
    DONE,
    ESTIMATE_SERVICE_TOKENS,
    OK_JSON,
    USAGE_CHUNK,
    Received,
    chat,
    chunk,
    json_response,
    metrics_text,
    post,
    reply,
    request_bytes,
    sidecar_for,
    usage_json,
)
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    records_of,
    wait_for,
)

from tokenfair.server.backends.base import MAX_USAGE_TOKENS, UsageBounds

pytestmark = pytest.mark.virtual_time

CONTEXT_TOKENS = 4096
DECODE_WEIGHT = 4  # the lesson's policy


def usage(prompt: int, completion: int) -> bytes:
    return json_response(
        usage_json(b'{"prompt_tokens":%d,"completion_tokens":%d}' % (prompt, completion))
    )


# -- the bounds ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "bounds"),
    [
        ("/v1/chat/completions", {"max_tokens": 50}, (4096, 50)),
        ("/v1/chat/completions", {"max_tokens": 50, "n": 3}, (4096, 150)),
        # Both given: the larger (a server honouring either generates at most that many).
        ("/v1/completions", {"max_tokens": 8000, "max_completion_tokens": 1}, (4096, 8000)),
        ("/v1/completions", {"max_tokens": 10, "best_of": 4, "n": 2}, (4096, 40)),
        # A batch of prompts: each has the context, and its own sequences.
        ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 5}, (3 * 4096, 15)),
        # No max_tokens: a server's default runs to the end of the context.
        ("/v1/chat/completions", {}, (4096, 4096)),
        ("/v1/embeddings", {"input": ["a", "b"]}, (2 * 4096, 0)),
        ("/v1/embeddings", {"input": [1, 2, 3]}, (4096, 0)),
        # Never past what is a usage at all.
        ("/v1/completions", {"prompt": ["a"] * 2048, "max_tokens": 8192, "n": 128},
         (2048 * 4096, MAX_USAGE_TOKENS)),
    ],
)  # fmt: skip
def test_usage_bounds_of_a_request(
    path: str, body: dict[str, Any], bounds: tuple[int, int]
) -> None:
    assert UsageBounds(CONTEXT_TOKENS).of_request(path, body) == bounds


@pytest.mark.parametrize(
    ("extra", "reported", "settled"),
    [
        # 2^31 - 1 prompt tokens on a small request: settled at the context, not believed.
        ({}, (MAX_USAGE_TOKENS, 5), (CONTEXT_TOKENS, 5)),
        # More completion tokens than max_tokens x n allow.
        ({"n": 2}, (11, 100_000), (11, 2 * 50)),
        # Both over.
        ({}, (10**6, 10**6), (CONTEXT_TOKENS, 50)),
        # max_completion_tokens of 1 beside max_tokens of 50: 50 is the bound.
        ({"max_completion_tokens": 1}, (11, 50), (11, 50)),
    ],
    ids=["prompt", "completion-n", "both", "larger-of-two"],
)
async def test_usage_over_the_requests_bounds_settles_at_the_bounds(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    extra: dict[str, Any],
    reported: tuple[int, int],
    settled: tuple[int, int],
) -> None:
    raw = await upstream({"over": reply(usage(*reported))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, model_context_tokens=CONTEXT_TOKENS)
    with caplog.at_level(logging.WARNING, logger="tokenfair.sidecar"):
        response = await post(clients, chat("over", **extra))
        assert response.status == 200  # the answer is relayed as it came
        await response.read()
    request_id = response.headers["x-request-id"]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    bad = reported != settled
    assert (row["status_code"], row["reason"]) == (
        200, "upstream_bad_usage" if bad else "admitted"
    )  # fmt: skip
    assert (row["actual_prefill_tokens"], row["actual_decode_tokens"]) == settled
    assert row["actual_service_tokens"] == settled[0] + DECODE_WEIGHT * settled[1]
    tenant = clients.sidecar.scheduler.tenants["tenant_chat_pro"]
    assert tenant.served_tokens == settled[0] + DECODE_WEIGHT * settled[1]
    if bad:
        assert 'code="upstream_bad_usage"' in await metrics_text(clients)
        lines = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
        assert any("tenant_chat_pro" in line and "bound" in line for line in lines), lines


async def test_usage_within_the_bounds_is_taken_as_reported(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """At the bounds exactly (the context, max_tokens): believed, ``admitted``."""
    raw = await upstream({"edge": reply(usage(CONTEXT_TOKENS, 50))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, model_context_tokens=CONTEXT_TOKENS)
    assert (await post(clients, chat("edge"))).status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["reason"], row["actual_prefill_tokens"], row["actual_decode_tokens"]) == (
        "admitted", CONTEXT_TOKENS, 50,
    )  # fmt: skip


async def test_embeddings_report_no_completion_tokens(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    body = b'{"object":"list","data":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}'
    raw = await upstream({"emb": reply(json_response(body))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await clients.proxy.post(
        "/v1/embeddings", json={"model": "emb", "input": "hi"}, headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["reason"], row["actual_prefill_tokens"], row["actual_decode_tokens"]) == (
        "upstream_bad_usage", 3, 0,
    )  # fmt: skip


async def test_a_streams_usage_over_its_bounds_settles_at_the_bounds(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    huge = USAGE_CHUNK.replace(b'"prompt_tokens":9', b'"prompt_tokens":%d' % MAX_USAGE_TOKENS)
    stream = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunk(b"".join(CONTENT_CHUNKS) + huge + DONE) + b"0\r\n\r\n"
    )  # fmt: skip
    raw = await upstream({"s": reply(stream)})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, model_context_tokens=CONTEXT_TOKENS)
    response = await post(clients, chat("s", stream=True))
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (200, "upstream_bad_usage")
    assert (row["actual_prefill_tokens"], row["actual_decode_tokens"]) == (CONTEXT_TOKENS, 3)


# -- answers cut short -----------------------------------------------------------------------------


def cut_json(status: str, body: bytes, sent: int) -> bytes:
    """A head announcing ``body`` whole, then only its first ``sent`` bytes (the connection
    closes)."""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body[:sent]


async def test_a_whole_answer_cut_after_its_head_settles_at_what_ran(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """Cut before its usage: the estimate. Cut after a whole usage object: that usage. An error
    head cut short: 0 (as a whole error answer without usage). Each a 502 to the client."""
    usage_first = (
        b'{"usage":{"prompt_tokens":11,"completion_tokens":5},"id":"x","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"' + b"w" * 200 + b'"}}]}'
    )
    raw = await upstream(
        {
            "early": reply(cut_json("200 OK", OK_JSON, 20)),
            "late": reply(cut_json("200 OK", usage_first, 100)),
            "error": reply(cut_json("500 Internal Server Error", b'{"error":"x' * 10, 5)),
        }
    )
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    for model in ("early", "late", "error"):
        response = await post(clients, chat(model))
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_error"
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [(r["status_code"], r["reason"]) for r in rows] == [(502, "upstream_error")] * 3
    assert [r["actual_service_tokens"] for r in rows] == [
        ESTIMATE_SERVICE_TOKENS,
        11 + DECODE_WEIGHT * 5,
        0,
    ]


async def test_a_gzip_request_body_cut_before_its_trailer_is_refused(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """The JSON is whole, but the gzip member's trailer (CRC-32 and length) is missing: not a
    valid body, ``400 invalid_encoding``, and nothing reaches the upstream. Whole members, one
    or several, are read."""
    raw = await upstream({"ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    body = json.dumps(chat("ok")).encode()
    headers = {"Authorization": CHAT, "Content-Type": "application/json"}
    for cut in (4, 8):
        response = await clients.proxy.post(
            "/v1/chat/completions",
            data=gzip.compress(body)[:-cut],
            headers={**headers, "Content-Encoding": "gzip"},
        )
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["code"] == "invalid_encoding"
    half = len(body) // 2
    for data in (gzip.compress(body), gzip.compress(body[:half]) + gzip.compress(body[half:])):
        response = await clients.proxy.post(
            "/v1/chat/completions", data=data, headers={**headers, "Content-Encoding": "gzip"}
        )
        assert response.status == 200
    assert [r.body for r in raw.received] == [body, body]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_upstream_trailers_never_reach_the_client_as_headers(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """A chunked answer whose trailers come in the same segment as its head."""
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Sneaked\r\n\r\n" + chunk(OK_JSON) + b"0\r\nX-Sneaked: yes\r\n"
        b"Set-Cookie: session=stolen\r\n\r\n"
    )
    raw = await upstream({"t": reply(answer)})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await post(clients, chat("t"))
    assert response.status == 200
    assert await response.read() == OK_JSON
    assert "X-Sneaked" not in response.headers
    assert "Set-Cookie" not in response.headers
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


# -- streams end as they ended ---------------------------------------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def stream_then(events: bytes, *, then: str) -> Any:
    """An upstream stream of ``events``, after which it waits (its last chunk is held back until
    the sidecar has gone: the client left) or, with ``then="cut"``, closes the connection
    without its last chunk."""

    async def write(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(SSE_HEAD + chunk(events))
        await writer.drain()
        if then == "hold":
            await asyncio.sleep(3600)  # cancelled by the fixture's teardown

    return write


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    """What the client reads until ``marker`` has arrived (a failure after 30 s: the bytes are
    due at once)."""
    data = b""
    async with asyncio.timeout(30):
        while marker not in data:
            piece = await reader.read(65536)
            assert piece, f"the answer ended before {marker!r}: {data!r}"
            data += piece
    return data


@pytest.mark.parametrize(
    ("asked_usage", "events", "leave_at"),
    [
        (False, b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE, DONE),
        (True, b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE, DONE),
        # The usage event the client asked for, [DONE] still to come: the client has it all.
        (True, b"".join(CONTENT_CHUNKS) + USAGE_CHUNK, b'"completion_tokens":3'),
    ],
    ids=["done", "done-usage-asked", "usage-event"],
)
async def test_a_client_that_leaves_at_the_streams_end_met_a_200(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    asked_usage: bool,
    events: bytes,
    leave_at: bytes,
) -> None:
    """The upstream holds back its last chunk; the client reads to the end of the answer and
    closes, as the openai SDK does. The record is what the client saw: 200, settled at the
    reported usage (9 + 4 x 3), not a 499 at the estimate."""
    raw = await upstream({"hold": stream_then(events, then="hold")})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    port = clients.proxy.port
    assert port is not None
    extra = {"stream_options": {"include_usage": True}} if asked_usage else {}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(json.dumps(chat("hold", stream=True, **extra)).encode()))
        data = await read_until(reader, leave_at)
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 200")
    assert await wait_for(lambda: bool(records_of(clients.sidecar)), budget_s=30.0)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (200, "admitted")
    assert row["actual_service_tokens"] == 9 + DECODE_WEIGHT * 3


async def test_a_client_that_leaves_before_the_end_is_still_a_499(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """Content only, no end yet: the client leaving mid-answer is a 499 at the estimate."""
    raw = await upstream({"hold": stream_then(b"".join(CONTENT_CHUNKS), then="hold")})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    port = clients.proxy.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(json.dumps(chat("hold", stream=True)).encode()))
        await read_until(reader, b"w2 ")
    finally:
        writer.close()
    assert await wait_for(lambda: bool(records_of(clients.sidecar)), budget_s=30.0)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (499, "cancelled")
    assert row["actual_service_tokens"] == ESTIMATE_SERVICE_TOKENS


async def test_an_upstream_that_breaks_off_after_done_ends_the_stream_cleanly(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """The upstream closes its connection after ``[DONE]`` without the last chunk: the client
    already has the whole answer, so its stream ends cleanly and the record says 200."""
    events = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    raw = await upstream({"cut": stream_then(events, then="cut")})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await post(clients, chat("cut", stream=True))
    assert response.status == 200
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE  # whole, and ended
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (200, "admitted")
    assert row["actual_service_tokens"] == 9 + DECODE_WEIGHT * 3
