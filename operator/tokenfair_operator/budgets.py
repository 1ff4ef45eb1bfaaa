"""Replica-aware budgets: divide each tenant's token bucket across the ready sidecars of a pool.

Every sidecar enforces its own bucket, so with ``n`` ready replicas behind a load balancer each
one gets ``1/n`` of the TenantQuota and the pool as a whole never exceeds it:

* burst per replica ``= max(1, floor(burst / n))`` service tokens (integers; rounding down keeps
  ``n * per_replica <= burst`` except when ``burst < n``, where each replica still needs 1);
* sustained per replica ``= sustained / n`` service tokens per second.

``n < 1`` (no ready pod yet) is treated as 1: the first pod gets the whole quota.
"""

from __future__ import annotations

import dataclasses

from tokenfair_sidecar.config import TenantConfig


def split_budgets(tenant: TenantConfig, ready_replicas: int) -> TenantConfig:
    """The per-replica share of ``tenant``'s budgets (weight and keys unchanged)."""
    replicas = max(1, ready_replicas)
    return dataclasses.replace(
        tenant,
        burst_service_tokens=max(1, tenant.burst_service_tokens // replicas),
        sustained_service_tokens_per_second=tenant.sustained_service_tokens_per_second / replicas,
    )
