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

SIGHUP (what logrotate's ``postrotate`` sends) never stops the sidecar: it calls the sidecar's
``reopen_logs()`` (the records file is reopened at its path) where the sidecar has one, and is
otherwise logged and ignored; a failure to reopen is logged, and the sidecar serves on.

The proxy listener is bounded (the admin listener serves a few scrapers and is not):

* ``client_idle_timeout_s`` — aiohttp's keep-alive timeout. Its timer starts when a connection
  opens and again after every response, and closes the connection if no request's head has
  arrived by then: idle connections and slow-header ("slowloris") connections alike.
* ``client_body_timeout_s`` and ``client_write_timeout_s`` — in the proxy handler (the body
  read) and the backends and the proxy (every answer a request gets, streamed or whole, to a
  client that does not read); and for every connection, whatever it is doing, the
  write-timeout sweep of :mod:`~tokenfair.server.connections` (answers aiohttp writes
  itself, pipelined requests' answers, connections closed with bytes unsent).
* ``max_client_connections``, ``max_unauthenticated_connections`` and
  ``max_unauthenticated_connections_per_peer`` — :class:`~tokenfair.server.connections.
  ConnectionCap` wraps aiohttp's protocol factory: a connection over the cap, or over its
  peer's share of unauthenticated connections, is answered ``503`` and closed before anything is
  parsed (a flood costs a few bytes per connection, never a handler); anonymous connections
  hold at most their own share, evicting the oldest of them, and the rest of the cap is kept
  for tenants' connections.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import platform
import signal
from typing import Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tokenfair import native
from tokenfair.server.admin import create_admin_app
from tokenfair.server.app import SIDECAR
from tokenfair.server.connections import ConnectionCap, ConnectionLimits
from tokenfair.server.runtime_settings import SidecarSettings, parse_address
from tokenfair.server.sidecar import Sidecar

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


MMAP_THRESHOLD_BYTES: Final = 1 << 20
"""Allocations from this size up are their own memory mappings, returned to the system when
freed (glibc's ``M_MMAP_THRESHOLD``, pinned)."""
TRIM_THRESHOLD_BYTES: Final = 1 << 20
"""Free memory at the top of the heap beyond this is returned to the system (glibc's
``M_TRIM_THRESHOLD``)."""
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3


def _tune_malloc() -> None:
    """Pin glibc's mmap and trim thresholds at 1 MiB (elsewhere: nothing).

    By default glibc raises its mmap threshold, up to 32 MiB, each time a mapped block is
    freed, after which blocks of that size come from the heap and stay with the process when
    freed: answers of megabytes held by clients that did not read them (until the write
    timeout cut those clients) kept the RSS at its peak for good
    (``bench/bench_hostile_clients.py``). Pinned, blocks of 1 MiB and more go back to the
    system when freed. The trim threshold at the same size keeps the heap from being shrunk
    and grown again around the 256 KiB buffer asyncio reads every socket into: with glibc's
    defaults each read cost an ``mmap``, an ``mremap`` and a ``munmap`` (~20 µs on this
    project's test machine), with the thresholds pinned at 128 KiB two ``brk``; at 1 MiB, none
    (~3 µs)."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        pinned = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(
            _M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES
        )
    except (OSError, AttributeError):
        pinned = False
    if not pinned:
        log.warning("could not pin malloc's thresholds (mallopt); large answers freed may "
                    "stay in the process's memory")  # fmt: skip


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


def connection_limits(settings: SidecarSettings) -> ConnectionLimits:
    """The proxy listener's bounds from the settings."""
    return ConnectionLimits(
        max_connections=settings.max_client_connections,
        max_unauthenticated=settings.max_unauthenticated_connections,
        max_unauthenticated_per_peer=settings.max_unauthenticated_connections_per_peer,
        write_timeout_s=settings.client_write_timeout_s,
    )


def reopen_logs(sidecar: Sidecar) -> None:
    """SIGHUP: the sidecar's ``reopen_logs()`` if it has one, else logged and ignored. Never
    raises (a signal handler that raised would end in the loop's exception handler)."""
    reopen = getattr(sidecar, "reopen_logs", None)
    if not callable(reopen):
        log.info("SIGHUP: nothing to reopen; ignored")
        return
    try:
        reopen()
    except Exception:
        log.exception("SIGHUP: reopening the logs failed; the sidecar serves on")
    else:
        log.info("SIGHUP: logs reopened")


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
    # From now until the end of the drain and the cleanup: never SIGHUP's default (death).
    loop.add_signal_handler(signal.SIGHUP, reopen_logs, sidecar)
    listener: asyncio.Server | None = None
    cap: ConnectionCap | None = None
    try:
        host, port = parse_address(settings.listen, "listen")
        server = proxy_runner.server
        assert server is not None  # set up above
        # The proxy listener is served here rather than by a web.TCPSite: the cap wraps the
        # protocol factory that a TCPSite would hand to create_server.
        cap = ConnectionCap(server, connection_limits(settings),
                            sidecar.metrics.refused_connections.inc)  # fmt: skip
        cap.start()
        sidecar.connections = cap
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
        _tune_malloc()
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
        if cap is not None:
            cap.close()
        if listener is not None:
            listener.close()  # no new connections; the runner closes the open ones
        await proxy_runner.cleanup()
        await admin_runner.cleanup()
        loop.remove_signal_handler(signal.SIGHUP)
