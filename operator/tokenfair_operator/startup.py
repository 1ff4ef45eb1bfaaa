"""What the startup hook starts and the cleanup hook stops, in order.

Starting: the reconciler; with leader election, the elector (:mod:`.leader`), whose first round
ends before anything that writes; with a webhook or TLS port and
``$TOKENFAIR_WEBHOOK_CERT_SECRET``, the operator's own certificate (:mod:`.cert_bootstrap`);
Kopf's settings (:func:`.settings.configure_kopf`); with ``$TOKENFAIR_HTTP_PORT`` or
``$TOKENFAIR_HTTPS_PORT``, the HTTP server (:mod:`.serve`) and, over TLS, the serving-TLS loop
(:mod:`.tls_loop`); then the resync (:mod:`.resync`) and usage (:mod:`.usage_loop`) loops, one
each for the whole operator (:mod:`.periodic`); last, on the leader, the operator's own listing of
the policies, quotas and sidecar Pods (:mod:`.startview`), whose first pages are read before the
hook returns (before Kopf lists anything) and whose passes publish before Kopf's listing is over.

Everything lands in Kopf's memo (:mod:`.runtime`): ``memo[runtime.CONFIG]`` holds the settings
as the startup hook read them from the environment, once per process (so a retried hook keeps
its Lease identity), not the copy :func:`.cert_bootstrap.own_certificates` returns with the
own certificate's file paths (only Kopf's webhook server and the TLS port get that one);
``memo[runtime.GENERATIONS]`` the one generations record every object's copy of the memo
shares, ``memo[runtime.LISTING]`` likewise the one record of whether Kopf's initial listing is
over (:mod:`.listing`: no resync pass before), and ``memo[passes.PASSES]`` the passes the
event handlers ask for, run in the background (:class:`.passes.EventPasses`).

A start that fails part way (an API error, a port already bound) stops what it had started
before the error goes to Kopf, which runs the hook again a minute later: no elector, loop or
server of a failed attempt keeps running next to the retry's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from . import runtime
from .cert_bootstrap import own_certificates
from .gcwindow import StartupCollection
from .indexes import Indexes
from .kube import KubeApi, NotLeader, api_client
from .leader import LeaderElector
from .listing import Listing, yield_while
from .passes import PASSES, EventPasses, run_pass
from .periodic import Periodic
from .reconcile import PolicyKey, Reconciler, Snapshot
from .resync import resync_round
from .serve import TokenAuthenticator, audience_reviewer, create_app, start_server
from .serving_tls import ServingTLS, TrustPublisher
from .settings import OperatorConfig, configure_kopf
from .startview import PAGE, StartupView, World, watched_scope
from .tls_loop import serving_tls_round
from .usage_loop import usage_round


async def start(
    config: OperatorConfig,
    indexes: Indexes,
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    logger: kopf.Logger,
) -> None:
    """Start the operator's own parts (the module's docstring lists them), given its settings
    and the indexes Kopf passed to the startup hook (empty, filled in place later). On any
    error, whatever had started is stopped (:func:`stop`) and the error raised again."""
    try:
        await _start(config, indexes, settings, memo, logger)
    except BaseException:
        await stop(memo)
        raise


async def _start(
    config: OperatorConfig,
    indexes: Indexes,
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    logger: kopf.Logger,
) -> None:
    # Full collections freeze their survivors until the listing and its passes are over (the
    # heap grows by every listed object meanwhile, .gcwindow); closed by stop() at the latest.
    window = memo.get(runtime.GC_WINDOW)
    if not isinstance(window, StartupCollection):
        window = memo[runtime.GC_WINDOW] = StartupCollection()
    window.open()
    api = api_client()
    memo[runtime.CONFIG] = config
    memo[runtime.INDEXES] = indexes
    # Created here, in the operator's memo: each object's handlers get a shallow copy of it.
    memo[runtime.GENERATIONS] = {}
    memo[runtime.LISTING] = Listing()  # complete once Kopf calls a handler (.listing)
    memo[PASSES] = EventPasses(memo)  # the passes the handlers ask for (.passes)
    memo[runtime.PERIODIC] = periodic = Periodic()  # in the memo at once: stop() finds its loops
    # Every write asks, right before it is sent, whether this replica leads now (.leader).
    memo[runtime.RECONCILER] = Reconciler(KubeApi(api, may_write=lambda: runtime.leads(memo)))
    if config.leader_election:
        await _elect(api, memo, logger, indexes, config)
    serves_tls = config.webhook_port is not None or config.https_port is not None
    if serves_tls and config.webhook_cert_secret is not None:
        config = await own_certificates(api, memo, periodic, logger, config)
    configure_kopf(settings, config)
    if config.http_port is not None or config.https_port is not None:
        await _serve(api, memo, config, periodic, logger, indexes)
    resync = resync_round(memo, logger, indexes)
    periodic.start("tokenfair-resync", config.resync_interval_s, resync, logger)
    usage = usage_round(memo, logger, indexes, config.scrape_timeout_s)
    periodic.start("tokenfair-usage", config.usage_interval_s, usage, logger)
    await list_ourselves(memo, settings, logger)


async def list_ourselves(
    memo: kopf.Memo, settings: kopf.OperatorSettings, logger: kopf.Logger, page: int = PAGE
) -> None:
    """On the leader, the operator's own listing (:mod:`.startview`, ``page`` objects a LIST
    page): its first pages read here, before Kopf lists anything; the rest and the passes over
    it in the background."""
    if not runtime.leads(memo) or isinstance(memo.get(runtime.START_VIEW), StartupView):
        return  # a standby: Kopf's indexes; a retried hook: the view of the first attempt
    try:
        scope = watched_scope(settings.peering.clusterwide)
    except LookupError as exc:
        logger.info(f"no startup listing ({exc}): the first pass waits for Kopf's listing")
        return
    reconciler = runtime.reconciler(memo)

    def over() -> None:  # the view stopped running: the GC window may close (.gcwindow)
        passes = memo.get(PASSES)
        runtime.close_gc_window_if_settled(memo, isinstance(passes, EventPasses) and passes.busy)

    view = memo[runtime.START_VIEW] = StartupView(
        reconciler.api,
        scope,
        page,
        term=reconciler.term,
        on_quotas=reconciler.prefetch_keys,
        on_over=over,
    )
    if await view.begin():
        yield_while(lambda: view.running)  # Kopf's listing leaves the view's threads time
        view.start(lambda world: pass_listed(world, memo, logger, view.term))


async def pass_listed(world: World, memo: kopf.Memo, logger: kopf.Logger, term: int) -> None:
    """One pass of each policy of the startup listing's ``world`` (:mod:`.startview`), listed in
    leadership ``term`` (:attr:`.Reconciler.term`), reading that world while Kopf's listing is
    not over and Kopf's indexes once it is (decided as each pass starts). Nothing when Kopf's
    listing was over first (its handlers' passes serve), and no pass over ``world`` once this
    replica stepped down since ``term``, even if it leads again: a world listed in an earlier
    term may be older than the documents another leader published meanwhile."""
    listing = runtime.listing(memo)
    indexes = runtime.indexes(memo)
    reconciler = runtime.reconciler(memo)
    for key in world.policy_keys():
        if listing.is_complete or reconciler.term != term:
            break

        def snapshot(key: PolicyKey = key) -> Snapshot:
            if listing.is_complete:
                return indexes.snapshot(key)
            if reconciler.term != term:
                raise NotLeader(f"stepped down since the startup listing (term {term})")
            return world.snapshot(key)

        try:
            await run_pass(key, memo, logger, snapshot)
        except Exception:
            logger.exception(f"startup pass of {key[0]}/{key[1]} failed; the resync retries")


async def stop(memo: kopf.Memo) -> None:
    """Stop what :func:`start` started (whatever of it did start); idempotent. The loops and
    the server leave the memo; a stopped elector stays there, telling every writer that this
    replica does not lead (:func:`.runtime.leads`), until a retried start replaces it."""
    view = memo.get(runtime.START_VIEW)
    if isinstance(view, StartupView):
        await view.stop()  # the startup listing and its passes
    passes = memo.get(PASSES)
    if isinstance(passes, EventPasses):
        await passes.close()  # the passes events asked for: the next leader's pass redoes them
    periodic = memo.pop(runtime.PERIODIC, None)
    if isinstance(periodic, Periodic):
        await periodic.stop()
    elector = memo.get(runtime.ELECTOR)
    if isinstance(elector, LeaderElector):
        await elector.stop()  # releases the Lease: the standby leads at its next attempt
    server = memo.pop(runtime.SERVER, None)
    if isinstance(server, web.AppRunner):
        await server.cleanup()
    reconciler = memo.get(runtime.RECONCILER)
    if isinstance(reconciler, Reconciler):
        await reconciler.close()  # queued status writes: the next leader's pass writes them
    window = memo.get(runtime.GC_WINDOW)
    if isinstance(window, StartupCollection):
        window.close("stopping")


async def _elect(
    api: Any, memo: kopf.Memo, logger: kopf.Logger, indexes: Indexes, config: OperatorConfig
) -> None:
    """Leader election (:mod:`.leader`). On becoming the leader: a full pass of every policy
    at once (a standby only watched), so a failover costs the lease expiry plus one pass. On
    stepping down: the documents held, the queued status writes and the key cache are forgotten
    (:meth:`.Reconciler.step_down`) and the startup view abandoned (:meth:`.StartupView.abandon`),
    so a replica elected again serves none from its previous term (only what its first pass
    publishes, :mod:`.documents`)."""
    resync = resync_round(memo, logger, indexes)

    async def on_lead() -> None:
        try:
            await resync()
        except Exception:
            logger.exception("first pass as the leader failed; the resync retries")

    def on_lose() -> None:
        runtime.reconciler(memo).step_down()
        view = runtime.startup_view(memo)
        if view is not None:
            view.abandon()  # listed in this term: not published in a later one (.startview)

    elector = LeaderElector(
        api,
        config.lease_namespace,
        config.lease_name,
        config.identity,
        on_lead=on_lead,
        on_lose=on_lose,
        advertise=config.http_advertise,
    )
    memo[runtime.ELECTOR] = elector
    elector.start()
    await elector.first_round()  # the certificates' keeper needs to know who leads


async def _serve(
    api: Any,
    memo: kopf.Memo,
    config: OperatorConfig,
    periodic: Periodic,
    logger: kopf.Logger,
    indexes: Indexes,
) -> None:
    """The HTTP server (:mod:`.serve`): plain on ``http_port``, TLS on ``https_port`` with the
    operator's serving certificate (``$TOKENFAIR_HTTPS_CERT``/``_KEY``/``_CA``, else the
    webhook's); TokenReviews for the sidecars' audience only."""
    reconciler = runtime.reconciler(memo)
    auth = TokenAuthenticator(audience_reviewer(api, config.config_audience))
    elector = memo.get(runtime.ELECTOR)
    leader = elector.leader_address if isinstance(elector, LeaderElector) else _no_leader
    tls = _serving_tls(config)
    app = create_app(
        reconciler.documents,
        reconciler.metrics,
        auth,
        leader,
        config.relay_connections,
        plain_config=config.config_insecure_http,
        tls=tls,
    )
    context = tls.server if tls is not None else None
    memo[runtime.SERVER] = await start_server(
        app, config.http_addr, config.http_port, config.https_port, context
    )
    if tls is not None:
        memo[runtime.TRUST] = publisher = TrustPublisher(api)  # the rotation asks it
        tls_round = serving_tls_round(memo, logger, indexes, tls, publisher)
        try:
            await tls_round()  # the CA out to the policies' namespaces before the first resync
        except Exception:
            logger.exception("publishing the CA bundle failed; retried next round")
        periodic.start("tokenfair-serving-tls", config.resync_interval_s, tls_round, logger)


def _serving_tls(config: OperatorConfig) -> ServingTLS | None:
    """The TLS port's certificate files: given, else the webhook's; None without a TLS port.
    A TLS port without a certificate stops the operator at startup, naming the variables."""
    if config.https_port is None:
        return None
    cert = config.https_cert or config.webhook_cert
    key = config.https_key or config.webhook_key or cert
    ca = config.https_ca or config.webhook_ca
    if not (cert and key and ca):
        raise kopf.PermanentError(
            "$TOKENFAIR_HTTPS_PORT needs a certificate: $TOKENFAIR_WEBHOOK_CERT_SECRET (the "
            "operator's own), or $TOKENFAIR_HTTPS_CERT, _KEY and _CA (PEM files)"
        )
    return ServingTLS(Path(cert), Path(key), Path(ca))


def _no_leader() -> None:
    """One replica (no election): this one serves its own documents."""
