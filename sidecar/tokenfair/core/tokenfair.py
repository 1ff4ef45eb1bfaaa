"""``tokenfair`` — the default policy: admit what *its tenant* can be served in time, then wait for
headroom.

Admission (at arrival; the first gate that fails decides, with a ``Retry-After``):

1. ``queue_full`` — ``queued_all >= max_queued_requests`` or
   ``queued_tenant >= max_queued_requests_per_tenant``.
2. ``shed_kv_watermark`` — only a request that could *never* fit: ``kv_blocks / total_kv_blocks``
   above its class watermark. Anything smaller waits in the queue for KV headroom instead of being
   shed because the cache is busy right now (the lesson shed 14 of 18 batch requests that way).
3. ``shed_queue_wait_slo`` — the wait *this tenant* can expect, counted from the request's
   arrival, is above the class limit: its turns under the DRR that will serve it (its own queue,
   one quantum of the others per quantum it still needs, the work in flight, at the rate its lane
   gets, and — for batch work while interactive work waits — its own cost, which the minimum
   share's credit must cover before it starts; :mod:`tokenfair.core.shares`), or the
   wait for KV room if that is longer
   (:meth:`TokenfairScheduler.kv_wait_ms`). A flooder's backlog lengthens the flooder's own
   predicted wait, not its neighbours'. The batch lane's model wait is timed by its wait
   correction (:meth:`TokenfairScheduler.wait_correction`: how much longer than predicted its
   requests waited lately, an expiry counted as three limits), so an engine that does not keep
   to the model, or a lane whose rate the model misjudges, does not have requests admitted that
   then expire; its rate reads the interactive demand corrected for its warm-up
   (:data:`DEMAND_WARMUP_FLOOR`) and ``batchRateMarginSigmas`` standard deviations above its
   average (the spread of the interactive work that may arrive within its wait limit, from the
   recent requests' sizes), the rate of joiners ahead is corrected for its warm-up too (and,
   in the first wait limit, read at least as the lane's demand times the part of the batch
   tenants not seen yet), and a batch request that joins at the ring's tail, or ahead behind
   other joiners, is admitted on :data:`TAIL_WAIT_FACTOR` times its model wait.
4. ``shed_tenant_token_quota`` — the tenant's budget cannot cover its queued work plus this
   request before the class wait limit: ``(queued_tenant_tokens + cost - bucket_level) /
   sustained_rate > max_wait``, or ``cost > burst`` (never coverable). With
   ``lend_idle_capacity`` such a request may still be admitted if it can borrow in time (the
   capacity within-budget work has left lately serves its queue within the limit).

Budgets *shape* rather than police: the estimate is charged at dispatch, and a head whose tenant
bucket is below its cost waits for the refill (``next_wakeup_ms`` says when) — or, with
``lend_idle_capacity``, runs at once if no request within budget can start (it borrows; the
borrowed dispatch is not charged to its bucket, and within-budget work goes first at every
dispatch, so the capacity is reclaimed at the next one).

Selection (at dispatch): a request may start only if its class watermark holds on resident KV
(``(resident + blocks) / total <= watermark``) and its tenant's bucket covers its cost. Lanes are
strict priority with a **minimum batch share** ``s``: while batch work is queued, every interactive
dispatch earns the batch lane ``cost * s / (1 - s)`` credit; when the credit covers the cheapest
batch head, batch runs next even though interactive work waits (credit resets when the batch lane
empties, so an idle lane banks nothing). Under sustained interactive overload batch therefore gets
``s`` of the service, and none of the interactive burst when its work is short. Inside a lane:
weighted DRR over tenants (:mod:`tokenfair.core.drr`), FIFO inside a tenant. On a batching
engine (``maxBatchRequests`` ``S > 1``) the batch lane starts nothing while it holds
:meth:`TokenfairScheduler.batch_slots` of the ``S`` slots: the rest are the **interactive
reserve**, so an interactive arrival beside a batch flood finds a slot free and waits 0, and the
batch lane's waits are priced at the throughput of the requests it can run at once,
``X(batch_concurrency)``: its slots, or fewer where its KV watermark holds fewer of its requests
(:meth:`TokenfairScheduler.batch_concurrency`, docs/capacity.md).

Settlement charges ``actual - estimate`` to the tenant's bucket and ``actual - expected`` (the
estimate times its usage ratio, what the round robin charged) to its DRR deficit, so the round
robin is fair in actual service tokens; a debt outlives the tenant's queue. A tenant that becomes
backlogged while under its fair share of the lane's recent service joins the ring ahead
(``DeficitRoundRobin.push``, VTC's lift in DRR terms): the weighted max-min share of the lane's
recent service given every tenant's recent offered service (:meth:`TokenfairScheduler.
fair_level`), or the equal weighted share while the offers fit the lane.

Queued requests past ``arrival + max_wait`` of their class are refused ``shed_queue_timeout``, so
every request that starts, starts within its class's wait limit; the refusal's ``Retry-After`` is
the tenant's own predicted wait (for its turn or its budget) beyond the limit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from fractions import Fraction
from typing import Final

from tokenfair.config import Config
from tokenfair.core.batching import BatchingCurve, RunningWork
from tokenfair.core.bucket import ExactTokenBucket
from tokenfair.core.drr import DeficitRoundRobin, TenantQueue
from tokenfair.core.jobs import (
    DEMAND_AT_DISPATCH,
    HELD_CONCURRENCY,
    HELD_KV_SHARE,
    LANE_BATCH,
    LANE_INTERACTIVE,
    LANE_OF,
    QUEUE_FULL,
    SHED_QUEUE_WAIT_SLO,
    SHED_TENANT_CONCURRENCY,
    SHED_TENANT_KV_SHARE,
    SHED_TENANT_TOKEN_QUOTA,
    Decision,
    Job,
    JobState,
)
from tokenfair.core.pool_order import PoolService
from tokenfair.core.scheduler import Scheduler, TenantState, shed_kv
from tokenfair.core.shares import (
    DemandRate,
    LaneCompetition,
    RateSum,
    ResidualWork,
    tokens_ahead,
    water_level,
)
from tokenfair.core.units import nearest_units, tokens_of, tokens_of_float, units_of

SERVICE_MEMORY_LIMITS = 10.0
"""How far back a tenant's recent service reaches, in wait limits of its lane (time constant
of the averages that admission compares)."""

USAGE_RATIO_WEIGHT = 0.25
"""Weight of the newest settlement in a tenant's usage ratio: four settlements take it most of
the way to a new level, so a tenant that starts under-declaring is priced right within a few
requests, and one odd request moves it by a quarter."""

USAGE_RATIO_RANGE = (0.1, 100.0)
"""Bounds of a tenant's usage ratio. The floor keeps requests that end at once (a client that
cancels right after dispatch settles at 0) from making the tenant's next requests nearly free to
the round robin until they settle; the ceiling keeps one absurd report from pricing a tenant
out for long. Settlement corrects whatever the ratio gets wrong."""

_RATIO_LOW, _RATIO_HIGH = USAGE_RATIO_RANGE

WAIT_CORRECTION_LIMITS = 4.0
"""Time constant of the batch lane's wait correction (``TokenfairScheduler.wait_correction``),
in wait limits of the lane: the waits of the requests dispatched (or expired) over the last
few limits."""

WAIT_CORRECTION_RANGE = (1.0, 8.0)
"""Bounds of the wait correction: never below 1 (a model that predicts too long is left as it
is: the correction only stops admitting what will not start in time), and at most 8."""

_CORRECTION_LOW, _CORRECTION_HIGH = WAIT_CORRECTION_RANGE

PREDICTED_WAIT_FLOOR = 0.1
"""A predicted wait counts as at least this fraction of its lane's wait limit in the wait
correction: a request predicted to start at once that started a little later says nothing
about the model (a ratio to 0 would); one that waited a good part of its limit does. (At 1 %
the replays of ``test_wait_correction`` served 1-2 % fewer batch requests below capacity.)"""

EXPIRED_WAIT_LIMITS = 3.0
"""What a request that expired counts as having waited in the wait correction, in wait limits
of its lane. Its real wait is unknown (at least the limit: it never started), and it is the
outcome the correction is for — the client waited the whole limit and was refused anyway,
where a refusal at the door costs it nothing. Counted at the limit alone, a replay at 1.3x an
engine's capacity still expired 3 % of the batch requests it admitted (model exact) and 5 %
(engine twice as slow as the model); at three limits 1.6 % and 2.0 %, serving as many."""

DEMAND_WARMUP_FLOOR = 0.25
"""The batch lane's rate reads the interactive demand corrected for its warm-up: an average
that started from nothing ``t`` ms ago reads ``1 - exp(-t / tau)`` of a steady rate, so it is
divided by that, with ``t`` at least this fraction of ``tau`` (``maxBatchWaitMs``). Without the
correction a scheduler that has just started takes the batch lane for nearly the whole server
and admits batch work that then expires (bench_fairness, scenario 5b: a quarter of the batch
requests admitted). The floor is for bursts: over its first few hundred ms a burst that ends
soon reads as a steady rate above the server's (the lesson's fixture: at a floor of 0.15 one
of its batch requests, served in time today, would be refused; 0.2 is the least that keeps
it)."""

TAIL_WAIT_FACTOR = 1.1
"""A batch request that joins at the ring's tail (its tenant backlogged, in debt, or at or above
its share) is admitted on its model wait times this as well: its turn comes after every joiner
that arrives during its wait, the longest and least certain part of the model (lifts come in
bursts their recent rate does not show). bench_fairness, 32 seeds: scenario 5b's batch lane
(one tenant at its minimum share, always at the tail) expired 2.5 % of what it admitted without
it (worst seed 4.6 %), 0.1 % with it (worst 1.6 %); scenarios 3 and 9 within noise (1.2: the
same in 5b, scenario 3's batch Jain 0.004 lower). 1.3 changes the lesson's fixture (a batch
request served in time there would be refused). So is a request that joins ahead behind other
joiners still waiting for their first turn (the first joiner waits for the front's turn
alone): it waits through their turns too, which come two or three at a time (scenario 3 at
seeds 22 and 23: 7 of 10 expiries were such joiners; docs/fairness.md §5.5, change 8)."""

FORGOTTEN_RATE = 1e-9
"""An offered rate (service tokens per ms) below which a tenant's offer is forgotten."""

NOT_KEPT_NEED: Final = -(1 << 62)
"""The KV need (blocks) the batch lane's round robin is told for a head its tenant's own limit
holds: below any room, so such a head never keeps its tenant's place (`_batch_need`)."""

POOL_WEIGHED_TENANTS = 32
"""With the pool's order, admission weighs at most this many backlogged tenants one by one
(:meth:`TokenfairScheduler._pool_ahead`): with more backlogged in the lane, the ones whose
counters are least among those that can be ahead before the horizon; the rest of those are
taken as all ahead, and the ones farther up as away, in O(1) from the lane's sums. So an
admission's work is bounded whatever the backlog (docs/fairness.md §9.2.1): up to this many it
is exactly the one-by-one prediction; 32 costs about what 32 tenants did before (a few tens of
µs compiled)."""

POOL_HORIZON_LIMITS = 2.0
"""How far ahead, in wait limits of the lane, the pool's order is followed for a prediction
(:meth:`TokenfairScheduler._pool_ahead`): a tenant whose turn here does not come by then is
predicted to wait at least that long (its ``Retry-After`` at least one limit)."""

MIN_LANE_RATE_FRACTION = 1e-3
"""Floor of a lane's predicted rate, as a fraction of the service rate: with ``batchMinShare``
0 and interactive demand at capacity the batch lane's rate is 0, and its predicted wait (which
is then refused) must stay a finite number of ms."""


class TokenfairScheduler(Scheduler):
    """Per-tenant admission, shaped (optionally lending) budgets, DRR lanes with a batch minimum
    share, settlement in actual tokens."""

    name = "tokenfair"
    expires_queued = True
    charges_at_dispatch = True
    settles_every_request = True  # the expected cost (estimate x usage ratio) may differ
    tracks_kv_releases = True  # the KV forecast of `kv_wait_ms`
    tracks_completions = True  # the work running on the engine (`_finished`)
    takes_decode_allowance = True  # `kvDecodeBooking: engine | peak` (the lesson's: up front)
    bucket_type = ExactTokenBucket  # budgets in integer units, like the DRR state

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        # Per-lane state, indexed by a `Lane`, in tuples typed `tuple[X, ...]`: compiled, a
        # fixed-size tuple is kept unboxed and built again at each index by a variable.
        self._lanes: tuple[DeficitRoundRobin, ...] = (DeficitRoundRobin(), DeficitRoundRobin())
        self._competition: tuple[LaneCompetition, ...] = (LaneCompetition(), LaneCompetition())
        self._backlogged: tuple[Callable[[str], bool], ...] = (
            self._lanes[0].backlogged,
            self._lanes[1].backlogged,
        )
        self._interactive_demand = DemandRate()  # time constant: maxBatchWaitMs
        # The same sum of each request's service tokens squared: their spread
        # (`_interactive_demand_rate`'s margin, batchRateMarginSigmas).
        self._interactive_squares = DemandRate()
        self._started_ms = now_ms  # since when it has been measured (`_interactive_demand_rate`)
        # Per lane, over the lane's wait limit: admitted service, and the part of it that
        # joined ahead of the ring's tail.
        self._lane_demand: tuple[DemandRate, ...] = (DemandRate(), DemandRate())
        self._lane_lifted: tuple[DemandRate, ...] = (DemandRate(), DemandRate())
        self._budgeted = DemandRate()  # dispatched within budget (`_lending_memory_ms`)
        # Resident requests -> when their KV is forecast to be freed (`kv_wait_ms`).
        self._kv_release_ms: dict[str, float] = {}
        self._residual = ResidualWork()  # a serial engine's (maxBatchRequests 1)
        # A batching engine's running requests (maxBatchRequests > 1; `_adopt_cost_model`).
        self._engine: RunningWork | None = None
        self._running_expected = 0.0  # expected service tokens of the requests running
        self._batch_running = 0  # batch requests dispatched and not ended (`batch_slots`)
        # The batch lane's wait correction (`wait_correction`): per lane, the recent waits
        # the requests had and the waits admission predicted for them, and each queued
        # request's predicted wait (from its arrival) until it starts or expires.
        self._waited: tuple[DemandRate, ...] = (DemandRate(), DemandRate())
        self._predicted: tuple[DemandRate, ...] = (DemandRate(), DemandRate())
        # Each queued sample: (its predicted wait, its tenant's budget-held ms at admission).
        self._pending_samples: dict[str, tuple[float, float]] = {}
        # Per lane, the sampled requests in the order admitted, (id, tenant, arrival, predicted
        # wait): the oldest still queued is the first whose id is still in `_pending_samples`.
        self._admitted_order: tuple[deque[tuple[str, str, float, float]], ...] = (
            deque(),
            deque(),
        )
        # Tenant -> how long the round robin has held its head back for its own limits, its
        # budget or its maxConcurrentRequests (while samples were pending): the length of the
        # union of its holds, each from a pass-over until its head started (a cap's: until
        # the cap freed), and the end of the last (`_tenant_hold`). That part of a sample's
        # wait is the tenant's own, not the engine model's, and is taken out of it
        # (`_waited_for`).
        self._tenant_held_ms: dict[str, float] = {}
        self._tenant_held_until_ms: dict[str, float] = {}
        # The tenants whose last hold is their maxConcurrentRequests' or maxKvShare's: it ends
        # when one of their requests ends (`_limit_freed`) or a reload lifts the limit.
        self._limit_held: set[str] = set()
        self._curve: BatchingCurve | None = None  # the engine model they measure
        self._batch_floor_slots = 1  # max(1, ceil(batchMinShare * S)) (`_adopt_cost_model`)
        self._interactive_tenants = False  # the configuration has an interactive tenant
        self._batch_tenants = 0  # batch tenants configured
        self._batch_quantum_max = 0.0  # the largest quantum among them (`predicted_wait_ms`)
        # The interactive tenants if every one has maxConcurrentRequests, else None (`batch_slots`).
        self._interactive_capped: tuple[str, ...] | None = None
        # Recent service per lane, per tenant and in all (time constant: SERVICE_MEMORY_LIMITS).
        self._served: tuple[dict[str, DemandRate], ...] = ({}, {})
        self._lane_served: tuple[DemandRate, ...] = (DemandRate(), DemandRate())
        # With the pool's order: per lane, the sum of `_served` over the tenants backlogged
        # there (`_pool_ahead` reads it in O(1)); None without.
        self._backlog_served: tuple[RateSum, ...] | None = None
        # Per lane: each tenant's recent offered service (every arrival, admitted or not;
        # time constant SERVICE_MEMORY_LIMITS). The lane's max-min water level over it, as
        # (when computed, level), recomputed at most once per wait limit, is `_level`
        # (`_adopt_cost_model` starts it).
        self._offered: tuple[dict[str, DemandRate], ...] = ({}, {})
        # The batch lane's minimum-share credit, in units times `_credit_spend` (exact: see
        # `_adopt_cost_model`; `_batch_credit` reads it in tokens).
        self._batch_credit_scaled = 0
        self._credit_spend = 1
        self._cheapest_batch_units: int | None = None  # as of the last selection that looked
        self._now_ms = now_ms  # the clock of the selection in progress (read by `_eligible`)
        self._lending = False  # the selection in progress ignores budgets (read by `_eligible`)
        self._push_ahead: float | None = None  # join rank of the job `_admit` just admitted
        super().__init__(config, now_ms)

    def _adopt_cost_model(self) -> None:
        super()._adopt_cost_model()
        # Per lane, read on every request: the service memory (the wait limit and the
        # watermark are the base's `_wait_limits` and `_watermarks`); hot-path constants.
        policy = self.policy
        self._memories_ms: tuple[float, ...] = tuple(
            limit * SERVICE_MEMORY_LIMITS for limit in self._wait_limits
        )
        self._rate = policy.service_tokens_per_ms
        self._interactive_cap = self._rate * (1.0 - policy.batch_min_share)
        self._rate_margin = policy.batch_rate_margin_sigmas
        # The minimum share as the decimal it was written as, s = p / q (0.1 -> 1/10): an
        # interactive dispatch of `e` units earns the batch lane e * s / (1 - s) units of
        # credit, kept times (q - p) so that it is an exact integer, e * p; a batch dispatch
        # spends e * (q - p). No rounding, so no drift: batch is due exactly when the credit
        # covers the cheapest head. A reload that changes the share rescales the credit (one
        # floor, less than a unit).
        share = Fraction(repr(float(policy.batch_min_share)))
        spend = share.denominator - share.numerator
        # The batch lane's least slots of a batching engine, ceil(s * S) exactly (`batch_slots`).
        batch_floor = -(-share.numerator * policy.max_batch_requests // share.denominator)
        self._batch_floor_slots = batch_floor if batch_floor > 1 else 1
        interactive = [t for t in self.config.tenants if t.priority_class == "interactive"]
        self._interactive_tenants = bool(interactive)
        self._batch_tenants = len(self.config.tenants) - len(interactive)
        self._batch_quantum_max = self._base_quantum_tokens * max(
            (t.weight for t in self.config.tenants if t.priority_class != "interactive"),
            default=0.0,
        )
        self._interactive_capped = (
            tuple(t.tenant_id for t in interactive)
            if all(t.max_concurrent_requests is not None for t in interactive)
            else None
        )
        self._batch_credit_scaled = self._batch_credit_scaled * spend // self._credit_spend
        self._credit_earn = share.numerator
        self._credit_spend = spend
        self._kv_residency = policy.kv_residency_factor
        self._lend = policy.lend_idle_capacity
        # `watermark * total_kv_blocks` per lane: the blocks a lane's requests may fill.
        self._kv_limits = tuple(mark * policy.total_kv_blocks for mark in self._watermarks)
        curve = BatchingCurve.from_policy(policy)
        if curve != self._curve:
            # A new engine model (a recalibration): the wait correction measured the old one.
            self._curve = curve
            self._waited = (DemandRate(), DemandRate())
            self._predicted = (DemandRate(), DemandRate())
            self._pending_samples.clear()
            self._drop_holds_without_samples()  # no sample left to take a hold out of
            for order in self._admitted_order:
                order.clear()
        if curve.max_batch_requests == 1:
            self._engine = None
        elif self._engine is None:
            self._engine = RunningWork(curve)
        else:
            self._engine.retune(curve, self._now_ms)
        # Bound once, `pick` takes it at every selection: the tenant limits' check only when a
        # tenant has one (the unlimited path pays nothing for them).
        self._tenant_limits = any(
            tenant.max_concurrent_requests is not None or tenant.max_kv_share is not None
            for tenant in self.config.tenants
        )
        self._eligible_now = self._eligible_limited if self._tenant_limits else self._eligible
        # The water level is per quantum token and over the tenants of the old configuration:
        # computed again at the next admission that asks.
        self._level: list[tuple[float, float]] = [(-math.inf, math.inf), (-math.inf, math.inf)]

    @property
    def _batch_credit(self) -> float:
        """The batch lane's minimum-share credit in service tokens (the state is
        ``_batch_credit_scaled``)."""
        return tokens_of_float(self._batch_credit_scaled / self._credit_spend)

    @_batch_credit.setter
    def _batch_credit(self, tokens: float) -> None:
        self._batch_credit_scaled = nearest_units(tokens) * self._credit_spend

    @property
    def _cheapest_batch_head(self) -> float | None:
        """The cheapest batch head's expected service tokens, as of the last selection that
        looked (the state is ``_cheapest_batch_units``)."""
        units = self._cheapest_batch_units
        return None if units is None else tokens_of(units)

    def reconfigure(self, config: Config, now_ms: float) -> None:
        """As the base's; a change of ``maxBatchRequests`` carries the requests running over to
        the new engine model: into a new batching model as if started now, or into a serial
        residual of their expected work."""
        batching_before = self._engine is not None
        self._now_ms = now_ms
        super().reconfigure(config, now_ms)
        # A limit the reload raised or removed no longer holds its tenant: its head waits for
        # the engine from here (review rev1207g F2: an engine expiry read as a ~0 ms sample).
        # Only a lifted limit: a reload that leaves a tenant past its maxKvShare (any reload,
        # an identical one too) keeps it held (review rev1207h F1).
        for tenant_id in list(self._limit_held):
            if not self._still_past_kv_share(tenant_id):
                self._limit_freed(tenant_id, now_ms)
        engine = self._engine
        if engine is not None and not batching_before:
            for job in self.jobs.values():
                if job.state is JobState.DISPATCHED:
                    engine.start(job.request_id, job.expected_tokens, now_ms)
        elif engine is None and batching_before:
            self._residual = ResidualWork()
            self._residual.dispatched(self._running_expected, self._rate, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        quantum = self.tenant_quantum(tenant)
        tenant_id = tenant.tenant_id
        for lane, competition in zip(self._lanes, self._competition, strict=True):
            lane.add_tenant(tenant_id, quantum)
            competition.quantum_changed(tenant_id, quantum)

    def share_pool_service(self, pool: PoolService | None) -> None:
        """The one hook of pool-wide fairness (:mod:`.pool_order`): each lane's round robin
        orders its tenants by ``pool``'s counters of pool-wide weighted service and counts the
        service it gives there; None: each lane's own round robin again (no store)."""
        sums: list[RateSum] = []
        for lane, drr in enumerate(self._lanes):
            drr.set_order(None if pool is None else pool.lanes[lane])
            if pool is not None:
                pool.lanes[lane].backlog = drr.backlogged_tenants
                memory_ms = self._memories_ms[lane]
                backlog_served = RateSum(self._served[lane], memory_ms)
                for queue in drr.active:
                    backlog_served.put(queue.tenant_id, memory_ms)
                sums.append(backlog_served)
        self._backlog_served = tuple(sums) if pool is not None else None

    # -- admission --------------------------------------------------------------------------

    def predicted_wait_ms(
        self,
        tenant_id: str,
        lane: int,
        cost_tokens: int,
        now_ms: float,
        join_rank: float | None = None,
        kv_blocks: int = 0,
    ) -> float:
        """What a new request of the tenant costing ``cost_tokens`` would wait in ``lane``
        (:mod:`.shares`): the work in flight, then what DRR sends ahead of it — from the tenants
        backlogged now, and from the competing tenants that are idle now as far as the lane's
        recent demand says they will send — plus, for interactive work, the batch requests its
        minimum share lets in meanwhile, and for batch work while interactive work waits, its
        own expected cost (the credit that must cover it), at the rate the lane gets.
        ``kv_blocks``: the request's own KV booking (0: not known), which on a batching engine
        counts in the batch lane's KV-bound concurrency (:meth:`batch_concurrency`)."""
        drr = self._lanes[lane]
        queue = drr.queues[tenant_id]
        order = drr.order
        pooled = order is not None and order.sharing  # the pool's order (`_pooled_ahead`)
        competition = self._competition[lane]
        # The state in units, read in tokens: a prediction is a float estimate.
        competing = tokens_of(competition.competing_units)
        quantum = queue.quantum
        if not competition.competes(tenant_id):
            competing += quantum
        backlogged = tokens_of(drr.active_quanta_units) + (0.0 if queue.in_active else quantum)
        first_turn = None
        if join_rank is not None:  # it would join ahead with that rank (`_join_rank`)
            first_turn = drr.tokens_before_joining_ahead(join_rank)
        expected_tokens = cost_tokens * self.tenants[tenant_id].usage_ratio
        active = drr.active
        ahead, later_turns = tokens_ahead(
            tokens_of(queue.queued_units),
            expected_tokens,
            queue,
            competing,
            backlogged,
            tokens_of(drr.queued_units),
            tokens_of(drr.credit_units),
            active[0] if active else None,
            first_turn,
        )
        rate = self._rate
        lane_slots = 0  # the batch lane's `batch_concurrency` on a batching engine
        if lane == LANE_INTERACTIVE:
            if pooled:
                ahead, later_turns = self._pooled_ahead(drr, queue, lane, ahead, later_turns,
                                                        expected_tokens, first_turn, rate,
                                                        now_ms)  # fmt: skip
            if self.queued_count[1]:  # else no batch intrusion (`ahead + 0.0`)
                ahead += self._batch_intrusion(ahead)
        else:
            # rate - min(demand, interactive cap), floored at MIN_LANE_RATE_FRACTION of it
            demand = self._interactive_demand_rate(now_ms)
            interactive_cap = self._interactive_cap
            lane_rate = rate - (interactive_cap if interactive_cap < demand else demand)
            if self._engine is not None:
                # A batching engine: the lane drains at most at the throughput of the requests
                # it can run at once, X(batch_concurrency): the slots the interactive reserve
                # leaves it, or fewer where its KV watermark binds first (docs/capacity.md).
                lane_slots = self.batch_concurrency(now_ms, kv_blocks)
                slots_rate = self._engine.curve.throughput(lane_slots)
                if slots_rate < lane_rate:
                    lane_rate = slots_rate
            floor = rate * MIN_LANE_RATE_FRACTION
            rate = floor if floor > lane_rate else lane_rate
            if pooled:
                ahead, later_turns = self._pooled_ahead(drr, queue, lane, ahead, later_turns,
                                                        expected_tokens, first_turn, rate,
                                                        now_ms)  # fmt: skip
            if self.queued_count[0]:
                # Credit-gated start (docs/fairness.md §5.1): while interactive work waits, a
                # batch request starts only once the minimum share's credit covers it, and the
                # credit accrues at the lane's rate, so the lane must have served its own cost
                # too. Without it a request admitted to an empty lane was predicted to start at
                # once and waited ~0.8 s on average (bench_fairness, scenario 3).
                ahead += expected_tokens
        engine = self._engine
        if engine is None:
            wait_ms = self._residual.wait_ms(now_ms) + ahead / rate
        else:
            wait_ms = self._batch_wait_ms(
                engine, lane, ahead, expected_tokens, rate, now_ms, lane_slots
            )
        # The competing tenants idle now take part in the later turns only if they send
        # meanwhile: at most one quantum each per turn (the DRR bound), and at most what the
        # lane's recent admitted demand λ brings in during the wait itself, i.e. the wait T with
        # T = wait + λ T / rate. The smaller of the two.
        idle_quanta = competing - backlogged
        horizon_ms = self._wait_limits[lane]
        if later_turns and idle_quanta > 0.0:
            by_turns_ms = wait_ms + later_turns * idle_quanta / rate
            demand = self._lane_demand[lane].rate(now_ms, horizon_ms)
            if demand < rate:
                by_demand_ms = wait_ms / (1.0 - demand / rate)
                wait_ms = by_demand_ms if by_demand_ms < by_turns_ms else by_turns_ms
            else:
                wait_ms = by_turns_ms
        if first_turn is None:
            # Tenants joining ahead send their first request before it: T = wait + λ_lift T.
            lifted = self._lane_lifted[lane].rate(now_ms, horizon_ms)
            if lifted > 0.0 and lane == LANE_BATCH:
                # Corrected for its warm-up, as the interactive demand is: in the first wait
                # limits every tenant is new and joins ahead (docs/fairness.md §5.5).
                lifted /= self._seen(now_ms, horizon_ms)
            newcomers_ms = math.inf  # what the tenants not seen yet can bring, at most
            if lane == LANE_BATCH and now_ms - self._started_ms < horizon_ms:
                # Start-up (docs/fairness.md §5.5, change 7): in the first wait limit nearly
                # every tenant's first request joins ahead, and the lifted rate has seen few of
                # them (none before the first lift). The batch tenants that have not sent yet
                # are read as lifts at the lane's demand (corrected for its warm-up) times the
                # part they are of the batch tenants (`unseen > 0`, so there is one at least).
                unseen = self._batch_tenants - len(self._offered[lane])
                if unseen > 0:
                    newcomers = (
                        self._lane_demand[lane].rate(now_ms, horizon_ms)
                        / self._seen(now_ms, horizon_ms)
                        * unseen
                        / self._batch_tenants
                    )
                    if newcomers > lifted:
                        # A burst read as a rate can pass the lane's (T = wait + λ T has no
                        # finite answer then), but each unseen tenant brings at most its first
                        # turn ahead of this request and one quantum in each of its later turns
                        # (the DRR bound), each read at the largest batch quantum: so at most
                        # `unseen (1 + later_turns) Q_max` more, beside the joiners seen.
                        seen_left = 1.0 - lifted / rate
                        newcomers_ms = (
                            wait_ms + unseen * (1 + later_turns) * self._batch_quantum_max / rate
                        ) / (
                            seen_left
                            if seen_left > MIN_LANE_RATE_FRACTION
                            else MIN_LANE_RATE_FRACTION
                        )
                        lifted = newcomers
            if lifted > 0.0:
                share_left = 1.0 - lifted / rate
                wait_ms /= (
                    share_left if share_left > MIN_LANE_RATE_FRACTION else (MIN_LANE_RATE_FRACTION)
                )
                if newcomers_ms < wait_ms:
                    wait_ms = newcomers_ms
        return wait_ms

    def _interactive_demand_add(self, service_tokens: int, now_ms: float) -> None:
        """An interactive request's demand counts (at admission, or at dispatch when its
        tenant's concurrency held it): its service tokens, and their square."""
        tau_ms = self._wait_limits[1]
        self._interactive_demand.add(service_tokens, now_ms, tau_ms)
        self._interactive_squares.add(float(service_tokens) * service_tokens, now_ms, tau_ms)

    def _seen(self, now_ms: float, tau_ms: float) -> float:
        """The part of a steady rate that an average with time constant ``tau`` started from
        nothing when the scheduler did reads now: ``1 - exp(-t / tau)``, ``t`` the time since
        the start and at least :data:`DEMAND_WARMUP_FLOOR` ``tau``; 1 past 40 ``tau`` (to
        the last bit)."""
        watched_ms = now_ms - self._started_ms
        if watched_ms >= 40.0 * tau_ms:
            return 1.0
        floor_ms = DEMAND_WARMUP_FLOOR * tau_ms
        watched_ms = watched_ms if watched_ms > floor_ms else floor_ms
        return -math.expm1(-watched_ms / tau_ms)

    def _interactive_demand_rate(self, now_ms: float) -> float:
        """The interactive demand as the batch lane's predicted rate reads it, in service tokens
        per ms (docs/fairness.md §5.5): the recent admitted demand (an average with time
        constant ``maxBatchWaitMs``, ``tau``) corrected for its warm-up (:meth:`_seen`: divided
        by ``seen``), ``λ``, plus ``z`` (``batchRateMarginSigmas``) standard deviations of the
        interactive work the batch lane must leave room for within ``tau``, as a rate::

            λ + z sqrt(1.5 λ m / tau),   m = Σ c² / Σ c

        ``m`` over the same recent requests (their size-weighted mean size). A Poisson stream
        of requests of random size ``c`` at ``n`` per ms (``λ = n E[c]``) brings work of
        variance ``n tau E[c²] = λ m tau`` within ``tau`` (the ``1`` of 1.5), and the average
        ``λ`` is read from has variance ``λ m / (2 tau)`` (the ``0.5``). Heavy-tailed sizes
        make ``m`` large, and the batch lane gets what is left, ``R - λ``, so a small relative
        error in ``λ`` is a large one in its rate. (The average's variance is larger while it
        warms up — about 4 times at the warm-up floor — but counting that refuses a batch
        request of the lesson's fixture, a burst at the start, that is served in time.)"""
        tau_ms = self._wait_limits[1]
        measured = self._interactive_demand.rate(now_ms, tau_ms)
        if measured <= 0.0:
            return measured
        seen = self._seen(now_ms, tau_ms)
        demand = measured if seen == 1.0 else measured / seen
        margin = self._rate_margin
        if margin <= 0.0:
            return demand
        size = self._interactive_squares.rate(now_ms, tau_ms) / measured
        return demand + margin * math.sqrt(1.5 * demand * size / tau_ms)

    def _pooled_ahead(
        self,
        drr: DeficitRoundRobin,
        queue: TenantQueue,
        lane: int,
        round_robin_ahead: float,
        later_turns: int,
        expected_tokens: float,
        first_turn: float | None,
        rate: float,
        now_ms: float,
    ) -> tuple[float, int]:
        """What is ahead of a new request of ``queue``'s tenant while the lane orders by the
        pool's counters (docs/fairness.md §9.2.1), and the round robin's later turns: the more
        of the counters' order (:meth:`_pool_ahead`) and the round robin's
        (``round_robin_ahead`` and ``later_turns``, :func:`tokens_ahead`) without the tenants
        the counters keep above it until the horizon (they take nothing here meanwhile). The
        round robin's, with its later turns and its joiners (the caller's), stands for what the
        counters' snapshot cannot foresee: the others' service comes in batches, and a batch
        can reverse the order; an idle tenant below comes back with a burst, all of it ahead."""
        away: list[str] = []
        beyond = [0, 0, 0, 0]
        ahead = self._pool_ahead(drr, queue, lane, rate, now_ms, away, beyond)
        if away or beyond[0]:
            quanta, queued, credit, front_beyond = beyond
            front = drr.active[0] if drr.active and not front_beyond else None
            for other_id in away:
                other = drr.queues[other_id]
                quanta += other.quantum_units
                queued += other.queued_units
                if other.deficit_units > 0:
                    credit += other.deficit_units
                if other is front:
                    front = None
            competition = self._competition[lane]
            own = 0 if queue.in_active else queue.quantum_units
            round_robin_ahead, later_turns = tokens_ahead(
                tokens_of(queue.queued_units),
                expected_tokens,
                queue,
                tokens_of(competition.competing_units - quanta
                          + (0 if competition.competes(queue.tenant_id) else queue.quantum_units)),
                tokens_of(drr.active_quanta_units + own - quanta),
                tokens_of(drr.queued_units - queued),
                tokens_of(drr.credit_units - credit),
                front,
                first_turn,
            )  # fmt: skip
        return (ahead if ahead > round_robin_ahead else round_robin_ahead), later_turns

    def _pool_ahead(
        self,
        drr: DeficitRoundRobin,
        queue: TenantQueue,
        lane: int,
        rate: float,
        now_ms: float,
        away: list[str],
        beyond: list[int],
    ) -> float:
        """What the lane serves here before a new request of ``queue``'s tenant while the
        round robin orders by the pool's counters (:meth:`LaneOrder.ahead_tokens
        <tokenfair.core.pool_order.LaneOrder.ahead_tokens>`, docs/fairness.md §9.2.1): its own
        queue, and the work of the tenants whose counters are below its own, queued here or
        sent here meanwhile at their recent rate of service here, until they catch up.

        Only the tenants backlogged here are weighed one by one. The tenants idle here that
        were served here lately are one aggregate: the lane's recent service rate less that of
        the backlogged tenants and of this one, taken as all ahead (``idle_rate``: an idle
        tenant that sends joins below the level at most that fast). O(b log b) in the ``b``
        backlogged tenants of the lane, never in the tenants served lately, up to
        :data:`POOL_WEIGHED_TENANTS`; past it :meth:`_pool_ahead_bounded`, whose work is
        bounded whatever ``b``. ``away`` and ``beyond`` receive the tenants away (``beyond``:
        the sums of the quanta, queued work and credit of those not listed, and 1 if the ring's
        front is one of them)."""
        order = drr.order
        if order is None:
            return 0.0
        if len(drr.active) > POOL_WEIGHED_TENANTS:
            return self._pool_ahead_bounded(
                drr, queue, lane, rate, now_ms, away, beyond, POOL_WEIGHED_TENANTS
            )
        tenant_id = queue.tenant_id
        memory_ms = self._memories_ms[lane]
        served = self._served[lane]
        others: list[tuple[str, int, int, float]] = []
        idle_rate = self._lane_served[lane].rate(now_ms, memory_ms)
        recent = served.get(tenant_id)
        if recent is not None:
            idle_rate -= recent.rate(now_ms, memory_ms)
        for other in drr.active:
            if other is queue:
                continue
            recent = served.get(other.tenant_id)
            sending = 0.0 if recent is None else recent.rate(now_ms, memory_ms)
            idle_rate -= sending
            others.append((other.tenant_id, other.quantum_units, other.queued_units, sending))
        joining = not queue.in_active
        return order.ahead_tokens(
            (tenant_id, queue.quantum_units, queue.queued_units),
            joining,
            drr.least_counter(order) if joining else None,
            others,
            idle_rate if idle_rate > FORGOTTEN_RATE else 0.0,
            rate,
            self._wait_limits[lane] * POOL_HORIZON_LIMITS,
            away,
        )

    def _pool_ahead_bounded(
        self,
        drr: DeficitRoundRobin,
        queue: TenantQueue,
        lane: int,
        rate: float,
        now_ms: float,
        away: list[str],
        beyond: list[int],
        most: int,
    ) -> float:
        """:meth:`_pool_ahead` with more than :data:`POOL_WEIGHED_TENANTS` backlogged, in
        O(log b + most) (docs/fairness.md §9.2.1), ``most`` that cap. A tenant whose counter is at
        least :meth:`LaneOrder.away_limit <tokenfair.core.pool_order.LaneOrder.away_limit>`
        is away whatever its rate elsewhere (``ahead_tokens`` would find it so), so only the
        tenants below that limit are weighed, least counter first (the lane's ranking). If more
        than ``most`` are, the rest are one piece of ``ahead_tokens``: their queued work and
        rates (the lane's sums less the weighed ones'), their quanta times the gap from the
        least counter left out to the level, and times this tenant's rise — each at least the
        sum of their own pieces' (an upper bound of what they take). The backlogged tenants' rates
        come from their sum (:class:`~tokenfair.core.shares.RateSum`): equal to the one-by-one
        answer up to the rounding of the sums when no more than the cap are below the limit."""
        order = drr.order
        backlog_served = self._backlog_served
        assert order is not None
        assert backlog_served is not None
        tenant_id = queue.tenant_id
        memory_ms = self._memories_ms[lane]
        served = self._served[lane]
        horizon_ms = self._wait_limits[lane] * POOL_HORIZON_LIMITS
        joining = not queue.in_active
        floor = order.least_counter() if joining else None
        own = (tenant_id, queue.quantum_units, queue.queued_units)
        level = order.level(own, joining, floor)
        limit = order.away_limit(level, tenant_id, queue.quantum_units, horizon_ms)
        near, left_out = order.below(limit, tenant_id, most)
        recent = served.get(tenant_id)
        own_rate = 0.0 if recent is None else recent.rate(now_ms, memory_ms)
        # The others' rates: every backlogged tenant's, less this one's if it is backlogged.
        others_rate = backlog_served[lane].rate(now_ms, memory_ms)
        if not joining:
            others_rate -= own_rate
        idle_rate = self._lane_served[lane].rate(now_ms, memory_ms) - own_rate - others_rate
        others: list[tuple[str, int, int, float]] = []
        quanta = drr.active_quanta_units
        queued = drr.queued_units
        credit = drr.credit_units
        if not joining:  # the rest: the ring's sums less this tenant's and the weighed ones'
            quanta -= queue.quantum_units
            queued -= queue.queued_units
            if queue.deficit_units > 0:
                credit -= queue.deficit_units
        queues = drr.queues
        for other_id in near:
            other = queues[other_id]
            recent = served.get(other_id)
            sending = 0.0 if recent is None else recent.rate(now_ms, memory_ms)
            others_rate -= sending
            quanta -= other.quantum_units
            queued -= other.queued_units
            if other.deficit_units > 0:
                credit -= other.deficit_units
            others.append((other_id, other.quantum_units, other.queued_units, sending))
        folded: tuple[float, float, float, float] | None = None
        if left_out is not None:
            # More than the cap below the limit: the rest as one piece, the sums of theirs
            # (an upper bound of their pieces' sum: each rest tenant's counter is at least
            # `left_out`, so its gap to the level at most the level less that, its drift at
            # most this tenant's rise, both times its quantum; and the sum of minima is at
            # most the minimum of the sums).
            gap = level - left_out
            folded = (
                tokens_of(queued),
                others_rate if others_rate > 0.0 else 0.0,
                tokens_of_float((gap if gap > 0.0 else 0.0) * quanta),
                tokens_of_float(order.rise(tenant_id, queue.quantum_units) * quanta),
            )
        else:
            # The rest are away: their sums for the round robin's share without them.
            front = drr.active[0] if drr.active else None
            beyond[0] = quanta
            beyond[1] = queued
            beyond[2] = credit
            beyond[3] = int(
                front is not None and front is not queue and front.tenant_id not in near
            )
        return order.ahead_tokens(
            own,
            joining,
            floor,
            others,
            idle_rate if idle_rate > FORGOTTEN_RATE else 0.0,
            rate,
            horizon_ms,
            away,
            folded,
        )

    def _batch_wait_ms(
        self,
        engine: RunningWork,
        lane: int,
        ahead_tokens: float,
        own_tokens: float,
        rate: float,
        now_ms: float,
        lane_slots: int,
    ) -> float:
        """The wait for a slot of a batching engine (docs/capacity.md): the requests the round
        robin sends first (``ahead_tokens`` of work, ``n = ahead / s`` requests of the lane's
        mean queued size ``s``, the request's own cost while the lane is empty) take the ``F``
        free slots at once; the rest start as slots free, one every ``s / R`` at the full
        batch, after the first end the engine forecasts when no slot is free now::

            wait = 0                                          if n < F
                 = (F > 0 ? 0 : first_end) + (ahead - F s) / rate   otherwise

        So a request that finds a free slot and nothing of its lane ahead waits 0, however much
        the engine is running; ``rate`` is the lane's share of ``R`` (as for a serial engine),
        for the batch lane at most ``X(lane_slots)``. The batch lane's free slots are those
        the interactive reserve and its KV watermark leave it, ``F = min(S - running,
        lane_slots - batch_running)`` with ``lane_slots`` its :meth:`batch_concurrency`, and
        while it holds all of them its ``first_end`` is the engine's next forecast end,
        whoever's (a lower bound of its own next end)."""
        free_slots = self.policy.max_batch_requests - self.running
        lane_full = False  # the batch lane holds every slot the reserve and KV leave it
        if lane == LANE_BATCH:
            batch_free = lane_slots - self._batch_running
            if batch_free < free_slots:
                free_slots = batch_free
                lane_full = free_slots <= 0
        if free_slots < 0:
            free_slots = 0
        queued = self.queued_count[lane]
        mean_tokens = tokens_of(self._lanes[lane].queued_units) / queued if queued else own_tokens
        started_now = free_slots * mean_tokens
        if ahead_tokens < started_now:
            return 0.0
        if free_slots:
            first_ms = 0.0
        elif lane_full:
            first_ms = engine.next_departure_ms(now_ms)
            if first_ms == math.inf:  # nothing forecast to run: no end to wait for
                first_ms = 0.0
        else:
            first_ms = engine.slot_wait_ms(now_ms)
        return first_ms + (ahead_tokens - started_now) / rate

    @property
    def batch_running(self) -> int:
        """Batch requests dispatched and not ended: what :meth:`batch_slots` bounds."""
        return self._batch_running

    def batch_concurrency(self, now_ms: float, kv_blocks: int = 0) -> int:
        """The most batch requests the wait prediction counts on running at once on a batching
        engine (docs/capacity.md): :meth:`batch_slots`, or fewer where the KV cache binds
        first — the batch watermark's blocks over the mean KV booking of the lane's requests
        to come (those queued, with ``kv_blocks``, the request's own, if given), at least 1::

            kv_slots          = max(1, floor(batch_kv_watermark * totalKvBlocks / mean_booking))
            batch_concurrency = min(batch_slots, kv_slots)

        With nothing queued and no booking given it is :meth:`batch_slots`. The dispatcher
        does not read it: a request starts whenever its blocks fit (``kv_fits``); this is the
        concurrency its lane's waits are priced at. O(1)."""
        slots = self.batch_slots(now_ms)
        queued = self.queued_count[LANE_BATCH]
        blocks = self.queued_blocks[LANE_BATCH] + kv_blocks
        count = queued + 1 if kv_blocks > 0 else queued
        if count == 0 or blocks <= 0:
            return slots
        kv_slots = math.floor(self._kv_limits[LANE_BATCH] * count / blocks)
        if kv_slots < 1:
            kv_slots = 1
        return kv_slots if kv_slots < slots else slots

    def batch_slots(self, now_ms: float) -> int:
        """The most batch requests the dispatcher lets run at once on a batching engine: the
        slots the **interactive reserve** leaves the batch lane (docs/capacity.md). With ``S =
        maxBatchRequests``, ``s = batchMinShare`` and ``rho`` the interactive lane's recent
        admitted demand as a fraction of ``R`` (the rate the batch lane's prediction reads:
        time constant ``maxBatchWaitMs``; at most 1)::

            reserve     = min(S - floor, 1 + round(rho * S))   with an interactive tenant
                        = 0                                    without (nothing to keep it for)
            floor       = max(1, ceil(s * S))                  the batch lane's least slots
            batch_slots = S - reserve

        ``rho * S`` is the interactive lane's mean concurrency at the full batch (Little's law:
        its share of the throughput, of the ``S`` slots that carry it), rounded half up to a
        whole slot, and the one more is the free slot its next arrival starts in at once. The
        batch lane always keeps its minimum share's slots, and at least one. ``S = 1`` (a
        serial engine): 1, no reserve.

        A tenant's ``maxConcurrentRequests`` bounds what the reserve keeps for it: an
        interactive request admitted while the tenant's running and queued requests fill its
        limit counts in ``rho`` when it starts, not when admitted (``DEMAND_AT_DISPATCH``), so
        a held tenant's flood counts at the rate it runs; and the one more is kept only while
        an interactive tenant could start a request now (one without the limit, or below
        it)."""
        batch = self.policy.max_batch_requests
        if batch == 1 or not self._interactive_tenants:
            return batch
        load = self._interactive_demand.rate(now_ms, self._wait_limits[1]) / self._rate
        reserve = math.floor((load if load < 1.0 else 1.0) * batch + 0.5)
        reserve += self._next_arrival_slot()
        most = batch - self._batch_floor_slots
        return batch - (reserve if reserve < most else most)

    def _next_arrival_slot(self) -> int:
        """The reserve's one more slot (:meth:`batch_slots`): 1 unless every interactive tenant
        has ``maxConcurrentRequests`` and runs that many requests (none could start one now;
        the counts change only at a dispatch or an end)."""
        capped = self._interactive_capped
        if capped is None:
            return 1
        tenants = self.tenants
        for tenant_id in capped:
            tenant = tenants.get(tenant_id)
            if tenant is None or tenant.running < tenant.max_running:
                return 1
        return 0

    def _batch_slots_grow_ms(self, now_ms: float) -> float | None:
        """When :meth:`batch_slots` next exceeds the batch requests running, with nothing
        admitted meanwhile; None if it does now or never will by time alone.

        With ``k = S - batch_running``, the batch lane may start one more once ``reserve < k``.
        Held back now, the floor's cap ``S - floor`` is at least ``k``, and it does not move
        with time: only ``n + round(rho * S) < k`` can come (``n`` the one more slot, 0 or 1:
        :meth:`_next_arrival_slot`, constant between dispatches and ends), i.e. ``rho * S <
        k - n - 0.5``, when the interactive demand rate falls below ``(k - n - 0.5) * R / S``
        (never for ``k < n + 1``;
        :meth:`DemandRate.ms_until_below`). Returned a little after that instant (``1e-9 tau``,
        and at least one ulp past ``now_ms``), so the rounding in :meth:`batch_slots` has moved
        when the caller looks."""
        if self._batch_running < self.batch_slots(now_ms):
            return None
        batch = self.policy.max_batch_requests
        k = batch - self._batch_running
        tau_ms = self._wait_limits[1]
        wait_ms = self._interactive_demand.ms_until_below(
            (k - self._next_arrival_slot() - 0.5) * self._rate / batch, now_ms, tau_ms
        )
        if wait_ms == math.inf:
            return None
        return max(now_ms + wait_ms + 1e-9 * tau_ms, math.nextafter(now_ms, math.inf))

    def _engine_wait_ms(self, now_ms: float) -> float:
        """How long until the engine takes a request sent now: a serial engine's residual work,
        a batching engine's wait for a slot."""
        engine = self._engine
        if engine is None:
            return self._residual.wait_ms(now_ms)
        return engine.slot_wait_ms(now_ms)

    def _join_rank(self, job: Job, now_ms: float) -> float | None:
        """A tenant that is not backlogged, owes nothing and has had less than its fair share
        lately (:meth:`share_ratio`) joins the ring ahead with ``job``, the least served first
        (VTC's lift, in DRR terms: docs/fairness.md), if the job can start when its turn comes:
        it fits the KV cache now, or the cache is forecast to have room for it before the work
        ahead of it is done at the full rate (a lifted request that cannot start at its turn
        goes to the tail). Its rank is its share ratio in the interactive lane, 0 in the batch lane
        (its joiners in the order admitted). None: it joins at the tail."""
        tenant_id = job.tenant_id
        lane = job.lane
        drr = self._lanes[lane]
        queue = drr.queues[tenant_id]
        if queue.in_active or queue.deficit_units < 0:
            return None
        ratio = self.share_ratio(tenant_id, lane, now_ms)
        if ratio is None or ratio >= 1.0:
            return None
        if not self.kv_fits(job):
            turn_ms = self._engine_wait_ms(now_ms) + (
                drr.tokens_before_joining_ahead(ratio) / self.policy.service_tokens_per_ms
            )
            if self.kv_wait_ms(job, now_ms) > turn_ms:
                return None
        # The batch lane's joiners keep the order they were admitted in (one rank for all:
        # `push` puts equals in arrival order), so a joiner's first turn is the one admission
        # predicted: a later, less served joiner no longer goes before it. Ranked by the ratio
        # (bench_fairness, scenario 3, seed 3), 52 % of the batch service given between the
        # admission and the expiry of the batch requests that expired went to later joiners.
        return ratio if lane == LANE_INTERACTIVE else 0.0

    def _batch_intrusion(self, interactive_tokens: float) -> float:
        """Batch service tokens the minimum share lets run while ``interactive_tokens`` are
        served: none until the credit ``c + X * s / (1 - s)`` covers the cheapest batch head,
        else that credit plus one head — the front's of the batch ring, the one its round robin
        sends next, if dearer than the cheapest (a due head may cost more than the credit)."""
        if not self.queued_count[LANE_BATCH]:
            return 0.0
        cheapest_units = self._cheapest_batch_units
        if cheapest_units is None:
            cheapest_units = self._cheapest_batch_units = self._lanes[LANE_BATCH].min_head_units()
            if cheapest_units is None:
                return 0.0
        cheapest = tokens_of(cheapest_units)
        share = self._batch_min_share
        credit = tokens_of_float(
            self._batch_credit_scaled / self._credit_spend
        ) + interactive_tokens * share / (1.0 - share)
        if credit < cheapest:
            return 0.0
        # Due: the batch lane sends the head its round robin picks, which is the front's
        # (usually), not the cheapest one.
        head = cheapest
        active = self._lanes[LANE_BATCH].active
        if active:
            front = active[0].head()
            if front is not None and front.expected_tokens > head:
                head = front.expected_tokens
        return credit + head

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        # The gates in their order; the hot path (a request that passes) reads cached policy
        # constants and calls out only where the work is: the refusals (and the occupancy they
        # record, which nothing here changes) are built when a gate fails.
        lane = job.lane
        tenant_id = job.tenant_id
        wait_limit_ms = self._wait_limits[lane]
        drr = self._lanes[lane]
        competition = self._competition[lane]
        competition.retire(now_ms, wait_limit_ms, self._backlogged[lane])
        offered_rates = self._offered[lane]
        offered = offered_rates.get(tenant_id)
        if offered is None:
            offered = offered_rates[tenant_id] = DemandRate()
        service_tokens = job.service_tokens
        offered.add(service_tokens * tenant.usage_ratio, now_ms, self._memories_ms[lane])
        queued_all = self.queued_count[0] + self.queued_count[1]
        if queued_all >= self._max_queued_requests or tenant.queued >= self._max_queued_per_tenant:
            return self._refusal(
                job,
                QUEUE_FULL,
                "admission",
                self._occupancy(job),
                self.predicted_wait_ms(tenant_id, lane, service_tokens, now_ms),
                queued_requests=queued_all,
                tenant_queued_requests=tenant.queued,
            )
        kv_share = job.kv_blocks / self._total_kv_blocks
        if kv_share > self._watermarks[lane]:
            return shed_kv(self, job, "admission", kv_share)
        if kv_share > tenant.max_kv_share:  # no state of the cache lets it start
            return self._refusal(
                job,
                SHED_TENANT_KV_SHARE,
                "admission",
                self._occupancy(job),
                None,
                request_kv_share=round(kv_share, 4),
                max_kv_share=tenant.max_kv_share,
            )
        # From its arrival: a replay submits the arrivals of a busy stretch when it ends.
        join_rank = self._join_rank(job, now_ms)
        elapsed_ms = now_ms - job.arrival_ms
        turn_wait_ms = self.predicted_wait_ms(
            tenant_id, lane, service_tokens, now_ms, join_rank, job.kv_blocks
        )
        kv_wait_ms = self.kv_wait_ms(job, now_ms)
        model_wait_ms = turn_wait_ms if turn_wait_ms > kv_wait_ms else kv_wait_ms
        waited_ms = elapsed_ms if elapsed_ms > 0.0 else 0.0
        if lane == LANE_INTERACTIVE:
            predicted_wait_ms = waited_ms + model_wait_ms
        else:
            # The batch lane: the model's wait times how much longer the lane's requests have
            # waited than it predicted lately (`wait_correction`), and a request that joins at
            # the ring's tail, or ahead behind other joiners, times TAIL_WAIT_FACTOR more.
            correction = self.wait_correction(lane, now_ms)
            if join_rank is None or drr.ahead_joiners:
                correction *= TAIL_WAIT_FACTOR
            predicted_wait_ms = waited_ms + model_wait_ms * correction
        if predicted_wait_ms > wait_limit_ms:
            return self._refusal(
                job,
                SHED_QUEUE_WAIT_SLO,
                "admission",
                self._occupancy(job),
                predicted_wait_ms - wait_limit_ms,
                predicted_wait_ms=predicted_wait_ms,
                max_wait_ms=wait_limit_ms,
            )
        # Gate 4: the rest of `_budget_gate` only if the budget is short. The request's wait,
        # less the time its own limits hold its tenant back (`_waited_for`), is a sample of the
        # wait correction, unless its cost is above the burst (only a loan starts it).
        budget_wait_ms = self._budget_wait_ms(tenant, service_tokens, now_ms)
        sampled = budget_wait_ms is not None
        if budget_wait_ms is None or budget_wait_ms > 0.0:
            refusal = self._budget_gate(job, tenant, wait_limit_ms, now_ms, budget_wait_ms)
            if refusal is not None:
                return refusal
        # The expected cost in units: exact at a usage ratio of 1, else the nearest unit of
        # estimate x ratio (the one rounding: 0.5 unit + 2^-53 of the value at most, per job).
        ratio = tenant.usage_ratio
        units = units_of(service_tokens) if ratio == 1.0 else nearest_units(service_tokens * ratio)
        job.expected_units = units
        job.expected_tokens = expected_tokens = tokens_of(units)
        self._push_ahead = join_rank
        competition.admitted(tenant_id, drr.queues[tenant_id].quantum, now_ms)
        self._lane_demand[lane].add(expected_tokens, now_ms, wait_limit_ms)
        job.lifted = join_rank is not None
        if sampled and lane == LANE_BATCH:
            sampled_ms = waited_ms + model_wait_ms
            self._pending_samples[job.request_id] = (
                sampled_ms,
                self._tenant_held_by(tenant_id, now_ms),
            )
            self._admitted_order[lane].append(
                (job.request_id, tenant_id, job.arrival_ms, sampled_ms)
            )
        if lane == LANE_INTERACTIVE:
            if self._tenant_limits and tenant.running + tenant.queued >= tenant.max_running:
                job.held |= DEMAND_AT_DISPATCH  # counted when it can run (`batch_slots`)
            else:
                self._interactive_demand_add(service_tokens, now_ms)
        return None

    def wait_correction(self, lane: int, now_ms: float) -> float:
        """How much longer than predicted the lane's requests waited lately (the batch lane's,
        on a serial engine as on a batching one): the ratio of the waits they had (from
        arrival to dispatch, less the time the round robin held their tenant back for its
        budget or its ``maxConcurrentRequests`` meanwhile: that wait is the tenant's own, not
        the engine model's; three wait limits for one that expired, unless its tenant was held
        then: :meth:`_waited_for`) to
        the model waits admission predicted for them, each a sum decayed with
        :data:`WAIT_CORRECTION_LIMITS` wait limits, within :data:`WAIT_CORRECTION_RANGE`
        (1 before any request has waited) — or, if larger, the ratio of the oldest queued
        request's wait so far (less its tenant's holds) to its prediction (a wait not yet
        over: the lower bound of what it will have waited, known a wait limit before its
        expiry would say it). Every batch request whose cost its tenant's burst covers is a
        sample, a flooder's too, whichever of its budget and the engine model predicts the
        longer wait. Admission times
        the model's wait by it: a model that the engine does not keep to (slower than
        calibrated, noisier, held back by KV the model does not see), or a lane rate the model
        misjudges (interactive demand above its recent average, joiners ahead of the ring's
        tail above their recent rate), stops admitting requests that then wait out their limit,
        and as the waits come true again the correction returns to 1."""
        limit_ms = self._wait_limits[lane]
        tau_ms = limit_ms * WAIT_CORRECTION_LIMITS
        ratio = _CORRECTION_LOW
        waited = self._waited[lane].rate(now_ms, tau_ms)
        if waited > 0.0:
            predicted = self._predicted[lane].rate(now_ms, tau_ms)
            if predicted * _CORRECTION_HIGH <= waited:
                return _CORRECTION_HIGH
            ratio = waited / predicted
        order = self._admitted_order[lane]
        pending = self._pending_samples
        while order and order[0][0] not in pending:
            order.popleft()  # started, expired or cancelled
        if order:
            request_id, tenant_id, arrival_ms, predicted_ms = order[0]
            floor_ms = limit_ms * PREDICTED_WAIT_FLOOR
            # Its wait so far less the time its tenant's own limits held the tenant back.
            held_ms = self._tenant_held_by(tenant_id, now_ms) - pending[request_id][1]
            so_far = (now_ms - arrival_ms - held_ms) / (
                predicted_ms if predicted_ms > floor_ms else floor_ms
            )
            if so_far > ratio:
                ratio = so_far
        if ratio > _CORRECTION_HIGH:
            return _CORRECTION_HIGH
        return ratio if ratio > _CORRECTION_LOW else _CORRECTION_LOW

    def _waited_for(
        self,
        request_id: str,
        tenant_id: str,
        lane: int,
        waited_ms: float,
        now_ms: float,
        expired: bool,
    ) -> None:
        """A queued request's wait is known (it started, or it expired): into the lane's wait
        correction beside what admission predicted for it, less the time the round robin held
        its tenant back for its own limits meanwhile (:meth:`_tenant_hold`: from a pass-over
        with a slot and KV free and the bucket short until the tenant's head started, or with
        the tenant at its ``maxConcurrentRequests`` until the cap freed; that time is the
        tenant's own, and admission's model wait cannot tell it: a budget's refill without the
        burst's cap, no cap at all)::

            sample = max(0, waited - held)                started
                   = max(0, waited - held)                expired while its tenant was held
                   = EXPIRED_WAIT_LIMITS x wait limit     expired otherwise

        ``held`` is at most the wait (the holds are counted from the sample's admission), and
        each hold at most a wait limit. A request that expired while its tenant was held was
        kept by its tenant's limit at the end: what the engine made it wait is the rest. (Until
        review rev1207e F6 the cap's holds were not taken out: a tenant's
        ``maxConcurrentRequests: 1`` raised the whole lane's mean correction 1.02 -> 2.46 on an
        engine keeping to its model, test_wait_correction. Until 2026-12-07 a request whose
        tenant was held once in its wait was no sample at all: a flooder whose burst covers
        two requests is held at most dispatches where three slots are free at once, and its
        samples, all of them, left the correction at 1 however slow the engine; and a request
        whose budget wait at admission was longer than the model's was no sample either: a
        budget refilled a little faster than a slow engine serves hid it from the correction;
        issue 27.)"""
        sample = self._pending_samples.pop(request_id, None)
        held_ms = 0.0
        held_now = False
        if sample is not None:
            held_ms = self._tenant_held_by(tenant_id, now_ms) - sample[1]
            # Held now: a hold not yet over, or the cap's, which lasts until the cap frees
            # (its bound of a wait limit from the last pass-over may have passed just before
            # the expiry: a head passed over at its arrival reaches it at its deadline).
            held_now = (
                self._tenant_held_until_ms.get(tenant_id, -math.inf) > now_ms
                or tenant_id in self._limit_held
            )
        if not expired:
            self._tenant_hold_ended(tenant_id, now_ms)  # its head started: no longer held
        self._drop_holds_without_samples()
        if sample is None:
            return
        limit_ms = self._wait_limits[lane]
        if expired and not held_now:
            waited_ms = EXPIRED_WAIT_LIMITS * limit_ms
        else:
            waited_ms -= held_ms
        tau_ms = limit_ms * WAIT_CORRECTION_LIMITS
        floor_ms = limit_ms * PREDICTED_WAIT_FLOOR
        predicted_ms = sample[0]
        self._waited[lane].add(waited_ms if waited_ms > 0.0 else 0.0, now_ms, tau_ms)
        self._predicted[lane].add(
            predicted_ms if predicted_ms > floor_ms else floor_ms, now_ms, tau_ms
        )

    def _tenant_hold(self, job: Job, limit: bool) -> None:
        """The round robin passes over ``job``, its tenant's head, for the tenant's own limit
        now, a slot and KV free for it: its budget (``limit`` False, :meth:`_eligible`) or its
        ``maxConcurrentRequests`` or ``maxKvShare`` (``limit`` True, :meth:`_eligible_limited`).
        The tenant is held from now until its head starts (:meth:`_tenant_hold_ended`), its
        queue empties (:meth:`_hold_left_behind`) or, for a limit, until one of its requests
        ends below its cap (:meth:`_limit_freed`) or a reload lifts it; at most the lane's
        wait limit; added to its held time as far as it does not overlap the holds before. A
        budget's hold lasts until the head
        starts, not only until the bucket covers it: a slot the budget let another tenant
        take meanwhile is a wait the budget caused too (held only until the refill, a
        one-request burst beside a flood raised the lane's correction to a mean of up to 1.11,
        p95 up to 1.22, on an engine keeping to its model; this way 1.00, as when such waits
        were no samples). A cap's ends where the cap frees: the slot the tenant's own request
        leaves is the one its head starts in, and a wait after that is for the engine or the
        tenant's turn, which the model predicts (a cap's waits taken as the engine's, one
        tenant's ``maxConcurrentRequests: 1`` raised the whole lane's correction on an engine
        keeping to its model: review rev1207e F6; ``maxKvShare`` the same, review rev1207g F1:
        its blocks free as its request ends, and a tenant still past its share is held again
        at its next pass-over)."""
        now_ms = self._now_ms
        until_ms = now_ms + self._wait_limits[job.lane]
        tenant_id = job.tenant_id
        if limit:
            self._limit_held.add(tenant_id)
        else:
            self._limit_held.discard(tenant_id)
        last_ms = self._tenant_held_until_ms.get(tenant_id, -math.inf)
        if until_ms <= last_ms:
            return
        since_ms = now_ms if now_ms > last_ms else last_ms
        self._tenant_held_ms[tenant_id] = (
            self._tenant_held_ms.get(tenant_id, 0.0) + until_ms - since_ms
        )
        self._tenant_held_until_ms[tenant_id] = until_ms

    def _tenant_hold_ended(self, tenant_id: str, now_ms: float) -> None:
        """The tenant's hold ends now (its head started, its queue emptied, or its cap freed):
        a hold that was to last longer ends here."""
        self._limit_held.discard(tenant_id)
        until_ms = self._tenant_held_until_ms.get(tenant_id, -math.inf)
        if until_ms > now_ms:
            self._tenant_held_ms[tenant_id] -= until_ms - now_ms
            self._tenant_held_until_ms[tenant_id] = now_ms

    def _limit_freed(self, tenant_id: str, now_ms: float) -> None:
        """One of the tenant's requests ended (:meth:`_finished`), or a reload changed its
        limits: if its last hold is its ``maxConcurrentRequests``' or ``maxKvShare``'s and the
        tenant is below its cap now, that hold ends (a tenant still past its KV share is held
        again at its next pass-over)."""
        if tenant_id in self._limit_held:
            tenant = self.tenants.get(tenant_id)
            if tenant is None or tenant.running < tenant.max_running:
                self._tenant_hold_ended(tenant_id, now_ms)

    def _tenant_held_by(self, tenant_id: str, now_ms: float) -> float:
        """The tenant's held time (:meth:`_tenant_hold`) up to ``now_ms``: the held ms
        recorded, less the part of the last hold still to come."""
        held_ms = self._tenant_held_ms.get(tenant_id)
        if held_ms is None:
            return 0.0
        ahead_ms = self._tenant_held_until_ms[tenant_id] - now_ms
        return held_ms - ahead_ms if ahead_ms > 0.0 else held_ms

    def cancel(self, request_id: str, now_ms: float) -> Decision | None:
        decision = super().cancel(request_id, now_ms)
        if decision is not None:
            self._pending_samples.pop(request_id, None)  # its wait is not known
            self._hold_left_behind(decision.tenant_id, now_ms)
        return decision

    def _hold_left_behind(self, tenant_id: str, now_ms: float) -> None:
        """A request of the tenant left the queue without starting (cancelled, expired): if
        the tenant has nothing left queued in the batch lane, its hold ends now. Held
        until its next head started, it would outlive the request it held, and the tenant's
        next sample, a wait for the engine alone, would have that time taken out (review
        rev1207e F4: the correction 4.42 read 2.29)."""
        if not self._lanes[LANE_BATCH].backlogged(tenant_id):
            self._tenant_hold_ended(tenant_id, now_ms)
        self._drop_holds_without_samples()

    def _drop_holds_without_samples(self) -> None:
        """No sample pending: nothing to take the holds out of, so none is kept (the holds are
        bounded by the samples)."""
        if not self._pending_samples:
            self._tenant_held_ms.clear()
            self._tenant_held_until_ms.clear()
            self._limit_held.clear()

    def _occupancy(self, job: Job) -> float:
        """The KV occupancy ``job`` attempts: resident blocks and its own, of the whole cache."""
        return (self.kv_gate_blocks + self.kv_gate_job_blocks(job)) / self._total_kv_blocks

    def kv_wait_ms(self, job: Job, now_ms: float) -> float:
        """How long until the KV cache has room for ``job`` under its class watermark, if the
        resident requests free their blocks (those the gates count: :meth:`kv_gate_freed_blocks`)
        when the cost model says: a request dispatched at ``t`` holds them until ``t +
        kv_residency_factor * expected / rate``, corrected to its actual usage when it settles.
        0 if it fits now. O(r log r) in the resident requests, and only for a request that does
        not fit now."""
        excess = self.kv_gate_blocks + self.kv_gate_job_blocks(job) - self._kv_limits[job.lane]
        if excess <= 0:
            return 0.0
        jobs = self.jobs
        freed = 0
        last_ms = now_ms
        engine = self._engine
        if engine is not None:
            # A batching engine frees a request's blocks when it ends: in the order the
            # forecast ends them. O(r log r) in the running requests.
            for in_ms, request_id in engine.departures(now_ms):
                held = jobs.get(request_id)
                if held is None:
                    continue
                freed += self.kv_gate_freed_blocks(held)
                last_ms = now_ms + in_ms
                if freed >= excess:
                    break
            return max(0.0, last_ms - now_ms)
        for release_ms, request_id in sorted(
            (ms, rid) for rid, ms in self._kv_release_ms.items() if rid in jobs
        ):
            freed += self.kv_gate_freed_blocks(jobs[request_id])
            last_ms = release_ms
            if freed >= excess:
                break
        return max(0.0, last_ms - now_ms)

    def _kv_released(self, job: Job) -> None:
        self._kv_release_ms.pop(job.request_id, None)

    @staticmethod
    def _budget_wait_ms(tenant: TenantState, service_tokens: int, now_ms: float) -> float | None:
        """Gate 4's first step: how long until the tenant's bucket covers its queued work (at
        the usage ratio, if above 1) and ``service_tokens``; None if they are above the burst
        (never coverable). The bucket is read once per admission."""
        bucket = tenant.bucket
        if service_tokens > bucket.burst:
            return None
        ratio = tenant.usage_ratio
        # An integer at a ratio up to 1: the bucket compares it exactly, without rounding.
        needed: int | float = (
            tenant.queued_tokens * ratio + service_tokens
            if ratio > 1.0
            else tenant.queued_tokens + service_tokens
        )
        return bucket.ms_until(needed, now_ms)

    def _budget_gate(
        self,
        job: Job,
        tenant: TenantState,
        wait_limit_ms: float,
        now_ms: float,
        budget_wait_ms: float | None,
    ) -> Decision | None:
        """Gate 4: can the tenant's budget cover its queued work and this request in time?

        Each queued request needs its estimate in the bucket when it is dispatched (a refund
        comes back only after it ran), a debt is paid at the usage ratio, and with work queued
        ahead the server may still be running the previous request when the budget allows this
        one. With ``lend_idle_capacity`` a request the budget cannot cover may still borrow: it
        passes if its queue can be served in time at the capacity that work within budget has
        left lately (``R`` minus the recent within-budget dispatch rate).

        ``budget_wait_ms`` is :meth:`_budget_wait_ms`, as :meth:`_admit` read it."""
        policy = self.policy
        bucket = tenant.bucket
        elapsed_ms = max(0.0, now_ms - job.arrival_ms)
        never = budget_wait_ms is None
        if budget_wait_ms is None:
            budget_wait_ms = 0.0
        else:
            if budget_wait_ms > 0.0:
                budget_wait_ms += elapsed_ms
                if tenant.queued:
                    budget_wait_ms += job.service_tokens / policy.service_tokens_per_ms
            if budget_wait_ms <= wait_limit_ms:
                return None
        if policy.lend_idle_capacity:
            rate = policy.service_tokens_per_ms
            spare = rate - self._budgeted.rate(now_ms, self._lending_memory_ms())
            spare = max(spare, rate * MIN_LANE_RATE_FRACTION)
            queue = self._lanes[job.lane].queues[job.tenant_id]
            borrow_wait_ms = elapsed_ms + self._engine_wait_ms(now_ms) + queue.queued_tokens / spare
            if borrow_wait_ms <= wait_limit_ms:
                return None
            budget_wait_ms = max(budget_wait_ms, borrow_wait_ms)
        return self._refusal(
            job,
            SHED_TENANT_TOKEN_QUOTA,
            "admission",
            self._occupancy(job),
            None if never and not policy.lend_idle_capacity else budget_wait_ms - wait_limit_ms,
            bucket_tokens=bucket.level,
            tenant_queued_tokens=tenant.queued_tokens,
            burst_tokens=bucket.burst,
            budget_wait_ms=budget_wait_ms,
        )

    def _lending_memory_ms(self) -> float:
        """Time constant of the within-budget dispatch rate: the shorter wait limit, so lending
        stops within a wait limit of the neighbours coming back."""
        return min(self.policy.max_interactive_wait_ms, self.policy.max_batch_wait_ms)

    def _expired(self, expired: list[Decision], now_ms: float) -> None:
        """The ``Retry-After`` of the requests :meth:`expire` refused, from the tenant's own
        position: how much longer than the limit a new request of the tenant would wait now, for
        its turn or (with budgets as caps) for its budget."""
        for decision in expired:
            lane = LANE_OF[decision.priority_class]
            if self._pending_samples:
                self._waited_for(
                    decision.request_id,
                    decision.tenant_id,
                    lane,
                    now_ms - decision.arrival_ms,
                    now_ms,
                    True,
                )
            tenant_id = decision.tenant_id
            if lane == LANE_BATCH:
                self._hold_left_behind(tenant_id, now_ms)
            wait_ms = self.predicted_wait_ms(tenant_id, lane, decision.service_tokens, now_ms)
            tenant = self.tenants[tenant_id]
            if not self.policy.lend_idle_capacity:
                needed = tenant.queued_tokens + decision.service_tokens
                wait_ms = max(wait_ms, tenant.bucket.ms_until(needed, now_ms))
            decision.retry_after_ms = max(0.0, wait_ms - self._wait_limits[lane])

    # -- selection --------------------------------------------------------------------------

    def _push(self, job: Job) -> None:
        lane = job.lane
        self._lanes[lane].push(job, join_ahead=self._push_ahead)
        backlog_served = self._backlog_served
        if backlog_served is not None and job.tenant_id not in backlog_served[lane]:
            backlog_served[lane].put(job.tenant_id, self._memories_ms[lane])

    def _forget(self, job: Job) -> None:
        lane = job.lane
        tenant_id = job.tenant_id
        drr = self._lanes[lane]
        drr.forget(job)
        if not drr.backlogged(tenant_id):
            self._competition[lane].drained(tenant_id)
        backlog_served = self._backlog_served
        if backlog_served is not None and not drr.queues[tenant_id].in_active:
            backlog_served[lane].drop(tenant_id)
        # Called before the totals drop the job: the batch lane empties if this is its last job.
        if self.queued_count[LANE_BATCH] == int(lane == LANE_BATCH):
            self._batch_credit_scaled = 0
            self._cheapest_batch_units = None

    def _eligible(self, job: Job) -> bool:
        if not self.kv_fits(job):
            return False
        if self._lending:
            return True
        tenant = self.tenants[job.tenant_id]
        if tenant.bucket.covers(job.service_tokens, self._now_ms):
            return True
        if self._pending_samples and job.lane == LANE_BATCH:  # only the batch lane samples
            self._tenant_hold(job, False)
        return False

    def _still_past_kv_share(self, tenant_id: str) -> bool:
        """The tenant's batch head would still take it past its ``maxKvShare``."""
        tenant = self.tenants.get(tenant_id)
        queue = self._lanes[LANE_BATCH].queues.get(tenant_id)
        head = None if queue is None else queue.head()
        return tenant is not None and head is not None and self._past_kv_share(tenant, head)

    def _batch_need(self, job: Job) -> int:
        """A passed-over batch head's KV need for its place (:meth:`kv_gate_job_blocks`), or,
        held by its tenant's own ``maxConcurrentRequests`` or ``maxKvShare``, less than any
        room: its own limit holds it, so it goes to the tail and does not take the kept place
        from a head that waits for the engine's KV (review rev1207h F2)."""
        if self._tenant_limits:
            tenant = self.tenants[job.tenant_id]
            if tenant.running >= tenant.max_running or self._past_kv_share(tenant, job):
                return NOT_KEPT_NEED
        return self.kv_gate_job_blocks(job)

    def _batch_kv_room(self) -> int:
        """The blocks a batch request may book now (:meth:`kv_room_blocks`): the batch lane's
        pick reads it only when a head is passed over or a kept head waits."""
        return self.kv_room_blocks(LANE_BATCH)

    def _eligible_limited(self, job: Job) -> bool:
        """:meth:`_eligible` behind the tenant's entitlements: a head whose tenant runs
        ``maxConcurrentRequests`` requests, or whose KV blocks would take the tenant's resident
        blocks past ``maxKvShare`` of the pool, is passed over (marked in ``job.held``; the
        round robin goes on to the next tenant, and grants a passed-over tenant no quantum)."""
        tenant = self.tenants[job.tenant_id]
        if tenant.running >= tenant.max_running:
            job.held |= HELD_CONCURRENCY
            # Only the batch lane samples; a head KV holds back too waits for the engine's KV
            # (the model's `kv_wait_ms`), as a budget's hold starts only with KV free.
            if self._pending_samples and job.lane == LANE_BATCH and self.kv_fits(job):
                self._tenant_hold(job, True)
            return False
        if self._past_kv_share(tenant, job):
            job.held |= HELD_KV_SHARE
            # Its own maxKvShare holds it as its cap does (review rev1207g F1: the same lane
            # correction 1.02 -> 2.45); it ends when one of its requests ends, its blocks freed.
            if self._pending_samples and job.lane == LANE_BATCH and self.kv_fits(job):
                self._tenant_hold(job, True)
            return False
        return self._eligible(job)

    def _past_kv_share(self, tenant: TenantState, job: Job) -> bool:
        """``job``'s blocks would take the tenant's resident blocks past ``maxKvShare``."""
        return (tenant.resident_blocks + job.kv_blocks) / self._total_kv_blocks > (
            tenant.max_kv_share
        )

    def _held_at_expiry(self, job: Job, decision: Decision) -> None:
        """A queued request expires ``shed_tenant_concurrency`` if its tenant runs
        ``maxConcurrentRequests`` requests at that instant, else ``shed_tenant_kv_share`` if its
        blocks would take the tenant past ``maxKvShare``, else it stays ``shed_queue_timeout``
        (held by the KV watermark, its budget or its turn): the limit the client can act on."""
        tenant = self.tenants[job.tenant_id]
        observed = decision.observed
        if tenant.running >= tenant.max_running:
            decision.reason = SHED_TENANT_CONCURRENCY
            observed["max_concurrent_requests"] = tenant.max_running
            observed["tenant_running_requests"] = tenant.running
        elif self._past_kv_share(tenant, job):
            decision.reason = SHED_TENANT_KV_SHARE
            observed["max_kv_share"] = tenant.max_kv_share
            observed["tenant_kv_share"] = round(tenant.resident_blocks / self._total_kv_blocks, 4)
            observed["request_kv_share"] = round(job.kv_blocks / self._total_kv_blocks, 4)

    def _select(self, now_ms: float) -> Job | None:
        self._now_ms = now_ms
        job = self._select_by_lane()
        if job is None and self._lend:
            # Nobody within budget can start: lend the idle capacity to work over budget.
            self._lending = True
            try:
                job = self._select_by_lane()
            finally:
                self._lending = False
            if job is not None:
                job.borrowed = True
        if job is not None:
            tenant_id = job.tenant_id
            if not self._lanes[job.lane].queues[tenant_id].live:  # no longer backlogged
                self._competition[job.lane].drained(tenant_id)
        return job

    def _select_by_lane(self) -> Job | None:
        interactive, batch = self._lanes
        eligible = self._eligible_now
        queued_count = self.queued_count
        batch_waiting = queued_count[1] > 0
        interactive_waiting = queued_count[0] > 0
        if not batch_waiting:
            self._batch_credit_scaled = 0
            self._cheapest_batch_units = None
        batch_due = False
        if interactive_waiting and batch_waiting:
            cheapest = self._cheapest_batch_units = batch.min_head_units()
            batch_due = (
                cheapest is not None and self._batch_credit_scaled >= cheapest * self._credit_spend
            )
        if interactive_waiting and not batch_due:
            job = interactive.pick(eligible)
            if job is not None:
                if batch_waiting:
                    self._batch_credit_scaled += job.expected_units * self._credit_earn
                return job
        # A batching engine's batch lane starts nothing while it holds the slots the
        # interactive reserve leaves it (`batch_slots`); a serial engine has no reserve.
        if batch_waiting and (
            self._engine is None or self._batch_running < self.batch_slots(self._now_ms)
        ):
            # A head the KV cache cannot take now keeps its tenant's place (docs/fairness.md
            # §5.5, change 9): admission predicted its start from that place.
            job = batch.pick(eligible, self._batch_need, self._batch_kv_room)
            if job is not None:
                if interactive_waiting:
                    self._batch_credit_scaled -= job.expected_units * self._credit_spend
                return job
        if batch_due:
            return interactive.pick(eligible)
        return None

    # -- budgets and settlement -------------------------------------------------------------

    def _charge(self, job: Job, tenant: TenantState, now_ms: float) -> None:
        rate = self._rate
        expected_tokens = job.expected_tokens
        self._running_expected += expected_tokens
        if job.lane == LANE_BATCH:
            self._batch_running += 1
        elif job.held & DEMAND_AT_DISPATCH:
            self._interactive_demand_add(job.service_tokens, now_ms)
        engine = self._engine
        if engine is None:
            self._kv_release_ms[job.request_id] = (
                now_ms + self._kv_residency * expected_tokens / rate
            )
            self._residual.dispatched(expected_tokens, rate, now_ms)
        else:
            engine.start(job.request_id, expected_tokens, now_ms)
        if self._pending_samples:  # a batch request whose wait admission sampled
            self._waited_for(
                job.request_id, job.tenant_id, job.lane, now_ms - job.arrival_ms, now_ms, False
            )
        self._record_service(job, expected_tokens, now_ms)
        if job.lifted:
            lane = job.lane
            self._lane_lifted[lane].add(expected_tokens, now_ms, self._wait_limits[lane])
        if job.borrowed:
            return
        if self._lend:  # only lending reads it
            self._budgeted.add(expected_tokens, now_ms, self._lending_memory_ms())
        tenant.bucket.debit(job.service_tokens, now_ms)

    def _record_service(
        self, job: Job, tokens: float, now_ms: float, lane_tokens: float | None = None
    ) -> None:
        """Add ``tokens`` to the tenant's recent service in its lane and ``lane_tokens``
        (default: the same) to the lane's."""
        lane = job.lane
        memory_ms = self._memories_ms[lane]
        tenant_id = job.tenant_id
        served = self._served[lane].get(tenant_id)
        if served is None:
            served = self._served[lane][tenant_id] = DemandRate()
        served.add(tokens, now_ms, memory_ms)
        self._lane_served[lane].add(
            tokens if lane_tokens is None else lane_tokens, now_ms, memory_ms
        )
        backlog_served = self._backlog_served
        if backlog_served is not None:  # (a dispatch that emptied its queue: it left)
            if self._lanes[lane].queues[tenant_id].in_active:
                backlog_served[lane].put(tenant_id, memory_ms)
            else:
                backlog_served[lane].drop(tenant_id)

    def _finished(self, job: Job, now_ms: float | None) -> None:
        running_expected = self._running_expected - job.expected_tokens
        # Exactly 0 when nothing runs (float residue of the sums otherwise).
        self._running_expected = running_expected if self.running and running_expected > 0 else 0.0
        if job.lane == LANE_BATCH:
            self._batch_running -= 1
        ended_ms = self._now_ms if now_ms is None else now_ms
        if self._limit_held:  # a tenant held at its maxConcurrentRequests may be below it now
            self._limit_freed(job.tenant_id, ended_ms)
        engine = self._engine
        if engine is not None:
            engine.finish(job.request_id, ended_ms, job.expected_tokens)

    def fair_level(self, lane: int, now_ms: float) -> float:
        """The lane's weighted max-min water level ``L``, in service tokens per ms per quantum
        token: each tenant ``j`` is owed ``min(offered_j, L * Q_j)`` of the lane's recent service
        rate, ``offered_j`` being its recent offered rate (every arrival, admitted or not).
        ``inf`` while the offers fit. Recomputed at most once per wait limit of the lane, in
        O(n log n) over the tenants that offered lately (``shares.water_level``); tenants whose
        offer has faded below 1e-9 tokens per ms are forgotten then."""
        at_ms, level = self._level[lane]
        horizon_ms = self._wait_limits[lane]
        if now_ms - at_ms < horizon_ms:
            return level
        memory_ms = horizon_ms * SERVICE_MEMORY_LIMITS
        # Capacity: what the lane served lately, with the same time constant as the offers (so
        # both warm up alike), not what it could serve: the batch lane gets what interactive
        # leaves. Nothing served yet: level 0 (nobody is owed a share of nothing), asked again
        # at the lane's first service, without the O(n log n) pass.
        served = self._lane_served[lane].rate(now_ms, memory_ms)
        if served <= 0.0:
            return 0.0
        queues = self._lanes[lane].queues
        configured = self.config.tenant_index
        offered = self._offered[lane]
        demands: list[tuple[float, float]] = []
        for tenant_id, rate in list(offered.items()):
            value = rate.rate(now_ms, memory_ms)
            if value < FORGOTTEN_RATE or tenant_id not in configured:
                del offered[tenant_id]  # faded, or removed by a reload
            else:
                demands.append((value, queues[tenant_id].quantum))
        level = water_level(served, demands)
        self._level[lane] = (now_ms, level)
        return level

    def share_ratio(self, tenant_id: str, lane: int, now_ms: float) -> float | None:
        """The tenant's recent service per quantum over the lane's max-min water level (below 1:
        owed service), or over the lane's recent service per competing quantum while the offers
        fit the lane; None while the lane has served nothing lately."""
        memory_ms = self._memories_ms[lane]
        quantum = self._lanes[lane].queues[tenant_id].quantum
        at_ms, level = self._level[lane]  # `fair_level`'s cached level while it is fresh
        if not now_ms - at_ms < self._wait_limits[lane]:
            level = self.fair_level(lane, now_ms)
        if math.isinf(level):
            lane_rate = self._lane_served[lane].rate(now_ms, memory_ms)
            competing = tokens_of(self._competition[lane].competing_units)
            if lane_rate <= 0.0 or competing <= 0.0:
                return None
            level = lane_rate / competing
        if level <= 0.0:
            return None
        served = self._served[lane].get(tenant_id)
        if served is None:
            return 0.0
        return served.rate(now_ms, memory_ms) / (level * quantum)

    def _settle(self, job: Job, tenant: TenantState, refund: int, now_ms: float) -> None:
        if (
            not refund
            and tenant.usage_ratio == 1.0
            and job.expected_units == units_of(job.service_tokens)
        ):
            # Used its estimate, expected at it, ratio at 1: the ratio stays 1.0 exactly
            # (1.0 + (c / c - 1.0) * w), the overrun is 0.0 and there is no refund: nothing
            # below would change anything.
            return
        if job.service_tokens:
            ratio = tenant.usage_ratio
            ratio += ((job.service_tokens - refund) / job.service_tokens - ratio) * (
                USAGE_RATIO_WEIGHT
            )
            # min(high, max(low, ratio)) in conditionals, the same comparisons
            ratio = ratio if ratio > _RATIO_LOW else _RATIO_LOW
            tenant.usage_ratio = ratio if ratio < _RATIO_HIGH else _RATIO_HIGH
        # The round robin and the work in flight were charged the expected usage; the budget
        # was charged the estimate. Each is settled against what it was charged.
        overrun_units = units_of(job.service_tokens - refund) - job.expected_units
        if overrun_units:
            overrun = tokens_of(overrun_units)
            rate = self._rate
            dispatch_ms = job.decision.dispatch_ms if job.decision is not None else None
            # The debt is the tenant's: its deficit and its own recent service take the whole
            # overrun. What others see — the lane's recent service, the work in flight — takes
            # only what the engine can have done while the request ran (docs/fairness.md §5.4):
            # a reported usage, however large, never makes the engine look busier than it was.
            lane_overrun = overrun
            if dispatch_ms is not None:
                if self._engine is None:  # the hold follows the actual usage
                    self._kv_release_ms[job.request_id] = dispatch_ms + (
                        self.policy.kv_residency_factor * (job.service_tokens - refund) / rate
                    )
                # One request runs at most at one request's speed alone, X(1) = R / G.
                alone = rate / self.policy.batch_throughput_gain
                possible = alone * (now_ms - dispatch_ms) - job.expected_tokens
                # (+1e-6 token: a replay whose clock is the actual usage is never clamped by
                # float noise, so its decisions stay those of the unclamped sum.)
                if lane_overrun > possible + 1e-6:
                    lane_overrun = possible if possible > 0.0 else 0.0
            self._record_service(job, overrun, now_ms, lane_overrun)
            self._lanes[job.lane].settle_units(tenant.tenant_id, overrun_units)
            if self._engine is None:
                # Within the work the other running requests still hold.
                others = self._running_expected - job.expected_tokens
                bound_ms = now_ms + (others if others > 0.0 else 0.0) / rate
                self._residual.settled(overrun, rate, bound_ms)
        if refund and not job.borrowed:  # a borrowed dispatch was never charged to the bucket
            tenant.bucket.refill(now_ms)
            tenant.bucket.settle(refund)

    def next_wakeup_ms(self, now_ms: float) -> float | None:
        wakeup = super().next_wakeup_ms(now_ms)
        # Batch work held back by the interactive reserve starts when the reserve shrinks, as
        # the interactive demand fades: time alone moves it, so the dispatcher must wake then
        # (not only at an arrival, an end or the work's own deadline, where it would expire).
        if self._engine is not None and self.queued_count[LANE_BATCH]:
            grows_ms = self._batch_slots_grow_ms(now_ms)
            if grows_ms is not None and (wakeup is None or grows_ms < wakeup):
                wakeup = grows_ms
        if self.policy.lend_idle_capacity:
            return wakeup  # a head short of budget borrows when nothing else can start
        for lane in self._lanes:
            for queue in lane.active:
                head = queue.head()
                if head is None:
                    continue
                bucket = self.tenants[queue.tenant_id].bucket
                if head.service_tokens > bucket.burst:
                    continue  # no refill ever covers it (a reload shrank the burst): it expires
                wait_ms = bucket.ms_until(head.service_tokens, now_ms)
                if wait_ms > 0:
                    # At least one ulp later, so a caller that sleeps until then makes progress.
                    ready_ms = max(now_ms + wait_ms, math.nextafter(now_ms, math.inf))
                    if wakeup is None or ready_ms < wakeup:
                        wakeup = ready_ms
        return wakeup
