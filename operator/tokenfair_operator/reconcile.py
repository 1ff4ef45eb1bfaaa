"""The level-based reconciler: one SchedulingPolicy and all its TenantQuotas at once.

Every trigger (a quota or policy changed, a periodic resync) runs the same idempotent pass for
one policy, serialized per policy by an asyncio lock. Triggers are coalesced
(:meth:`Reconciler.request`): a trigger that arrives while a pass runs is served by the next
pass, which reads the indexes when it starts and so serves every trigger queued behind it;
10,000 TenantQuotas applied at once cost a handful of passes, not 10,000 (each O(n), which made
the old behaviour quadratic). A pass:

1. take the policy and its quotas from the Kopf indexes (snapshots; the policy is read from
   the API only when the index has none, as its watch may lag);
2. read the key Secrets the quotas reference that were never read or had a problem (pipelined,
   :data:`READ_CHUNK` per call, :data:`READ_CONNECTIONS` calls at a time); the others come from
   the cache, which the resync refreshes (:meth:`Reconciler.refresh_keys`, at the
   resourceVersion etcd holds then) outside the lock. A cold cache (the replica's
   first pass of the policy since it started or was elected) first takes the digests of the
   quotas published at their current generation from the document stored in the policy's
   Secret, which is what the sidecars enforce (:meth:`Reconciler._seed_keys`): a restarted or
   new leader serves 10,000 tenants without reading 10,000 key Secrets first;
3. render (pure, :func:`~.render.render_config`); publish the ConfigMap and Secret when the
   content changed, then hand the document to the long-poll server (:mod:`.documents`);
4. write the policy's status, and hand the quotas' statuses that changed to the
   :class:`StatusWriter`, which writes them after the pass, in the background (at most
   :data:`STATUS_CONCURRENCY` at a time and :data:`STATUS_WRITES_PER_SECOND`), with a Warning
   Event when a refusal is new. The pass does not wait for them: what the sidecars enforce is
   the published document, and the first pass over 10,000 new quotas would otherwise wait for
   10,000 writes (~60 s here) after publishing.

Status writes stay correct when deferred: each carries the resourceVersion of the snapshot it
was computed from; a later pass replaces whatever of its policy is still queued (so a quota
deleted meanwhile is never written, and one changed twice is written once); a status computed
from a snapshot that predates our own queued or finished write is computed over that write
(the watch lags our writes: without it every pass of a burst would rewrite the quotas whose
write it has not seen, each a 409); a 409 drops the write and asks for one more pass of the
policy a second later (at most :data:`CONFLICT_RETRIES` in a row: then the resync repairs);
``NotLeader`` drops every queued write (the new leader writes its own).

Blocking client calls run in the reconciler's own threads; index reads and Event posting stay
on the loop.

What is kept per policy and per object is pruned as objects go (:meth:`Reconciler._remember`,
:meth:`Reconciler._refer`, :meth:`Reconciler._forget`): a pass forgets the statuses written over
objects that left its policy and the key Secrets no policy references any more; a pass that
finds nothing of its policy forgets the policy, and its lock and tickets go with the last
caller (:meth:`Reconciler._leave`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, cast

import kopf

from . import events
from .conditions import SIDECARS_INJECTED, ready_reason
from .documents import Document, DocumentStore
from .kube import KubeApi, NotLeader, is_conflict
from .metrics import OperatorMetrics
from .prefetch import KeyPrefetch
from .render import KeyLookup, Rendering, render_config
from .rollout import rollout_changed, rollout_status
from .selector import ready_sidecars
from .status import differs, orphan_verdict, policy_status, published_at, quota_status
from .usage import aggregate_usage, usage_changed
from .views import (
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

PolicyKey = tuple[str, str]
"""(namespace, policy name)."""
Snapshot = tuple[Iterable[PolicyView], Iterable[QuotaView], Iterable[SidecarView]]
"""A policy's objects as the indexes hold them: policies, quotas, sidecar Pods."""
T = TypeVar("T")
V = TypeVar("V", bound=ObjectView)

IO_CONCURRENCY: Final = 16
"""Threads of the reconciler's blocking calls next to the status writer's (key Secret reads
take :data:`READ_CONNECTIONS` of them)."""
READ_CONNECTIONS: Final = 4
"""Connections the key Secret reads of one pass (or the resync's re-read) use at once, each a
thread writing up to 16 GETs ahead (:mod:`.bulk_get`): a first pass over 10,000 new quotas
reads 10,000 key Secrets, ~0.25-0.3 ms of the API server's CPU and ~0.05-0.07 ms of ours each.
The reads are bound by that CPU, not by round trips: 2, 4, 8 and 16 connections read 10,000 in
the same time on the 2-core test machine; 4 x 16 requests in flight keep the API server's
default max-requests-inflight (400) far away."""
READ_CHUNK: Final = 250
"""Key Secrets one call reads (one thread, one connection): small enough that the chunks spread
evenly over the connections, large enough that asyncio's hand-off per call is noise."""
LAGGING_CACHE_S: Final = 600.0
"""Seconds a namespace whose Secret watch cache did not reach etcd's revision within the API
server's wait (~3 s, a 504) is re-read by quorum without probing again: etcd's default
progress-notify interval (10 min), about the longest such a cache lags when no Secret changes
on an API server that does not ask etcd for progress (before Kubernetes 1.31, or etcd before
3.4.31/3.5.13). Without it every resync round would pay the wait once per policy."""
STATUS_CONCURRENCY: Final = 16
"""Status writes the background writer has in flight at once (its own threads, next to a pass's
:data:`IO_CONCURRENCY`): a status patch of a custom object took up to ~90 ms on the loaded
2-core test machine at 10,000 objects, so 16 in flight are needed to reach the pace below."""
STATUS_WRITES_PER_SECOND: Final = 200.0
"""Pace of the background status writes: 10,000 new quotas' statuses take 50 s, leaving the
API server (~400 such writes per second on 2 cores) to everyone else, the next pass included."""
QUEUE_CHUNK: Final = 250
"""Quota statuses computed in one loop step by a pass (:meth:`Reconciler._queue_quotas`)."""
CONFLICT_DELAY_S: Final = 1.0
"""After a status write's 409, the policy's pass runs again this much later (the watch has
then brought the newer object)."""
CONFLICT_RETRIES: Final = 3
"""Conflict-driven passes of one policy in a row, until a trigger (an event, the resync) asks
for a pass of it: a conflict that persists costs three passes per resync round at most."""


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
    _written: dict[str, Written] = field(default_factory=dict)
    """Per object uid: the statuses we wrote that the watch may not have brought back yet."""
    _keys: dict[tuple[str, str], KeyLookup] = field(default_factory=dict)
    """(namespace, Secret name) -> the digests (or problem) read from that key Secret last."""
    _seeded: set[PolicyKey] = field(default_factory=set)
    """Policies whose cache was seeded from their stored document (:meth:`_seed_keys`)."""
    _term: int = 0
    """Counts :meth:`step_down` calls: key reads begun in an earlier term are not cached."""
    _unprotected: dict[PolicyKey, tuple[str, ...]] = field(default_factory=dict)
    """Per policy: its labelled Pods without the sidecar at the last pass."""
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    documents: DocumentStore = field(default_factory=DocumentStore)
    """The documents last published, served to sidecars by :mod:`.serve`."""
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            IO_CONCURRENCY + STATUS_CONCURRENCY, "tokenfair-api"
        )
    )
    """Threads for the blocking client calls: asyncio's default pool has only CPUs + 4."""
    status_concurrency: int = STATUS_CONCURRENCY
    status_writes_per_second: float = STATUS_WRITES_PER_SECOND
    statuses: StatusWriter = field(init=False)
    """The quotas' status writes, after the passes (:class:`StatusWriter`)."""
    prefetch: KeyPrefetch = field(init=False)
    """Key Secrets read during Kopf's initial listing, for the first pass (:mod:`.prefetch`)."""
    _snapshots: dict[PolicyKey, Callable[[], Snapshot]] = field(default_factory=dict)
    """Per policy: where :meth:`request` reads the world, for a pass after a conflict."""
    _conflicts: dict[PolicyKey, int] = field(default_factory=dict)
    """Per policy: conflict-driven passes since the last pass a trigger asked for."""
    _retries: dict[PolicyKey, asyncio.Task[None]] = field(default_factory=dict)
    _members: dict[PolicyKey, frozenset[str]] = field(default_factory=dict)
    """Per policy: the uids of its live policy object and its quotas at the last pass; a status
    written over any other (an object deleted or moved meanwhile) is not remembered."""
    _key_refs: dict[PolicyKey, frozenset[tuple[str, str]]] = field(default_factory=dict)
    """Per policy: the key Secrets its quotas referenced at the last pass."""
    _key_users: dict[tuple[str, str], int] = field(default_factory=dict)
    """Per key Secret: how many policies' last passes referenced it; only those are cached."""
    _waiting: dict[PolicyKey, int] = field(default_factory=dict)
    """Per policy: callers of :meth:`request`/:meth:`reconcile` holding or awaiting its lock."""
    _gone: set[PolicyKey] = field(default_factory=set)
    """Policies whose last pass found nothing of them (no policy, quota or labelled Pod): their
    lock and tickets go with the last caller (:meth:`_leave`)."""
    monotonic: Callable[[], float] = time.monotonic
    """The clock of :attr:`_lagging` (injected by tests)."""
    _lagging: dict[str, float] = field(default_factory=dict)
    """Per namespace: until when (``monotonic``) its key Secrets are re-read by quorum without
    probing the watch cache (:data:`LAGGING_CACHE_S`)."""

    def __post_init__(self) -> None:
        self.statuses = StatusWriter(
            self._flush,
            concurrency=self.status_concurrency,
            per_second=self.status_writes_per_second,
        )
        self.prefetch = KeyPrefetch(self._read_many)

    def prefetch_keys(self, quotas: Iterable[QuotaView]) -> None:
        """During Kopf's initial listing, on the leader (the caller's checks): read in the
        background the key Secrets of ``quotas`` that no stored status shows published at
        their generation (:mod:`.prefetch`; the published ones are seeded from the stored
        document, :meth:`_seed_keys`)."""
        self.prefetch.ask(
            (q.namespace, q.key_secret)
            for q in quotas
            if q.key_secret is not None
            and not published_at(q)
            and not isinstance(self._keys.get((q.namespace, q.key_secret)), tuple)
        )

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of our API threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def request(
        self,
        key: PolicyKey,
        snapshot: Callable[[], Snapshot],
        logger: kopf.Logger,
        *,
        after_conflict: bool = False,
    ) -> None:
        """A pass of ``key`` that starts after this call, reading the world from ``snapshot``
        when it starts; returns when one has run. If another trigger's pass started after this
        call, that pass serves this one too (it read the indexes later than our trigger) and
        nothing more runs. A pass that fails raises in its own caller only; the others were
        served by a pass that saw their change, and its caller's retry covers them again."""
        self._snapshots[key] = snapshot
        if not after_conflict:
            self._conflicts.pop(key, None)
        ticket = self._requested[key] = self._requested.get(key, 0) + 1
        self._enter(key)
        try:
            async with self._lock(key):
                if self._served.get(key, 0) >= ticket:
                    return
                self._served[key] = self._requested[key]
                policies, quotas, sidecars = snapshot()
                await self._pass(key, policies, quotas, logger, sidecars)
        finally:
            self._leave(key)

    def _enter(self, key: PolicyKey) -> None:
        self._waiting[key] = self._waiting.get(key, 0) + 1

    def _leave(self, key: PolicyKey) -> None:
        """The last caller of a policy that is gone takes its lock, tickets and snapshot with it
        (nobody holds or awaits that lock then: a later caller makes a new one, alone)."""
        left = self._waiting.pop(key) - 1
        if left:
            self._waiting[key] = left
        elif key in self._gone:
            self._gone.discard(key)
            self._snapshots.pop(key, None)
            self._locks.pop(key, None)
            self._requested.pop(key, None)
            self._served.pop(key, None)

    async def refresh_keys(self, quotas: Iterable[QuotaView]) -> bool:
        """Read again every key Secret ``quotas`` reference (no watch reports a Secret's
        content; the resync calls this), at the resourceVersion etcd holds now (from the watch
        cache once it has caught up: as fresh as a quorum read, :meth:`_fresh_versions`); True
        if one read differs from the cache. Outside the policy's lock: passes go on
        meanwhile."""
        return await self._read_keys(
            {(q.namespace, q.key_secret) for q in quotas if q.key_secret is not None},
            only_unknown=False,
        )

    @property
    def term(self) -> int:
        """How many times this replica stepped down (:meth:`step_down`): what was read in
        another term is not this term's to publish (:mod:`.startview`)."""
        return self._term

    def step_down(self) -> None:
        """This replica no longer leads: forget the documents it serves, its queued status
        writes and its key cache (not refreshed while it stands by: a later term starts from
        the document stored then, :meth:`_seed_keys`)."""
        self._term += 1
        self.documents.clear()
        self.statuses.clear()
        self.prefetch.clear()
        self._keys.clear()
        self._seeded.clear()
        self._key_refs.clear()
        self._key_users.clear()

    async def _read_keys(self, secrets: set[tuple[str, str]], *, only_unknown: bool) -> bool:
        """Read key Secrets into the cache; True if one read differs from the cache. With
        ``only_unknown``, those never read or whose last read found a problem (a Secret created
        later is picked up by the next pass): a pass over 10,000 keyed quotas makes no reads
        when nothing is new. Read in chunks of :data:`READ_CHUNK`, pipelined, at most
        :data:`READ_CONNECTIONS` chunks at a time (:meth:`.KubeApi.key_hashes_many`)."""
        term = self._term
        if only_unknown:
            secrets = {s for s in secrets if not isinstance(self._keys.get(s), tuple)}
            if secrets and len(self.prefetch):  # read during the listing (.prefetch)?
                claimed = await self.prefetch.claim(secrets)
                if term != self._term:
                    return False
                self._keys.update((s, f) for s, f in claimed.items() if s in self._key_users)
                secrets = {s for s in secrets if not isinstance(self._keys.get(s), tuple)}
        if not secrets:
            return False
        wanted = sorted(secrets)
        # A pass's reads of new Secrets may come from the API server's watch cache as it is
        # (a moment behind at most). The resync's re-read bounds how late a revoked key is
        # dropped: it reads at the resourceVersion of etcd now (:meth:`_fresh_versions`), so a
        # lagging watch cache cannot stretch that bound (a quorum read where none is known).
        versions = await self._fresh_versions(wanted) if not only_unknown else {}
        found = await self._read_many(wanted, versions)
        if term != self._term:  # stepped down meanwhile: a later term reads afresh
            return False
        # Only Secrets some policy's last pass referenced are kept: a quota deleted while its
        # Secret was read (the resync reads outside the lock) leaves nothing behind.
        kept = [(s, f) for s, f in zip(wanted, found, strict=True) if s in self._key_users]
        changed = any(self._keys.get(s) != f for s, f in kept)
        self._keys.update(kept)
        return changed

    async def _read_many(
        self, wanted: list[tuple[str, str]], versions: Mapping[str, str] | None = None
    ) -> list[KeyLookup]:
        """Key Secrets ``wanted`` (sorted), read in chunks of :data:`READ_CHUNK` (one
        namespace each), pipelined, :data:`READ_CONNECTIONS` chunks at a time, each namespace
        at its resourceVersion in ``versions`` (default ``"0"``: the watch cache as it is)."""
        at = versions or {}
        chunks = [wanted[i : i + READ_CHUNK] for i in range(0, len(wanted), READ_CHUNK)]
        # A chunk holds one namespace's Secrets only (each has its resourceVersion).
        chunks = [c for chunk in chunks for c in _by_namespace(chunk)]
        found_chunks = await _bounded(
            (
                self._call(self.api.key_hashes_many, chunk, at.get(chunk[0][0], "0"))
                for chunk in chunks
            ),
            READ_CONNECTIONS,
        )
        return [lookup for chunk in found_chunks for lookup in chunk]

    async def _fresh_versions(self, secrets: list[tuple[str, str]]) -> dict[str, str]:
        """Per namespace of ``secrets`` (sorted): the resourceVersion its reads are made at,
        etcd's revision now (:meth:`.KubeApi.fresh_version`), or ``""`` (quorum reads) where
        that could not be had."""
        now = self.monotonic()
        for namespace in [ns for ns, until in self._lagging.items() if until <= now]:
            del self._lagging[namespace]
        fresh: dict[str, str] = {}  # ``""`` for a namespace whose cache lagged lately
        first: dict[str, str] = {}
        for namespace, name in secrets:
            if namespace in self._lagging:
                fresh[namespace] = ""
            else:
                first.setdefault(namespace, name)
        versions = await asyncio.gather(
            *(self._call(self.api.fresh_version, ns, name) for ns, name in first.items()),
            return_exceptions=True,
        )
        for namespace, version in zip(first, versions, strict=True):
            fresh[namespace] = version if isinstance(version, str) else ""
            if version == "":  # the probe's 504: the cache lags (a failed call is not that)
                self._lagging[namespace] = now + LAGGING_CACHE_S
        return fresh

    async def _seed_keys(self, key: PolicyKey, policy: PolicyView, keyed: list[QuotaView]) -> None:
        """The first pass of ``key`` with a cold cache takes the digests of each quota whose
        status says it is published at its current generation (so its tenant id and Secret
        reference are those published) from the document stored in the policy's Secret now:
        the digests its sidecars enforce, as fresh as the last pass of whoever led (a key
        Secret's change is picked up by the resync's re-read, as always). A quota not in that
        document, new, or changed since is read as usual."""
        if key in self._seeded:
            return
        self._seeded.add(key)
        cold = [
            q
            for q in keyed
            if (q.namespace, str(q.key_secret)) not in self._keys and published_at(q)
        ]
        if not cold:
            return
        term = self._term
        published = await self._call(self.api.published_keys, policy)
        if term != self._term:
            return
        for quota in cold:
            digests = published.get(quota.tenant_id)
            if digests:
                self._keys.setdefault((quota.namespace, str(quota.key_secret)), digests)

    def _remember(self, key: PolicyKey, members: frozenset[str]) -> None:
        """Policy ``key``'s objects are ``members`` (uids) now: what was written over one that
        left (deleted, or moved to another policy) is forgotten."""
        left = self._members.get(key, frozenset()) - members
        if left:  # what moved to another policy keeps what that policy wrote over it
            elsewhere = set().union(*(m for k, m in self._members.items() if k != key))
            for uid in left - elsewhere:
                self._written.pop(uid, None)
        self._members[key] = members

    def _refer(self, key: PolicyKey, secrets: Iterable[tuple[str, str]]) -> None:
        """Policy ``key`` references ``secrets`` now; a key Secret no policy references any
        more leaves the cache."""
        now = frozenset(secrets)
        before = self._key_refs.get(key, frozenset())
        if now:
            self._key_refs[key] = now
        else:
            self._key_refs.pop(key, None)
        for secret in now - before:
            self._key_users[secret] = self._key_users.get(secret, 0) + 1
        for secret in before - now:
            users = self._key_users.pop(secret) - 1
            if users:
                self._key_users[secret] = users
            else:
                self._keys.pop(secret, None)

    def _forget(self, key: PolicyKey) -> None:
        """Nothing of policy ``key`` exists (no policy, quota or labelled Pod): drop what is
        kept per policy (its lock and tickets when its last caller leaves, :meth:`_leave`)."""
        self._gone.add(key)
        # Its snapshot goes with its last caller (:meth:`_leave`): a caller awaiting the lock
        # has just set it, for its own pass and a pass after a conflict.
        for per_policy in (self._replicas, self._unprotected, self._conflicts):
            per_policy.pop(key, None)
        self._remember(key, frozenset())
        self._members.pop(key, None)
        self._seeded.discard(key)
        self._refer(key, ())
        self.statuses.forget(key)
        for gauge, labels in (
            (self.metrics.pods_without_sidecar, key),
            (self.metrics.sidecars, (*key, "current")),
            (self.metrics.sidecars, (*key, "stale")),
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

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
        self._enter(key)
        try:
            async with self._lock(key):
                await self._pass(key, policies, quotas, logger, sidecars)
        finally:
            self._leave(key)

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
        self._gone.discard(key)
        self._remember(key, frozenset([*(p.uid for p in live[:1]), *(q.uid for q in members)]))
        if not live:
            self.documents.withdraw(key)
            self._refer(key, ())
            await self._queue_quotas(key, members, lambda q: quota_status_orphan(q, now), logger)
            if not members and not labelled:
                self._forget(key)
            return
        policy = live[0]
        keyed = [q for q in members if q.key_secret is not None]
        self._refer(key, {(q.namespace, str(q.key_secret)) for q in keyed})
        term = self._term
        await self._seed_keys(key, policy, keyed)
        await self._read_keys({(q.namespace, str(q.key_secret)) for q in keyed}, only_unknown=True)
        if term != self._term:  # the cache was emptied under us
            raise NotLeader(f"stepped down during the pass of {key[0]}/{key[1]}")
        lookups = {q.name: self._keys[(q.namespace, str(q.key_secret))] for q in keyed}
        # In a thread, pure: at 10,000 tenants ~0.5 s of CPU (more on a loaded machine), which
        # on the loop would hold Kopf's events, the Lease's renewals and the webhooks that long.
        replicas = self._replicas[key]
        rendering = await self._call(render_config, policy, members, lookups, replicas)
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
        # Over our own last write when the watch has not brought it back yet (back-to-back
        # passes: the first one's write): the same status, not a rewrite at a stale version.
        policy = self._effective(policy)
        status = policy_status(policy, rendering, now=now, unprotected=unprotected)
        await self._write(key, POLICY_PLURAL, policy, status)
        _warn_if_new(policy, status, SIDECARS_INJECTED)
        await self._queue_quotas(
            key,
            members,
            lambda q: quota_status(q, rendering.verdicts[q.name], rendering, now=now),
            logger,
        )

    async def _queue_quotas(
        self,
        key: PolicyKey,
        quotas: Iterable[QuotaView],
        status_of: Callable[[QuotaView], dict[str, Any]],
        logger: kopf.Logger,
    ) -> None:
        """Hand the statuses of ``quotas`` that differ from the stored ones to the writer (in
        place of whatever of policy ``key`` it still holds). Each is computed over our own
        write when the snapshot predates it (:meth:`_effective`), so that a lagging watch
        makes no new status (a new first ``configVersion``, a new ``lastTransitionTime``).
        The loop is let go every :data:`QUEUE_CHUNK` quotas: 10,000 statuses are ~1 s of CPU
        on the 2-core test machine (several seconds when it is loaded), which in one step
        would hold Kopf's events and the Lease's renewals that long."""
        writes = []
        for done, quota in enumerate(quotas, 1):
            if done % QUEUE_CHUNK == 0:
                await asyncio.sleep(0)
            effective = self._effective(quota)
            status = status_of(effective)
            if differs(dict(quota.status), status) and not self._wrote(quota, status):
                writes.append(
                    StatusWrite(key, QUOTA_PLURAL, quota, status, effective.status, logger)
                )
        self.statuses.submit(key, writes)

    def _wrote(self, view: ObjectView, status: Mapping[str, Any]) -> bool:
        """We wrote ``status`` last over ``view`` (or over what our writes made of it)."""
        written = self._written.get(view.uid)
        return written is not None and written.holds(view) and written.status == status

    def _effective(self, view: V) -> V:
        """``view`` with the status we queued, are writing or wrote over its very
        resourceVersion (the watch has not brought it back yet)."""
        queued = self.statuses.queued(view.uid)
        if queued is not None and queued.view.resource_version == view.resource_version:
            ours: Mapping[str, Any] | None = queued.status
        else:
            written = self._written.get(view.uid)
            ours = written.status if written is not None and written.holds(view) else None
        if ours is None:
            return view
        return dataclasses.replace(view, status={**view.status, **ours})

    async def _flush(self, write: StatusWrite) -> None:
        """One queued status write (the :class:`StatusWriter` calls it): a 409 asks for another
        pass of the policy; ``NotLeader`` drops every queued write; any other failure drops the
        policy's (logged once; the resync repairs)."""
        view = write.view
        try:
            await self._write(
                write.policy, write.plural, view, write.status, previous=write.previous
            )
        except NotLeader as exc:
            self.statuses.clear()
            write.logger.info(f"queued status writes dropped: {exc}")
        except Exception as exc:
            if is_conflict(exc):
                self._pass_after_conflict(write.policy, write.logger)
                return
            self.statuses.forget(write.policy)
            write.logger.warning(
                f"status of {write.plural} {view.namespace}/{view.name} not written "
                f"({exc.__class__.__name__}: {exc}); the policy's queued status writes are "
                "dropped, the resync writes them again"
            )

    def _pass_after_conflict(self, key: PolicyKey, logger: kopf.Logger) -> None:
        """One more pass of ``key`` :data:`CONFLICT_DELAY_S` from now (one at a time, at most
        :data:`CONFLICT_RETRIES` until a trigger asks for a pass), reading the world where its
        last :meth:`request` did; none for a pass never requested (:meth:`reconcile`)."""
        snapshot = self._snapshots.get(key)
        if snapshot is None or key in self._retries:
            return
        tries = self._conflicts[key] = self._conflicts.get(key, 0) + 1
        if tries > CONFLICT_RETRIES:
            if tries == CONFLICT_RETRIES + 1:
                logger.info(f"status writes of {key[0]}/{key[1]}: conflicts; the resync repairs")
            return

        async def again() -> None:
            try:
                await asyncio.sleep(CONFLICT_DELAY_S)
                if self.api.may_write():
                    await self.request(key, snapshot, logger, after_conflict=True)
            except NotLeader:
                pass
            except Exception:
                logger.exception(f"pass of {key[0]}/{key[1]} after a conflict failed")
            finally:
                self._retries.pop(key, None)

        self._retries[key] = asyncio.create_task(again(), name=f"tokenfair-retry-{key[1]}")

    async def drain(self) -> None:
        """Return once every queued status write is done (tests and the bench)."""
        await self.statuses.drain()

    async def close(self) -> None:
        """Stop the status writer and any pending pass after a conflict (queued writes are
        dropped: the next leader's, or our next, pass writes them)."""
        retries = list(self._retries.values())
        for task in retries:
            task.cancel()
        prefetching = self.prefetch.clear()
        await asyncio.gather(
            *retries, *([prefetching] if prefetching else []), return_exceptions=True
        )
        await self.statuses.close()

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
        metrics ``scrapes``) into the policy's status, only when it changed (:mod:`.rollout`),
        and not while a pass of the policy runs: it writes the policy's status over the version
        it read (the next round writes this; the pass's write would lose to this one)."""
        document = self.documents.get(key)
        version = document.version if document else str(policy.status.get("configVersion", ""))
        fresh = rollout_status(ready, scrapes, version)
        self.metrics.sidecars.labels(*key, "current").set(fresh["sidecarsCurrent"])
        self.metrics.sidecars.labels(*key, "stale").set(ready - fresh["sidecarsCurrent"])
        passing = key in self._locks and self._locks[key].locked()
        if rollout_changed(policy.status, fresh) and not passing:
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

    async def _write(
        self,
        key: PolicyKey,
        plural: str,
        view: ObjectView,
        status: dict[str, Any],
        *,
        previous: Mapping[str, Any] | None = None,
    ) -> None:
        """Write ``status`` if it differs from the snapshot's, conditional on the snapshot's
        resourceVersion (a stale snapshot is a 409, never a lost update). A status we wrote
        over this very snapshot already is not written again: the watch has not brought our
        own write back yet, and writing it again would only earn a 409. A snapshot our own
        writes have passed (the watch lags them) is written over the resourceVersion our last
        write got instead: what we wrote is all that changed since (anyone else's write makes
        it a 409 as before), so back-to-back passes (a bulk apply: each pass a new tenant count
        in the policy's status) do not each lose a race with the previous one's write. A
        Warning Event goes with a refusal that ``previous`` (default: the snapshot's status)
        did not have."""
        if not differs(dict(view.status), status):
            return
        written = self._written.get(view.uid)
        if written is not None and written.holds(view):
            if written.status == status:
                return
            version = written.now or view.resource_version
            versions = written.versions | {version}
        else:
            version, versions = view.resource_version, frozenset({view.resource_version})
        answered = await self._call(
            self.api.patch_status, plural, view.namespace, view.name, status, version
        )
        if view.uid in self._members.get(key, ()):  # not an object deleted meanwhile
            self._written[view.uid] = Written(versions, status, answered or "")
        refusal = ready_reason(status["conditions"])
        before = view.status if previous is None else previous
        if refusal is not None and refusal != ready_reason(before.get("conditions", [])):
            reason, message = refusal
            body = kopf.Body(cast(Any, object_reference(view)))
            events.warn(body, reason=reason, message=message)


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
        events.warn(body, reason=new["reason"], message=new["message"])


def _by_namespace(chunk: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """``chunk`` (sorted) cut where the namespace changes."""
    parts: list[list[tuple[str, str]]] = []
    for secret in chunk:
        if not parts or parts[-1][0][0] != secret[0]:
            parts.append([])
        parts[-1].append(secret)
    return parts


async def _bounded(calls: Iterable[Awaitable[T]], limit: int) -> list[T]:
    """Await ``calls`` with at most ``limit`` running, results in order; the first failure is
    raised once all have finished (none is left running)."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        try:
            async with gate:
                return await call
        finally:  # cancelled before its turn: never started, closed (no "never awaited")
            if inspect.iscoroutine(call):
                call.close()

    pending = [one(call) for call in calls]
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


@dataclass(frozen=True, slots=True)
class Written:
    """Our status writes over one object that the watch may not have brought back yet."""

    versions: frozenset[str]
    """resourceVersions the watch may still show the object at: the snapshot's that the first
    of these writes was made over, and each later write's."""
    status: dict[str, Any]
    """The status written last."""
    now: str
    """The resourceVersion the API server gave the object with that write ("": unknown)."""

    def holds(self, view: ObjectView) -> bool:
        """``view`` predates our last write (a version our writes were made over)."""
        return view.resource_version in self.versions


@dataclass(frozen=True, slots=True)
class StatusWrite:
    """A status a pass wants written over ``view`` (the snapshot it was computed from: its
    resourceVersion makes the write conditional); ``previous`` is the status it was computed
    over (ours when the snapshot predates our write), for the Warning Event check."""

    policy: PolicyKey
    plural: str
    view: ObjectView
    status: dict[str, Any]
    previous: Mapping[str, Any]
    logger: kopf.Logger


class StatusWriter:
    """Writes statuses after the passes, in the background: at most ``concurrency`` at a time,
    at most ``per_second``, oldest first. Coalesced: one queued write per object (the newest
    pass's), and each pass replaces every queued write of its policy (:meth:`submit`), so an
    object gone or back in line since is not written. Worker tasks start with the first write
    and run until :meth:`close`."""

    def __init__(
        self,
        write: Callable[[StatusWrite], Awaitable[None]],
        *,
        concurrency: int = STATUS_CONCURRENCY,
        per_second: float = STATUS_WRITES_PER_SECOND,
    ) -> None:
        self._write = write
        self._concurrency = concurrency
        self._interval_s = 1.0 / per_second
        self._pending: dict[str, StatusWrite] = {}
        """Object uid -> its queued write."""
        self._in_flight: dict[str, StatusWrite] = {}
        self._order: asyncio.Queue[str] = asyncio.Queue()
        self._in_order: set[str] = set()
        self._workers: list[asyncio.Task[None]] = []
        self._next_slot = 0.0

    def __len__(self) -> int:
        """Writes queued or being written."""
        return len(self._pending) + len(self._in_flight)

    def queued(self, uid: str) -> StatusWrite | None:
        """The write of object ``uid`` queued or being written, if any."""
        return self._pending.get(uid) or self._in_flight.get(uid)

    def submit(self, policy: PolicyKey, writes: Iterable[StatusWrite]) -> None:
        """Queue ``writes`` in place of every write of ``policy`` still queued."""
        wanted = {w.view.uid: w for w in writes}
        self.forget(policy, keep=wanted)
        self._pending.update(wanted)
        for uid in wanted:
            if uid not in self._in_order:
                self._in_order.add(uid)
                self._order.put_nowait(uid)
        while wanted and len(self._workers) < self._concurrency:
            self._workers.append(asyncio.create_task(self._work(), name="tokenfair-status"))

    def forget(self, policy: PolicyKey, keep: Mapping[str, StatusWrite] | None = None) -> None:
        """Drop the queued writes of ``policy`` (but those of uids in ``keep``)."""
        for uid in [u for u, w in self._pending.items() if w.policy == policy]:
            if keep is None or uid not in keep:
                del self._pending[uid]

    def clear(self) -> None:
        """Drop every queued write (a write in flight finishes)."""
        self._pending.clear()

    async def drain(self) -> None:
        """Return once nothing is queued or being written."""
        # ``join()`` returns once the count of unfinished writes *reached* zero: the last
        # ``task_done()`` wakes it, but whatever runs before it resumes may queue more (a pass
        # after a conflict resuming in that same loop step), and it returns all the same. So
        # join again until, as we return, nothing is queued (a write a worker took is in
        # ``_in_flight`` until its ``task_done()``).
        while True:
            await self._order.join()
            if not self._order.qsize() and not self._in_flight:
                return

    async def close(self) -> None:
        self.clear()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()

    async def _work(self) -> None:
        while True:
            uid = await self._order.get()
            try:
                self._in_order.discard(uid)
                write = self._pending.pop(uid, None)
                if write is not None:
                    self._in_flight[uid] = write
                    await self._pace()
                    await self._write(write)
            finally:
                self._in_flight.pop(uid, None)
                self._order.task_done()

    async def _pace(self) -> None:
        """Wait for the next of the evenly spaced write slots."""
        now = asyncio.get_running_loop().time()
        slot = max(now, self._next_slot)
        self._next_slot = slot + self._interval_s
        if slot > now:
            await asyncio.sleep(slot - now)


def quota_status_orphan(quota: QuotaView, now: str) -> dict[str, Any]:
    """Status of a quota whose policy is absent: refused, nothing published."""
    return quota_status(quota, orphan_verdict(quota), None, now=now)
