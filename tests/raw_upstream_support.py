"""A raw upstream for the sidecar's fault tests, and the sidecar in front of it (no tests here).

:class:`RawUpstream` (the ``upstream`` fixture: a pytest plugin of ``tests/conftest.py``) is an
``asyncio.start_server`` whose reply is chosen by the request's ``model`` and written as exact
bytes (bad usage numbers, a stream cut mid-way, gzip the sidecar did not ask for, trailers,
hop-by-hop headers); :func:`sidecar_for` puts the ``openai`` backend in front of it, one request
in flight, records on. Raw client helpers send bytes aiohttp's client would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sidecar_support import CHAT, ClientFactory, Clients, keyed_config, start

from tokenfair.server.runtime_settings import SidecarSettings

USAGE_CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
USAGE_CHUNK += b'"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}\n\n'
CONTENT_CHUNKS = [
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"w%d "},"finish_reason":null}]}\n\n' % i
    for i in range(3)
]
DONE = b"data: [DONE]\n\n"
OK_JSON = (
    b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":11,'
    b'"completion_tokens":5,"total_tokens":16}}'
)


# -- the raw upstream ------------------------------------------------------------------------------


@dataclass
class Received:
    """One request as the upstream read it."""

    head: bytes
    body: bytes

    @property
    def headers(self) -> dict[str, str]:
        lines = self.head.decode("latin-1").split("\r\n")[1:]
        return {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines if line)
        }

    @property
    def json(self) -> dict[str, Any]:
        payload: dict[str, Any] = json.loads(self.body)
        return payload


Reply = Callable[[asyncio.StreamWriter, Received], Awaitable[None]]


@dataclass
class RawUpstream:
    """Answers each request with ``replies[model]`` (exact bytes), then closes the connection.
    A reply that meets the client gone ends quietly and sets ``client_gone``."""

    replies: dict[str, Reply]
    received: list[Received] = field(default_factory=list)
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    errors: list[BaseException] = field(default_factory=list)
    url: str = ""
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            seen = Received(head, await reader.readexactly(length))
            self.received.append(seen)
            await self.replies[seen.json["model"]](writer, seen)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.client_gone.set()
        except asyncio.CancelledError:
            pass  # the fixture stopped the server: a quiet end
        except Exception as exc:
            self.errors.append(exc)
        finally:
            self.tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[dict[str, Reply]], Awaitable[RawUpstream]]]:
    servers: list[tuple[asyncio.Server, RawUpstream]] = []

    async def make(replies: dict[str, Reply]) -> RawUpstream:
        raw = RawUpstream(replies)
        server = await asyncio.start_server(raw.serve, "127.0.0.1", 0)
        raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        servers.append((server, raw))
        return raw

    yield make
    for server, raw in servers:
        server.close()
        for task in list(raw.tasks):
            task.cancel()
        await asyncio.gather(*raw.tasks, return_exceptions=True)
        assert not raw.errors, raw.errors


def reply(data: bytes) -> Reply:
    async def write(writer: asyncio.StreamWriter, _: Received) -> None:
        writer.write(data)
        await writer.drain()

    return write


def json_response(body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{header}\r\n" for header in headers)
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse_response(*events: bytes, headers: tuple[str, ...] = (), end: bool = True) -> bytes:
    extra = "".join(f"{header}\r\n" for header in headers)
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        f"{extra}Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    return head + b"".join(chunk(event) for event in events) + (b"0\r\n\r\n" if end else b"")


def usage_json(usage: bytes) -> bytes:
    return b'{"id":"x","object":"chat.completion","choices":[],"usage":' + usage + b"}"


# -- the sidecar in front of it --------------------------------------------------------------------


async def sidecar_for(
    aiohttp_client: ClientFactory, raw: RawUpstream, tmp_path: Path, **settings: Any
) -> Clients:
    """The openai backend in front of ``raw``, one request in flight at a time (so a leaked
    slot shows as the next request never being served), request records on."""
    options: dict[str, Any] = {
        "backend": "openai",
        "upstream_url": raw.url,
        "max_in_flight": 1,
        "records_path": str(tmp_path / "records.jsonl"),
        "upstream_read_timeout_s": 10.0,
        "engine_metrics": "off",  # the raw upstream is no engine: it serves no /metrics
        **settings,
    }
    return await start(aiohttp_client, keyed_config(), SidecarSettings(**options))


async def metrics_text(clients: Clients) -> str:
    return await (await clients.admin.get("/metrics")).text()


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        **extra,
    }


# "hi": ceil(2 / 4) + 4 = 5 prompt tokens; 50 decode tokens at weight 4: 5 + 200 = 205.
ESTIMATE_SERVICE_TOKENS = 205


async def post(clients: Clients, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
    return await clients.proxy.post(
        "/v1/chat/completions", json=body, headers={"Authorization": CHAT, **headers}
    )


async def assert_next_request_served(clients: Clients) -> None:
    """With one request in flight at most, a leaked slot would queue this one forever."""
    response = await post(clients, chat("ok"))
    assert response.status == 200
    assert (await response.json())["usage"]["completion_tokens"] == 5


async def raw_exchange(port: int, request: bytes) -> tuple[bytes, bytes]:
    """Send raw request bytes; the response head and body (read to the connection's end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def request_bytes(
    body: bytes, *headers: str, authorization: bytes = CHAT.encode(), target: str = ""
) -> bytes:
    extra = "".join(f"{header}\r\n" for header in headers).encode()
    return (
        f"POST {target or '/v1/chat/completions'} HTTP/1.1\r\nHost: sidecar\r\n".encode()
        + b"Authorization: " + authorization + b"\r\n" + extra
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )  # fmt: skip


async def client_socket(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the sidecar with a 4 KiB receive buffer, read through a 512-byte limit."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=512)


TCP_CLOSED_STATES = frozenset({7, 8})
"""Linux's ``TCP_CLOSE`` (after a reset) and ``TCP_CLOSE_WAIT`` (after the peer's end)."""


def connection_cut(sock: socket.socket) -> bool:
    """Whether the peer has reset or ended this connection, seen in the socket's TCP state
    (``TCP_INFO``, Linux): neither reading (a client that never reads stays one; a reset is not
    seen by ``recv`` while bytes wait in the socket) nor writing."""
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    return state in TCP_CLOSED_STATES
