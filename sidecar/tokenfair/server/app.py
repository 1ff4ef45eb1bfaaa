"""App factories: the proxy app (tenants' traffic) and the admin app, sharing one :class:`Sidecar`.

Long-lived resources live in the proxy app's ``cleanup_ctx`` (set up in this order, torn down in
reverse, each only if its setup ran): the access log's buffer (handed to its writer last), the
tracer provider (with tracing on: torn down next to last, so the spans of the requests the drain
ends are exported), the backend (the ``openai`` backend's
connection pool to its upstream, :class:`~tokenfair.server.upstream.UpstreamClient`), the
records file, the budget store's lease task (teardown returns the leases), the dispatcher (its
timers; teardown drains the queue and releases every reservation), the config watcher task, the
engine poller and the fairness signal's refresh task.

The proxy app's one middleware is :func:`~tokenfair.server.proxy.observe_requests`, beside the
handlers it wraps: this module builds and tears down, and no request runs through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from tokenfair.config import Config
from tokenfair.server.accesslog import LineWriter
from tokenfair.server.admin import create_admin_app
from tokenfair.server.backends import MODELS_ROUTE, ROUTES, Backend
from tokenfair.server.models import list_models
from tokenfair.server.proxy import (
    SIDECAR,
    completions,
    expect_continue,
    expect_not_found,
    not_found,
    observe_requests,
)
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.reload import apply_config, refuse_config, reload_failed, watch_config
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.server.sidecar import Sidecar
from tokenfair.server.tracing import (
    RequestTracer,
    check_tracing_available,
    otlp_tracer_provider,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from tokenfair.server.pool import BudgetPool
    from tokenfair.server.pool_fairness import PoolFairness


def create_app(
    settings: SidecarSettings,
    config: Config,
    backend: Backend,
    *,
    config_path: Path | None = None,
    config_sha256: str = "",
    section: object = None,
    tracer_provider: TracerProvider | None = None,
    access_writer: LineWriter | None = None,
) -> web.Application:
    """The proxy app; ``app[SIDECAR]`` is its state (pass it to :func:`create_admin_app`).
    With ``config_path``, that file is watched and reloaded. With ``settings.tracing``, spans
    go to ``tracer_provider`` (the caller's: not shut down here) or, by default, to an OTLP
    exporter; :class:`~tokenfair.config.ConfigError` at once if the ``tracing`` extra
    is not installed. Access lines go to ``access_writer`` (``tokenfair sidecar``'s stdout;
    its buffer is handed over at teardown) or, without one, to the ``tokenfair.access``
    logger."""
    if settings.tracing and tracer_provider is None:
        check_tracing_available()
    sidecar = Sidecar(
        settings,
        config,
        backend,
        config_sha256=config_sha256,
        config_path=config_path,
        section=section,
        access_writer=access_writer,
    )
    # auto_decompress off: the proxy decodes request bodies itself (proxy.decode_body), so that a
    # coding aiohttp cannot decode is the proxy's 415, not aiohttp's plain-text 400.
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        handler_args={"auto_decompress": False},
        middlewares=[observe_requests],
    )
    app[SIDECAR] = sidecar
    app[TRACER_PROVIDER] = tracer_provider
    for route in ROUTES:
        app.router.add_post(route, completions, expect_handler=expect_continue)
    app.router.add_get(MODELS_ROUTE, list_models, allow_head=False)
    app.router.add_route("*", "/{tail:.*}", not_found, expect_handler=expect_not_found)
    app.cleanup_ctx.append(_access_log_ctx)
    app.cleanup_ctx.append(_tracing_ctx)
    app.cleanup_ctx.append(_backend_ctx)
    app.cleanup_ctx.append(_records_ctx)
    app.cleanup_ctx.append(_pool_ctx)
    app.cleanup_ctx.append(_pool_fairness_ctx)  # torn down first: the pool closes the client
    app.cleanup_ctx.append(_dispatcher_ctx)
    app.cleanup_ctx.append(_watcher_ctx)
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(_fairness_ctx)
    return app


TRACER_PROVIDER = web.AppKey("tracer_provider", object)
"""The caller's tracer provider (None: an OTLP one is made when tracing is on)."""


async def _access_log_ctx(app: web.Application) -> AsyncIterator[None]:
    """Torn down last: the buffered access lines (the drain's included) go to the writer's
    thread (``tokenfair sidecar`` waits for them to be written before it exits)."""
    yield
    access = app[SIDECAR].outcomes.access_log
    if access is not None and access.writer is not None:
        access.writer.flush()


async def _tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """With tracing on, the sidecar's :class:`RequestTracer` (shut down last: it exports the
    spans of the requests the drain ended)."""
    sidecar = app[SIDECAR]
    if not sidecar.settings.tracing:
        yield
        return
    given = app[TRACER_PROVIDER]
    if given is None:
        provider = otlp_tracer_provider(sidecar.settings.tracing_endpoint)
        tracer = RequestTracer(provider, sidecar.backend.name, owned=True)
    else:
        tracer = RequestTracer(given, sidecar.backend.name, owned=False)  # type: ignore[arg-type]
    sidecar.outcomes.tracer = tracer
    yield
    sidecar.outcomes.tracer = None
    await tracer.close()


async def _backend_ctx(app: web.Application) -> AsyncIterator[None]:
    backend = app[SIDECAR].backend
    await backend.open()
    yield
    await backend.close()


async def _records_ctx(app: web.Application) -> AsyncIterator[None]:
    sidecar = app[SIDECAR]
    path = sidecar.settings.records_path
    outcomes = sidecar.outcomes
    if path is not None:
        outcomes.record_writer = RecordWriter(path, on_dropped=sidecar.metrics.records_dropped.inc)
    yield
    if outcomes.record_writer is not None:
        outcomes.record_writer.close()
        outcomes.record_writer = None


async def _pool_ctx(app: web.Application) -> AsyncIterator[None]:
    """The budget store's lease task; torn down after the dispatcher's drain, so the leases
    returned at shutdown include the refunds of the last settlements."""
    async with _background(app[SIDECAR].pool, "tokenfair-budget-pool"):
        yield


async def _pool_fairness_ctx(app: web.Application) -> AsyncIterator[None]:
    """The pool-wide fairness task (its last batch is sent at shutdown, after the drain)."""
    async with _background(app[SIDECAR].pool_fairness, "tokenfair-pool-fairness"):
        yield


@contextlib.asynccontextmanager
async def _background(owner: BudgetPool | PoolFairness | None, name: str) -> AsyncIterator[None]:
    """``owner.run()`` as a task while the app runs; at teardown the task is cancelled and
    ``owner.close()`` awaited. Nothing when the feature is off (``owner`` is None)."""
    if owner is None:
        yield
        return
    task = asyncio.create_task(owner.run(), name=name)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await owner.close()


async def _dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    dispatcher = app[SIDECAR].dispatcher
    dispatcher.drain()
    dispatcher.close()


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """The poller of the upstream engine's own state (:mod:`~tokenfair.server.engine_state`),
    when there is one to ask."""
    engine = app[SIDECAR].engine
    if engine is None:
        yield
        return
    task = asyncio.create_task(engine.run(), name="tokenfair-engine-state")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _fairness_ctx(app: web.Application) -> AsyncIterator[None]:
    """The live fairness signal's refresh (:mod:`~tokenfair.server.fairness_signal`)."""
    task = asyncio.create_task(app[SIDECAR].fairness.run(), name="tokenfair-fairness-signal")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
            functools.partial(apply_config, sidecar),
            functools.partial(refuse_config, sidecar),
            functools.partial(reload_failed, sidecar),
        ),
        name="tokenfair-config-watcher",
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


__all__ = ["SIDECAR", "create_admin_app", "create_app"]
