"""From a watch event to one policy's pass: which events call for a pass (:func:`news`), the
passes they ask for, run in the background (:class:`EventPasses`), and the pass itself on the
leader, retried when it loses a race (:func:`run_pass`).

**Why in the background.** Kopf handles each object's events one after another, in a worker of
its own, and indexes an event only when the handler of the one before it has returned. A
handler that awaited its policy's pass (seconds at 10,000 quotas) held its object's later
events, index updates included, for that long: after the initial listing 10,000 handlers
waited on one pass, the policy's own index entry stayed at its listed version, and every
status write of the pass and its retries lost to the policy's newer version (409s, then a
failed handler). A handler now asks for a pass and returns (:meth:`EventPasses.ask`): the pass
runs in a task of its policy; asked for again while it runs, one more pass follows it, which
reads the indexes when it starts and so serves every event of the meantime.

**Spacing.** That next pass starts no sooner than the last one took after it ended (at most
:data:`MAX_SPACING_S`): while 10,000 quotas arrive in a bulk apply, one policy's passes (each
O(n): render, document, statuses) take at most about half of the event loop, leaving the rest
to Kopf's processing of the events and to the API server, instead of starting again the moment
they end. A pass asked for after a quiet spell starts at once: one change is published as fast
as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import kopf

from . import runtime
from .kube import NotLeader, is_conflict
from .reconcile import PolicyKey, Snapshot
from .views import QuotaView

CONFLICT_RETRIES: Final = 3
"""Passes tried when one loses a race (409 Conflict: another writer, e.g. a leader stepping
down, changed an object since we read it), 1 s apart; then the resync repairs."""
MAX_SPACING_S: Final = 5.0
"""Longest wait between two passes of one policy asked for by events (see the module
docstring): a first pass over 10,000 brand-new keyed quotas takes ~3-5 s here, a later one
under 1 s."""
PASSES: Final = "event_passes"
"""The memo's key of the one :class:`EventPasses` (created by the startup hook, shared by every
object's copy of the memo, as :mod:`.runtime` explains)."""


def news(memo: kopf.Memo, event_type: str | None, body: kopf.Body) -> bool:
    """True for an event a pass must follow: the object is new to us (``event_type`` None is the
    initial listing), deleted, being deleted, or at a generation not seen yet. Recorded on
    every replica, leader or not, so a standby that takes over starts from the same place
    (and runs a full pass anyway). ``memo`` is the object's copy of the operator's memo; the
    record is the one dict the startup hook put there (:func:`.runtime.generations`), so the
    resync round sees what every object's events recorded."""
    seen = runtime.generations(memo)
    meta = body.get("metadata", {})
    uid = str(meta.get("uid", ""))
    if event_type == "DELETED":
        seen.pop(uid, None)
        return True
    state = (int(meta.get("generation", 0)), bool(meta.get("deletionTimestamp")))
    if seen.get(uid) == state:
        return False
    seen[uid] = state
    return True


async def run_pass(
    key: PolicyKey,
    memo: kopf.Memo,
    logger: kopf.Logger,
    snapshot: Callable[[], Snapshot] | None = None,
) -> None:
    """Reconcile policy ``key`` (coalesced with the triggers queued behind a running pass,
    :meth:`.Reconciler.request`). The indexes are live: the pass reads them when it starts, not
    when the trigger came. ``snapshot`` reads the world elsewhere (the startup view's passes,
    :func:`.startup.pass_listed`)."""
    indexes = runtime.indexes(memo)
    if not runtime.leads(memo):  # the leader reconciles; a standby keeps its indexes warm
        return
    world = snapshot or (lambda: indexes.snapshot(key))
    for attempt in range(1, CONFLICT_RETRIES + 1):
        try:
            await runtime.reconciler(memo).request(key, world, logger)
            return
        except NotLeader as exc:  # stepped down during the pass: the new leader redoes it
            logger.info(f"pass of {key[0]}/{key[1]} stopped: {exc}")
            return
        except Exception as exc:
            if not is_conflict(exc) or attempt == CONFLICT_RETRIES:
                raise
            logger.info(f"pass of {key[0]}/{key[1]}: conflict, retrying in 1 s")
            await asyncio.sleep(1)


def prefetch_while_listing(memo: kopf.Memo, quotas: Iterable[QuotaView]) -> None:
    """Quotas just indexed: while Kopf's initial listing goes on, on the leader, their key
    Secrets are read in the background for the first pass (:mod:`.prefetch`), unless the
    startup view covers the listing (:mod:`.startview`: it asks for its own pages' keys)."""
    if runtime.listing(memo).is_complete or not runtime.leads(memo):
        return
    view = runtime.startup_view(memo)
    if view is not None and view.covers:
        return
    runtime.reconciler(memo).prefetch_keys(quotas)


def sidecars_moved(key: PolicyKey, memo: kopf.Memo) -> bool:
    """Whether policy ``key``'s count of Ready selected sidecars changed, or which of its
    labelled Pods run without the sidecar: either calls for a pass."""
    reconciler = runtime.reconciler(memo)
    indexes = runtime.indexes(memo)
    ready = reconciler.replicas_changed(key, indexes.ready_sidecars(key))
    return ready or reconciler.unprotected_changed(key, indexes.sidecars.get(key, ()))


@dataclass
class EventPasses:
    """Passes asked for by watch events, run in the background: at most one task per policy,
    which passes again while it is asked to (see the module docstring). Failures are logged;
    the resync repairs them."""

    memo: kopf.Memo
    _running: dict[PolicyKey, asyncio.Task[None]] = field(default_factory=dict)
    _again: set[PolicyKey] = field(default_factory=set)

    def ask(self, key: PolicyKey, logger: kopf.Logger) -> None:
        """A pass of ``key`` that reads the indexes after this call: the running one's next,
        or a new task's."""
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.create_task(
            self._passes(key, logger), name=f"tokenfair-pass-{key[0]}/{key[1]}"
        )

    async def _passes(self, key: PolicyKey, logger: kopf.Logger) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._again.discard(key)
                started = loop.time()
                try:
                    await run_pass(key, self.memo, logger)
                except Exception:
                    logger.exception(f"pass of {key[0]}/{key[1]} failed; the resync retries")
                if key not in self._again:
                    return  # no await from here to the finally: an ask() now starts a task
                await asyncio.sleep(min(loop.time() - started, MAX_SPACING_S))
        finally:
            self._running.pop(key, None)
            # The start-up passes are over: the collector back to its usual work (.gcwindow).
            runtime.close_gc_window_if_settled(self.memo, bool(self._running))

    @property
    def busy(self) -> bool:
        """A pass asked for by an event runs or waits for its turn."""
        return bool(self._running)

    async def drain(self) -> None:
        """Return once no pass is running or asked for (tests)."""
        while self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def close(self) -> None:
        """Cancel every pass (the cleanup hook); idempotent."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()
        self._again.clear()


def event_passes(memo: kopf.Memo) -> EventPasses:
    """The shared :class:`EventPasses` (:data:`PASSES`, :func:`.runtime.shared`)."""
    return runtime.shared(memo, PASSES, EventPasses)
