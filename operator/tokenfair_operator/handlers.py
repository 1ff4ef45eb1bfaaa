"""Kopf handlers: thin, typed, keyword-only; all the work is in :mod:`.reconcile`.

Run with ``kopf run -m tokenfair_operator.handlers [--namespace NS | --all-namespaces]``.

Triggers, each reconciling one whole policy (see :mod:`.reconcile`), all Kopf *event*
handlers: Kopf keeps no per-object state (no diff-base or progress annotations, no finalizer),
so several replicas can watch the same objects, and the reconciler is level-based anyway:

* a TenantQuota listed, created, at a new generation (its spec changed) or deleted -> its
  policy; our own status writes bring no new generation and trigger nothing;
* a SchedulingPolicy likewise -> itself (a deleted one marks its quotas ``PolicyNotFound``);
* a sidecar Pod (labelled ``tokenfair.io/policy``) changing the policy's count of Ready
  sidecars, or which labelled Pods run without the sidecar -> that policy (budgets are divided
  across them, :mod:`.budgets`; only the Pods the policy's ``spec.selector`` matches count,
  :mod:`.selector`);
* every ``resync_interval_s``, one operator-level loop (:mod:`.periodic`) -> every policy that
  exists or is named by a quota, then re-reading its key Secrets and passing again if one
  changed: picks up what no watch reports (a key Secret's content) and repairs anything a
  failed pass left behind;
* every ``usage_interval_s``, a second loop: each policy's Ready sidecars' metrics -> its
  TenantQuotas' ``status.usage`` (:mod:`.usage`) and its own ``status.sidecars``, how many
  run the published version (:mod:`.rollout`).

A pass that loses a race (409) is tried again, 1 s apart, :data:`CONFLICT_RETRIES` times.

With ``$TOKENFAIR_LEADER_ELECTION=true`` (two or more replicas) only the Lease's holder
(:mod:`.leader`) reconciles, runs the loops and issues or rotates the webhook certificate; every
replica watches, indexes, answers admission webhooks and serves its HTTP routes. A new leader
runs a full pass at once.

No handler makes Kopf add a finalizer: deleting an object never waits for the operator, so
``helm uninstall``, which removes the operator and its RBAC at once, leaves nothing stuck.

With ``$TOKENFAIR_WEBHOOK_CERT_SECRET`` the startup hook also issues (or reuses) the operator's
own webhook certificate and a third loop renews it (:mod:`.webhook_certs`). With
``$TOKENFAIR_HTTP_PORT`` it starts the HTTP server (:mod:`.serve`), ``/metrics``; with
``$TOKENFAIR_HTTPS_PORT`` the same over TLS, where the sidecars long-poll their policy's
document, with the operator's own serving certificate (the webhook's) and a loop that reloads
it when it changes and, on the leader, publishes its CA to the policies' namespaces
(:mod:`.serving_tls`).

Admission (when a webhook server is configured, see :mod:`.settings`): creating a TenantQuota or
changing its spec is checked by :func:`.admission.quota_refusal`; a SchedulingPolicy's spec by
the sidecar's ``parse_policy`` and its ``selector`` by :func:`.selector.parse_selector`.
Metadata-only updates (Kopf's own annotations) pass unchecked.

Three Kopf indexes hold the snapshots the reconciler reads: quotas by (namespace, policyName),
policies by (namespace, name), and sidecar Pods' readiness, address and labels by (namespace,
policy label); the policy's selector is applied when they are read, so a changed selector needs
no re-indexing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import kopf
from aiohttp import web

from tokenfair.config import ConfigError, parse_policy

from .admission import quota_refusal
from .certs import Reached, trust_settle
from .inject import (
    ADMIN_PORT,
    ADMIN_PORT_ANNOTATION,
    CONTAINER,
    POLICY_LABEL,
    InjectionError,
    injected,
    scrape_annotations,
    store_password_key,
)
from .kube import KubeApi, NotLeader, api_client, is_conflict
from .leader import LeaderElector
from .model import GROUP, POLICY_PLURAL, QUOTA_PLURAL, VERSION, PolicyView, QuotaView, SidecarView
from .periodic import Job, Periodic
from .reconcile import PolicyKey, Reconciler, Snapshot
from .scrape import scrape_metrics
from .selector import parse_selector, ready_sidecars, selected_sidecars
from .serve import TokenAuthenticator, audience_reviewer, create_app, start_server
from .serving_tls import ServingTLS, TrustPublisher
from .settings import OperatorConfig, configure_kopf
from .webhook_certs import CertKeeper

RECONCILER = "reconciler"
PERIODIC = "periodic"
SERVER = "server"
ELECTOR = "elector"
GENERATIONS = "generations"
KEEPER = "cert_keeper"
TRUST = "trust_publisher"
CERT_WAIT_S = 2.0
"""A standby starting before the leader issued the certificate looks again this often."""
CONFLICT_RETRIES = 3
FORBIDDEN = 403
"""Passes tried when one loses a race (409 Conflict: another writer, e.g. a leader stepping
down, changed an object since we read it), 1 s apart; then the resync repairs."""
INDEX_NAMES = ("policies_by_name", "quotas_by_policy", "sidecars_by_policy")
CONFIG = OperatorConfig.from_env()

PolicyIndex = kopf.Index[PolicyKey, PolicyView]
QuotaIndex = kopf.Index[PolicyKey, QuotaView]
SidecarIndex = kopf.Index[PolicyKey, SidecarView]


@kopf.on.startup()
async def configure(
    *, settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """All of Kopf's settings in one place (see :func:`.settings.configure_kopf`), and the two
    operator-level loops (resync, usage) over the indexes. Kopf passes the indexes here already
    (empty, filled in place as the watches list objects), so the loops keep these mappings."""
    api = api_client()
    periodic = Periodic()
    config = CONFIG
    # Every write asks, right before it is sent, whether this replica leads now (.leader).
    memo[RECONCILER] = Reconciler(KubeApi(api, may_write=lambda: _leads(memo)))
    indexes = {name: kwargs[name] for name in INDEX_NAMES}
    if CONFIG.leader_election:
        await _elect(api, memo, logger, indexes)
    serves_tls = CONFIG.webhook_port is not None or CONFIG.https_port is not None
    if serves_tls and CONFIG.webhook_cert_secret is not None:
        config = await _own_certificates(api, memo, periodic, logger)
    configure_kopf(settings, config)
    if CONFIG.http_port is not None or CONFIG.https_port is not None:
        await _serve(api, memo, config, periodic, logger, indexes)
    periodic.start(
        "tokenfair-resync", CONFIG.resync_interval_s, _resync_job(memo, logger, indexes), logger
    )
    periodic.start(
        "tokenfair-usage", CONFIG.usage_interval_s, _usage_job(memo, logger, indexes), logger
    )
    memo[PERIODIC] = periodic


async def _serve(
    api: Any,
    memo: kopf.Memo,
    config: OperatorConfig,
    periodic: Periodic,
    logger: kopf.Logger,
    indexes: Mapping[str, Any],
) -> None:
    """The HTTP server (:mod:`.serve`): plain on ``http_port``, TLS on ``https_port`` with the
    operator's serving certificate (``$TOKENFAIR_HTTPS_CERT``/``_KEY``/``_CA``, else the
    webhook's); TokenReviews for the sidecars' audience only."""
    reconciler = _reconciler(memo)
    auth = TokenAuthenticator(audience_reviewer(api, CONFIG.config_audience))
    elector = memo.get(ELECTOR)
    leader = elector.leader_address if isinstance(elector, LeaderElector) else _no_leader
    tls = _serving_tls(config)
    app = create_app(
        reconciler.documents,
        reconciler.metrics,
        auth,
        leader,
        CONFIG.relay_connections,
        plain_config=CONFIG.config_insecure_http,
        tls=tls,
    )
    context = tls.server if tls is not None else None
    memo[SERVER] = await start_server(
        app, CONFIG.http_addr, CONFIG.http_port, CONFIG.https_port, context
    )
    if tls is not None:
        memo[TRUST] = publisher = TrustPublisher(api)  # the rotation asks it (_reached)
        job = _tls_job(memo, logger, indexes, tls, publisher)
        try:
            await job()  # the CA out to the policies' namespaces before the first resync ends
        except Exception:
            logger.exception("publishing the CA bundle failed; retried next round")
        periodic.start("tokenfair-serving-tls", CONFIG.resync_interval_s, job, logger)


def _serving_tls(config: OperatorConfig) -> ServingTLS | None:
    """The TLS port's certificate files: given, else the webhook's; None without a TLS port.
    A TLS port without a certificate stops the operator at startup, naming the variables."""
    if CONFIG.https_port is None:
        return None
    cert = CONFIG.https_cert or config.webhook_cert
    key = CONFIG.https_key or config.webhook_key or cert
    ca = CONFIG.https_ca or config.webhook_ca
    if not (cert and key and ca):
        raise kopf.PermanentError(
            "$TOKENFAIR_HTTPS_PORT needs a certificate: $TOKENFAIR_WEBHOOK_CERT_SECRET (the "
            "operator's own), or $TOKENFAIR_HTTPS_CERT, _KEY and _CA (PEM files)"
        )
    return ServingTLS(Path(cert), Path(key), Path(ca))


def _tls_job(
    memo: kopf.Memo,
    logger: kopf.Logger,
    indexes: Mapping[str, Any],
    tls: ServingTLS,
    publisher: TrustPublisher,
) -> Job:
    """Every ``resync_interval_s``: a standby takes the leader's certificate from the Secret
    (:meth:`.CertKeeper.follow`: its webhook and its TLS port serve the current one within a
    round, not an hour); every replica reloads the TLS port's files if they changed; the
    leader writes the CA bundle into each policy namespace's ConfigMap (:mod:`.serving_tls`),
    checking every namespace again once it newly leads."""
    led = False

    async def tls_round() -> None:
        nonlocal led
        leads = _leads(memo)
        keeper = memo.get(KEEPER)
        if isinstance(keeper, CertKeeper) and not leads:
            await asyncio.to_thread(keeper.follow)
        if await asyncio.to_thread(tls.reload):
            logger.info("document server: new certificate or CA bundle loaded")
        if leads and not led:
            publisher.forget()
        led = leads
        if not leads:
            return
        policies: PolicyIndex = indexes["policies_by_name"]
        by_namespace: dict[str, list[PolicyView]] = {}
        for (namespace, _), views in list(policies.items()):
            by_namespace.setdefault(namespace, []).extend(v for v in views if not v.deleting)
        written = await asyncio.to_thread(
            publisher.publish, tls.ca_pem, by_namespace, lambda: _leads(memo)
        )
        if written:
            logger.info(f"CA bundle published to namespaces {', '.join(written)}")

    return tls_round


async def _elect(
    api: Any, memo: kopf.Memo, logger: kopf.Logger, indexes: Mapping[str, Any]
) -> None:
    """Leader election (:mod:`.leader`). On becoming the leader: a full pass of every policy
    at once (a standby only watched), so a failover costs the lease expiry plus one pass. On
    stepping down: the documents held, the queued status writes and the key cache are forgotten
    (:meth:`.Reconciler.step_down`), so a replica elected again serves none from its previous
    term (only what its first pass publishes, :mod:`.documents`)."""
    resync = _resync_job(memo, logger, indexes)

    async def on_lead() -> None:
        try:
            await resync()
        except Exception:
            logger.exception("first pass as the leader failed; the resync retries")

    elector = LeaderElector(
        api,
        CONFIG.lease_namespace,
        CONFIG.lease_name,
        CONFIG.identity,
        on_lead=on_lead,
        on_lose=_reconciler(memo).step_down,
        advertise=CONFIG.http_advertise,
    )
    memo[ELECTOR] = elector
    elector.start()
    await elector.first_round()  # the certificates' keeper needs to know who leads


async def _own_certificates(
    api: Any, memo: kopf.Memo, periodic: Periodic, logger: kopf.Logger
) -> OperatorConfig:
    """No cert-manager: issue (or take from the Secret) our own CA and serving certificate,
    set the webhook configurations' caBundle, and check hourly for renewal
    (:mod:`.webhook_certs`). The settings then point Kopf's server at the files. Only the
    leader issues and rotates; a standby serves what the leader keeps in the Secret (waiting
    at startup until there is one, or until it leads itself)."""
    assert CONFIG.webhook_cert_secret is not None
    keeper = CertKeeper(
        api,
        CONFIG.webhook_cert_secret,
        CONFIG.webhook_dns_names,
        CONFIG.webhook_configurations,
        Path(CONFIG.webhook_cert_dir),
        may_write=lambda: _leads(memo),  # asked before each of its writes
        # A next CA is published this long before its leaf is served (.certs: two phases),
        # counted from when every policy namespace's ConfigMap holds it, when they hold ours.
        settle=trust_settle(datetime.timedelta(seconds=CONFIG.resync_interval_s)),
        reached=_reached(memo) if CONFIG.https_port is not None and not CONFIG.https_ca else None,
    )
    memo[KEEPER] = keeper

    async def renew() -> None:
        if not _leads(memo):
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
    periodic.start("tokenfair-certs", CONFIG.cert_check_interval_s, renew, logger)
    files = keeper.files
    return dataclasses.replace(
        CONFIG, webhook_cert=str(files.cert), webhook_key=str(files.key), webhook_ca=str(files.ca)
    )


def _reached(memo: kopf.Memo) -> Reached:
    """Since when the policies' ConfigMaps hold a CA, as this replica's publisher saw them
    (:meth:`.TrustPublisher.holding_since`); None before it ran as the leader."""

    def reached(ca_pem: bytes) -> datetime.datetime | None:
        publisher = memo.get(TRUST)
        return publisher.holding_since(ca_pem) if isinstance(publisher, TrustPublisher) else None

    return reached


@kopf.on.cleanup()
async def stop_loops(*, memo: kopf.Memo, **_: Any) -> None:
    periodic = memo.get(PERIODIC)
    if isinstance(periodic, Periodic):
        await periodic.stop()
    elector = memo.get(ELECTOR)
    if isinstance(elector, LeaderElector):
        await elector.stop()  # releases the Lease: the standby leads at its next attempt
    server = memo.get(SERVER)
    if isinstance(server, web.AppRunner):
        await server.cleanup()
    reconciler = memo.get(RECONCILER)
    if isinstance(reconciler, Reconciler):
        await reconciler.close()  # queued status writes: the next leader's pass writes them


@kopf.index(GROUP, VERSION, QUOTA_PLURAL)
def quotas_by_policy(*, body: kopf.Body, **_: Any) -> dict[PolicyKey, QuotaView]:
    view = QuotaView.from_body(body)
    return {(view.namespace, view.policy_name): view}


@kopf.index(GROUP, VERSION, POLICY_PLURAL)
def policies_by_name(*, body: kopf.Body, **_: Any) -> dict[PolicyKey, PolicyView]:
    view = PolicyView.from_body(body)
    return {(view.namespace, view.name): view}


def _reconciler(memo: kopf.Memo) -> Reconciler:
    reconciler = memo[RECONCILER]
    assert isinstance(reconciler, Reconciler)
    return reconciler


@kopf.index("", "v1", "pods", labels={POLICY_LABEL: kopf.PRESENT})
def sidecars_by_policy(
    *,
    name: str | None,
    namespace: str | None,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    spec: kopf.Spec,
    status: kopf.Status,
    **_: Any,
) -> dict[PolicyKey, SidecarView]:
    """Each sidecar Pod (labelled ``tokenfair.io/policy``): Ready or not, where its admin
    port answers (``status.podIP``, port 9090 or annotation ``tokenfair.io/admin-port``), its
    labels (for the policy's ``spec.selector``), and whether it runs the sidecar at all."""
    ip = status.get("podIP")
    port = annotations.get(ADMIN_PORT_ANNOTATION, str(ADMIN_PORT))
    address = f"{ip}:{port}" if ip else None
    containers = spec.get("containers") or []
    view = SidecarView(
        pod_is_ready(status),
        address,
        {str(k): str(v) for k, v in labels.items()},
        name=name or "",
        injected=any(c.get("name") == CONTAINER for c in containers),
    )
    return {(namespace or "", labels[POLICY_LABEL]): view}


def pod_is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _ready_sidecars(key: PolicyKey, kwargs: Mapping[str, Any]) -> int:
    """Ready sidecars of policy ``key`` that its ``spec.selector`` matches."""
    policies: PolicyIndex = kwargs["policies_by_name"]
    sidecars: SidecarIndex = kwargs["sidecars_by_policy"]
    return ready_sidecars(policies.get(key, ()), sidecars.get(key, ()))


async def _reconcile(
    key: PolicyKey, memo: kopf.Memo, logger: kopf.Logger, kwargs: Mapping[str, Any]
) -> None:
    """Reconcile policy ``key`` (coalesced with the triggers queued behind a running pass,
    :meth:`.Reconciler.request`); Kopf passes the indexes as keyword arguments named after their
    functions (taken from ``kwargs``: a required parameter would not fit Kopf's handler types).
    The indexes are live: the pass reads them when it starts, not when the trigger came."""
    policies: PolicyIndex = kwargs["policies_by_name"]
    quotas: QuotaIndex = kwargs["quotas_by_policy"]
    sidecars: SidecarIndex = kwargs["sidecars_by_policy"]

    def snapshot() -> Snapshot:
        return policies.get(key, ()), quotas.get(key, ()), sidecars.get(key, ())

    if not _leads(memo):  # the leader reconciles; a standby keeps its indexes warm
        return
    for attempt in range(1, CONFLICT_RETRIES + 1):
        try:
            await _reconciler(memo).request(key, snapshot, logger)
            return
        except NotLeader as exc:  # stepped down during the pass: the new leader redoes it
            logger.info(f"pass of {key[0]}/{key[1]} stopped: {exc}")
            return
        except Exception as exc:
            if not is_conflict(exc) or attempt == CONFLICT_RETRIES:
                raise
            logger.info(f"pass of {key[0]}/{key[1]}: conflict, retrying in 1 s")
            await asyncio.sleep(1)


def _no_leader() -> None:
    """One replica (no election): this one serves its own documents."""


def _leads(memo: kopf.Memo) -> bool:
    elector = memo.get(ELECTOR)
    return not isinstance(elector, LeaderElector) or elector.is_leader


@kopf.on.event(GROUP, VERSION, QUOTA_PLURAL)
async def quota_event(
    *,
    type: str | None,
    body: kopf.Body,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A quota listed, created, changed (spec: a new generation) or deleted -> a pass of its
    policy. Our own status writes bring no new generation, so they trigger nothing."""
    if _news(memo, type, body):
        key = (namespace or "", str(spec.get("policyName", "")))
        await _reconcile(key, memo, logger, kwargs)


@kopf.on.event(GROUP, VERSION, POLICY_PLURAL)
async def policy_event(
    *,
    type: str | None,
    body: kopf.Body,
    namespace: str | None,
    name: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A policy listed, created, changed or deleted -> its pass (a deleted one marks its
    quotas ``PolicyNotFound``; no finalizer: deletion never waits for us)."""
    if _news(memo, type, body):
        await _reconcile((namespace or "", name or ""), memo, logger, kwargs)


def _news(memo: kopf.Memo, type: str | None, body: kopf.Body) -> bool:
    """True for an event a pass must follow: the object is new to us (``type`` None is the
    initial listing), deleted, being deleted, or at a generation not seen yet. Recorded on
    every replica, leader or not, so a standby that takes over starts from the same place
    (and runs a full pass anyway)."""
    seen: dict[str, tuple[int, bool]] = memo.setdefault(GENERATIONS, {})
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


@kopf.on.event("", "v1", "pods", labels={POLICY_LABEL: kopf.PRESENT})
async def sidecar_changed(
    *,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A sidecar Pod came, went or changed readiness: re-divide budgets if the count moved;
    report a labelled Pod that runs without the sidecar (or no longer does)."""
    key = (namespace or "", labels[POLICY_LABEL])
    reconciler = _reconciler(memo)
    sidecars: SidecarIndex = kwargs["sidecars_by_policy"]
    if reconciler.replicas_changed(
        key, _ready_sidecars(key, kwargs)
    ) or reconciler.unprotected_changed(key, sidecars.get(key, ())):
        await _reconcile(key, memo, logger, kwargs)


def _resync_job(memo: kopf.Memo, logger: kopf.Logger, indexes: Mapping[str, Any]) -> Job:
    """Every ``resync_interval_s``: one pass for each policy that exists or is named by a quota.
    Picks up what no watch reports (a key Secret's content) and repairs anything a failed pass
    left behind (a quota of a vanished policy included). One policy failing skips only itself."""

    async def resync() -> None:
        policies: PolicyIndex = indexes["policies_by_name"]
        quotas: QuotaIndex = indexes["quotas_by_policy"]
        _prune_generations(memo, policies, quotas)
        if not _leads(memo):
            return
        for key in sorted({*policies, *quotas}):
            try:
                # The pass first, from the key cache (a new leader's seeded from the stored
                # document: it serves at once); then every key Secret is read again, and a
                # change is published by a second pass in the same round.
                await _reconcile(key, memo, logger, indexes)
                if await _reconciler(memo).refresh_keys(quotas.get(key, ())):
                    await _reconcile(key, memo, logger, indexes)
            except Exception as exc:
                if is_conflict(exc):
                    logger.info(f"resync of {key[0]}/{key[1]}: conflict, retried next round")
                else:
                    logger.exception(f"resync of {key[0]}/{key[1]} failed, retried next round")

    return resync


def _prune_generations(memo: kopf.Memo, policies: PolicyIndex, quotas: QuotaIndex) -> None:
    """Forget the generations :func:`_news` recorded of objects no index holds any more (on
    every replica): a deletion whose DELETED event never came (one missed while a watch was
    re-established) leaves nothing behind. Kopf updates an index before it calls the event's
    handlers, so a live object's entry is never dropped (if it were, its next event would
    only cost one more pass)."""
    seen: dict[str, tuple[int, bool]] | None = memo.get(GENERATIONS)
    if not seen:
        return
    live = {view.uid for index in (policies, quotas) for key in index for view in index[key]}
    for uid in [uid for uid in seen if uid not in live]:
        del seen[uid]


def _usage_job(memo: kopf.Memo, logger: kopf.Logger, indexes: Mapping[str, Any]) -> Job:
    """Every ``usage_interval_s``: scrape each policy's Ready sidecars (those its selector
    matches), write their tenants' live usage, and how many of them run the published config
    version (:mod:`.rollout`; also for a policy with no Ready sidecar: ``0/0``)."""

    async def scrape() -> None:
        if not _leads(memo):
            return
        policies: PolicyIndex = indexes["policies_by_name"]
        sidecars: SidecarIndex = indexes["sidecars_by_policy"]
        quotas: QuotaIndex = indexes["quotas_by_policy"]
        for key in sorted({*sidecars, *policies}):
            live = [p for p in policies.get(key, ()) if not p.deleting]
            selected = selected_sidecars(policies.get(key, ()), sidecars.get(key, ()))
            addresses = [s.address for s in selected if s.ready and s.address]
            scrapes = await scrape_metrics(addresses, CONFIG.scrape_timeout_s) if addresses else []
            try:
                if scrapes and key in quotas:
                    await _reconciler(memo).write_usage(quotas.get(key, ()), scrapes)
                if live:
                    await _reconciler(memo).write_rollout(key, live[0], len(addresses), scrapes)
            except NotLeader:
                return  # stepped down during the round
            except Exception:  # best effort: one policy's failed write skips only itself
                logger.exception(f"usage of {key[0]}/{key[1]} not written, retried next round")

    return scrape


def _spec_changed(review: Mapping[str, Any]) -> bool:
    """CREATE, or an UPDATE that touches the spec (not Kopf's metadata patches); ``review`` is
    the handler's keyword arguments (Kopf passes ``operation``, ``old`` and ``new`` there)."""
    operation, old, new = review.get("operation"), review.get("old"), review.get("new")
    if operation == "CREATE":
        return True
    old_spec = old.get("spec") if isinstance(old, Mapping) else None
    new_spec = new.get("spec") if isinstance(new, Mapping) else None
    return bool(operation == "UPDATE" and old_spec != new_spec)


async def admit_quota(*, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    if not _spec_changed(kwargs):
        return
    creating = kwargs.get("operation") == "CREATE"
    view = QuotaView.from_body(body)
    refusal = await quota_refusal(_reconciler(memo).api, view, creating=creating)
    if refusal is not None:
        raise kopf.AdmissionError(refusal, code=422)


def admit_policy(*, name: str | None, spec: kopf.Spec, **kwargs: Any) -> None:
    if not _spec_changed(kwargs):
        return
    where = f"SchedulingPolicy {name!r}: spec"
    try:
        parse_policy(spec, where)
        parse_selector(spec.get("selector"), f"{where}.selector")
    except ConfigError as exc:
        raise kopf.AdmissionError(str(exc), code=422) from None


async def inject_sidecar(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    namespace: str | None = None,
    **kwargs: Any,
) -> None:
    """Mutating webhook: add the sidecar to a Pod labelled ``tokenfair.io/policy`` (once), with
    the resources and flags its annotations ask for (:mod:`.inject`), the scrape annotations,
    and its policy's budget-store password if the policy names one (:func:`policy_spec_for`)."""
    meta = body.get("metadata", {})
    settings = CONFIG.injection
    try:
        if injected(body, settings) is None:  # unlabelled or already injected: no reads
            return
        policy_name = str((meta.get("labels") or {}).get(POLICY_LABEL))
        key = (namespace or meta.get("namespace") or "", policy_name)
        spec = await policy_spec_for(key, kwargs.get("policies_by_name"), _reconciler(memo).api)
        password = store_password_key(spec) if spec is not None else None
        change = injected(body, settings, password)
    except InjectionError as exc:
        raise kopf.AdmissionError(str(exc), code=422) from None
    if change is None:
        return
    patch.spec["containers"] = change["containers"]
    patch.spec["volumes"] = change["volumes"]
    for name, value in scrape_annotations(body, settings).items():
        patch.metadata.setdefault("annotations", {})[name] = value


class PolicyReader(Protocol):
    def get_policy(self, namespace: str, name: str) -> PolicyView | None: ...


async def policy_spec_for(
    key: PolicyKey, policies: PolicyIndex | None, api: PolicyReader
) -> Mapping[str, Any] | None:
    """The spec of SchedulingPolicy ``key`` for injection: from the live index, or, when the
    index has no entry (right after a restart, or the policy applied together with its Pods,
    before the watch delivered it), read from the API server, so a Pod is never injected
    without the budget-store password because our cache was cold. None: no such policy. A
    failed read refuses the Pod (503) rather than injecting a sidecar that cannot reach its
    store; its ReplicaSet retries. A 403 (a namespace the operator is not granted, so not
    watched either) counts as no policy: the Pod is injected without the password."""
    for indexed in policies.get(key, ()) if policies is not None else ():
        return indexed.spec
    if not key[0]:  # no namespace to read from (the API server sets it before admission)
        return None
    try:
        view = await asyncio.to_thread(api.get_policy, *key)
    except Exception as exc:
        if getattr(exc, "status", None) == FORBIDDEN:
            return None  # a namespace outside our RBAC (not watched): nothing of ours there
        raise kopf.AdmissionError(
            f"SchedulingPolicy {key[1]!r} in namespace {key[0]!r} could not be read to inject "
            f"its sidecar ({exc.__class__.__name__}); retry",
            code=503,
        ) from None
    return view.spec if view is not None else None


# Registered only with a webhook server configured: Kopf refuses to start with admission
# handlers and no server. Validation fails open (failurePolicy Ignore): with the operator down,
# objects are still checked by CEL on the way in and by the reconciler into status. Injection
# fails closed unless $TOKENFAIR_INJECTION_FAILURE_POLICY=Ignore: a labelled Pod waits for us
# rather than serving unprotected (only labelled Pods are sent: the objectSelector).
if CONFIG.webhook_port is not None:
    # Explicit ids: Kopf serves each handler at ``/<id>``, and a webhook's Service path must
    # be made of RFC 1123 labels (no underscores), which the function names are not.
    validators = (
        (QUOTA_PLURAL, "admit-quota", admit_quota),
        (POLICY_PLURAL, "admit-policy", admit_policy),
    )
    for plural, handler_id, admit in validators:
        kopf.on.validate(
            GROUP,
            VERSION,
            plural,
            id=handler_id,
            operations=["CREATE", "UPDATE"],
            ignore_failures=True,
        )(admit)
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id="inject-sidecar",
        operations=["CREATE"],
        labels={POLICY_LABEL: kopf.PRESENT},
        ignore_failures=CONFIG.injection_failure_policy == "Ignore",
    )(inject_sidecar)
