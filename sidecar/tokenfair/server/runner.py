"""Run a sidecar: two listeners, signal handling, and the graceful drain.

Drain sequence on SIGTERM (or SIGINT):

1. readiness goes false (``/readyz`` 503) and new proxy requests get ``503 draining``;
2. every still-queued request is taken out of the queue and answered ``503`` with
   ``Retry-After`` (its reservation released);
3. in-flight requests run to the end, for at most ``drain_grace_s``;
4. handlers still running are cancelled by the sidecar and get :data:`SHUTDOWN_AFTER_GRACE_S`
   to settle and record their requests (``503 drain_aborted``: a stream ends incomplete, its
   upstream call is closed); then the proxy listener closes (aiohttp's own shutdown, given
   :data:`RUNNER_SHUTDOWN_S`, finds nothing left to wait for), then the admin listener, and the
   cleanup context closes the upstream connections (the backend's) and the records file and
   releases any remaining KV. The drain ends within ``drain_grace_s + 1`` s (``+ 1.5`` s at
   worst: a handler that ignores its cancellation costs aiohttp's two waits of
   :data:`RUNNER_SHUTDOWN_S`), then the process exits.

The proxy listener is bounded (the admin listener serves a few scrapers and is not):

* ``client_idle_timeout_s`` — aiohttp's keep-alive timeout. Its timer starts when a connection
  opens and again after every response, and closes the connection if no request's head has
  arrived by then: idle connections and slow-header ("slowloris") connections alike.
* ``client_body_timeout_s`` and ``client_write_timeout_s`` — in the proxy handler (the body
  read) and the backends (stream writes to a client that does not read).
* ``max_client_connections`` — :class:`ConnectionCap` wraps aiohttp's protocol factory: one
  connection over the cap is answered ``503`` and closed before anything is parsed, so a flood
  of connections costs a few bytes each, never a handler.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from typing import Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tokenfair import native
from tokenfair.server.admin import create_admin_app
from tokenfair.server.app import SIDECAR
from tokenfair.server.runtime_settings import SidecarSettings, parse_address

log = logging.getLogger("tokenfair.sidecar")

GC_GEN0_THRESHOLD: Final = 10_000
"""Allocations between young collections (CPython's default: 700)."""

SHUTDOWN_AFTER_GRACE_S: Final = 1.0
"""After the drain grace, how long handlers cancelled by the sidecar get to settle and record."""
RUNNER_SHUTDOWN_S: Final = 0.25
"""aiohttp's ``shutdown_timeout`` of the proxy listener: it waits this long for a handler to end
on its own, then as long again after cancelling it. Nothing should be left for it (the sidecar
cancelled the handlers first); it bounds what a stuck one can add to the drain."""


def _tune_gc() -> None:
    """Cheaper cyclic GC for a long-running proxy (no effect on what is collected, only when).

    Everything allocated so far (modules, config, apps) lives as long as the process: ``freeze``
    moves it out of the generations the collector scans. And with 64 requests in flight, each
    young collection re-scans a few thousand live objects of the requests under way; at
    CPython's default of one every 700 allocations that was ~10 % of the CPU per request, so
    young collections run every :data:`GC_GEN0_THRESHOLD` allocations instead (requests rarely
    make cycles: reference counting frees nearly all of their garbage at once).
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


class MalformedRequestLogFilter(logging.Filter):
    """Turns aiohttp's ``ERROR`` + traceback for a request it could not parse (bad framing,
    bad header bytes: anyone can send them, and the client got its ``400``) into one ``INFO``
    line naming the peer and the parser's complaint — emitted only where that logger would emit
    an ``INFO`` line (not under ``--log-level WARNING``). Other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and record.levelno >= logging.ERROR:
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            # One line: the parser's message quotes the client's bytes (newlines, controls).
            record.msg = "malformed request from %s (%s %r)"
            record.args = (peer, exc.code, " ".join(str(exc.message).split())[:120])
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            # The logger let it through as an ERROR; as an INFO it passes only if INFO is on.
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def quiet_malformed_requests() -> None:
    """Install :class:`MalformedRequestLogFilter` on aiohttp's server logger (once)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLogFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestLogFilter())


_CAP_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_CAP_BODY: Final = (
    b'{"error":{"message":"too many open connections to the sidecar; retry","type":'
    b'"service_unavailable","param":null,"code":"too_many_connections"}}'
)


class ConnectionCap:
    """A protocol factory around aiohttp's (``runner.server``) that keeps at most ``limit``
    connections open: one more is answered ``503`` at once and closed (its request, if any,
    is never read). ``on_refused`` counts those."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limit: int,
        on_refused: Callable[[], object],
    ) -> None:
        self.factory = factory
        self.limit = limit
        self.on_refused = on_refused
        self.open = 0

    def __call__(self) -> asyncio.Protocol:
        return _CappedConnection(self)


class _CappedConnection(asyncio.Protocol):
    """Delegates to aiohttp's handler if the connection is within the cap."""

    __slots__ = ("_cap", "_inner")

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap
        self._inner: asyncio.Protocol | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cap = self._cap
        if cap.open >= cap.limit:
            cap.on_refused()
            assert isinstance(transport, asyncio.Transport)
            transport.write(_CAP_RESPONSE % (len(_CAP_BODY), _CAP_BODY))
            transport.close()
            return
        cap.open += 1
        self._inner = cap.factory()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            self._cap.open -= 1
            inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


async def serve(settings: SidecarSettings, app: web.Application) -> None:
    """Serve ``app`` and its admin app until SIGTERM/SIGINT, then drain."""
    sidecar = app[SIDECAR]
    admin = create_admin_app(sidecar)
    quiet_malformed_requests()
    # handler_cancellation: a client that disconnects cancels its handler, so a queued request
    # leaves the queue at once and a streaming one stops its upstream call.
    # The grace is spent in `wait_idle` below and the handlers still running are cancelled by
    # `abort_handlers`; the runner then only closes connections (RUNNER_SHUTDOWN_S).
    # keepalive_timeout: see the module docstring (it closes idle and slow-header connections).
    proxy_runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=RUNNER_SHUTDOWN_S,
        access_log=None,
        keepalive_timeout=settings.client_idle_timeout_s,
    )
    admin_runner = web.AppRunner(admin, access_log=None)
    await proxy_runner.setup()
    await admin_runner.setup()
    loop = asyncio.get_running_loop()
    listener: asyncio.Server | None = None
    try:
        host, port = parse_address(settings.listen, "listen")
        server = proxy_runner.server
        assert server is not None  # set up above
        # The proxy listener is served here rather than by a web.TCPSite: the cap wraps the
        # protocol factory that a TCPSite would hand to create_server.
        cap = ConnectionCap(
            server, settings.max_client_connections, sidecar.metrics.refused_connections.inc
        )
        listener = await loop.create_server(cap, host, port, backlog=1024)
        admin_host, admin_port = parse_address(settings.admin_listen, "adminListen")
        await web.TCPSite(admin_runner, admin_host, admin_port).start()
        log.info(
            "tokenfair sidecar: proxy on %s, admin on %s, backend %s, %s",
            settings.listen, settings.admin_listen, sidecar.backend.name,
            native.status().describe(),
        )  # fmt: skip
        print(
            f"tokenfair sidecar ready: proxy http://{settings.listen} "
            f"admin http://{settings.admin_listen}",
            flush=True,
        )
        _tune_gc()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        queued = sidecar.dispatcher.drain()
        running = sidecar.scheduler.running
        log.info("draining: %d queued refused, %d in flight", queued, running)
        if not await sidecar.dispatcher.wait_idle(settings.drain_grace_s):
            log.warning("drain grace of %.1f s over; aborting what still runs",
                        settings.drain_grace_s)  # fmt: skip
            aborted = await sidecar.dispatcher.abort_handlers(SHUTDOWN_AFTER_GRACE_S)
            log.warning("drain: %d request(s) cut (recorded 503 drain_aborted)", aborted)
    finally:
        if listener is not None:
            listener.close()  # no new connections; the runner closes the open ones
        await proxy_runner.cleanup()
        await admin_runner.cleanup()
