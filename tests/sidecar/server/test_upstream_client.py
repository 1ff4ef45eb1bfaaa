"""The sidecar's HTTP/1.1 upstream client (``tokenfair.server.upstream``) against real
servers on loopback, plus ``usage_from_sse`` of the OpenAI backend.

Every server here is an ``asyncio.start_server`` that reads the raw request bytes and writes
scripted raw response bytes, so the framing (Content-Length, chunked, end of connection, interim
responses, garbage) is exactly what the test says; it records what it received and how many
connections it accepted, and sees when the client leaves a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from loopback_support import TLSFiles, free_ports, localhost_tls

from tokenfair.server.backends.openai import usage_from_sse
from tokenfair.server.upstream import (
    HIGH_WATER_BYTES,
    IDLE_KEEPALIVE_S,
    MAX_BUFFERED_BODY_BYTES,
    MAX_RESPONSE_HEAD_BYTES,
    Origin,
    UpstreamClient,
    UpstreamClosedError,
    UpstreamResponse,
    UpstreamTooLargeError,
    keepalive_limit_s,
    parse_origin,
)

SOCKET_READ_BYTES = 256 * 1024
"""The most asyncio's socket transport reads at once: the client may buffer one such read past
HIGH_WATER_BYTES before it pauses reading."""

pytestmark = pytest.mark.virtual_time
"""Every wait here is on the event loop's clock, virtual (tests/clock_support.py): a peer's
pauses, the client's read timeouts and the bounds on waiting for something that must happen."""

WAIT_S = 5.0
"""Upper bound for waiting on something that must happen (never reached when all is well)."""


# -- the scripted server ---------------------------------------------------------------------------


@dataclass
class Peer:
    """One connection the scripted server accepted."""

    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: list[bytes] = field(default_factory=list)
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the client closed (EOF) or reset this connection."""

    async def read_request(self) -> bytes:
        """The next request's raw bytes (head and Content-Length body); IncompleteReadError at
        the client's EOF."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        raw = head + await self.reader.readexactly(length)
        self.requests.append(raw)
        return raw

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_client_gone(self) -> None:
        """Read (and drop) whatever comes until the client closes or resets the connection."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(1 << 16):
                pass
        self.client_gone.set()


Script = Callable[[Peer], Awaitable[None]]


class ScriptedServer:
    """``script(peer)`` runs for every accepted connection; the server closes the connection
    when the script returns. A client leaving mid-script (EOF, reset) ends the script quietly;
    any other exception is kept in ``errors`` (the fixture fails the test on it)."""

    def __init__(self, script: Script, ssl_context: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.ssl_context = ssl_context
        self.peers: list[Peer] = []
        self.errors: list[BaseException] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1") -> None:
        self._server = await asyncio.start_server(self._serve, host, 0, ssl=self.ssl_context)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def url(self, scheme: str = "http", host: str = "127.0.0.1", path: str = "") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    @property
    def accepted(self) -> int:
        return len(self.peers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(len(self.peers), reader, writer)
        self.peers.append(peer)
        try:
            await self._run(peer)
        except asyncio.CancelledError:
            pass  # stop() ended it: a quiet end, not an error for asyncio's callback to log
        finally:
            self._tasks.discard(task)

    async def _run(self, peer: Peer) -> None:
        try:
            await self.script(peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            peer.client_gone.set()
        except Exception as exc:
            self.errors.append(exc)
        finally:
            peer.writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await peer.writer.wait_closed()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for peer in self.peers:
            peer.writer.close()
        if self._server is not None:
            await self._server.wait_closed()


def answer_each(response: bytes) -> Script:
    """A keep-alive server: every request on the connection gets ``response``, until the client
    leaves."""

    async def script(peer: Peer) -> None:
        while True:
            await peer.read_request()
            await peer.send(response)

    return script


def ok(body: bytes = b"ok", *extra_headers: str) -> bytes:
    head = "".join(f"{header}\r\n" for header in extra_headers)
    return f"HTTP/1.1 200 OK\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds (bounded by WAIT_S: a failure, not a speed check)."""
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.005)


async def gone(peer: Peer) -> None:
    """Wait until the client left ``peer``'s connection (a failure after WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        await peer.client_gone.wait()


async def fetch(client: UpstreamClient) -> bytes:
    """POST / and read the whole body."""
    response = await client.request("POST", "/", [], b"")
    try:
        return await response.read()
    finally:
        response.release()


async def stream(response: UpstreamResponse) -> AsyncIterator[bytes]:
    while part := await response.next_chunk():
        yield part


async def drain_stream(response: UpstreamResponse) -> bytes:
    return b"".join([part async for part in stream(response)])


ServerFactory = Callable[..., Awaitable[ScriptedServer]]
ClientFactory = Callable[..., UpstreamClient]


@pytest.fixture
async def serve() -> AsyncIterator[ServerFactory]:
    servers: list[ScriptedServer] = []

    async def start(
        script: Script, *, ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> ScriptedServer:
        server = ScriptedServer(script, ssl_context)
        servers.append(server)
        await server.start(host)
        return server

    yield start
    errors = []
    for server in servers:
        await server.stop()
        errors += server.errors
    assert not errors, f"scripted server failed: {errors!r}"


@pytest.fixture
async def clients(serve: ServerFactory) -> AsyncIterator[ClientFactory]:
    """Clients closed before the servers (this fixture depends on ``serve``)."""
    made: list[UpstreamClient] = []

    def make(
        url: str, *, connect_timeout_s: float = 2.0, read_timeout_s: float = 2.0
    ) -> UpstreamClient:
        client = UpstreamClient(
            url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s
        )
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


# -- parse_origin ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "origin", "host_header"),
    [
        ("http://example.com", Origin("http", "example.com", 80, ""), "example.com"),
        ("https://example.com", Origin("https", "example.com", 443, ""), "example.com"),
        ("http://Example.COM:8080", Origin("http", "example.com", 8080, ""), "example.com:8080"),
        # a default port of the *other* scheme is not default: it stays in the Host header
        ("https://h:80/", Origin("https", "h", 80, ""), "h:80"),
        ("http://[::1]:8000", Origin("http", "::1", 8000, ""), "[::1]:8000"),
        ("http://[::1]", Origin("http", "::1", 80, ""), "[::1]"),
        ("http://h/prefix/", Origin("http", "h", 80, "/prefix"), "h"),
        ("http://h:81/a/b//", Origin("http", "h", 81, "/a/b"), "h:81"),
    ],
)
def test_parse_origin_ports_hosts_and_base_path(url: str, origin: Origin, host_header: str) -> None:
    parsed = parse_origin(url)
    assert parsed == origin
    assert parsed.host_header == host_header


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://h/", "must start with http:// or https://"),
        ("h:8000", "must start with http:// or https://"),
        ("http:///v1", "has no host"),
        ("http://:8000/", "has no host"),
        ("http://user:secret@h/", "must not carry credentials"),
        ("http://user@h/", "must not carry credentials"),
        ("http://h/?a=1", "must not have a query or fragment"),
        ("http://h/#top", "must not have a query or fragment"),
        ("http://h:99999/", "not a valid URL"),
        ("http://h:http/", "not a valid URL"),
        ("http://[::1/", "not a valid URL"),
        ("http://h:0/", "must not have port 0"),
        ("http://h/a b", "characters a URL path cannot hold"),
    ],
)
def test_parse_origin_refusals_name_the_rule(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_origin(url)


async def test_base_path_is_prepended_to_the_request_target(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    server = await serve(answer_each(ok()))
    client = clients(server.url(path="/prefix/"))
    response = await client.request("POST", "/v1/chat/completions?x=1", [], b"")
    response.release()
    request_line = server.peers[0].requests[0].split(b"\r\n")[0]
    assert request_line == b"POST /prefix/v1/chat/completions?x=1 HTTP/1.1"


async def test_ipv6_loopback_origin_sends_a_bracketed_host_header(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    server = await serve(answer_each(ok(b"six")), host="::1")
    client = clients(server.url(host="[::1]"))
    response = await client.request("GET", "/", [], b"")
    assert await response.read() == b"six"
    response.release()
    assert f"\r\nHost: [::1]:{server.port}\r\n".encode() in server.peers[0].requests[0]


# -- the request's bytes ---------------------------------------------------------------------------


async def test_request_bytes_are_exactly_the_request(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """Request line, Host first, the given headers in order (repeats kept), Content-Length
    last, then the body byte for byte (binary, not decoded)."""
    server = await serve(answer_each(ok()))
    client = clients(server.url())
    body = b'{"model":"m"}' + bytes(range(256))
    headers = [("X-A", "1"), ("Content-Type", "application/json"), ("X-A", "2 ünï")]
    response = await client.request("POST", "/v1/completions", headers, body)
    assert response.status == 200
    response.release()
    expected_head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        "X-A: 1\r\nContent-Type: application/json\r\nX-A: 2 ünï\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    assert server.peers[0].requests == [expected_head + body]


@pytest.mark.parametrize("bad", ["a\rb", "a\nb", "a\r\nX-Injected: 1"])
async def test_header_value_with_cr_or_lf_is_refused_and_nothing_is_sent(
    serve: ServerFactory, clients: ClientFactory, bad: str
) -> None:
    server = await serve(answer_each(ok()))
    client = clients(server.url())
    with pytest.raises(ValueError, match="X-Bad"):
        await client.request("POST", "/", [("X-Bad", bad)], b"body")
    assert server.accepted == 0
    assert not client.connections
    # On a pooled connection too: the refused request leaves nothing on the wire, so the next
    # request is the second (and last) thing the server reads on that connection.
    (await client.request("POST", "/first", [], b"")).release()
    with pytest.raises(ValueError, match="CR or LF"):
        await client.request("POST", "/bad", [("X-Bad", bad)], b"body")
    response = await client.request("POST", "/second", [], b"")
    response.release()
    assert server.accepted == 1
    lines = [raw.split(b"\r\n")[0] for raw in server.peers[0].requests]
    assert lines == [b"POST /first HTTP/1.1", b"POST /second HTTP/1.1"]


async def test_head_is_refused_before_anything_is_sent(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    # The parser does not know the method: it would wait for the body a HEAD answer announces.
    server = await serve(answer_each(ok()))
    client = clients(server.url())
    with pytest.raises(ValueError, match="HEAD"):
        await client.request("HEAD", "/", [], b"")
    assert server.accepted == 0


# -- response framing ------------------------------------------------------------------------------


async def test_content_length_body_is_read_whole(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB, many socket reads: read() must not pause

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok(body, "X-One: 1", "X-Two: ü")[:100])
        await asyncio.sleep(0.01)
        await peer.send(ok(body, "X-One: 1", "X-Two: ü")[100:])
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert response.status == 200
    assert response.headers == [("X-One", "1"), ("X-Two", "ü"), ("Content-Length", str(len(body)))]
    async with asyncio.timeout(WAIT_S):  # a reader left paused would wait forever
        assert await response.read() == body
    response.release()
    assert client.idle_connections == 1


async def test_chunked_body_split_across_writes_arrives_whole(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    pieces = [b"data: one\n\n", b"data: two\n\n", b"x" * 5000, b"data: [DONE]\n\n"]
    wire = CHUNKED_HEAD + b"".join(chunk(piece) for piece in pieces) + LAST_CHUNK

    async def script(peer: Peer) -> None:
        await peer.read_request()
        for start in range(0, len(wire), 7):  # cuts through heads, sizes, data and CRLFs
            await peer.send(wire[start : start + 7])
            if start % 700 == 0:
                await asyncio.sleep(0.002)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert response.status == 200
    assert ("Transfer-Encoding", "chunked") in response.headers
    received = []
    while part := await response.next_chunk():
        received.append(part)
    assert b"".join(received) == b"".join(pieces)
    assert len(received) > 1  # it did stream: bytes were handed over before the end
    assert await response.next_chunk() == b""  # the end stays the end
    response.release()
    assert client.idle_connections == 1


async def test_body_framed_by_the_end_of_the_connection(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    body = b"until the end " * 1000

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body[:10])
        await asyncio.sleep(0.01)
        await peer.send(body[10:])

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == body
    response.release()
    assert client.idle_connections == 0


async def test_204_has_no_body_and_keeps_the_connection(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    server = await serve(answer_each(b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n"))
    client = clients(server.url())
    for _ in range(2):
        response = await client.request("POST", "/", [], b"")
        assert response.status == 204
        assert await response.read() == b""
        response.release()
    assert server.accepted == 1


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\nX-Interim: yes\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
    ],
)
async def test_interim_responses_are_skipped(
    serve: ServerFactory, clients: ClientFactory, interim: bytes
) -> None:
    async def script(peer: Peer) -> None:
        while True:
            await peer.read_request()
            await peer.send(interim)
            await asyncio.sleep(0.01)
            await peer.send(ok(b"final", "X-Final: yes"))

    server = await serve(script)
    client = clients(server.url())
    for _ in range(2):
        response = await client.request("POST", "/", [], b"")
        assert response.status == 200
        assert response.headers == [("X-Final", "yes"), ("Content-Length", "5")]
        assert await response.read() == b"final"
        response.release()
    assert server.accepted == 1


# -- keep-alive ------------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    server = await serve(answer_each(ok(b"again")))
    client = clients(server.url())
    for _ in range(3):
        response = await client.request("POST", "/", [], b"x")
        assert await response.read() == b"again"
        response.release()
        assert client.idle_connections == 1
    assert server.accepted == 1
    assert len(server.peers[0].requests) == 3


async def test_concurrent_requests_get_their_own_connections(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    release = asyncio.Event()

    async def script(peer: Peer) -> None:
        while True:
            raw = await peer.read_request()
            await release.wait()
            await peer.send(ok(raw.split(b"\r\n")[0]))

    server = await serve(script)
    client = clients(server.url())
    tasks = [asyncio.create_task(client.request("POST", f"/{n}", [], b"")) for n in range(3)]
    await wait_for(lambda: sum(len(peer.requests) for peer in server.peers) == 3)
    release.set()
    for n, task in enumerate(tasks):
        response = await task
        assert await response.read() == f"POST /{n} HTTP/1.1".encode()
        response.release()
    assert server.accepted == 3
    assert client.idle_connections == 3


async def test_connection_close_response_is_not_reused(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok(b"bye", "Connection: close"))
        await peer.until_client_gone()  # the server keeps it open: the client must close it

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"bye"
    response.release()
    await gone(server.peers[0])
    assert client.idle_connections == 0
    (await client.request("POST", "/", [], b"")).release()
    assert server.accepted == 2


async def test_http_1_0_response_without_keep_alive_is_not_reused(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    await gone(server.peers[0])
    assert client.idle_connections == 0


async def test_unfinished_response_released_closes_its_connection(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"0123456789")
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.next_chunk() == b"0123456789"
    response.release()
    await gone(server.peers[0])
    assert client.idle_connections == 0
    with pytest.raises(RuntimeError, match="released"):
        await response.next_chunk()
    second = await client.request("POST", "/", [], b"")
    assert second.status == 200
    second.close()
    assert server.accepted == 2


async def test_closing_a_finished_response_closes_its_connection(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """``close()`` means "abandon": even a keep-alive response read to its end is not pooled."""
    server = await serve(answer_each(ok()))
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.close()
    await gone(server.peers[0])
    assert client.idle_connections == 0


async def test_closing_a_response_aborts_a_long_stream(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """The upstream sees the client leave while it is still generating."""
    stopped_by: list[BaseException] = []

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        try:
            while True:  # an endless stream: only the client leaving stops it
                await peer.send(chunk(b"data: token\n\n" * 100))
                await asyncio.sleep(0.001)
        except ConnectionError as exc:
            stopped_by.append(exc)
            raise

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert (await response.next_chunk()).startswith(b"data: token")
    response.close()
    response.close()  # twice is harmless
    await gone(server.peers[0])
    assert stopped_by
    assert not client.connections
    assert client.idle_connections == 0


# -- failures --------------------------------------------------------------------------------------


async def test_connection_refused_names_the_host(clients: ClientFactory) -> None:
    (port,) = free_ports(1)
    client = clients(f"http://127.0.0.1:{port}")
    with pytest.raises(UpstreamClosedError, match=f"cannot connect to 127.0.0.1:{port}"):
        await client.request("POST", "/", [], b"")
    assert not client.connections


async def test_server_closing_before_answering(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()  # then return: the server closes the connection

    server = await serve(script)
    client = clients(server.url())
    with pytest.raises(UpstreamClosedError, match="before answering"):
        await client.request("POST", "/", [], b"")
    assert not client.connections
    assert client.idle_connections == 0


async def test_server_closing_mid_body(serve: ServerFactory, clients: ClientFactory) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"0123456789")

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    with pytest.raises(UpstreamClosedError, match="mid-response"):
        await response.read()
    response.release()
    assert client.idle_connections == 0


async def test_server_closing_mid_chunked_stream(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.next_chunk() == b"data: one\n\n"
    with pytest.raises(UpstreamClosedError, match="mid-response"):
        await response.next_chunk()
    response.release()


@pytest.mark.parametrize(
    "garbage",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"hello, not http\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_malformed_response_is_an_upstream_error(
    serve: ServerFactory, clients: ClientFactory, garbage: bytes
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(garbage)
        await peer.until_client_gone()  # the client, not the server, must end it

    server = await serve(script)
    client = clients(server.url())
    with pytest.raises(UpstreamClosedError, match="malformed"):
        await fetch(client)  # a bad head fails request(), a bad body read()
    await gone(server.peers[0])


async def test_switching_protocols_is_refused(serve: ServerFactory, clients: ClientFactory) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
        )
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    with pytest.raises(UpstreamClosedError, match="switched protocols"):
        await client.request("POST", "/", [], b"")
    await gone(server.peers[0])


async def test_a_second_response_in_the_same_segment_is_not_taken_for_a_keep_alive(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """Bytes after the response (here a whole unrequested response) mean the connection cannot
    be trusted: the answer is still delivered, the connection is not reused."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok(b"one") + ok(b"two"))
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"one"
    response.release()
    await gone(server.peers[0])
    assert client.idle_connections == 0


async def test_read_timeout_when_the_server_never_answers(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.2)
    # asyncio.timeout only bounds a broken timer; its TimeoutError has no message, so it fails
    with pytest.raises(TimeoutError, match=re.escape("no upstream bytes for 0.2 s")):
        async with asyncio.timeout(WAIT_S):
            await client.request("POST", "/", [], b"")
    await gone(server.peers[0])
    assert not client.connections


async def test_read_timeout_when_a_stream_stalls_after_its_head(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: first\n\n"))
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.2)
    response = await client.request("POST", "/", [], b"")
    assert await response.next_chunk() == b"data: first\n\n"
    with pytest.raises(TimeoutError, match="no upstream bytes"):
        async with asyncio.timeout(WAIT_S):
            await response.next_chunk()
    response.release()
    await gone(server.peers[0])


async def test_read_timeout_counts_from_the_last_byte_not_the_request(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """A stream that keeps sending, a byte well within the timeout each time, outlives the
    timeout several times over (the timer re-arms from the last byte)."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        for n in range(8):
            await asyncio.sleep(0.1)
            await peer.send(chunk(b"%d" % n))
        await peer.send(LAST_CHUNK)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.3)
    response = await client.request("POST", "/", [], b"")
    assert await drain_stream(response) == b"01234567"
    response.release()


async def test_a_pooled_connection_keeps_one_read_timer_across_its_requests(
    serve: ServerFactory, clients: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read timeout's timer belongs to the connection: sequential requests on one pooled
    connection arm it once, not once a request (a timer handle, a heap push and a cancel saved
    per request on the hot path)."""
    server = await serve(answer_each(ok(b"again")))
    client = clients(server.url(), read_timeout_s=60.0)
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__name__", "") == "_on_timer":  # not the connect's timeout
            armed.append(when)
        return call_at(when, callback, *args)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    for _ in range(5):
        assert await fetch(client) == b"again"
    assert server.accepted == 1
    assert len(armed) == 1


async def test_read_timeout_on_a_reused_connection_counts_from_its_own_request(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """The timer kept from the connection's first request fires early for the second one (the
    second was sent later): it re-arms, and the second request times out a whole read timeout
    after it was sent, never at the first one's deadline."""
    answered = 0

    async def script(peer: Peer) -> None:
        nonlocal answered
        await peer.read_request()
        await peer.send(ok(b"first"))
        answered += 1
        await peer.read_request()
        await peer.until_client_gone()  # the second request is never answered

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.4)
    assert await fetch(client) == b"first"
    await asyncio.sleep(0.25)  # the first request's deadline falls during the second's wait
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    with pytest.raises(TimeoutError, match=re.escape("no upstream bytes for 0.4 s")):
        async with asyncio.timeout(WAIT_S):
            await client.request("POST", "/", [], b"")
    # Not at the first request's deadline (~0.15 s in). 0.4 s is no float's difference of two
    # readings near the virtual loop's start (1000.65 - 1000.25 is 0.39999999999997726, on every
    # machine: the start no longer depends on uptime), so the bound allows a microsecond.
    assert loop.time() - sent_at >= 0.4 - 1e-6
    assert server.accepted == 1
    assert answered == 1
    await gone(server.peers[0])


async def test_read_timeout_on_a_body_framed_by_the_connection_end_is_not_its_end(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """The consumer is busy elsewhere (not awaiting next_chunk) when the timer fires; the
    stalled body must still end in TimeoutError, not in b"" as if the upstream had finished."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.1)
    response = await client.request("POST", "/", [], b"")
    await gone(server.peers[0])  # the timer fired and the client aborted the connection
    assert await response.next_chunk() == b"partial"
    try:
        await response.next_chunk()
    except TimeoutError:
        pass
    else:
        raise AssertionError("a timed-out body framed by the connection's end read as complete")
    finally:
        response.release()


# -- back-pressure ---------------------------------------------------------------------------------


async def test_a_slow_reader_pauses_the_upstream_and_gets_every_byte(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """Unread bytes stop at HIGH_WATER_BYTES plus one socket read: the server's writes stall
    (kernel buffers fill) instead of the client buffering the stream."""
    total = 32 << 20
    block = bytes(range(256)) * 256  # 64 KiB
    drained = 0

    async def script(peer: Peer) -> None:
        nonlocal drained
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        for _ in range(total // len(block)):
            await peer.send(chunk(block))
            drained += len(block)
        await peer.send(LAST_CHUNK)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=2.0)
    response = await client.request("POST", "/", [], b"")
    await asyncio.sleep(0.3)  # the reader is slow to start
    assert drained < total, "the server could write the whole body to a reader that read none"
    received = bytearray()
    largest = 0
    async with asyncio.timeout(WAIT_S):  # a reader left paused would wait forever
        while part := await response.next_chunk():
            largest = max(largest, len(part))
            received += part
            if len(received) < (1 << 20):
                await asyncio.sleep(0.01)  # slow for the first MiB, then as fast as it can
    response.release()
    assert len(received) == total
    assert received == block * (total // len(block))
    assert largest <= HIGH_WATER_BYTES + SOCKET_READ_BYTES
    assert server.accepted == 1
    assert client.idle_connections == 1


async def test_read_timeout_does_not_fire_while_the_reader_is_the_slow_side(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    body = bytes(range(256)) * (16 << 10)  # 4 MiB: well past HIGH_WATER_BYTES plus one read

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        for start in range(0, len(body), 1 << 16):
            await peer.send(chunk(body[start : start + (1 << 16)]))
        await peer.send(LAST_CHUNK)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url(), read_timeout_s=0.15)
    response = await client.request("POST", "/", [], b"")
    await asyncio.sleep(0.6)  # four read timeouts without taking a byte: paused, not stalled
    async with asyncio.timeout(WAIT_S):  # a reader left paused would wait forever
        assert await drain_stream(response) == body
    response.release()
    assert server.accepted == 1


async def test_read_refuses_a_body_over_the_buffer_limit(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """``read()`` buffers the whole body, so it stops at MAX_BUFFERED_BODY_BYTES (the server
    announces a larger Content-Length and streams zeros)."""
    block = bytes(1 << 20)

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(
            f"HTTP/1.1 200 OK\r\nContent-Length: {MAX_BUFFERED_BODY_BYTES * 2}\r\n\r\n".encode()
        )
        for _ in range(MAX_BUFFERED_BODY_BYTES * 2 // len(block)):
            await peer.send(block)

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    with pytest.raises(UpstreamClosedError, match=f"over {MAX_BUFFERED_BODY_BYTES} bytes"):
        async with asyncio.timeout(WAIT_S):  # a reader left paused would wait forever
            await response.read()
    response.close()
    await gone(server.peers[0])


def head_with(header_bytes: int, *, lines: int) -> bytes:
    """A 200 head whose ``lines`` extra header lines hold ``header_bytes`` in all (names,
    values, ``": "`` and CRLF), then an empty body."""
    per_line = header_bytes // lines
    value = "v" * (per_line - len("x-pad-0000: \r\n"))
    extra = "".join(f"x-pad-{i:04d}: {value}\r\n" for i in range(lines))
    return f"HTTP/1.1 200 OK\r\n{extra}Content-Length: 2\r\n\r\nok".encode()


@pytest.mark.parametrize(
    ("lines", "pieces"),
    [(1, 1), (1, 64), (2000, 1), (2000, 64)],
    ids=["one-header-one-write", "one-header-many-writes", "many-headers-one-write",
         "many-headers-many-writes"],
)  # fmt: skip
async def test_a_response_head_over_the_limit_is_refused_and_dropped(
    serve: ServerFactory, clients: ClientFactory, lines: int, pieces: int
) -> None:
    """A head over MAX_RESPONSE_HEAD_BYTES is refused however it arrives (in one read: the
    header lines are counted; over many: the bytes fed while no head is complete), and its
    connection is dropped (the server sees the client leave before it finished sending)."""
    oversized = head_with(4 * MAX_RESPONSE_HEAD_BYTES, lines=lines)

    async def script(peer: Peer) -> None:
        await peer.read_request()
        step = -(-len(oversized) // pieces)
        for start in range(0, len(oversized), step):
            await peer.send(oversized[start : start + step])
            await asyncio.sleep(0)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    with pytest.raises(UpstreamTooLargeError, match=f"head over {MAX_RESPONSE_HEAD_BYTES} bytes"):
        await client.request("POST", "/", [], b"")
    await gone(server.peers[0])
    assert not client.connections


async def test_a_response_head_within_the_limit_is_read(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """Just under the limit, in many writes: the head and its body arrive intact."""
    within = head_with(MAX_RESPONSE_HEAD_BYTES - 200, lines=100)

    async def script(peer: Peer) -> None:
        await peer.read_request()
        for start in range(0, len(within), 1000):
            await peer.send(within[start : start + 1000])
            await asyncio.sleep(0)

    server = await serve(script)
    response = await clients(server.url()).request("POST", "/", [], b"")
    assert len(response.headers) == 101
    assert await response.read() == b"ok"
    response.release()


async def test_a_body_over_the_clients_cap_fails_with_the_cap(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """``max_body_bytes`` is the client's: a 1 MiB body read whole by a client capped at
    64 KiB is refused and its connection dropped (the rest is never buffered)."""
    body = bytes(1 << 20)

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok(body))

    server = await serve(script)
    client = UpstreamClient(
        server.url(), connect_timeout_s=2.0, read_timeout_s=2.0, max_body_bytes=1 << 16
    )
    try:
        response = await client.request("POST", "/", [], b"")
        with pytest.raises(UpstreamTooLargeError, match=f"body over {1 << 16} bytes"):
            await response.read()
        response.close()
        await wait_for(lambda: not client.connections)  # dropped (connection_lost is a turn on)
    finally:
        await client.close()


# -- the pool and close() --------------------------------------------------------------------------


async def test_close_closes_idle_connections_and_refuses_new_requests(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    server = await serve(answer_each(ok()))
    client = clients(server.url())
    # two idle connections: the first is still held while the second is requested
    first = await client.request("POST", "/", [], b"")
    second = await client.request("POST", "/", [], b"")
    await first.read()
    await second.read()
    first.release()
    second.release()
    assert client.idle_connections == 2
    await client.close()
    assert client.idle_connections == 0
    assert not client.connections
    for peer in server.peers:
        await gone(peer)
    with pytest.raises(UpstreamClosedError, match="client is closed"):
        await client.request("POST", "/", [], b"")
    assert server.accepted == 2


async def test_close_fails_a_response_being_read(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.next_chunk() == b"data: one\n\n"
    await client.close()
    with pytest.raises(UpstreamClosedError):
        await response.next_chunk()
    response.release()
    await gone(server.peers[0])


async def test_close_fails_a_body_framed_by_the_connection_end(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npartial")
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.next_chunk() == b"partial"
    await client.close()
    try:
        await response.next_chunk()
    except UpstreamClosedError:
        pass
    else:
        raise AssertionError("a body cut by client.close() read as complete")
    finally:
        response.release()


@pytest.mark.parametrize(
    "unsolicited",
    [
        b"X",
        b"HTTP/1.1 200 OK\r\n",  # a head begun: the next response would be parsed after it
        ok(b"smuggled"),  # a whole response that would answer the next request
    ],
)
async def test_unsolicited_bytes_on_an_idle_connection_drop_it(
    serve: ServerFactory, clients: ClientFactory, unsolicited: bytes
) -> None:
    async def script(peer: Peer) -> None:
        while True:
            await peer.read_request()
            await peer.send(ok())
            if peer.index == 0:
                await asyncio.sleep(0.05)  # the client has pooled the connection by now
                await peer.send(unsolicited)

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    assert client.idle_connections == 1
    await gone(server.peers[0])
    assert client.idle_connections == 0
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    assert server.accepted == 2
    assert len(server.peers[0].requests) == 1


async def test_an_idle_connection_the_server_closed_is_not_reused(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok())  # keep-alive as far as the client knows, then closed

    server = await serve(script)
    client = clients(server.url())
    (await client.request("POST", "/", [], b"")).release()
    await wait_for(lambda: client.idle_connections == 0)
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    assert server.accepted == 2


def test_idle_keepalive_is_under_uvicorns_five_seconds() -> None:
    """vLLM's server (uvicorn) closes idle connections after 5 s; reusing one older than that
    races the close."""
    assert 0 < IDLE_KEEPALIVE_S < 5


# -- https -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA and a serving certificate for ``localhost``."""
    return localhost_tls(tmp_path_factory.mktemp("tls"))


def server_tls(certificate: TLSFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate.cert_file, certificate.key_file)
    return context


async def test_https_upstream_trusted_through_ssl_cert_file(
    serve: ServerFactory,
    clients: ClientFactory,
    certificate: TLSFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = "localhost"
    server = await serve(answer_each(ok(b"secret")), ssl_context=server_tls(certificate))
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate.ca_file))
    client = clients(server.url("https", host))  # the trust store is read here
    monkeypatch.undo()
    for _ in range(2):
        response = await client.request("POST", "/", [], b"")
        assert response.status == 200
        assert await response.read() == b"secret"
        response.release()
    assert server.accepted == 1
    assert f"\r\nHost: {host}:{server.port}\r\n".encode() in server.peers[0].requests[0]


async def test_https_upstream_with_an_untrusted_certificate_is_refused(
    serve: ServerFactory, clients: ClientFactory, certificate: TLSFiles
) -> None:
    server = await serve(answer_each(ok()), ssl_context=server_tls(certificate))
    client = clients(server.url("https", "localhost"))  # the system trust store: unknown CA
    with pytest.raises(UpstreamClosedError, match=r"cannot connect to localhost.*CERTIFICATE"):
        await client.request("POST", "/", [], b"")
    assert not server.peers or not server.peers[0].requests


# -- usage_from_sse --------------------------------------------------------------------------------

USAGE = b'"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}'
USAGE_DICT = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def sse(*payloads: bytes, newline: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + payload + newline + newline for payload in payloads)


def test_usage_from_sse_finds_the_usage_chunk_before_done() -> None:
    tail = sse(
        b'{"id":"a","choices":[{"delta":{"content":"hi"}}],"usage":null}',
        b'{"id":"a","choices":[],' + USAGE + b"}",
        b"[DONE]",
    )
    assert usage_from_sse(tail) == USAGE_DICT


def test_usage_from_sse_skips_later_null_usage_lines() -> None:
    tail = sse(
        b'{"id":"a","choices":[],' + USAGE + b"}",
        b'{"id":"a","choices":[{"delta":{}}],"usage":null}',
        b'{"id":"a","choices":[{"delta":{}}],"usage": null}',
        b"[DONE]",
    )
    assert usage_from_sse(tail) == USAGE_DICT


def test_usage_from_sse_takes_the_last_usage() -> None:
    earlier = b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}'
    tail = sse(b"{" + earlier + b"}", b"{" + USAGE + b"}", b"[DONE]")
    assert usage_from_sse(tail) == USAGE_DICT


def test_usage_from_sse_never_matches_an_escaped_usage_inside_a_string() -> None:
    fake = rb'{"choices":[{"delta":{"content":"say \"usage\":{\"prompt_tokens\":999}"}}]}'
    assert usage_from_sse(sse(b'{"choices":[],' + USAGE + b"}", fake, b"[DONE]")) == USAGE_DICT
    assert usage_from_sse(sse(fake, b"[DONE]")) is None
    # a string that is just the word: "usage" is followed by a comma, not a colon
    word = b'{"choices":[{"delta":{"content":"usage"}}],"usage":null}'
    assert usage_from_sse(sse(b"{" + USAGE + b"}", word)) == USAGE_DICT


@pytest.mark.parametrize(
    "tail",
    [
        sse(b"{" + USAGE + b"}", newline=b"\r\n"),  # CRLF line ends
        b"data: {" + USAGE + b"}",  # the last line has no newline
        b"data:{" + USAGE + b"}\n\n",  # no space after the colon
        b"  data: {" + USAGE + b"}\n\n",  # indented
        b"event: x\ndata: {" + USAGE + b" }\n\n: comment\n\n",
    ],
)
def test_usage_from_sse_line_shapes(tail: bytes) -> None:
    assert usage_from_sse(tail) == USAGE_DICT


@pytest.mark.parametrize(
    "tail",
    [
        b"",
        sse(b"[DONE]"),
        sse(b'{"choices":[],"usage":null}', b"[DONE]"),
        sse(b'{"choices":[],"usage":5}'),
        sse(b'{"choices":[],"usage":[1,2]}'),
        sse(b'{"choices":[],"usage":{"prompt_tokens":'),  # cut off: not JSON
        # the tail starts mid-line: what precedes "usage" on that line is unknown, so not trusted
        USAGE + b"}\n\ndata: [DONE]\n\n",
        b'event: {"usage":{"prompt_tokens":1}}\n\n',  # not a data: line
        b'id: 1 data: {"usage":{"prompt_tokens":1}}\n\n',
    ],
)
def test_usage_from_sse_without_a_usable_usage(tail: bytes) -> None:
    assert usage_from_sse(tail) is None


def test_usage_from_sse_skips_a_cut_usage_for_an_earlier_whole_one() -> None:
    tail = sse(b'{"choices":[],' + USAGE + b"}") + b'data: {"choices":[],"usage":{"prompt_to'
    assert usage_from_sse(tail) == USAGE_DICT


# -- trailers --------------------------------------------------------------------------------------


async def test_trailers_never_become_response_headers(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """Trailers that arrive with the head (one segment) are dropped, not read as headers."""
    answer = CHUNKED_HEAD + chunk(b"data") + b"0\r\nX-Trailer: sneaked\r\nSet-Cookie: a=b\r\n\r\n"
    server = await serve(answer_each(answer))
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    body = await response.read()
    names = {name.lower() for name, _ in response.headers}
    response.release()
    assert body == b"data"
    assert "x-trailer" not in names
    assert "set-cookie" not in names
    assert client.idle_connections == 1  # a response with trailers is still whole


@pytest.mark.parametrize("shape", ["many-lines", "one-long-line"])
async def test_trailers_over_the_head_limit_are_refused_and_dropped(
    serve: ServerFactory, clients: ClientFactory, shape: str
) -> None:
    """Trailers are bounded like a head: past 64 KiB of them (many small lines, or one line
    that never ends) the response fails ``UpstreamTooLargeError`` and the connection is dropped
    while the trailers still come; nothing of them is kept."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data") + b"0\r\n")
        for index in range(1 << 12):  # 4 MiB of trailers at most: far past the bound
            if shape == "many-lines":
                piece = b"X-T%d: %s\r\n" % (index, b"v" * 1000)
            else:
                piece = b"X-Long: " + b"v" * 1024 if index == 0 else b"v" * 1024
            await peer.send(piece)
        await peer.until_client_gone()

    server = await serve(script)
    client = clients(server.url())
    response = await client.request("POST", "/", [], b"")
    with pytest.raises(UpstreamTooLargeError, match="trailers"):
        await response.read()
    response.release()
    await gone(server.peers[0])
    assert client.idle_connections == 0


# -- stale keep-alive connections ------------------------------------------------------------------


class ClosingUpstream:
    """A threaded server (outside the event loop) that answers each connection's first request
    keep-alive, then closes the connection at once, and says so: ``closed`` is set after the
    close, so the FIN is on its way before the event loop can run again."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with sock:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = sock.recv(65536)
                    if not more:
                        break
                    data += more
                if data:
                    self.requests += 1
                    sock.sendall(ok())
            self.closed.set()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
        self._listener.close()
        self._thread.join(WAIT_S)


@pytest.fixture
def closing_upstream() -> Iterator[ClosingUpstream]:
    server = ClosingUpstream()
    yield server
    server.stop()


@pytest.mark.wall_time  # the upstream is a thread
async def test_a_connection_the_upstream_closed_unseen_by_the_loop_is_not_used(
    closing_upstream: ClosingUpstream, clients: ClientFactory
) -> None:
    """The upstream closes a keep-alive connection right after answering, and the event loop is
    busy (the blocking wait below stands for it) while the close arrives: the pooled connection
    looks open to the loop, but its socket already holds the end. The next request must go on a
    new connection, not fail (a POST that fails there may not be sent again)."""
    client = clients(f"http://127.0.0.1:{closing_upstream.port}")
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    # Without yielding to the loop: the server has closed the connection once this returns.
    assert closing_upstream.closed.wait(WAIT_S)
    closing_upstream.closed.clear()
    response = await client.request("POST", "/", [], b"")
    assert await response.read() == b"ok"
    response.release()
    assert closing_upstream.requests == 2  # each request reached the upstream once


@pytest.mark.parametrize(
    ("value", "limit_s"),
    [
        ("timeout=5, max=100", 4.0),
        ("timeout=2", 1.0),
        ("max=3, timeout=1", 0.0),
        ("timeout=0.5", 0.0),
        ("timeout=600", IDLE_KEEPALIVE_S),
        ("max=100", IDLE_KEEPALIVE_S),
        ("garbage", IDLE_KEEPALIVE_S),
    ],
)
def test_keepalive_timeout_of_the_upstream_shortens_reuse(value: str, limit_s: float) -> None:
    assert keepalive_limit_s(value) == limit_s


async def test_an_upstream_keepalive_timeout_of_one_second_is_never_raced(
    serve: ServerFactory, clients: ClientFactory
) -> None:
    """``Keep-Alive: timeout=1``: the upstream may close an idle connection after 1 s, so it is
    not reused (1 s less the 1 s margin): every request gets a connection of its own."""
    server = await serve(answer_each(ok(b"ok", "Keep-Alive: timeout=1")))
    client = clients(server.url())
    for _ in range(2):
        assert await fetch(client) == b"ok"
    assert server.accepted == 2
