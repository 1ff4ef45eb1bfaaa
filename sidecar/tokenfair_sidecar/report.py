"""Summaries of decision records, in the lesson's report shape.

Percentiles use the nearest-rank rule of the lesson: the value at index
``ceil(p/100 * n) - 1`` of the sorted values (clamped to the list), rounded to 0.01 ms.
``peak_kv_occupancy_ratio`` is the peak occupancy of **admitted** work; the lesson's published
figure also took the (clamped) occupancy that refused requests *attempted* (see docs/lesson.md).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from tokenfair_sidecar.core import Decision
from tokenfair_sidecar.core.jobs import STATUS_OK, STATUS_SHED


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) rounded to 2 decimals; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(p / 100.0 * len(ordered)) - 1))
    return round(ordered[index], 2)


class _TenantTally:
    __slots__ = ("admitted_service_tokens", "shed_429", "submitted", "ttft_ms")

    def __init__(self) -> None:
        self.submitted = 0
        self.shed_429 = 0
        self.admitted_service_tokens = 0
        self.ttft_ms = array("d")  # of the admitted requests: 8 bytes each, no float objects


class SummaryTally:
    """:func:`summarize`, one decision at a time: feed decisions to :meth:`add` as they are
    decided (nothing of a decision is kept but its TTFT when admitted, as a C double: the
    nearest-rank percentiles need every value), then :meth:`summary`."""

    __slots__ = ("_batch_ttft_ms", "_interactive_ttft_ms", "_peak_kv", "_shed_reasons", "_tenants")

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantTally] = {}
        self._shed_reasons: dict[str, int] = {}
        self._interactive_ttft_ms = array("d")
        self._batch_ttft_ms = array("d")
        self._peak_kv = 0.0

    def add(self, decision: Decision) -> None:
        tally = self._tenants.get(decision.tenant_id)
        if tally is None:
            tally = self._tenants[decision.tenant_id] = _TenantTally()
        tally.submitted += 1
        status = decision.status_code
        if status == STATUS_OK:
            tally.admitted_service_tokens += decision.service_tokens
            ttft_ms = decision.ttft_ms
            tally.ttft_ms.append(ttft_ms)
            if decision.priority_class == "interactive":
                self._interactive_ttft_ms.append(ttft_ms)
            else:
                self._batch_ttft_ms.append(ttft_ms)
            if decision.kv_occupancy_ratio > self._peak_kv:
                self._peak_kv = decision.kv_occupancy_ratio
            return
        if status == STATUS_SHED:
            tally.shed_429 += 1
        reasons = self._shed_reasons
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1

    def summary(self) -> dict[str, Any]:
        """The lesson's per-policy summary of the decisions added so far."""
        tenants: dict[str, dict[str, object]] = {}
        for tenant_id in sorted(self._tenants):
            tally = self._tenants[tenant_id]
            tenants[tenant_id] = {
                "submitted": tally.submitted,
                "admitted": len(tally.ttft_ms),
                "shed_429": tally.shed_429,
                "admitted_service_tokens": tally.admitted_service_tokens,
                "p50_ttft_ms": percentile(tally.ttft_ms, 50),
                "p99_ttft_ms": percentile(tally.ttft_ms, 99),
            }
        return {
            "total_requests": sum(t.submitted for t in self._tenants.values()),
            "admitted_requests": len(self._interactive_ttft_ms) + len(self._batch_ttft_ms),
            "shed_429_requests": sum(t.shed_429 for t in self._tenants.values()),
            "interactive_p50_ttft_ms": percentile(self._interactive_ttft_ms, 50),
            "interactive_p99_ttft_ms": percentile(self._interactive_ttft_ms, 99),
            "batch_p99_ttft_ms": percentile(self._batch_ttft_ms, 99),
            "peak_kv_occupancy_ratio": round(self._peak_kv, 4),
            "shed_reasons": dict(self._shed_reasons),
            "tenants": tenants,
        }


def summarize(decisions: Iterable[Decision]) -> dict[str, Any]:
    """The lesson's per-policy summary (``comparison.<policy>`` of its JSON report)."""
    tally = SummaryTally()
    for decision in decisions:
        tally.add(decision)
    return tally.summary()
