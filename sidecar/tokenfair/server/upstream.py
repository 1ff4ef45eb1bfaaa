"""An HTTP/1.1 client for one upstream origin: keep-alive connections on asyncio protocols,
responses parsed by httptools (llhttp, the parser of Node.js, in C).

Why not ``aiohttp.ClientSession``: the relay needs one POST per request to one origin, and the
session's generality (URL objects, cookie jar, redirects, tracing, per-read timer re-arming)
cost ~100 µs of CPU per request in ``bench/bench_sidecar.py``, more than all of the sidecar's
own work; this client costs ~15 µs (the numbers are in bench/HISTORY.md).

What it does, and nothing else:

* ``request(method, target, headers, body)`` writes the request in one ``write`` (``Host`` and
  ``Content-Length`` are added; header values must not contain CR or LF) and returns the
  response once its head arrived: ``status``, ``headers`` (name and value decoded, in order),
  then ``read()`` (the whole body, at most ``max_body_bytes``, default
  :data:`MAX_BUFFERED_BODY_BYTES`) or ``next_chunk()`` (the bytes received since the last call;
  ``b""`` at the end).
* Bounds: a response head over :data:`MAX_RESPONSE_HEAD_BYTES` (64 KiB), trailers (the header
  lines after a chunked body's last chunk) over as much again, or a body read whole over
  ``max_body_bytes`` (8 MiB), raises :class:`UpstreamTooLargeError` and drops the connection at
  once (nothing more of it is kept in memory). Trailers are counted and dropped: they never
  join the response's ``headers`` (a client would get them as response headers).
* Bodies framed by ``Content-Length``, chunked encoding, or the end of the connection;
  ``1xx`` interim responses are skipped.
* Keep-alive: a connection goes back to the pool only when its response was read to the end and
  the upstream did not ask to close it; the pool reuses the most recently used one first and
  drops connections idle for over :data:`IDLE_KEEPALIVE_S` (or the upstream's own
  ``Keep-Alive: timeout`` less :data:`KEEPALIVE_MARGIN_S`), and keeps at most
  :data:`MAX_IDLE_CONNECTIONS` idle. Before reuse, an idle connection's socket is polled: an
  upstream that closed (or reset) it while it idled is seen there even when the event loop has
  not read it yet, and the connection is dropped instead of carrying a request that would fail.
  There is no limit on open connections here: the sidecar's ``maxInFlight`` bounds the requests
  that can hold one.
* Timeouts: connecting longer than ``connect_timeout_s`` raises :class:`TimeoutError`; so does
  ``read_timeout_s`` without a byte from the upstream while a response is awaited (one timer per
  connection, kept from one request to the next and re-armed only when it fires early — not per
  read, nor per request). The clock stops while the reader is the slow side (reading paused,
  see below).
* Back-pressure: a response's unread bytes past :data:`HIGH_WATER_BYTES` pause reading from the
  socket until ``next_chunk()`` takes them, so a slow client never makes the sidecar buffer a
  whole stream.
* Failures (refused, reset, closed early, malformed response) raise :class:`UpstreamClosedError`.
  ``close()`` on a response that is not finished closes its connection (the upstream sees the
  client leave and can stop generating). A request is sent again, once, on a new connection
  only when its write on a pooled one failed at once (the socket refused it: not a byte left
  this host); never once a byte went out, since a POST may have run.
* ``https://`` upstreams use the system's trust store (``SSL_CERT_FILE`` honoured).
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

IDLE_KEEPALIVE_S: Final = 4.0
"""Idle connections older than this are closed instead of reused: under the 5 s idle limit of
uvicorn (vLLM's server), so the sidecar does not race the upstream closing the same connection."""
MAX_IDLE_CONNECTIONS: Final = 256
HIGH_WATER_BYTES: Final = 1 << 16
"""Unread response bytes that pause reading from the upstream (64 KiB)."""
MAX_BUFFERED_BODY_BYTES: Final = 1 << 23
"""``read()`` refuses a body over 8 MiB (:class:`UpstreamTooLargeError`: the connection is
dropped as soon as the body passes it). A non-streamed completion is tens of KB; 128 choices of
8,192 tokens are ~4 MiB of text. Each request in flight may hold this much: ``maxInFlight``
(64 for ``openai``) times it bounds the memory of buffered answers."""
MAX_RESPONSE_HEAD_BYTES: Final = 1 << 16
"""A response head (status line and headers, of interim ``1xx`` heads too) over 64 KiB is
refused (:class:`UpstreamTooLargeError`) and its connection dropped: real servers send a few
hundred bytes (nginx refuses request heads over 32 KiB by default, Node.js over 16 KiB)."""


_PATH_RE: Final = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%/]*")
"""The characters of a URL path (RFC 3986 ``pchar`` and ``/``)."""


KEEPALIVE_MARGIN_S: Final = 1.0
"""An upstream that announces ``Keep-Alive: timeout=N`` has its idle connections reused for at
most ``N`` minus this (and never longer than :data:`IDLE_KEEPALIVE_S`)."""
_KEEPALIVE_TIMEOUT: Final = re.compile(r"(?:^|[\s,;])timeout\s*=\s*([0-9]+(?:\.[0-9]+)?)", re.I)


def keepalive_limit_s(value: str) -> float:
    """How long a connection may idle before reuse, given a response's ``Keep-Alive`` header
    (``timeout=5, max=100``): ``timeout`` minus :data:`KEEPALIVE_MARGIN_S`, at most
    :data:`IDLE_KEEPALIVE_S`, at least 0 (not reused); :data:`IDLE_KEEPALIVE_S` without one."""
    match = _KEEPALIVE_TIMEOUT.search(value)
    if match is None:
        return IDLE_KEEPALIVE_S
    return max(0.0, min(IDLE_KEEPALIVE_S, float(match.group(1)) - KEEPALIVE_MARGIN_S))


class UpstreamClosedError(ConnectionError):
    """The upstream refused, reset or closed the connection, or sent a malformed response."""


class UpstreamTooLargeError(UpstreamClosedError):
    """The response's head passed :data:`MAX_RESPONSE_HEAD_BYTES`, or a body being read whole
    passed the client's ``max_body_bytes``; the connection was dropped."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an upstream URL points: ``scheme://host[:port][/base]``."""

    scheme: str
    host: str
    port: int
    base_path: str
    """Prepended to every request target ('' or e.g. ``/proxy``, no trailing slash)."""

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def parse_origin(url: str) -> Origin:
    """``http(s)://host[:port][/base path]``; anything else is a ``ValueError`` saying why."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("must start with http:// or https://")
    if not parts.hostname:
        raise ValueError("has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials (user:password@)")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment (request paths are appended)")
    if port == 0:
        raise ValueError("must not have port 0")
    if _PATH_RE.fullmatch(parts.path) is None:
        raise ValueError("has a path with characters a URL path cannot hold (spaces, ...)")
    default = 443 if parts.scheme == "https" else 80
    return Origin(parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))


class UpstreamResponse:
    """One response; call :meth:`release` (finished: back to the pool) or :meth:`close`."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(self, connection: _Connection, status: int, headers: list[tuple[str, str]]):
        self._connection: _Connection | None = connection
        self.status = status
        self.headers = headers
        """Header names and values in the order received (values decoded as UTF-8, undecodable
        bytes replaced)."""

    async def read(self) -> bytes:
        """The whole body (waits for its end)."""
        connection = self._live()
        connection.unbounded = True
        connection.resume()
        while not connection.complete:
            connection.raise_error()  # on_body fails the exchange past max_body_bytes
            await connection.wait()
        connection.raise_error()
        return connection.take()

    def received(self) -> bytes:
        """The body bytes received and not yet taken, without waiting (what there is of a body
        whose :meth:`read` failed; empty after a body over ``max_body_bytes``)."""
        connection = self._connection
        return b"".join(connection.chunks) if connection is not None else b""

    async def next_chunk(self) -> bytes:
        """The body bytes received since the last call (waits for some); ``b""`` at the end."""
        connection = self._live()
        while True:
            if connection.buffered:
                return connection.take()
            if connection.complete:
                return b""
            connection.raise_error()
            await connection.wait()

    @property
    def complete(self) -> bool:
        """The whole body has arrived and been taken: :meth:`next_chunk` returns ``b""`` now
        (the chunk just taken was the last)."""
        connection = self._connection
        return connection is not None and connection.complete and not connection.buffered

    def release(self) -> None:
        """Done with it: a finished keep-alive connection goes back to the pool, else closed."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.release()

    def close(self) -> None:
        """Abandon the response: its connection is closed."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.keep_alive = False
            connection.release()

    def _live(self) -> _Connection:
        if self._connection is None:
            raise RuntimeError("the response was released")
        return self._connection


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the exchange in progress on it (at most one)."""

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client
        self.loop = client.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.idle_limit_s = IDLE_KEEPALIVE_S
        """How long it may stay idle in the pool and still be reused (the upstream's own
        ``Keep-Alive: timeout`` can shorten it)."""
        self.timer: asyncio.TimerHandle | None = None
        """The read timeout's timer: armed by the first exchange, kept while the connection is
        pooled (it fires at most once more, finds nothing to time and stays off until the next
        exchange), re-armed when it fires early; cancelled when the connection closes."""
        self._poller: select.poll | None = None
        """Polls the idle socket before reuse (:meth:`reusable_now`); made once, with the
        transport."""
        self._reset()

    def _reset(self) -> None:
        self.active = False
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.head_done = False
        self.head_fed = 0  # bytes of reads that did not complete a head (all head bytes)
        self.header_bytes = 0  # header lines seen, of every head of the exchange
        self.after_chunk_header = False  # no body since the last chunk's size line
        self.body_seen = False  # on_body ran during the current feed
        self.trailer_fed = 0  # bytes of feeds that ended among a last chunk's trailers
        self.trailer_bytes = 0  # trailer lines seen
        self.complete = False
        self.keep_alive = False
        self.until_eof = False
        self.interim = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.unbounded = False
        self.paused = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_read = 0.0

    # -- the exchange ---------------------------------------------------------------------------

    def send(self, data: bytes) -> bool:
        """Start the exchange by writing the request. False if the write failed at once (the
        socket's send raised: nothing of the request left this host, so it never reached the
        upstream); the connection is then broken."""
        transport = self.transport
        assert transport is not None
        self.active = True
        self.last_read = self.loop.time()
        if self.timer is None:  # a pooled connection's timer still runs: it re-arms when it fires
            self.timer = self.loop.call_at(
                self.last_read + self.client.read_timeout_s, self._on_timer
            )
        transport.write(data)
        # asyncio's write sends at once when nothing is buffered, and closes the transport on
        # the spot if that send fails: closing now means no byte was sent.
        return not transport.is_closing()

    def reusable_now(self) -> bool:
        """Whether this idle connection can carry a request: open, and nothing readable on its
        socket. The event loop may not have read yet what the upstream sent while it idled (a
        busy loop), and an idle connection must be silent: an end of stream (the upstream
        closed it), a reset or any bytes all mean it cannot be used."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        poller = self._poller
        if poller is None:
            return True
        return not poller.poll(0)  # POLLHUP and POLLERR are reported whatever was asked

    async def wait(self) -> None:
        waiter = self.loop.create_future()
        self.waiter = waiter
        try:
            await waiter
        finally:
            self.waiter = None

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused:
            self.resume()
        return data

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.last_read = self.loop.time()  # the wait for the upstream starts again now
            self.transport.resume_reading()

    def release(self) -> None:
        """The exchange is over: pool the connection if it can carry another one, else close it
        (a connection's end, not a request's). A pooled connection keeps its timer."""
        reusable = (
            self.complete and self.keep_alive and self.error is None and not self.closed
            and not self.paused
        )  # fmt: skip
        self._reset()
        if reusable:
            self.client.pool(self)
        elif not self.closed:
            self.abort()

    def abort(self) -> None:
        """Close the connection now, from our side (``abort``, not ``close``: an unread response
        is not drained). ``closed`` is set first: see :meth:`connection_lost`."""
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def _cancel_timer(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def _fail(self, error: Exception) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timer(self) -> None:
        self.timer = None
        if not self.active or self.complete or self.error is not None:
            return  # idle (pooled), or its exchange is over: the next exchange arms it again
        now = self.loop.time()
        if self.paused:  # the reader is the slow side, not the upstream
            deadline = now + self.client.read_timeout_s
        else:
            deadline = self.last_read + self.client.read_timeout_s
        if now < deadline:
            self.timer = self.loop.call_at(deadline, self._on_timer)
            return
        self._fail(TimeoutError(f"no upstream bytes for {self.client.read_timeout_s:g} s"))
        self.abort()

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: the protocol is the same.
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.client.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:  # nothing was asked: the connection must be silent
            self.abort()
            return
        self.last_read = self.loop.time()
        head_pending = not self.head_done
        self.body_seen = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken("the upstream switched protocols")
        except httptools.HttpParserError as exc:
            self._broken(f"malformed upstream response ({exc})")
        if self.error is not None or self.complete:
            return
        if head_pending and not self.head_done:
            # The parser holds a header's bytes until the header ends: count what it was fed.
            self.head_fed += len(data)
            if self.head_fed > MAX_RESPONSE_HEAD_BYTES:
                self._too_large(f"response head over {MAX_RESPONSE_HEAD_BYTES} bytes")
        elif self.after_chunk_header and not self.body_seen:
            # Fed nothing but framing since a chunk's size line: the last chunk's trailers
            # (a chunk with data would have given body bytes), which the parser also holds
            # until each line ends. Bounded like a head; counted from the last body bytes.
            self.trailer_fed += len(data)
            if self.trailer_fed > MAX_RESPONSE_HEAD_BYTES:
                self._too_large(f"response trailers over {MAX_RESPONSE_HEAD_BYTES} bytes")

    def _too_large(self, message: str) -> None:
        self._fail(UpstreamTooLargeError(f"the upstream's {message}"))
        self.abort()

    def _broken(self, message: str) -> None:
        self._fail(UpstreamClosedError(message))
        self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        # `closed` is already set when the close was ours (timeout, malformed response,
        # `close()`): then the end of the connection is not the end of a body framed by it.
        aborted_here = self.closed
        self.closed = True
        self._cancel_timer()
        self._poller = None
        self.client.connections.discard(self)
        if self.active and not self.complete:
            if self.head_done and self.until_eof and exc is None and not aborted_here:
                self.complete = True  # a body framed by the end of the connection
                self._wake()
            else:
                where = "mid-response" if self.head_done else "before answering"
                reason = f": {exc}" if exc is not None else ""
                self._fail(UpstreamClosedError(f"the upstream closed the connection {where}"
                                               f"{reason}"))  # fmt: skip

    def pause_writing(self) -> None:  # requests are small and written at once: nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # more bytes after the response: stop parsing, never reuse this one
            raise UpstreamClosedError("the upstream sent more than one response")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:  # a trailer (after a chunked body): bounded, never a header
            self.trailer_bytes += len(name) + len(value) + 4
            if self.trailer_bytes > MAX_RESPONSE_HEAD_BYTES and self.error is None:
                self._too_large(f"response trailers over {MAX_RESPONSE_HEAD_BYTES} bytes")
            return
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        self.headers.append((name.decode("latin-1"), value.decode("utf-8", "replace")))

    def on_chunk_header(self) -> None:
        self.after_chunk_header = True

    def on_chunk_complete(self) -> None:
        self.after_chunk_header = False
        self.trailer_fed = 0

    def on_headers_complete(self) -> None:
        if self.header_bytes > MAX_RESPONSE_HEAD_BYTES:  # a head that came whole in one read
            self._too_large(f"response head over {MAX_RESPONSE_HEAD_BYTES} bytes")
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): wait for the real one
            self.interim = True
            self.headers = []
            return
        self.status = status
        framed = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == "content-length" or (
                lower == "transfer-encoding" and "chunked" in value.lower()
            ):
                framed = True
            elif lower == "keep-alive":
                self.idle_limit_s = keepalive_limit_s(value)
        self.until_eof = not framed and status not in (204, 304)
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body_seen = True
        self.after_chunk_header = False
        self.trailer_fed = 0
        if self.error is not None:  # refused (e.g. its head too large): nothing more is kept
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.unbounded and self.buffered > self.client.max_body_bytes:
            self.chunks.clear()
            self.buffered = 0
            self._too_large(f"response body over {self.client.max_body_bytes} bytes")
            return
        if self.buffered > HIGH_WATER_BYTES and not self.unbounded and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()  # the timer, left running, finds the exchange over when it fires


class UpstreamClient:
    """The connection pool for one origin (see the module docstring). Create it inside the event
    loop that uses it; :meth:`close` when done."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_body_bytes: int = MAX_BUFFERED_BODY_BYTES,
    ) -> None:
        self.origin = parse_origin(url)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_body_bytes = max_body_bytes
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self._idle: deque[_Connection] = deque()
        self._ssl = ssl.create_default_context() if self.origin.scheme == "https" else None
        self._closed = False
        self._request_line_tail = f" HTTP/1.1\r\nHost: {self.origin.host_header}\r\n"

    async def request(
        self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send one request; returns once the response's head arrived. ``target`` is the path
        and query (``/v1/chat/completions``), appended to the URL's base path. Not ``HEAD``
        (the parser would wait for the body its Content-Length announces)."""
        if method == "HEAD":
            raise ValueError("HEAD requests are not supported")
        parts = [method, " ", self.origin.base_path, target, self._request_line_tail]
        for name, value in headers:
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name}: CR or LF in its value")
            parts += (name, ": ", value, "\r\n")
        parts += ("Content-Length: ", str(len(body)), "\r\n\r\n")
        data = "".join(parts).encode("utf-8", "surrogateescape") + body
        connection = self._reuse()
        if connection is not None and not connection.send(data):
            # The pooled connection's write failed at once (the upstream had reset it): nothing
            # was sent, so the request goes on a new connection. Never after a byte went out.
            connection.release()
            connection = None
        if connection is None:
            connection = await self._connect()
            if not connection.send(data):
                connection.release()
                raise UpstreamClosedError("the upstream closed a new connection before the request")
        try:
            while not connection.head_done:
                connection.raise_error()
                await connection.wait()
        except BaseException:
            connection.release()
            raise
        return UpstreamResponse(connection, connection.status, connection.headers)

    def _reuse(self) -> _Connection | None:
        idle = self._idle
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            if now - connection.idle_since >= connection.idle_limit_s:
                # Too old to trust; a limit of 0 s is never trusted, even on a coarse clock.
                connection.release()
                continue
            if connection.reusable_now():
                return connection
            connection.release()  # closed or reset by the upstream, not yet seen by the loop
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise UpstreamClosedError("the upstream client is closed")
        origin = self.origin
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await self.loop.create_connection(
                    lambda: _Connection(self),
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=origin.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise TimeoutError(
                f"connecting to {origin.host_header} took over {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            raise UpstreamClosedError(f"cannot connect to {origin.host_header}: {exc}") from None
        return connection

    def pool(self, connection: _Connection) -> None:
        if self._closed or len(self._idle) >= MAX_IDLE_CONNECTIONS:
            connection.closed = True
            connection._cancel_timer()
            if connection.transport is not None:
                connection.transport.close()
            return
        connection.idle_since = self.loop.time()
        self._idle.append(connection)

    @property
    def idle_connections(self) -> int:
        return sum(1 for connection in self._idle if not connection.closed)

    async def close(self) -> None:
        """Close every connection (responses still being read fail with UpstreamClosedError)."""
        self._closed = True
        self._idle.clear()
        for connection in list(self.connections):
            connection.abort()
        # Let the transports' connection_lost callbacks run before the loop may close (TLS
        # takes a turn more than TCP; bounded, in case a transport never reports).
        for _ in range(10):
            if not self.connections:
                break
            await asyncio.sleep(0)


__all__ = [
    "HIGH_WATER_BYTES",
    "IDLE_KEEPALIVE_S",
    "Origin",
    "UpstreamClient",
    "UpstreamClosedError",
    "UpstreamResponse",
    "UpstreamTooLargeError",
    "parse_origin",
]
