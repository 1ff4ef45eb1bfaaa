"""Replica-aware budgets: divide each tenant's token bucket across the ready sidecars of a pool.

Every sidecar enforces its own bucket, so with ``n`` ready replicas behind a load balancer each
one gets ``1/n`` of the TenantQuota and the pool as a whole never exceeds it:

* burst per replica ``= max(1, floor(burst / n))`` service tokens (integers; rounding down keeps
  ``n * per_replica <= burst`` except when ``burst < n``, where each replica still needs 1);
* sustained per replica ``= sustained / n`` service tokens per second.

``n < 1`` (no ready pod yet) is treated as 1: the first pod gets the whole quota. The rule itself
lives in the sidecar (:func:`tokenfair.config.budget_store.split_budgets`), which applies it too
when a policy with a ``budgetStore`` falls back from pool-wide budgets.

``maxConcurrentRequests`` is divided the same way, with or without a ``budgetStore`` (the store
shares budgets, not running requests): ``max(1, floor(limit / n))`` per replica, so the pool
runs at most the limit unless it has more replicas than the limit. ``maxKvShare`` is a fraction
of each sidecar's own engine, hence of the pool: it is not divided.
"""

from __future__ import annotations

import dataclasses

from tokenfair.config import TenantConfig
from tokenfair.config.budget_store import split_budgets as _split


def split_concurrency(tenant: TenantConfig, ready_replicas: int) -> TenantConfig:
    """The per-replica share of ``tenant``'s ``maxConcurrentRequests`` (unchanged without one)."""
    limit = tenant.max_concurrent_requests
    if limit is None or ready_replicas <= 1:
        return tenant
    return dataclasses.replace(tenant, max_concurrent_requests=max(1, limit // ready_replicas))


def split_budgets(tenant: TenantConfig, ready_replicas: int) -> TenantConfig:
    """The per-replica share of ``tenant``'s budgets (weight and keys unchanged)."""
    return _split(tenant, ready_replicas)
