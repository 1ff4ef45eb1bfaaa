"""The resync loop's round: every ``resync_interval_s`` a pass of each policy that exists or
is named by a quota, then its key Secrets read again and a second pass if one changed. It picks
up what no watch reports (a key Secret's content) and repairs anything a failed pass left
behind (a quota of a vanished policy included). It also forgets the generations recorded of
objects gone from the indexes (:func:`prune_generations`). Nothing before Kopf's initial
listing is over (:mod:`.listing`): a pass over a half-filled index would publish a document
without the tenants not listed yet (a new leader elected while its replica still lists, or the
loop's first round during a long listing)."""

from __future__ import annotations

import kopf

from . import runtime
from .indexes import Indexes, PolicyIndex, QuotaIndex
from .kube import is_conflict
from .passes import run_pass
from .periodic import PeriodicRound


def resync_round(memo: kopf.Memo, logger: kopf.Logger, indexes: Indexes) -> PeriodicRound:
    """One resync round, for :class:`.Periodic` (and run at once by a new leader). One policy
    failing skips only itself."""

    async def resync() -> None:
        if not runtime.listing(memo).is_complete:
            # Kopf is still listing: the indexes hold part of the objects, and a pass would
            # publish a document without the rest. The handlers pass once it is over.
            logger.debug("resync skipped: the initial listing is not over")
            return
        prune_generations(memo, indexes.policies, indexes.quotas)
        if not runtime.leads(memo):
            return
        for key in sorted({*indexes.policies, *indexes.quotas}):
            try:
                # The pass first, from the key cache (a new leader's seeded from the stored
                # document: it serves at once); then every key Secret is read again, and a
                # change is published by a second pass in the same round.
                await run_pass(key, memo, logger)
                if await runtime.reconciler(memo).refresh_keys(indexes.quotas.get(key, ())):
                    await run_pass(key, memo, logger)
            except Exception as exc:
                if is_conflict(exc):
                    logger.info(f"resync of {key[0]}/{key[1]}: conflict, retried next round")
                else:
                    logger.exception(f"resync of {key[0]}/{key[1]} failed, retried next round")
        # Every policy passed since the listing: what was read for it and no pass took (its
        # quota went meanwhile) is dropped (.prefetch).
        runtime.reconciler(memo).prefetch.drop_unclaimed()

    return resync


def prune_generations(memo: kopf.Memo, policies: PolicyIndex, quotas: QuotaIndex) -> None:
    """Forget the generations :func:`.passes.news` recorded of objects no index holds any more
    (on every replica): a deletion whose DELETED event never came (one missed while a watch was
    re-established) leaves nothing behind. Kopf updates an index before it calls the event's
    handlers, so a live object's entry is never dropped (if it were, its next event would
    only cost one more pass)."""
    seen = runtime.generations(memo)
    if not seen:
        return
    live = {view.uid for index in (policies, quotas) for key in index for view in index[key]}
    for uid in [uid for uid in seen if uid not in live]:
        del seen[uid]
