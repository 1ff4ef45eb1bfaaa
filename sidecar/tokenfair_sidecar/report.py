"""Summaries of decision records, in the lesson's report shape.

Percentiles use the nearest-rank rule of the lesson: the value at index
``ceil(p/100 * n) - 1`` of the sorted values (clamped to the list), rounded to 0.01 ms.
``peak_kv_occupancy_ratio`` is the peak occupancy of **admitted** work; the lesson's published
figure also took the (clamped) occupancy that refused requests *attempted* (see docs/lesson.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from tokenfair_sidecar.core import Decision


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) rounded to 2 decimals; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(p / 100.0 * len(ordered)) - 1))
    return round(ordered[index], 2)


def summarize(decisions: Iterable[Decision]) -> dict[str, Any]:
    """The lesson's per-policy summary (``comparison.<policy>`` of its JSON report)."""
    rows = list(decisions)
    admitted = [d for d in rows if d.admitted]
    refused = [d for d in rows if not d.admitted]
    shed_reasons: dict[str, int] = {}
    for row in refused:
        shed_reasons[row.reason] = shed_reasons.get(row.reason, 0) + 1
    tenants: dict[str, dict[str, object]] = {}
    for tenant_id in sorted({d.tenant_id for d in rows}):
        mine = [d for d in rows if d.tenant_id == tenant_id]
        ok = [d for d in mine if d.admitted]
        tenants[tenant_id] = {
            "submitted": len(mine),
            "admitted": len(ok),
            "shed_429": sum(1 for d in mine if d.status_code == 429),
            "admitted_service_tokens": sum(d.service_tokens for d in ok),
            "p50_ttft_ms": percentile([d.ttft_ms for d in ok], 50),
            "p99_ttft_ms": percentile([d.ttft_ms for d in ok], 99),
        }
    interactive = [d.ttft_ms for d in admitted if d.priority_class == "interactive"]
    batch = [d.ttft_ms for d in admitted if d.priority_class == "batch"]
    return {
        "total_requests": len(rows),
        "admitted_requests": len(admitted),
        "shed_429_requests": sum(1 for d in rows if d.status_code == 429),
        "interactive_p50_ttft_ms": percentile(interactive, 50),
        "interactive_p99_ttft_ms": percentile(interactive, 99),
        "batch_p99_ttft_ms": percentile(batch, 99),
        "peak_kv_occupancy_ratio": round(
            max((d.kv_occupancy_ratio for d in admitted), default=0.0), 4
        ),
        "shed_reasons": shed_reasons,
        "tenants": tenants,
    }
