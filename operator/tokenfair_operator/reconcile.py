"""The level-based reconciler: one SchedulingPolicy and all its TenantQuotas at once.

Every trigger (a quota or policy changed, a periodic resync) runs the same idempotent pass for
one policy, serialized per policy by an asyncio lock. Triggers are coalesced
(:meth:`Reconciler.request`): a trigger that arrives while a pass runs is served by the next
pass, which reads the indexes when it starts and so serves every trigger queued behind it;
10,000 TenantQuotas applied at once cost a handful of passes, not 10,000 (each O(n), which made
the old behaviour quadratic). A pass:

1. take the policy and its quotas from the Kopf indexes (snapshots; the policy is read from
   the API only when the index has none, as its watch may lag);
2. read the key Secrets the quotas reference that were never read or had a problem (at most
   :data:`IO_CONCURRENCY` at a time); the others come from the cache, which the resync
   refreshes (:meth:`Reconciler.refresh_keys`) outside the lock;
3. render (pure, :func:`~.render.render_config`); publish the ConfigMap and Secret when the
   content changed, then hand the document to the long-poll server (:mod:`.documents`);
4. write each object's status when it changed (at most :data:`IO_CONCURRENCY` at a time), and
   a Warning Event when a refusal is new.

Blocking client calls run in the reconciler's own :data:`IO_CONCURRENCY` threads; index reads
and Event posting stay on the loop.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

import kopf

from .conditions import SIDECARS_INJECTED, ready_reason
from .documents import Document, DocumentStore
from .kube import KubeApi
from .metrics import OperatorMetrics
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
from .rollout import rollout_changed, rollout_status
from .selector import ready_sidecars
from .status import differs, orphan_verdict, policy_status, quota_status
from .usage import aggregate_usage, usage_changed

PolicyKey = tuple[str, str]
"""(namespace, policy name)."""
Snapshot = tuple[Iterable[PolicyView], Iterable[QuotaView], Iterable[SidecarView]]
"""A policy's objects as the indexes hold them: policies, quotas, sidecar Pods."""
T = TypeVar("T")

IO_CONCURRENCY: Final = 16
"""API calls one pass has in flight at once (key Secret reads, status writes): a first pass over
10,000 new quotas makes 10,000 status writes, ~3 ms each on a local API server, which one at a
time take 30 s; 16 keeps the API server's default max-requests-inflight (400) far away."""


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
    _requested: dict[PolicyKey, int] = field(default_factory=dict)
    """Per policy: how many passes were requested (a ticket number)."""
    _served: dict[PolicyKey, int] = field(default_factory=dict)
    """Per policy: the highest ticket a started pass serves."""
    _written: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """Per object uid: the resourceVersion we last wrote a status over, and that status."""
    _keys: dict[tuple[str, str], KeyLookup] = field(default_factory=dict)
    """(namespace, Secret name) -> the digests (or problem) read from that key Secret last."""
    _unprotected: dict[PolicyKey, tuple[str, ...]] = field(default_factory=dict)
    """Per policy: its labelled Pods without the sidecar at the last pass."""
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    documents: DocumentStore = field(default_factory=DocumentStore)
    """The documents last published, served to sidecars by :mod:`.serve`."""
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(IO_CONCURRENCY, "tokenfair-api")
    )
    """Threads for the blocking client calls: asyncio's default pool has only CPUs + 4."""

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of our API threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def request(
        self, key: PolicyKey, snapshot: Callable[[], Snapshot], logger: kopf.Logger
    ) -> None:
        """A pass of ``key`` that starts after this call, reading the world from ``snapshot``
        when it starts; returns when one has run. If another trigger's pass started after this
        call, that pass serves this one too (it read the indexes later than our trigger) and
        nothing more runs. A pass that fails raises in its own caller only; the others were
        served by a pass that saw their change, and its caller's retry covers them again."""
        ticket = self._requested[key] = self._requested.get(key, 0) + 1
        async with self._lock(key):
            if self._served.get(key, 0) >= ticket:
                return
            self._served[key] = self._requested[key]
            policies, quotas, sidecars = snapshot()
            await self._pass(key, policies, quotas, logger, sidecars)

    async def refresh_keys(self, quotas: Iterable[QuotaView]) -> None:
        """Read again every key Secret ``quotas`` reference (no watch reports a Secret's
        content; the resync calls this). Outside the policy's lock: passes go on meanwhile."""
        await self._read_keys(
            {(q.namespace, q.key_secret) for q in quotas if q.key_secret is not None},
            only_unknown=False,
        )

    async def _read_keys(self, secrets: set[tuple[str, str]], *, only_unknown: bool) -> None:
        """Read key Secrets into the cache, at most :data:`IO_CONCURRENCY` at a time. With
        ``only_unknown``, those never read or whose last read found a problem (a Secret created
        later is picked up by the next pass): a pass over 10,000 keyed quotas makes no reads
        when nothing is new."""
        if only_unknown:
            secrets = {s for s in secrets if not isinstance(self._keys.get(s), tuple)}
        wanted = sorted(secrets)
        found = await _bounded(self._call(self.api.key_hashes, *s) for s in wanted)
        self._keys.update(zip(wanted, found, strict=True))

    def _lock(self, key: PolicyKey) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def replicas_changed(self, key: PolicyKey, ready_replicas: int) -> bool:
        """True if the last pass of ``key`` used another count (pod events that change no
        count cost nothing)."""
        return self._replicas.get(key) != ready_replicas

    def unprotected_changed(self, key: PolicyKey, sidecars: Iterable[SidecarView]) -> bool:
        """True if the labelled Pods of ``key`` without the sidecar are not those of the last
        pass (a Pod created uninjected is reported at once, not at the next resync)."""
        return self._unprotected.get(key, ()) != _unprotected(sidecars)

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
        async with self._lock(key):
            await self._pass(key, policies, quotas, logger, sidecars)

    async def _pass(
        self,
        key: PolicyKey,
        policies: Iterable[PolicyView],
        quotas: Iterable[QuotaView],
        logger: kopf.Logger,
        sidecars: Iterable[SidecarView],
    ) -> None:
        with self.metrics.reconcile_seconds.time():
            await self._pass_timed(key, policies, quotas, logger, sidecars)

    async def _pass_timed(
        self,
        key: PolicyKey,
        policies: Iterable[PolicyView],
        quotas: Iterable[QuotaView],
        logger: kopf.Logger,
        sidecars: Iterable[SidecarView],
    ) -> None:
        labelled = list(sidecars)
        unprotected = self._unprotected[key] = _unprotected(labelled)
        self.metrics.pods_without_sidecar.labels(*key).set(len(unprotected))
        live = [p for p in policies if not p.deleting]
        members = list(quotas)
        now = self.clock()
        if not live and members:
            # The policy's watch may lag its quotas' (one `kubectl apply` of both): ask the
            # API before calling the policy missing and posting Warning Events.
            stored = await self._call(self.api.get_policy, *key)
            live = [stored] if stored is not None and not stored.deleting else []
        self._replicas[key] = ready_sidecars(live, labelled)
        if not live:
            self.documents.withdraw(key)
            await _bounded(self._write_quota(q, quota_status_orphan(q, now)) for q in members)
            return
        policy = live[0]
        keyed = [q for q in members if q.key_secret is not None]
        await self._read_keys({(q.namespace, str(q.key_secret)) for q in keyed}, only_unknown=True)
        lookups = {q.name: self._keys[(q.namespace, str(q.key_secret))] for q in keyed}
        rendering = render_config(policy, members, lookups, self._replicas[key])
        if rendering.version:
            generation = await self._publish(policy, rendering, logger)
            # Served only once stored: a sidecar never runs what the API server refused.
            document = Document(
                rendering.version,
                rendering.secret_payload,
                rendering.configmap_payload,
                generation,
            )
            self.documents.publish(key, document)
        status = policy_status(policy, rendering, now=now, unprotected=unprotected)
        await self._write(POLICY_PLURAL, policy, status)
        _warn_if_new(policy, status, SIDECARS_INJECTED)
        await _bounded(
            self._write_quota(q, quota_status(q, rendering.verdicts[q.name], rendering, now=now))
            for q in members
        )

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

    async def write_rollout(
        self, key: PolicyKey, policy: PolicyView, ready: int, scrapes: Iterable[str]
    ) -> None:
        """Write how many of ``ready`` sidecars run the version published last (from their
        metrics ``scrapes``) into the policy's status, only when it changed (:mod:`.rollout`)."""
        document = self.documents.get(key)
        version = document.version if document else str(policy.status.get("configVersion", ""))
        fresh = rollout_status(ready, scrapes, version)
        self.metrics.sidecars.labels(*key, "current").set(fresh["sidecarsCurrent"])
        self.metrics.sidecars.labels(*key, "stale").set(ready - fresh["sidecarsCurrent"])
        if rollout_changed(policy.status, fresh):
            await self._call(
                self.api.patch_status, POLICY_PLURAL, policy.namespace, policy.name, fresh
            )

    async def _publish(self, policy: PolicyView, rendering: Rendering, logger: kopf.Logger) -> int:
        """Store the document in the ConfigMap and Secret; its generation (:mod:`.documents`)."""
        version = rendering.version
        generation, written = await self._call(
            self.api.publish_document,
            policy,
            version,
            rendering.configmap_payload,
            rendering.secret_payload,
        )
        names = {"ConfigMap": configmap_name(policy.name), "Secret": secret_name(policy.name)}
        for kind in written:
            logger.info(
                f"published config version {version} (generation {generation}) "
                f"to {kind} {names[kind]}"
            )
        return generation

    async def _write_quota(self, quota: QuotaView, status: dict[str, Any]) -> None:
        await self._write(QUOTA_PLURAL, quota, status)

    async def _write(self, plural: str, view: ObjectView, status: dict[str, Any]) -> None:
        """Write ``status`` if it differs from the snapshot's, conditional on the snapshot's
        resourceVersion (a stale snapshot is a 409, never a lost update). A status we wrote
        over this very snapshot already is not written again: the watch has not brought our
        own write back yet, and writing it again would only earn a 409."""
        if not differs(dict(view.status), status):
            return
        if self._written.get(view.uid) == (view.resource_version, status):
            return
        await self._call(
            self.api.patch_status,
            plural,
            view.namespace,
            view.name,
            status,
            view.resource_version,
        )
        self._written[view.uid] = (view.resource_version, status)
        refusal = ready_reason(status["conditions"])
        if refusal is not None and refusal != ready_reason(view.status.get("conditions", [])):
            reason, message = refusal
            body = kopf.Body(cast(Any, object_reference(view)))
            kopf.warn(body, reason=reason, message=message)


def _unprotected(sidecars: Iterable[SidecarView]) -> tuple[str, ...]:
    return tuple(sorted(s.name for s in sidecars if not s.injected))


def _warn_if_new(view: ObjectView, status: dict[str, Any], kind: str) -> None:
    """A Warning Event when condition ``kind`` is False with a message it did not have."""
    new = next((c for c in status["conditions"] if c["type"] == kind), None)
    if new is None or new["status"] != "False":
        return
    old: Mapping[str, Any] = next(
        (c for c in view.status.get("conditions", []) if c.get("type") == kind), {}
    )
    if (old.get("status"), old.get("message")) != ("False", new["message"]):
        body = kopf.Body(cast(Any, object_reference(view)))
        kopf.warn(body, reason=new["reason"], message=new["message"])


async def _bounded(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Await ``calls`` with at most :data:`IO_CONCURRENCY` running, results in order; the first
    failure is raised once all have finished (none is left running)."""
    gate = asyncio.Semaphore(IO_CONCURRENCY)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    pending = [one(call) for call in calls]
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


def quota_status_orphan(quota: QuotaView, now: str) -> dict[str, Any]:
    """Status of a quota whose policy is absent: refused, nothing published."""
    return quota_status(quota, orphan_verdict(quota), None, now=now)
