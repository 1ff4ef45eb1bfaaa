"""The serving-TLS loop's round, every ``resync_interval_s`` on every replica with a TLS port:
a standby takes the leader's certificate from the Secret (:meth:`.CertKeeper.follow`: its webhook
and its TLS port serve the current one within a round, not an hour); every replica reloads the
TLS port's files if they changed; the leader writes the CA bundle into each policy namespace's
ConfigMap (:mod:`.serving_tls`), checking every namespace again once it newly leads."""

from __future__ import annotations

import asyncio

import kopf

from . import runtime
from .indexes import Indexes
from .periodic import PeriodicRound
from .serving_tls import ServingTLS, TrustPublisher
from .views import PolicyView
from .webhook_certs import CertKeeper


def serving_tls_round(
    memo: kopf.Memo,
    logger: kopf.Logger,
    indexes: Indexes,
    tls: ServingTLS,
    publisher: TrustPublisher,
) -> PeriodicRound:
    """One round, for :class:`.Periodic` (and run once at startup, before the first resync)."""
    led = False

    async def tls_round() -> None:
        nonlocal led
        leads = runtime.leads(memo)
        keeper = memo.get(runtime.KEEPER)
        if isinstance(keeper, CertKeeper) and not leads:
            await asyncio.to_thread(keeper.follow)
        if await asyncio.to_thread(tls.reload):
            logger.info("document server: new certificate or CA bundle loaded")
        if leads and not led:
            publisher.forget()
        led = leads
        if not leads:
            return
        by_namespace: dict[str, list[PolicyView]] = {}
        for (namespace, _), views in list(indexes.policies.items()):
            by_namespace.setdefault(namespace, []).extend(v for v in views if not v.deleting)
        written = await asyncio.to_thread(
            publisher.publish, tls.ca_pem, by_namespace, lambda: runtime.leads(memo)
        )
        if written:
            logger.info(f"CA bundle published to namespaces {', '.join(written)}")

    return tls_round
