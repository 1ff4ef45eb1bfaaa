"""The pool-wide weighted max-min reference, constrained by where each request could run.

A pool of replicas ``r`` with capacities ``C_r`` (service tokens over a window) serves tenants
``i`` with weights ``w_i``; ``d_ir`` is the service tenant ``i`` offered at replica ``r`` (the
requests that reached ``r``: a request runs only where it landed). An allocation gives each
tenant ``t_i``; it is **feasible** when some ``x_ir`` with ``0 <= x_ir <= d_ir``,
``sum_r x_ir = t_i`` and ``sum_i x_ir <= C_r`` exists — a flow from tenants to replicas. By the
max-flow min-cut theorem (a cut puts a set ``S`` of replicas on the source side) that is

    sum_i t_i  <=  min over S of [ C(S) + sum_i min(t_i, sum_{r not in S} d_ir) ],

checked here over every subset (so at most :data:`MAX_REPLICAS` replicas: ``2^N`` cuts).

The **weighted max-min** allocation is found by progressive filling: a water level ``L`` rises,
every tenant not frozen gets ``min(D_i, L * w_i)`` (``D_i = sum_r d_ir``), the level stops at
the highest feasible value (bisection, to a relative ``1e-9``), and the tenants that cannot grow
any more there (offer met, or every larger share infeasible) are frozen; repeat until all are.
A tenant pinned to one replica against a flooder present on all of ``N`` gets that whole
replica, not the half a per-replica round robin gives it (``tokenfair simulate --replicas``,
``bench/bench_pool_fairness.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from tokenfair.core import Decision
from tokenfair.sim.fairness import decision_size, is_served

MAX_REPLICAS: Final = 16
_BISECTIONS: Final = 100


def constrained_max_min(
    capacities: Sequence[float],
    offered: Mapping[str, Sequence[float]],
    weights: Mapping[str, float],
) -> dict[str, float]:
    """Each tenant's weighted max-min share of the pool (module docstring). ``offered[i][r]``
    is ``d_ir``; ``weights`` must hold a positive weight for every tenant of ``offered``."""
    replicas = len(capacities)
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas: must be in [1, {MAX_REPLICAS}] (got {replicas})")
    tenants = [t for t in offered if sum(offered[t]) > 0]
    for tenant_id in tenants:
        if len(offered[tenant_id]) != replicas:
            raise ValueError(f"offered[{tenant_id!r}]: must have one value per replica")
        if not weights.get(tenant_id, 0.0) > 0.0:
            raise ValueError(f"weights[{tenant_id!r}]: must be positive")
    subsets = range(1 << replicas)
    capacity_of = [sum(capacities[r] for r in range(replicas) if s >> r & 1) for s in subsets]
    # reach[i][s]: what tenant i offered outside the replicas of s.
    reach = {
        t: [sum(offered[t][r] for r in range(replicas) if not s >> r & 1) for s in subsets]
        for t in tenants
    }
    demand = {t: float(sum(offered[t])) for t in tenants}

    def feasible(shares: Mapping[str, float]) -> bool:
        total = sum(shares.values())
        slack = 1e-9 * max(1.0, total)
        for s in subsets:
            cut = capacity_of[s] + sum(min(shares[t], reach[t][s]) for t in tenants)
            if cut < total - slack:
                return False
        return True

    shares = dict.fromkeys(tenants, 0.0)
    frozen: set[str] = set()
    level = 0.0
    while len(frozen) < len(tenants):
        active = [t for t in tenants if t not in frozen]

        def at(
            value: float, active: list[str] = active, base: dict[str, float] = shares
        ) -> dict[str, float]:
            trial = dict(base)
            for t in active:
                trial[t] = min(demand[t], value * weights[t])
            return trial

        high = max(demand[t] / weights[t] for t in active)
        if feasible(at(high)):
            level = high
        else:
            low = level
            for _ in range(_BISECTIONS):
                middle = (low + high) / 2.0
                if feasible(at(middle)):
                    low = middle
                else:
                    high = middle
                if high - low <= 1e-12 * max(1.0, high):
                    break
            level = low
        shares = at(level)
        grown = False
        for t in active:
            if shares[t] >= demand[t] * (1.0 - 1e-12):
                frozen.add(t)
                grown = True
                continue
            trial = dict(shares)
            trial[t] = min(demand[t], shares[t] + 1e-6 * max(1.0, shares[t]))
            if not feasible(trial):
                frozen.add(t)
                grown = True
        if not grown:  # numerical corner: freeze the rest at this level
            frozen.update(active)
    return shares


def pool_shares(
    replicas: Sequence[Sequence[Decision]],
    weights: Mapping[str, float],
    window_ms: tuple[float, float] | None = None,
    *,
    rounded: bool = True,
) -> dict[str, object]:
    """The pool-wide reference over several replicas' decisions (one sequence per replica,
    e.g. each sidecar's records): per tenant, what it offered at each replica (every request
    that arrived there in the window, at its actual size where recorded) and was served (those
    answered), against :func:`constrained_max_min` with each replica's capacity taken as what
    it served. Tenants missing from ``weights`` weigh 1. Returns ``{"tenants": {id: {...}},
    "jain_of_max_min": J}`` (J over the tenants with a positive share; None if none): tokens
    rounded to 2 decimals, ratios and J to 4 for a report; ``rounded=False`` leaves every figure
    as computed (a verdict judges those: 0.94996 is no pass at 0.95, review rev1207f F4)."""
    count = len(replicas)
    offered: dict[str, list[float]] = {}
    served: dict[str, list[float]] = {}
    for index, decisions in enumerate(replicas):
        for decision in decisions:
            if window_ms is not None and not (window_ms[0] <= decision.arrival_ms <= window_ms[1]):
                continue
            size = float(decision_size(decision, None))
            tenant_id = decision.tenant_id
            offered.setdefault(tenant_id, [0.0] * count)[index] += size
            row = served.setdefault(tenant_id, [0.0] * count)
            if is_served(decision):
                row[index] += size
    capacities = [sum(row[r] for row in served.values()) for r in range(count)]
    tenant_weights = {t: float(weights.get(t, 1.0)) for t in offered}
    shares = constrained_max_min(capacities, offered, tenant_weights) if offered else {}

    def at(value: float, digits: int) -> float:
        return round(value, digits) if rounded else value

    rows: dict[str, object] = {}
    ratios: list[float] = []
    for tenant_id in sorted(offered):
        got = sum(served[tenant_id])
        share = shares.get(tenant_id, 0.0)
        ratio = got / share if share > 0 else None
        if ratio is not None:
            ratios.append(ratio)
        rows[tenant_id] = {
            "weight": tenant_weights[tenant_id],
            "offered_service_tokens": at(sum(offered[tenant_id]), 2),
            "served_service_tokens": at(got, 2),
            "max_min_service_tokens": at(share, 2),
            "of_max_min": None if ratio is None else at(ratio, 4),
            "replicas": [r for r in range(count) if offered[tenant_id][r] > 0],
        }
    jain = sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios)) if ratios else None
    return {"tenants": rows, "jain_of_max_min": None if jain is None else at(jain, 4)}
