"""``tokenfair`` — the default policy: admit what *its tenant* can be served in time, then wait for
headroom.

Admission (at arrival; the first gate that fails decides, with a ``Retry-After``):

1. ``queue_full`` — ``queued_all >= max_queued_requests`` or
   ``queued_tenant >= max_queued_requests_per_tenant``.
2. ``shed_kv_watermark`` — only a request that could *never* fit: ``kv_blocks / total_kv_blocks``
   above its class watermark. Anything smaller waits in the queue for KV headroom instead of being
   shed because the cache is busy right now (the lesson shed 14 of 18 batch requests that way).
3. ``shed_queue_wait_slo`` — the wait *this tenant* can expect under the DRR that will serve it
   is above the class limit (:mod:`tokenfair_sidecar.core.shares`): its own queued work scaled by
   the weights competing in its lane, one turn of the others, the work in flight, at the rate its
   lane gets. A flooder's backlog lengthens the flooder's own predicted wait, not its
   neighbours'.
4. ``shed_tenant_token_quota`` — the tenant's budget cannot cover its queued work plus this
   request before the class wait limit: ``(queued_tenant_tokens + cost - bucket_level) /
   sustained_rate > max_wait``, or ``cost > burst`` (never coverable). Skipped when the policy
   lends idle capacity (``lend_idle_capacity``): such a request may still run on capacity nobody
   within budget wants.

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
weighted DRR over tenants (:mod:`tokenfair_sidecar.core.drr`), FIFO inside a tenant.

Settlement charges ``actual - estimate`` to the tenant's bucket *and* its DRR deficit, so the
round robin is fair in actual service tokens; a debt outlives the tenant's queue.

Queued requests past ``arrival + max_wait`` of their class are refused ``shed_queue_timeout``, so
every request that starts, starts within its class's wait limit; the refusal's ``Retry-After`` is
the tenant's own predicted wait beyond the limit.
"""

from __future__ import annotations

import math

from tokenfair_sidecar.config import Config
from tokenfair_sidecar.core.drr import DeficitRoundRobin
from tokenfair_sidecar.core.jobs import (
    QUEUE_FULL,
    SHED_QUEUE_WAIT_SLO,
    SHED_TENANT_TOKEN_QUOTA,
    Decision,
    Job,
    Lane,
)
from tokenfair_sidecar.core.scheduler import Scheduler, TenantState, shed_kv
from tokenfair_sidecar.core.shares import (
    DemandRate,
    LaneCompetition,
    ResidualWork,
    tokens_ahead,
)

SERVICE_MEMORY_LIMITS = 10.0
"""How far back a tenant's recent service reaches, in wait limits of its lane (time constant
of the averages that admission compares)."""

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

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        self._lanes = (DeficitRoundRobin(), DeficitRoundRobin())
        self._competition = (LaneCompetition(), LaneCompetition())
        self._interactive_demand = DemandRate()
        self._residual = ResidualWork()
        # Recent service per lane, per tenant and in all (time constant: SERVICE_MEMORY_LIMITS).
        self._served: tuple[dict[str, DemandRate], dict[str, DemandRate]] = ({}, {})
        self._lane_served = (DemandRate(), DemandRate())
        self._batch_credit = 0.0
        self._cheapest_batch_head: float | None = None  # as of the last selection that looked
        self._now_ms = now_ms  # the clock of the selection in progress (read by `_eligible`)
        self._lending = False  # the selection in progress ignores budgets (read by `_eligible`)
        self._push_ahead: float | None = None  # join rank of the job `_admit` just admitted
        super().__init__(config, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        quantum = self.tenant_quantum(tenant)
        tenant_id = tenant.config.tenant_id
        for lane, competition in zip(self._lanes, self._competition, strict=True):
            lane.add_tenant(tenant_id, quantum)
            competition.quantum_changed(tenant_id, quantum)

    # -- admission --------------------------------------------------------------------------

    def predicted_wait_ms(
        self, tenant_id: str, lane: Lane, cost_tokens: int, now_ms: float
    ) -> float:
        """What a new request of the tenant costing ``cost_tokens`` would wait in ``lane``
        (:mod:`.shares`): the work in flight, then ``ahead`` tokens of its lane — plus, for
        interactive work, the batch requests its minimum share lets in meanwhile — at the rate
        the lane gets."""
        drr = self._lanes[lane]
        queue = drr.queues[tenant_id]
        competition = self._competition[lane]
        competing = competition.competing_quanta
        if not competition.competes(tenant_id):
            competing += queue.quantum
        first_turn = None
        rank = self._join_rank(tenant_id, lane, now_ms)
        if rank is not None:
            first_turn = drr.tokens_before_joining_ahead(rank)
        ahead = tokens_ahead(
            queue.queued_tokens,
            cost_tokens * self.tenants[tenant_id].usage_ratio,
            queue,
            competing,
            drr.queued_tokens,
            drr.credit_tokens,
            drr.active[0] if drr.active else None,
            first_turn,
        )
        policy = self.policy
        rate = policy.service_tokens_per_ms
        if lane is Lane.INTERACTIVE:
            ahead += self._batch_intrusion(ahead)
        else:
            demand = self._interactive_demand.rate(now_ms, policy.max_batch_wait_ms)
            interactive_cap = rate * (1.0 - policy.batch_min_share)
            rate = max(rate - min(demand, interactive_cap), rate * MIN_LANE_RATE_FRACTION)
        return self._residual.wait_ms(now_ms) + ahead / rate

    def _join_rank(self, tenant_id: str, lane: Lane, now_ms: float) -> float | None:
        """A tenant that is not backlogged and has had less than its weighted share lately
        joins the ring ahead, the least served first (VTC's lift, in DRR terms:
        docs/fairness.md); its rank is its share ratio. None: it joins at the tail."""
        if self._lanes[lane].queues[tenant_id].in_active:
            return None
        ratio = self.share_ratio(tenant_id, lane, now_ms)
        return ratio if ratio is not None and ratio < 1.0 else None

    def _batch_intrusion(self, interactive_tokens: float) -> float:
        """Batch service tokens the minimum share lets run while ``interactive_tokens`` are
        served: none until the credit ``c + X * s / (1 - s)`` covers the cheapest batch head,
        else that credit plus one head (a due head may cost more than the credit)."""
        if not self.queued_count[Lane.BATCH]:
            return 0.0
        cheapest = self._cheapest_batch_head
        if cheapest is None:
            cheapest = self._cheapest_batch_head = self._lanes[Lane.BATCH].min_head_cost()
            if cheapest is None:
                return 0.0
        share = self.policy.batch_min_share
        credit = self._batch_credit + interactive_tokens * share / (1.0 - share)
        return 0.0 if credit < cheapest else credit + cheapest

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        policy = self.policy
        lane = job.lane
        tenant_id = job.request.tenant_id
        occupancy = (self.resident_blocks + job.kv_blocks) / policy.total_kv_blocks
        wait_limit_ms = self.wait_limit_ms(lane)
        drr = self._lanes[lane]
        competition = self._competition[lane]
        competition.retire(now_ms, wait_limit_ms, drr.backlogged)
        queued_all = self.queued_count[0] + self.queued_count[1]
        if (
            queued_all >= policy.max_queued_requests
            or tenant.queued >= policy.max_queued_requests_per_tenant
        ):
            return self._refusal(
                job,
                QUEUE_FULL,
                "admission",
                occupancy,
                self.predicted_wait_ms(tenant_id, lane, job.service_tokens, now_ms),
                queued_requests=queued_all,
                tenant_queued_requests=tenant.queued,
            )
        if job.kv_blocks / policy.total_kv_blocks > self.watermark(lane):
            return shed_kv(self, job, "admission", job.kv_blocks / policy.total_kv_blocks)
        # From its arrival: a replay submits the arrivals of a busy stretch when it ends.
        predicted_wait_ms = max(0.0, now_ms - job.request.arrival_ms) + self.predicted_wait_ms(
            tenant_id, lane, job.service_tokens, now_ms
        )
        if predicted_wait_ms > wait_limit_ms:
            return self._refusal(
                job,
                SHED_QUEUE_WAIT_SLO,
                "admission",
                occupancy,
                predicted_wait_ms - wait_limit_ms,
                predicted_wait_ms=predicted_wait_ms,
                max_wait_ms=wait_limit_ms,
            )
        if not policy.lend_idle_capacity:
            bucket = tenant.bucket
            budget_wait_ms = bucket.ms_until(
                (tenant.queued_tokens + job.service_tokens) * tenant.usage_ratio, now_ms
            )
            if budget_wait_ms > 0.0:
                # From its arrival; and with work of the tenant queued ahead, the server may
                # still be running the previous request when the budget allows this one.
                budget_wait_ms += max(0.0, now_ms - job.request.arrival_ms)
                if tenant.queued:
                    budget_wait_ms += job.service_tokens / policy.service_tokens_per_ms
            if job.service_tokens > bucket.burst or budget_wait_ms > wait_limit_ms:
                return self._refusal(
                    job,
                    SHED_TENANT_TOKEN_QUOTA,
                    "admission",
                    occupancy,
                    None if job.service_tokens > bucket.burst else budget_wait_ms - wait_limit_ms,
                    bucket_tokens=bucket.level,
                    tenant_queued_tokens=tenant.queued_tokens,
                    burst_tokens=bucket.burst,
                    budget_wait_ms=budget_wait_ms,
                )
        job.expected_tokens = job.service_tokens * tenant.usage_ratio
        self._push_ahead = self._join_rank(tenant_id, lane, now_ms)
        competition.admitted(tenant_id, drr.queues[tenant_id].quantum, now_ms)
        if lane is Lane.INTERACTIVE:
            self._interactive_demand.add(job.service_tokens, now_ms, policy.max_batch_wait_ms)
        return None

    def expire(self, now_ms: float) -> list[Decision]:
        """The base's expiry, with ``Retry-After`` from the tenant's own position: how much
        longer than the limit a new request of the tenant would wait now."""
        expired = super().expire(now_ms)
        for decision in expired:
            lane = Lane.of(decision.priority_class)
            beyond_ms = self.predicted_wait_ms(
                decision.tenant_id, lane, decision.service_tokens, now_ms
            ) - self.wait_limit_ms(lane)
            decision.retry_after_ms = max(0.0, beyond_ms)
        return expired

    # -- selection --------------------------------------------------------------------------

    def _push(self, job: Job) -> None:
        self._lanes[job.lane].push(job, join_ahead=self._push_ahead)

    def _forget(self, job: Job) -> None:
        lane = job.lane
        tenant_id = job.request.tenant_id
        drr = self._lanes[lane]
        drr.forget(job)
        if not drr.backlogged(tenant_id):
            self._competition[lane].drained(tenant_id)
        # Called before the totals drop the job: the batch lane empties if this is its last job.
        if self.queued_count[Lane.BATCH] == int(lane is Lane.BATCH):
            self._batch_credit = 0.0
            self._cheapest_batch_head = None

    def _eligible(self, job: Job) -> bool:
        if not self.kv_fits(job):
            return False
        if self._lending:
            return True
        tenant = self.tenants[job.request.tenant_id]
        return tenant.bucket.ms_until(job.service_tokens, self._now_ms) == 0.0

    def _select(self, now_ms: float) -> Job | None:
        self._now_ms = now_ms
        job = self._select_by_lane()
        if job is None and self.policy.lend_idle_capacity:
            # Nobody within budget can start: lend the idle capacity to work over budget.
            self._lending = True
            try:
                job = self._select_by_lane()
            finally:
                self._lending = False
            if job is not None:
                job.borrowed = True
        if job is not None:
            tenant_id = job.request.tenant_id
            if not self._lanes[job.lane].backlogged(tenant_id):
                self._competition[job.lane].drained(tenant_id)
        return job

    def _select_by_lane(self) -> Job | None:
        interactive, batch = self._lanes
        batch_waiting = self.queued_count[Lane.BATCH] > 0
        interactive_waiting = self.queued_count[Lane.INTERACTIVE] > 0
        if not batch_waiting:
            self._batch_credit = 0.0
            self._cheapest_batch_head = None
        batch_due = False
        if interactive_waiting and batch_waiting:
            cheapest = self._cheapest_batch_head = batch.min_head_cost()
            batch_due = cheapest is not None and self._batch_credit >= cheapest
        if interactive_waiting and not batch_due:
            job = interactive.pick(self._eligible)
            if job is not None:
                if batch_waiting:
                    share = self.policy.batch_min_share
                    self._batch_credit += job.expected_tokens * share / (1.0 - share)
                return job
        if batch_waiting:
            job = batch.pick(self._eligible)
            if job is not None:
                if interactive_waiting:
                    self._batch_credit -= job.expected_tokens
                return job
        if batch_due:
            return interactive.pick(self._eligible)
        return None

    # -- budgets and settlement -------------------------------------------------------------

    def _charge(self, job: Job, tenant: TenantState, now_ms: float) -> None:
        self._residual.dispatched(job.expected_tokens, self.policy.service_tokens_per_ms, now_ms)
        self._record_service(job, job.expected_tokens, now_ms)
        if job.borrowed:
            return
        tenant.bucket.refill(now_ms)
        tenant.bucket.level -= job.service_tokens

    def _record_service(self, job: Job, tokens: float, now_ms: float) -> None:
        lane = job.lane
        memory_ms = self.wait_limit_ms(lane) * SERVICE_MEMORY_LIMITS
        tenant_id = job.request.tenant_id
        served = self._served[lane].get(tenant_id)
        if served is None:
            served = self._served[lane][tenant_id] = DemandRate()
        served.add(tokens, now_ms, memory_ms)
        self._lane_served[lane].add(tokens, now_ms, memory_ms)

    def share_ratio(self, tenant_id: str, lane: Lane, now_ms: float) -> float | None:
        """The tenant's recent service per quantum over the lane's recent service per competing
        quantum (above 1: more than an equal weighted share lately); None while the lane has
        served nothing lately (nobody is owed anything then)."""
        memory_ms = self.wait_limit_ms(lane) * SERVICE_MEMORY_LIMITS
        lane_rate = self._lane_served[lane].rate(now_ms, memory_ms)
        competing = self._competition[lane].competing_quanta
        if lane_rate <= 0.0 or competing <= 0.0:
            return None
        served = self._served[lane].get(tenant_id)
        if served is None:
            return 0.0
        quantum = self._lanes[lane].queues[tenant_id].quantum
        return (served.rate(now_ms, memory_ms) / quantum) / (lane_rate / competing)

    def _settle(self, job: Job, tenant: TenantState, refund: int, now_ms: float) -> None:
        # The round robin and the work in flight were charged the expected usage; the budget
        # was charged the estimate. Each is settled against what it was charged.
        overrun = job.service_tokens - refund - job.expected_tokens
        self._record_service(job, overrun, now_ms)
        self._lanes[job.lane].settle(tenant.config.tenant_id, overrun)
        self._residual.settled(overrun, self.policy.service_tokens_per_ms)
        if not job.borrowed:  # a borrowed dispatch was never charged to the bucket
            tenant.bucket.refill(now_ms)
            tenant.bucket.settle(refund)

    def next_wakeup_ms(self, now_ms: float) -> float | None:
        wakeup = super().next_wakeup_ms(now_ms)
        for lane in self._lanes:
            for queue in lane.active:
                head = queue.head()
                if head is None:
                    continue
                bucket = self.tenants[queue.tenant_id].bucket
                wait_ms = bucket.ms_until(head.service_tokens, now_ms)
                if wait_ms > 0:
                    # At least one ulp later, so a caller that sleeps until then makes progress.
                    ready_ms = max(now_ms + wait_ms, math.nextafter(now_ms, math.inf))
                    if wakeup is None or ready_ms < wakeup:
                        wakeup = ready_ms
        return wakeup
