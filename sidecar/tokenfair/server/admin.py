"""The admin app (its own listener; tenants never reach it through the proxy port).

* ``GET /healthz`` — 200 while the process serves (liveness).
* ``GET /readyz`` — 200, or 503 once draining (readiness goes false first on SIGTERM).
* ``GET /metrics`` — Prometheus text format (see :mod:`tokenfair.server.metrics`).
* ``GET /status`` — JSON: config version and hash, the scheduler's books, per-tenant state and
  outcome counts.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfair.server.state import Sidecar

ADMIN_SIDECAR: Final = web.AppKey("admin_sidecar", Sidecar)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    if request.app[ADMIN_SIDECAR].dispatcher.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[ADMIN_SIDECAR].metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[ADMIN_SIDECAR].status())


def create_admin_app(sidecar: Sidecar) -> web.Application:
    app = web.Application()
    app[ADMIN_SIDECAR] = sidecar
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    return app
