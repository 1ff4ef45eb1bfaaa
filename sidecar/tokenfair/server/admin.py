"""The admin app (its own listener; tenants never reach it through the proxy port).

* ``GET /healthz`` — 200 while the process serves (liveness).
* ``GET /readyz`` — 200, or 503 once draining (readiness goes false first on SIGTERM).
* ``GET /metrics`` — Prometheus text format (see :mod:`tokenfair.server.metrics`).
* ``GET /status`` — JSON: config version and hash, the scheduler's books, per-tenant state and
  outcome counts (see :mod:`tokenfair.server.status`).

Both grow with the tenants (10,000 tenants: ~2 MB of ``/status``, ~11 MB of ``/metrics`` with
2,000 of them active) and share the event loop with the proxy, so both are streamed: written a
bounded chunk at a time (a few hundred tenants' series or entries, ~1 ms of work), yielding to
the loop between chunks, so a scrape delays a proxied request by one chunk at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from tokenfair.server.sidecar import Sidecar
from tokenfair.server.status import status_chunks

ADMIN_SIDECAR: Final = web.AppKey("admin_sidecar", Sidecar)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if request.app[ADMIN_SIDECAR].dispatcher.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ready"})


async def stream(
    request: web.Request, content_type: str, chunks: Iterator[str] | Iterator[bytes]
) -> web.StreamResponse:
    """Write ``chunks`` as they come (chunked transfer encoding), yielding to the event loop
    after each: the proxy's requests run between two chunks. ``HEAD`` gets the head alone; a
    client that leaves mid-way ends the rendering quietly."""
    if request.method == "HEAD":
        return web.Response(headers={"Content-Type": content_type})
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    try:
        for chunk in chunks:
            if chunk:
                await response.write(chunk.encode() if isinstance(chunk, str) else chunk)
            await asyncio.sleep(0)
        await response.write_eof()
    except ConnectionResetError:  # the scraper went away: nothing left to do, nothing to log
        pass
    return response


async def metrics(request: web.Request) -> web.StreamResponse:
    return await stream(request, CONTENT_TYPE_LATEST, request.app[ADMIN_SIDECAR].metrics.chunks())


async def status(request: web.Request) -> web.StreamResponse:
    return await stream(
        request, "application/json; charset=utf-8", status_chunks(request.app[ADMIN_SIDECAR])
    )


def create_admin_app(sidecar: Sidecar) -> web.Application:
    app = web.Application()
    app[ADMIN_SIDECAR] = sidecar
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app
