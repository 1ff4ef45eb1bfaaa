"""The baselines: the reference lesson's two policies, rebuilt on the core with running totals.

They make the same per-request decisions as the lesson's lab (status, reason, TTFT, queue wait)
on any trace, so the published figures can be reproduced and compared against. The lesson's
quirks are kept on purpose and marked below; :mod:`tokenfair.core.tokenfair` is the
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

from tokenfair.config import Config
from tokenfair.core.bucket import refill_all
from tokenfair.core.jobs import (
    LANE_BATCH,
    LANE_INTERACTIVE,
    SHED_QUEUE_WAIT_SLO,
    SHED_TENANT_TOKEN_QUOTA,
    Decision,
    Job,
)
from tokenfair.core.scheduler import Scheduler, TenantState, shed_kv


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
            self._queues[job.tenant_id].append(job)

    def _select(self, now_ms: float) -> Job | None:
        order = self.tenant_order
        while True:
            if self._round_at < 0:
                if not self.queued_count[0] + self.queued_count[1]:
                    return None
                self._round_at = 0
            while self._round_at < len(order):
                queue = self._queues[order[self._round_at].tenant_id]
                self._round_at += 1
                if queue:
                    return queue.popleft()
            self._round_at = -1
            for job in self._arrivals:
                self._queues[job.tenant_id].append(job)
            self._arrivals.clear()


class LessonDrrScheduler(Scheduler):
    """The lesson's protected policy: priority lanes, service-token DRR, KV/SLO/budget shedding."""

    name = "service_token_drr_with_admission"
    gates_at_dispatch = True

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        # (`tuple[X, ...]`: compiled, a fixed-size tuple taken from a dict is unboxed, then
        # built again at each index by a variable.)
        self._queues: dict[str, tuple[deque[Job], ...]] = {}
        self._deficit: dict[str, float] = {}
        # The round in progress: its lane, the position in tenant order, whether the tenant
        # there has had its quantum for this visit, and whether the round dispatched anything.
        self._round_lane: int | None = None
        self._round_at = 0
        self._in_visit = False
        self._round_dispatched = False
        super().__init__(config, now_ms)

    def _tenant_added(self, tenant: TenantState) -> None:
        self._queues.setdefault(tenant.config.tenant_id, (deque(), deque()))
        self._deficit.setdefault(tenant.config.tenant_id, 0.0)

    def _refill_all(self, now_ms: float) -> None:
        # Lab semantics: every bucket refills at every event, in one step per event.
        # (`_admit` and `_dispatch_gate` call `refill_all` directly.)
        refill_all(self.tenant_order, now_ms)

    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        arrival_ms = job.arrival_ms
        refill_all(self.tenant_order, arrival_ms)  # `self._refill_all`, one call fewer
        lane = job.lane
        queued_blocks = self.queued_blocks
        reserved = self.resident_blocks + queued_blocks[0]
        if lane:  # batch
            reserved += queued_blocks[1]
        occupancy = (reserved + job.kv_blocks) / self._total_kv_blocks
        if occupancy > self._watermarks[lane]:
            return shed_kv(self, job, "admission", occupancy)
        predicted_wait_ms = self.queued_tokens[lane] / self._service_rate
        wait_limit_ms = self._wait_limits[lane]
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
        service_tokens = job.service_tokens
        # Lab quirk: only batch requests are held to their budget; everyone is debited.
        if lane and bucket.level < service_tokens:
            return self._refusal(
                job,
                SHED_TENANT_TOKEN_QUOTA,
                "admission",
                occupancy,
                bucket.ms_until(service_tokens, arrival_ms),
                bucket_tokens=bucket.level,
            )
        # max(0.0, level - cost) as a conditional: the same comparison
        level = bucket.level - service_tokens
        bucket.level = level if level > 0.0 else 0.0
        return None

    def _push(self, job: Job) -> None:
        self._queues[job.tenant_id][job.lane].append(job)

    def _select(self, now_ms: float) -> Job | None:
        # The round's state lives in locals while the loop runs (it runs at every dispatch)
        # and is stored back when it returns: the same steps as one attribute at a time.
        order = self.tenant_order
        tenants = len(order)
        queued_count = self.queued_count
        queues = self._queues
        deficits = self._deficit
        lane = self._round_lane
        at = self._round_at
        in_visit = self._in_visit
        while True:
            if lane is None:
                lane = LANE_INTERACTIVE if queued_count[0] else LANE_BATCH
                if not queued_count[lane]:
                    self._round_lane = None
                    self._round_at = at
                    self._in_visit = in_visit
                    return None
                at = 0
                in_visit = False
                self._round_dispatched = False
            elif lane == LANE_BATCH and queued_count[0]:
                # Interactive work arrived after a batch dispatch: the batch round ends.
                lane = None
                continue
            if at >= tenants:  # `>=`: a reload may have removed tenants mid-round
                if not self._round_dispatched:
                    self._grant_boost(lane)
                lane = None
                continue
            tenant = order[at]
            tenant_id = tenant.tenant_id
            queue = queues[tenant_id][lane]
            if not in_visit:
                if not queue:
                    deficits[tenant_id] = 0.0
                    at += 1
                    continue
                deficits[tenant_id] += self.tenant_quantum(tenant)
                in_visit = True
            if queue:
                job = queue[0]
                deficit = deficits[tenant_id]
                if deficit >= job.service_tokens:
                    queue.popleft()
                    deficits[tenant_id] = deficit - job.service_tokens
                    self._round_dispatched = True
                    self._round_lane = lane
                    self._round_at = at
                    self._in_visit = in_visit
                    return job
            in_visit = False
            at += 1

    def _grant_boost(self, lane: int) -> None:
        base = float(self._base_quantum_tokens)
        backlogged = [t for t in self.tenant_order if self._queues[t.tenant_id][lane]]
        needed = min(
            (
                (self._queues[t.tenant_id][lane][0].service_tokens - self._deficit[t.tenant_id])
                / t.weight
                for t in backlogged
            ),
            default=base,
        )
        boost = max(base, math.ceil(needed))
        for tenant in backlogged:
            self._deficit[tenant.tenant_id] += boost * tenant.weight

    def _dispatch_gate(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        refill_all(self.tenant_order, now_ms)  # `self._refill_all`, one call fewer
        occupancy = (self.resident_blocks + job.kv_blocks) / self._total_kv_blocks
        if occupancy > self._watermarks[job.lane]:
            return shed_kv(self, job, "dispatch", occupancy)
        return None
