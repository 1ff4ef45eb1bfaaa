"""Replay a trace over a pool of ``N`` replicas, each its own model server (serial or batching)
and scheduler, with or without pool-wide fairness (:mod:`tokenfair.core.pool_order`) shared
between them.

**Routing** (where each request lands; it runs there or nowhere):

* ``round-robin`` — the ``k``-th request of the trace goes to replica ``k mod N``;
* ``affinity`` — each run of :data:`AFFINITY_RUN` consecutive requests of a tenant (a client's
  keep-alive connection, a session) goes to one replica, chosen by a hash (CRC-32) of the
  tenant and the run's number: every tenant spreads over the pool, unevenly at any moment;
* ``skewed`` — the ``pinned`` tenants' requests all go to replica 0 (a LoRA only it holds, a
  client pinned to one endpoint); the others' go round robin over all replicas.

**Each replica** follows the serial server's event rules of :mod:`tokenfair.sim.simulator`
(it decides exactly as ``_replay`` would on the requests routed to it, when it has no pool):
at each of its steps it frees the KV whose residency ended, submits the arrivals routed to it up
to its clock, expires, and dispatches one request, its clock jumping to the request's end (where
the request is settled with its actual usage); idle, it jumps to its next event. The replicas
step in the order of their clocks (the least first, replica index among equals), so a replica
acts at time ``t`` after every other replica has acted up to ``t``.

**The pool's store** (``pool=True``) is :class:`MemoryPoolStore`: the totals the Redis script
keeps (:mod:`tokenfair.server.pool_fairness`), in a dict. Before each dispatch a replica sends a
batch when :meth:`~tokenfair.core.pool_order.PoolService.due` says so (the sidecar's rule: every
``lease_tokens`` of service, or ``sync_ms`` with work to send or tenants to order), and takes
the answer at once: the simulator models the batching interval, not the store's round trip (the
sidecar does not wait for it either; its order uses the previous answer meanwhile). The same
:class:`~tokenfair.core.pool_order.PoolService` methods run as in the sidecar.

**A batching engine** (``maxBatchRequests`` above 1) is replayed on each replica by the
single-replica batching replay itself (:func:`tokenfair.sim.simulator.replay_batching`, the
same loop, paced): it stops before each of its events, and the pool resumes the replica whose
next event is the earliest (replica index among equals), so here too a replica acts at time
``t`` after every other replica has acted up to ``t``; the batch to the store is sent at each
event, after the expiries and before the dispatches, when ``due``.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from tokenfair.config import Config
from tokenfair.core import Decision, make_scheduler
from tokenfair.core.errors import SimulationStuckError
from tokenfair.core.jobs import STATUS_OK
from tokenfair.core.pool_order import PoolService
from tokenfair.core.rounding import round_hundredths
from tokenfair.core.scheduler import Scheduler
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.sim.simulator import PACE, Arrival, replay_batching

ROUTINGS: Final = ("round-robin", "affinity", "skewed")
AFFINITY_RUN: Final = 16
"""Consecutive requests of a tenant that ``affinity`` routing sends to one replica."""
DEFAULT_SYNC_MS: Final = 500.0
DEFAULT_LEASE_TOKENS: Final = 20_000
DEFAULT_SLICE_MS: Final = 1_000.0
"""The slices of the time-constrained reference (:attr:`PoolReplay.sliced_served`): a request
waits at most a wait limit, so service offered in one second cannot be given ten seconds later
(the reference over the whole window assumes it can)."""


class MemoryPoolStore:
    """The pool's fairness totals in memory: per lane, each tenant's pool-wide service in whole
    service tokens (what the Redis hash of each lane holds)."""

    def __init__(self, lanes: int = 2) -> None:
        self.totals: tuple[dict[str, int], ...] = tuple({} for _ in range(lanes))
        self.calls = 0
        """Batches answered (one store call each, as the Redis script is)."""

    def apply(self, batch: tuple[list[tuple[str, int]], ...]) -> tuple[list[int], ...]:
        """Add each ``(tenant, tokens)`` of ``batch`` and answer every named tenant's total."""
        self.calls += 1
        answer: list[list[int]] = []
        for totals, entries in zip(self.totals, batch, strict=True):
            values = []
            for tenant_id, tokens in entries:
                value = totals.get(tenant_id, 0) + tokens
                totals[tenant_id] = value
                values.append(value)
            answer.append(values)
        return tuple(answer)


def route(
    arrivals: Sequence[Arrival], replicas: int, routing: str, pinned: Sequence[str] = ()
) -> list[int]:
    """The replica of each arrival (in the order given), by ``routing`` (module docstring)."""
    if replicas < 1:
        raise ValueError(f"replicas: must be at least 1 (got {replicas})")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: must be one of {', '.join(ROUTINGS)} (got {routing!r})")
    pinned_set = set(pinned)
    placed: list[int] = []
    spread = 0
    seen: dict[str, int] = {}
    for request, _, _ in arrivals:
        tenant_id = request.tenant_id
        if routing == "affinity":
            number = seen.get(tenant_id, 0)
            seen[tenant_id] = number + 1
            key = f"{tenant_id}:{number // AFFINITY_RUN}".encode()
            placed.append(zlib.crc32(key) % replicas)
        elif routing == "skewed" and tenant_id in pinned_set:
            placed.append(0)
        else:
            placed.append(spread % replicas)
            spread += 1
    return placed


class _Replica:
    """One replica's state between its steps (a serial one's: ``_replay``'s locals; a batching
    one uses its scheduler, arrivals and pool only, the rest is its replay's)."""

    def __init__(
        self, index: int, scheduler: Scheduler, arrivals: list[Arrival], pool: PoolService | None
    ) -> None:
        self.index = index
        self.scheduler = scheduler
        self.arrivals = arrivals
        self.next_arrival = 0
        self.pool = pool
        self.pending: dict[str, Arrival] = {}
        self.releases: list[tuple[float, int, str]] = []
        self.sequence = 0
        self.clock_ms = arrivals[0][0].arrival_ms if arrivals else math.inf
        self.served: dict[str, int] = {}
        """Service tokens (actual) served here per tenant."""


class PoolReplay:
    """A pool replay's outcome besides its decisions: the store's calls, and per replica the
    service each tenant offered there and was given there (in the arrival window)."""

    def __init__(self, replicas: int, slice_ms: float = DEFAULT_SLICE_MS) -> None:
        self.served: list[dict[str, int]] = [{} for _ in range(replicas)]
        self.offered: list[dict[str, int]] = [{} for _ in range(replicas)]
        self.slice_ms = slice_ms
        """The length of the slices of :attr:`sliced_served` and :attr:`sliced_offered`."""
        self.sliced_served: list[dict[tuple[int, str], int]] = [{} for _ in range(replicas)]
        """Per replica, :attr:`served` by ``(slice, tenant)``: the slice its request ended in."""
        self.sliced_offered: list[dict[tuple[int, str], int]] = [{} for _ in range(replicas)]
        """Per replica, :attr:`offered` by ``(slice, tenant)``: the slice its request arrived in."""
        self.store_calls = 0
        self.requests = 0
        self.schedulers: list[Scheduler] = []
        """Each replica's scheduler, for a caller that inspects it afterwards (its books)."""
        self.window_end_ms = math.inf
        """Service counts in :attr:`served` only for requests that ended by then (the last
        arrival: past it the offers are over and every replica serves what is left)."""

    def add_served(self, replica: int, tenant_id: str, tokens: int, end_ms: float) -> None:
        """A request of ``tenant_id`` that ran on ``replica`` ended at ``end_ms`` with
        ``tokens`` of service (counted if it ended in the arrival window)."""
        if end_ms > self.window_end_ms:
            return
        served = self.served[replica]
        served[tenant_id] = served.get(tenant_id, 0) + tokens
        key = (int(end_ms // self.slice_ms), tenant_id)
        sliced = self.sliced_served[replica]
        sliced[key] = sliced.get(key, 0) + tokens

    def add_offered(self, replica: int, tenant_id: str, tokens: int, arrival_ms: float) -> None:
        offered = self.offered[replica]
        offered[tenant_id] = offered.get(tenant_id, 0) + tokens
        key = (int(arrival_ms // self.slice_ms), tenant_id)
        sliced = self.sliced_offered[replica]
        sliced[key] = sliced.get(key, 0) + tokens


def replay_pool(
    config: Config,
    arrivals: Sequence[Arrival],
    policy: str,
    replicas: int,
    routing: str,
    *,
    pool: bool,
    pinned: Sequence[str] = (),
    sync_ms: float = DEFAULT_SYNC_MS,
    lease_tokens: int = DEFAULT_LEASE_TOKENS,
    outcome: PoolReplay | None = None,
) -> Iterator[tuple[Decision, int | None]]:
    """Replay ``arrivals`` (in ``(arrival_ms, request_id)`` order) over ``replicas`` replicas
    routed by ``routing``; ``pool``: the tokenfair schedulers share pool-wide service counters
    through a :class:`MemoryPoolStore` (other policies ignore it). Yields each decision once
    final with the request's recorded usage; ``outcome`` collects the rest."""
    placed = route(arrivals, replicas, routing, pinned)
    routed: list[list[Arrival]] = [[] for _ in range(replicas)]
    for arrival, replica in zip(arrivals, placed, strict=True):
        routed[replica].append(arrival)
    store = MemoryPoolStore() if pool else None
    result = outcome if outcome is not None else PoolReplay(replicas)
    result.requests = len(arrivals)
    if arrivals:
        result.window_end_ms = arrivals[-1][0].arrival_ms
    members: list[_Replica] = []
    for index in range(replicas):
        scheduler = make_scheduler(policy, config)
        service = None
        if store is not None and isinstance(scheduler, TokenfairScheduler):
            service = PoolService()
            scheduler.share_pool_service(service)
        members.append(_Replica(index, scheduler, routed[index], service))
        result.schedulers.append(scheduler)
        for arrival in routed[index]:
            request = arrival[0]
            asked = scheduler.cost.service_tokens(request.prefill_tokens, request.decode_tokens)
            result.add_offered(
                index,
                request.tenant_id,
                asked if arrival[1] is None else arrival[1],
                request.arrival_ms,
            )
    if config.policy.max_batch_requests > 1:
        yield from _replay_batching_pool(members, store, sync_ms, lease_tokens, policy, result)
        if store is not None:
            result.store_calls = store.calls
        return
    ready = [(member.clock_ms, member.index) for member in members if member.clock_ms < math.inf]
    heapq.heapify(ready)
    while ready:
        _, index = heapq.heappop(ready)
        member = members[index]
        yield from _step(member, store, sync_ms, lease_tokens, policy, result)
        if member.clock_ms < math.inf:
            heapq.heappush(ready, (member.clock_ms, index))
    if store is not None:
        result.store_calls = store.calls


def _step(
    member: _Replica,
    store: MemoryPoolStore | None,
    sync_ms: float,
    lease_tokens: int,
    policy: str,
    result: PoolReplay,
) -> Iterator[tuple[Decision, int | None]]:
    """One iteration of the serial replay's loop on one replica (``_replay``'s rules)."""
    scheduler = member.scheduler
    clock_ms = member.clock_ms
    releases = member.releases
    pending = member.pending
    while releases and releases[0][0] <= clock_ms:
        scheduler.release_kv(heapq.heappop(releases)[2])
    arrivals = member.arrivals
    while member.next_arrival < len(arrivals):
        arrival = arrivals[member.next_arrival]
        if arrival[0].arrival_ms > clock_ms:
            break
        member.next_arrival += 1
        refusal = scheduler.submit(arrival[0], clock_ms)
        if refusal is None:
            pending[arrival[0].request_id] = arrival
        else:
            yield refusal, arrival[1]
    if scheduler.expires_queued:
        for expired in scheduler.expire(clock_ms):
            yield expired, pending.pop(expired.request_id)[1]
    service = member.pool
    if service is not None and store is not None:
        backlogged = service.backlogged()
        if service.due(clock_ms, sync_ms, lease_tokens, backlogged):
            batch = service.take_batch(backlogged, clock_ms)
            service.absorb(batch, store.apply(batch))
    decision = scheduler.next_dispatch(clock_ms)
    if decision is None:
        events: list[float] = []
        upcoming = member.next_arrival < len(arrivals)
        if upcoming:
            events.append(arrivals[member.next_arrival][0].arrival_ms)
        queued = scheduler.queued_total
        if queued:
            if releases:
                events.append(releases[0][0])
            wakeup = scheduler.next_wakeup_ms(clock_ms)
            if wakeup is not None:
                events.append(wakeup)
        if not events:
            if queued:
                raise SimulationStuckError(
                    f"{policy}: replica {member.index}: {queued} request(s) queued at "
                    f"{clock_ms} ms with no event left"
                )
            member.clock_ms = math.inf
            while releases:  # done: the KV still held is freed (the books end at zero)
                scheduler.release_kv(heapq.heappop(releases)[2])
            return
        member.clock_ms = max(clock_ms, min(events))
        return
    request, used, used_kv = pending.pop(decision.request_id)
    if decision.status_code != STATUS_OK:
        yield decision, used
        return
    served_tokens = decision.service_tokens if used is None else used
    prefill_ms, execution_ms, kv_hold_ms = scheduler.cost.run_ms(
        request.prefill_tokens, served_tokens
    )
    wait_ms = clock_ms - decision.arrival_ms
    decision.ttft_ms = round_hundredths((wait_ms if wait_ms > 0.0 else 0.0) + prefill_ms)
    member.sequence += 1
    heapq.heappush(releases, (clock_ms + kv_hold_ms, member.sequence, decision.request_id))
    clock_ms += execution_ms
    member.clock_ms = clock_ms
    scheduler.complete(
        decision.request_id, clock_ms, used, actual_kv_blocks=used_kv, release_kv=False
    )
    result.add_served(member.index, decision.tenant_id, served_tokens, clock_ms)
    yield decision, used


def _replay_batching_pool(
    members: list[_Replica],
    store: MemoryPoolStore | None,
    sync_ms: float,
    lease_tokens: int,
    policy: str,
    result: PoolReplay,
) -> Iterator[tuple[Decision, int | None]]:
    """Each replica's batching replay, resumed in the order of the clocks it stops at."""
    replays: list[Iterator[tuple[Decision, int | None, float | None]]] = []
    ready: list[tuple[float, int]] = []
    for member in members:
        sync = None
        if member.pool is not None and store is not None:
            sync = _sync(member.pool, store, sync_ms, lease_tokens)
        replay = replay_batching(member.scheduler, iter(member.arrivals), policy, sync)
        replays.append(replay)
        for decision, _, clock_ms in replay:  # its first stop, before it acts
            if decision is PACE and clock_ms is not None:
                heapq.heappush(ready, (clock_ms, member.index))
            break
    while ready:
        _, index = heapq.heappop(ready)
        for decision, used, end_ms in replays[index]:
            if decision is PACE:
                if end_ms is not None:
                    heapq.heappush(ready, (end_ms, index))
                break
            if (
                end_ms is not None
                and decision.status_code == STATUS_OK
                and not decision.would_refuse  # served beside the modeled engine (shadow)
            ):
                tokens = decision.service_tokens if used is None else used
                result.add_served(index, decision.tenant_id, tokens, end_ms)
            yield decision, used


def _sync(
    service: PoolService, store: MemoryPoolStore, sync_ms: float, lease_tokens: int
) -> Callable[[float], None]:
    """A replica's exchange with the store before its dispatches (the serial step's rule)."""

    def sync(clock_ms: float) -> None:
        backlogged = service.backlogged()
        if service.due(clock_ms, sync_ms, lease_tokens, backlogged):
            batch = service.take_batch(backlogged, clock_ms)
            service.absorb(batch, store.apply(batch))

    return sync
