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
