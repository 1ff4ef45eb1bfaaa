"""The admission webhooks' bodies, registered by :func:`.handlers.register_webhooks` when a
webhook server is configured (see :mod:`.settings`).

Creating a TenantQuota or changing its spec is checked by :func:`.admission.quota_refusal`; a
SchedulingPolicy's spec by the sidecar's ``parse_policy``, its ``selector`` by
:func:`.selector.parse_selector`, and against its stored quotas by
:func:`.admission.policy_refusal`. Metadata-only updates (Kopf's own annotations) pass
unchecked. A Pod labelled ``tokenfair.io/policy`` gets the sidecar (:mod:`.inject`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import kopf

from tokenfair.config import ConfigError, parse_policy

from . import runtime
from .admission import policy_refusal, quota_refusal
from .indexes import PolicyIndex
from .inject import POLICY_LABEL, InjectionError, injected, scrape_annotations, store_password_key
from .kube import FORBIDDEN
from .reconcile import PolicyKey
from .selector import parse_selector
from .views import PolicyView, QuotaView


def spec_changed(review: Mapping[str, Any]) -> bool:
    """CREATE, or an UPDATE that touches the spec (not Kopf's metadata patches); ``review`` is
    the handler's keyword arguments (Kopf passes ``operation``, ``old`` and ``new`` there)."""
    operation, old, new = review.get("operation"), review.get("old"), review.get("new")
    if operation == "CREATE":
        return True
    old_spec = old.get("spec") if isinstance(old, Mapping) else None
    new_spec = new.get("spec") if isinstance(new, Mapping) else None
    return bool(operation == "UPDATE" and old_spec != new_spec)


async def admit_quota(body: kopf.Body, memo: kopf.Memo, review: Mapping[str, Any]) -> None:
    """Refuse (422) a quota :func:`.admission.quota_refusal` refuses."""
    if not spec_changed(review):
        return
    creating = review.get("operation") == "CREATE"
    view = QuotaView.from_body(body)
    refusal = await quota_refusal(runtime.reconciler(memo).api, view, creating=creating)
    if refusal is not None:
        raise kopf.AdmissionError(refusal, code=422)


async def admit_policy(
    name: str | None,
    namespace: str | None,
    spec: kopf.Spec,
    memo: kopf.Memo,
    review: Mapping[str, Any],
) -> None:
    """Refuse (422) a policy whose spec or selector does not parse, or whose spec would make a
    stored TenantQuota of it invalid (:func:`.admission.policy_refusal`)."""
    if not spec_changed(review):
        return
    where = f"SchedulingPolicy {name!r}: spec"
    try:
        policy = parse_policy(spec, where)
        parse_selector(spec.get("selector"), f"{where}.selector")
    except ConfigError as exc:
        raise kopf.AdmissionError(str(exc), code=422) from None
    if name and namespace:
        api = runtime.reconciler(memo).api
        refusal = await policy_refusal(api, namespace, name, policy)
        if refusal is not None:
            raise kopf.AdmissionError(refusal, code=422)


async def inject_sidecar(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, namespace: str | None
) -> None:
    """Add the sidecar to a Pod labelled ``tokenfair.io/policy`` (once), with the resources and
    flags its annotations ask for (:mod:`.inject`), the scrape annotations, and its policy's
    budget-store password if the policy names one (:func:`policy_spec_for`)."""
    meta = body.get("metadata", {})
    settings = runtime.config(memo).injection
    try:
        if injected(body, settings) is None:  # unlabelled or already injected: no reads
            return
        policy_name = str((meta.get("labels") or {}).get(POLICY_LABEL))
        key = (namespace or meta.get("namespace") or "", policy_name)
        policies = runtime.indexes(memo).policies
        spec = await policy_spec_for(key, policies, runtime.reconciler(memo).api)
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
    key: PolicyKey, policies: PolicyIndex, api: PolicyReader
) -> Mapping[str, Any] | None:
    """The spec of SchedulingPolicy ``key`` for injection: from the live index, or, when the
    index has no entry (right after a restart, or the policy applied together with its Pods,
    before the watch delivered it), read from the API server, so a Pod is never injected
    without the budget-store password because our cache was cold. None: no such policy. A
    failed read refuses the Pod (503) rather than injecting a sidecar that cannot reach its
    store; its ReplicaSet retries. A 403 (a namespace the operator is not granted, so not
    watched either) counts as no policy: the Pod is injected without the password."""
    for indexed in policies.get(key, ()):
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
