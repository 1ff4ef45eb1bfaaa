"""``tokenfair`` — the default policy: admit what can be served in time, then wait for headroom.

Admission (at arrival; the first gate that fails decides, with a ``Retry-After``):

1. ``queue_full`` — ``queued_all >= max_queued_requests`` or
   ``queued_tenant >= max_queued_requests_per_tenant``.
2. ``shed_kv_watermark`` — only a request that could *never* fit: ``kv_blocks / total_kv_blocks``
   above its class watermark. Anything smaller waits in the queue for KV headroom instead of being
   shed because the cache is busy right now (the lesson shed 14 of 18 batch requests that way).
3. ``shed_queue_wait_slo`` — predicted wait above the class limit, where the prediction is the
   service tokens queued ahead of it divided by the service rate (interactive work is ahead of
   batch): ``(queued_interactive [+ queued_batch]) / service_tokens_per_ms``.
4. ``shed_tenant_token_quota`` — the tenant's budget cannot cover its queued work plus this
   request before the class wait limit: ``(queued_tenant_tokens + cost - bucket_level) /
   sustained_rate > max_wait``, or ``cost > burst`` (never coverable).

Budgets *shape* rather than police: the estimate is charged at dispatch, and a head whose tenant
bucket is below its cost waits for the refill (``next_wakeup_ms`` says when).

Selection (at dispatch): a request may start only if its class watermark holds on resident KV
(``(resident + blocks) / total <= watermark``) and its tenant's bucket covers its cost. Lanes are
strict priority with a **minimum batch share** ``s``: while batch work is queued, every interactive
dispatch earns the batch lane ``cost * s / (1 - s)`` credit; when the credit covers the cheapest
batch head, batch runs next even though interactive work waits (credit resets when the batch lane
empties, so an idle lane banks nothing). Under sustained interactive overload batch therefore gets
``s`` of the service, and none of the interactive burst when its work is short. Inside a lane:
weighted DRR over tenants (:mod:`tokenfair_sidecar.core.drr`), FIFO inside a tenant.

Queued requests past ``arrival + max_wait`` of their class are refused ``shed_queue_timeout``, so
every request that starts, starts within its class's wait limit.
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


class TokenfairScheduler(Scheduler):
    """Admission that waits for headroom, shaped budgets, DRR lanes with a batch minimum share."""

    name = "tokenfair"
    expires_queued = True
    charges_at_dispatch = True

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        self._lanes = (DeficitRoundRobin(), DeficitRoundRobin())
        self._batch_credit = 0.0
        self._now_ms = now_ms  # the clock of the selection in progress (read by `_eligible`)
        super().__init__(config, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        quantum = self.tenant_quantum(tenant)
        for lane in self._lanes:
            lane.add_tenant(tenant.config.tenant_id, quantum)

    # -- admission --------------------------------------------------------------------------

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        policy = self.policy
        lane = job.lane
        rate = policy.service_tokens_per_ms
        occupancy = (self.resident_blocks + job.kv_blocks) / policy.total_kv_blocks
        queued_all = self.queued_count[0] + self.queued_count[1]
        if (
            queued_all >= policy.max_queued_requests
            or tenant.queued >= policy.max_queued_requests_per_tenant
        ):
            ahead = self.queued_tokens[Lane.INTERACTIVE]
            if lane is Lane.BATCH:
                ahead += self.queued_tokens[Lane.BATCH]
            return self._refusal(
                job,
                QUEUE_FULL,
                "admission",
                occupancy,
                ahead / rate,
                queued_requests=queued_all,
                tenant_queued_requests=tenant.queued,
            )
        if job.kv_blocks / policy.total_kv_blocks > self.watermark(lane):
            return shed_kv(self, job, "admission", job.kv_blocks / policy.total_kv_blocks)
        wait_limit_ms = self.wait_limit_ms(lane)
        ahead_tokens = self.queued_tokens[Lane.INTERACTIVE]
        if lane is Lane.BATCH:
            ahead_tokens += self.queued_tokens[Lane.BATCH]
        predicted_wait_ms = ahead_tokens / rate
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
        bucket = tenant.bucket
        budget_wait_ms = bucket.ms_until(tenant.queued_tokens + job.service_tokens, now_ms)
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
        return None

    # -- selection --------------------------------------------------------------------------

    def _push(self, job: Job) -> None:
        self._lanes[job.lane].push(job)

    def _forget(self, job: Job) -> None:
        self._lanes[job.lane].forget(job)
        # Called before the totals drop the job: the batch lane empties if this is its last job.
        if self.queued_count[Lane.BATCH] == int(job.lane is Lane.BATCH):
            self._batch_credit = 0.0

    def _eligible(self, job: Job) -> bool:
        if not self.kv_fits(job):
            return False
        tenant = self.tenants[job.request.tenant_id]
        return tenant.bucket.ms_until(job.service_tokens, self._now_ms) == 0.0

    def _select(self, now_ms: float) -> Job | None:
        self._now_ms = now_ms
        interactive, batch = self._lanes
        batch_waiting = self.queued_count[Lane.BATCH] > 0
        interactive_waiting = self.queued_count[Lane.INTERACTIVE] > 0
        if not batch_waiting:
            self._batch_credit = 0.0
        batch_due = False
        if interactive_waiting and batch_waiting:
            cheapest = batch.min_head_cost()
            batch_due = cheapest is not None and self._batch_credit >= cheapest
        if interactive_waiting and not batch_due:
            job = interactive.pick(self._eligible)
            if job is not None:
                if batch_waiting:
                    share = self.policy.batch_min_share
                    self._batch_credit += job.service_tokens * share / (1.0 - share)
                return job
        if batch_waiting:
            job = batch.pick(self._eligible)
            if job is not None:
                if interactive_waiting:
                    self._batch_credit -= job.service_tokens
                return job
        if batch_due:
            return interactive.pick(self._eligible)
        return None

    # -- budgets ----------------------------------------------------------------------------

    def _charge(self, job: Job, tenant: TenantState, now_ms: float) -> None:
        tenant.bucket.refill(now_ms)
        tenant.bucket.level -= job.service_tokens

    def _settle(self, job: Job, tenant: TenantState, refund: int, now_ms: float) -> None:
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
