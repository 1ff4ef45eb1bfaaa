"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's ``leaderelection``.

Two (or more) operator replicas all watch, index and serve (admission webhooks, the sidecars'
document long-poll, ``/metrics``); only the leader reconciles, runs the periodic loops and
issues or rotates the webhook certificate. Kopf's own peering is not used: it pauses peers of
equal priority and its 60 s lifetime makes failover slow.

The Lease ``spec``: ``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``,
``renewTime``, ``leaseTransitions``. Every :data:`RETRY_S` seconds each replica reads it:

* no Lease: create it holding it (a lost create race is a 409: someone else leads);
* held by us: renew (``renewTime`` = now), a replace conditional on ``resourceVersion``;
* held by another: taken over only once it is *observed* unchanged for ``leaseDurationSeconds``
  on our own monotonic clock (no trust in other nodes' clocks, as client-go), or when its
  holder is empty (a leader that stopped cleanly released it: immediate handover);
  the takeover is a conditional replace, so two standbys cannot both win.

A leader that cannot renew for :data:`RENEW_DEADLINE_S` (< the lease duration) steps down
before anyone may take over: it stops reconciling while the Lease is still its own, so two
replicas never write at once (and every ConfigMap/Secret write is conditional on its
``resourceVersion`` anyway). Failover after a crash: at most ``LEASE_DURATION_S + RETRY_S``
(12 s) until the standby leads, which then runs a full pass at once.

Without ``$TOKENFAIR_LEADER_ELECTION`` (one replica) the operator always leads, no Lease.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes import client
from kubernetes.client import ApiException

from .kube import CONFLICT, NOT_FOUND

LEASE_DURATION_S: Final = 10
"""How long a Lease nobody renews keeps others out: the crash-failover time, mostly."""
RENEW_DEADLINE_S: Final = 7.0
"""A leader that could not renew for this long steps down (before the lease can expire)."""
RETRY_S: Final = 2.0
"""Seconds between attempts to acquire or renew."""
ADDRESS_ANNOTATION: Final = "tokenfair.io/http-address"

log = logging.getLogger("tokenfair.operator")

Callback = Callable[[], Coroutine[Any, Any, None]]


@dataclass
class LeaderElector:
    """Acquire and renew Lease ``namespace/name`` as ``identity``; :attr:`is_leader` says
    whether we lead now; ``on_lead`` runs (as a task) each time we become the leader."""

    api: Any
    namespace: str
    name: str
    identity: str
    on_lead: Callback | None = None
    advertise: str = ""
    """``host:port`` of this replica's HTTP server, written into the Lease while we lead
    (annotation :data:`ADDRESS_ANNOTATION`), so standbys can relay sidecars' long-polls."""
    clock: Callable[[], float] = time.monotonic
    is_leader: bool = False
    _observed: tuple[Any, ...] | None = None
    _observed_at: float = 0.0
    _renewed_at: float = 0.0
    _task: asyncio.Task[None] | None = None
    _lead_task: asyncio.Task[None] | None = None
    _first_round: asyncio.Event = field(default_factory=asyncio.Event)
    _leader_address: str = ""
    _coordination: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._coordination = client.CoordinationV1Api(self.api)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tokenfair-leader-election")

    def leader_address(self) -> str | None:
        """None while we lead; else the leader's advertised ``host:port`` ("" if unknown)."""
        return None if self.is_leader else self._leader_address

    async def first_round(self) -> None:
        """Wait until the first attempt is over (leading or not, :attr:`is_leader` is known)."""
        await self._first_round.wait()

    async def stop(self) -> None:
        """Stop trying; a leader releases the Lease (empty holder) so a standby takes over at
        its next attempt instead of after the lease duration."""
        for task in (self._task, self._lead_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._lead_task = None
        if self.is_leader:
            self.is_leader = False
            try:
                await asyncio.to_thread(self._release)
            except Exception as exc:
                log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)

    async def _run(self) -> None:
        while True:
            try:
                held = await asyncio.to_thread(self._try_acquire_or_renew)
            except Exception as exc:  # an unreachable API: no renewal this round
                log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
                held = False
            now = self.clock()
            if held:
                self._renewed_at = now
                if not self.is_leader:
                    self.is_leader = True
                    log.info("became the leader (Lease %s/%s)", self.namespace, self.name)
                    if self.on_lead is not None:
                        self._lead_task = asyncio.create_task(
                            self.on_lead(), name="tokenfair-on-lead"
                        )
            elif self.is_leader and now - self._renewed_at >= RENEW_DEADLINE_S:
                self.is_leader = False
                log.warning("stepped down: Lease %s/%s not renewed", self.namespace, self.name)
            self._first_round.set()
            await asyncio.sleep(RETRY_S)

    def _try_acquire_or_renew(self) -> bool:
        """One round (blocking); True if we hold the Lease after it."""
        now = datetime.datetime.now(datetime.UTC)
        try:
            lease = self._coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            return self._create(now)
        spec = lease.spec or client.V1LeaseSpec()
        annotations = dict(lease.metadata.annotations or {})
        self._leader_address = (
            annotations.get(ADDRESS_ANNOTATION, "") if spec.holder_identity else ""
        )
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds)
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        holder = spec.holder_identity or ""
        if holder and holder != self.identity:
            duration = spec.lease_duration_seconds or LEASE_DURATION_S
            if self.clock() - self._observed_at < duration:
                return False  # someone else's, and alive as far as we have seen
        taking_over = holder != self.identity
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = LEASE_DURATION_S
        spec.renew_time = now
        if taking_over:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        lease.spec = spec
        lease.metadata.annotations = {**annotations, ADDRESS_ANNOTATION: self.advertise}
        try:  # conditional on the resourceVersion we read: one winner
            self._coordination.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            if exc.status == CONFLICT:
                return False
            raise
        return True

    def _create(self, now: datetime.datetime) -> bool:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                annotations={ADDRESS_ANNOTATION: self.advertise},
            ),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=LEASE_DURATION_S,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        try:
            self._coordination.create_namespaced_lease(self.namespace, body)
        except ApiException as exc:
            if exc.status == CONFLICT:  # created by another replica just now
                return False
            raise
        return True

    def _release(self) -> None:
        lease = self._coordination.read_namespaced_lease(self.name, self.namespace)
        if lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        lease.spec.holder_identity = ""
        lease.spec.lease_duration_seconds = 1
        self._coordination.replace_namespaced_lease(self.name, self.namespace, lease)
