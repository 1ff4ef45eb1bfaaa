"""App factories: the proxy app (tenants' traffic) and the admin app, sharing one :class:`Sidecar`.

Long-lived resources live in the proxy app's ``cleanup_ctx`` (set up in this order, torn down in
reverse, each only if its setup ran): the backend (the upstream ``ClientSession``), the records
file, the budget store's lease task (teardown returns the leases), the dispatcher (its timers;
teardown drains the queue and releases every reservation), and the config watcher task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from tokenfair_sidecar.config import Config
from tokenfair_sidecar.server.admin import create_admin_app
from tokenfair_sidecar.server.backends import MODELS_ROUTE, ROUTES, Backend
from tokenfair_sidecar.server.models import list_models
from tokenfair_sidecar.server.proxy import (
    SIDECAR,
    completions,
    expect_continue,
    expect_not_found,
    not_found,
)
from tokenfair_sidecar.server.recorder import RecordWriter
from tokenfair_sidecar.server.reload import watch_config
from tokenfair_sidecar.server.settings import SidecarSettings
from tokenfair_sidecar.server.state import Sidecar


def create_app(
    settings: SidecarSettings,
    config: Config,
    backend: Backend,
    *,
    config_path: Path | None = None,
    config_sha256: str = "",
    section: object = None,
) -> web.Application:
    """The proxy app; ``app[SIDECAR]`` is its state (pass it to :func:`create_admin_app`).
    With ``config_path``, that file is watched and reloaded."""
    sidecar = Sidecar(
        settings,
        config,
        backend,
        config_sha256=config_sha256,
        config_path=config_path,
        section=section,
    )
    # auto_decompress off: the proxy decodes request bodies itself (proxy.decode_body), so that a
    # coding aiohttp cannot decode is the proxy's 415, not aiohttp's plain-text 400.
    app = web.Application(
        client_max_size=settings.max_body_bytes, handler_args={"auto_decompress": False}
    )
    app[SIDECAR] = sidecar
    for route in ROUTES:
        app.router.add_post(route, completions, expect_handler=expect_continue)
    app.router.add_get(MODELS_ROUTE, list_models, allow_head=False)
    app.router.add_route("*", "/{tail:.*}", not_found, expect_handler=expect_not_found)
    app.cleanup_ctx.append(_backend_ctx)
    app.cleanup_ctx.append(_records_ctx)
    app.cleanup_ctx.append(_pool_ctx)
    app.cleanup_ctx.append(_dispatcher_ctx)
    app.cleanup_ctx.append(_watcher_ctx)
    return app


async def _backend_ctx(app: web.Application) -> AsyncIterator[None]:
    backend = app[SIDECAR].backend
    await backend.open()
    yield
    await backend.close()


async def _records_ctx(app: web.Application) -> AsyncIterator[None]:
    sidecar = app[SIDECAR]
    path = sidecar.settings.records_path
    if path is not None:
        sidecar.recorder = RecordWriter(path, on_dropped=sidecar.metrics.records_dropped.inc)
    yield
    if sidecar.recorder is not None:
        sidecar.recorder.close()
        sidecar.recorder = None


async def _pool_ctx(app: web.Application) -> AsyncIterator[None]:
    """The budget store's lease task; torn down after the dispatcher's drain, so the leases
    returned at shutdown include the refunds of the last settlements."""
    pool = app[SIDECAR].pool
    if pool is None:
        yield
        return
    task = asyncio.create_task(pool.run(), name="tokenfair-budget-pool")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await pool.close()


async def _dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    dispatcher = app[SIDECAR].dispatcher
    dispatcher.drain()
    dispatcher.close()


async def _watcher_ctx(app: web.Application) -> AsyncIterator[None]:
    sidecar = app[SIDECAR]
    if sidecar.config_path is None:
        yield
        return
    task = asyncio.create_task(
        watch_config(
            sidecar.config_path,
            sidecar.settings.reload_interval_s,
            sidecar.config_sha256,
            sidecar.apply_config,
            sidecar.refuse_config,
            sidecar.reload_failed,
        ),
        name="tokenfair-config-watcher",
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["SIDECAR", "create_admin_app", "create_app"]
