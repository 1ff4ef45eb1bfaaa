"""Warning Events posted from any task of the operator, not only from Kopf's handlers.

Kopf's ``kopf.warn`` finds its Event queue in context variables that Kopf sets in each object's
handler task only. The status writer's workers are long-lived tasks started by whichever pass
first queues a write; since the leader's own startup listing (:mod:`.startview`) passes before
any Kopf handler runs, they could start in a context without that queue, and then every Warning
Event they posted raised ``LookupError`` (lost for good: the status, written just before, no
longer differs). So the queue is remembered from the first Kopf handler that runs
(:func:`remember_queue`, called at the top of the index and event handlers) and set in the
posting task's own context when missing (:func:`warn`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf
from kopf._core.engines import posting

log = logging.getLogger("tokenfair.operator")

_queue: tuple[Any, asyncio.AbstractEventLoop] | None = None
"""Kopf's Event queue and its loop, as a Kopf handler saw them (None until one ran)."""


def remember_queue() -> None:
    """Keep Kopf's Event queue from the handler context this runs in (once; cheap after)."""
    global _queue
    if _queue is not None:
        return
    with contextlib.suppress(LookupError):  # not in a Kopf handler's context: nothing to learn
        _queue = (posting.event_queue_var.get(), posting.event_queue_loop_var.get())


def warn(body: kopf.Body, *, reason: str, message: str) -> None:
    """``kopf.warn`` from any task: the remembered queue is set in this task's context when
    Kopf's is missing. Before any Kopf handler has run there is no queue to post to: logged,
    not raised (the status, already written, carries the same reason and message)."""
    try:
        posting.event_queue_loop_var.get()
    except LookupError:
        if _queue is None:
            log.warning("Warning Event %s on %s not posted: Kopf's Event queue is not known yet",
                        reason, body.get("metadata", {}).get("name"))  # fmt: skip
            return
        posting.event_queue_var.set(_queue[0])
        posting.event_queue_loop_var.set(_queue[1])
    kopf.warn(body, reason=reason, message=message)
