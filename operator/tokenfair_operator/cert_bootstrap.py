"""The operator's own webhook certificate, without cert-manager: issued (or taken from its
Secret) at startup, the webhook configurations' caBundle set, and a loop that checks it for
renewal (:mod:`.webhook_certs`). Only the leader issues and rotates; a standby serves what the
leader keeps in the Secret."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from pathlib import Path
from typing import Any, Final

import kopf

from . import runtime
from .certs import Reached, trust_settle
from .kube import NotLeader
from .periodic import Periodic
from .serving_tls import TrustPublisher
from .settings import OperatorConfig
from .webhook_certs import CertKeeper

CERT_WAIT_S: Final = 2.0
"""A standby starting before the leader issued the certificate looks again this often."""


async def own_certificates(
    api: Any, memo: kopf.Memo, periodic: Periodic, logger: kopf.Logger, config: OperatorConfig
) -> OperatorConfig:
    """Issue (or take from the Secret) our own CA and serving certificate, set the webhook
    configurations' caBundle, and start the renewal loop (every ``cert_check_interval_s``).
    Returns ``config`` pointing Kopf's server at the files. A standby waits here until the
    leader has issued them (or until it leads itself)."""
    assert config.webhook_cert_secret is not None
    keeper = CertKeeper(
        api,
        config.webhook_cert_secret,
        config.webhook_dns_names,
        config.webhook_configurations,
        Path(config.webhook_cert_dir),
        may_write=lambda: runtime.leads(memo),  # asked before each of its writes
        # A next CA is published this long before its leaf is served (.certs: two phases),
        # counted from when every policy namespace's ConfigMap holds it, when they hold ours.
        settle=trust_settle(datetime.timedelta(seconds=config.resync_interval_s)),
        reached=trust_reached(memo)
        if config.https_port is not None and not config.https_ca
        else None,
    )
    memo[runtime.KEEPER] = keeper

    async def renew() -> None:
        if not runtime.leads(memo):
            await asyncio.to_thread(keeper.follow)
            return
        try:
            reason = await asyncio.to_thread(keeper.ensure)
        except NotLeader as exc:  # stepped down during the round: the new leader keeps them
            logger.info(f"webhook certificate round stopped: {exc}")
            await asyncio.to_thread(keeper.follow)
            return
        if reason is not None:
            logger.info(f"webhook certificate: {reason}")

    await renew()
    while not keeper.files.cert.exists():  # a standby before the leader's first issue
        await asyncio.sleep(CERT_WAIT_S)
        await renew()
    periodic.start("tokenfair-certs", config.cert_check_interval_s, renew, logger)
    files = keeper.files
    return dataclasses.replace(
        config, webhook_cert=str(files.cert), webhook_key=str(files.key), webhook_ca=str(files.ca)
    )


def trust_reached(memo: kopf.Memo) -> Reached:
    """Since when the policies' ConfigMaps hold a CA, as this replica's publisher saw them
    (:meth:`.TrustPublisher.holding_since`); None before it ran as the leader."""

    def reached(ca_pem: bytes) -> datetime.datetime | None:
        publisher = memo.get(runtime.TRUST)
        return publisher.holding_since(ca_pem) if isinstance(publisher, TrustPublisher) else None

    return reached
