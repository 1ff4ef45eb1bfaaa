"""The proxy listener's connection cap (``tokenfair.server.connections``) on real sockets over
loopback, in front of a tiny protocol standing in for aiohttp's handler: it marks its connection
authenticated when a client sends ``auth``, and answers ``big`` with 8 MiB, ``small`` with 32 KiB.

Behaviours: a peer's unauthenticated connections over its share are refused (``503``, closed)
and evict nobody; when the unauthenticated share is full, a new connection evicts the oldest
anonymous one (told ``503`` if it sent nothing, reset otherwise), never an authenticated one;
the cap itself refuses whatever the kind; peers are IPv4 addresses and IPv6 /64s; the write
sweep resets a connection that takes nothing of what it is sent within 1.5 write timeouts —
a paused write, or a small answer the kernel holds for an idle connection — and never one
that keeps reading, however slowly. Timeouts here (0.2 s) are what the tests wait
for, not speeds they need: every wait is a poll with a generous deadline.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from raw_upstream_support import connection_cut
from sidecar_support import wait_for

from tokenfair.server.connections import (
    CAP_ANSWER,
    ConnectionCap,
    ConnectionLimits,
    mark_authenticated,
    peer_key,
)

pytestmark = pytest.mark.virtual_time

WRITE_TIMEOUT_S = 0.2


class Handler(asyncio.Protocol):
    """Stands in for aiohttp's request handler."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if data.startswith(b"auth"):
            mark_authenticated(self.transport)
        elif data.startswith(b"big"):
            self.transport.write(bytes(8 << 20))
        elif data.startswith(b"small"):
            self.transport.write(bytes(32 << 10))  # under the transport's high-water mark


@dataclass
class Listener:
    cap: ConnectionCap
    port: int
    clients: list[socket.socket] = field(default_factory=list)

    async def connect(self, peer: str = "127.0.0.1", *, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((peer, 0))
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        self.clients.append(sock)
        # The cap decides in connection_made: wait until the listener has seen this one.
        seen = self.cap.open + self.cap.refused + self.cap.evicted
        await wait_for(lambda: self.cap.open + self.cap.refused + self.cap.evicted > seen)
        return sock


Start = Callable[..., "asyncio.Future[Listener]"]


@pytest.fixture
async def listen() -> AsyncIterator[Callable[..., asyncio.Future[Listener]]]:
    made: list[tuple[asyncio.Server, Listener]] = []

    async def start(
        max_connections: int = 100, max_unauthenticated: int = 100, per_peer: int = 100
    ) -> Listener:
        limits = ConnectionLimits(max_connections, max_unauthenticated, per_peer, WRITE_TIMEOUT_S)
        cap = ConnectionCap(Handler, limits, lambda: None)
        cap.start()
        server = await asyncio.get_running_loop().create_server(cap, "127.0.0.1", 0)
        listener = Listener(cap, int(server.sockets[0].getsockname()[1]))
        made.append((server, listener))
        return listener

    yield start  # type: ignore[misc]
    for server, listener in made:
        listener.cap.close()
        for sock in listener.clients:
            sock.close()
        server.close()
        await server.wait_closed()


async def answered_503_and_closed(sock: socket.socket) -> bool:
    data = b""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while chunk := await loop.sock_recv(sock, 4096):
            data += chunk
    return data == CAP_ANSWER


async def still_open(listener: Listener, sock: socket.socket) -> bool:
    """The connection is open: a round trip through the listener's handler proves it (an
    ``auth`` it takes without a word back), and its TCP state is not closed."""
    await asyncio.get_running_loop().sock_sendall(sock, b"auth")
    return not connection_cut(sock)


async def test_a_peer_over_its_unauthenticated_share_is_refused_and_evicts_nobody(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    listener = await listen(per_peer=3)
    own = [await listener.connect("127.0.0.2") for _ in range(3)]
    surplus = await listener.connect("127.0.0.2")
    assert await answered_503_and_closed(surplus)
    other = await listener.connect("127.0.0.3")  # another peer has its own share
    assert listener.cap.status() == {
        "open": 4, "unauthenticated": 4, "refused": 1, "evicted": 0, "write_timeouts": 0,
    }  # fmt: skip
    for sock in [*own, other]:
        assert await still_open(listener, sock)


async def test_a_full_unauthenticated_share_evicts_its_oldest_never_an_authenticated_one(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    listener = await listen(max_unauthenticated=3)
    tenant = await listener.connect("127.0.0.9")
    await asyncio.get_running_loop().sock_sendall(tenant, b"auth")
    await wait_for(lambda: listener.cap.status()["unauthenticated"] == 0)
    anonymous = [await listener.connect(f"127.0.0.{2 + i}") for i in range(3)]
    # One more anonymous: the oldest anonymous one makes room (it sent nothing: a 503).
    newcomer = await listener.connect("127.0.0.7")
    assert await answered_503_and_closed(anonymous[0])
    # Once more: the next oldest, which has sent bytes (half a request): reset.
    await asyncio.get_running_loop().sock_sendall(anonymous[1], b"POST / HTTP/1.1\r\n")
    await asyncio.sleep(0)
    await listener.connect("127.0.0.8")
    await wait_for(lambda: connection_cut(anonymous[1]))
    status = listener.cap.status()
    assert (status["open"], status["unauthenticated"], status["evicted"]) == (4, 3, 2)
    for sock in (tenant, anonymous[2], newcomer):
        assert await still_open(listener, sock)


async def test_the_cap_refuses_whatever_the_kind(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    listener = await listen(max_connections=2, max_unauthenticated=1)
    first = await listener.connect()
    await asyncio.get_running_loop().sock_sendall(first, b"auth")
    await wait_for(lambda: listener.cap.status()["unauthenticated"] == 0)
    await listener.connect("127.0.0.2")
    over = await listener.connect("127.0.0.3")
    assert await answered_503_and_closed(over)
    assert listener.cap.status()["refused"] == 1
    assert listener.cap.status()["evicted"] == 0  # at the cap nobody is evicted


async def test_closed_connections_leave_every_count(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    listener = await listen(per_peer=2)
    socks = [await listener.connect("127.0.0.2") for _ in range(2)]
    for sock in socks:
        sock.close()
    listener.clients.clear()
    await wait_for(lambda: listener.cap.open == 0)
    assert listener.cap.unauthenticated == {}
    assert listener.cap.unauthenticated_by_peer == {}
    again = [await listener.connect("127.0.0.2") for _ in range(2)]  # the share is back
    for sock in again:
        assert await still_open(listener, sock)


async def test_a_connection_that_takes_nothing_is_reset_by_the_sweep(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    listener = await listen()
    sock = await listener.connect(rcvbuf=4096)
    await asyncio.get_running_loop().sock_sendall(sock, b"big")  # 8 MiB it never reads
    await wait_for(lambda: connection_cut(sock), budget_s=30.0)
    assert listener.cap.status()["write_timeouts"] == 1
    await wait_for(lambda: listener.cap.open == 0)


async def test_a_small_answer_nobody_reads_is_reset_by_the_sweep(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    """32 KiB never read: the write never pauses (under the high-water mark) and the connection
    stays open, idle; the bytes wait in the kernel (and the transport), unacknowledged, and the
    sweep resets the connection all the same."""
    listener = await listen()
    sock = await listener.connect(rcvbuf=4096)
    await asyncio.get_running_loop().sock_sendall(sock, b"small")
    await wait_for(lambda: connection_cut(sock), budget_s=30.0)
    assert listener.cap.status()["write_timeouts"] == 1


async def test_a_slow_reader_is_never_reset_by_the_sweep(
    listen: Callable[..., asyncio.Future[Listener]],
) -> None:
    """Reads at most 16 KiB every 5 ms: the 8 MiB take seconds, many write timeouts, and the
    connection is never cut. The kernel's send queue (megabytes here) hides the reading from
    the transport's buffer for longer than a timeout: the progress counted is the bytes the
    client acknowledged."""
    listener = await listen()
    sock = await listener.connect(rcvbuf=16384)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, b"big")
    received = 0
    async with asyncio.timeout(120):
        while received < 8 << 20:
            piece = await loop.sock_recv(sock, 1 << 16)
            assert piece, f"cut after {received} bytes"
            received += len(piece)
            await asyncio.sleep(0.005)
    assert listener.cap.status()["write_timeouts"] == 0


@pytest.mark.parametrize(
    ("peername", "key"),
    [
        (("10.1.2.3", 443), "10.1.2.3"),
        (("2001:db8:1:2:3:4:5:6", 443, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:ffff::1", 443, 0, 0), "2001:db8:1:2::/64"),  # the same host
        (("::ffff:10.1.2.3", 443, 0, 0), "10.1.2.3"),
        ("/run/sidecar.sock", "/run/sidecar.sock"),
        (None, ""),
    ],
)
def test_peers_are_ipv4_addresses_and_ipv6_slash_64s(peername: object, key: str) -> None:
    assert peer_key(peername) == key
