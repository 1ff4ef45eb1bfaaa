"""Admission's model of the scheduler: who competes in a lane, and how long a tenant will wait.

Admission judges a request by what *its tenant* will wait under weighted DRR (docs/fairness.md
§5), never by the lane's whole backlog, so a neighbour's flood pushes out the neighbour's own
requests. Everything here is O(1) per request (amortised), whatever the number of tenants.

**Competing tenants.** Tenant ``j`` competes in a lane while it has work queued there, and for
``horizon_ms`` (the lane's wait limit) after its last request was admitted there: a tenant that
sends now and then may be back within the wait of the request being judged. ``W`` is the sum of
the DRR quanta of the competing tenants (``Q_j = base_quantum_tokens * w_j``).

**Predicted wait** of a new request of tenant ``i`` (quantum ``Q_i``, ``q_i`` service tokens of
its own queued ahead of it in its FIFO, ``L`` tokens queued in the whole lane)::

    k       = max(1, ceil((q_i + c - D_i) / Q_i))          quanta i still needs
    ahead_i = q_i + min(C_i + W - Q_i - open_front, L - q_i) + (k - 1) * (B - Q_i)
    T0      = residual_ms + ahead_i / lane_rate
    T       = min(T0 + (k - 1) * (W - B) / lane_rate,  T0 / (1 - λ / lane_rate))
    wait_i  = T / (1 - λ_lift / lane_rate)

* ``k`` — DRR grants ``i`` one quantum per turn and it may start the request once its deficit
  ``D_i`` covers its queue and the request's cost ``c`` (a debt, ``D_i < 0``, adds turns);
* ``min(...)`` — before ``i``'s next turn every other competing tenant gets at most one quantum
  and may spend the credit ``C_i`` it already holds; never more than the lane holds now, since a
  tenant that arrives later joins the ring behind ``i`` (:func:`tokens_ahead`);
* ``(k - 1) * (B - Q_i)`` — one quantum of each other *backlogged* tenant (``B``: their quanta)
  before each later turn of ``i``; a competing tenant that is idle now (``W - B``) takes part
  only if it sends during the wait: at most one quantum per turn, at most what the lane's recent
  admitted demand ``λ`` brings in during the wait itself (``T = T0 + λ T / lane_rate``);
* ``λ_lift`` — the first requests of under-served tenants that join ahead of the ring's tail
  (:meth:`drr.DeficitRoundRobin.push`) go before ``i``'s queue, at the lane's recent rate of
  such lifted dispatches;
* the caller also takes the larger of this and the wait for KV room
  (:meth:`TokenfairScheduler.kv_wait_ms`);
* ``q_i`` and ``c`` are scaled by the tenant's recent ratio of actual to estimated usage (a
  tenant that under-declares waits for what its work will really cost);
* ``residual_ms`` — work already dispatched and not yet done, as a fluid at the service rate
  (:class:`ResidualWork`);
* ``lane_rate`` — the service rate ``R``; the interactive lane adds the batch work its minimum
  share lets in meanwhile; the batch lane runs at ``R - min(λ, R * (1 - s))`` where ``λ`` is the
  interactive lane's recently admitted service per ms (:class:`DemandRate`, time constant
  ``maxBatchWaitMs``).

The error, stated: ``ahead_i`` is an *upper* bound on what the tenants backlogged now can send
ahead of the request under DRR. The prediction overestimates the wait of a tenant whose
neighbours have less work than their share (its queue is capped lower than it could be, which
costs it nothing while it stays backlogged: DRR, not the cap, sets its service). It
underestimates when a tenant that
was not competing starts during the wait, when arrivals or lifts run above their recent rates,
when the others' first turn receives arrivals, when the usage ratio changes, and when KV holds
the request back (KV is not modelled: a request that fits the watermark alone is admitted).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from itertools import accumulate

from tokenfair.core.drr import TenantQueue
from tokenfair.core.units import to_units as _units
from tokenfair.core.units import tokens_of


class LaneCompetition:
    """The tenants competing in one lane and the sum ``W`` of their quanta."""

    __slots__ = ("_counted", "_recent", "competing_units")

    def __init__(self) -> None:
        self.competing_units = 0
        """``W`` in fixed-point units (:mod:`~tokenfair.core.units`): an exact integer sum, so
        it is 0 exactly when nobody competes, whatever was added and taken away."""
        self._counted: dict[str, float] = {}  # competing tenant -> the quantum counted in W
        self._recent: OrderedDict[str, float] = (
            OrderedDict()
        )  # tenant -> last admission, oldest first

    @property
    def competing_quanta(self) -> float:
        """``W``: the sum of the quanta of the competing tenants, in service tokens."""
        return tokens_of(self.competing_units)

    def admitted(self, tenant_id: str, quantum: float, now_ms: float) -> None:
        """A request of the tenant was admitted into the lane: it competes from now on."""
        recent = self._recent
        recent[tenant_id] = now_ms
        recent.move_to_end(tenant_id)
        if tenant_id not in self._counted:
            self._counted[tenant_id] = quantum
            self.competing_units += _units(quantum)

    def retire(self, now_ms: float, horizon_ms: float, backlogged: Callable[[str], bool]) -> None:
        """Stop counting the tenants whose last admission is older than ``horizon_ms`` and whose
        queue in the lane is empty. Amortised O(1): each admission is retired once."""
        cutoff_ms = now_ms - horizon_ms
        recent = self._recent
        for tenant_id in recent:  # the oldest admission first
            if recent[tenant_id] >= cutoff_ms:
                return
            break
        else:
            return  # nobody
        while recent:
            tenant_id, last_ms = next(iter(recent.items()))
            if last_ms >= cutoff_ms:
                break
            recent.popitem(last=False)
            if not backlogged(tenant_id):
                self._uncount(tenant_id)

    def drained(self, tenant_id: str) -> None:
        """The tenant's queue in the lane emptied; it stops competing unless it sent recently."""
        if tenant_id not in self._recent:
            self._uncount(tenant_id)

    def quantum_changed(self, tenant_id: str, quantum: float) -> None:
        """A reconfiguration changed the tenant's weight."""
        counted = self._counted.get(tenant_id)
        if counted is not None:
            self._counted[tenant_id] = quantum
            self.competing_units += _units(quantum) - _units(counted)

    def competes(self, tenant_id: str) -> bool:
        return tenant_id in self._counted

    def _uncount(self, tenant_id: str) -> None:
        quantum = self._counted.pop(tenant_id, None)
        if quantum is not None:
            self.competing_units -= _units(quantum)  # what `admitted` added: exact


def tokens_ahead(
    own_queued_tokens: float,
    cost_tokens: float,
    own: TenantQueue,
    competing_quanta: float,
    backlogged_quanta: float,
    lane_queued_tokens: float,
    lane_credit_tokens: float,
    front: TenantQueue | None,
    first_turn_tokens: float | None = None,
) -> tuple[float, int]:
    """Lane service before a new request of tenant ``i`` can start, from the tenants backlogged
    now (an upper bound under DRR), and how many later turns of the others it waits for.

    ``i`` still needs ``k = max(1, ceil((q_i + c - D_i) / Q_i))`` quanta (none, and no wait for
    the others, if its open turn at the front already covers its queue and the request). Before
    each of them every other tenant gets at most one turn of one quantum, and may also spend the
    credit it already holds (``C_i``: the lane's positive deficits but ``i``'s), so::

        ahead = q_i + min(C_i + W - Q_i - open_front, L - q_i) + (k - 1) * (B - Q_i)

    with ``W`` the quanta of the competing tenants, ``B`` those of the backlogged ones (both
    counting ``i``). The others' first turn is capped by what the lane holds now (a tenant that
    arrives later joins the ring behind ``i``); a front tenant whose turn is open gets no new
    quantum in it (``open_front = Q_front``: what it may still send is its credit). A tenant
    that joins ahead (``first_turn_tokens``: what is promised before its first turn) waits for
    that only; its first turn covers the request. Competing tenants that are not backlogged now
    take part in the later turns only if they send meanwhile: the caller adds that
    (:meth:`TokenfairScheduler.predicted_wait_ms`). Returns ``(ahead, k - 1)``. ``own`` and
    ``front`` are the tenants' round-robin queues (typed as such: compiled, their fields are
    read directly)."""
    deficit = own.deficit
    needed = own_queued_tokens + cost_tokens - deficit
    if front is own and own.turn_open and needed <= 0:
        return own_queued_tokens, 0
    if first_turn_tokens is not None:
        # Joining ahead lifts the deficit to cover the request: it goes in the first turn.
        later_turns = 0
        first_turn = first_turn_tokens
    else:
        # Conditionals rather than min/max calls: this runs for every admission.
        later_turns = math.ceil(needed / own.quantum) - 1
        if later_turns < 0:
            later_turns = 0
        first_turn = (
            lane_credit_tokens - (deficit if deficit > 0.0 else 0.0) + competing_quanta
        ) - own.quantum
        if front is not None and front is not own and front.turn_open:
            first_turn -= front.quantum
        held = lane_queued_tokens - own_queued_tokens
        if held < first_turn:
            first_turn = held
    others = backlogged_quanta - own.quantum
    later = later_turns * others if others > 0.0 else 0.0
    return own_queued_tokens + (first_turn if first_turn > 0.0 else 0.0) + later, later_turns


class DemandRate:
    """An exponentially weighted rate of admitted service tokens per ms (time constant ``tau``).

    ``rate(t) = sum_k tokens_k * exp(-(t - t_k) / tau) / tau``: a steady stream of ``r`` tokens
    per ms reads ``r``; a stream that stops fades with ``tau``. ``tau`` is passed with each call
    (it is a policy parameter, and a reload may change it).
    """

    __slots__ = ("_at_ms", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._at_ms = 0.0

    def add(self, tokens: float, now_ms: float, tau_ms: float) -> None:
        value = self._value
        elapsed_ms = now_ms - self._at_ms
        if elapsed_ms > 0.0:
            self._at_ms = now_ms
            if value:
                value *= math.exp(-elapsed_ms / tau_ms)
        value += tokens / tau_ms
        # A settlement may take back more than is left of a decayed dispatch: never below 0.
        self._value = value if value > 0.0 else 0.0

    def rate(self, now_ms: float, tau_ms: float) -> float:
        elapsed_ms = now_ms - self._at_ms
        if elapsed_ms <= 0.0 or self._value == 0.0:
            return self._value
        return self._value * math.exp(-elapsed_ms / tau_ms)

    @property
    def at_ms(self) -> float:
        """When it was last added to."""
        return self._at_ms

    def term(self, ref_ms: float, tau_ms: float) -> float:
        """The rate as of ``ref_ms`` unscaled by the decay since: ``rate(t) = term(ref) *
        exp(-(t - ref) / tau)`` for every ``t`` after the last :meth:`add` (:class:`RateSum`)."""
        value = self._value
        if value == 0.0:
            return value
        return value * math.exp((self._at_ms - ref_ms) / tau_ms)

    def ms_until_below(self, rate: float, now_ms: float, tau_ms: float) -> float:
        """How long until :meth:`rate` falls below ``rate`` with nothing added:
        ``tau * ln(rate(now) / rate)`` (0 if it is below already; infinite for a ``rate`` of
        0 or less, which a decay never goes below)."""
        if rate <= 0.0:
            return math.inf
        current = self.rate(now_ms, tau_ms)
        if current < rate:
            return 0.0
        return tau_ms * math.log(current / rate)


RATE_SUM_REBASE_TAUS = 32.0
"""How far :class:`RateSum`'s reference time may fall behind, in ``tau``: its terms grow by
``exp(32)`` at most meanwhile (far from the float's range)."""


class RateSum:
    """The sum of the :class:`DemandRate` of a changing set of keys (the tenants backlogged in a
    lane), read in O(1) however many there are.

    Every member's rate decays with the same ``tau``, so ``sum_j rate_j(t) = exp(-(t - ref) /
    tau) sum_j term_j(ref)`` (:meth:`DemandRate.term`): the sum of the members' terms is kept
    as they join (:meth:`put`), leave (:meth:`drop`) and are served (:meth:`put` again). Equal
    to the sum of the rates read one by one up to the rounding of the sums: the running total
    is summed afresh from the terms every ``len + 16`` changes (amortised O(1)), and the terms
    re-read at a new ``ref`` when ``t - ref`` passes :data:`RATE_SUM_REBASE_TAUS` ``tau`` or
    ``tau`` changes (a reload). Read at a time before its last change (a member's last add, or
    its ``ref``), it reads as at that time: no extrapolation backwards (:meth:`DemandRate.rate`
    has none either), so then at most the one-by-one sum."""

    __slots__ = ("_changes", "_last_ms", "_rates", "_ref_ms", "_tau_ms", "_terms", "_total")

    def __init__(self, rates: dict[str, DemandRate], tau_ms: float) -> None:
        self._rates = rates
        """The rates read (the scheduler's per-tenant rates of the lane)."""
        self._terms: dict[str, float] = {}
        self._total = 0.0
        self._ref_ms = 0.0
        self._tau_ms = tau_ms
        self._changes = 0
        self._last_ms = 0.0
        """The latest of ``ref`` and the members' last adds put in: a read before it reads as
        at it."""

    def __contains__(self, key: str) -> bool:
        return key in self._terms

    def __len__(self) -> int:
        return len(self._terms)

    def put(self, key: str, tau_ms: float) -> None:
        """``key`` is a member, its rate as it is now (joined, or served)."""
        rate = self._rates.get(key)
        if rate is not None:
            at_ms = rate.at_ms
            if at_ms > self._last_ms:
                self._last_ms = at_ms
            if tau_ms != self._tau_ms or at_ms - self._ref_ms > RATE_SUM_REBASE_TAUS * tau_ms:
                self._rebase(at_ms if at_ms > self._ref_ms else self._ref_ms, tau_ms)
        term = 0.0 if rate is None else rate.term(self._ref_ms, tau_ms)
        terms = self._terms
        self._total += term - terms.get(key, 0.0)
        terms[key] = term
        self._changed()

    def drop(self, key: str) -> None:
        """``key`` is not a member any more (nothing if it was not)."""
        term = self._terms.pop(key, None)
        if term is not None:
            self._total -= term
            self._changed()

    def rate(self, now_ms: float, tau_ms: float) -> float:
        """The sum of the members' rates at ``now_ms`` (at the last change if it is later)."""
        if now_ms < self._last_ms:
            now_ms = self._last_ms
        if tau_ms != self._tau_ms or now_ms - self._ref_ms > RATE_SUM_REBASE_TAUS * tau_ms:
            self._rebase(now_ms, tau_ms)
        total = self._total
        if total <= 0.0:
            return 0.0
        return total * math.exp(-(now_ms - self._ref_ms) / tau_ms)

    def _changed(self) -> None:
        self._changes += 1
        if self._changes > len(self._terms) + 16:
            self._changes = 0
            self._total = sum(self._terms.values())

    def _rebase(self, now_ms: float, tau_ms: float) -> None:
        self._ref_ms = now_ms
        if now_ms > self._last_ms:
            self._last_ms = now_ms
        self._tau_ms = tau_ms
        rates = self._rates
        terms = self._terms
        for key in terms:
            rate = rates.get(key)
            terms[key] = 0.0 if rate is None else rate.term(now_ms, tau_ms)
        self._total = sum(terms.values())
        self._changes = 0


class ResidualWork:
    """Dispatched work not yet done, as a fluid served at ``rate`` service tokens per ms.

    ``busy_until = max(busy_until, t) + expected / rate`` at each dispatch (``expected``: the
    estimate times the tenant's usage ratio), corrected by ``(actual - expected) / rate`` at
    settlement, never past the end of the work the other running requests hold; the residual
    wait is ``max(0, busy_until - t)``. A serial engine's (``maxBatchRequests`` 1); a batching
    engine's running work is :class:`tokenfair.core.batching.RunningWork`.
    """

    __slots__ = ("_busy_until_ms",)

    def __init__(self) -> None:
        self._busy_until_ms = 0.0

    def dispatched(self, service_tokens: float, rate_per_ms: float, now_ms: float) -> None:
        busy_until_ms = self._busy_until_ms
        if busy_until_ms < now_ms:
            busy_until_ms = now_ms
        self._busy_until_ms = busy_until_ms + service_tokens / rate_per_ms

    def settled(
        self, overrun_tokens: float, rate_per_ms: float, bound_ms: float = math.inf
    ) -> None:
        """A request ended having used ``overrun_tokens`` more than it was expected to (fewer
        if negative): the engine is busy that much longer, but never past ``bound_ms`` (the
        caller's bound: the end of the work the *other* running requests hold), since the
        request itself is over. A reported usage, however large, thus delays no one beyond the
        work actually running. (Within 1e-6 ms of the bound the sum stands: a replay whose
        clock is the actual usage lands on the bound give or take float noise, and its
        decisions stay those of the unclamped sum.)"""
        busy_until_ms = self._busy_until_ms + overrun_tokens / rate_per_ms
        if busy_until_ms > bound_ms + 1e-6:
            busy_until_ms = bound_ms if bound_ms > self._busy_until_ms else self._busy_until_ms
        self._busy_until_ms = busy_until_ms

    def wait_ms(self, now_ms: float) -> float:
        wait_ms = self._busy_until_ms - now_ms
        return wait_ms if wait_ms > 0.0 else 0.0


def water_level(capacity: float, demands: list[tuple[float, float]]) -> float:
    """The weighted max-min water level ``L`` of ``capacity`` over ``(demand, weight)`` pairs:
    each gets ``min(demand, L * weight)`` and the allocations sum to ``capacity``; ``inf`` when
    the demands fit. O(n log n). The weight still to fill is summed from the end (a suffix
    sum), not by subtraction, so it never drifts to 0 however the weights differ in size."""
    if sum(d for d, _ in demands) <= capacity:
        return math.inf
    ordered = sorted(demands, key=lambda p: p[0] / p[1])
    rest_weights = list(accumulate(w for _, w in reversed(ordered)))[::-1]
    remaining = capacity
    for (demand, weight), rest_weight in zip(ordered, rest_weights, strict=True):
        level = remaining / rest_weight
        if demand > level * weight:
            return level
        remaining -= demand
    return math.inf
