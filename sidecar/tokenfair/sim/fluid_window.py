"""The fluid fair-share reference over a sliding window, kept up as decisions come: a live
fairness signal per lane, in bounded memory and with a bounded number of tenants reported.

The same fluid server as the report's (:mod:`tokenfair.sim.fluid`: weighted max-min sharing
of what the lane actually served, the same demand rules as ``fairness.FairnessTally``), run
forward as decisions arrive instead of once over a finished run. Over the window, each tenant's
service *delivered* in it — the lane's (its served requests' segments, at
``serviceTokensPerMs`` from their dispatch) and the fluid server's — and per lane Jain's index
over ``received / reference`` of the tenants with a reference in the window, the lowest such
ratio, and the ``top_tenants`` tenants by service received with everyone else summed into
``other`` (what a metric may label; Jain and the worst ratio are over every tenant).

**Feeding it.** :meth:`FluidWindow.observe` takes each final decision (what the sidecar records)
with its size (actual service tokens where known, as the report's); :meth:`FluidWindow.advance`
moves its clock. A decision is final only after its request has waited and run, so the fluid
server runs ``settle_ms`` behind the clock (default: the longest wait limit plus 10 s of
running): by then every request that arrived earlier has been observed, in the common case.
One observed later than that (a long stream) joins the fluid server late: its arrival and the
start of its service are taken as the fluid server's present (``late_requests`` counts them).
Over a finished run, ``advance(math.inf)`` settles everything: the totals are then the report's
(``tests/sidecar/sim/test_fluid_window.py`` checks it on the same decisions).

**The window.** Every ``window_ms / buckets`` of fluid time each tenant's running totals are
saved; the window is from the oldest saving not older than ``window_ms`` to the fluid server's
present, so between ``window_ms - window_ms / buckets`` and ``window_ms`` long (default 5 min,
10 buckets).

**Bounds.** Memory: the decisions not yet settled (at most ``max_pending``: past it, the fluid
server is moved up to the oldest of them, as if ``settle_ms`` had passed), the fluid backlog
(demand still waiting: at most what arrived within a wait limit or is queued or running), and
``buckets + 1`` savings of two numbers per tenant of the config (tenants it does not know are
counted together under ``other``, weight 1: at most ``top_tenants`` names leave this module).
Work: O(log tenants) per decision and event, O(tenants) per saving.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from tokenfair.config import PRIORITY_CLASSES, Config
from tokenfair.core import Decision
from tokenfair.core.jobs import STATUS_CLIENT_CLOSED, STATUS_OK
from tokenfair.sim.fairness import jain_index
from tokenfair.sim.fluid import FluidLane, FluidRequest

OTHER: Final = "other"
"""The name every tenant not among the top ones is summed under (and every unknown tenant);
``other~`` (``~`` added until no tenant has it) if a tenant of the config is named ``other``,
so a metric never carries two series of one name (:func:`rest_name`)."""


def rest_name(tenant_ids: set[str]) -> str:
    """:data:`OTHER`, with ``~`` added while a tenant of ``tenant_ids`` has that name."""
    name = OTHER
    while name in tenant_ids:
        name += "~"
    return name


DEFAULT_WINDOW_MS: Final = 300_000.0
DEFAULT_BUCKETS: Final = 10
DEFAULT_TOP_TENANTS: Final = 10
DEFAULT_RUNNING_MS: Final = 10_000.0
"""Added to the longest wait limit for the default ``settle_ms``: how long a request may run
before its decision is final, in the common case."""
DEFAULT_MAX_PENDING: Final = 100_000

_NEVER: Final = math.inf
_Event = tuple[float, int, int, str, FluidRequest]
_ARRIVAL: Final = 0
_START: Final = 1
_END: Final = 2


@dataclass(frozen=True, slots=True)
class TenantWindow:
    """One tenant (or ``other``) over the window, in service tokens."""

    tenant_id: str
    received_tokens: float
    reference_tokens: float

    @property
    def served_over_fluid(self) -> float | None:
        return self.received_tokens / self.reference_tokens if self.reference_tokens else None


@dataclass(frozen=True, slots=True)
class LaneWindow:
    """One lane over the window."""

    jain: float | None
    """Over ``received / reference`` of every tenant with a reference in the window."""
    worst: TenantWindow | None
    """The tenant with the lowest ratio."""
    tenants: list[TenantWindow]
    """The ``top_tenants`` by service received, then ``other`` (the rest summed) if any."""


@dataclass(frozen=True, slots=True)
class WindowFairness:
    start_ms: float
    end_ms: float
    """The window: from a saving to the fluid server's present (``now - settle_ms``)."""
    lanes: dict[str, LaneWindow]
    late_requests: int
    """Decisions observed after the fluid server had passed their arrival (see above)."""


class _Lane:
    """One lane's fluid server, and each tenant's service delivered so far (the lane's own
    integrated along its segments, the fluid's read from the server)."""

    __slots__ = ("fluid", "received", "running", "running_by_tenant", "touched")

    def __init__(self, weights: list[float]) -> None:
        self.fluid = FluidLane(weights)
        self.received = [0.0] * len(weights)
        """Service the lane delivered to each tenant up to ``touched``."""
        self.running_by_tenant: dict[int, int] = {}
        """Segments running now, by tenant."""
        self.running = 0
        self.touched = -_NEVER

    def move_to(self, at_ms: float, rate_tokens_per_ms: float) -> None:
        """Advance the fluid server and the lane's own deliveries to ``at_ms``."""
        if at_ms <= self.touched:
            return
        if self.touched > -_NEVER:
            elapsed = at_ms - self.touched
            for tenant, segments in self.running_by_tenant.items():
                self.received[tenant] += segments * rate_tokens_per_ms * elapsed
        self.touched = at_ms
        if at_ms > self.fluid.now_ms:
            self.fluid.advance(at_ms)


class FluidWindow:
    """The live fluid-reference fairness of every lane (module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        window_ms: float = DEFAULT_WINDOW_MS,
        buckets: int = DEFAULT_BUCKETS,
        top_tenants: int = DEFAULT_TOP_TENANTS,
        settle_ms: float | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        policy = config.policy
        if not (math.isfinite(window_ms) and window_ms > 0):
            raise ValueError(f"window_ms must be a finite number > 0 (got {window_ms!r})")
        if buckets < 1:
            raise ValueError(f"buckets must be an integer >= 1 (got {buckets!r})")
        if top_tenants < 0:
            raise ValueError(f"top_tenants must be an integer >= 0 (got {top_tenants!r})")
        if max_pending < 1:
            raise ValueError(f"max_pending must be an integer >= 1 (got {max_pending!r})")
        if settle_ms is None:
            settle_ms = (
                max(policy.max_interactive_wait_ms, policy.max_batch_wait_ms) + DEFAULT_RUNNING_MS
            )
        if not (settle_ms >= 0 and math.isfinite(settle_ms)):
            raise ValueError(f"settle_ms must be a finite number >= 0 (got {settle_ms!r})")
        self.window_ms = float(window_ms)
        self.bucket_ms = self.window_ms / buckets
        self.buckets = buckets
        self.top_tenants = top_tenants
        self.settle_ms = float(settle_ms)
        self.max_pending = max_pending
        self._rate = policy.service_tokens_per_ms
        self._wait_ms = {
            "interactive": policy.max_interactive_wait_ms,
            "batch": policy.max_batch_wait_ms,
        }
        # Each lane's tenants: those of the config in that lane, then `other` (unknown ones).
        self._names: dict[str, list[str]] = {}
        self._index: dict[str, dict[str, int]] = {}
        self._lanes: dict[str, _Lane] = {}
        rest = rest_name({t.tenant_id for t in config.tenants})
        for lane in PRIORITY_CLASSES:
            members = [t for t in config.tenants if t.priority_class == lane]
            self._names[lane] = [t.tenant_id for t in members] + [rest]
            self._index[lane] = {t.tenant_id: i for i, t in enumerate(members)}
            self._lanes[lane] = _Lane([t.weight for t in members] + [1.0])
        self._pending: list[_Event] = []
        """(time, kind, sequence, lane, request): arrivals, segment starts and ends to come."""
        self._sequence = 0
        self._present_ms = -_NEVER
        self.late_requests = 0
        self._savings: list[tuple[float, dict[str, tuple[list[float], list[float]]]]] = []
        self._next_saving_ms = -_NEVER
        self._push: Callable[[list[_Event], _Event], None] = heapq.heappush

    # -- input ---------------------------------------------------------------------------------

    def observe(self, decision: Decision, size: int) -> None:
        """A final decision of ``size`` service tokens (the report's rules for its demand)."""
        lane = decision.priority_class
        index = self._index[lane]
        tenant = index.get(decision.tenant_id, len(index))  # unknown: `other`
        arrival_ms = decision.arrival_ms
        if arrival_ms < self._present_ms:
            self.late_requests += 1
            arrival_ms = self._present_ms
        status = decision.status_code
        start_ms = _NEVER
        leave_ms = _NEVER
        if status == STATUS_OK and decision.gate == "dispatch":
            if decision.dispatch_ms is not None:
                start_ms = max(decision.dispatch_ms, arrival_ms)
        elif status == STATUS_CLIENT_CLOSED:
            leave_ms = arrival_ms + decision.queue_wait_ms
        else:
            leave_ms = arrival_ms + self._wait_ms[lane]
        request = FluidRequest(arrival_ms, tenant, float(size), leave_ms, start_ms)
        self._add(arrival_ms, _ARRIVAL, lane, request)
        if start_ms < _NEVER and size > 0:
            self._add(start_ms, _START, lane, request)
            self._add(start_ms + size / self._rate, _END, lane, request)
        if len(self._pending) > self.max_pending:
            self._settle(self._pending[0][0])

    def advance(self, now_ms: float) -> None:
        """The clock is at ``now_ms``: the fluid server moves to ``now_ms - settle_ms``."""
        self._settle(now_ms - self.settle_ms)

    # -- output --------------------------------------------------------------------------------

    @property
    def pending_events(self) -> int:
        """Arrivals and segment starts and ends observed but not settled yet."""
        return len(self._pending)

    def snapshot(self) -> WindowFairness:
        """The window as of the fluid server's present."""
        present = self._present_ms
        oldest = present - self.window_ms
        base_ms, base = present, None
        for saved_ms, totals in self._savings:
            if saved_ms >= oldest - 1e-9 * abs(oldest):
                base_ms, base = saved_ms, totals
                break
        lanes: dict[str, LaneWindow] = {}
        for lane, state in self._lanes.items():
            received, reference = self._totals(state)
            if base is not None:
                received_then, reference_then = base[lane]
                received = [a - b for a, b in zip(received, received_then, strict=True)]
                reference = [a - b for a, b in zip(reference, reference_then, strict=True)]
            elif base_ms == present:
                received = [0.0] * len(received)
                reference = [0.0] * len(reference)
            lanes[lane] = self._lane_window(self._names[lane], received, reference)
        return WindowFairness(base_ms, present, lanes, self.late_requests)

    # -- internals -----------------------------------------------------------------------------

    def _add(self, at_ms: float, kind: int, lane: str, request: FluidRequest) -> None:
        self._sequence += 1
        self._push(self._pending, (at_ms, kind, self._sequence, lane, request))

    def _settle(self, until_ms: float) -> None:
        """Run every lane up to ``until_ms``, applying the events due by then in time order
        (at one instant: arrivals, then segment starts, then ends; no time passes between)."""
        if until_ms <= self._present_ms:
            return
        pending = self._pending
        rate = self._rate
        while pending and pending[0][0] <= until_ms:
            at_ms, kind, _, lane_name, request = heapq.heappop(pending)
            self._save_until(at_ms)
            lane = self._lanes[lane_name]
            lane.move_to(at_ms, rate)
            self._present_ms = max(self._present_ms, at_ms)
            if kind == _ARRIVAL:
                lane.fluid.arrive(request)
                continue
            step = 1 if kind == _START else -1
            tenant = request.tenant
            count = lane.running_by_tenant.get(tenant, 0) + step
            if count:
                lane.running_by_tenant[tenant] = count
            else:
                del lane.running_by_tenant[tenant]
            lane.running += step
            lane.fluid.rate_tokens_per_ms = lane.running * rate if lane.running > 0 else 0.0
        self._save_until(until_ms)
        if until_ms < _NEVER:
            for lane in self._lanes.values():
                lane.move_to(until_ms, rate)
            self._present_ms = until_ms

    def _save_until(self, at_ms: float) -> None:
        """Save every tenant's totals at each bucket boundary up to ``at_ms`` (the lanes moved
        to the boundary first), dropping savings older than the window needs."""
        if self._next_saving_ms == -_NEVER:
            if at_ms == _NEVER:
                return
            self._next_saving_ms = math.floor(at_ms / self.bucket_ms) * self.bucket_ms
        while self._next_saving_ms <= at_ms and self._next_saving_ms < _NEVER:
            boundary = self._next_saving_ms
            totals = {}
            for lane_name, lane in self._lanes.items():
                lane.move_to(boundary, self._rate)
                totals[lane_name] = self._totals(lane)
            self._savings.append((boundary, totals))
            if len(self._savings) > self.buckets + 1:
                del self._savings[0]
            self._next_saving_ms = boundary + self.bucket_ms
            if at_ms == _NEVER:
                break

    def _totals(self, lane: _Lane) -> tuple[list[float], list[float]]:
        count = lane.fluid.tenant_count
        return list(lane.received), [lane.fluid.service_tokens(t) for t in range(count)]

    def _lane_window(
        self, names: list[str], received: list[float], reference: list[float]
    ) -> LaneWindow:
        """The lane's figures; O(tenants) with a rows object only for the ones shown (a refresh
        at 10,000 tenants builds a dozen, not 10,000)."""
        ratios: list[float] = []
        worst_index = -1
        worst_ratio = _NEVER
        last = len(names) - 1  # `other`
        active: list[int] = []
        for index in range(len(names)):
            got, due = received[index], reference[index]
            if due > 0:
                ratio = got / due
                ratios.append(ratio)
                if ratio < worst_ratio:  # the first of equal ones, as `min` takes it
                    worst_index, worst_ratio = index, ratio
            if index < last and (got > 0 or due > 0):
                active.append(index)
        worst = None
        if worst_index >= 0:
            worst = TenantWindow(names[worst_index], received[worst_index], reference[worst_index])
        top = heapq.nsmallest(self.top_tenants, active, key=lambda i: (-received[i], names[i]))
        shown = set(top)
        rest = [i for i in active if i not in shown]
        rest.append(last)
        other = TenantWindow(
            names[last], math.fsum(received[i] for i in rest), math.fsum(reference[i] for i in rest)
        )
        rows = [TenantWindow(names[i], received[i], reference[i]) for i in top]
        if other.received_tokens or other.reference_tokens:
            rows.append(other)
        return LaneWindow(jain_index(ratios), worst, rows)
