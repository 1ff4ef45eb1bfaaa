"""The usage loop's round: every ``usage_interval_s`` the leader scrapes each policy's Ready
sidecars (those its selector matches) and writes their tenants' live usage into the
TenantQuotas' ``status.usage`` (:mod:`.usage`) and, into the policy's ``status.sidecars``, how
many of them run the published config version (:mod:`.rollout`; also for a policy with no Ready
sidecar: ``0/0``)."""

from __future__ import annotations

import kopf

from . import runtime
from .indexes import Indexes
from .kube import NotLeader
from .periodic import PeriodicRound
from .scrape import scrape_metrics
from .selector import selected_sidecars


def usage_round(
    memo: kopf.Memo, logger: kopf.Logger, indexes: Indexes, scrape_timeout_s: float
) -> PeriodicRound:
    """One usage round, for :class:`.Periodic`; a scrape waits ``scrape_timeout_s`` at most."""

    async def scrape() -> None:
        if not runtime.leads(memo) or not runtime.listing(memo).is_complete:
            return  # (a rollout written while Kopf lists would only race the first pass)
        policies, sidecars, quotas = indexes.policies, indexes.sidecars, indexes.quotas
        for key in sorted({*sidecars, *policies}):
            live = [p for p in policies.get(key, ()) if not p.deleting]
            selected = selected_sidecars(policies.get(key, ()), sidecars.get(key, ()))
            addresses = [s.address for s in selected if s.ready and s.address]
            scrapes = await scrape_metrics(addresses, scrape_timeout_s) if addresses else []
            try:
                reconciler = runtime.reconciler(memo)
                if scrapes and key in quotas:
                    await reconciler.write_usage(quotas.get(key, ()), scrapes)
                if live:
                    await reconciler.write_rollout(key, live[0], len(addresses), scrapes)
            except NotLeader:
                return  # stepped down during the round
            except Exception:  # best effort: one policy's failed write skips only itself
                logger.exception(f"usage of {key[0]}/{key[1]} not written, retried next round")

    return scrape
