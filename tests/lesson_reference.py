"""Oracle: the reference lesson's two scheduling policies, restated naively and independently.

What it is for: the parity tests (``tests/sidecar/core/test_lesson_parity.py``) run it next to the
scheduling core (``tokenfair.core.baselines`` driven by ``tokenfair.sim.simulator``) and require the
same per-request decisions on any trace; ``bench/bench_core.py`` uses it as the baseline whose cost
grows with the backlog. It imports nothing from the sidecar, so a bug in the core's cost model,
clock or queues cannot hide in both.

It restates the lesson lab (the lesson folder ``shared/seed/``, whose code lost its
indentation) from its semantics, quirks included, and keeps the lab's O(n) sums over queues
and resident requests:

* cost model: ``service = prefill + decode_weight * decode``; ``prefill_ms = max(8, prefill/48)``;
  ``execution_ms = service / rate``; ``kv_blocks = ceil((prefill + decode) / 16)``, resident from
  dispatch for ``5.5 * execution_ms``; one serial, non-preemptive server;
* ``request_count_no_admission``: rounds over tenants in quota order, one request per backlogged
  tenant per round, no lanes, no admission; arrivals join only between rounds;
* ``service_token_drr_with_admission``: every arrival is judged when the clock reaches it, at
  ``max(clock, arrival)``, after refilling *all* buckets to its arrival time. KV occupancy counts
  resident blocks, queued interactive blocks and (for batch) queued batch blocks; then the lane's
  queued service over the rate against the class wait limit; then (batch only) the bucket against
  the cost. Admission debits the bucket (floored at 0). Rounds: strict priority (a batch round
  breaks off after a dispatch once interactive work waits); one deficit per tenant shared by both
  lanes, reset when the tenant's queue in the round's lane is empty; arrivals join at once after
  each dispatch; a round that dispatched nothing grants every backlogged tenant
  ``max(base, ceil(min_i (cost_i - D_i) / w_i)) * w_i``. At dispatch, all buckets refill to the
  clock and a request that would pass its watermark on resident KV alone is shed.

Outcomes use the lab's rounding (2 decimals for ms, 4 for ratios). Like the lab, a KV refusal at
admission records its occupancy *clamped to the watermark*; the core records the attempted,
unclamped value (see docs/lesson.md): there the core's value is >= the oracle's; every other
recorded occupancy is the same in both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Klass = Literal["interactive", "batch"]

KV_BLOCK_TOKENS = 16
PREFILL_FLOOR_MS = 8.0
PREFILL_TOKENS_PER_MS = 48.0
KV_HOLD_FACTOR = 5.5


@dataclass(frozen=True)
class OracleTenant:
    """A tenant quota; its list order is the round-robin visiting order."""

    tenant_id: str
    weight: float
    burst_service_tokens: int
    sustained_service_tokens_per_second: float


@dataclass(frozen=True)
class OracleRequest:
    """One request of a trace: arrival in ms, sizes in tokens."""

    request_id: str
    tenant_id: str
    arrival_ms: int
    prefill_tokens: int
    decode_tokens: int
    priority_class: Klass


@dataclass(frozen=True)
class OracleKnobs:
    """The lab's policy parameters, with its defaults."""

    total_kv_blocks: int = 1600
    interactive_kv_watermark: float = 0.90
    batch_kv_watermark: float = 0.65
    max_interactive_wait_ms: float = 420.0
    max_batch_wait_ms: float = 3500.0
    decode_weight: int = 4
    base_quantum_tokens: int = 1200
    service_tokens_per_ms: float = 45.0


@dataclass(frozen=True)
class OracleOutcome:
    """The one decision the lab records for a request."""

    request_id: str
    tenant_id: str
    priority_class: Klass
    status_code: int
    reason: str
    service_tokens: int
    ttft_ms: float
    queue_wait_ms: float
    kv_occupancy_ratio: float


def service_tokens(request: OracleRequest, decode_weight: int = 4) -> int:
    """``prefill + decode_weight * decode`` (the lab's integer cost unit)."""
    return request.prefill_tokens + decode_weight * request.decode_tokens


def kv_blocks(request: OracleRequest) -> int:
    """KV blocks the whole sequence needs: ``ceil((prefill + decode) / 16)``."""
    return math.ceil((request.prefill_tokens + request.decode_tokens) / KV_BLOCK_TOKENS)


def _in_lab_order(requests: Sequence[OracleRequest]) -> list[OracleRequest]:
    return sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))


def _outcome(
    req: OracleRequest,
    knobs: OracleKnobs,
    status: int,
    reason: str,
    ttft_ms: float,
    wait_ms: float,
    occupancy: float,
) -> OracleOutcome:
    return OracleOutcome(
        request_id=req.request_id,
        tenant_id=req.tenant_id,
        priority_class=req.priority_class,
        status_code=status,
        reason=reason,
        service_tokens=service_tokens(req, knobs.decode_weight),
        ttft_ms=round(ttft_ms, 2),
        queue_wait_ms=round(wait_ms, 2),
        kv_occupancy_ratio=round(occupancy, 4),
    )


class _Server:
    """The serial server: a clock and the list of (release time, blocks) of started requests."""

    def __init__(self, knobs: OracleKnobs) -> None:
        self.knobs = knobs
        self.clock_ms = 0.0
        self.resident: list[tuple[float, int]] = []

    def resident_blocks(self, at_ms: float) -> int:
        # O(started requests): the lab's sum, on purpose (it is the benchmark's baseline).
        return sum(blocks for release_ms, blocks in self.resident if release_ms > at_ms)

    def forget_released(self) -> None:
        self.resident = [(t, b) for t, b in self.resident if t > self.clock_ms]

    def run(self, req: OracleRequest, occupancy: float) -> OracleOutcome:
        """Start ``req`` now; the clock jumps to its end (non-preemptive)."""
        knobs = self.knobs
        wait_ms = max(0.0, self.clock_ms - req.arrival_ms)
        prefill_ms = max(PREFILL_FLOOR_MS, req.prefill_tokens / PREFILL_TOKENS_PER_MS)
        execution_ms = service_tokens(req, knobs.decode_weight) / knobs.service_tokens_per_ms
        self.resident.append((self.clock_ms + execution_ms * KV_HOLD_FACTOR, kv_blocks(req)))
        self.clock_ms += execution_ms
        return _outcome(req, knobs, 200, "admitted", wait_ms + prefill_ms, wait_ms, occupancy)


def run_request_count(
    tenants: Sequence[OracleTenant],
    requests: Sequence[OracleRequest],
    knobs: OracleKnobs = OracleKnobs(),
) -> list[OracleOutcome]:
    """The lab's ``request_count_fifo`` without admission control; outcomes in decision order."""
    pending = _in_lab_order(requests)
    queues: dict[str, deque[OracleRequest]] = {t.tenant_id: deque() for t in tenants}
    server = _Server(knobs)
    outcomes: list[OracleOutcome] = []
    nxt = 0

    def anything_queued() -> bool:
        return any(queues.values())

    while nxt < len(pending) or anything_queued():
        if not anything_queued():
            server.clock_ms = max(server.clock_ms, float(pending[nxt].arrival_ms))
        # Arrivals join here only, between rounds, never in the middle of one.
        while nxt < len(pending) and pending[nxt].arrival_ms <= server.clock_ms:
            queues[pending[nxt].tenant_id].append(pending[nxt])
            nxt += 1
        for tenant in tenants:
            queue = queues[tenant.tenant_id]
            if not queue:
                continue
            req = queue.popleft()
            server.forget_released()
            occupancy = (server.resident_blocks(server.clock_ms) + kv_blocks(req)) / (
                knobs.total_kv_blocks
            )
            outcomes.append(server.run(req, occupancy))
    return outcomes


class _DrrRun:
    """One run of the lab's service-token DRR with admission (state of a single trace)."""

    def __init__(
        self,
        tenants: Sequence[OracleTenant],
        requests: Sequence[OracleRequest],
        knobs: OracleKnobs,
    ) -> None:
        self.tenants = list(tenants)
        self.weight = {t.tenant_id: t.weight for t in tenants}
        self.knobs = knobs
        self.pending = _in_lab_order(requests)
        self.nxt = 0
        self.lanes: dict[Klass, dict[str, deque[OracleRequest]]] = {
            "interactive": {t.tenant_id: deque() for t in tenants},
            "batch": {t.tenant_id: deque() for t in tenants},
        }
        self.deficit = {t.tenant_id: 0.0 for t in tenants}
        self.bucket = {t.tenant_id: float(t.burst_service_tokens) for t in tenants}
        self.refilled_ms = 0.0
        self.server = _Server(knobs)
        self.outcomes: list[OracleOutcome] = []

    # -- bookkeeping, naive on purpose -------------------------------------------------------

    def has_work(self, lane: Klass) -> bool:
        return any(self.lanes[lane].values())

    def queued_blocks(self, lane: Klass) -> int:
        return sum(kv_blocks(r) for q in self.lanes[lane].values() for r in q)

    def queued_service(self, lane: Klass) -> int:
        weight = self.knobs.decode_weight
        return sum(service_tokens(r, weight) for q in self.lanes[lane].values() for r in q)

    def refill_all(self, to_ms: float) -> None:
        """Every bucket, in one step, from the last refill (one shared timestamp) to ``to_ms``."""
        elapsed_s = max(0.0, (to_ms - self.refilled_ms) / 1000.0)
        if elapsed_s <= 0.0:
            return
        for tenant in self.tenants:
            topped = self.bucket[tenant.tenant_id] + (
                elapsed_s * tenant.sustained_service_tokens_per_second
            )
            self.bucket[tenant.tenant_id] = min(float(tenant.burst_service_tokens), topped)
        self.refilled_ms = to_ms

    def watermark(self, lane: Klass) -> float:
        knobs = self.knobs
        return knobs.interactive_kv_watermark if lane == "interactive" else knobs.batch_kv_watermark

    # -- admission ----------------------------------------------------------------------------

    def judge(self, req: OracleRequest) -> tuple[str, float]:
        """The admission verdict (reason) and the occupancy the lab records with it."""
        knobs = self.knobs
        lane = req.priority_class
        at_ms = max(self.server.clock_ms, float(req.arrival_ms))
        reserved = self.server.resident_blocks(at_ms) + self.queued_blocks("interactive")
        if lane == "batch":
            reserved += self.queued_blocks("batch")
        occupancy = (reserved + kv_blocks(req)) / knobs.total_kv_blocks
        mark = self.watermark(lane)
        if occupancy > mark:
            return "shed_kv_watermark", min(occupancy, mark)  # the lab's clamp
        limit_ms = (
            knobs.max_interactive_wait_ms if lane == "interactive" else knobs.max_batch_wait_ms
        )
        if self.queued_service(lane) / knobs.service_tokens_per_ms > limit_ms:
            return "shed_queue_wait_slo", min(occupancy, mark)
        cost = service_tokens(req, knobs.decode_weight)
        if lane == "batch" and self.bucket[req.tenant_id] < cost:
            return "shed_tenant_token_quota", min(occupancy, mark)
        return "admitted", occupancy

    def take_arrivals(self) -> None:
        """Judge every arrival the clock has reached, in ``(arrival, id)`` order."""
        while (
            self.nxt < len(self.pending)
            and self.pending[self.nxt].arrival_ms <= self.server.clock_ms
        ):
            req = self.pending[self.nxt]
            self.nxt += 1
            self.refill_all(float(req.arrival_ms))
            reason, occupancy = self.judge(req)
            if reason != "admitted":
                self.outcomes.append(_outcome(req, self.knobs, 429, reason, 0.0, 0.0, occupancy))
                continue
            cost = service_tokens(req, self.knobs.decode_weight)
            # Interactive requests are debited too, though never refused for their budget.
            self.bucket[req.tenant_id] = max(0.0, self.bucket[req.tenant_id] - cost)
            self.lanes[req.priority_class][req.tenant_id].append(req)

    # -- scheduling ---------------------------------------------------------------------------

    def start(self, req: OracleRequest) -> bool:
        """Dispatch gate, then run (True) or shed (False); a shed request still paid its cost
        out of the deficit."""
        server = self.server
        self.refill_all(server.clock_ms)
        server.forget_released()
        occupancy = (server.resident_blocks(server.clock_ms) + kv_blocks(req)) / (
            self.knobs.total_kv_blocks
        )
        if occupancy > self.watermark(req.priority_class):
            wait_ms = max(0.0, server.clock_ms - req.arrival_ms)
            # Unclamped here in the lab (only admission refusals were clamped).
            self.outcomes.append(
                _outcome(req, self.knobs, 429, "shed_kv_watermark", 0.0, wait_ms, occupancy)
            )
            return False
        self.outcomes.append(server.run(req, occupancy))
        self.take_arrivals()
        return True

    def one_round(self) -> None:
        lane: Klass = "interactive" if self.has_work("interactive") else "batch"
        if not self.has_work(lane):
            return
        queues = self.lanes[lane]
        quantum_base = self.knobs.base_quantum_tokens
        decode_weight = self.knobs.decode_weight
        dispatched = False
        for tenant in self.tenants:
            tid = tenant.tenant_id
            queue = queues[tid]
            if not queue:
                self.deficit[tid] = 0.0
                continue
            self.deficit[tid] += quantum_base * tenant.weight
            preempted = False
            while queue:
                head = queue[0]
                cost = service_tokens(head, decode_weight)
                if self.deficit[tid] < cost:
                    break
                queue.popleft()
                self.deficit[tid] -= cost
                dispatched = True  # a shed at dispatch counts: the round made progress
                ran = self.start(head)
                # Strict priority: only a run moves the clock and lets interactive work in.
                if ran and lane == "batch" and self.has_work("interactive"):
                    preempted = True
                    break
            if preempted:
                return
        if not dispatched:
            self.grant_boost(lane)

    def grant_boost(self, lane: Klass) -> None:
        """Nothing fitted: lift every backlogged tenant enough for the closest head."""
        base = float(self.knobs.base_quantum_tokens)
        queues = self.lanes[lane]
        gaps = [
            (service_tokens(q[0], self.knobs.decode_weight) - self.deficit[tid]) / self.weight[tid]
            for tid, q in queues.items()
            if q
        ]
        boost = max(base, math.ceil(min(gaps, default=base)))
        for tid, q in queues.items():
            if q:
                self.deficit[tid] += boost * self.weight[tid]

    def run(self) -> list[OracleOutcome]:
        while (
            self.nxt < len(self.pending) or self.has_work("interactive") or self.has_work("batch")
        ):
            if not self.has_work("interactive") and not self.has_work("batch"):
                nxt_ms = float(self.pending[self.nxt].arrival_ms)
                self.server.clock_ms = max(self.server.clock_ms, nxt_ms)
            self.take_arrivals()
            self.one_round()
        return self.outcomes


def run_service_token_drr(
    tenants: Sequence[OracleTenant],
    requests: Sequence[OracleRequest],
    knobs: OracleKnobs = OracleKnobs(),
) -> list[OracleOutcome]:
    """The lab's ``service_token_drr`` with admission control; outcomes in decision order."""
    return _DrrRun(tenants, requests, knobs).run()


def lab_percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the sorted value at ``ceil(p/100 * n) - 1``, rounded to 0.01."""
    if not values:
        return 0.0
    ranked = sorted(values)
    index = min(len(ranked) - 1, max(0, math.ceil(p / 100.0 * len(ranked)) - 1))
    return round(ranked[index], 2)


def lab_summary(outcomes: Sequence[OracleOutcome]) -> dict[str, object]:
    """The lab's per-policy summary; its peak occupancy spans *all* outcomes, refusals too."""
    admitted = [o for o in outcomes if o.status_code == 200]
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.status_code == 429:
            reasons[o.reason] = reasons.get(o.reason, 0) + 1
    tenants: dict[str, dict[str, object]] = {}
    for tid in sorted({o.tenant_id for o in outcomes}):
        mine = [o for o in outcomes if o.tenant_id == tid]
        ok = [o for o in mine if o.status_code == 200]
        tenants[tid] = {
            "submitted": len(mine),
            "admitted": len(ok),
            "shed_429": len(mine) - len(ok),
            "admitted_service_tokens": sum(o.service_tokens for o in ok),
            "p50_ttft_ms": lab_percentile([o.ttft_ms for o in ok], 50),
            "p99_ttft_ms": lab_percentile([o.ttft_ms for o in ok], 99),
        }
    interactive = [o.ttft_ms for o in admitted if o.priority_class == "interactive"]
    batch = [o.ttft_ms for o in admitted if o.priority_class == "batch"]
    return {
        "total_requests": len(outcomes),
        "admitted_requests": len(admitted),
        "shed_429_requests": len(outcomes) - len(admitted),
        "interactive_p50_ttft_ms": lab_percentile(interactive, 50),
        "interactive_p99_ttft_ms": lab_percentile(interactive, 99),
        "batch_p99_ttft_ms": lab_percentile(batch, 99),
        "peak_kv_occupancy_ratio": round(
            max((o.kv_occupancy_ratio for o in outcomes), default=0.0), 4
        ),
        "shed_reasons": reasons,
        "tenants": tenants,
    }
