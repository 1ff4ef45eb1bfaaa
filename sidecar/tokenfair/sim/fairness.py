"""Fairness of a run, per tenant: the service it got against a fluid fair-share reference and
against its windowed weighted max-min share.

Pure functions over decision records (``core/jobs.py``'s :class:`Decision`); no I/O. Used by
``tokenfair simulate`` (under each policy's block, and ``fairness`` in its JSON report) and
``tokenfair report`` (over a records file). Definitions (docs/report.md):

**Size.** A request's size ``s`` is its *actual* service tokens when known —
``Decision.actual_service_tokens`` (what it was settled against), else the caller's
``actual_service_tokens[request_id]`` (the simulator passes the trace's usage there, which also
sizes the requests it refused) — and its estimate ``Decision.service_tokens`` otherwise.

**Window** ``[start_ms, end_ms]`` (both ends included). Default: ``[min arrival_ms, max
arrival_ms]`` over the decisions. When that has zero length (every request arrived at once), the
end is the end of the last dispatch, ``max(dispatch_ms + s / serviceTokensPerMs)``, or
``start_ms + 1`` if nothing ran later than ``start_ms``; with no decisions at all it is ``[0, 1]``.

**Offered and served**, per tenant, over the requests that *arrived* in the window::

    offered_service_tokens = Σ s                     (every request that arrived)
    served_service_tokens  = Σ s                     (those dispatched: status 200, gate dispatch)
    demand_served          = served / offered        (None when offered = 0)

Every per-tenant count (requests, refusals, expiries) is over the same arrivals.

**Fluid reference**, per lane (the lane of each decision; weights as below): what a weighted
max-min fluid server (``sim/fluid.py``) would have given each tenant's requests that arrived in
the window, run over every decision, with the lane's own service as its capacity (a segment of
``s / serviceTokensPerMs`` ms from each served request's ``dispatch_ms``). A request's ``s``
is demand from its arrival: a served one (status 200 at gate ``dispatch``) until the fluid
server has served it, a cancelled one (499) until ``arrival + queue_wait_ms``, any other until
``arrival + its class's wait limit`` (``maxInteractiveWaitMs``, ``maxBatchWaitMs``)::

    served_over_fluid = served / fluid reference     (None when the reference is 0; the
                                                      reference summed over lanes)

Per lane, Jain's index over ``received / reference`` of the lane's tenants with a reference > 0
(their served tokens in that lane), and the tenant with the lowest such ratio.

**Windowed share**, per lane (``priority_class``; a tenant's lane and weight come from the config,
a tenant absent from it has weight 1 and the lane of its last decision)::

    fair_share = water_fill(capacity = Σ served of the lane,
                            demands  = offered per tenant, weights = tenant weight)
    served_over_fair = served / fair_share           (None when fair_share = 0)

i.e. what weighted max-min fairness would have given each tenant of the lane out of what the
lane actually got. ``served_over_fair`` is 1.0 for a tenant that got exactly its share, below 1
for one that got less.

**Jain's index** per lane over ``served_over_fair`` of the lane's tenants with ``offered > 0``
(and a fair share, i.e. when the lane served anything): ``(Σx)² / (n · Σx²)``, 1.0 when every
tenant got the same fraction of its share, ``1/n`` when one tenant got everything. Which
reference answers which question: docs/report.md.

**Utilisation** over the window, by *dispatch* time, in actual tokens::

    utilisation = Σ s over requests with start_ms <= dispatch_ms <= end_ms
                  / (serviceTokensPerMs * (end_ms - start_ms))

(every dispatched request, whatever its outcome after dispatch). A request counts in full at
its dispatch, so the ratio can pass 1.0 when the last ones run past the window's end, or when
the server is faster than ``serviceTokensPerMs`` says.

**Admitted then expired.** A request is *admitted* when it was not refused at gate
``admission``; it *expired* when, admitted, it was refused later: from the queue (gate
``queue``, status 429: ``shed_queue_timeout``) or at dispatch (gate ``dispatch``, status
neither 200 nor 499: a dispatch-time KV refusal, or a live sidecar's upstream error).
Cancelled requests (499) are not expired, nor are those a draining sidecar answered 503 from
the queue; they stay in ``refused_by_reason`` (``cancelled``, ``draining``).
``admitted_then_expired_ratio = expired / admitted`` over all tenants.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Final

from tokenfair.config import PRIORITY_CLASSES, Config
from tokenfair.core import Decision
from tokenfair.core.jobs import ADMITTED, STATUS_CLIENT_CLOSED, STATUS_OK, STATUS_SHED
from tokenfair.records.reading import TraceReading
from tokenfair.sim.fluid import FluidRequest, fluid_reference

DEFAULT_WEIGHT: Final = 1.0
"""Weight of a tenant the config does not know (e.g. ``tokenfair report`` without --tenants)."""
_NEVER: Final = math.inf
EMPTY_WINDOW_MS: Final = 1.0
"""Length of the window when the decisions give none (every request arrived and ran at once)."""


def water_fill(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min fair allocation of ``capacity`` among ``demands`` (progressive filling).

    Every tenant gets ``min(demand_i, level * weight_i)``, with the water level chosen so the
    allocations sum to ``min(capacity, Σ demand)``. Tenants are filled in order of
    ``demand_i / weight_i``: while the smallest of those is at most ``remaining capacity /
    remaining weight`` that tenant is satisfied and leaves; the rest share what is left in
    proportion to their weights. O(n log n).

    ``weights`` must hold a weight > 0 for every key of ``demands``; demands and capacity must be
    finite and >= 0. Anything else raises ``ValueError`` naming the tenant.
    """
    if not (math.isfinite(capacity) and capacity >= 0):
        raise ValueError(f"water_fill: capacity must be a finite number >= 0 (got {capacity!r})")
    for tenant_id, demand in demands.items():
        if not (math.isfinite(demand) and demand >= 0):
            raise ValueError(
                f"water_fill: demand of {tenant_id!r} must be a finite number >= 0 (got {demand!r})"
            )
        if tenant_id not in weights:
            raise ValueError(f"water_fill: no weight for {tenant_id!r}")
        weight = weights[tenant_id]
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"water_fill: weight of {tenant_id!r} must be a finite number > 0 (got {weight!r})"
            )
    order = sorted(demands, key=lambda t: demands[t] / weights[t])
    # rest_weight[i]: the weight of order[i:], summed from the end (O(n)) rather than by
    # subtracting from the total, so it never drifts to 0 or below for the last tenant.
    rest_weight = list(accumulate(weights[t] for t in reversed(order)))[::-1]
    allocation = dict.fromkeys(demands, 0.0)
    remaining_capacity = float(capacity)
    for index, tenant_id in enumerate(order):
        demand, weight = demands[tenant_id], weights[tenant_id]
        level = remaining_capacity / rest_weight[index]
        if demand <= level * weight:
            allocation[tenant_id] = float(demand)
            remaining_capacity = max(0.0, remaining_capacity - demand)
            continue
        # Every tenant left wants more than its weighted share of what is left (they are in
        # order of demand / weight): the level is final and they split the rest by weight.
        for other in order[index:]:
            allocation[other] = level * weights[other]
        break
    return allocation


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index ``(Σx)² / (n · Σx²)``: 1.0 when all are equal, ``1/n`` at worst.

    None for no values; 1.0 when every value is 0 (all equal). Values must be >= 0.
    """
    if not values:
        return None
    if any(value < 0 for value in values):
        raise ValueError(f"jain_index: values must be >= 0 (got {min(values)!r})")
    squares = math.fsum(value * value for value in values)
    if squares == 0:
        return 1.0
    return math.fsum(values) ** 2 / (len(values) * squares)


@dataclass(frozen=True, slots=True)
class TenantFairness:
    """One tenant over the requests that arrived in the window (sizes in service tokens)."""

    tenant_id: str
    priority_class: str
    weight: float
    offered_requests: int
    offered_service_tokens: int
    admitted_requests: int
    """Passed admission: every request not refused at gate ``admission``."""
    served_requests: int
    served_service_tokens: int
    """Dispatched: status 200 at gate ``dispatch``."""
    fair_share_service_tokens: float
    """Weighted max-min share of what its lane served (``water_fill``)."""
    served_over_fair: float | None
    """``served / fair share``; None when the fair share is 0."""
    demand_served: float | None
    """``served / offered``; None when offered is 0."""
    refused_by_reason: dict[str, int]
    """Requests not served, by reason (``cancelled`` included; ``http_<status>`` for a live
    request dispatched and answered with an error status under reason ``admitted``)."""
    admitted_then_expired: int
    """Admitted, then refused from the queue (429) or at dispatch (not 200, not 499)."""
    fluid_reference_service_tokens: float = 0.0
    """What the fluid GPS server would have given its requests that arrived in the window, out
    of its lane's actual service curve (``sim/fluid.py``)."""
    served_over_fluid: float | None = None
    """``served / fluid reference``; None when the reference is 0."""


@dataclass(frozen=True, slots=True)
class LaneWorst:
    """The tenant of a lane with the lowest ``served / fluid reference``."""

    tenant_id: str
    served_over_fluid: float


@dataclass(frozen=True, slots=True)
class FairnessReport:
    """The fairness of one policy's decisions over one window."""

    tenants: dict[str, TenantFairness]
    """By tenant id: interactive tenants first, then batch, each by id."""
    jain_by_lane: dict[str, float | None]
    """``interactive`` and ``batch``: Jain over ``served_over_fair`` of tenants with offered > 0."""
    utilisation: float
    """Service tokens dispatched in the window / (service_tokens_per_ms * window length)."""
    window_ms: tuple[float, float]
    admitted_requests: int
    admitted_then_expired: int
    admitted_then_expired_ratio: float | None
    """``admitted_then_expired / admitted_requests``; None when nothing was admitted."""
    dispatched_service_tokens: int = 0
    """The numerator of ``utilisation``."""
    service_tokens_per_ms: float = 0.0
    """The rate ``utilisation`` is measured against (the policy's ``serviceTokensPerMs``)."""
    fluid_jain_by_lane: dict[str, float | None] = field(default_factory=dict)
    """``interactive`` and ``batch``: Jain over ``served_over_fluid`` of the lane's tenants with
    a fluid reference > 0; None when there is none."""
    fluid_worst_by_lane: dict[str, LaneWorst | None] = field(default_factory=dict)
    """Per lane, the tenant with the lowest ``served_over_fluid`` (None: no reference)."""
    fluid_unused_by_lane: dict[str, float] = field(default_factory=dict)
    """Per lane, service the fluid server had nobody backlogged for (0 for consistent records;
    see ``sim/fluid.py``)."""


def request_size(decision: Decision, actual_service_tokens: Mapping[str, int]) -> int:
    """The size ``s`` of a request: actual service tokens when known, else the estimate."""
    return decision_size(decision, actual_service_tokens.get(decision.request_id))


def decision_size(decision: Decision, actual_service_tokens: int | None) -> int:
    """:func:`request_size` given the request's recorded usage itself (None: not recorded)."""
    if decision.actual_service_tokens is not None:
        return decision.actual_service_tokens
    return decision.service_tokens if actual_service_tokens is None else actual_service_tokens


def is_served(decision: Decision) -> bool:
    """Dispatched and answered: status 200 at gate ``dispatch`` (not ``would_refuse``: a
    request shadow mode served counts as the refusal enforcement would have made)."""
    return (
        decision.status_code == STATUS_OK
        and decision.gate == "dispatch"
        and not decision.would_refuse
    )


def is_admitted(decision: Decision) -> bool:
    """Passed admission: anything not refused at gate ``admission``."""
    return decision.gate != "admission"


def is_expired(decision: Decision) -> bool:
    """Admitted, then refused from the queue (429) or at dispatch (neither 200 nor 499); in
    shadow mode, a ``would_refuse`` record at gate ``queue`` or ``dispatch`` (served, but what
    enforcement would have refused)."""
    if decision.would_refuse:
        return decision.gate in ("queue", "dispatch")
    if decision.gate == "queue":
        return decision.status_code == STATUS_SHED
    return decision.gate == "dispatch" and decision.status_code not in (
        STATUS_OK,
        STATUS_CLIENT_CLOSED,
    )


def _refusal_key(decision: Decision) -> str:
    # A live sidecar writes the status the client saw; a dispatched request the upstream
    # answered with an error keeps reason "admitted", which would read as a non-refusal.
    if decision.reason == ADMITTED:
        return f"http_{decision.status_code}"
    return decision.reason


def _check_window(window_ms: tuple[float, float]) -> tuple[float, float]:
    start_ms, end_ms = float(window_ms[0]), float(window_ms[1])
    if not (math.isfinite(start_ms) and math.isfinite(end_ms) and end_ms > start_ms):
        raise ValueError(
            f"window: END_MS must be greater than START_MS, both finite (got {start_ms:g}:"
            f"{end_ms:g})"
        )
    return (start_ms, end_ms)


class _LaneFluid:
    """One lane's fluid inputs while the decisions are read: its requests, and each tenant's
    index among them (in the order first seen)."""

    __slots__ = ("index", "requests", "tenant_ids")

    def __init__(self) -> None:
        self.requests: list[FluidRequest] = []
        self.index: dict[str, int] = {}
        self.tenant_ids: list[str] = []


@dataclass(slots=True)
class _Tally:
    """Per-tenant running sums while the decisions are read."""

    priority_class: str
    offered_requests: int = 0
    offered_tokens: int = 0
    admitted_requests: int = 0
    served_requests: int = 0
    served_tokens: int = 0
    expired: int = 0
    refused: dict[str, int] | None = None
    fluid_class: str = ""
    """The lane of ``fluid_lane`` (the lane of the tenant's last decision, so far)."""
    fluid_lane: _LaneFluid | None = None
    fluid_slot: int = 0
    """The tenant's index in ``fluid_lane``."""


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


@dataclass(frozen=True, slots=True)
class _FluidFigures:
    """The fluid reference of every lane, read back per tenant and per lane."""

    reference_by_tenant: dict[str, float]
    jain_by_lane: dict[str, float | None]
    worst_by_lane: dict[str, LaneWorst | None]
    unused_by_lane: dict[str, float]


def fairness_report(
    decisions: Iterable[Decision],
    config: Config,
    *,
    actual_service_tokens: Mapping[str, int] | None = None,
    window_ms: tuple[float, float] | None = None,
) -> FairnessReport:
    """Fairness of one policy's decisions (definitions in the module docstring).

    Tenants: every tenant of ``config`` and every tenant of ``decisions`` (one with no request in
    the window shows zeros). ``window_ms`` must have ``end > start``. For decisions that arrive
    one at a time (a replay too large to hold), feed a :class:`FairnessTally` instead.
    """
    rows = list(decisions)
    actual = actual_service_tokens or {}
    sizes = [request_size(d, actual) for d in rows]
    window: tuple[float, float | None]
    if window_ms is not None:
        window = window_ms
    elif not rows:
        window = (0.0, EMPTY_WINDOW_MS)
    else:
        start_ms = min(d.arrival_ms for d in rows)
        end_ms = max(d.arrival_ms for d in rows)
        window = (start_ms, end_ms) if end_ms > start_ms else (start_ms, None)
    tally = FairnessTally(config, window)
    for decision, size in zip(rows, sizes, strict=True):
        tally.add(decision, size)
    return tally.report()


ArrivalsRead = TraceReading
"""The arrivals of a trace still being read, in ``(arrival_ms, request_id)`` order
(:class:`tokenfair.records.reading.TraceReading`, which :func:`records.stream_validated` updates):
the default window is ``[first_arrival_ms, last_arrival_ms]`` once ``complete``; before,
``last_arrival_ms`` is the latest read, a lower bound of the end. The class itself, not a
protocol: compiled, its fields are read directly at every dispatch past the latest arrival."""


class FairnessTally:
    """:func:`fairness_report` one decision at a time, in constant memory per tenant.

    ``window_ms`` is ``(start, end)``, or ``(start, None)`` for the default window of decisions
    that all arrived at ``start`` (its end is then the end of the last dispatch,
    ``max(dispatch_ms + s / serviceTokensPerMs)``, or ``start + 1``; every dispatch counts then,
    as none is earlier than its arrival nor later than that end). A caller streaming a replay
    knows the default window before it starts: ``[min arrival_ms, max arrival_ms]`` of the trace.

    A caller that validates the trace in the same pass as the replay does not know the end yet:
    it passes the :class:`ArrivalsRead` it updates. Every arrival is then in the window (the
    lines come in order), a dispatch at or before the latest arrival read is too, and one past
    it waits in a list until the trace has been read further or to its end (the replay reads the
    next arrival before it dispatches, so that list stays empty in practice). :meth:`report`
    needs the trace read to its end, and gives what the known window would have given.

    Feed every decision with its size ``s`` (:func:`request_size`), then call :meth:`report`.
    """

    def __init__(
        self, config: Config, window_ms: tuple[float, float | None] | ArrivalsRead
    ) -> None:
        self._config = config
        self._tenant_index = config.tenant_index
        self._rate = config.policy.service_tokens_per_ms
        self._reading: ArrivalsRead | None = None
        self._undecided: list[tuple[float, int]] = []  # (dispatch_ms, size), a reading only
        if isinstance(window_ms, (tuple, list)):  # a window given, not a reading
            start_ms, end_ms = window_ms
            if end_ms is not None:
                start_ms, end_ms = _check_window((start_ms, end_ms))
            elif not math.isfinite(start_ms):
                raise ValueError(f"window: START_MS must be finite (got {start_ms:g})")
            self._start_ms = float(start_ms)
            self._end_ms = math.inf if end_ms is None else end_ms
            self._open_end = end_ms is None
        else:
            # Until the end is known: every arrival counts, and dispatches up to `_end_ms`,
            # the latest arrival read when last asked (`_dispatch_past_end`).
            self._reading = window_ms
            self._start_ms = -math.inf
            self._end_ms = -math.inf
            self._open_end = True  # the end of the last dispatch is kept, as for an open end
        self._arrival_from_ms, self._arrival_to_ms = self._start_ms, self._end_ms
        if self._reading is not None:
            self._arrival_to_ms = math.inf
        self._last_end_ms = self._start_ms  # the latest dispatch end (open-ended window only)
        self._dispatched_tokens = 0
        self._tallies: dict[str, _Tally] = {
            t.tenant_id: _Tally(t.priority_class) for t in config.tenants
        }
        self._fluid: dict[str, _LaneFluid] = {}
        self._interactive_wait_ms = config.policy.max_interactive_wait_ms
        self._batch_wait_ms = config.policy.max_batch_wait_ms

    def _dispatch_past_end(self, dispatch_ms: float, size: int) -> None:
        """A dispatch after ``_end_ms`` while a trace is being read: once it has been read, the
        window is the known one from then on (:meth:`_close_reading`); before, the dispatch
        counts if the latest arrival read is not before it, else it waits aside."""
        reading = self._reading
        assert reading is not None
        if reading.complete:
            self._close_reading()
            if self._start_ms <= dispatch_ms <= self._end_ms:
                self._dispatched_tokens += size
            return
        self._end_ms = reading.last_arrival_ms
        if dispatch_ms <= self._end_ms:
            self._dispatched_tokens += size
        else:
            self._undecided.append((dispatch_ms, size))

    def _close_reading(self) -> None:
        """The trace has been read: the window becomes the known one, as if given at the
        start, and the dispatches kept aside are counted by it."""
        reading = self._reading
        if reading is None:
            return
        if not reading.complete:
            raise ValueError("fairness report: the trace has not been read to its end")
        first_ms, last_ms = reading.first_arrival_ms, reading.last_arrival_ms
        self._reading = None
        self._start_ms = self._arrival_from_ms = first_ms
        if last_ms > first_ms:
            _check_window((first_ms, last_ms))
            self._end_ms = self._arrival_to_ms = last_ms
            self._open_end = False
        else:
            if not math.isfinite(first_ms):
                raise ValueError(f"window: START_MS must be finite (got {first_ms:g})")
            self._end_ms = self._arrival_to_ms = math.inf
            self._last_end_ms = max(self._last_end_ms, first_ms)
        for dispatch_ms, size in self._undecided:
            if dispatch_ms <= self._end_ms:
                self._dispatched_tokens += size
        self._undecided.clear()

    def add(self, decision: Decision, size: int) -> None:
        """Count one decision of size ``size`` service tokens."""
        tenant_id = decision.tenant_id
        tally = self._tallies.get(tenant_id)
        if tally is None:
            tally = self._tallies[tenant_id] = _Tally(decision.priority_class)
        elif tenant_id not in self._tenant_index:
            tally.priority_class = decision.priority_class  # its last decision's lane
        dispatch_ms = decision.dispatch_ms
        if dispatch_ms is not None:
            if self._start_ms <= dispatch_ms <= self._end_ms:
                self._dispatched_tokens += size
            elif self._reading is not None:
                self._dispatch_past_end(dispatch_ms, size)
            if self._open_end:
                self._last_end_ms = max(self._last_end_ms, dispatch_ms + size / self._rate)
        self._add_fluid(decision, size, tally)
        if not self._arrival_from_ms <= decision.arrival_ms <= self._arrival_to_ms:
            return
        tally.offered_requests += 1
        tally.offered_tokens += size
        gate = decision.gate
        if gate != "admission":  # `is_admitted`, inline (every decision comes here)
            tally.admitted_requests += 1
            if (
                gate == "dispatch"
                and decision.status_code == STATUS_OK
                and not decision.would_refuse
            ):  # `is_served`
                tally.served_requests += 1
                tally.served_tokens += size
                return
        if is_expired(decision):
            tally.expired += 1
        if tally.refused is None:
            tally.refused = {}
        key = _refusal_key(decision)
        tally.refused[key] = tally.refused.get(key, 0) + 1

    def _add_fluid(self, decision: Decision, size: int, tally: _Tally) -> None:
        """The decision as fluid demand of its lane (every decision, in the window or not: the
        requests outside it compete too). How long a request's demand stays
        (docs/report.md, *fluid reference*): one the lane served, until the fluid server has
        served it, and its service segment starts at its dispatch; one the client cancelled
        (499), until it left; any other refusal, until its class's wait limit after arrival."""
        priority_class = decision.priority_class
        lane = tally.fluid_lane
        if lane is None or tally.fluid_class != priority_class:
            lane = self._fluid.get(priority_class)
            if lane is None:
                lane = self._fluid[priority_class] = _LaneFluid()
            tenant_id = decision.tenant_id
            slot = lane.index.get(tenant_id)
            if slot is None:
                slot = lane.index[tenant_id] = len(lane.tenant_ids)
                lane.tenant_ids.append(tenant_id)
            tally.fluid_lane, tally.fluid_class, tally.fluid_slot = lane, priority_class, slot
        slot = tally.fluid_slot
        arrival_ms = decision.arrival_ms
        status = decision.status_code
        if status == STATUS_OK and decision.gate == "dispatch" and not decision.would_refuse:
            dispatch_ms = decision.dispatch_ms
            # Served, but with no dispatch recorded (loadgen): demand, and no service to share.
            start_ms = _NEVER if dispatch_ms is None else dispatch_ms
            lane.requests.append(FluidRequest(arrival_ms, slot, size, _NEVER, start_ms))
            return
        if status == STATUS_CLIENT_CLOSED:
            leave_ms = arrival_ms + decision.queue_wait_ms
        elif priority_class == "interactive":
            leave_ms = arrival_ms + self._interactive_wait_ms
        else:
            leave_ms = arrival_ms + self._batch_wait_ms
        lane.requests.append(FluidRequest(arrival_ms, slot, size, leave_ms, _NEVER))

    def _fluid_figures(self, weights: Mapping[str, float]) -> _FluidFigures:
        """Run each lane's fluid server over every decision; the reference of the requests that
        arrived in the window, per tenant (summed over lanes), and per lane Jain's index over
        ``received / reference`` of its tenants with a reference > 0, the worst of them, and
        the capacity the fluid server had nobody for."""
        reference: dict[str, float] = {}
        jain_by_lane: dict[str, float | None] = {}
        worst_by_lane: dict[str, LaneWorst | None] = {}
        unused_by_lane: dict[str, float] = {}
        for lane_name in PRIORITY_CLASSES:
            lane = self._fluid.get(lane_name)
            ratios: list[float] = []
            worst: LaneWorst | None = None
            if lane is not None and lane.requests:
                result = fluid_reference(
                    lane.requests,
                    [weights.get(t, DEFAULT_WEIGHT) for t in lane.tenant_ids],
                    self._rate,
                    self._arrival_from_ms,
                    self._arrival_to_ms,
                )
                unused_by_lane[lane_name] = result.unused_tokens
                for slot, tenant_id in enumerate(lane.tenant_ids):
                    tokens = result.reference_tokens[slot]
                    reference[tenant_id] = reference.get(tenant_id, 0.0) + tokens
                    if tokens > 0:
                        ratio = result.received_tokens[slot] / tokens
                        ratios.append(ratio)
                        if worst is None or ratio < worst.served_over_fluid:
                            worst = LaneWorst(tenant_id, ratio)
            else:
                unused_by_lane[lane_name] = 0.0
            jain_by_lane[lane_name] = jain_index(ratios)
            worst_by_lane[lane_name] = worst
        return _FluidFigures(reference, jain_by_lane, worst_by_lane, unused_by_lane)

    def report(self) -> FairnessReport:
        """The report of the decisions added so far (``ValueError`` while a trace it was given
        as its window is still being read)."""
        self._close_reading()
        config, tallies = self._config, self._tallies
        start_ms, end_ms = self._start_ms, self._end_ms
        if self._open_end:
            last = self._last_end_ms
            end_ms = last if last > start_ms else start_ms + EMPTY_WINDOW_MS
        weights = {
            tenant_id: (
                config.tenant_index[tenant_id].weight
                if tenant_id in config.tenant_index
                else DEFAULT_WEIGHT
            )
            for tenant_id in tallies
        }
        fluid = self._fluid_figures(weights)
        tenants: dict[str, TenantFairness] = {}
        jain_by_lane: dict[str, float | None] = {}
        for lane in PRIORITY_CLASSES:
            members = sorted(t for t, tally in tallies.items() if tally.priority_class == lane)
            shares = water_fill(
                capacity=sum(tallies[t].served_tokens for t in members),
                demands={t: float(tallies[t].offered_tokens) for t in members},
                weights={t: weights[t] for t in members},
            )
            ratios: list[float] = []
            for tenant_id in members:
                tally = tallies[tenant_id]
                over_fair = _ratio(tally.served_tokens, shares[tenant_id])
                if tally.offered_tokens > 0 and over_fair is not None:
                    ratios.append(over_fair)
                tenants[tenant_id] = TenantFairness(
                    tenant_id=tenant_id,
                    priority_class=lane,
                    weight=weights[tenant_id],
                    offered_requests=tally.offered_requests,
                    offered_service_tokens=tally.offered_tokens,
                    admitted_requests=tally.admitted_requests,
                    served_requests=tally.served_requests,
                    served_service_tokens=tally.served_tokens,
                    fair_share_service_tokens=shares[tenant_id],
                    served_over_fair=over_fair,
                    demand_served=_ratio(tally.served_tokens, tally.offered_tokens),
                    refused_by_reason=dict(sorted((tally.refused or {}).items())),
                    admitted_then_expired=tally.expired,
                    fluid_reference_service_tokens=fluid.reference_by_tenant.get(tenant_id, 0.0),
                    served_over_fluid=_ratio(
                        tally.served_tokens, fluid.reference_by_tenant.get(tenant_id, 0.0)
                    ),
                )
            jain_by_lane[lane] = jain_index(ratios)
        admitted = sum(t.admitted_requests for t in tenants.values())
        expired = sum(t.admitted_then_expired for t in tenants.values())
        return FairnessReport(
            tenants=tenants,
            jain_by_lane=jain_by_lane,
            utilisation=self._dispatched_tokens / (self._rate * (end_ms - start_ms)),
            window_ms=(start_ms, end_ms),
            admitted_requests=admitted,
            admitted_then_expired=expired,
            admitted_then_expired_ratio=_ratio(expired, admitted),
            dispatched_service_tokens=self._dispatched_tokens,
            service_tokens_per_ms=self._rate,
            fluid_jain_by_lane=fluid.jain_by_lane,
            fluid_worst_by_lane=fluid.worst_by_lane,
            fluid_unused_by_lane=fluid.unused_by_lane,
        )


def _round(value: float | None, places: int) -> float | None:
    return None if value is None else round(value, places)


def fairness_to_json(report: FairnessReport) -> dict[str, object]:
    """The report as JSON-ready data; ratios rounded to 4 places, service tokens to 2."""
    return {
        "window_ms": list(report.window_ms),
        "service_tokens_per_ms": report.service_tokens_per_ms,
        "dispatched_service_tokens": report.dispatched_service_tokens,
        "utilisation": round(report.utilisation, 4),
        "admitted_requests": report.admitted_requests,
        "admitted_then_expired": report.admitted_then_expired,
        "admitted_then_expired_ratio": _round(report.admitted_then_expired_ratio, 4),
        "fluid_jain_by_lane": {lane: _round(j, 4) for lane, j in report.fluid_jain_by_lane.items()},
        "fluid_worst_by_lane": {
            lane: None
            if worst is None
            else {
                "tenant_id": worst.tenant_id,
                "served_over_fluid": round(worst.served_over_fluid, 4),
            }
            for lane, worst in report.fluid_worst_by_lane.items()
        },
        "fluid_unused_service_tokens_by_lane": {
            lane: round(tokens, 2) for lane, tokens in report.fluid_unused_by_lane.items()
        },
        "jain_by_lane": {lane: _round(j, 4) for lane, j in report.jain_by_lane.items()},
        "tenants": {
            tenant_id: {
                "priority_class": t.priority_class,
                "weight": t.weight,
                "offered_requests": t.offered_requests,
                "offered_service_tokens": t.offered_service_tokens,
                "admitted_requests": t.admitted_requests,
                "served_requests": t.served_requests,
                "served_service_tokens": t.served_service_tokens,
                "fluid_reference_service_tokens": round(t.fluid_reference_service_tokens, 2),
                "served_over_fluid": _round(t.served_over_fluid, 4),
                "fair_share_service_tokens": round(t.fair_share_service_tokens, 2),
                "served_over_fair": _round(t.served_over_fair, 4),
                "demand_served": _round(t.demand_served, 4),
                "refused_by_reason": dict(t.refused_by_reason),
                "admitted_then_expired": t.admitted_then_expired,
            }
            for tenant_id, t in report.tenants.items()
        },
    }


def _optional(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _worst(worst: LaneWorst | None) -> str:
    return "-" if worst is None else f"{worst.tenant_id} {worst.served_over_fluid:.4f}"


def format_fairness(report: FairnessReport) -> str:
    """A fixed-width text table, indented two spaces (it sits under a policy's block)."""
    start_ms, end_ms = report.window_ms
    fluid_jain = ", ".join(
        f"{lane} {_optional(value, '.4f')}" for lane, value in report.fluid_jain_by_lane.items()
    )
    worst = ", ".join(
        f"{lane} {_worst(value)}" for lane, value in report.fluid_worst_by_lane.items()
    )
    jain = ", ".join(
        f"{lane} {_optional(value, '.4f')}" for lane, value in report.jain_by_lane.items()
    )
    expired_ratio = _optional(report.admitted_then_expired_ratio, ".2%")
    lines = [
        f"  fairness over {start_ms:.2f}..{end_ms:.2f} ms: utilisation "
        f"{report.utilisation:.4f}; admitted then expired {report.admitted_then_expired}/"
        f"{report.admitted_requests} ({expired_ratio})",
        f"  Jain vs fluid reference: {fluid_jain}; worst served/fluid: {worst}",
        f"  Jain vs windowed max-min share: {jain}",
        f"  {'tenant':<22}{'lane':<12}{'weight':>7}{'served/offered req':>20}"
        f"{'served tok':>13}{'offered tok':>13}{'fluid ref':>13}{'served/fluid':>13}"
        f"{'fair share':>13}{'served/fair':>13}{'demand':>9}{'expired':>9}  refused",
    ]
    for tenant_id, t in report.tenants.items():
        refused = " ".join(f"{reason}={n}" for reason, n in t.refused_by_reason.items())
        requests = f"{t.served_requests}/{t.offered_requests}"
        lines.append(
            f"  {tenant_id:<22}{t.priority_class:<12}{t.weight:>7g}{requests:>20}"
            f"{t.served_service_tokens:>13}{t.offered_service_tokens:>13}"
            f"{t.fluid_reference_service_tokens:>13.1f}"
            f"{_optional(t.served_over_fluid, '.4f'):>13}"
            f"{t.fair_share_service_tokens:>13.1f}{_optional(t.served_over_fair, '.4f'):>13}"
            f"{_optional(t.demand_served, '.1%'):>9}{t.admitted_then_expired:>9}  "
            f"{refused or '-'}"
        )
    return "\n".join(lines) + "\n"
