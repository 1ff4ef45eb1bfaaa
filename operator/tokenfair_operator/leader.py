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

Stepping down never waits for the API server. :attr:`LeaderElector.is_leader` is computed
from the local monotonic clock each time it is read: true only while the last successful
renewal *started* less than :data:`RENEW_DEADLINE_S` ago. A standby takes over no sooner than
``LEASE_DURATION_S`` after it observed that renewal, which it can only observe after it was
written, so the old leader stops at least ``LEASE_DURATION_S - RENEW_DEADLINE_S`` (3 s) before
the new one may start, whether its renewal failed, hangs or never returns (client-go's
``RenewDeadline`` < ``LeaseDuration``). Every Lease call carries a request timeout of
:data:`REQUEST_TIMEOUT_S` (a round makes at most two, well under the renew deadline) and runs
on the elector's own thread, so nothing else the operator does (TokenReviews, reconciler
calls) can delay a renewal. Writers ask :attr:`~LeaderElector.is_leader` right before each
write (:class:`.kube.KubeApi`'s guard, the document server), not once per pass.

Failover after a crash: at most ``LEASE_DURATION_S + RETRY_S`` (12 s) until the standby leads,
which then runs a full pass at once.

Without ``$TOKENFAIR_LEADER_ELECTION`` (one replica) the operator always leads, no Lease.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes import client
from kubernetes.client import ApiException

from .kube import CONFLICT, NOT_FOUND

LEASE_DURATION_S: Final = 10
"""How long a Lease nobody renews keeps others out: the crash-failover time, mostly."""
RENEW_DEADLINE_S: Final = 7.0
"""A leader whose last successful renewal started this long ago has stepped down (before the
lease can expire for anyone else)."""
RETRY_S: Final = 2.0
"""Seconds between attempts to acquire or renew."""
REQUEST_TIMEOUT_S: Final = 2.0
"""Bound on each Lease call (connect and answer): a round makes at most two (read, then
replace or create), 4 s < :data:`RENEW_DEADLINE_S`, so one hung call costs one round, not
the lease."""
WATCH_S: Final = 0.5
"""While a round's call is outstanding, how often the deadline is looked at (to log the step
down and run ``on_lose`` without waiting for the call)."""
ADDRESS_ANNOTATION: Final = "tokenfair.io/http-address"

log = logging.getLogger("tokenfair.operator")

Callback = Callable[[], Coroutine[Any, Any, None]]


@dataclass
class LeaderElector:
    """Acquire and renew Lease ``namespace/name`` as ``identity``; :attr:`is_leader` says
    whether we lead now; ``on_lead`` runs (as a task) each time we become the leader,
    ``on_lose`` (plain, on the loop) each time we stop."""

    api: Any
    namespace: str
    name: str
    identity: str
    on_lead: Callback | None = None
    on_lose: Callable[[], None] | None = None
    advertise: str = ""
    """``host:port`` of this replica's HTTP server, written into the Lease while we lead
    (annotation :data:`ADDRESS_ANNOTATION`), so standbys can relay sidecars' long-polls."""
    clock: Callable[[], float] = time.monotonic
    request_timeout_s: float = REQUEST_TIMEOUT_S
    coordination: Any = None
    """The ``CoordinationV1Api`` (default: over ``api``)."""
    _holding: bool = False
    """The last round that answered renewed (or acquired) the Lease."""
    _renewed_at: float = 0.0
    """When that round started, on :attr:`clock`."""
    _leading: bool = False
    """What :meth:`_note` last saw of :attr:`is_leader` (edges: log, callbacks)."""
    _observed: tuple[Any, ...] | None = None
    _observed_at: float = 0.0
    _task: asyncio.Task[None] | None = None
    _lead_task: asyncio.Task[None] | None = None
    _first_round: asyncio.Event = field(default_factory=asyncio.Event)
    _leader_address: str = ""
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, "tokenfair-lease")
    )
    """The Lease's own thread: its calls never queue behind anyone else's."""

    def __post_init__(self) -> None:
        if self.coordination is None:
            self.coordination = client.CoordinationV1Api(self.api)

    @property
    def is_leader(self) -> bool:
        """We lead *now*: the last successful renewal started under :data:`RENEW_DEADLINE_S`
        ago on the local clock, whatever the round in flight is doing."""
        return self._holding and self.clock() - self._renewed_at < RENEW_DEADLINE_S

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tokenfair-leader-election")

    def leader_address(self) -> str | None:
        """None while we lead; else the leader's advertised ``host:port`` ("" if unknown, or
        if the Lease still names us: a replica that stepped down never relays to itself)."""
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
        leading = self.is_leader
        self._holding = self._leading = False  # a clean stop, no step-down to report
        if leading:
            try:
                await self._in_thread(self._release)
            except Exception as exc:
                log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)
        self._executor.shutdown(wait=False)

    async def _run(self) -> None:
        while True:
            await self.attempt()
            self._first_round.set()
            await asyncio.sleep(RETRY_S)

    async def attempt(self) -> bool:
        """One round: acquire or renew; True if we hold the Lease after it. While its calls
        are outstanding the deadline is watched, so a hung API server makes us step down on
        time (:attr:`is_leader` is false from the deadline on in any case)."""
        started = self.clock()
        try:
            held = bool(await self._in_thread(self._try_acquire_or_renew))
        except Exception as exc:  # an unreachable API or a timeout: no renewal this round,
            # the deadline decides (a transient error costs no leadership)
            log.warning("Lease %s/%s: %s", self.namespace, self.name, exc)
            self._note()
            return False
        # An answer is definitive: renewed (from when the round started), or someone else's.
        self._holding = held
        if held:
            self._renewed_at = started
        self._note()
        return held

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        while True:
            done, _ = await asyncio.wait({future}, timeout=WATCH_S)
            self._note()
            if done:
                return future.result()

    def _note(self) -> None:
        """Act on a change of :attr:`is_leader` (log it, run the callbacks)."""
        leading = self.is_leader
        if leading == self._leading:
            return
        self._leading = leading
        if leading:
            log.info("became the leader (Lease %s/%s)", self.namespace, self.name)
            if self.on_lead is not None:
                previous = self._lead_task
                if previous is not None and not previous.done():
                    previous.cancel()  # a first pass from an earlier term: one at a time
                self._lead_task = asyncio.create_task(self.on_lead(), name="tokenfair-on-lead")
            return
        log.warning(
            "stepped down: Lease %s/%s not renewed within %.0f s",
            self.namespace,
            self.name,
            RENEW_DEADLINE_S,
        )
        lead_task = self._lead_task
        if lead_task is not None and not lead_task.done():
            lead_task.cancel()  # its writes would be refused (NotLeader) anyway
        if self.on_lose is not None:
            self.on_lose()

    def _try_acquire_or_renew(self) -> bool:
        """One round (blocking); True if we hold the Lease after it."""
        now = datetime.datetime.now(datetime.UTC)
        timeout = self.request_timeout_s
        try:
            lease = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=timeout
            )
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            return self._create(now)
        spec = lease.spec or client.V1LeaseSpec()
        annotations = dict(lease.metadata.annotations or {})
        holder = spec.holder_identity or ""
        self._leader_address = (
            annotations.get(ADDRESS_ANNOTATION, "") if holder and holder != self.identity else ""
        )
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds)
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
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
            self.coordination.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=timeout
            )
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
            self.coordination.create_namespaced_lease(
                self.namespace, body, _request_timeout=self.request_timeout_s
            )
        except ApiException as exc:
            if exc.status == CONFLICT:  # created by another replica just now
                return False
            raise
        return True

    def _release(self) -> None:
        timeout = self.request_timeout_s
        lease = self.coordination.read_namespaced_lease(
            self.name, self.namespace, _request_timeout=timeout
        )
        if lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        lease.spec.holder_identity = ""
        lease.spec.lease_duration_seconds = 1
        self.coordination.replace_namespaced_lease(
            self.name, self.namespace, lease, _request_timeout=timeout
        )
