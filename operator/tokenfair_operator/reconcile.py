"""The level-based reconciler: one SchedulingPolicy and all its TenantQuotas at once.

Every trigger (a quota or policy changed, a periodic resync) runs the same idempotent pass for
one policy, serialized per policy by an asyncio lock:

1. take the policy and its quotas from the Kopf indexes (snapshots; the policy is read from
   the API only when the index has none, as its watch may lag);
2. read the key Secrets the quotas reference;
3. render (pure, :func:`~.render.render_config`); publish the ConfigMap and Secret when the
   content changed;
4. write each object's status when it changed, and a Warning Event when a refusal is new.

Blocking client calls run in worker threads; index reads and Event posting stay on the loop.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from .conditions import ready_reason
from .kube import KubeApi
from .model import (
    POLICY_PLURAL,
    QUOTA_PLURAL,
    ObjectView,
    PolicyView,
    QuotaView,
    SidecarView,
    configmap_name,
    object_reference,
    secret_name,
)
from .render import KeyLookup, Rendering, render_config
from .selector import ready_sidecars
from .status import differs, orphan_verdict, policy_status, quota_status
from .usage import aggregate_usage, usage_changed

PolicyKey = tuple[str, str]
"""(namespace, policy name)."""


def utc_now() -> str:
    """RFC 3339 UTC time with seconds, as Kubernetes writes ``lastTransitionTime``."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Reconciler:
    """Holds the API and the per-policy locks; :meth:`reconcile` is the whole job."""

    api: KubeApi
    clock: Callable[[], str] = utc_now
    _locks: dict[PolicyKey, asyncio.Lock] = field(default_factory=dict)
    _replicas: dict[PolicyKey, int] = field(default_factory=dict)

    def replicas_changed(self, key: PolicyKey, ready_replicas: int) -> bool:
        """True if the last pass of ``key`` used another count (pod events that change no
        count cost nothing)."""
        return self._replicas.get(key) != ready_replicas

    async def reconcile(
        self,
        key: PolicyKey,
        policies: Iterable[PolicyView],
        quotas: Iterable[QuotaView],
        logger: kopf.Logger,
        sidecars: Iterable[SidecarView] = (),
    ) -> None:
        """Bring the documents and statuses of policy ``key`` in line with the world, with
        budgets divided across the Ready ones of ``sidecars`` (the Pods labelled with the
        policy's name) that the policy's ``spec.selector`` matches (:mod:`.selector`)."""
        labelled = list(sidecars)
        async with self._locks.setdefault(key, asyncio.Lock()):
            live = [p for p in policies if not p.deleting]
            members = list(quotas)
            now = self.clock()
            if not live and members:
                # The policy's watch may lag its quotas' (one `kubectl apply` of both): ask the
                # API before calling the policy missing and posting Warning Events.
                stored = await asyncio.to_thread(self.api.get_policy, *key)
                live = [stored] if stored is not None and not stored.deleting else []
            self._replicas[key] = ready_sidecars(live, labelled)
            if not live:
                for quota in members:
                    await self._write_quota(quota, quota_status_orphan(quota, now))
                return
            policy = live[0]
            lookups: dict[str, KeyLookup] = {}
            for quota in members:
                if (secret := quota.key_secret) is not None:
                    lookups[quota.name] = await asyncio.to_thread(
                        self.api.key_hashes, quota.namespace, secret
                    )
            rendering = render_config(policy, members, lookups, self._replicas[key])
            if rendering.version:
                await self._publish(policy, rendering, logger)
            status = policy_status(policy, rendering, now=now)
            await self._write(POLICY_PLURAL, policy, status)
            for quota in members:
                verdict = rendering.verdicts[quota.name]
                await self._write_quota(quota, quota_status(quota, verdict, rendering, now=now))

    async def write_usage(self, quotas: Iterable[QuotaView], scrapes: Iterable[str]) -> None:
        """Write each quota's ``status.usage`` from the sidecars' metrics, only where it changed
        (the caller's interval bounds the write rate)."""
        members = list(quotas)
        usage = aggregate_usage(scrapes, [q.tenant_id for q in members])
        now = self.clock()
        for quota in members:
            fresh = usage[quota.tenant_id]
            if usage_changed(quota.status.get("usage"), fresh):
                status = {"usage": {**fresh, "updatedAt": now}}
                await asyncio.to_thread(
                    self.api.patch_status, QUOTA_PLURAL, quota.namespace, quota.name, status
                )

    async def _publish(self, policy: PolicyView, rendering: Rendering, logger: kopf.Logger) -> None:
        version = rendering.version
        for kind, name, data in (
            ("ConfigMap", configmap_name(policy.name), rendering.configmap_data),
            ("Secret", secret_name(policy.name), rendering.secret_data),
        ):
            wrote = await asyncio.to_thread(self.api.publish, kind, name, policy, data, version)
            if wrote:
                logger.info(f"published config version {version} to {kind} {name}")

    async def _write_quota(self, quota: QuotaView, status: dict[str, Any]) -> None:
        await self._write(QUOTA_PLURAL, quota, status)

    async def _write(self, plural: str, view: ObjectView, status: dict[str, Any]) -> None:
        if not differs(dict(view.status), status):
            return
        await asyncio.to_thread(self.api.patch_status, plural, view.namespace, view.name, status)
        refusal = ready_reason(status["conditions"])
        if refusal is not None and refusal != ready_reason(view.status.get("conditions", [])):
            reason, message = refusal
            body = kopf.Body(cast(Any, object_reference(view)))
            kopf.warn(body, reason=reason, message=message)


def quota_status_orphan(quota: QuotaView, now: str) -> dict[str, Any]:
    """Status of a quota whose policy is absent: refused, nothing published."""
    return quota_status(quota, orphan_verdict(quota), None, now=now)
