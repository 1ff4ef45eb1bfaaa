"""Replica-aware budgets: divide each tenant's token bucket across the ready sidecars of a pool.

Every sidecar enforces its own bucket, so with ``n`` ready replicas behind a load balancer each
one gets ``1/n`` of the TenantQuota and the pool as a whole never exceeds it:

* burst per replica ``= max(1, floor(burst / n))`` service tokens (integers; rounding down keeps
  ``n * per_replica <= burst`` except when ``burst < n``, where each replica still needs 1);
* sustained per replica ``= sustained / n`` service tokens per second.

``n < 1`` (no ready pod yet) is treated as 1: the first pod gets the whole quota. The rule itself
lives in the sidecar (:func:`tokenfair.config.budget_store.split_budgets`), which applies it too
when a policy with a ``budgetStore`` falls back from pool-wide budgets.
"""

from __future__ import annotations

from tokenfair.config import TenantConfig
from tokenfair.config.budget_store import split_budgets as _split


def split_budgets(tenant: TenantConfig, ready_replicas: int) -> TenantConfig:
    """The per-replica share of ``tenant``'s budgets (weight and keys unchanged)."""
    return _split(tenant, ready_replicas)
