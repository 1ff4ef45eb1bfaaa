"""The proxy listener's connections: a cap with a share per peer and a reserve for tenants, and a
write timeout on every connection, whatever state it is in.

:class:`ConnectionCap` wraps aiohttp's protocol factory (``runner.serve`` builds the listener
with it). A new connection is decided before anything of it is parsed, by these rules in order:

1. ``max_client_connections`` are open: it is answered ``503 too_many_connections`` and closed.
2. Its peer — an IPv4 address, or an IPv6 /64 (what one host holds) — already holds
   ``max_unauthenticated_connections_per_peer`` *unauthenticated* connections: the same ``503``;
   the peer's excess evicts nobody.
3. ``max_unauthenticated_connections`` unauthenticated connections are open: the oldest of them
   is closed (``503`` if it has sent nothing yet, else cut) and the new one takes its place.

A connection is *unauthenticated* until a request on it presents a valid key (the proxy calls
:func:`mark_authenticated`); from then on it counts only against the cap, and is never evicted.
So anonymous sockets can hold at most ``max_unauthenticated_connections``: the rest of the cap is
a reserve that only tenants' connections reach, and a tenant's *new* connection — anonymous until
its first request's head is read, a round trip — always gets in, by eviction if need be: a flood
would have to open ``max_unauthenticated_connections`` sockets within that round trip to push it
out. With ``max_unauthenticated_connections >= max_client_connections`` rule 3 never applies
(the cap is reached first) and there is no reserve.

**Write timeout on every connection.** Every ``client_write_timeout_s / 4`` one sweep looks at
each open connection that has bytes waiting for its client — in the transport's buffer or in
the kernel's send queue: :func:`unacknowledged_bytes` — and at how many bytes the client has
acknowledged (Linux's ``tcpi_bytes_acked``). A connection whose client has taken no byte since
a look ``client_write_timeout_s + client_write_timeout_s / 4`` ago is reset (``SO_LINGER`` 0,
so the kernel drops what it held for it too: :func:`reset`), within 1.5 times the write
timeout. This covers what no handler bounds — the answers aiohttp writes after a handler
(refusals, ``404``\\ s, the answers of requests pipelined behind one another by a client that
never reads), an answer the kernel took whole but the client never read, a connection closed
with bytes unsent — while a request's own answer is cut a little earlier, at the write timeout,
by :class:`~tokenfair.server.backends.base.BackendCall` (which records it ``499
client_write_timeout``). Where the kernel does not count acknowledged bytes, only a paused
write or a closing connection is judged, by its unacknowledged bytes shrinking. Idle and
slow-header connections are aiohttp's keep-alive timer's (``client_idle_timeout_s``), request
bodies the proxy's (``client_body_timeout_s``): every state of a connection has its timeout.

The sweep costs two system calls per open connection every quarter of the write timeout (4,096
connections are a few ms every 7.5 s by default); a connection costs O(1) to open, authenticate
and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

from tokenfair.server.clock import EventClock, ModelClock, Timer

log = logging.getLogger("tokenfair.sidecar")

SWEEPS_PER_TIMEOUT: Final = 4
"""Sweeps of the write timeout per ``client_write_timeout_s``."""
_CAP_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_CAP_BODY: Final = (
    b'{"error":{"message":"too many open connections to the sidecar; retry","type":'
    b'"service_unavailable","param":null,"code":"too_many_connections"}}'
)
CAP_ANSWER: Final = _CAP_RESPONSE % (len(_CAP_BODY), _CAP_BODY)
"""What a connection refused (or evicted before it sent anything) is sent before it is closed."""
_LINGER_RESET: Final = struct.pack("ii", 1, 0)


_INT: Final = struct.Struct("i")


def unacknowledged_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes written to a connection that its peer has not taken yet: the transport's buffer
    plus the kernel's send queue (``SIOCOUTQ``: sent or not, not yet acknowledged; 0 where the
    kernel does not say). It shrinks exactly when the peer takes bytes — the transport's buffer
    alone does not: with a send queue of megabytes, a slow reader takes a long time to make
    room enough for the kernel to ask the transport for more."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            size += _INT.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
    return size


_TCP_INFO: Final = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED: Final = struct.Struct("Q")
_BYTES_ACKED_OFFSET: Final = 120
"""Where ``tcpi_bytes_acked`` (Linux 4.1 and later) lies in ``struct tcp_info``."""


def acknowledged_bytes(transport: asyncio.BaseTransport) -> int | None:
    """Bytes the peer has acknowledged since the connection opened (Linux's
    ``tcpi_bytes_acked``: it grows exactly when the peer takes bytes, whatever is written
    meanwhile); None where the kernel does not say."""
    sock = transport.get_extra_info("socket")
    if sock is None or _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except (OSError, ValueError):
        return None
    if len(info) < _BYTES_ACKED_OFFSET + _BYTES_ACKED.size:
        return None
    acked: int = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0]
    return acked


def reset(transport: asyncio.Transport) -> None:
    """Abort a connection with a TCP reset (``SO_LINGER`` 0): what the kernel still holds for
    the peer is dropped with it. A plain abort frees the transport's buffer but leaves the
    bytes already in the kernel's send queue to be retried, for minutes, to a peer that takes
    nothing."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The listener's bounds (``SidecarSettings``' fields of the same names)."""

    max_connections: int
    max_unauthenticated: int
    max_unauthenticated_per_peer: int
    write_timeout_s: float


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The peer a connection's share is counted against (:func:`peer_key` of its address)."""
    return peer_key(transport.get_extra_info("peername"))


def peer_key(peername: object) -> str:
    """The peer of a socket address (``getpeername()``): the IPv4 address; for IPv6 its /64
    (one host's share: a host is given a whole /64), an IPv4-mapped address as the IPv4 one;
    anything else (a Unix socket) as the text of the address."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername or "")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return f"{ipaddress.IPv6Network((address, 64), strict=False).network_address}/64"
    return str(address)


class ConnectionCap:
    """A protocol factory around aiohttp's (``runner.server``) that applies the module's rules.
    ``on_refused`` counts every connection answered ``503 too_many_connections`` (refused or
    evicted). :meth:`start` arms the write-timeout sweep, :meth:`close` stops it."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limits: ConnectionLimits,
        on_refused: Callable[[], object],
        clock: EventClock | None = None,
    ) -> None:
        self.factory = factory
        self.limits = limits
        self.on_refused = on_refused
        self._clock: EventClock = clock or ModelClock()
        """The write-timeout sweep's timer; on the event loop's line, as the transports' times."""
        self.open = 0
        self.connections: set[CappedConnection] = set()
        self.unauthenticated: dict[CappedConnection, None] = {}
        """The unauthenticated connections, oldest first (a dict keeps insertion order)."""
        self.unauthenticated_by_peer: dict[str, int] = {}
        self.refused = 0
        self.evicted = 0
        self.write_timeouts = 0
        self._sweeper: Timer | None = None

    def __call__(self) -> asyncio.Protocol:
        return CappedConnection(self)

    # -- the write-timeout sweep ----------------------------------------------------------------

    def start(self) -> None:
        """Arm the sweep (in the running loop)."""
        if self._sweeper is None:
            interval_s = self.limits.write_timeout_s / SWEEPS_PER_TIMEOUT
            self._sweeper = self._clock.call_later(interval_s, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep(self) -> None:
        now = self._clock.monotonic_s()
        interval_s = self.limits.write_timeout_s / SWEEPS_PER_TIMEOUT
        stalled_for_s = self.limits.write_timeout_s + interval_s
        for connection in tuple(self.connections):
            if connection.stalled_since(now) <= now - stalled_for_s:
                self.write_timeouts += 1
                connection.abort_stalled(self.limits.write_timeout_s)
        self._sweeper = self._clock.call_later(interval_s, self._sweep)

    # -- admission of a connection --------------------------------------------------------------

    def refuse(self, transport: asyncio.Transport) -> None:
        self.refused += 1
        self.on_refused()
        transport.write(CAP_ANSWER)
        transport.close()

    def admit(self, connection: CappedConnection, transport: asyncio.Transport) -> bool:
        """Apply the rules to a new connection; False: refused (answered and closed)."""
        limits = self.limits
        if self.open >= limits.max_connections:
            self.refuse(transport)
            return False
        peer = peer_of(transport)
        held = self.unauthenticated_by_peer.get(peer, 0)
        if held >= limits.max_unauthenticated_per_peer:
            self.refuse(transport)
            return False
        if len(self.unauthenticated) >= limits.max_unauthenticated:
            self._evict_oldest()
        connection.peer = peer
        self.open += 1
        self.connections.add(connection)
        self.unauthenticated[connection] = None
        self.unauthenticated_by_peer[peer] = held + 1
        return True

    def _evict_oldest(self) -> None:
        oldest = next(iter(self.unauthenticated))
        self.evicted += 1
        self.on_refused()
        oldest.evict()

    def authenticated(self, connection: CappedConnection) -> None:
        """``connection`` carried a valid key: it leaves the unauthenticated share."""
        if connection in self.unauthenticated:
            del self.unauthenticated[connection]
            self._uncount_peer(connection.peer)

    def forget(self, connection: CappedConnection) -> None:
        """``connection`` is closed (or being closed by an eviction): off every count, once."""
        if connection in self.connections:
            self.connections.discard(connection)
            self.open -= 1
            self.authenticated(connection)

    def _uncount_peer(self, peer: str) -> None:
        held = self.unauthenticated_by_peer.get(peer, 0) - 1
        if held > 0:
            self.unauthenticated_by_peer[peer] = held
        else:
            self.unauthenticated_by_peer.pop(peer, None)

    def status(self) -> dict[str, int]:
        """For ``/status``: connections open and unauthenticated now, and since the start the
        connections refused, evicted and cut by the write-timeout sweep."""
        return {
            "open": self.open,
            "unauthenticated": len(self.unauthenticated),
            "refused": self.refused,
            "evicted": self.evicted,
            "write_timeouts": self.write_timeouts,
        }


class CappedConnection(asyncio.Protocol):
    """One proxy connection: delegates to aiohttp's handler once :meth:`ConnectionCap.admit`
    let it in, and keeps what the write-timeout sweep looks at."""

    __slots__ = (
        "_cap",
        "_inner",
        "_mark",
        "_paused",
        "_received",
        "_stalled_since",
        "_transport",
        "peer",
    )

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self.peer = ""
        self._received = False
        self._paused = False
        self._stalled_since: float | None = None
        self._mark = 0
        """At the last look: the bytes the client had acknowledged (or, where the kernel does
        not count them, the bytes it had not)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: the protocol is the same.
        transport = cast(asyncio.Transport, transport)
        if not self._cap.admit(self, transport):
            return
        self._transport = transport
        self._inner = self._cap.factory()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        inner, self._inner = self._inner, None
        self._transport = None
        self._cap.forget(self)
        if inner is not None:
            inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._received = True
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        self._paused = True
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        if self._inner is not None:
            self._inner.resume_writing()

    def authenticated(self) -> None:
        self._cap.authenticated(self)

    def evict(self) -> None:
        """Make room for a newer connection: off the counts now; a connection that has sent
        nothing is told ``503`` (then closed), one under way is cut."""
        self._cap.forget(self)
        transport = self._transport
        if transport is None:
            return
        if self._received:
            reset(transport)
        else:
            transport.write(CAP_ANSWER)
            transport.close()

    def stalled_since(self, now: float) -> float:
        """Loop time since when the client has taken no bytes while bytes wait for it (``now``:
        none wait, or this is the first look that finds them waiting).

        Where the kernel counts the bytes the client acknowledged (:func:`acknowledged_bytes`),
        bytes wait whenever :func:`unacknowledged_bytes` is not 0 — in the transport's buffer
        or in the kernel's send queue, the handler done or not, the connection open or
        closing — and the client took some if that count grew since the last look. Elsewhere
        only a write that is paused, or a closing connection with bytes in the transport, is
        judged, by the unacknowledged bytes shrinking (nothing is added to them meanwhile)."""
        transport = self._transport
        if transport is None:
            return now
        acked = acknowledged_bytes(transport)
        unacknowledged = unacknowledged_bytes(transport)
        if acked is None:
            waiting = transport.get_write_buffer_size() > 0 and (
                self._paused or transport.is_closing()
            )
            progress, mark = unacknowledged < self._mark, unacknowledged
        else:
            waiting = unacknowledged > 0
            progress, mark = acked > self._mark, acked
        since = self._stalled_since
        if not waiting:
            since = None
        elif since is None or progress:
            since = now
        self._stalled_since, self._mark = since, mark
        return now if since is None else since

    def abort_stalled(self, timeout_s: float) -> None:
        transport = self._transport
        if transport is not None:
            log.info("connection from %s took no bytes for over %g s; resetting it",
                     self.peer, timeout_s)  # fmt: skip
            reset(transport)


def mark_authenticated(transport: asyncio.BaseTransport | None) -> None:
    """The request on ``transport`` presented a valid key: its connection leaves the
    unauthenticated share (nothing happens for a connection not served through a
    :class:`ConnectionCap`, such as a test server's)."""
    if transport is not None:
        protocol = transport.get_protocol()
        if type(protocol) is CappedConnection:
            protocol.authenticated()


__all__ = [
    "CAP_ANSWER",
    "CappedConnection",
    "ConnectionCap",
    "ConnectionLimits",
    "acknowledged_bytes",
    "mark_authenticated",
    "peer_key",
    "peer_of",
    "reset",
    "unacknowledged_bytes",
]
