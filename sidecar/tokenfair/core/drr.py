"""Weighted deficit round robin (Shreedhar & Varghese) over tenants of one lane, in service tokens.

Each backlogged tenant ``i`` holds a deficit counter ``D_i``. When its turn starts it earns its
quantum ``Q_i = base_quantum_tokens * weight_i``; it then sends head-of-queue requests while
``D_i >= cost(head)``, paying ``cost(head)`` each (a request's *full* cost, never a slice). The turn
passes when the head costs more than ``D_i``; ``D_i`` carries over while the tenant stays
backlogged; when its queue empties a *credit* (``D_i > 0``) is dropped, so idle tenants bank
nothing, but a *debt* (``D_i < 0``, see settlement) is kept until it is paid.

**Settlement in actual tokens.** A request is paid for with its *estimate* when it is sent; when
its actual usage is known, :meth:`DeficitRoundRobin.settle` charges the difference,
``D_i -= actual - estimate``. A tenant that under-declares therefore goes into debt and must earn
the quanta that cover it before it sends again, so the round robin is fair in *actual* service
tokens. A refund (``actual < estimate``) is a credit like any other: kept while the tenant is
backlogged, dropped when it is not.

Fairness bound (the DRR lemma): for two tenants continuously backlogged in one lane over an
interval, the normalised service gap stays bounded,
``|S_i/w_i - S_j/w_j| <= 3 * base_quantum_tokens + max_cost/w_i + max_cost/w_j``
(each side is within ``Q_i + max_cost`` of ``k`` quanta after ``k`` turns; see docs/fairness.md).
Counted in *settled* (actual) tokens the deficit also holds debts, ``-A_i <= D_i``, where ``A_i``
bounds the actual usage of the tenant's requests in flight at once (one request in the serial
simulator, which settles each before the next pick), so the bound becomes
``3 * base_quantum_tokens + (max_cost + A_i)/w_i + (max_cost + A_j)/w_j``.

Three departures from the textbook, all bounded:

* **eligibility** — a head that cannot run *now* (KV watermark, token budget) is passed over
  without earning a quantum; the tenant keeps its deficit, and a turn it had open stays open (it
  resumes that turn, with no new quantum, when next visited), so ``D_i < max_cost + Q_i``
  holds whatever the eligibility (and ``D_i >= 0`` but for settlement debts);
* **joining ahead** — a tenant that was not backlogged and is owed service (the caller decides:
  ``tokenfair`` asks for it when the tenant had less than its weighted share of the lane's
  recent service) joins right behind the front, least served first, with its turn open and its
  deficit lifted to cover the job: VTC's counter lift in DRR terms. If the front has not started
  its turn (it was granted nothing yet) and no joiner waits, it goes before the front instead.
  Two tenants that stay backlogged never change their relative order, so the bound above holds
  for them;
* **skipping empty rounds** — when a full pass finds no eligible head covered by its deficit,
  every eligible tenant is granted the quanta of the rounds it would have waited through,
  ``k = min_i ceil((cost_i - D_i) / Q_i) - 1`` in one step, so selection costs O(tenants) and
  never loops on large requests.

**Exact arithmetic.** Deficits, quanta, the lane's credit and queued totals are integers in
fixed-point units of ``UNITS_PER_TOKEN`` (10^9) per service token (:mod:`.jobs`); a job is
charged its ``expected_units``. Every sum, difference and ``ceil`` here is exact, so the running
totals equal the sums they stand for at every step and no tolerance is needed. The only
rounding is where a float enters: a quantum ``base * weight`` and a float ``settle`` amount are
rounded to the nearest unit of their float value (off the real value by at most ``0.5 unit +
2^-53 * value``), once, when they enter; charge and refund use the same integer. The
``deficit``, ``quantum``, ``credit_tokens``... attributes read the state in tokens (floats).

Costs of selection: O(active tenants) per pick; enqueue and cancel amortised O(1) (joining
ahead: O(tenants waiting for their first turn ahead); a cancel that empties a tenant's queue
takes it out of the ring, O(active tenants) in C); ``min_head_cost`` O(log n) amortised (its
first call O(n): the heads are indexed from then on, so a lane never asked pays nothing).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from heapq import heapify, heappop, heappush
from itertools import count

from tokenfair.core.jobs import UNITS_PER_TOKEN, Job, JobState, to_units
from tokenfair.core.pool_order import LaneOrder

_QUEUED = JobState.QUEUED
_UNIT = UNITS_PER_TOKEN


def _quantum_units(quantum: float) -> int:
    """A quantum in units, at least one (a quantum of 0 would never cover a head)."""
    units = to_units(quantum)
    return units if units > 0 else 1


class TenantQueue:
    """One tenant's FIFO within one lane, with its DRR state."""

    __slots__ = (
        "deficit_units",
        "in_active",
        "jobs",
        "joined_ahead",
        "live",
        "quantum",
        "quantum_units",
        "queued_units",
        "tenant_id",
        "turn_open",
    )

    def __init__(self, tenant_id: str, quantum: float) -> None:
        self.tenant_id = tenant_id
        self.quantum_units = _quantum_units(quantum)
        self.quantum = self.quantum_units / _UNIT
        """``Q_i`` in service tokens, read (the state is ``quantum_units``)."""
        self.jobs: deque[Job] = deque()
        self.live = 0  # queued jobs not cancelled (cancelled ones are dropped lazily at the head)
        self.queued_units = 0  # expected service of the live jobs, in units
        self.deficit_units = 0
        self.turn_open = False
        self.in_active = False
        self.joined_ahead = False  # joined ahead of the ring's tail, first turn still to come

    @property
    def deficit(self) -> float:
        """``D_i`` in service tokens (the state is ``deficit_units``, exact)."""
        return self.deficit_units / _UNIT

    @property
    def queued_tokens(self) -> float:
        """Expected service tokens of the live jobs (the state is ``queued_units``)."""
        return self.queued_units / _UNIT

    def head(self) -> Job | None:
        jobs = self.jobs
        while jobs and jobs[0].state is not _QUEUED:
            jobs.popleft()
        return jobs[0] if jobs else None

    def reset(self) -> None:
        """The queue emptied: drop a credit (idle tenants bank nothing), keep a debt."""
        if self.deficit_units > 0:
            self.deficit_units = 0
        self.turn_open = False
        self.queued_units = 0


class DeficitRoundRobin:
    """Selects the next job of one lane; see the module docstring for the rules."""

    __slots__ = (
        "_head_costs",
        "_heads_indexed",
        "_joiner_credit",
        "_joiner_ranks",
        "_sequence",
        "active",
        "active_quanta_units",
        "credit_units",
        "order",
        "queued_units",
        "queues",
    )

    def __init__(self) -> None:
        self.queues: dict[str, TenantQueue] = {}
        self.active: deque[TenantQueue] = deque()
        self.credit_units = 0
        """``sum_i max(0, D_i)`` in units: what the tenants could send on deficits already
        granted (admission's bound on the others' next turns reads it)."""
        self.active_quanta_units = 0
        """Sum of the quanta of the backlogged tenants (the ring), in units."""
        # The tenants that joined ahead and wait for their first turn sit at active[1:1+n],
        # in rank order; these lists hold their ranks and what they may send in that turn.
        self._joiner_ranks: list[float] = []
        self._joiner_credit: list[int] = []
        self.queued_units = 0
        """Expected service of every live queued job of the lane, in units."""
        # (cost in units, sequence, job) of every live queue's head, plus stale entries (a head
        # that was sent or cancelled) dropped when they surface: `min_head_cost` in O(log n)
        # amortised. Kept from the first `min_head_cost` on: a lane nobody asks (`tokenfair`
        # asks only the batch lane) pays nothing for it.
        self._head_costs: list[tuple[int, int, Job]] = []
        self._heads_indexed = False
        self._sequence = count()
        self.order: LaneOrder | None = None
        """Pool-wide service counters (:mod:`.pool_order`), or None: this lane's own round
        robin, as without a pool. With them, every service given and settled is counted there,
        and while they are shared :meth:`pick` serves the eligible head whose tenant has the
        least pool-wide service per quantum (:meth:`_pick_least_served`)."""

    @property
    def credit_tokens(self) -> float:
        """``sum_i max(0, D_i)`` in service tokens."""
        return self.credit_units / _UNIT

    @property
    def active_quanta(self) -> float:
        """Sum of the quanta of the backlogged tenants, in service tokens."""
        return self.active_quanta_units / _UNIT

    @property
    def queued_tokens(self) -> float:
        """Expected service tokens of every live queued job of the lane."""
        return self.queued_units / _UNIT

    @property
    def ahead_joiners(self) -> int:
        """Tenants that joined right behind the front and have not had their first turn."""
        return len(self._joiner_ranks)

    def add_tenant(self, tenant_id: str, quantum: float) -> None:
        queue = self.queues.get(tenant_id)
        if queue is None:
            self.queues[tenant_id] = TenantQueue(tenant_id, quantum)
        else:
            units = _quantum_units(quantum)
            moved = units != queue.quantum_units
            if queue.in_active:
                self.active_quanta_units += units - queue.quantum_units
            queue.quantum_units = units
            if moved and queue.in_active and self.order is not None:
                self.order.enter(tenant_id, units)  # its counter moved with its quantum
            queue.quantum = units / _UNIT

    def push(self, job: Job, *, join_ahead: float | None = None) -> None:
        """Queue a job. A tenant that was not backlogged joins the ring at its tail — or, with
        a ``join_ahead`` rank, right behind the front and behind the tenants that joined that
        way with a rank no higher (lower ranks first, FIFO among equals), its turn open with a
        deficit that covers this job: it sends the job in its first turn (VTC's lift, in DRR
        terms). When the front has not started its turn and no joiner waits, before the front:
        a tenant owed service goes before one that has been granted nothing yet."""
        queue = self.queues[job.tenant_id]
        if queue.live == 0:  # the job is the queue's head
            self._head_changed(job)
        queue.jobs.append(job)
        queue.live += 1
        cost = job.expected_units
        queue.queued_units += cost
        self.queued_units += cost
        if not queue.in_active:
            order = self.order
            if order is not None:
                order.joined(queue.tenant_id, queue.quantum_units, order.least_counter())
                order.enter(queue.tenant_id, queue.quantum_units)
            queue.in_active = True
            self.active_quanta_units += queue.quantum_units
            active = self.active
            if join_ahead is not None:
                if queue.deficit_units < cost:
                    self._credit_moved(queue.deficit_units, cost)
                    queue.deficit_units = cost
                queue.turn_open = True
                if active and not active[0].turn_open and not self._joiner_ranks:
                    # The front has not started its turn and nobody waits ahead: the joiner
                    # goes first (its turn has come; it is no longer waiting ahead).
                    active.appendleft(queue)
                elif active:
                    position = bisect_right(self._joiner_ranks, join_ahead)
                    active.insert(1 + position, queue)
                    self._joiner_ranks.insert(position, join_ahead)
                    self._joiner_credit.insert(position, queue.deficit_units)
                    queue.joined_ahead = True
                else:
                    active.append(queue)
            else:
                active.append(queue)

    def tokens_before_joining_ahead(self, rank: float) -> float:
        """What the ring sends before a tenant that joins ahead now with ``rank`` gets its
        first turn: nothing if it would go before the front (:meth:`push`); else the front's
        turn (its credit, or a fresh quantum on top if its turn is not open yet, capped by what
        it has queued), then the first turns of the joiners ranked no higher. O(log n) to find
        them, then a sum over a list slice (exact, in units)."""
        active = self.active
        if not active:
            return 0.0
        front = active[0]
        if not front.turn_open and not self._joiner_ranks:
            return 0.0  # it would go before the front (`push`)
        credit = max(0, front.deficit_units)
        if not front.turn_open:
            credit += front.quantum_units
        before = bisect_right(self._joiner_ranks, rank)
        return (min(credit, front.queued_units) + sum(self._joiner_credit[:before])) / _UNIT

    def _front_changed(self) -> None:
        """A queue reached the front of the ring: a joiner's first turn has come."""
        active = self.active
        if active and active[0].joined_ahead:
            active[0].joined_ahead = False
            del self._joiner_ranks[0]
            del self._joiner_credit[0]

    def _leave(self, queue: TenantQueue) -> None:
        """The front queue has nothing live: it leaves the ring."""
        self.active.popleft()
        queue.in_active = False
        if self.order is not None:
            self.order.leave(queue.tenant_id)
        self.active_quanta_units -= queue.quantum_units
        self._drop_credit(queue)
        self._front_changed()

    def forget(self, job: Job) -> None:
        """A queued job left without being picked (cancelled, expired): amortised O(1). A job
        behind the head is dropped lazily when it reaches the head; the head itself (and the
        dead jobs in front of it) leave the queue at once, so the next head is indexed for
        :meth:`min_head_cost` (the caller may change ``job.state`` before or after this). If it
        was the tenant's last live job the tenant leaves the ring at once (``deque.remove``:
        O(active tenants), in C), so it is not backlogged any more — a tenant left in the ring
        with nothing queued would be taken for backlogged by admission and could not join
        ahead until the ring came round to it."""
        queue = self.queues[job.tenant_id]
        queue.live -= 1
        queue.queued_units -= job.expected_units
        self.queued_units -= job.expected_units
        jobs = queue.jobs
        while jobs and jobs[0] is not job and jobs[0].state is not _QUEUED:
            jobs.popleft()  # each dead job is popped once: amortised O(1)
        if jobs and jobs[0] is job:  # it was the head
            jobs.popleft()
            while jobs and jobs[0].state is not _QUEUED:
                jobs.popleft()
            if jobs:
                self._head_changed(jobs[0])
        if queue.live == 0:
            self._drop_credit(queue)
            if queue.in_active:
                self._remove(queue)

    def _remove(self, queue: TenantQueue) -> None:
        """Take a queue with nothing live out of the ring, wherever it is."""
        active = self.active
        if active[0] is queue:
            self._leave(queue)
            return
        index = active.index(queue)
        del active[index]
        if queue.joined_ahead:  # the joiners waiting for their first turn sit at active[1:1+n]
            del self._joiner_ranks[index - 1]
            del self._joiner_credit[index - 1]
            queue.joined_ahead = False
        queue.in_active = False
        if self.order is not None:
            self.order.leave(queue.tenant_id)
        self.active_quanta_units -= queue.quantum_units

    def settle(self, tenant_id: str, overrun_tokens: int | float) -> None:
        """Charge ``actual - charged`` of a sent request, in service tokens, to its tenant's
        deficit (:meth:`settle_units`, after rounding to the nearest unit)."""
        self.settle_units(tenant_id, to_units(overrun_tokens))

    def settle_units(self, tenant_id: str, overrun_units: int) -> None:
        """Charge ``actual - charged`` of a sent request, in units, to its tenant's deficit.

        A debt (``overrun_units > 0``) is always kept; a credit only while the tenant is
        backlogged (an idle tenant banks nothing)."""
        queue = self.queues[tenant_id]
        if self.order is not None:
            self.order.served(tenant_id, overrun_units)
        before = queue.deficit_units
        after = before - overrun_units
        if queue.live == 0 and after > 0:  # idle (or emptied by cancellations)
            after = 0
        queue.deficit_units = after
        self._credit_moved(before, after)

    def _credit_moved(self, before: int, after: int) -> None:
        self.credit_units += (after if after > 0 else 0) - (before if before > 0 else 0)

    def _drop_credit(self, queue: TenantQueue) -> None:
        """The queue emptied: its credit goes (a debt stays), and its turn ends."""
        if queue.deficit_units > 0:
            self.credit_units -= queue.deficit_units
        queue.reset()

    def backlogged(self, tenant_id: str) -> bool:
        """The tenant has live (not cancelled) jobs queued in this lane."""
        return self.queues[tenant_id].live > 0

    def _head_changed(self, head: Job) -> None:
        """``head`` is now the first live job of its queue: index its cost."""
        if not self._heads_indexed:
            return
        heads = self._head_costs
        heappush(heads, (head.expected_units, next(self._sequence), head))
        if len(heads) > 64 + 4 * len(self.active):
            # Mostly stale (heads sent while nobody asked for the cheapest): rebuild, O(n).
            heads[:] = [entry for entry in heads if self._is_head(entry[2])]
            heapify(heads)

    def _is_head(self, job: Job) -> bool:
        return job.state is _QUEUED and self.queues[job.tenant_id].head() is job

    def min_head_cost(self) -> float | None:
        """Expected service tokens of the cheapest head among backlogged tenants
        (:meth:`min_head_units`, read in tokens)."""
        units = self.min_head_units()
        return None if units is None else units / _UNIT

    def min_head_units(self) -> int | None:
        """Cheapest head among backlogged tenants, in units: O(log n) amortised (a heap of the
        heads' costs; entries of heads that were sent or cancelled are dropped as they surface).
        The first call indexes the heads there are (O(n)); every head change is indexed from
        then on."""
        heads = self._head_costs
        queues = self.queues
        if not self._heads_indexed:
            self._heads_indexed = True
            for queue in queues.values():
                if queue.live:
                    head = queue.head()
                    if head is not None:
                        heappush(heads, (head.expected_units, next(self._sequence), head))
        while heads:
            cost, _, job = heads[0]
            if job.state is _QUEUED:
                queue = queues[job.tenant_id]
                if queue.jobs[0] is job or queue.head() is job:  # the first test is the usual
                    return cost
            heappop(heads)
        return None

    def pick(self, eligible: Callable[[Job], bool]) -> Job | None:
        """Remove and return the next job to run, or None if no head is eligible now."""
        order = self.order
        if order is not None and order.sharing:
            return self._pick_least_served(eligible, order)
        return self._pick_round_robin(eligible)

    def backlogged_tenants(self) -> list[str]:
        """The tenants with live jobs queued in this lane, in ring order."""
        return [queue.tenant_id for queue in self.active]

    def set_order(self, order: LaneOrder | None) -> None:
        """Order by ``order``'s counters (None: by the round robin alone); its ranking of the
        backlogged tenants (:meth:`LaneOrder.rank`) starts from the ring as it is."""
        self.order = order
        if order is not None:
            order.rank([(queue.tenant_id, queue.quantum_units) for queue in self.active])

    def least_counter(self, order: LaneOrder) -> float | None:
        """The least pool-wide counter among the backlogged tenants (None if none): O(1), from
        ``order``'s ranking (:attr:`LaneOrder.ranked`)."""
        return order.least_counter()

    def _pick_least_served(self, eligible: Callable[[Job], bool], order: LaneOrder) -> Job | None:
        """The eligible head whose tenant has the least pool-wide service per quantum (the
        first in ring order among equals): O(backlogged tenants). Deficits are left as they
        are (the round robin takes over with them when the store is down)."""
        best: TenantQueue | None = None
        best_head: Job | None = None
        best_value = 0.0
        for queue in self.active:
            head = queue.head()
            if head is None or not eligible(head):
                continue
            value = order.counter(queue.tenant_id, queue.quantum_units)
            if best is None or value < best_value:
                best, best_head, best_value = queue, head, value
        if best is None or best_head is None:
            return None
        cost = best_head.expected_units
        best.jobs.popleft()
        best.live -= 1
        best.queued_units -= cost
        self.queued_units -= cost
        order.served(best.tenant_id, cost)
        if best.live:
            next_head = best.head()
            if next_head is not None:
                self._head_changed(next_head)
        else:
            self._drop_credit(best)
            self._remove(best)
        return best_head

    def _pick_round_robin(self, eligible: Callable[[Job], bool]) -> Job | None:
        """The round robin's pick (the module docstring's rules)."""
        active = self.active
        while active:
            candidates: list[TenantQueue] | None = None  # built only when a deficit falls short
            for _ in range(len(active)):
                queue = active[0]
                self._front_changed()
                head = queue.head()
                if head is None:
                    # Emptied by cancellations: leave the round robin, bank nothing.
                    self._leave(queue)
                    continue
                if not eligible(head):
                    # An open turn stays open: closing it would grant a fresh quantum on top of
                    # an uncovered deficit, and a throttled tenant would bank without bound.
                    active.rotate(-1)
                    self._front_changed()
                    continue
                deficit = queue.deficit_units
                if not queue.turn_open:
                    before = deficit
                    queue.deficit_units = deficit = deficit + queue.quantum_units
                    queue.turn_open = True
                    self._credit_moved(before, deficit)
                cost = head.expected_units
                if deficit >= cost:
                    queue.jobs.popleft()
                    queue.live -= 1
                    queue.queued_units -= cost
                    self.queued_units -= cost
                    queue.deficit_units = deficit - cost  # stays >= 0: all of it was credit
                    self.credit_units -= cost
                    if self.order is not None:  # counted while the pool's store is down
                        self.order.served(queue.tenant_id, cost)
                    if queue.live:
                        next_head = queue.head()
                        if next_head is not None:
                            self._head_changed(next_head)
                    else:
                        self._leave(queue)
                    return head
                queue.turn_open = False
                if candidates is None:
                    candidates = []
                candidates.append(queue)
                active.rotate(-1)
                self._front_changed()
            if not candidates:
                return None
            # Nobody's deficit covered its head: grant the quanta of the empty rounds at once.
            # ceil((cost - D) / Q) in integers: exact.
            rounds = min(
                -((q.deficit_units - q.jobs[0].expected_units) // q.quantum_units)
                for q in candidates
            )
            if rounds > 1:
                for queue in candidates:
                    before = queue.deficit_units
                    queue.deficit_units = after = before + (rounds - 1) * queue.quantum_units
                    self._credit_moved(before, after)
        return None
