"""The reference lesson's two policies, rebuilt on the core with running totals.

They make the same per-request decisions as the lesson's lab (status, reason, TTFT, queue wait)
on any trace, so the published figures can be reproduced and compared against. The lesson's
quirks are kept on purpose and marked below; :mod:`tokenfair_sidecar.core.tokenfair` is the
policy that improves on them. Differences from the lab, all in bookkeeping, never in decisions:

* sums over queues and over resident requests are running totals (the lab's admission cost grew
  with the backlog: quadratic over a trace);
* a refusal records the occupancy it *attempted*; the lab clamped it to the watermark.

``request_count_no_admission``
    Rounds over tenants in configuration order, one request per backlogged tenant per round, no
    priority lanes, no admission. Arrivals join the queues only between rounds.

``service_token_drr_with_admission``
    At arrival (occupancy counts resident KV, queued interactive KV and, for batch, queued batch
    KV): ``shed_kv_watermark`` if it would pass the class watermark; ``shed_queue_wait_slo`` if the
    lane's queued service tokens / rate pass the class wait limit; for batch only,
    ``shed_tenant_token_quota`` if the bucket is below the cost. Admission debits the bucket
    (floored at 0). Selection: strict priority (a batch round ends as soon as interactive work
    waits), weighted DRR rounds over tenants in configuration order with one deficit per tenant
    shared by both lanes; a round in which no head fits its deficit grants every backlogged tenant
    ``max(base, ceil(min_i (cost_i - D_i) / w_i)) * w_i``. At dispatch a request that would pass
    the watermark on resident KV alone is shed. Buckets of all tenants refill together at every
    arrival (to its arrival time) and every dispatch (to the clock).
"""

from __future__ import annotations

import math
from collections import deque

from tokenfair_sidecar.config import Config
from tokenfair_sidecar.core.jobs import (
    SHED_QUEUE_WAIT_SLO,
    SHED_TENANT_TOKEN_QUOTA,
    Decision,
    Job,
    Lane,
)
from tokenfair_sidecar.core.scheduler import Scheduler, TenantState, shed_kv


class RequestCountScheduler(Scheduler):
    """The lesson's naive baseline: one request per tenant per round, no admission."""

    name = "request_count_no_admission"

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        self._queues: dict[str, deque[Job]] = {}
        self._arrivals: list[Job] = []  # arrivals during a round join after it (lab semantics)
        self._round_at = -1  # position in tenant order while a round runs
        super().__init__(config, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        self._queues.setdefault(tenant.config.tenant_id, deque())

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        return None

    def _push(self, job: Job) -> None:
        if self._round_at >= 0:
            self._arrivals.append(job)
        else:
            self._queues[job.request.tenant_id].append(job)

    def _select(self, now_ms: float) -> Job | None:
        order = self.tenant_order
        while True:
            if self._round_at < 0:
                if not self.queued_count[0] + self.queued_count[1]:
                    return None
                self._round_at = 0
            while self._round_at < len(order):
                queue = self._queues[order[self._round_at].config.tenant_id]
                self._round_at += 1
                if queue:
                    return queue.popleft()
            self._round_at = -1
            for job in self._arrivals:
                self._queues[job.request.tenant_id].append(job)
            self._arrivals.clear()


class LessonDrrScheduler(Scheduler):
    """The lesson's protected policy: priority lanes, service-token DRR, KV/SLO/budget shedding."""

    name = "service_token_drr_with_admission"
    gates_at_dispatch = True

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        self._queues: dict[str, tuple[deque[Job], deque[Job]]] = {}
        self._deficit: dict[str, float] = {}
        # The round in progress: its lane, the position in tenant order, whether the tenant
        # there has had its quantum for this visit, and whether the round dispatched anything.
        self._round_lane: Lane | None = None
        self._round_at = 0
        self._in_visit = False
        self._round_dispatched = False
        super().__init__(config, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        self._queues.setdefault(tenant.config.tenant_id, (deque(), deque()))
        self._deficit.setdefault(tenant.config.tenant_id, 0.0)

    def _refill_all(self, now_ms: float) -> None:
        # Lab semantics: every bucket refills at every event, in one step per event.
        for tenant in self.tenant_order:
            tenant.bucket.refill(now_ms)

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        self._refill_all(job.request.arrival_ms)
        lane = job.lane
        reserved = self.resident_blocks + self.queued_blocks[Lane.INTERACTIVE]
        if lane is Lane.BATCH:
            reserved += self.queued_blocks[Lane.BATCH]
        occupancy = (reserved + job.kv_blocks) / self.policy.total_kv_blocks
        if occupancy > self.watermark(lane):
            return shed_kv(self, job, "admission", occupancy)
        predicted_wait_ms = self.queued_tokens[lane] / self.policy.service_tokens_per_ms
        if predicted_wait_ms > self.wait_limit_ms(lane):
            return self._refusal(
                job,
                SHED_QUEUE_WAIT_SLO,
                "admission",
                occupancy,
                predicted_wait_ms - self.wait_limit_ms(lane),
                predicted_wait_ms=predicted_wait_ms,
                max_wait_ms=self.wait_limit_ms(lane),
            )
        bucket = tenant.bucket
        # Lab quirk: only batch requests are held to their budget; everyone is debited.
        if lane is Lane.BATCH and bucket.level < job.service_tokens:
            return self._refusal(
                job,
                SHED_TENANT_TOKEN_QUOTA,
                "admission",
                occupancy,
                bucket.ms_until(job.service_tokens, job.request.arrival_ms),
                bucket_tokens=bucket.level,
            )
        bucket.level = max(0.0, bucket.level - job.service_tokens)
        return None

    def _push(self, job: Job) -> None:
        self._queues[job.request.tenant_id][job.lane].append(job)

    def _select(self, now_ms: float) -> Job | None:
        order = self.tenant_order
        while True:
            lane = self._round_lane
            if lane is None:
                lane = Lane.INTERACTIVE if self.queued_count[Lane.INTERACTIVE] else Lane.BATCH
                if not self.queued_count[lane]:
                    return None
                self._round_lane = lane
                self._round_at = 0
                self._in_visit = False
                self._round_dispatched = False
            elif lane is Lane.BATCH and self.queued_count[Lane.INTERACTIVE]:
                # Interactive work arrived after a batch dispatch: the batch round ends.
                self._round_lane = None
                continue
            if self._round_at == len(order):
                if not self._round_dispatched:
                    self._grant_boost(lane)
                self._round_lane = None
                continue
            tenant_id = order[self._round_at].config.tenant_id
            queue = self._queues[tenant_id][lane]
            if not self._in_visit:
                if not queue:
                    self._deficit[tenant_id] = 0.0
                    self._round_at += 1
                    continue
                self._deficit[tenant_id] += self.tenant_quantum(order[self._round_at])
                self._in_visit = True
            if queue and self._deficit[tenant_id] >= queue[0].service_tokens:
                job = queue.popleft()
                self._deficit[tenant_id] -= job.service_tokens
                self._round_dispatched = True
                return job
            self._in_visit = False
            self._round_at += 1

    def _grant_boost(self, lane: Lane) -> None:
        base = float(self.policy.base_quantum_tokens)
        backlogged = [t for t in self.tenant_order if self._queues[t.config.tenant_id][lane]]
        needed = min(
            (
                (
                    self._queues[t.config.tenant_id][lane][0].service_tokens
                    - self._deficit[t.config.tenant_id]
                )
                / t.config.weight
                for t in backlogged
            ),
            default=base,
        )
        boost = max(base, math.ceil(needed))
        for tenant in backlogged:
            self._deficit[tenant.config.tenant_id] += boost * tenant.config.weight

    def _dispatch_gate(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        self._refill_all(now_ms)
        occupancy = (self.resident_blocks + job.kv_blocks) / self.policy.total_kv_blocks
        if occupancy > self.watermark(job.lane):
            return shed_kv(self, job, "dispatch", occupancy)
        return None
