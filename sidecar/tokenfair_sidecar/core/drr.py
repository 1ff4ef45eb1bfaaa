"""Weighted deficit round robin (Shreedhar & Varghese) over tenants of one lane, in service tokens.

Each backlogged tenant ``i`` holds a deficit counter ``D_i``. When its turn starts it earns its
quantum ``Q_i = base_quantum_tokens * weight_i``; it then sends head-of-queue requests while
``D_i >= cost(head)``, paying ``cost(head)`` each (a request's *full* cost, never a slice). The turn
passes when the head costs more than ``D_i``; ``D_i`` carries over while the tenant stays
backlogged and resets to 0 when its queue empties, so idle tenants bank nothing.

Fairness bound (the DRR lemma): for two tenants continuously backlogged in one lane over an
interval, the normalised service gap stays bounded,
``|S_i/w_i - S_j/w_j| <= 3 * base_quantum_tokens + max_cost/w_i + max_cost/w_j``
(each side is within ``Q_i + max_cost`` of ``k`` quanta after ``k`` turns; see docs/fairness.md).

Two departures from the textbook, both bounded:

* **eligibility** — a head that cannot run *now* (KV watermark, token budget) is passed over
  without earning a quantum; the tenant keeps its deficit, and a turn it had open stays open (it
  resumes that turn, with no new quantum, when next visited), so ``0 <= D_i < max_cost + Q_i``
  holds whatever the eligibility;
* **skipping empty rounds** — when a full pass finds no eligible head covered by its deficit,
  every eligible tenant is granted the quanta of the rounds it would have waited through,
  ``k = min_i ceil((cost_i - D_i) / Q_i) - 1`` in one step, so selection costs O(tenants) and
  never loops on large requests.

Costs of selection: O(active tenants) per pick; enqueue and cancel O(1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from tokenfair_sidecar.core.jobs import Job, JobState


class TenantQueue:
    """One tenant's FIFO within one lane, with its DRR state."""

    __slots__ = ("deficit", "in_active", "jobs", "live", "quantum", "tenant_id", "turn_open")

    def __init__(self, tenant_id: str, quantum: float) -> None:
        self.tenant_id = tenant_id
        self.quantum = quantum
        self.jobs: deque[Job] = deque()
        self.live = 0  # queued jobs not cancelled (cancelled ones are dropped lazily at the head)
        self.deficit = 0.0
        self.turn_open = False
        self.in_active = False

    def head(self) -> Job | None:
        jobs = self.jobs
        while jobs and jobs[0].state is not JobState.QUEUED:
            jobs.popleft()
        return jobs[0] if jobs else None

    def reset(self) -> None:
        self.deficit = 0.0
        self.turn_open = False


class DeficitRoundRobin:
    """Selects the next job of one lane; see the module docstring for the rules."""

    __slots__ = ("active", "queues")

    def __init__(self) -> None:
        self.queues: dict[str, TenantQueue] = {}
        self.active: deque[TenantQueue] = deque()

    def add_tenant(self, tenant_id: str, quantum: float) -> None:
        queue = self.queues.get(tenant_id)
        if queue is None:
            self.queues[tenant_id] = TenantQueue(tenant_id, quantum)
        else:
            queue.quantum = quantum

    def push(self, job: Job) -> None:
        queue = self.queues[job.request.tenant_id]
        queue.jobs.append(job)
        queue.live += 1
        if not queue.in_active:
            queue.in_active = True
            self.active.append(queue)

    def forget(self, job: Job) -> None:
        """A queued job left without being picked (cancelled, expired): O(1), lazy removal."""
        queue = self.queues[job.request.tenant_id]
        queue.live -= 1
        if queue.live == 0:
            queue.reset()

    def min_head_cost(self) -> int | None:
        """Cheapest head among backlogged tenants (O(active tenants))."""
        return min(
            (head.service_tokens for q in self.active if (head := q.head()) is not None),
            default=None,
        )

    def pick(self, eligible: Callable[[Job], bool]) -> Job | None:
        """Remove and return the next job to run, or None if no head is eligible now."""
        active = self.active
        while active:
            candidates: list[TenantQueue] | None = None  # built only when a deficit falls short
            for _ in range(len(active)):
                queue = active[0]
                head = queue.head()
                if head is None:
                    # Emptied by cancellations: leave the round robin, bank nothing.
                    active.popleft()
                    queue.in_active = False
                    queue.reset()
                    continue
                if not eligible(head):
                    # An open turn stays open: closing it would grant a fresh quantum on top of
                    # an uncovered deficit, and a throttled tenant would bank without bound.
                    active.rotate(-1)
                    continue
                if not queue.turn_open:
                    queue.deficit += queue.quantum
                    queue.turn_open = True
                if queue.deficit >= head.service_tokens:
                    queue.jobs.popleft()
                    queue.live -= 1
                    queue.deficit -= head.service_tokens
                    if queue.live == 0:
                        active.popleft()
                        queue.in_active = False
                        queue.reset()
                    return head
                queue.turn_open = False
                if candidates is None:
                    candidates = []
                candidates.append(queue)
                active.rotate(-1)
            if not candidates:
                return None
            # Nobody's deficit covered its head: grant the quanta of the empty rounds at once.
            rounds = min(
                math.ceil((q.jobs[0].service_tokens - q.deficit) / q.quantum) for q in candidates
            )
            if rounds > 1:
                for queue in candidates:
                    queue.deficit += (rounds - 1) * queue.quantum
        return None
