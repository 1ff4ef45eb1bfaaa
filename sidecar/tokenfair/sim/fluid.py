"""The fluid fair-share reference: what an ideal weighted max-min (GPS) server would have given
each tenant of a lane out of what the lane actually served, moment by moment.

Written from the definition of generalised processor sharing (Parekh & Gallager), with its own
arithmetic: it imports nothing of the scheduling core and nothing of ours at all (a test reads
its imports), so a mistake in the scheduler cannot hide in its own yardstick.

**The fluid server of one lane.** Tenants ``i`` with weights ``w_i > 0``. Demand comes as
*requests* (:class:`FluidRequest`: ``arrival_ms``, ``tenant``, ``size_tokens``, ``leave_ms``,
``start_ms``); at ``arrival_ms`` the request's ``size_tokens`` join its tenant's fluid backlog,
behind the tenant's earlier requests (FIFO within a tenant), and whatever of it is still
unserved at ``leave_ms`` leaves unserved (``leave_ms = inf``: it stays until served). The
server's capacity is a rate ``C(t)`` (service tokens per ms), given from outside: here, what the
lane actually served at ``t``. At every instant the backlogged tenants ``B(t)`` share ``C(t)``
in proportion to their weights::

    rate_i(t) = C(t) * w_i / W(t)        for i in B(t),   W(t) = Σ_{j in B(t)} w_j

(a tenant with no backlog gets nothing; while nobody is backlogged the capacity is lost and
counted in :attr:`FluidLane.unused_tokens`). With the virtual time ``V``, ``dV/dt = C / W``
while ``W > 0``, tenant ``i`` receives ``w_i * dV``. The request at the head of ``i``'s backlog,
of ``r`` tokens when it became head at virtual time ``V0``, is served in full when ``V`` reaches
its finish tag ``F = V0 + r / w_i``; if ``leave_ms`` comes first it leaves with
``r - w_i * (F - V)`` served. Between two events — an arrival, a change of ``C``, a head served
in full, a head leaving — ``C`` and ``B`` are constant, so the next event is the smaller of the
next input and ``now + (F_min - V) * W / C``: the whole run is event-driven, each request
costing one arrival, one head start and one head end, each O(log tenants) (the finish tags in a
heap while more than ``_SCAN_MAX`` tenants are backlogged, a look at each of them otherwise; the
heads' leave times in a heap; stale entries are skipped). Measured compiled, ~2,400 instructions
and ~80 bytes a request of a replay (``tokenfair simulate`` of 200k requests: +5-8 %
instructions). A request that becomes head at or after its own ``leave_ms`` leaves unserved (the
same service, 0, as leaving behind the head: its tenant was backlogged either way).

Whenever ``W`` falls to 0 the virtual time restarts at 0 (no tag is outstanding), so it never
grows with the length of a run; a served head's service is its size exactly (``V`` is set to
its tag at that event), so rounding enters only through a head that leaves part-served and
through ``C * dt`` on the way, and sums match to ~1e-12 relative.

**The lane's service as the capacity.** :func:`fluid_reference` takes the lane's served
requests (those with a ``start_ms``) as *service segments*: one at ``rate_tokens_per_ms``
from ``start_ms`` for ``size_tokens / rate_tokens_per_ms`` ms, so ``C(t) = rate * (segments
running at t)`` — the serial simulator's exact timeline, and a model of a live server's. If
every request the lane served is demand that stays until served (``leave_ms = inf``) and
arrived no later than it started, the fluid server is never idle while the lane serves: its
cumulative service equals the lane's at every instant, and ``unused_tokens`` is 0. (Proof:
with ``τ`` the last instant at or before ``t`` with no fluid backlog, the fluid has served by
``τ`` everything that arrived by then, which includes every served request that started by
``τ``, so at least the lane's service up to ``τ``; it is busy on ``(τ, t]``, so it serves all
the capacity there.) So the reference re-splits exactly what the lane served; only *who* gets
it differs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

_NEVER: Final = math.inf
_SCAN_MAX: Final = 8
"""Above this many backlogged tenants, the next finish is kept in a heap (see ``_heaped``)."""
_SCAN_MIN: Final = 4
"""At this many or fewer, back to a scan (apart from ``_SCAN_MAX``: no switching back and forth
at every arrival)."""


class FluidRequest:
    """One request of a lane as the fluid server takes it.

    ``tenant`` is an index the caller assigns (``0 ..``). A request the lane served has the
    start of its service, ``start_ms``, and stays in the demand until the fluid server has
    served it (``leave_ms = inf``); one it did not serve has ``start_ms = inf`` (no service
    segment) and its ``leave_ms``. One object a request: compiled, its fields are C doubles
    read directly, and the tenants' queues hold it as it is (a request costs ~80 bytes until
    the report, against ~30 in arrays, whose appends and reads each cost a call).
    """

    __slots__ = ("arrival_ms", "leave_ms", "size_tokens", "start_ms", "tenant")

    def __init__(
        self,
        arrival_ms: float,
        tenant: int,
        size_tokens: float,
        leave_ms: float = _NEVER,
        start_ms: float = _NEVER,
    ) -> None:
        self.arrival_ms = arrival_ms
        self.tenant = tenant
        self.size_tokens = size_tokens
        self.leave_ms = leave_ms
        self.start_ms = start_ms

    def __lt__(self, other: FluidRequest) -> bool:
        """Arrival order (what ``list.sort`` sorts by: a comparison method of the class costs
        less than a key function called for every request)."""
        return self.arrival_ms < other.arrival_ms


class _FluidTenant:
    """One tenant's fluid backlog: its head request and the ones queued behind it."""

    __slots__ = (
        "busy",
        "busy_position",
        "counted_tokens",
        "done_tokens",
        "finish_v",
        "head",
        "head_counted",
        "index",
        "queue",
        "queue_next",
        "received_tokens",
        "weight",
    )

    def __init__(self, weight: float, index: int) -> None:
        self.weight = weight
        self.index = index
        self.busy = False
        self.busy_position = 0
        """Its place in the lane's list of backlogged tenants, while it is in it."""
        self.head: FluidRequest | None = None
        self.head_counted = False
        self.queue: list[FluidRequest] = []
        """The requests behind the head, in arrival order, from ``queue[queue_next]`` on (a list
        and an index: compiled, a deque's methods are looked up by name at every call)."""
        self.queue_next = 0
        self.finish_v = 0.0
        """The head's finish tag: the virtual time at which it is served in full. It also names
        the head in the heaps: an entry whose tag (or leave time) is not the head's is stale,
        and one equal to it stands for the head itself (a later head of the same tenant has a
        later tag, its size being > 0)."""
        self.done_tokens = 0.0
        """Fluid service of every request that has left (served in full or not)."""
        self.counted_tokens = 0.0
        """The part of ``done_tokens`` that went to counted requests."""
        self.received_tokens = 0.0
        """Sizes of the counted requests that the lane served (those with a ``start_ms``)."""


class FluidLane:
    """The GPS fluid server of one lane, driven forward in time by its caller.

    Tenants are ``0 .. len(weights) - 1`` (more with :meth:`add_tenant`). The caller moves the
    clock with :meth:`advance` (never backwards) and, at the current time, adds demand
    (:meth:`arrive`) and sets the capacity (:attr:`rate_tokens_per_ms`, or :meth:`set_rate`
    with a check). Read a tenant's fluid service so far with :meth:`service_tokens`, and the
    part of it that went to *counted* requests — those that arrived in ``[counted_from_ms,
    counted_to_ms]`` — with :meth:`counted_tokens`. Weights must be finite and > 0
    (``ValueError`` naming the tenant).
    """

    __slots__ = (
        "_busy",
        "_deadlines",
        "_finishes",
        "_heaped",
        "_heappop",
        "_heappush",
        "_heapreplace",
        "_tenants",
        "busy_tenants",
        "counted_from_ms",
        "counted_to_ms",
        "now_ms",
        "rate_tokens_per_ms",
        "unused_tokens",
        "virtual",
        "weight_sum",
    )

    def __init__(
        self,
        weights: Sequence[float],
        start_ms: float = 0.0,
        counted_from_ms: float = -_NEVER,
        counted_to_ms: float = _NEVER,
    ) -> None:
        self._tenants: list[_FluidTenant] = []
        for weight in weights:
            self.add_tenant(weight)
        self.now_ms = float(start_ms)
        self.counted_from_ms = counted_from_ms
        self.counted_to_ms = counted_to_ms
        self.rate_tokens_per_ms = 0.0
        """The capacity now, in service tokens per ms (>= 0)."""
        self.virtual = 0.0
        self.weight_sum = 0.0
        self.busy_tenants = 0
        self.unused_tokens = 0.0
        """Capacity offered while no tenant was backlogged (0 when the capacity is the service of
        requests that are all part of the demand, see the module docstring)."""
        self._busy: list[_FluidTenant] = []
        """The backlogged tenants, in no order."""
        self._heaped = False
        """Whether the finish tags are in ``_finishes``: only while more than ``_SCAN_MAX``
        tenants are backlogged (back to a scan of ``_busy`` at ``_SCAN_MIN``): a lane of a few
        backlogged tenants finds its next finish faster by looking at each than by keeping a
        heap, whose every push is a call, a tuple and a boxed float."""
        self._finishes: list[tuple[float, int]] = []  # (a head's finish tag, tenant)
        self._deadlines: list[tuple[float, int]] = []  # (a head's leave_ms, tenant)
        # Held here: compiled, ``heapq.heappush`` is a lookup on the module at every call (a
        # heap of two lists sifted in compiled code was slower still: it boxes every key).
        self._heappush: Callable[[list[tuple[float, int]], tuple[float, int]], None] = (
            heapq.heappush
        )
        self._heappop: Callable[[list[tuple[float, int]]], tuple[float, int]] = heapq.heappop
        self._heapreplace: Callable[
            [list[tuple[float, int]], tuple[float, int]], tuple[float, int]
        ] = heapq.heapreplace

    @property
    def tenant_count(self) -> int:
        return len(self._tenants)

    def add_tenant(self, weight: float) -> int:
        """A new tenant of weight ``weight`` (finite, > 0); its index."""
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"fluid reference: weight of tenant {len(self._tenants)} must be a finite "
                f"number > 0 (got {weight!r})"
            )
        index = len(self._tenants)
        self._tenants.append(_FluidTenant(float(weight), index))
        return index

    def set_rate(self, rate_tokens_per_ms: float) -> None:
        """The capacity from now on, in service tokens per ms (finite, >= 0)."""
        if not (rate_tokens_per_ms >= 0 and math.isfinite(rate_tokens_per_ms)):
            raise ValueError(
                f"fluid reference: rate must be a finite number >= 0 (got {rate_tokens_per_ms!r})"
            )
        self.rate_tokens_per_ms = rate_tokens_per_ms

    def arrive(self, request: FluidRequest) -> None:
        """``request`` arrives now (its ``arrival_ms`` is taken as now). One of no size, or that
        leaves before it arrives, adds nothing."""
        if not request.size_tokens > 0 or not request.leave_ms > self.now_ms:
            return
        state = self._tenants[request.tenant]
        if request.start_ms < _NEVER and (
            self.counted_from_ms <= request.arrival_ms <= self.counted_to_ms
        ):
            state.received_tokens += request.size_tokens
        if state.busy:
            state.queue.append(request)
            return
        state.busy = True
        self.busy_tenants += 1
        self.weight_sum += state.weight
        state.busy_position = len(self._busy)
        self._busy.append(state)
        self._start_head(request.tenant, state, request, False)
        if not self._heaped and len(self._busy) > _SCAN_MAX:
            finishes = self._finishes
            finishes.clear()
            finishes.extend((t.finish_v, t.index) for t in self._busy)
            heapq.heapify(finishes)
            self._heaped = True

    def advance(self, to_ms: float) -> None:
        """Run the fluid server until ``to_ms`` (no earlier than the current time)."""
        while self.now_ms < to_ms:
            now_ms = self.now_ms
            rate = self.rate_tokens_per_ms
            if self.busy_tenants == 0:
                self.unused_tokens += rate * (to_ms - now_ms)
                self.now_ms = to_ms
                return
            deadline_ms = self._next_deadline_ms() if self._deadlines else _NEVER
            finish_ms = _NEVER
            finish_v = 0.0
            if rate > 0:
                finish_v = self._next_finish_v()
                ahead = finish_v - self.virtual
                finish_ms = now_ms + (ahead if ahead > 0 else 0.0) * self.weight_sum / rate
            if finish_ms > to_ms and deadline_ms > to_ms:
                self.virtual += rate * (to_ms - now_ms) / self.weight_sum
                self.now_ms = to_ms
                return
            if finish_ms <= deadline_ms:
                self.now_ms = finish_ms
                if finish_v > self.virtual:
                    self.virtual = finish_v
                self._finish_heads()
            else:
                self.virtual += rate * (deadline_ms - now_ms) / self.weight_sum
                self.now_ms = deadline_ms
                self._leave_heads()

    def service_tokens(self, tenant: int) -> float:
        """Fluid service ``tenant`` has received up to now."""
        state = self._tenants[tenant]
        return state.done_tokens + (self._head_served(state) if state.busy else 0.0)

    def counted_tokens(self, tenant: int) -> float:
        """The part of :meth:`service_tokens` that went to counted requests."""
        state = self._tenants[tenant]
        head = self._head_served(state) if state.busy and state.head_counted else 0.0
        return state.counted_tokens + head

    def received_tokens(self, tenant: int) -> float:
        """Sizes of ``tenant``'s counted requests that the lane served, arrived so far."""
        return self._tenants[tenant].received_tokens

    def backlog_tokens(self, tenant: int) -> float:
        """Fluid demand of ``tenant`` still waiting (its head's rest and the queue behind it)."""
        state = self._tenants[tenant]
        head = state.head
        if not state.busy or head is None:
            return 0.0
        rest = head.size_tokens - self._head_served(state)
        return rest + math.fsum(r.size_tokens for r in state.queue[state.queue_next :])

    # -- internals ---------------------------------------------------------------------------

    def _head_served(self, state: _FluidTenant) -> float:
        head = state.head
        size = 0.0 if head is None else head.size_tokens
        unserved = state.weight * (state.finish_v - self.virtual)
        if unserved <= 0:
            return size
        served = size - unserved
        return served if served > 0 else 0.0

    def _start_head(
        self, tenant: int, state: _FluidTenant, request: FluidRequest, replace_top: bool
    ) -> None:
        """``request`` becomes the head; its finish tag goes into the heap, in place of the top
        when ``replace_top`` (the tenant's previous head's, just served: one sift, not two)."""
        state.head = request
        arrival_ms = request.arrival_ms
        state.head_counted = self.counted_from_ms <= arrival_ms <= self.counted_to_ms
        finish_v = self.virtual + request.size_tokens / state.weight
        state.finish_v = finish_v
        if replace_top:
            self._heapreplace(self._finishes, (finish_v, tenant))
        elif self._heaped:
            self._heappush(self._finishes, (finish_v, tenant))
        leave_ms = request.leave_ms
        if leave_ms < _NEVER:
            self._heappush(self._deadlines, (leave_ms, tenant))

    def _next_head(self, tenant: int, state: _FluidTenant, finished_top: bool) -> None:
        """The head has left: the next request that has not left yet becomes head, or the
        tenant stops being backlogged. ``finished_top``: the head was served in full and its
        entry is the top of the finish heap (replaced or popped here)."""
        now_ms = self.now_ms
        queue = state.queue
        position = state.queue_next
        while position < len(queue):
            request = queue[position]
            position += 1
            if request.leave_ms > now_ms:
                if position > 64 and position * 2 > len(queue):
                    del queue[:position]  # amortised O(1): at most once per queue's length
                    position = 0
                state.queue_next = position
                self._start_head(tenant, state, request, finished_top)
                return
        if finished_top:
            self._heappop(self._finishes)
        queue.clear()
        state.queue_next = 0
        state.head = None
        state.busy = False
        self.busy_tenants -= 1
        busy = self._busy
        last = busy.pop()
        if last is not state:  # fill its place with the last one
            busy[state.busy_position] = last
            last.busy_position = state.busy_position
        if self.busy_tenants == 0:
            # No tag is outstanding: restart the virtual time (it never grows with the run)
            # and the weight sum (no rounding carried over from the last busy period).
            self.weight_sum = 0.0
            self.virtual = 0.0
            self._finishes.clear()
            self._deadlines.clear()
            self._heaped = False
        else:
            if self._heaped and len(busy) <= _SCAN_MIN:
                self._finishes.clear()
                self._heaped = False
            self.weight_sum -= state.weight
            if not self.weight_sum > 0:  # rounding, with weights of very different sizes
                self.weight_sum = math.fsum(t.weight for t in self._tenants if t.busy)

    def _next_finish_v(self) -> float:
        if not self._heaped:
            soonest = _NEVER
            for state in self._busy:
                if state.finish_v < soonest:
                    soonest = state.finish_v
            return soonest
        finishes = self._finishes
        tenants = self._tenants
        while finishes:
            finish_v, tenant = finishes[0]
            state = tenants[tenant]
            if state.busy and state.finish_v == finish_v:
                return finish_v
            self._heappop(finishes)
        return _NEVER

    def _next_deadline_ms(self) -> float:
        deadlines = self._deadlines
        tenants = self._tenants
        while deadlines:
            leave_ms, tenant = deadlines[0]
            head = tenants[tenant].head
            if head is not None and head.leave_ms == leave_ms:
                return leave_ms
            self._heappop(deadlines)
        return _NEVER

    def _finish_heads(self) -> None:
        """Every head whose finish tag the virtual time has reached is served in full (a head
        left for later by a switch from the heap to a scan is served at the next event, no
        time later)."""
        if not self._heaped:
            virtual = self.virtual
            for state in [t for t in self._busy if t.finish_v <= virtual]:
                head = state.head
                if head is None:
                    continue
                state.done_tokens += head.size_tokens
                if state.head_counted:
                    state.counted_tokens += head.size_tokens
                self._next_head(state.index, state, False)
            return
        finishes = self._finishes
        tenants = self._tenants
        while finishes and finishes[0][0] <= self.virtual:
            finish_v, tenant = finishes[0]
            state = tenants[tenant]
            head = state.head
            if head is None or state.finish_v != finish_v:
                self._heappop(finishes)
                continue
            state.done_tokens += head.size_tokens
            if state.head_counted:
                state.counted_tokens += head.size_tokens
            self._next_head(tenant, state, True)

    def _leave_heads(self) -> None:
        """Every head whose leave time has come leaves with what it has been served."""
        deadlines = self._deadlines
        tenants = self._tenants
        while deadlines and deadlines[0][0] <= self.now_ms:
            leave_ms, tenant = self._heappop(deadlines)
            state = tenants[tenant]
            head = state.head
            if head is None or head.leave_ms != leave_ms:
                continue
            served = self._head_served(state)
            state.done_tokens += served
            if state.head_counted:
                state.counted_tokens += served
            self._next_head(tenant, state, False)


@dataclass(frozen=True, slots=True)
class FluidResult:
    """What :func:`fluid_reference` found, per tenant index."""

    reference_tokens: list[float]
    """Fluid service of each tenant's counted requests (arrived in ``[counted_from_ms,
    counted_to_ms]``)."""
    received_tokens: list[float]
    """Sizes of each tenant's counted requests that the lane served."""
    total_reference_tokens: list[float]
    """Fluid service of each tenant over the whole run (every arrival)."""
    unused_tokens: float
    """Capacity offered while no tenant was backlogged (0 for a lane's own records)."""


def _arrival_of(request: FluidRequest) -> float:
    return request.arrival_ms


def _start_of(request: FluidRequest) -> float:
    return request.start_ms


class _EndOf:
    """The end of a request's service segment at ``rate_tokens_per_ms``: a sort key."""

    def __init__(self, rate_tokens_per_ms: float) -> None:
        self.rate_tokens_per_ms = rate_tokens_per_ms

    def __call__(self, request: FluidRequest) -> float:
        return request.start_ms + request.size_tokens / self.rate_tokens_per_ms


def _in_order(requests: list[FluidRequest], rate_tokens_per_ms: float) -> tuple[bool, bool]:
    """Whether ``requests`` are in order of start, and of end (a serial server's are both)."""
    by_start = by_end = True
    last_start = last_end = -_NEVER
    for request in requests:
        start_ms = request.start_ms
        end_ms = start_ms + request.size_tokens / rate_tokens_per_ms
        if start_ms < last_start:
            by_start = False
        if end_ms < last_end:
            by_end = False
        last_start, last_end = start_ms, end_ms
    return by_start, by_end


def fluid_reference(
    requests: list[FluidRequest],
    weights: Sequence[float],
    rate_tokens_per_ms: float,
    counted_from_ms: float = -_NEVER,
    counted_to_ms: float = _NEVER,
) -> FluidResult:
    """The fluid GPS service of each tenant of one lane over a whole run (module docstring).

    ``requests`` may come in any order (the list is sorted in place by arrival, stably). The
    capacity is one segment per served request: ``rate_tokens_per_ms`` (finite, > 0) from its
    ``start_ms`` for ``size_tokens / rate_tokens_per_ms`` ms. The fluid server runs until the
    last segment ends; a request still backlogged then keeps what it was served.
    ``weights[t]`` is tenant ``t``'s weight. O(n log n) for the sorts (near-linear on the
    nearly sorted order a replay gives), then O((requests + segments) log tenants).
    """
    if not (math.isfinite(rate_tokens_per_ms) and rate_tokens_per_ms > 0):
        raise ValueError(
            f"fluid reference: rate must be a finite number > 0 (got {rate_tokens_per_ms!r})"
        )
    # The segments, in order of start and of end: the served requests as they came (a
    # replay's come in order of both), sorted only if they are not.
    by_start = [r for r in requests if r.start_ms < _NEVER and r.size_tokens > 0]
    started_in_order, ended_in_order = _in_order(by_start, rate_tokens_per_ms)
    by_end = by_start if ended_in_order else sorted(by_start, key=_EndOf(rate_tokens_per_ms))
    if not started_in_order:
        by_start.sort(key=_start_of)
    requests.sort()
    count = len(requests)
    segment_count = len(by_start)
    arrival_at = requests[0].arrival_ms if count else _NEVER
    start_at = by_start[0].start_ms if segment_count else _NEVER
    end_at = _NEVER
    if segment_count:
        end_at = by_end[0].start_ms + by_end[0].size_tokens / rate_tokens_per_ms
    first_ms = min(arrival_at, start_at)
    lane = FluidLane(
        weights, first_ms if first_ms < _NEVER else 0.0, counted_from_ms, counted_to_ms
    )
    next_arrival = next_start = next_end = 0
    running = 0
    # Merge the three sorted streams. At one instant, capacity changes come before arrivals:
    # no time passes between them, so the order changes nothing but the work done.
    while next_end < segment_count or next_arrival < count:
        if end_at <= start_at and end_at <= arrival_at:
            lane.advance(end_at)
            running -= 1
            lane.rate_tokens_per_ms = running * rate_tokens_per_ms if running > 0 else 0.0
            next_end += 1
            if next_end < segment_count:
                ending = by_end[next_end]
                end_at = ending.start_ms + ending.size_tokens / rate_tokens_per_ms
            else:
                end_at = _NEVER
        elif start_at <= arrival_at:
            lane.advance(start_at)
            running += 1
            lane.rate_tokens_per_ms = running * rate_tokens_per_ms
            next_start += 1
            start_at = by_start[next_start].start_ms if next_start < segment_count else _NEVER
        else:
            lane.advance(arrival_at)
            lane.arrive(requests[next_arrival])
            next_arrival += 1
            arrival_at = requests[next_arrival].arrival_ms if next_arrival < count else _NEVER
    return FluidResult(
        reference_tokens=[lane.counted_tokens(t) for t in range(lane.tenant_count)],
        received_tokens=[lane.received_tokens(t) for t in range(lane.tenant_count)],
        total_reference_tokens=[lane.service_tokens(t) for t in range(lane.tenant_count)],
        unused_tokens=lane.unused_tokens,
    )
