"""From a watch event to one policy's pass: which events call for a pass (:func:`news`), and
the pass itself on the leader, retried when it loses a race (:func:`run_pass`)."""

from __future__ import annotations

import asyncio
from typing import Final

import kopf

from . import runtime
from .kube import NotLeader, is_conflict
from .reconcile import PolicyKey

CONFLICT_RETRIES: Final = 3
"""Passes tried when one loses a race (409 Conflict: another writer, e.g. a leader stepping
down, changed an object since we read it), 1 s apart; then the resync repairs."""


def news(memo: kopf.Memo, type: str | None, body: kopf.Body) -> bool:
    """True for an event a pass must follow: the object is new to us (``type`` None is the
    initial listing), deleted, being deleted, or at a generation not seen yet. Recorded on
    every replica, leader or not, so a standby that takes over starts from the same place
    (and runs a full pass anyway). ``memo`` is the object's copy of the operator's memo; the
    record is the one dict the startup hook put there (:func:`.runtime.generations`), so the
    resync round sees what every object's events recorded."""
    seen = runtime.generations(memo)
    meta = body.get("metadata", {})
    uid = str(meta.get("uid", ""))
    if type == "DELETED":
        seen.pop(uid, None)
        return True
    state = (int(meta.get("generation", 0)), bool(meta.get("deletionTimestamp")))
    if seen.get(uid) == state:
        return False
    seen[uid] = state
    return True


async def run_pass(key: PolicyKey, memo: kopf.Memo, logger: kopf.Logger) -> None:
    """Reconcile policy ``key`` (coalesced with the triggers queued behind a running pass,
    :meth:`.Reconciler.request`). The indexes are live: the pass reads them when it starts, not
    when the trigger came."""
    indexes = runtime.indexes(memo)
    if not runtime.leads(memo):  # the leader reconciles; a standby keeps its indexes warm
        return
    for attempt in range(1, CONFLICT_RETRIES + 1):
        try:
            await runtime.reconciler(memo).request(key, lambda: indexes.snapshot(key), logger)
            return
        except NotLeader as exc:  # stepped down during the pass: the new leader redoes it
            logger.info(f"pass of {key[0]}/{key[1]} stopped: {exc}")
            return
        except Exception as exc:
            if not is_conflict(exc) or attempt == CONFLICT_RETRIES:
                raise
            logger.info(f"pass of {key[0]}/{key[1]}: conflict, retrying in 1 s")
            await asyncio.sleep(1)


def sidecars_moved(key: PolicyKey, memo: kopf.Memo) -> bool:
    """Whether policy ``key``'s count of Ready selected sidecars changed, or which of its
    labelled Pods run without the sidecar: either calls for a pass."""
    reconciler = runtime.reconciler(memo)
    indexes = runtime.indexes(memo)
    ready = reconciler.replicas_changed(key, indexes.ready_sidecars(key))
    return ready or reconciler.unprotected_changed(key, indexes.sidecars.get(key, ()))
