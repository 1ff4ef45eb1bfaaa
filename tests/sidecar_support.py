"""Shared helpers of the sidecar tests (no tests here): configs with local keys, app clients,
free ports, and the books-are-zero check every fault test ends with."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient

from tokenfair.config import (
    Config,
    PolicyConfig,
    TenantConfig,
    api_key_digest,
    build_config,
)
from tokenfair.core import Books
from tokenfair.core.cost import CostModel
from tokenfair.server import SIDECAR, Sidecar, create_admin_app, create_app, make_backend
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.scenarios import LESSON_TENANTS

KEYS = {
    "tenant_chat_pro": "sk-local-chat-pro",
    "tenant_ide_assist": "sk-local-ide-assist",
    "tenant_batch_rag": "sk-local-batch-rag",
}
CHAT, IDE, BATCH = (f"Bearer {KEYS[t]}" for t in KEYS)
ZERO_BOOKS = Books(0, 0, 0, 0, 0)

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def lesson_tenants_with_keys() -> list[TenantConfig]:
    return [replace(t, api_key_sha256=(api_key_digest(KEYS[t.tenant_id]),)) for t in LESSON_TENANTS]


PATIENT_POLICY = PolicyConfig(max_interactive_wait_ms=60_000, max_batch_wait_ms=60_000)
"""The lesson's policy with 60 s wait limits: at ``time_scale`` 0.01 the lesson's 420 ms would be
4.2 real ms, less than the event loop of a loaded machine may stall between a request's arrival
and its admission. Tests about waiting and timing set their own policy."""


def keyed_config(policy: PolicyConfig | None = None, **tenant_changes: Any) -> Config:
    """The lesson's tenants with the local keys; ``tenant_changes`` apply to every tenant."""
    tenants = [replace(t, **tenant_changes) for t in lesson_tenants_with_keys()]
    return build_config(policy or PATIENT_POLICY, tenants, "test-1")


@dataclass
class Clients:
    proxy: TestClient[Any, Any]
    admin: TestClient[Any, Any]
    sidecar: Sidecar


async def start(
    aiohttp_client: ClientFactory,
    config: Config,
    settings: SidecarSettings | None = None,
    **app_kwargs: Any,
) -> Clients:
    """An app on loopback (the aiohttp test server cancels handlers of departed clients)."""
    settings = settings or SidecarSettings(time_scale=0.01)
    backend = make_backend(settings, CostModel.from_policy(config.policy))
    app = create_app(settings, config, backend, **app_kwargs)
    proxy = await aiohttp_client(app)
    sidecar = app[SIDECAR]
    admin = await aiohttp_client(create_admin_app(sidecar))
    return Clients(proxy, admin, sidecar)


async def books_when_settled(sidecar: Sidecar, budget_s: float = 5.0) -> Books:
    """The books once nothing is queued, running or resident — or as they are after
    ``budget_s`` (KV is released ``kv_hold_ms`` after dispatch, a few scaled ms)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while True:
        books = sidecar.scheduler.books()
        if books == ZERO_BOOKS or loop.time() > deadline:
            return books
        await asyncio.sleep(0.005)


async def until_ready(
    process: subprocess.Popen[bytes], admin: str, session: aiohttp.ClientSession
) -> None:
    """Wait until a ``tokenfair sidecar`` child answers ``admin``'s ``/readyz`` with 200 (its
    stderr in the failure if it exits first; an ``AssertionError`` after ~30 s of tries)."""
    for _ in range(600):
        assert process.poll() is None, process.stderr.read().decode()  # type: ignore[union-attr]
        try:
            async with session.get(f"{admin}/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the sidecar did not become ready")


def completion_body(prompt_tokens: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A /v1/completions body the ``chars4`` estimator prices at exactly ``prompt_tokens``
    (4 characters per token)."""
    return {"model": "m", "prompt": "x" * (4 * prompt_tokens), "max_tokens": max_tokens, **extra}


async def wait_for(predicate: Callable[[], bool], budget_s: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def one_running_one_queued(
    proxy: TestClient[Any, Any], sidecar: Sidecar, authorization: str = CHAT
) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """Start a 1000 + 4 * 750 = 4000-service-token request (89 model ms at 45 tokens/ms) and,
    once it runs, a small one that has to queue behind it (``max_in_flight=1``). Returns both
    client tasks; each resolves to its response."""
    running = asyncio.create_task(
        proxy.post(
            "/v1/completions",
            json=completion_body(1000, 750),
            headers={"Authorization": authorization},
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.running == 1)
    queued = asyncio.create_task(
        proxy.post(
            "/v1/completions",
            json=completion_body(10, 10),
            headers={"Authorization": authorization},
        )
    )
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 1)
    return running, queued


def records_of(sidecar: Sidecar) -> list[dict[str, Any]]:
    """The sidecar's request records so far (flushed first), one dict per JSON line."""
    record_writer = sidecar.outcomes.record_writer
    assert record_writer is not None
    record_writer.flush()
    path = sidecar.settings.records_path
    assert path is not None
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
