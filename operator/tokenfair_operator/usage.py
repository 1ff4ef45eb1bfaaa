"""Live usage: aggregate the sidecars' Prometheus metrics into ``TenantQuota.status.usage``.

Pure. Input: the ``/metrics`` text of each Ready sidecar of a policy (admin port). Output, per
tenant id, summed over the sidecars and both lanes:

* ``admittedServiceTokens`` — ``tokenfair_estimated_service_tokens_total``: service tokens
  charged at admission (dispatch);
* ``refusals`` — ``tokenfair_refused_requests_total`` by ``reason``;
* ``p99QueueWaitMs`` — p99 of the tenant's own ``tokenfair_queue_wait_seconds`` series
  (labels ``tenant``, ``lane``): its cumulative bucket counts are added per upper bound ``le``
  over the sidecars (and both lanes, should its priority class have changed), then the
  estimate is the upper bound of the first bucket whose cumulative count reaches
  ``0.99 * total`` (nearest bucket bound, no interpolation; ``+Inf`` is reported as the last
  finite bound), in milliseconds; 0 when the tenant saw no dispatched request;
* ``sidecars`` — how many sidecars answered.

Counters restart with a sidecar, so the sums are "since the sidecars started".
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from tokenfair.config.wire import ADMITTED_TOKENS_METRIC as ADMITTED
from tokenfair.config.wire import QUEUE_WAIT_METRIC as QUEUE_WAIT
from tokenfair.config.wire import REFUSED_METRIC as REFUSED

P99: Final = 0.99


def aggregate_usage(scrapes: Iterable[str], tenants: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``status.usage`` per tenant id in ``tenants`` from metrics texts (a mapping of tenant
    ids, e.g. to their lanes, is iterated for its keys)."""
    admitted: Counter[str] = Counter()
    refusals: dict[str, Counter[str]] = defaultdict(Counter)
    # tenant -> upper bound (le) -> cumulative count
    buckets: dict[str, defaultdict[float, float]] = defaultdict(lambda: defaultdict(float))
    sidecars = 0
    for text in scrapes:
        sidecars += 1
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == f"{ADMITTED}_total":
                    admitted[labels["tenant"]] += int(sample.value)
                elif sample.name == f"{REFUSED}_total":
                    refusals[labels["tenant"]][labels["reason"]] += int(sample.value)
                elif sample.name == f"{QUEUE_WAIT}_bucket":
                    buckets[labels["tenant"]][float(labels["le"])] += sample.value
    return {
        tenant: {
            "admittedServiceTokens": admitted[tenant],
            "refusals": dict(sorted(refusals[tenant].items())),
            "p99QueueWaitMs": _p99_ms(buckets[tenant]),
            "sidecars": sidecars,
        }
        for tenant in tenants
    }


def _p99_ms(cumulative: Mapping[float, float]) -> float:
    """Upper bound of the bucket holding the 99th percentile, in ms (+Inf -> the last finite)."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return 0.0
    total = cumulative[bounds[-1]]
    finite = [b for b in bounds if math.isfinite(b)]
    for bound in bounds:
        if cumulative[bound] >= P99 * total:
            upper = bound if math.isfinite(bound) else (finite[-1] if finite else 0.0)
            return round(upper * 1000.0, 3)
    return 0.0  # unreachable: the +Inf bucket holds every observation


def usage_changed(current: Mapping[str, Any] | None, fresh: Mapping[str, Any]) -> bool:
    """True when ``fresh`` differs from the stored usage (``updatedAt`` aside)."""
    stored = {k: v for k, v in (current or {}).items() if k != "updatedAt"}
    return stored != dict(fresh)
