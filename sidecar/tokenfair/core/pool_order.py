"""Pool-wide service counters: each replica's DRR orders its tenants by the weighted service the
whole pool gave them (VTC's virtual counters, shared in batches), not only its own.

Without it every replica's round robin is fair on its own traffic only: a tenant whose requests
all reach one replica of four gets half of that replica against a flooder present everywhere
(1/8 of the pool) where pool-wide max-min, constrained by where each request can run, gives it
the whole replica. With it, a replica picks, among its tenants whose head can run now, the one
whose **pool-wide service per quantum** is least; a tenant well served elsewhere yields here.

**State, per lane and tenant** (integers in ``UNITS_PER_TOKEN`` units, like the DRR's):

* ``pool`` — the tenant's pool-wide service as the store last answered (every replica's batches
  that reached it, this replica's included), in units;
* ``pushing`` — this replica's service sent to the store and not yet answered (live only: the
  simulator's batches are answered at once);
* ``unsynced`` — this replica's service not sent yet (at dispatch, the job's expected cost; at
  settlement, ``actual - expected``, which may be negative);
* ``offset`` — a local lift, in quanta (below).

The tenant's **counter** is ``(pool + pushing + unsynced) / Q + offset``, ``Q`` its quantum in
units (``base_quantum_tokens * weight``). The replica's own service enters at once; the others'
when a batch of this replica is answered (the store returns the totals of the tenants named).

**Joining** (VTC's lift): when a tenant **idle pool-wide** (neither served here nor moved in the
store's totals over the last :data:`IDLE_EPOCHS` batches) becomes backlogged in the lane, its
counter is clamped into ``[m - JOIN_LAG_QUANTA, m + JOIN_GAP_QUANTA]``, ``m`` the least counter
of the tenants already backlogged there (unchanged if none is): an idle tenant banks little, and
a tenant served long ago does not wait here behind more than ``JOIN_GAP_QUANTA`` quanta of the
others' service. A tenant still served somewhere is not clamped when its queue here empties and
fills again: its counter is its share, and the view's staleness (docs/fairness.md §9.2) can put
it many quanta from ``m``. The clamp is
this replica's (the offset is never shared): two tenants that stay backlogged here are ordered
by their pool-wide service alone.

**Batches** (:meth:`PoolService.take_batch`, :meth:`PoolService.absorb`): what each tenant's
``unsynced`` holds in whole service tokens moves to ``pushing`` and is sent with the names of
the tenants backlogged here (their totals are read in the same call); the answer replaces
``pool`` and clears ``pushing``. A batch whose answer is lost counts as delivered locally (its
service stays in ``pool``) and is not sent again: at most one batch of this replica is missing
from, or doubled in, the others' view. The store keeps cumulative integers; no clock enters,
so clock skew between replicas changes nothing.

**Store down** (:attr:`LaneOrder.sharing` False): the DRR picks by its round robin again —
each replica's own fairness, as without a store — and service keeps being counted, to be sent
when the store is back.

The bound this gives pool-wide is derived in docs/fairness.md ("Pool-wide fairness").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from tokenfair.core.jobs import UNITS_PER_TOKEN

JOIN_GAP_QUANTA: Final = 1.0
"""A tenant that joins a lane's backlog starts at most this many quanta above the least
backlogged counter there (its older pool-wide service is not held against it beyond that)."""

JOIN_LAG_QUANTA: Final = 4.0
"""...and at most this many quanta below it."""

IDLE_EPOCHS: Final = 2
"""A tenant is idle pool-wide (and clamped when it joins) once neither this replica served it
nor its pool-wide total moved over this many batches of this replica."""

_UNIT: Final = UNITS_PER_TOKEN


class LaneOrder:
    """One lane's pool-wide service counters on one replica: what
    :class:`~tokenfair.core.drr.DeficitRoundRobin` asks at each pick (its ``order``)."""

    __slots__ = (
        "active_epoch",
        "backlog",
        "epoch",
        "offsets",
        "pool_units",
        "pushing_units",
        "sharing",
        "unsynced",
        "unsynced_units",
    )

    def __init__(self) -> None:
        self.backlog: Callable[[], list[str]] = list
        """The tenants backlogged in the lane here (the DRR's, once it orders by this)."""
        self.pool_units: dict[str, int] = {}
        self.pushing_units: dict[str, int] = {}
        self.unsynced: dict[str, int] = {}
        self.offsets: dict[str, float] = {}
        self.unsynced_units = 0
        """Sum of the absolute values of ``unsynced`` since the last batch (its trigger)."""
        self.epoch = 0
        """Batches answered so far (:meth:`PoolService.absorb`)."""
        self.active_epoch: dict[str, int] = {}
        """Per tenant, the last epoch in which it was served here or its pool-wide total moved."""
        self.sharing = True
        """The DRR orders by the counters (True) or by its own round robin (the store is down)."""

    def service_units(self, tenant_id: str) -> int:
        """The tenant's pool-wide service as this replica knows it, in units."""
        return (
            self.pool_units.get(tenant_id, 0)
            + self.pushing_units.get(tenant_id, 0)
            + self.unsynced.get(tenant_id, 0)
        )

    def counter(self, tenant_id: str, quantum_units: int) -> float:
        """Pool-wide service per quantum, plus the local lift: least is served first."""
        return self.service_units(tenant_id) / quantum_units + self.offsets.get(tenant_id, 0.0)

    def served(self, tenant_id: str, units: int) -> None:
        """This replica gave ``units`` (negative: a settlement's refund) to the tenant."""
        self.unsynced[tenant_id] = self.unsynced.get(tenant_id, 0) + units
        self.unsynced_units += units if units > 0 else -units
        self.active_epoch[tenant_id] = self.epoch

    def joined(self, tenant_id: str, quantum_units: int, floor: float | None) -> None:
        """The tenant became backlogged; ``floor`` is the least counter of the tenants
        backlogged before it (None: none was). A tenant served anywhere in the pool within the
        last :data:`IDLE_EPOCHS` batches is not idle: its counter is left as it is (its queue
        here emptied, its share did not)."""
        if floor is None:
            return
        if self.active_epoch.get(tenant_id, -IDLE_EPOCHS - 1) >= self.epoch - IDLE_EPOCHS:
            return
        current = self.counter(tenant_id, quantum_units)
        wanted = current
        if wanted < floor - JOIN_LAG_QUANTA:
            wanted = floor - JOIN_LAG_QUANTA
        elif wanted > floor + JOIN_GAP_QUANTA:
            wanted = floor + JOIN_GAP_QUANTA
        if wanted != current:
            self.offsets[tenant_id] = self.offsets.get(tenant_id, 0.0) + (wanted - current)


class PoolService:
    """A replica's pool-wide service counters, one :class:`LaneOrder` per lane, and the batch
    protocol with the store (the simulator's in-memory store and the sidecar's Redis one run
    the same :meth:`take_batch` / :meth:`absorb`)."""

    __slots__ = ("lanes", "synced_at_ms")

    def __init__(self, lanes: int = 2) -> None:
        self.lanes: tuple[LaneOrder, ...] = tuple(LaneOrder() for _ in range(lanes))
        self.synced_at_ms = float("-inf")
        """When the last batch was taken (the caller's clock)."""

    def backlogged(self) -> tuple[list[str], ...]:
        """Per lane, the tenants backlogged here."""
        return tuple(lane.backlog() for lane in self.lanes)

    def due(
        self, now_ms: float, sync_ms: float, lease_tokens: int, backlogged: tuple[list[str], ...]
    ) -> bool:
        """Whether a batch is due: ``lease_tokens`` of service (absolute, over the lanes) given
        since the last one, or ``sync_ms`` passed and there is service to send or a lane here
        with two tenants or more backlogged (whose order needs the others' service)."""
        unsynced = self.unsynced_units()
        if unsynced >= lease_tokens * _UNIT:
            return True
        if now_ms - self.synced_at_ms < sync_ms:
            return False
        return unsynced > 0 or any(len(tenants) > 1 for tenants in backlogged)

    @property
    def sharing(self) -> bool:
        return self.lanes[0].sharing

    def set_sharing(self, sharing: bool) -> None:
        """Order by the pool's counters (True) or by each replica's round robin (False)."""
        for lane in self.lanes:
            lane.sharing = sharing

    def unsynced_units(self) -> int:
        """Service (absolute, in units) given since the last batch, over the lanes."""
        return sum(lane.unsynced_units for lane in self.lanes)

    def take_batch(
        self, backlogged: tuple[list[str], ...], now_ms: float
    ) -> tuple[list[tuple[str, int]], ...]:
        """Per lane, ``(tenant, whole service tokens to add)`` for every tenant with service to
        send or backlogged here (``backlogged[lane]``: their totals are read back; 0 to add).
        The sent part moves from ``unsynced`` to ``pushing`` (the remainder below a token
        stays)."""
        self.synced_at_ms = now_ms
        batch: list[list[tuple[str, int]]] = []
        for index, lane in enumerate(self.lanes):
            entries: list[tuple[str, int]] = []
            named: set[str] = set()
            unsynced = lane.unsynced
            pushing = lane.pushing_units
            for tenant_id, units in list(unsynced.items()):
                tokens = int(units / _UNIT)  # toward zero: the remainder keeps its sign
                if tokens:
                    sent = tokens * _UNIT
                    rest = units - sent
                    if rest:
                        unsynced[tenant_id] = rest
                    else:
                        del unsynced[tenant_id]
                    pushing[tenant_id] = pushing.get(tenant_id, 0) + sent
                    entries.append((tenant_id, tokens))
                    named.add(tenant_id)
            lane.unsynced_units = sum(abs(units) for units in unsynced.values())
            for tenant_id in backlogged[index] if index < len(backlogged) else ():
                if tenant_id not in named:
                    entries.append((tenant_id, 0))
                    named.add(tenant_id)
            batch.append(entries)
        return tuple(batch)

    def absorb(
        self, batch: tuple[list[tuple[str, int]], ...], totals: tuple[list[int], ...]
    ) -> None:
        """The store answered ``batch`` with each named tenant's pool-wide total (whole service
        tokens, this batch included), in the batch's order."""
        for lane, entries, values in zip(self.lanes, batch, totals, strict=True):
            pool = lane.pool_units
            pushing = lane.pushing_units
            active = lane.active_epoch
            epoch = lane.epoch
            for (tenant_id, tokens), total in zip(entries, values, strict=True):
                if tokens:
                    left = pushing.get(tenant_id, 0) - tokens * _UNIT
                    if left:
                        pushing[tenant_id] = left
                    else:
                        pushing.pop(tenant_id, None)
                units = total * _UNIT
                if pool.get(tenant_id, 0) + tokens * _UNIT != units:
                    active[tenant_id] = epoch  # served elsewhere since the last answer
                pool[tenant_id] = units
            lane.epoch = epoch + 1

    def lost(self, batch: tuple[list[tuple[str, int]], ...]) -> None:
        """The answer to ``batch`` never came: its service counts as delivered here (into
        ``pool``) and is not sent again."""
        for lane, entries in zip(self.lanes, batch, strict=True):
            pool = lane.pool_units
            pushing = lane.pushing_units
            for tenant_id, tokens in entries:
                if tokens:
                    units = tokens * _UNIT
                    left = pushing.get(tenant_id, 0) - units
                    if left:
                        pushing[tenant_id] = left
                    else:
                        pushing.pop(tenant_id, None)
                    pool[tenant_id] = pool.get(tenant_id, 0) + units
