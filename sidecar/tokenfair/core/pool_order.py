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

The tenant's **counter** is ``(pool + k * (pushing + unsynced)) / Q + offset``, ``Q`` its
quantum in units (``base_quantum_tokens * weight``). The replica's own service enters at once;
the others' when a batch of this replica is answered (the store returns the totals of the
tenants named). ``k``, the tenant's **gain** (:attr:`LaneOrder.gain`, in ``[1,
SHARE_GAIN_MAX]``), is its pool-wide service per token this replica gave it over the last few
batches: between batches the replica reckons that the others serving the tenant give it what
it gives, in the proportion they did lately. Without it every replica made up the whole
pool-wide deficit a batch showed on its own, the pool overshot about ``N`` times, and the
order swung by whole batch periods (docs/fairness.md §9.3.2); with it each replica makes up
its part. A tenant served only here has ``k = 1``.

**Joining** (VTC's lift): when a tenant **idle pool-wide** (neither served here nor moved in the
store's totals over the last :data:`IDLE_EPOCHS` batches) becomes backlogged in the lane, its
counter is clamped into ``[m - JOIN_LAG_QUANTA, m + JOIN_GAP_QUANTA]``, ``m`` the least counter
of the tenants already backlogged there (unchanged if none is): an idle tenant takes at most
``JOIN_LAG_QUANTA`` of its quanta (and one request) ahead of a tenant backlogged at ``m``, and a
tenant served above the others before it paused pays back at most ``JOIN_GAP_QUANTA`` quanta of
what this replica knew of it (service elsewhere not read here yet comes with the next batch,
unclamped). A tenant still served somewhere is not clamped when its queue here empties and
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

**Admission** (:meth:`LaneOrder.ahead_tokens`, docs/fairness.md §9.2.1): while the counters
order the lane, a new request's predicted wait follows them — its tenant's queue here, then
the work of the tenants whose counters are below its own until they catch up, the counters
moving meanwhile by what each tenant is served elsewhere (:attr:`LaneOrder.elsewhere_rate`,
read from the store's totals) — so a tenant served elsewhere faster than the tenants below it
are served here is refused at the door, not left to expire in the queue. The pick itself is
the least counter always (no exception for a head near its deadline: one starved a bursty
tenant, docs/fairness.md §9.2.1). The prediction weighs the tenants backlogged here one by one
and the tenants idle here but sending here as one aggregate: its cost is O(b log b) in the
``b`` backlogged tenants of the lane, whatever the number of tenants served lately, up to
``POOL_WEIGHED_TENANTS`` of them (core/tokenfair.py); past it, bounded: the backlogged tenants
are kept ranked by counter (:attr:`LaneOrder.ranked`), only those below
:meth:`LaneOrder.away_limit` can be ahead, at most that many are weighed, and the rest come
from the lane's sums (docs/fairness.md §9.2.1).

The bound this gives pool-wide is derived in docs/fairness.md ("Pool-wide fairness").
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import Final

from tokenfair.core.units import tokens_of, tokens_of_float, units_of, whole_tokens

JOIN_GAP_QUANTA: Final = 8.0
"""A tenant that joins a lane's backlog starts at most this many quanta above the least
backlogged counter there: of what it got above the others before it paused (as this replica
knew it), up to this many quanta are held against it, the rest forgiven. It delays only the
joiner, never a tenant already waiting; 1 before, which forgave nearly all of it (``pool-many``
with affinity: Jain 0.916 with 1, 0.960 with 8; docs/fairness.md §9.3.1)."""

JOIN_LAG_QUANTA: Final = 4.0
"""...and at most this many quanta below it: a joiner takes at most this many of its own quanta
(and one request) ahead of a tenant backlogged at the least counter all along (docs/fairness.md
§9.3.1: with requests of 640 tokens, 121 ms of a serial replica at 45 tokens/ms at weight 1,
441 ms at weight 4, about the default wait limit; 8 would double it)."""


IDLE_EPOCHS: Final = 2
"""A tenant is idle pool-wide (and clamped when it joins) once neither this replica served it
nor its pool-wide total moved over this many batches of this replica."""

ELSEWHERE_MEMORY_MS: Final = 2_000.0
"""Time constant of a tenant's service elsewhere (:attr:`LaneOrder.elsewhere_rate`), in ms of
the batches' clock: a few batches at the default ``sync_ms`` of 500."""

AWAY_QUANTA: Final = 32.0
"""A tenant whose counter stays this many of its quanta above another's level until the
admission's horizon is taken to take nothing here before it (:meth:`LaneOrder.ahead_tokens`'s
``away``): farther than the view's staleness moves the order (a few leases of service; 16 to 64
gave the same expiries within 0.3 points on the ``pool-*`` scenarios, 1 up to 2.6 %)."""

SHARE_GAIN_MAX: Final = 8.0
"""The largest factor by which this replica counts its own service to a tenant not yet sent
(:attr:`LaneOrder.gain`): the view may run ahead of the truth by at most ``SHARE_GAIN_MAX - 1``
times this replica's unanswered service (docs/fairness.md §9.2)."""

SHARE_GAIN_KEPT: Final = 0.75
"""Of a tenant's pool-wide and own service per batch (:attr:`LaneOrder.gain`'s two averages),
the part each answered batch keeps: a memory of about four batches."""


class LaneOrder:
    """One lane's pool-wide service counters on one replica: what
    :class:`~tokenfair.core.drr.DeficitRoundRobin` asks at each pick (its ``order``)."""

    __slots__ = (
        "active_epoch",
        "asking",
        "backlog",
        "clock_ms",
        "elsewhere_at_ms",
        "elsewhere_rate",
        "epoch",
        "gain",
        "gain_own",
        "gain_pool",
        "offsets",
        "pool_units",
        "pushing_units",
        "ranked",
        "ranked_keys",
        "ranked_quanta",
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
        self.gain: dict[str, float] = {}
        """Per tenant, ``k_i`` in ``[1, SHARE_GAIN_MAX]``: its pool-wide service per token this
        replica gives it, lately (``gain_pool / gain_own``; 1 if unknown). Its own service not
        answered yet counts ``k_i`` times in its counter, standing for what the other replicas
        that serve it give it meanwhile: a deficit the last batch showed is corrected by each
        replica for its part only, not by every replica in full (the order's swing,
        docs/fairness.md §9.3.2)."""
        self.gain_own: dict[str, float] = {}
        """Per tenant, this replica's service per answered batch (tokens, averaged with
        :data:`SHARE_GAIN_KEPT`)."""
        self.gain_pool: dict[str, float] = {}
        """Per tenant, the growth of its pool-wide total per answered batch (the same)."""
        self.sharing = True
        """The DRR orders by the counters (True) or by its own round robin (the store is down)."""
        self.elsewhere_rate: dict[str, float] = {}
        """Per tenant, the service the other replicas gave it lately, in units per ms of the
        batches' clock (:meth:`PoolService.absorb`; time constant :data:`ELSEWHERE_MEMORY_MS`):
        how fast its counter rises without this replica (:meth:`ahead_tokens`)."""
        self.elsewhere_at_ms: dict[str, float] = {}
        """Per tenant, when the batch that last read its total was taken."""
        self.clock_ms = float("-inf")
        """When the last answered batch was taken (the batches' clock)."""
        self.asking: dict[str, None] = {}
        """Tenants whose :attr:`elsewhere_rate` an admission read although the last answered
        batch did not name them (idle here): the next batch names them, so their rate is
        observed again (:meth:`ahead_tokens`)."""
        self.ranked: list[tuple[float, str]] = []
        """``(counter, tenant)`` of the tenants backlogged here, ascending (:meth:`enter`,
        :meth:`leave`; kept as the counters change): the least counter in O(1), the tenants
        below a level in O(log b + k) (:meth:`below`)."""
        self.ranked_keys: dict[str, float] = {}
        """Per tenant in :attr:`ranked`, its counter there."""
        self.ranked_quanta: dict[str, int] = {}
        """Per tenant in :attr:`ranked`, its quantum (units)."""

    def rank(self, tenants: list[tuple[str, int]]) -> None:
        """The backlogged tenants here are ``tenants`` (``(tenant, quantum)``): :attr:`ranked`
        afresh (when the lane starts ordering by these counters)."""
        quanta = dict(tenants)  # (a tenant named twice: its last quantum, as enter would)
        keys = {tenant_id: self.counter(tenant_id, units) for tenant_id, units in quanta.items()}
        self.ranked_quanta = quanta
        self.ranked_keys = keys
        self.ranked = sorted([(key, tenant_id) for tenant_id, key in keys.items()])

    def enter(self, tenant_id: str, quantum_units: int) -> None:
        """The tenant is backlogged here now (after :meth:`joined`), or its quantum changed."""
        if tenant_id in self.ranked_keys:
            self.leave(tenant_id)
        key = self.counter(tenant_id, quantum_units)
        self.ranked_keys[tenant_id] = key
        self.ranked_quanta[tenant_id] = quantum_units
        insort(self.ranked, (key, tenant_id))

    def leave(self, tenant_id: str) -> None:
        """The tenant is not backlogged here any more."""
        key = self.ranked_keys.pop(tenant_id, None)
        if key is None:
            return
        del self.ranked_quanta[tenant_id]
        ranked = self.ranked
        del ranked[bisect_left(ranked, (key, tenant_id))]

    def rekey(self, tenant_id: str) -> None:
        """The tenant's counter moved: its place in :attr:`ranked` (if it is there)."""
        key = self.ranked_keys.get(tenant_id)
        if key is None:
            return
        quantum_units = self.ranked_quanta[tenant_id]
        new_key = self.counter(tenant_id, quantum_units)
        if new_key == key:
            return
        ranked = self.ranked
        del ranked[bisect_left(ranked, (key, tenant_id))]
        self.ranked_keys[tenant_id] = new_key
        insort(ranked, (new_key, tenant_id))

    def rekey_moved(self, moved: list[tuple[str, float]]) -> None:
        """The counters of ``moved`` (``(tenant, new counter)``, each in :attr:`ranked` and
        changed) moved at once (a batch answered): one by one (two O(b) memmoves each) while
        they are at most ``sqrt(b)`` (O(b^1.5) at worst), else one sort of the ranking, nearly
        in order already (O(b log b)): a batch that moves every counter (a store outage ends, a
        store restart) costs no O(b²). The same list either way: ``(counter, tenant)`` pairs
        are all distinct and sort one way only (ties in counter by tenant)."""
        ranked = self.ranked
        keys = self.ranked_keys
        if len(moved) * len(moved) <= len(ranked):
            for tenant_id, new_key in moved:
                del ranked[bisect_left(ranked, (keys[tenant_id], tenant_id))]
                keys[tenant_id] = new_key
                insort(ranked, (new_key, tenant_id))
            return
        for tenant_id, new_key in moved:
            keys[tenant_id] = new_key
        fresh = [(keys[tenant_id], tenant_id) for _, tenant_id in ranked]
        fresh.sort()
        self.ranked = fresh

    def least_counter(self) -> float | None:
        """The least counter of the tenants backlogged here (None if none): O(1)."""
        return self.ranked[0][0] if self.ranked else None

    def below(self, limit: float, skip: str, most: int) -> tuple[list[str], float | None]:
        """The tenants backlogged here whose counters are below ``limit``, least first, but
        ``skip`` and at most ``most`` of them; and if more than ``most`` are below it, the
        counter of the first left out (None if none is): every one left out is at least
        that. O(most) once the least is found (O(1))."""
        found: list[str] = []
        for key, tenant_id in self.ranked:
            if key >= limit:
                return found, None
            if tenant_id == skip:
                continue
            if len(found) == most:
                return found, key
            found.append(tenant_id)
        return found, None

    def rate_is_stale(self, tenant_id: str) -> bool:
        """The tenant has a rate elsewhere that the last answered batch did not refresh (it
        did not name the tenant: idle here)."""
        return (
            tenant_id in self.elsewhere_rate
            and self.elsewhere_at_ms.get(tenant_id, self.clock_ms) < self.clock_ms
        )

    def service_units(self, tenant_id: str) -> int:
        """The tenant's pool-wide service as this replica knows it, in units: the store's
        last answer and this replica's service since (sent or not)."""
        return (
            self.pool_units.get(tenant_id, 0)
            + self.pushing_units.get(tenant_id, 0)
            + self.unsynced.get(tenant_id, 0)
        )

    def reckoned_units(self, tenant_id: str) -> float:
        """What the counter reads, in units: the store's last answer, plus this replica's
        service since (sent or not) times :attr:`gain` — ``pool + k * (pushing + unsynced)`` —
        for the service the other replicas give the tenant meanwhile. Each integer converted
        to a float once, explicitly: the same on both cores."""
        own = self.pushing_units.get(tenant_id, 0) + self.unsynced.get(tenant_id, 0)
        pool = float(self.pool_units.get(tenant_id, 0))
        if own <= 0:
            # A refund settled here (a request under its estimate, a running one cancelled)
            # says nothing of the others' service: counted once, not k times, or the view
            # falls below the truth by (k - 1) x the refund (review rev1207i F1).
            return pool + float(own)
        return pool + self.gain.get(tenant_id, 1.0) * float(own)

    def counter(self, tenant_id: str, quantum_units: int) -> float:
        """Pool-wide service per quantum, plus the local lift: least is served first.

        :meth:`reckoned_units` is a float (each integer converted once, explicitly): past
        2**53 units (~9 M tokens of pool-wide service) CPython rounds an int quotient once and
        the compiled core twice; float division is the same on both cores (exact below 2**53
        with a gain of 1, so unchanged there)."""
        return self.reckoned_units(tenant_id) / quantum_units + self.offsets.get(tenant_id, 0.0)

    def served(self, tenant_id: str, units: int) -> None:
        """This replica gave ``units`` (negative: a settlement's refund) to the tenant."""
        self.unsynced[tenant_id] = self.unsynced.get(tenant_id, 0) + units
        self.unsynced_units += units if units > 0 else -units
        self.active_epoch[tenant_id] = self.epoch
        if tenant_id in self.ranked_keys:
            self.rekey(tenant_id)

    def observe_gain(self, tenant_id: str, sent_tokens: int, grown_units: int) -> None:
        """A batch answered: this replica sent ``sent_tokens`` of the tenant's service and its
        pool-wide total grew by ``grown_units`` since the last answer (this batch included):
        :attr:`gain` afresh, ``k = clamp(pool / own, 1, SHARE_GAIN_MAX)`` over the two
        averages (exactly 1 for a tenant only ever served here; one served only elsewhere a
        while climbs toward the maximum, and decays back a quarter of the gap a batch once
        served here alone). A total that went down (a store restarted) counts as no growth."""
        kept = SHARE_GAIN_KEPT
        own = self.gain_own.get(tenant_id, 0.0) * kept + (1.0 - kept) * float(
            sent_tokens if sent_tokens > 0 else 0
        )
        grown = tokens_of(grown_units if grown_units > 0 else 0)
        pool = self.gain_pool.get(tenant_id, 0.0) * kept + (1.0 - kept) * grown
        self.gain_own[tenant_id] = own
        self.gain_pool[tenant_id] = pool
        if own <= 0.0 or pool <= own:
            self.gain.pop(tenant_id, None)
        elif pool >= own * SHARE_GAIN_MAX:
            self.gain[tenant_id] = SHARE_GAIN_MAX
        else:
            self.gain[tenant_id] = pool / own

    def joined(self, tenant_id: str, quantum_units: int, floor: float | None) -> None:
        """The tenant became backlogged; ``floor`` is the least counter of the tenants
        backlogged before it (None: none was). A tenant served anywhere in the pool within the
        last :data:`IDLE_EPOCHS` batches is not idle: its counter is left as it is (its queue
        here emptied, its share did not)."""
        current = self.counter(tenant_id, quantum_units)
        wanted = self.joining_counter(tenant_id, quantum_units, floor)
        if wanted != current:
            self.offsets[tenant_id] = self.offsets.get(tenant_id, 0.0) + (wanted - current)
            if tenant_id in self.ranked_keys:
                self.rekey(tenant_id)

    def joining_counter(self, tenant_id: str, quantum_units: int, floor: float | None) -> float:
        """The tenant's counter once it joins the backlog now (:meth:`joined`'s clamp)."""
        current = self.counter(tenant_id, quantum_units)
        if floor is None:
            return current
        if self.active_epoch.get(tenant_id, -IDLE_EPOCHS - 1) >= self.epoch - IDLE_EPOCHS:
            return current
        if current < floor - JOIN_LAG_QUANTA:
            return floor - JOIN_LAG_QUANTA
        if current > floor + JOIN_GAP_QUANTA:
            return floor + JOIN_GAP_QUANTA
        return current

    def ahead_tokens(
        self,
        own: tuple[str, int, int],
        joining: bool,
        floor: float | None,
        others: list[tuple[str, int, int, float]],
        idle_rate: float,
        rate: float,
        horizon_ms: float,
        away: list[str],
        folded: tuple[float, float, float, float] | None = None,
    ) -> float:
        """Service tokens this replica gives, in the lane, before a new request of tenant
        ``i`` can start, when it serves the least counter first (docs/fairness.md §9.2.1).

        ``own`` is ``(i, Q_i, q_i)`` (quantum and queued work here, in units); ``joining``:
        ``i`` is not backlogged here and joins with this request (its counter clamped as
        :meth:`joined` would, ``floor`` the least backlogged counter); ``others``: every other
        tenant backlogged here, ``(j, Q_j, q_j, lambda_j)`` with ``lambda_j`` its recent
        service here, tokens per ms (what it will add meanwhile); ``idle_rate``: what the
        tenants idle here send here, tokens per ms, one aggregate all taken ahead
        (``w_idle(t) = idle_rate t``: their counters are not read); ``rate`` the lane's service
        rate here, tokens per ms.

        ``i``'s request starts once its queue here is served and its counter, ``L_i = V_i +
        q_i/Q_i`` then, is the least. A tenant ``j`` whose counter is below that goes first
        until it reaches it, with what it has queued and what it sends meanwhile; the counters
        move meanwhile by the others' service too, ``e_i`` and ``e_j`` (:attr:`elsewhere_rate`,
        quanta per ms once divided by the quantum). So by ``t`` ms ``j`` takes::

            w_j(t) = max(0, min(q_j + lambda_j t, (L_i - V_j) Q_j + (e_i/Q_i - e_j/Q_j) Q_j t))

        and the request starts at the first ``t`` with ``rate * t >= q_i + sum_j w_j(t) +
        w_idle(t)``
        (:func:`first_crossing_ms`): what is ahead is ``rate * t`` then. A tenant served
        elsewhere faster than the tenants below it are served here never catches up with
        them: no such ``t`` within ``horizon_ms``, and the work ahead at ``horizon_ms`` is
        returned (more than ``rate * horizon_ms``). O(n log n) in ``others``: one
        :meth:`counter` and at most one piece per backlogged tenant, and nothing per idle one.

        ``away`` receives the tenants with work queued here whose counters stay at least
        :data:`AWAY_QUANTA` of their quanta above ``L_i`` until ``horizon_ms``: they take
        nothing here before it.

        ``folded``: one more piece ``(a, b, g, d)``, in tokens, standing for tenants not in
        ``others`` (the caller's :data:`~tokenfair.core.tokenfair.POOL_WEIGHED_TENANTS` cap:
        their sums, an upper bound of their pieces' sum)."""
        tenant_id, quantum_units, queued_units = own
        level = self.level(own, joining, floor)
        rates = self.elsewhere_rate
        own_rate = rates.get(tenant_id, 0.0)
        if own_rate and self.rate_is_stale(tenant_id):
            # Not named by the last batch (idle here), so its rate is as old as that: read it
            # again with the next batch. Without this, a tenant served fast elsewhere and then
            # idle everywhere kept that rate, and coming back here was predicted never to
            # catch up with the tenants below it — refused at the door, never backlogged here,
            # never named again: refused for good. Its old rate still answers meanwhile (a
            # tenant still flooding elsewhere must not be admitted to expire here).
            self.asking[tenant_id] = None  # (a dict: batches in a reproducible order)
        rise = own_rate / quantum_units  # quanta per ms
        pieces: list[tuple[float, float, float, float]] = []
        for other_id, other_quantum, other_queued, arrival_rate in others:
            gap = tokens_of_float((level - self.counter(other_id, other_quantum)) * other_quantum)
            drift = tokens_of_float(
                (rise - rates.get(other_id, 0.0) / other_quantum) * other_quantum
            )
            highest = gap + drift * horizon_ms if drift > 0.0 else gap
            if highest <= 0.0:  # never below the level within the horizon: w_j = 0
                if other_queued and highest <= tokens_of_float(-AWAY_QUANTA * other_quantum):
                    away.append(other_id)
                continue
            pieces.append((tokens_of(other_queued), arrival_rate, gap, drift))
        if folded is not None:
            pieces.append(folded)
        return first_crossing_tokens(tokens_of(queued_units), rate, pieces, horizon_ms, idle_rate)

    def level(self, own: tuple[str, int, int], joining: bool, floor: float | None) -> float:
        """``L_i`` of :meth:`ahead_tokens`: the tenant's counter once its queue here is served
        (its clamped counter if it joins)."""
        tenant_id, quantum_units, queued_units = own
        if joining:
            counter = self.joining_counter(tenant_id, quantum_units, floor)
        else:
            counter = self.counter(tenant_id, quantum_units)
        return counter + float(queued_units) / quantum_units  # (float: see `counter`)

    def rise(self, tenant_id: str, quantum_units: int) -> float:
        """How fast the tenant's counter rises by its service elsewhere, quanta per ms."""
        return self.elsewhere_rate.get(tenant_id, 0.0) / quantum_units

    def away_limit(
        self, level: float, tenant_id: str, quantum_units: int, horizon_ms: float
    ) -> float:
        """A counter from which a backlogged tenant is away for a request at ``level`` (of
        ``tenant_id``, quantum ``quantum_units``): at least :data:`AWAY_QUANTA` above the
        level until ``horizon_ms`` whatever its rate elsewhere, the level rising at most by the
        tenant's own rate elsewhere. (:meth:`ahead_tokens`'s test, in counters: ``V_j >= L_i +
        AWAY_QUANTA + e_i/Q_i * horizon`` implies ``highest <= -AWAY_QUANTA Q_j``, ``e_j >= 0``;
        plus a relative 1e-9, so a tenant at the limit by a rounding is weighed one by one.)"""
        limit = level + AWAY_QUANTA + self.rise(tenant_id, quantum_units) * horizon_ms
        return limit + 1e-9 * (abs(limit) + 1.0)


def first_crossing_tokens(
    base_tokens: float,
    rate: float,
    pieces: list[tuple[float, float, float, float]],
    horizon_ms: float,
    steady_rate: float = 0.0,
) -> float:
    """``rate * t`` at the first ``t`` in ``[0, horizon_ms]`` where ``rate * t >= base +
    steady_rate * t + sum_j w_j(t)``, ``w_j(t) = max(0, min(a_j + b_j t, g_j + d_j t))`` for
    each piece ``(a_j, b_j, g_j, d_j)`` (``a_j, b_j >= 0``); if there is none, ``base +
    steady_rate * horizon_ms + sum_j w_j(horizon_ms)``.

    Each ``w_j`` is piecewise linear with at most two breakpoints (where its two lines cross,
    where the second crosses 0): the difference is swept from 0 over the breakpoints in
    order, its value and slope updated at each, O(n log n)."""
    value = -base_tokens  # rate * t - base - steady_rate * t - sum_j w_j(t), at t
    slope = rate - steady_rate
    events: list[tuple[float, float]] = []  # (t, change of the sum's slope)
    for a, b, g, d in pieces:
        lows = [0.0]
        if b != d:
            cross = (g - a) / (b - d)
            if 0.0 < cross < horizon_ms:
                lows.append(cross)
        if d != 0.0:
            zero = -g / d
            if 0.0 < zero < horizon_ms:
                lows.append(zero)
        lows.sort()
        start = a if a < g else g
        value -= start if start > 0.0 else 0.0
        before = 0.0
        for index, low in enumerate(lows):
            high = lows[index + 1] if index + 1 < len(lows) else horizon_ms
            middle = (low + high) / 2.0
            first = a + b * middle
            second = g + d * middle
            piece_slope = 0.0
            if first <= second:
                if first > 0.0:
                    piece_slope = b
            elif second > 0.0:
                piece_slope = d
            if index == 0:
                slope -= piece_slope
            elif piece_slope != before:
                events.append((low, piece_slope - before))
            before = piece_slope
    if value >= 0.0:
        return 0.0
    events.sort()
    at_ms = 0.0
    for event_ms, change in events:
        reached = value + slope * (event_ms - at_ms)
        if reached >= 0.0:
            return rate * (at_ms - value / slope)
        value = reached
        at_ms = event_ms
        slope -= change
    reached = value + slope * (horizon_ms - at_ms)
    if reached >= 0.0:
        return rate * (at_ms - value / slope)
    return rate * horizon_ms - reached


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
        if unsynced >= units_of(lease_tokens):
            return True
        if now_ms - self.synced_at_ms < sync_ms:
            return False
        return (
            unsynced > 0
            or any(len(tenants) > 1 for tenants in backlogged)
            or any(lane.asking for lane in self.lanes)
        )

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
        send, backlogged here (``backlogged[lane]``) or asked for by an admission
        (:attr:`LaneOrder.asking`): every named tenant's total is read back; 0 to add.
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
                # Toward zero, the remainder keeping its sign; in integers (exact at any size).
                tokens = whole_tokens(units)
                if tokens:
                    sent = units_of(tokens)
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
            for tenant_id in lane.asking:
                if tenant_id not in named:
                    entries.append((tenant_id, 0))
                    named.add(tenant_id)
            lane.asking.clear()
            batch.append(entries)
        return tuple(batch)

    def absorb(
        self, batch: tuple[list[tuple[str, int]], ...], totals: tuple[list[int], ...]
    ) -> None:
        """The store answered ``batch`` with each named tenant's pool-wide total (whole service
        tokens, this batch included), in the batch's order."""
        taken_ms = self.synced_at_ms
        for lane, entries, values in zip(self.lanes, batch, totals, strict=True):
            pool = lane.pool_units
            pushing = lane.pushing_units
            active = lane.active_epoch
            epoch = lane.epoch
            rates = lane.elsewhere_rate
            seen = lane.elsewhere_at_ms
            ranked_keys = lane.ranked_keys
            ranked_quanta = lane.ranked_quanta
            moved: list[tuple[str, float]] = []
            for (tenant_id, tokens), total in zip(entries, values, strict=True):
                if tokens:
                    left = pushing.get(tenant_id, 0) - units_of(tokens)
                    if left:
                        pushing[tenant_id] = left
                    else:
                        pushing.pop(tenant_id, None)
                units = units_of(total)
                known = pool.get(tenant_id)
                elsewhere = units - (0 if known is None else known) - units_of(tokens)
                if elsewhere:
                    active[tenant_id] = epoch  # served elsewhere since the last answer
                if known is not None:
                    lane.observe_gain(tenant_id, tokens, units - known)
                last_ms = seen.get(tenant_id)
                seen[tenant_id] = taken_ms
                if known is not None and last_ms is not None and taken_ms > last_ms:
                    # (A total that went down — a store restarted, repaired — says nothing.)
                    span_ms = taken_ms - last_ms
                    observed = (elsewhere if elsewhere > 0 else 0) / span_ms
                    kept = math.exp(-span_ms / ELSEWHERE_MEMORY_MS)
                    rates[tenant_id] = rates.get(tenant_id, 0.0) * kept + observed * (1.0 - kept)
                pool[tenant_id] = units
                key = ranked_keys.get(tenant_id)
                if key is not None:
                    new_key = lane.counter(tenant_id, ranked_quanta[tenant_id])
                    if new_key != key:
                        moved.append((tenant_id, new_key))
            if moved:
                lane.rekey_moved(moved)
            lane.epoch = epoch + 1
            if taken_ms > lane.clock_ms:
                lane.clock_ms = taken_ms

    def lost(self, batch: tuple[list[tuple[str, int]], ...]) -> None:
        """The answer to ``batch`` never came: its service counts as delivered here (into
        ``pool``, no longer times :attr:`LaneOrder.gain`) and is not sent again; a tenant it
        named with a stale rate elsewhere is asked for again (:attr:`LaneOrder.asking`)."""
        for lane, entries in zip(self.lanes, batch, strict=True):
            pool = lane.pool_units
            pushing = lane.pushing_units
            for tenant_id, tokens in entries:
                if lane.rate_is_stale(tenant_id):
                    lane.asking[tenant_id] = None
                if tokens:
                    units = units_of(tokens)
                    left = pushing.get(tenant_id, 0) - units
                    if left:
                        pushing[tenant_id] = left
                    else:
                        pushing.pop(tenant_id, None)
                    pool[tenant_id] = pool.get(tenant_id, 0) + units
                    lane.rekey(tenant_id)  # (its service here leaves the gain's reach)
