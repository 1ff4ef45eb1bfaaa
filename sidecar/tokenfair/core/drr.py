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
* **kept places** — a head passed over because it needs more than the caller's ``room``
  (``tokenfair``'s batch lane: KV blocks over those free under the watermark) is not sent to
  the ring's tail: its tenant keeps its place right behind the front, ahead of the tenants
  that join ahead later, until its head is sent or passed over for another reason. At most
  ``max_kept`` tenants (default :data:`KEPT_PLACES_MAX`) keep their place at once (the others
  go to the tail, as any passed-over head); while ``room`` is below the least need among the
  kept heads they are not asked ``eligible`` at all. The kept tenants sit at the start of the
  tenants waiting ahead (rank ``-inf``), taken out and put back in O(kept) a pick; a pick that
  sends nothing leaves the ring as it was, and a kept tenant that becomes the front keeps the
  mark until its turn comes (docs/fairness.md §5.5, change 9);
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
fixed-point units of ``UNITS_PER_TOKEN`` (10^9) per service token (:mod:`.units`); a job is
charged its ``expected_units``. Every sum, difference and ``ceil`` here is exact, so the running
totals equal the sums they stand for at every step and no tolerance is needed. The only
rounding is where a float enters: a quantum ``base * weight`` and a float ``settle`` amount are
rounded to the nearest unit of their float value (off the real value by at most ``0.5 unit +
2^-53 * value``), once, when they enter; charge and refund use the same integer. The
``deficit``, ``quantum``, ``credit_tokens``... attributes read the state in tokens (floats).

Costs of selection: O(active tenants) per pick, plus O(kept) (at most ``max_kept``); enqueue
and cancel amortised O(1) (joining ahead: O(tenants waiting for their first turn ahead); a
cancel that empties a tenant's queue takes it out of the ring, O(active tenants) in C);
``min_head_cost`` O(log n) amortised (its first call O(n): the heads are indexed from then on,
so a lane never asked pays nothing).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from heapq import heapify, heappop, heappush
from itertools import count

from tokenfair.core.jobs import Job, JobState
from tokenfair.core.pool_order import LaneOrder
from tokenfair.core.units import to_units, tokens_of

_QUEUED = JobState.QUEUED
_KEPT_RANK = -math.inf  # a kept tenant's rank among those waiting ahead: before every joiner

KEPT_PLACES_MAX = 1
"""Default bound on the tenants of one lane that keep their place while their heads wait for
room (:class:`DeficitRoundRobin`, ``max_kept``). One: the oldest blocked head holds its place
and the others go to the tail as before. More keep more large requests waiting at the front
for KV, which the interactive lane then waits for: bench_fairness scenario 9 over seeds 1-32,
2, 4, 8 or 16 kept put seed 22's admitted-then-expired interactive requests at 2.2 % (1.5 %
without kept places, 1.8 % with one; bench/HISTORY.md, issue 29 fifth pass)."""


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
        "kept",
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
        self.quantum = tokens_of(self.quantum_units)
        """``Q_i`` in service tokens, read (the state is ``quantum_units``)."""
        self.jobs: deque[Job] = deque()
        self.live = 0  # queued jobs not cancelled (cancelled ones are dropped lazily at the head)
        self.queued_units = 0  # expected service of the live jobs, in units
        self.deficit_units = 0
        self.turn_open = False
        self.in_active = False
        self.joined_ahead = False  # joined ahead of the ring's tail, first turn still to come
        self.kept = False  # keeps its place while its head waits for room (`pick`'s `need`)

    @property
    def deficit(self) -> float:
        """``D_i`` in service tokens (the state is ``deficit_units``, exact)."""
        return tokens_of(self.deficit_units)

    @property
    def queued_tokens(self) -> float:
        """Expected service tokens of the live jobs (the state is ``queued_units``)."""
        return tokens_of(self.queued_units)

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
        "_kept_count",
        "_sequence",
        "active",
        "active_quanta_units",
        "credit_units",
        "max_kept",
        "order",
        "queued_units",
        "queues",
    )

    def __init__(self, max_kept: int = KEPT_PLACES_MAX) -> None:
        self.queues: dict[str, TenantQueue] = {}
        self.active: deque[TenantQueue] = deque()
        self.credit_units = 0
        """``sum_i max(0, D_i)`` in units: what the tenants could send on deficits already
        granted (admission's bound on the others' next turns reads it)."""
        self.active_quanta_units = 0
        """Sum of the quanta of the backlogged tenants (the ring), in units."""
        # The tenants that joined ahead and wait for their first turn sit at active[1:1+n],
        # in rank order; these lists hold their ranks and what they may send in that turn.
        # Kept tenants (`pick`'s `need`) are the first of them, with rank -inf.
        self._joiner_ranks: list[float] = []
        self._joiner_credit: list[int] = []
        self.max_kept = max_kept
        """The most tenants that keep their place at once (``pick``'s ``need``); 0: none."""
        self._kept_count = 0  # tenants with `kept` set (in the ring, or taken out in a pick)
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
        return tokens_of(self.credit_units)

    @property
    def active_quanta(self) -> float:
        """Sum of the quanta of the backlogged tenants, in service tokens."""
        return tokens_of(self.active_quanta_units)

    @property
    def queued_tokens(self) -> float:
        """Expected service tokens of every live queued job of the lane."""
        return tokens_of(self.queued_units)

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
            queue.quantum = tokens_of(units)

    def push(self, job: Job, *, join_ahead: float | None = None) -> None:
        """Queue a job. A tenant that was not backlogged joins the ring at its tail — or, with
        a ``join_ahead`` rank, right behind the front and behind the tenants that joined that
        way with a rank no higher (lower ranks first, FIFO among equals), its turn open with a
        deficit that covers this job: it sends the job in its first turn (VTC's lift, in DRR
        terms). When the front has not started its turn, does not keep its place (``kept``)
        and no joiner waits, before the front: a tenant owed service goes before one that has
        been granted nothing yet."""
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
                front = active[0] if active else None
                if (
                    front is not None
                    and not front.turn_open
                    and not front.kept
                    and not self._joiner_ranks
                ):
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
        if not front.turn_open and not front.kept and not self._joiner_ranks:
            return 0.0  # it would go before the front (`push`)
        credit = max(0, front.deficit_units)
        if not front.turn_open:
            credit += front.quantum_units
        before = bisect_right(self._joiner_ranks, rank)
        return tokens_of(min(credit, front.queued_units) + sum(self._joiner_credit[:before]))

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
        if queue.kept:
            self._unkeep(queue)
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
        if queue.kept:
            self._unkeep(queue)
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
        return None if units is None else tokens_of(units)

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

    def pick(
        self,
        eligible: Callable[[Job], bool],
        need: Callable[[Job], int] | None = None,
        room: Callable[[], int] | None = None,
    ) -> Job | None:
        """Remove and return the next job to run, or None if no head is eligible now.

        ``need`` and ``room`` (``tokenfair``'s batch lane: a head's KV blocks, and the blocks
        free under the watermark now): a head passed over with ``need(head) > room()`` keeps
        its tenant's place (the module docstring, :meth:`_pick_round_robin`); ``eligible``
        must be false for every such head. ``room`` is called at most once a pick, and only
        when a head is passed over or kept heads wait (a pick whose first head goes costs
        nothing more). None: a passed-over head goes to the ring's tail."""
        order = self.order
        if order is not None and order.sharing:
            return self._pick_least_served(eligible, order)
        return self._pick_round_robin(eligible, need, room)

    @property
    def kept_tenants(self) -> int:
        """Tenants that keep their place while their heads wait for room (at most
        :attr:`max_kept`)."""
        return self._kept_count

    def _unkeep(self, queue: TenantQueue) -> None:
        """``queue`` no longer keeps its place (its turn came, it was passed over for another
        reason, it left, or the pool-wide order sent its head). An entry among those waiting
        ahead stays where it is until the tenant's next turn (its rank, -inf, was the place
        it kept)."""
        queue.kept = False
        self._kept_count -= 1

    def _kept_still_blocked(self, need: Callable[[Job], int], room: int) -> bool:
        """The kept tenants at the ring's front (contiguous: the front's kept mark, then those
        waiting ahead with rank -inf) all have heads that need more than ``room``: O(kept)."""
        for queue in self.active:
            if not queue.kept:
                return True
            head = queue.head()
            if head is None or need(head) <= room:
                return False
        return True

    def _put_back(
        self,
        held: list[TenantQueue],
        at_front: bool,
        entry: tuple[float, int] | None = None,
    ) -> None:
        """The kept tenants ``held`` (taken out of the ring in this pick, in ring order) go back
        right behind the front, as the first of the tenants waiting ahead (rank -inf, credit as
        :meth:`tokens_before_joining_ahead` counts a front's) — or, ``at_front``, before it, the
        first of them the front (a pick that sent nothing: the ring as it was; or the front
        that was sent to left: they stood before the next). The front they go before waits
        ahead again: kept (rank -inf), or a joiner with its ``entry`` (rank, credit) as it had
        it before it became the front. O(kept)."""
        active = self.active
        ranks = self._joiner_ranks
        credits = self._joiner_credit
        if at_front or not active:
            # Each goes in before the one after it; the last first, right before the front.
            old_front = active[0] if active else None
            if old_front is not None and old_front.kept:
                self._wait_ahead(old_front, _KEPT_RANK)
            elif old_front is not None and entry is not None:
                old_front.joined_ahead = True
                ranks.insert(0, entry[0])
                credits.insert(0, entry[1])
            for index in range(len(held) - 1, 0, -1):
                queue = held[index]
                active.appendleft(queue)
                self._wait_ahead(queue, _KEPT_RANK)
            active.appendleft(held[0])
        else:
            for index in range(len(held) - 1, -1, -1):
                queue = held[index]
                active.insert(1, queue)
                self._wait_ahead(queue, _KEPT_RANK)

    def _wait_ahead(self, queue: TenantQueue, rank: float) -> None:
        """``queue`` now stands first among the tenants waiting ahead, with ``rank`` and the
        credit :meth:`tokens_before_joining_ahead` counts a front's with."""
        credit = queue.deficit_units if queue.deficit_units > 0 else 0
        if not queue.turn_open:
            credit += queue.quantum_units
        queue.joined_ahead = True
        self._joiner_ranks.insert(0, rank)
        self._joiner_credit.insert(0, credit if credit < queue.queued_units else queue.queued_units)

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
        if best.kept:  # the head it kept its place for is sent (review rev1207h F3)
            self._unkeep(best)
        if best.live:
            next_head = best.head()
            if next_head is not None:
                self._head_changed(next_head)
        else:
            self._drop_credit(best)
            self._remove(best)
        return best_head

    def _pick_round_robin(
        self,
        eligible: Callable[[Job], bool],
        need: Callable[[Job], int] | None,
        room: Callable[[], int] | None,
    ) -> Job | None:
        """The round robin's pick (the module docstring's rules). With ``need``: a head passed
        over that needs more than ``room()`` is taken out of the ring (``held``), its tenant
        marked ``kept`` (if fewer than ``max_kept`` are), and put back when the pick ends
        (:meth:`_put_back`): behind the front if a head was sent, else where it was. The kept
        tenants met at the front are taken out unasked while every kept head needs more than
        the room (:meth:`_kept_still_blocked`, asked once a pick). A kept tenant asked and
        eligible, or passed over for another reason, loses the mark."""
        active = self.active
        held: list[TenantQueue] | None = None  # kept tenants taken out in this pick, in order
        held_first = False  # no tenant that stays in the ring came before the first of them
        still_blocked: bool | None = None  # `_kept_still_blocked`, once asked
        turned = False  # the ring has turned in this pick (a tenant went to its tail)
        free = 0  # room(), read once, when first needed
        free_read = False
        while active:
            candidates: list[TenantQueue] | None = None  # built only when a deficit falls short
            # One visit a tenant of the ring as the pass began: each visit turns the ring past
            # one of them or takes one out, so the ring is not empty while visits remain.
            for _ in range(len(active)):
                queue = active[0]
                self._front_changed()
                head = queue.head()
                if head is None:
                    # Emptied by cancellations: leave the round robin, bank nothing.
                    self._leave(queue)
                    continue
                hold = False  # it keeps its place: out of the ring until the pick ends
                if queue.kept and need is not None and room is not None:
                    if still_blocked is None:
                        if not free_read:
                            free, free_read = room(), True
                        still_blocked = self._kept_still_blocked(need, free)
                    hold = still_blocked  # no kept head fits: none is asked (`eligible` is no)
                if not hold and not eligible(head):
                    # (`need` asked only of a head that could keep its place: with the bound
                    # reached, a passed-over head costs what it did before.)
                    if (
                        need is not None
                        and room is not None
                        and (queue.kept or self._kept_count < self.max_kept)
                    ):
                        if not free_read:
                            free, free_read = room(), True
                        if need(head) > free:
                            if not queue.kept:
                                queue.kept = True
                                self._kept_count += 1
                            hold = True
                    if not hold:
                        if queue.kept:
                            self._unkeep(queue)  # held by something else than room: the tail
                        # An open turn stays open: closing it would grant a fresh quantum on
                        # top of an uncovered deficit, and a throttled tenant would bank
                        # without bound.
                        active.rotate(-1)
                        turned = True
                        self._front_changed()
                        continue
                if hold:
                    active.popleft()
                    self._front_changed()
                    if held is None:
                        held, held_first = [], not turned
                    held.append(queue)
                    continue
                if queue.kept:
                    self._unkeep(queue)  # its turn has come
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
                        if held is not None:
                            self._put_back(held, False)
                    elif held is not None:
                        # The front leaves: the kept go where it stood, before the next front
                        # (which, if it waited ahead as a joiner, waits so again behind them).
                        entry: tuple[float, int] | None = None
                        if len(active) > 1 and active[1].joined_ahead and not active[1].kept:
                            entry = (self._joiner_ranks[0], self._joiner_credit[0])
                        self._leave(queue)
                        self._put_back(held, True, entry)
                    else:
                        self._leave(queue)
                    return head
                queue.turn_open = False
                if candidates is None:
                    candidates = []
                candidates.append(queue)
                active.rotate(-1)
                turned = True
                self._front_changed()
            if not candidates:
                break
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
        if held is not None:
            self._put_back(held, held_first)
        return None
