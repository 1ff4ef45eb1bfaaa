"""Warning Events posted by the status writer's workers, wherever those were started.

Kopf sets its Event queue in each object handler's context only. A worker started by the
leader's startup passes (before any Kopf handler ran) had no queue in its context: every
``kopf.warn`` raised ``LookupError`` and the Event was lost for good (the status, written just
before, no longer differed). :mod:`tokenfair_operator.events` remembers the queue from the first
handler and sets it in the posting task's context."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import kopf
import pytest
from kopf._core.engines import posting

from tokenfair_operator import events

BODY = kopf.Body(
    {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TenantQuota",
        "metadata": {"name": "chat-copy", "namespace": "ns", "uid": "u-1"},
    }
)


async def test_a_worker_started_before_any_handler_posts_its_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(events, "_queue", None)
    posting.settings_var.set(kopf.OperatorSettings())  # as `kopf run` sets it for every task
    queue: asyncio.Queue[Any] = asyncio.Queue()
    # The worker's context is taken now, before any handler ran: no Event queue in it.
    worker_context = contextvars.copy_context()

    async def kopf_handler() -> None:  # as Kopf runs an object's handler: the queue is set
        posting.event_queue_var.set(queue)
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        events.remember_queue()

    async def worker() -> None:
        events.warn(BODY, reason="DuplicateTenantId", message="already used")

    await asyncio.create_task(kopf_handler())
    await asyncio.create_task(worker(), context=worker_context)
    posted = queue.get_nowait()
    assert (posted.type, posted.reason, posted.message) == (
        "Warning",
        "DuplicateTenantId",
        "already used",
    )
    assert posted.ref["name"] == "chat-copy"


async def test_before_any_handler_the_warning_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(events, "_queue", None)
    posting.settings_var.set(kopf.OperatorSettings())

    async def worker() -> None:
        events.warn(BODY, reason="KeySecretNotFound", message="no Secret")

    await asyncio.create_task(worker(), context=contextvars.Context())
    assert "Warning Event KeySecretNotFound on chat-copy not posted" in caplog.text
