"""Issue 11's faults against the sidecar over real HTTP on loopback: every request ends exactly
once, nothing wedges, no input costs more than it is charged.

The upstream here is a raw ``asyncio.start_server`` whose reply is chosen by the request's
``model`` and written as exact bytes (bad usage numbers, a stream cut mid-way, gzip the sidecar
did not ask for, hop-by-hop headers); hostile clients are raw sockets where aiohttp's client
would not send the bytes (non-UTF-8 headers, a body that never finishes, a client that never
reads). After every case: the status the client saw, exactly one record with the outcome
(``status_code``, ``reason``), and the scheduler's books at zero.

Cases: usage of 401 digits, out of range, not an integer, or nested 100,000 deep is a protocol
error (200 relayed, settled at the estimate, recorded ``upstream_bad_usage``), and the slot is
free for the next request; the core refusing a settlement falls back to the estimate; a stream
broken after its 200 reaches the client as an incomplete transfer and is recorded
``502 upstream_aborted``; the ``include_usage`` event the sidecar added is cut from the client's
stream (and still settles), kept when the client asked, whatever its line ends (LF, CRLF, CR);
a stream is relayed as it comes, never held whole (CR line ends, a line of a megabyte), and an
LF-only stream is filtered without the event-end regex nor an event-by-event split; gzip/
deflate answers the sidecar did not ask for are decoded, other codings relayed with their header;
a gzip request body reaches the upstream decoded and unlabelled, an undecodable one is 400, a
zip bomb 413, an unknown coding (``br``/``zstd`` without their libraries too) an OpenAI-style
415; hop-by-hop and ``Connection``-named headers are stripped both ways; 502/504 bodies name no
upstream address; a streaming client that stops reading is cut after ``client_write_timeout_s``
and its slot freed, also when it stops within the stream's last 64 KiB (the end of the stream
waits for them), while a slow reader that keeps reading is served to the end, and a stream to a
client that reads arms no write timer (its writes cannot wait); a body that never
finishes is 408; JSON nested 100,000 deep is 400; a non-UTF-8 API key is 401; the core failing
to settle (even at the estimate) or the accounting failing still frees the slot and KV and
writes exactly one record per request.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import json
import os
import socket
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from raw_upstream_support import (
    CONTENT_CHUNKS,
    DONE,
    ESTIMATE_SERVICE_TOKENS,
    OK_JSON,
    USAGE_CHUNK,
    RawUpstream,
    Received,
    Reply,
    assert_next_request_served,
    chat,
    chunk,
    client_socket,
    connection_cut,
    json_response,
    metrics_text,
    post,
    raw_exchange,
    reply,
    request_bytes,
    sidecar_for,
    sse_response,
    usage_json,
)
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    keyed_config,
    records_of,
    start,
    wait_for,
)

from tokenfair.core import Request, make_scheduler
from tokenfair.server.backends import base as base_backend
from tokenfair.server.backends import openai as openai_backend
from tokenfair.server.backends.base import MAX_USAGE_TOKENS, BackendCall
from tokenfair.server.backends.openai import MAX_HELD_EVENT_BYTES, UsageEventFilter
from tokenfair.server.clock import ModelClock
from tokenfair.server.connections import unacknowledged_bytes
from tokenfair.server.dispatcher import Dispatcher
from tokenfair.server.lifecycle import Lifecycle, Phase, Settlement
from tokenfair.server.proxy import HAS_BROTLI, HAS_ZSTD
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.runtime_settings import SidecarSettings

pytestmark = pytest.mark.virtual_time

# -- reported usage --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens":1' + b"0" * 400 + b',"completion_tokens":5}',
        b'{"prompt_tokens":%d,"completion_tokens":5}' % (MAX_USAGE_TOKENS + 1),
        b'{"prompt_tokens":-1,"completion_tokens":5}',
        b'{"prompt_tokens":7,"completion_tokens":2.5}',
        b'{"prompt_tokens":true,"completion_tokens":5}',
        b'{"prompt_tokens":"7","completion_tokens":5}',
        b'{"prompt_tokens":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["401-digits", "over-max", "negative", "float", "bool", "string", "nested-100k"],
)
async def test_unbelievable_usage_settles_at_the_estimate_and_frees_the_slot(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, usage: bytes
) -> None:
    body = usage_json(usage)
    raw = await upstream({"bad": reply(json_response(body)), "ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await post(clients, chat("bad"))
    assert response.status == 200  # the upstream's answer is relayed as it came
    assert await response.read() == body
    await assert_next_request_served(clients)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    first, second = records_of(clients.sidecar)
    assert (first["status_code"], first["reason"]) == (200, "upstream_bad_usage")
    assert first["actual_service_tokens"] == first["service_tokens"] == ESTIMATE_SERVICE_TOKENS
    assert "actual_prefill_tokens" not in first
    assert "actual_decode_tokens" not in first
    assert (second["status_code"], second["reason"]) == (200, "admitted")
    assert second["actual_service_tokens"] == 11 + 4 * 5
    text = await metrics_text(clients)
    assert 'code="upstream_bad_usage"' in text


async def test_usage_the_core_refuses_settles_at_the_estimate() -> None:
    """The core raises (before changing anything) for a settlement it cannot book; the
    dispatcher settles at the estimate instead, so the running slot and KV are released."""
    scheduler = make_scheduler("tokenfair", keyed_config(), 0.0)
    dispatcher = Dispatcher(scheduler, ModelClock(), max_in_flight=1)
    request = Request("r-1", "tenant_chat_pro", 0.0, 280, 90, "interactive")
    lifecycle = dispatcher.submit(request)
    assert lifecycle.phase is Phase.RUNNING
    assert dispatcher.complete(lifecycle, 10**400, 0.0) is Settlement.AT_ESTIMATE
    assert phase_of(lifecycle) is Phase.SETTLED
    assert scheduler.books() == ZERO_BOOKS
    assert scheduler.tenants["tenant_chat_pro"].served_tokens == 280 + 4 * 90  # the estimate


# -- streams ---------------------------------------------------------------------------------------


async def test_a_stream_broken_after_its_200_is_an_incomplete_transfer(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    # The head and one event, then the connection closes without the last chunk.
    cut = sse_response(CONTENT_CHUNKS[0], end=False)
    raw = await upstream({"cut": reply(cut), "ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await post(clients, chat("cut", stream=True))
    assert response.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()
    await assert_next_request_served(clients)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    first, second = records_of(clients.sidecar)
    assert (first["status_code"], first["reason"]) == (502, "upstream_aborted")
    assert first["actual_service_tokens"] == ESTIMATE_SERVICE_TOKENS  # no usage: the estimate
    assert second["reason"] == "admitted"
    text = await metrics_text(clients)
    assert (
        'tokenfair_backend_errors_total{code="upstream_aborted",lane="interactive",'
        'tenant="tenant_chat_pro"} 1.0'
    ) in text


async def test_the_usage_chunk_the_sidecar_added_is_cut_from_the_clients_stream(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    # Split mid-event across chunks, as a server may write it: the cut must still be whole.
    wire = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    pieces = [wire[:100], wire[100:-40], wire[-40:]]
    stream = sse_response(*pieces)
    raw = await upstream({"stream": reply(stream)})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)

    # Not asked: added for the upstream, settled from it, not shown to the client.
    response = await post(clients, chat("stream", stream=True))
    assert response.status == 200
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE
    assert raw.received[-1].json["stream_options"] == {"include_usage": True}

    # Asked (the OpenAI way): relayed byte for byte, usage chunk included.
    response = await post(
        clients, chat("stream", stream=True, stream_options={"include_usage": True})
    )
    assert await response.read() == wire

    # Asked not to: the sidecar still needs the usage, the client still does not see it.
    response = await post(
        clients, chat("stream", stream=True, stream_options={"include_usage": False})
    )
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE
    assert raw.received[-1].json["stream_options"] == {"include_usage": True}

    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [row["reason"] for row in rows] == ["admitted"] * 3
    assert all(row["actual_service_tokens"] == 9 + 4 * 3 for row in rows)  # from the usage chunk


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        # CRLF line ends: the event and its blank line go.
        (
            b'data: {"choices":[],"usage":{"prompt_tokens":1}}\r\n\r\ndata: [DONE]\r\n\r\n',
            b"data: [DONE]\r\n\r\n",
        ),
        # Spaces around the empty list (Python's json.dumps default).
        (
            b'data: {"choices": [ ], "usage": {"prompt_tokens": 1}}\n\ndata: [DONE]\n\n',
            b"data: [DONE]\n\n",
        ),
        # Not a usage event: an empty choices list with a null usage, kept.
        (b'data: {"choices":[],"usage":null}\n\n', b'data: {"choices":[],"usage":null}\n\n'),
        # Not JSON at all, or text that merely mentions it: kept.
        (
            b'data: {"choices":[{"delta":{"content":"\\"choices\\":[]"}}]}\n\n',
            b'data: {"choices":[{"delta":{"content":"\\"choices\\":[]"}}]}\n\n',
        ),
        (b'data: "choices":[] garbage\n\n', b'data: "choices":[] garbage\n\n'),
        # No final newline: held, then released (and still cut) at the end.
        (b'data: x\n\ndata: {"choices":[],"usage":{"prompt_tokens":1}}', b"data: x\n\n"),
        # Lines ended by a lone CR (SSE allows LF, CRLF and CR).
        (
            b'data: x\r\rdata: {"choices":[],"usage":{"prompt_tokens":1}}\r\rdata: [DONE]\r\r',
            b"data: x\r\rdata: [DONE]\r\r",
        ),
        # The whole event goes: its event:, id: and comment lines too; others' stay.
        (
            b'event: usage\nid: 7\n: c\ndata: {"choices":[],"usage":{"prompt_tokens":1}}\n\n'
            b"event: done\ndata: [DONE]\n\n",
            b"event: done\ndata: [DONE]\n\n",
        ),
        # Data over two lines: joined with LF, as a client reads it.
        (
            b'data: {"choices":[],\r\ndata: "usage":{"prompt_tokens":1}}\r\n\r\n: ping\r\n\r\n',
            b": ping\r\n\r\n",
        ),
        # LF only (the fast path: no event split): an odd LF before the event stays with the
        # event before; the event first in the stream; a "choices": [] whose usage is null stays
        # and both usage events after it go; a pattern spanning an event's end is no usage event.
        (
            b'data: x\n\n\ndata: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n',
            b"data: x\n\n\ndata: [DONE]\n\n",
        ),
        (
            b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\ndata: [DONE]\n\n',
            b"data: [DONE]\n\n",
        ),
        (
            b'data: {"choices":[],"usage":null}\n\ndata: {"choices":[],"usage":{"a":1}}\n\n'
            b'data: {"choices": [ ], "usage": {}}\n\n\n\ndata: y\n\n',
            b'data: {"choices":[],"usage":null}\n\n\n\ndata: y\n\n',
        ),
        (
            b'data: {"choices":\n\n[]\n\ndata: {"choices":[],"usage":{}}\n\n',
            b'data: {"choices":\n\n[]\n\n',
        ),
        # An extra blank line before the event stays; mixed line ends.
        (
            b'data: x\n\n\r\ndata: {"choices":[],"usage":{}}\r\n\ndata: y\r\r',
            b"data: x\n\n\r\ndata: y\r\r",
        ),
    ],
)
def test_usage_event_filter_line_shapes(wire: bytes, expected: bytes) -> None:
    for size in (1, 2, 7, len(wire)):  # fed whole and in pieces cutting through everything
        usage_filter = UsageEventFilter()
        out = b"".join(usage_filter.feed(wire[i : i + size]) for i in range(0, len(wire), size))
        assert out + usage_filter.flush() == expected, size


def test_usage_event_filter_splits_no_event_of_an_lf_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 34: with LF line ends (what servers write) the filter finds event ends with
    ``rfind`` and the usage event from its ``"choices": []``, never running the event-end regex
    over every byte nor splitting the stream event by event; the bytes out are the same."""
    events = [b'data: {"choices":[{"index":0,"text":" t%d"}]}\n\n' % i for i in range(64)]
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":64}}\n\n'
    wire = b"".join(events) + usage + b"data: [DONE]\n\n"
    expected = b"".join(events) + b"data: [DONE]\n\n"
    scans: list[str] = []

    class Counted:
        def __init__(self, pattern: Any) -> None:
            self.pattern = pattern

        def finditer(self, *args: Any) -> Any:
            scans.append("finditer")
            return self.pattern.finditer(*args)

        def search(self, *args: Any) -> Any:
            scans.append("search")
            return self.pattern.search(*args)

    monkeypatch.setattr(openai_backend, "_EVENT_END", Counted(openai_backend._EVENT_END))
    for size in (len(wire), 512, 7):
        usage_filter = UsageEventFilter()
        out = b"".join(usage_filter.feed(wire[i : i + size]) for i in range(0, len(wire), size))
        assert out + usage_filter.flush() == expected, size
    assert scans == []


_SEARCHED = st.lists(
    st.sampled_from([b'"choices"', b'"choice"', b"s", b'"', b":", b"[", b"]", b"[]", b" ",
                     b"\n", b"\r", b"\t", b"\x0b", b"\x0c", b" " * 70, b"{", b"x"]),
    max_size=40,
).map(b"".join)  # fmt: skip


@given(data=_SEARCHED, pos=st.integers(0, 40))
@settings(max_examples=400, deadline=None)
def test_empty_choices_finds_what_the_regex_finds(data: bytes, pos: int) -> None:
    """Issue 34: the usage event's ``"choices": []`` is found from its empty list (a cheaper
    scan), at the spans the regex finds, from any start; whitespace runs longer than the look
    back (70 bytes) go to the regex."""
    pos = min(pos, len(data))
    match = openai_backend._EMPTY_CHOICES.search(data, pos)
    assert openai_backend._empty_choices(data, pos) == (None if match is None else match.span())


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"a":1}\n\n',
        b'data:{"a":1}\n\n\n',
        b"data:\n\n",
        b"data\n\n",
        b"data:  two spaces\n\n",
        b": comment\ndata: x\n\n",
        b"data: x\ndata: y\n\n",
        b"data: x\r\n\r\n",
        b"data: x\r\r",
        b"event: e\n\n",
        b"datax\n\n",
    ],
)
def test_event_data_of_one_line_is_sliced_as_split(event: bytes) -> None:
    """Issue 34: an event of one ``data:`` line ended by LFs is sliced, not split; its data is
    the same as the line-by-line reading's."""
    values = [line[5:].removeprefix(b" ") if line.startswith(b"data:") else b""
              for line in openai_backend._LINE_SPLIT.split(event)
              if line.startswith(b"data:") or line == b"data"]  # fmt: skip
    assert openai_backend._event_data(event) == (b"\n".join(values) if values else None)


def record_sends(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every send aiohttp's writer makes to a client's transport (``_write`` and
    ``_writelines``, each send one item), recorded while the test runs."""
    sends: list[bytes] = []
    write = aiohttp.http_writer.StreamWriter._write
    writelines = aiohttp.http_writer.StreamWriter._writelines

    def record_write(self: Any, chunk: bytes) -> None:
        sends.append(bytes(chunk))
        write(self, chunk)

    def record_writelines(self: Any, chunks: Any) -> None:
        chunks = list(chunks)
        sends.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(aiohttp.http_writer.StreamWriter, "_write", record_write)
    monkeypatch.setattr(aiohttp.http_writer.StreamWriter, "_writelines", record_writelines)
    return sends


async def test_a_streamed_answer_s_head_goes_out_with_its_first_bytes(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: the status line and headers of a streamed answer are sent with its first
    bytes, in one write to the client's transport (not a write of their own); the client's
    bytes are the same."""
    wire = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    raw = await upstream({"stream": reply(sse_response(wire[:100], wire[100:]))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    sends = record_sends(monkeypatch)
    response = await post(clients, chat("stream", stream=True))
    assert response.status == 200
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE
    heads = [send for send in sends if send.startswith(b"HTTP/1.1 200")]
    assert len(heads) == 1
    _, _, body = heads[0].partition(b"\r\n\r\n")
    assert CONTENT_CHUNKS[0] in body  # the first event (chunk-framed) in the head's own send


async def test_a_first_write_that_may_wait_sends_the_head_on_its_own(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: when the stream's first write may wait (so the write timer watches it, from
    the bytes the client holds), the head goes first in a send of its own, as before the head
    rode with the first bytes; the client's bytes are the same."""
    wire = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    raw = await upstream({"stream": reply(sse_response(wire))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    sends = record_sends(monkeypatch)
    monkeypatch.setattr(BackendCall, "cannot_wait", lambda self, size: False)
    response = await post(clients, chat("stream", stream=True))
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE
    heads = [send for send in sends if send.startswith(b"HTTP/1.1 200")]
    assert len(heads) == 1
    assert heads[0].endswith(b"\r\n\r\n")  # the head alone


async def test_a_streamed_answer_s_end_goes_out_with_its_last_bytes(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: when the upstream's end arrives with the stream's last bytes, those bytes and
    the client's last chunk (``0\\r\\n\\r\\n``) go in one send; the client's bytes are the
    same, with the usage event cut (not asked for) or relayed (asked for)."""
    wire = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    raw = await upstream({"stream": reply(sse_response(wire))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    sends = record_sends(monkeypatch)
    for options, expected in (
        ({}, b"".join(CONTENT_CHUNKS) + DONE),
        ({"stream_options": {"include_usage": True}}, wire),
    ):
        sends.clear()
        response = await post(clients, chat("stream", stream=True, **options))
        assert response.status == 200
        assert await response.read() == expected
        last = [send for send in sends if DONE in send]
        assert len(last) == 1
        assert last[0].endswith(DONE + b"\r\n0\r\n\r\n")
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [row["reason"] for row in rows] == ["admitted"] * 2
    assert all(row["actual_service_tokens"] == 9 + 4 * 3 for row in rows)  # from the usage


def _usage_from_sse_by_whole_scans(tail: bytes) -> dict[str, Any] | None:
    """``usage_from_sse`` as it was before issue 34's cut: every line end searched for over
    the whole tail (the reference the bounded searches must agree with)."""
    end = len(tail)
    while (index := tail.rfind(b'"usage"', 0, end)) >= 0:
        start = max(tail.rfind(b"\n", 0, index), tail.rfind(b"\r", 0, index)) + 1
        if tail[start:index].lstrip().startswith(b"data:"):
            ends = (tail.find(b"\n", index), tail.find(b"\r", index))
            stop = min((e for e in ends if e >= 0), default=None)
            usage = openai_backend.usage_from_json(tail[index:stop])
            if usage is not None:
                return usage
        end = start
    return None


@given(
    st.lists(
        st.sampled_from([b"data: ", b"data:", b' {"usage":{"prompt_tokens":3}}',
                         b'"usage":{"completion_tokens":2}', b'"usage":null', b"\n", b"\r",
                         b"\r\n", b"x", b" ", b"}"]),
        max_size=24,
    ).map(b"".join)
)  # fmt: skip
@settings(max_examples=400, deadline=None)
def test_usage_from_sse_reads_every_line_end_as_before(tail: bytes) -> None:
    """Issue 34: the settlement's usage search looks for a CR only within the line it reads;
    over LF, CRLF and lone-CR lines, a usage in the last line or earlier, it finds what the
    whole-tail scans found."""
    assert openai_backend.usage_from_sse(tail) == _usage_from_sse_by_whole_scans(tail)


def test_usage_event_filter_holds_at_most_an_event_of_64_kib() -> None:
    """A line that never ends is not held whole: past 64 KiB it passes through as it comes."""
    usage_filter = UsageEventFilter()
    line = b"data: " + b"x" * (1 << 20)
    piece = 4096
    out = bytearray()
    for i in range(0, len(line), piece):
        out += usage_filter.feed(line[i : i + piece])
        assert len(line[: i + piece]) - len(out) <= MAX_HELD_EVENT_BYTES + piece  # bounded
    assert out == line  # all of it out before its end arrived
    out += usage_filter.feed(b"\n\ndata: [DONE]\n\n")
    assert out + usage_filter.flush() == line + b"\n\ndata: [DONE]\n\n"


class Gate:
    """An event the upstream waits on mid-reply, and whether the reply got past it: lets a test
    check that the client had bytes while the upstream was still under way (order, not time)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.passed = False

    async def wait(self) -> None:
        await self.open.wait()
        self.passed = True


async def read_at_least(response: aiohttp.ClientResponse, count: int) -> bytes:
    data = b""
    async with asyncio.timeout(30):  # a failure, not a speed: the bytes are due at once
        while len(data) < count:
            piece = await response.content.readany()
            assert piece, f"the stream ended after {len(data)} bytes"
            data += piece
    return data


async def test_a_stream_with_cr_line_ends_is_relayed_as_it_comes(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """An upstream ending lines with a lone CR (as SSE allows) is relayed event by event, not
    held until the end; its usage event (event: line included) is cut and still settles."""
    first = b"".join(c.replace(b"\n", b"\r") for c in CONTENT_CHUNKS)
    usage = b"event: usage\r" + USAGE_CHUNK.replace(b"\n", b"\r")
    done = DONE.replace(b"\n", b"\r")
    gate = Gate()

    async def cr_stream(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk(first)
        )
        await writer.drain()
        await gate.wait()  # until the client has the first events
        writer.write(chunk(usage) + chunk(done) + b"0\r\n\r\n")
        await writer.drain()

    raw = await upstream({"cr": cr_stream})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    async with asyncio.timeout(30):
        response = await post(clients, chat("cr", stream=True))
    assert response.status == 200
    assert await read_at_least(response, len(first)) == first
    assert not gate.passed  # the client had them while the upstream was still under way
    gate.open.set()
    assert await response.read() == done  # the usage event cut, [DONE] relayed
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (200, "admitted")
    assert row["actual_service_tokens"] == 9 + 4 * 3  # read from the CR-ended usage event


async def test_a_line_of_a_megabyte_is_relayed_intact_as_it_comes(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    line = b"data: " + b"x" * (1 << 20)
    gate = Gate()

    async def long_line(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for i in range(0, len(line), 1 << 16):
            writer.write(chunk(line[i : i + (1 << 16)]))
            await writer.drain()
        await gate.wait()  # the line has no end yet
        writer.write(chunk(b"\n\n" + USAGE_CHUNK + DONE) + b"0\r\n\r\n")
        await writer.drain()

    raw = await upstream({"long": long_line})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    async with asyncio.timeout(30):
        response = await post(clients, chat("long", stream=True))
    assert await read_at_least(response, len(line)) == line
    assert not gate.passed
    gate.open.set()
    assert await response.read() == b"\n\n" + DONE
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert row["actual_service_tokens"] == 9 + 4 * 3


# -- encodings -------------------------------------------------------------------------------------


async def test_compressed_answers_the_sidecar_did_not_ask_for(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    gz_json = json_response(gzip.compress(OK_JSON), "Content-Encoding: gzip")
    deflated = zlib.compress(OK_JSON)
    deflate_json = json_response(deflated, "Content-Encoding: deflate")
    raw_deflate_json = json_response(deflated[2:-4], "Content-Encoding: deflate")
    wire = b"".join(CONTENT_CHUNKS) + USAGE_CHUNK + DONE
    gz_stream = sse_response(gzip.compress(wire), headers=("Content-Encoding: gzip",))
    opaque = b"\x8b\x00 not decodable here \xff"
    br_json = json_response(opaque, "Content-Encoding: br")
    bad_gzip = json_response(b"\x1f\x8b not gzip at all", "Content-Encoding: gzip")
    raw = await upstream(
        {
            "gz": reply(gz_json),
            "deflate": reply(deflate_json),
            "raw-deflate": reply(raw_deflate_json),
            "gz-stream": reply(gz_stream),
            "br": reply(br_json),
            "bad-gzip": reply(bad_gzip),
        }
    )
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    for model in ("gz", "deflate", "raw-deflate"):
        response = await post(clients, chat(model))
        assert response.status == 200
        assert "Content-Encoding" not in response.headers
        assert await response.read() == OK_JSON  # decoded, and labelled as what it is
    assert raw.received[0].headers["accept-encoding"] == "identity"

    response = await post(clients, chat("gz-stream", stream=True))
    assert "Content-Encoding" not in response.headers
    assert await response.read() == b"".join(CONTENT_CHUNKS) + DONE

    # A coding the sidecar does not decode: relayed with its label, settled at the estimate.
    response = await clients.proxy.post(
        "/v1/chat/completions",
        json=chat("br"),
        headers={"Authorization": CHAT, "Accept-Encoding": "br"},
        auto_decompress=False,
    )
    assert response.headers["Content-Encoding"] == "br"
    assert await response.read() == opaque

    response = await post(clients, chat("bad-gzip"))
    assert response.status == 502
    assert (await response.json())["error"]["code"] == "upstream_error"

    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    rows = records_of(clients.sidecar)
    assert [(r["status_code"], r["reason"]) for r in rows] == [(200, "admitted")] * 5 + [
        (502, "upstream_error")
    ]
    assert [r["actual_service_tokens"] for r in rows[:4]] == [31, 31, 31, 9 + 4 * 3]
    assert rows[4]["actual_service_tokens"] == ESTIMATE_SERVICE_TOKENS  # opaque: the estimate


async def test_request_content_encoding(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    raw = await upstream({"ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    body = json.dumps(chat("ok")).encode()
    headers = {"Authorization": CHAT, "Content-Type": "application/json"}

    response = await clients.proxy.post(
        "/v1/chat/completions",
        data=gzip.compress(body),
        headers={**headers, "Content-Encoding": "gzip"},
    )
    assert response.status == 200
    forwarded = raw.received[-1]
    assert forwarded.body == body  # decoded, and no longer labelled gzip
    assert "content-encoding" not in forwarded.headers

    response = await clients.proxy.post(
        "/v1/chat/completions", data=b"\x1f\x8bnot gzip", headers={**headers,
                                                                   "Content-Encoding": "gzip"}
    )  # fmt: skip
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_encoding"

    response = await clients.proxy.post(
        "/v1/chat/completions", data=body, headers={**headers, "Content-Encoding": "xyz"}
    )
    assert response.status == 415
    assert (await response.json())["error"]["code"] == "unsupported_content_encoding"

    # Codings aiohttp decodes only with their libraries: without them 415 (not aiohttp's own
    # plain-text 400), with them read as such (these bytes are no valid body of either).
    for coding, available in (("br", HAS_BROTLI), ("zstd", HAS_ZSTD)):
        response = await clients.proxy.post(
            "/v1/chat/completions", data=b"\x8b\x00\xff", headers={**headers,
                                                                    "Content-Encoding": coding}
        )  # fmt: skip
        error = (await response.json())["error"]  # OpenAI-style either way
        expected = (400, "invalid_encoding") if available else (415, "unsupported_content_encoding")
        assert (response.status, error["code"]) == expected, coding

    # Any case, as aiohttp reads it; decoded at most to maxBodyBytes (a zip bomb is 413).
    response = await clients.proxy.post(
        "/v1/chat/completions", data=gzip.compress(body), headers={**headers,
                                                                   "Content-Encoding": "GZip"}
    )  # fmt: skip
    assert response.status == 200
    assert raw.received[-1].body == body
    bomb = gzip.compress(b" " * (clients.sidecar.settings.max_body_bytes + 1))
    response = await clients.proxy.post(
        "/v1/chat/completions", data=bomb, headers={**headers, "Content-Encoding": "gzip"}
    )
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "request_too_large"

    assert len(raw.received) == 2  # the refused ones never reached the upstream
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    assert [r["reason"] for r in records_of(clients.sidecar)] == ["admitted"] * 2


# -- headers and messages --------------------------------------------------------------------------


async def test_hop_by_hop_and_connection_named_headers_are_stripped_both_ways(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    answer = json_response(
        OK_JSON,
        "Connection: X-Upstream-Hop, keep-alive",
        "X-Upstream-Hop: secret",
        "Keep-Alive: timeout=5",
        "Proxy-Connection: keep-alive",
        "X-Upstream-End: kept",
    )
    raw = await upstream({"ok": reply(answer)})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    port = clients.proxy.port
    assert port is not None
    request = request_bytes(
        json.dumps(chat("ok")).encode(),
        "Connection: X-Client-Hop",
        "X-Client-Hop: secret",
        "Keep-Alive: timeout=5",
        "TE: trailers",
        "X-End-To-End: kept",
    )
    head, _ = await raw_exchange(port, request)
    assert head.startswith(b"HTTP/1.1 200")
    forwarded = raw.received[-1].headers
    for name in ("x-client-hop", "keep-alive", "te", "authorization"):
        assert name not in forwarded, name
    assert forwarded["x-end-to-end"] == "kept"
    returned = head.decode("latin-1").lower()
    for name in ("x-upstream-hop", "keep-alive", "proxy-connection"):
        assert f"\r\n{name}:" not in returned, name
    assert "\r\nx-upstream-end: kept" in returned
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_upstream_failures_tell_the_tenant_nothing_about_the_upstream(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    async def never_answer(writer: asyncio.StreamWriter, _: Received) -> None:
        await asyncio.sleep(30)

    raw = await upstream({"slow": never_answer})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, upstream_read_timeout_s=0.2)
    host_port = raw.url.removeprefix("http://")
    response = await post(clients, chat("slow"))
    assert response.status == 504
    message = (await response.json())["error"]["message"]
    assert host_port not in message
    assert "127.0.0.1" not in message

    # Refused: a port nobody listens on.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    (tmp_path / "refused").mkdir()
    refused = await sidecar_for(
        aiohttp_client, RawUpstream({}, url=f"http://127.0.0.1:{closed_port}"), tmp_path / "refused"
    )
    response = await post(refused, chat("any"))
    assert response.status == 502
    message = (await response.json())["error"]["message"]
    assert str(closed_port) not in message
    assert "Errno" not in message
    assert "refused" not in message.lower() or "127.0.0.1" not in message
    for sidecar in (clients, refused):
        assert await books_when_settled(sidecar.sidecar) == ZERO_BOOKS


async def test_an_upstream_head_or_body_too_large_is_502_recorded_and_dropped(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """Headers of 4 MiB (one header, written in pieces) or a non-streamed body of 16 MiB: the
    client gets a 502 ``upstream_too_large`` naming no upstream detail, the record says so,
    the sidecar stops reading (the upstream sees it leave) and the slot is free."""

    async def huge_head(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-huge: ")
        for _piece in range(64):
            writer.write(b"v" * 65536)
            await writer.drain()
        writer.write(b"\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    async def huge_body(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (16 << 20))
        for _piece in range(256):
            writer.write(bytes(65536))
            await writer.drain()

    raw = await upstream(
        {"head": huge_head, "body": huge_body, "ok": reply(json_response(OK_JSON))}
    )
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    for model in ("head", "body"):
        raw.client_gone.clear()
        response = await post(clients, chat(model))
        assert response.status == 502
        error = (await response.json())["error"]
        assert error["code"] == "upstream_too_large"
        assert "127.0.0.1" not in error["message"]
        async with asyncio.timeout(5):
            await raw.client_gone.wait()  # dropped, not read to the end
    await assert_next_request_served(clients)
    outcomes = [(r["status_code"], r["reason"]) for r in records_of(clients.sidecar)]
    assert outcomes == [(502, "upstream_too_large")] * 2 + [(200, "admitted")]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_a_gzip_answer_decoding_past_the_buffer_cap_is_upstream_too_large(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """A small gzip body (it passed the cap as sent) that decodes to over 8 MiB is the same
    ``502 upstream_too_large`` as a body over 8 MiB as sent, not an ``upstream_error``."""
    bomb = gzip.compress(b"{" + b" " * (9 << 20) + b"}")
    raw = await upstream({
        "bomb": reply(json_response(bomb, "Content-Encoding: gzip")),
        "ok": reply(json_response(OK_JSON)),
    })  # fmt: skip
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    response = await post(clients, chat("bomb"))
    assert response.status == 502
    error = (await response.json())["error"]
    assert error["code"] == "upstream_too_large"
    await assert_next_request_served(clients)
    outcomes = [(r["status_code"], r["reason"]) for r in records_of(clients.sidecar)]
    assert outcomes == [(502, "upstream_too_large"), (200, "admitted")]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_an_upstreams_own_4xx_and_503_are_not_counted_as_refusals(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    """A dispatched request the upstream answered 400, 429 or 503: relayed, recorded with that
    status, but not a refusal of the sidecar's (it was admitted and ran): 400 and 429 count as
    served, 503 as a backend error; ``tokenfair_refused_requests_total`` stays empty."""

    def status_reply(status: str) -> Reply:
        body = b'{"error":{"message":"upstream says no","code":null}}'
        return reply(
            f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    raw = await upstream({
        "u400": status_reply("400 Bad Request"),
        "u429": status_reply("429 Too Many Requests"),
        "u503": status_reply("503 Service Unavailable"),
    })  # fmt: skip
    clients = await sidecar_for(aiohttp_client, raw, tmp_path)
    for model, status in (("u400", 400), ("u429", 429), ("u503", 503)):
        response = await post(clients, chat(model))
        assert response.status == status
    counts = (await (await clients.admin.get("/status")).json())["tenants"]["tenant_chat_pro"]
    assert counts["counts"].get("refused", 0) == 0, counts
    assert counts["counts"]["served"] == 2
    assert counts["counts"]["backend_errors"] == 1
    assert counts["counts"]["admitted"] == 3
    text = await metrics_text(clients)
    assert 'reason="admitted"' not in text
    assert "tokenfair_refused_requests_total{" not in text
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


# -- clients that hold resources -------------------------------------------------------------------


async def test_a_streaming_client_that_stops_reading_is_cut_and_its_slot_freed(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path
) -> None:
    block = b"data: " + b"x" * 65_000 + b"\n\n"

    async def endless(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while True:  # until the sidecar closes the connection
            writer.write(chunk(block))
            await writer.drain()

    raw = await upstream({"endless": endless, "ok": reply(json_response(OK_JSON))})
    # The write timeout is what the test waits for; 0.5 s is short only so the test is.
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, client_write_timeout_s=0.5)
    port = clients.proxy.port
    assert port is not None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up sooner
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(request_bytes(json.dumps(chat("endless", stream=True)).encode()))
        # ... and never read. The record appears once the sidecar gave up on this client.
        assert await wait_for(lambda: bool(records_of(clients.sidecar)), budget_s=30.0)
    finally:
        writer.close()
    async with asyncio.timeout(10):
        await raw.client_gone.wait()  # the upstream call was aborted too
    await assert_next_request_served(clients)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    first = records_of(clients.sidecar)[0]
    assert (first["status_code"], first["reason"]) == (499, "client_write_timeout")


@pytest.mark.parametrize(
    ("headers", "first_bytes", "ends_with_it"),
    [(7, 40_000, False), (7, 40_000, True), (3, 57_000, False), (2, 57_000, True)],
)
async def test_a_client_that_never_reads_a_stream_with_a_large_head_is_cut(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    headers: int,
    first_bytes: int,
    ends_with_it: bool,
) -> None:
    """A streamed answer's head goes out with its first bytes only when that one send cannot
    wait, the head counted at its real size: the upstream's headers (8 KB each here, up to 64
    KiB in all) ride with the first event past the transport's high-water mark otherwise, and
    that send's drain had no timer (review rev1208d: the client kept its slot until it left,
    recorded ``499 cancelled``). Whether the upstream's end comes with the first event or not."""

    async def large_head(writer: asyncio.StreamWriter, _: Received) -> None:
        extra = b"".join(b"X-Big-%d: %s\r\n" % (i, b"v" * 8000) for i in range(headers))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + extra
            + b"Transfer-Encoding: chunked\r\n\r\n"
        )  # fmt: skip
        await writer.drain()
        event = chunk(b"data: " + b"x" * (first_bytes - 8) + b"\n\n")
        writer.write(event + (chunk(DONE) + b"0\r\n\r\n" if ends_with_it else b""))
        await writer.drain()
        if not ends_with_it:
            await asyncio.Event().wait()  # until the sidecar closes the connection

    await assert_a_non_reader_is_cut(
        aiohttp_client, upstream, tmp_path, monkeypatch, large_head, True
    )


async def test_a_client_that_never_reads_a_whole_answer_with_a_large_head_is_cut(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole answer's head goes out with its body: whether that send can wait is told with
    the head at its real size (3 upstream headers of 8 KB here), not the 8 KiB allowed for a
    head: with a 50 KB body the send passes the transport's high-water mark, and is timed
    (review rev1208e: it went out under an unwatched drain, and the client that never read
    held its connection and its answer until it left, recorded 200)."""
    content = b"w" * 50_000
    answer = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":'
    answer += b'"assistant","content":"' + content + b'"}}],"usage":{"prompt_tokens":11,'
    answer += b'"completion_tokens":5}}'

    async def large_head(writer: asyncio.StreamWriter, _: Received) -> None:
        extra = b"".join(b"X-Big-%d: %s\r\n" % (i, b"v" * 8000) for i in range(3))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(answer) + answer
        )  # fmt: skip
        await writer.drain()

    await assert_a_non_reader_is_cut(
        aiohttp_client, upstream, tmp_path, monkeypatch, large_head, False
    )


async def assert_a_non_reader_is_cut(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    answer: Reply,
    stream: bool,
) -> None:
    """A client asks for ``answer`` and never reads: it is cut at the write timeout (0.5 s:
    what the test waits for, short only so the test is), recorded ``499 client_write_timeout``
    while it is still connected, and nothing stays booked."""
    raw = await upstream({"head": answer, "ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, client_write_timeout_s=0.5)
    small_send_buffers(clients, monkeypatch)
    port = clients.proxy.port
    assert port is not None
    _reader, writer = await client_socket(port)
    try:
        writer.write(request_bytes(json.dumps(chat("head", stream=stream)).encode()))
        assert await wait_for(lambda: bool(records_of(clients.sidecar)), budget_s=30.0)
        (first,) = records_of(clients.sidecar)
    finally:
        writer.close()
    assert (first["status_code"], first["reason"]) == (499, "client_write_timeout")
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


def small_send_buffers(
    clients: Clients, monkeypatch: pytest.MonkeyPatch, *, high_water: int | None = None
) -> None:
    """Shrink the sidecar's side of each client connection before the backend answers: the
    socket's send buffer (``SO_SNDBUF``) and, with ``high_water``, the transport's write buffer
    limits, so a client that does not read fills them within a few KiB."""
    backend = clients.sidecar.backend
    respond = backend.respond

    async def small(call: BackendCall) -> web.StreamResponse:
        transport = call.request.transport
        assert isinstance(transport, asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        if high_water is not None:
            transport.set_write_buffer_limits(high=high_water)
        return await respond(call)

    monkeypatch.setattr(backend, "respond", small)


def dechunk(body: bytes) -> bytes:
    """A chunked transfer's data; AssertionError unless it ends with its last chunk."""
    data = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", "no clean end"
            return data
        data += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def sse_events(count: int, size: int = 2000) -> Reply:
    """An SSE answer of ``count`` events of ``size`` bytes, [DONE], then the stream's end."""

    async def write(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _event in range(count):
            writer.write(chunk(b"data: " + b"x" * (size - 8) + b"\n\n"))
            await writer.drain()
        writer.write(chunk(DONE) + b"0\r\n\r\n")
        await writer.drain()

    return write


@pytest.mark.parametrize("backend", ["openai", "costmodel"])
async def test_a_client_that_stops_reading_near_the_end_is_cut_at_write_eof(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:
    """The last bytes of a stream (under 64 KiB: no write waited for them) wait in the
    transport; ending the stream waits for them to drain. A client that stops reading there is
    cut like one that stops mid-stream, and its slot freed."""
    # The write timeout is what the test waits for; 0.5 s is short only so the test is.
    if backend == "openai":
        # 20 events of 2,000 bytes: 40 KB, never enough for aiohttp to wait in a write (it
        # drains only past 64 KiB written), so only the end of the stream can wait.
        raw = await upstream({"tail": sse_events(20), "ok": reply(json_response(OK_JSON))})
        clients = await sidecar_for(aiohttp_client, raw, tmp_path, client_write_timeout_s=0.5)
        body = chat("tail", stream=True)
    else:
        settings = SidecarSettings(
            time_scale=0.01,
            max_in_flight=1,
            records_path=str(tmp_path / "records.jsonl"),
            client_write_timeout_s=0.5,
        )
        clients = await start(aiohttp_client, keyed_config(), settings)
        # 6,000 words in 16 chunks: ~40 KB, under 64 KiB as well.
        body = chat("m", stream=True, max_tokens=6000)
    # Over a 4 KiB high-water mark, the transport is paused by the time the stream ends.
    small_send_buffers(clients, monkeypatch, high_water=4096)
    port = clients.proxy.port
    assert port is not None
    _reader, writer = await client_socket(port)
    try:
        writer.write(request_bytes(json.dumps(body).encode()))  # ... and never read
        assert await wait_for(lambda: bool(records_of(clients.sidecar)), budget_s=30.0)
    finally:
        writer.close()
    (first,) = records_of(clients.sidecar)
    assert (first["status_code"], first["reason"]) == (499, "client_write_timeout")
    if backend == "openai":
        await assert_next_request_served(clients)
    else:
        response = await post(clients, chat("m"))
        assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


NON_READERS = 40


@pytest.mark.parametrize("backend", ["openai", "costmodel"])
async def test_clients_that_never_read_a_whole_answer_are_cut_at_the_write_timeout(
    aiohttp_client: ClientFactory,
    upstream: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:
    """40 clients ask for a large non-streamed answer (1 MiB of JSON; embeddings of the
    costmodel engine) and never read it: each answer is written in its handler under the write
    timeout, so each client is cut (its connection reset, the answer no longer held) and
    recorded ``499 client_write_timeout`` — settled at the usage, the work was done — and the
    next request is served. The 0.5 s timeout is what the test waits for, not a speed."""
    if backend == "openai":
        big = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":'
        big += b'"assistant","content":"' + b"w" * (1 << 20) + b'"}}],"usage":{"prompt_tokens"'
        big += b':11,"completion_tokens":5}}'
        raw = await upstream(
            {"big": reply(json_response(big)), "ok": reply(json_response(OK_JSON))}
        )
        clients = await sidecar_for(
            aiohttp_client, raw, tmp_path, client_write_timeout_s=0.5, max_in_flight=64
        )
        path, body, settled = "/v1/chat/completions", chat("big"), 11 + 4 * 5
    else:
        settings = SidecarSettings(
            time_scale=0.001,
            max_in_flight=64,
            records_path=str(tmp_path / "records.jsonl"),
            client_write_timeout_s=0.5,
        )
        clients = await start(aiohttp_client, keyed_config(), settings)
        # 4 inputs of 16,384 floats: ~1.3 MB of JSON; prompt tokens ceil(4 chars / 4) + 4 inputs.
        body = {"model": "m", "input": ["x", "y", "z", "w"], "dimensions": 16384}
        path, settled = "/v1/embeddings", 1 + 4
    small_send_buffers(clients, monkeypatch)
    port = clients.proxy.port
    assert port is not None
    request = request_bytes(json.dumps(body).encode(), target=path)
    socks: list[socket.socket] = []
    try:
        for _ in range(NON_READERS):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(sock, request)
            socks.append(sock)
        # ... and never read. Every client is cut once the sidecar gave up on it.
        assert await wait_for(lambda: all(connection_cut(sock) for sock in socks), budget_s=60.0)
    finally:
        for sock in socks:
            sock.close()
    assert await wait_for(lambda: len(records_of(clients.sidecar)) == NON_READERS)
    rows = records_of(clients.sidecar)
    assert {(r["status_code"], r["reason"]) for r in rows} == {(499, "client_write_timeout")}
    assert {r["actual_service_tokens"] for r in rows} == {settled}
    if backend == "openai":
        await assert_next_request_served(clients)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_a_stream_whose_writes_cannot_wait_arms_no_write_timer(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: a write that cannot wait (the transport holds nothing and the bytes fit under
    its high-water mark) needs no timer: a stream to a client that reads is written without
    arming the write timer or asking the kernel for the client's unacknowledged bytes, and is
    relayed whole (the client that stops reading is cut: the tests above)."""
    looks: list[object] = []

    def counted(transport: Any) -> int:  # the look that arms the timer with its baseline
        looks.append(transport)
        return unacknowledged_bytes(transport)

    monkeypatch.setattr(base_backend, "unacknowledged_bytes", counted)
    raw = await upstream({"tail": sse_events(8, 500), "ok": reply(json_response(OK_JSON))})
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, client_write_timeout_s=5.0)
    response = await post(clients, chat("tail", stream=True))
    assert response.status == 200
    body = await response.read()
    assert body.count(b"data: xxx") == 8
    assert body.endswith(DONE)
    assert await wait_for(lambda: bool(records_of(clients.sidecar)))
    (record,) = records_of(clients.sidecar)
    assert record["status_code"] == 200
    assert looks == []


async def test_a_slow_reader_that_keeps_reading_is_not_cut(
    aiohttp_client: ClientFactory, upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write timeout measures how long the client takes nothing, not how long a write
    waits: a client reading ~50 KB/s needs ~1 s to take the 48 KiB a write waits on, over the
    0.5 s timeout, and is still served to the end (it takes bytes every 10 ms)."""
    raw = await upstream({"slow": sse_events(50)})  # 100 KB
    clients = await sidecar_for(aiohttp_client, raw, tmp_path, client_write_timeout_s=0.5)
    small_send_buffers(clients, monkeypatch)
    port = clients.proxy.port
    assert port is not None
    reader, writer = await client_socket(port)
    received = b""
    try:
        writer.write(request_bytes(json.dumps(chat("slow", stream=True)).encode()))
        async with asyncio.timeout(60):  # a failure, not a speed: ~2 s at this pace
            while piece := await reader.read(512):
                received += piece
                await asyncio.sleep(0.01)
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    event = b"data: " + b"x" * 1992 + b"\n\n"
    assert dechunk(body) == event * 50 + DONE  # the whole stream, cleanly ended
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    (row,) = records_of(clients.sidecar)
    assert (row["status_code"], row["reason"]) == (200, "admitted")


async def test_a_body_that_never_finishes_is_408(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # The body timeout is what the test waits for.
    settings = SidecarSettings(time_scale=0.01, client_body_timeout_s=0.3)
    clients = await start(aiohttp_client, keyed_config(), settings)
    port = clients.proxy.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + CHAT.encode()
        + b"\r\nContent-Length: 100\r\n\r\n{\"model\":"
    )  # fmt: skip
    async with asyncio.timeout(10):
        data = await reader.read()  # the sidecar answers and closes
    writer.close()
    assert data.startswith(b"HTTP/1.1 408")
    assert b'"request_timeout"' in data
    assert clients.sidecar.scheduler.books() == ZERO_BOOKS


# -- hostile inputs --------------------------------------------------------------------------------


async def test_hostile_bodies_and_keys(aiohttp_client: ClientFactory, tmp_path: Path) -> None:
    clients = await start(aiohttp_client, keyed_config())
    port = clients.proxy.port
    assert port is not None
    # 100,000 levels: refused before the parse, over maxJsonValues (200,000 brackets).
    deep = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    head, body = await raw_exchange(port, request_bytes(deep))
    assert head.startswith(b"HTTP/1.1 400")
    error = json.loads(body)["error"]
    assert error["code"] == "body_too_complex"
    assert "max_json_values" in error["message"]
    # With the value bound lifted, the parser's own limit still answers 400, not 500.
    lifted = await start(
        aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01, max_json_values=10**6)
    )
    assert lifted.proxy.port is not None
    head, body = await raw_exchange(lifted.proxy.port, request_bytes(deep))
    assert head.startswith(b"HTTP/1.1 400")
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_json"
    assert "nests JSON more deeply" in error["message"]
    # 100 levels parse, and are over maxJsonDepth (64): named.
    hundred = b'{"model":"m","prompt":"x","x":' + b"[" * 100 + b"]" * 100 + b"}"
    head, body = await raw_exchange(port, request_bytes(hundred))
    assert head.startswith(b"HTTP/1.1 400")
    assert "max_json_depth" in json.loads(body)["error"]["message"]

    key = b"Bearer sk-\xff\xfe\x80-not-utf8"
    head, body = await raw_exchange(port, request_bytes(b"{}", authorization=key))
    assert head.startswith(b"HTTP/1.1 401")
    assert json.loads(body)["error"]["code"] == "invalid_api_key"

    # Nested deep inside a field the costmodel engine echoes: still served.
    nested = {"model": [[[[["m"]]]]], "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4}  # fmt: skip
    response = await clients.proxy.post(
        "/v1/chat/completions", json=nested, headers={"Authorization": CHAT}
    )
    assert response.status == 200
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    text = await metrics_text(clients)
    # Two 400s on this sidecar (values, depth), one 401; the parser's 400 on the other one.
    assert 'tokenfair_invalid_requests_total{status="400"} 2.0' in text
    assert 'tokenfair_invalid_requests_total{status="401"} 1.0' in text


# -- the records file ------------------------------------------------------------------------------


class FullDisk:
    """A records file on a disk that fills up: while ``full``, a write takes ``room`` bytes
    (then none) and raises ``OSError(ENOSPC)`` — the fault injected, everything else real."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab", buffering=0)
        self.full = False
        self.room = 0
        self.failures = 0

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, data: bytes, /) -> int:
        if self.full:
            if self.room:
                taken, self.room = data[: self.room], 0
                written = self._file.write(taken)
                assert written is not None
                return written
            self.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self._file.write(data)
        assert written is not None
        return written

    def close(self) -> None:
        self._file.close()


async def test_records_survive_a_full_disk(aiohttp_client: ClientFactory, tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    settings = SidecarSettings(time_scale=0.01, records_path=str(path))
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    assert sidecar.outcomes.record_writer is not None
    sidecar.outcomes.record_writer.close()
    disk = FullDisk(path)
    # Five records may wait; retried every 10 ms (the defaults: 10,000 and 1 s).
    sidecar.outcomes.record_writer = RecordWriter.to_file(
        disk,
        str(path),
        max_pending=5,
        retry_interval_s=0.01,
        on_dropped=sidecar.metrics.records_dropped.inc,
    )

    async def send(count: int) -> None:
        for _ in range(count):
            response = await clients.proxy.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"Authorization": CHAT},
            )
            assert response.status == 200

    await send(2)
    disk.full, disk.room = True, 100  # the third record is cut after 100 bytes, then nothing fits
    # The rest of the cut line waits, and 5 whole records; the other 2 are dropped.
    await send(8)
    assert await wait_for(lambda: disk.failures >= 2)  # retried while it fails
    disk.full = False  # space again: the waiting records go out on the next retry
    assert await wait_for(lambda: len(path.read_bytes().splitlines()) == 2 + 1 + 5)
    await send(2)
    assert sidecar.outcomes.record_writer.flush()
    lines = path.read_text().splitlines()
    assert len(lines) == 10
    ids = [json.loads(line)["request_id"] for line in lines]  # every line whole JSON
    assert len(set(ids)) == 10
    assert sidecar.outcomes.record_writer.dropped == 2
    text = await metrics_text(clients)
    assert "tokenfair_records_dropped_total 2.0" in text
    assert await books_when_settled(sidecar) == ZERO_BOOKS


# -- the sidecar's own failures -------------------------------------------------------------------


async def test_a_failure_inside_the_sidecar_is_one_500_record_and_no_leak(
    aiohttp_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the backend or in settlement (injected) still ends the request exactly once:
    the true outcome recorded, the slot and KV released."""
    settings = SidecarSettings(time_scale=0.01, max_in_flight=1)
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    lines: list[str] = []
    monkeypatch.setattr(sidecar.outcomes, "record_writer", RecordWriter.to_file(_Lines(lines)))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def broken(call: Any) -> Any:
        raise RuntimeError("injected backend bug")

    with monkeypatch.context() as patch:
        patch.setattr(sidecar.backend, "respond", broken)
        response = await clients.proxy.post(
            "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
        )
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "internal_error"

    def broken_hold(call: Any) -> float:
        raise RuntimeError("injected settlement bug")

    with monkeypatch.context() as patch:
        patch.setattr(sidecar.backend, "kv_hold_ms", broken_hold)
        response = await clients.proxy.post(
            "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
        )
    assert response.status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    assert sidecar.outcomes.record_writer is not None
    sidecar.outcomes.record_writer.flush()
    rows = [json.loads(line) for line in "".join(lines).splitlines()]
    outcomes = [(row["status_code"], row["reason"]) for row in rows]
    assert outcomes == [(500, "internal_error"), (200, "admitted")]
    text = await metrics_text(clients)
    assert 'code="internal_error"' in text


async def post_twice(clients: Clients) -> list[aiohttp.ClientResponse]:
    """Two requests one after the other (one in flight at most: a leaked slot would queue the
    second until the test fails, rather than forever)."""
    responses = []
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(2):
        async with asyncio.timeout(30):
            response = await clients.proxy.post(
                "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
            )
            await response.read()
        responses.append(response)
    return responses


def one_record_each(clients: Clients, responses: list[aiohttp.ClientResponse]) -> list[Any]:
    """The records, asserted to be exactly one per response (joined by x-request-id)."""
    rows = records_of(clients.sidecar)
    assert [row["request_id"] for row in rows] == [r.headers["x-request-id"] for r in responses]
    return rows


@pytest.mark.parametrize("failures", [1, 2], ids=["at-usage", "at-usage-and-estimate"])
async def test_a_core_that_fails_to_settle_still_frees_the_slot_and_records_once(
    aiohttp_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """``complete`` raising something unexpected (injected: a core bug) for the reported usage
    falls back to the estimate; raising for that too, the slot and KV are released without the
    core's settlement code. Either way the next request is served and the books are zero."""
    settings = SidecarSettings(
        time_scale=0.01, max_in_flight=1, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, keyed_config(), settings)
    scheduler = clients.sidecar.scheduler
    complete = scheduler.complete
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= failures:
            raise RuntimeError("injected core bug")
        return complete(*args, **kwargs)

    monkeypatch.setattr(scheduler, "complete", failing)
    responses = await post_twice(clients)
    assert [r.status for r in responses] == [200, 200]  # answered, then the slot was free
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    first, second = one_record_each(clients, responses)
    assert (first["status_code"], first["reason"]) == (200, "internal_error")
    assert first["actual_service_tokens"] in (None, first["service_tokens"])  # the estimate
    assert (second["status_code"], second["reason"]) == (200, "admitted")
    assert 'code="internal_error"' in await metrics_text(clients)


async def test_an_accounting_failure_still_writes_one_record(
    aiohttp_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = SidecarSettings(
        time_scale=0.01, max_in_flight=1, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    count = sidecar.outcomes.count  # the counting step of the outcome sink
    failed = False

    def failing(*args: Any, **kwargs: Any) -> None:
        nonlocal failed
        if not failed:
            failed = True
            raise RuntimeError("injected accounting bug")
        count(*args, **kwargs)

    monkeypatch.setattr(sidecar.outcomes, "count", failing)
    responses = await post_twice(clients)
    assert failed
    assert [r.status for r in responses] == [200, 200]
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = one_record_each(clients, responses)
    assert [(row["status_code"], row["reason"]) for row in rows] == [(200, "admitted")] * 2

    # A record that cannot be encoded is written minimal; one that cannot be queued is counted.
    def broken_encoding(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("injected encoding bug")

    monkeypatch.setattr("tokenfair.server.outcomes.encode_record", broken_encoding)
    responses += await post_twice(clients)
    rows = one_record_each(clients, responses)
    assert [(row["status_code"], row["reason"]) for row in rows[2:]] == [(200, "admitted")] * 2
    assert "dispatch_ms" not in rows[2]  # minimal: the request's own fields and its outcome
    assert sidecar.outcomes.record_writer is not None

    def broken_write(line: str) -> None:
        raise RuntimeError("injected write bug")

    monkeypatch.setattr(sidecar.outcomes.record_writer, "write", broken_write)
    responses += await post_twice(clients)
    assert "tokenfair_records_dropped_total 2.0" in await metrics_text(clients)
    assert await books_when_settled(sidecar) == ZERO_BOOKS


async def test_release_unsettled_takes_what_the_core_cannot_settle_off_the_books(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatcher's core-free last resort: the core raising in ``complete`` (for the usage
    and for the estimate) or in ``release_kv`` still frees the slot (the next request is
    dispatched) and the KV."""
    scheduler = make_scheduler("tokenfair", keyed_config(), 0.0)
    dispatcher = Dispatcher(scheduler, ModelClock(), max_in_flight=1)
    first = dispatcher.submit(Request("r-1", "tenant_chat_pro", 0.0, 280, 90, "interactive"))
    second = dispatcher.submit(Request("r-2", "tenant_chat_pro", 0.0, 280, 90, "interactive"))
    assert first.phase is Phase.RUNNING
    assert second.phase is Phase.QUEUED  # queued behind the one slot

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected core bug")

    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "complete", broken)
        assert dispatcher.complete(first, 300, 0.0) is Settlement.CORE_FAILED
    assert phase_of(first) is Phase.SETTLED
    assert phase_of(second) is Phase.RUNNING  # the slot went to the next request
    assert scheduler.books().running_requests == 1
    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "release_kv", broken)
        assert dispatcher.complete(second, 300, 0.0) is Settlement.AS_REPORTED
    assert scheduler.books() == ZERO_BOOKS
    assert dispatcher.complete(second, 999, 0.0) is Settlement.AS_REPORTED  # once only
    assert second.booked_service_tokens == 300


class _Lines:
    """A records file in memory."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.closed = False

    def write(self, data: bytes, /) -> int:
        self.lines.append(data.decode())
        return len(data)

    def close(self) -> None:
        self.closed = True


def phase_of(lifecycle: Lifecycle) -> Phase:
    """The phase now (a call: mypy does not carry an earlier ``assert`` on it past a move)."""
    return lifecycle.phase
