"""Kopf handlers: thin, typed, keyword-only; all the work is in :mod:`.reconcile`.

Run with ``kopf run -m tokenfair_operator.handlers [--namespace NS | --all-namespaces]``.

Triggers, each reconciling one whole policy (see :mod:`.reconcile`):

* a TenantQuota created, resumed, changed (spec) or deleted -> its policy;
* a SchedulingPolicy created, resumed, changed (spec) or deleted -> itself;
* a sidecar Pod (labelled ``tokenfair.io/policy``) changing the policy's count of Ready
  sidecars -> that policy (budgets are divided across them, :mod:`.budgets`; only the Pods the
  policy's ``spec.selector`` matches count, :mod:`.selector`);
* every ``resync_interval_s``, one operator-level loop (:mod:`.periodic`) -> every policy that
  exists or is named by a quota: picks up what no watch reports (a key Secret's content) and
  repairs anything a failed pass left behind;
* every ``usage_interval_s``, a second loop: each policy's Ready sidecars' metrics -> its
  TenantQuotas' ``status.usage`` (:mod:`.usage`).

No handler makes Kopf add a finalizer (no per-object timers or daemons, the delete handler is
``optional``): deleting an object never waits for the operator, so ``helm uninstall``, which
removes the operator and its RBAC at once, leaves nothing stuck. A finalizer left by an older
version is removed by Kopf on the first event of the object.

With ``$TOKENFAIR_WEBHOOK_CERT_SECRET`` the startup hook also issues (or reuses) the operator's
own webhook certificate and a third loop renews it (:mod:`.webhook_certs`).

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
import functools
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, ParamSpec

import kopf

from tokenfair_sidecar.config import ConfigError, parse_policy

from .admission import quota_refusal
from .inject import (
    ADMIN_PORT,
    ADMIN_PORT_ANNOTATION,
    POLICY_LABEL,
    InjectionError,
    InjectionSettings,
    injected,
)
from .kube import KubeApi, api_client, is_conflict
from .model import GROUP, POLICY_PLURAL, QUOTA_PLURAL, VERSION, PolicyView, QuotaView, SidecarView
from .periodic import Job, Periodic
from .reconcile import PolicyKey, Reconciler
from .scrape import scrape_metrics
from .selector import parse_selector, ready_sidecars, selected_sidecars
from .settings import OperatorConfig, configure_kopf
from .webhook_certs import CertKeeper

P = ParamSpec("P")
RECONCILER = "reconciler"
PERIODIC = "periodic"
INDEX_NAMES = ("policies_by_name", "quotas_by_policy", "sidecars_by_policy")
CONFIG = OperatorConfig.from_env()

PolicyIndex = kopf.Index[PolicyKey, PolicyView]
QuotaIndex = kopf.Index[PolicyKey, QuotaView]
SidecarIndex = kopf.Index[PolicyKey, SidecarView]


def retry_on_conflict(
    fn: Callable[P, Coroutine[Any, Any, None]],
) -> Callable[P, Coroutine[Any, Any, None]]:
    """A 409 Conflict (we raced another writer) becomes a retry in 1 s, not a failure."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            await fn(*args, **kwargs)
        except Exception as exc:
            if is_conflict(exc):
                raise kopf.TemporaryError(f"conflict, retrying: {exc}", delay=1) from exc
            raise

    return wrapper


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
    if CONFIG.webhook_port is not None and CONFIG.webhook_cert_secret is not None:
        config = await _own_certificates(api, periodic, logger)
    configure_kopf(settings, config)
    memo[RECONCILER] = Reconciler(KubeApi(api))
    indexes = {name: kwargs[name] for name in INDEX_NAMES}
    periodic.start(
        "tokenfair-resync", CONFIG.resync_interval_s, _resync_job(memo, logger, indexes), logger
    )
    periodic.start(
        "tokenfair-usage", CONFIG.usage_interval_s, _usage_job(memo, logger, indexes), logger
    )
    memo[PERIODIC] = periodic


async def _own_certificates(api: Any, periodic: Periodic, logger: kopf.Logger) -> OperatorConfig:
    """No cert-manager: issue (or take from the Secret) our own CA and serving certificate,
    set the webhook configurations' caBundle, and check hourly for renewal
    (:mod:`.webhook_certs`). The settings then point Kopf's server at the files."""
    assert CONFIG.webhook_cert_secret is not None
    keeper = CertKeeper(
        api,
        CONFIG.webhook_cert_secret,
        CONFIG.webhook_dns_names,
        CONFIG.webhook_configurations,
        Path(CONFIG.webhook_cert_dir),
    )

    async def renew() -> None:
        reason = await asyncio.to_thread(keeper.ensure)
        if reason is not None:
            logger.info(f"issued a new webhook certificate: {reason}")

    await renew()
    periodic.start("tokenfair-certs", CONFIG.cert_check_interval_s, renew, logger)
    files = keeper.files
    return dataclasses.replace(
        CONFIG, webhook_cert=str(files.cert), webhook_key=str(files.key), webhook_ca=str(files.ca)
    )


@kopf.on.cleanup()
async def stop_loops(*, memo: kopf.Memo, **_: Any) -> None:
    periodic = memo.get(PERIODIC)
    if isinstance(periodic, Periodic):
        await periodic.stop()


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
    namespace: str | None,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    status: kopf.Status,
    **_: Any,
) -> dict[PolicyKey, SidecarView]:
    """Each sidecar Pod (labelled ``tokenfair.io/policy``): Ready or not, where its admin
    port answers (``status.podIP``, port 9090 or annotation ``tokenfair.io/admin-port``), and
    its labels (for the policy's ``spec.selector``)."""
    ip = status.get("podIP")
    port = annotations.get(ADMIN_PORT_ANNOTATION, str(ADMIN_PORT))
    address = f"{ip}:{port}" if ip else None
    view = SidecarView(pod_is_ready(status), address, {str(k): str(v) for k, v in labels.items()})
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
    """Reconcile policy ``key``; Kopf passes the indexes as keyword arguments named after their
    functions (taken from ``kwargs``: a required parameter would not fit Kopf's handler types)."""
    policies: PolicyIndex = kwargs["policies_by_name"]
    quotas: QuotaIndex = kwargs["quotas_by_policy"]
    sidecars: SidecarIndex = kwargs["sidecars_by_policy"]
    await _reconciler(memo).reconcile(
        key, policies.get(key, ()), quotas.get(key, ()), logger, sidecars.get(key, ())
    )


@kopf.on.resume(GROUP, VERSION, QUOTA_PLURAL)
@kopf.on.create(GROUP, VERSION, QUOTA_PLURAL)
@kopf.on.update(GROUP, VERSION, QUOTA_PLURAL, field="spec")
@retry_on_conflict
async def quota_changed(
    *,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    key = (namespace or "", str(spec.get("policyName", "")))
    await _reconcile(key, memo, logger, kwargs)


@kopf.on.event("", "v1", "pods", labels={POLICY_LABEL: kopf.PRESENT})
async def sidecar_changed(
    *,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A sidecar Pod came, went or changed readiness: re-divide budgets if the count moved."""
    key = (namespace or "", labels[POLICY_LABEL])
    if _reconciler(memo).replicas_changed(key, _ready_sidecars(key, kwargs)):
        await _reconcile(key, memo, logger, kwargs)


def _is_deletion(*, type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event(GROUP, VERSION, QUOTA_PLURAL, when=_is_deletion)
async def quota_deleted(
    *,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A deleted quota leaves its policy's document (no finalizer: deletion never blocks; a
    failed pass here is repaired by the policy's resync timer)."""
    key = (namespace or "", str(spec.get("policyName", "")))
    await _reconcile(key, memo, logger, kwargs)


@kopf.on.resume(GROUP, VERSION, POLICY_PLURAL)
@kopf.on.create(GROUP, VERSION, POLICY_PLURAL)
@kopf.on.update(GROUP, VERSION, POLICY_PLURAL, field="spec")
@kopf.on.delete(GROUP, VERSION, POLICY_PLURAL, optional=True)
@retry_on_conflict
async def policy_changed(
    *,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    await _reconcile((namespace or "", name), memo, logger, kwargs)


@kopf.on.event(GROUP, VERSION, POLICY_PLURAL, when=_is_deletion)
async def policy_deleted(
    *,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """A deleted policy marks its quotas ``PolicyNotFound``. Without a finalizer (none: deletion
    never waits for us) the delete handler above rarely sees the policy; this watch event does."""
    await _reconcile((namespace or "", name), memo, logger, kwargs)


def _resync_job(memo: kopf.Memo, logger: kopf.Logger, indexes: Mapping[str, Any]) -> Job:
    """Every ``resync_interval_s``: one pass for each policy that exists or is named by a quota.
    Picks up what no watch reports (a key Secret's content) and repairs anything a failed pass
    left behind (a quota of a vanished policy included). One policy failing skips only itself."""

    async def resync() -> None:
        policies: PolicyIndex = indexes["policies_by_name"]
        quotas: QuotaIndex = indexes["quotas_by_policy"]
        for key in sorted({*policies, *quotas}):
            try:
                await _reconcile(key, memo, logger, indexes)
            except Exception as exc:
                if is_conflict(exc):
                    logger.info(f"resync of {key[0]}/{key[1]}: conflict, retried next round")
                else:
                    logger.exception(f"resync of {key[0]}/{key[1]} failed, retried next round")

    return resync


def _usage_job(memo: kopf.Memo, logger: kopf.Logger, indexes: Mapping[str, Any]) -> Job:
    """Every ``usage_interval_s``: scrape each policy's Ready sidecars (those its selector
    matches) and write their tenants' live usage."""

    async def scrape() -> None:
        policies: PolicyIndex = indexes["policies_by_name"]
        sidecars: SidecarIndex = indexes["sidecars_by_policy"]
        quotas: QuotaIndex = indexes["quotas_by_policy"]
        for key in sorted(sidecars):
            selected = selected_sidecars(policies.get(key, ()), sidecars.get(key, ()))
            addresses = [s.address for s in selected if s.ready and s.address]
            if not addresses or key not in quotas:
                continue
            scrapes = await scrape_metrics(addresses, CONFIG.scrape_timeout_s)
            try:
                if scrapes:
                    await _reconciler(memo).write_usage(quotas.get(key, ()), scrapes)
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


def inject_sidecar(*, body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Mutating webhook: add the sidecar to a Pod labelled ``tokenfair.io/policy`` (once)."""
    try:
        change = injected(body, InjectionSettings(image=CONFIG.sidecar_image))
    except InjectionError as exc:
        raise kopf.AdmissionError(str(exc), code=422) from None
    if change is not None:
        patch.spec["containers"] = change["containers"]
        patch.spec["volumes"] = change["volumes"]


# Registered only with a webhook server configured: Kopf refuses to start with admission
# handlers and no server. They fail open (failurePolicy Ignore): with the operator down, objects
# are still checked by CEL on the way in and by the reconciler into status; the cluster is never
# blocked on us.
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
        ignore_failures=True,
    )(inject_sidecar)
