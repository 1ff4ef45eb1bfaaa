"""Kopf's registrations for the operator, each delegating to the module that does the work.

Run with ``kopf run -m tokenfair_operator.handlers [--namespace NS | --all-namespaces]``.
Importing this module registers the startup and cleanup hooks, the three indexes and the event
handlers; it reads no setting. The startup hook reads the settings (:mod:`.settings`), registers
the admission webhooks when a webhook server is configured (:func:`register_webhooks`) and
starts the rest (:mod:`.startup`).

Triggers, each reconciling one whole policy (:mod:`.passes`, :mod:`.reconcile`), all Kopf
*event* handlers: Kopf keeps no per-object state (no diff-base or progress annotations, no
finalizer), so several replicas can watch the same objects, and the reconciler is level-based
anyway. A handler asks for its policy's pass and returns (the pass runs in the background,
:class:`.passes.EventPasses`), and no pass runs before Kopf's initial listing is over
(:mod:`.listing`: the first handler call says it is):

* a TenantQuota listed, created, at a new generation (its spec changed) or deleted -> its
  policy; our own status writes bring no new generation and trigger nothing;
* a SchedulingPolicy likewise -> itself (a deleted one marks its quotas ``PolicyNotFound``);
* a sidecar Pod (labelled ``tokenfair.io/policy``) changing the policy's count of Ready
  sidecars, or which labelled Pods run without the sidecar -> that policy (budgets are divided
  across them, :mod:`.budgets`; only the Pods the policy's ``spec.selector`` matches count,
  :mod:`.selector`);
* every ``resync_interval_s``, one operator-level loop (:mod:`.resync`) -> every policy that
  exists or is named by a quota, then re-reading its key Secrets and passing again if one
  changed: picks up what no watch reports (a key Secret's content) and repairs anything a
  failed pass left behind;
* every ``usage_interval_s``, a second loop (:mod:`.usage_loop`): each policy's Ready sidecars'
  metrics -> its TenantQuotas' ``status.usage`` (:mod:`.usage`) and its own ``status.sidecars``,
  how many run the published version (:mod:`.rollout`).

With ``$TOKENFAIR_LEADER_ELECTION=true`` (two or more replicas) only the Lease's holder
(:mod:`.leader`) reconciles, runs the loops and issues or rotates the webhook certificate; every
replica watches, indexes, answers admission webhooks and serves its HTTP routes. A new leader
runs a full pass at once.

No handler makes Kopf add a finalizer: deleting an object never waits for the operator, so
``helm uninstall``, which removes the operator and its RBAC at once, leaves nothing stuck.

With ``$TOKENFAIR_WEBHOOK_CERT_SECRET`` the startup hook also issues (or reuses) the operator's
own webhook certificate and a third loop renews it (:mod:`.cert_bootstrap`). With
``$TOKENFAIR_HTTP_PORT`` it starts the HTTP server (:mod:`.serve`), ``/metrics``; with
``$TOKENFAIR_HTTPS_PORT`` the same over TLS, where the sidecars long-poll their policy's
document, with the operator's own serving certificate (the webhook's) and a loop that reloads
it when it changes and, on the leader, publishes its CA to the policies' namespaces
(:mod:`.tls_loop`).

Admission (:mod:`.webhooks`): a TenantQuota's and a SchedulingPolicy's spec are checked, and a
labelled Pod gets the sidecar.

Three Kopf indexes hold the snapshots the reconciler reads (:mod:`.indexes`): quotas by
(namespace, policyName), policies by (namespace, name), and sidecar Pods' readiness, address and
labels by (namespace, policy label).
"""

from __future__ import annotations

from typing import Any, Final

import kopf

from . import events, runtime, startup, webhooks
from .indexes import Indexes, policy_entry, quota_entry, sidecar_entry
from .inject import POLICY_LABEL
from .listing import linear_index_prepopulation
from .passes import event_passes, news, prefetch_while_listing, sidecars_moved
from .reconcile import PolicyKey
from .settings import OperatorConfig, quiet_successes
from .views import GROUP, POLICY_PLURAL, QUOTA_PLURAL, VERSION, PolicyView, QuotaView, SidecarView

ADMIT_QUOTA_ID: Final = "admit-quota"
ADMIT_POLICY_ID: Final = "admit-policy"
INJECT_ID: Final = "inject-sidecar"
"""The admission handlers' ids (:func:`register_webhooks`): Kopf serves each at ``/<id>``."""

EVENT_HANDLERS: Final = ("quota_event", "policy_event", "sidecar_changed")
"""Kopf's ids of the event handlers below (their function names)."""

# Before Kopf lists anything: its index pre-population, quadratic in the objects listed, made
# linear (.listing); and no "Handler ... succeeded." line per watch event (.settings).
linear_index_prepopulation()
quiet_successes(EVENT_HANDLERS)


@kopf.on.startup()
async def configure(
    *, settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Read our settings (a bad one stops the operator), register the admission webhooks if a
    webhook server is configured, and start the operator's parts (:func:`.startup.start`) over
    the indexes, which Kopf passes here already (empty, filled in place as the watches list
    objects).

    Kopf runs a startup hook that raised an ordinary error again (a minute later), with the
    same memo: the settings are read on the first attempt only (kept in the memo, so the Lease
    identity stays), the webhooks are added once (:func:`register_webhooks` skips those the
    registry holds), and a failed :func:`.startup.start` has stopped what it started."""
    config = memo.get(runtime.CONFIG)
    if not isinstance(config, OperatorConfig):
        try:
            config = OperatorConfig.from_env()
        except ValueError as exc:
            raise kopf.PermanentError(f"invalid setting: {exc}") from exc
        memo[runtime.CONFIG] = config
    # Kopf refuses to start with admission handlers and no server; it reads the registry only
    # once the startup hooks are done, so they can still be added here.
    if config.webhook_port is not None:
        register_webhooks(kopf.get_default_registry(), config)
    await startup.start(config, Indexes.from_kwargs(kwargs), settings, memo, logger)


@kopf.on.cleanup()
async def stop_loops(*, memo: kopf.Memo, **_: Any) -> None:
    await startup.stop(memo)


# The indexes: Kopf passes each to the handlers under its function's name (.indexes names them).
# Coroutines, though they await nothing: Kopf runs a plain function in its thread pool, a hop
# to a thread and back for every event (10,000 listed quotas: 10,000 hops, ~1 s of the loop).
@kopf.index(GROUP, VERSION, QUOTA_PLURAL)
async def quotas_by_policy(
    *, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[PolicyKey, QuotaView]:
    events.remember_queue()  # Warning Events from the status writer (:mod:`.events`)
    entry = quota_entry(body)
    prefetch_while_listing(memo, entry.values())  # the first pass's key reads, started early
    return entry


@kopf.index(GROUP, VERSION, POLICY_PLURAL)
async def policies_by_name(*, body: kopf.Body, **_: Any) -> dict[PolicyKey, PolicyView]:
    events.remember_queue()
    return policy_entry(body)


@kopf.index("", "v1", "pods", labels={POLICY_LABEL: kopf.PRESENT})
async def sidecars_by_policy(
    *,
    name: str | None,
    namespace: str | None,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    spec: kopf.Spec,
    status: kopf.Status,
    **_: Any,
) -> dict[PolicyKey, SidecarView]:
    return sidecar_entry(
        name=name,
        namespace=namespace,
        labels=labels,
        annotations=annotations,
        spec=spec,
        status=status,
    )


@kopf.on.event(GROUP, VERSION, QUOTA_PLURAL)
async def quota_event(
    *,
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """A quota listed, created, changed (spec: a new generation) or deleted -> a pass of its
    policy. Our own status writes bring no new generation, so they trigger nothing. Kopf calls
    no handler before its listing is over: the first call says so (:mod:`.listing`)."""
    events.remember_queue()
    runtime.listing(memo).mark_complete(runtime.indexes(memo).size)
    if news(memo, event["type"], body):
        event_passes(memo).ask((namespace or "", str(spec.get("policyName", ""))), logger)


@kopf.on.event(GROUP, VERSION, POLICY_PLURAL)
async def policy_event(
    *,
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """A policy listed, created, changed or deleted -> its pass (a deleted one marks its
    quotas ``PolicyNotFound``; no finalizer: deletion never waits for us)."""
    events.remember_queue()
    runtime.listing(memo).mark_complete(runtime.indexes(memo).size)
    if news(memo, event["type"], body):
        event_passes(memo).ask((namespace or "", name or ""), logger)


@kopf.on.event("", "v1", "pods", labels={POLICY_LABEL: kopf.PRESENT})
async def sidecar_changed(
    *,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """A sidecar Pod came, went or changed readiness: re-divide budgets if the count moved;
    report a labelled Pod that runs without the sidecar (or no longer does)."""
    runtime.listing(memo).mark_complete(runtime.indexes(memo).size)
    key = (namespace or "", labels[POLICY_LABEL])
    if sidecars_moved(key, memo):
        event_passes(memo).ask(key, logger)


async def admit_quota(*, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    await webhooks.admit_quota(body, memo, kwargs)


async def admit_policy(
    *, name: str | None, namespace: str | None, spec: kopf.Spec, memo: kopf.Memo, **kwargs: Any
) -> None:
    await webhooks.admit_policy(name, namespace, spec, memo, kwargs)


async def inject_sidecar(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    namespace: str | None = None,
    **_: Any,
) -> None:
    await webhooks.inject_sidecar(body, patch, memo, namespace)


def register_webhooks(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """The admission handlers, in ``registry``.

    Validation fails open (failurePolicy Ignore): with the operator down, objects are still
    checked by CEL on the way in and by the reconciler into status. Injection fails closed unless
    ``$TOKENFAIR_INJECTION_FAILURE_POLICY=Ignore``: a labelled Pod waits for us rather than
    serving unprotected (only labelled Pods are sent: the objectSelector).
    """
    # Explicit ids: Kopf serves each handler at ``/<id>``, and a webhook's Service path must
    # be made of RFC 1123 labels (no underscores), which the function names are not.
    validators = (
        (QUOTA_PLURAL, ADMIT_QUOTA_ID, admit_quota),
        (POLICY_PLURAL, ADMIT_POLICY_ID, admit_policy),
    )
    # Idempotent, by the ids the registry holds (whatever memo the caller has): Kopf keeps a
    # second handler under the same id, runs both on each review and lists the webhook twice in
    # a configuration it manages, so one added already (a retried startup hook) is skipped.
    present = {handler.id for handler in registry._webhooks.get_all_handlers()}
    for plural, handler_id, admit in validators:
        if handler_id in present:
            continue
        kopf.on.validate(
            GROUP,
            VERSION,
            plural,
            id=handler_id,
            operations=["CREATE", "UPDATE"],
            ignore_failures=True,
            registry=registry,
        )(admit)
    if INJECT_ID in present:
        return
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id=INJECT_ID,
        operations=["CREATE"],
        labels={POLICY_LABEL: kopf.PRESENT},
        ignore_failures=config.injection_failure_policy == "Ignore",
        registry=registry,
    )(inject_sidecar)
