"""The scaling signal: per lane, demand over capacity in service tokens (docs/observability.md,
"The scaling signal").

::

    demand_ratio(lane) = max(queued + running, offered over the last W) / (R * W)
    offered = admitted + refused for capacity at admission

``queued`` is the lane's queued service tokens (the core's running total), ``running`` the
estimates of the lane's requests dispatched and not ended, ``offered`` the service tokens of
the lane's requests that arrived in the last ``W`` ms and were admitted or refused at admission
for want of capacity — the gates more replicas would have passed (:data:`CAPACITY_REASONS`: a
predicted wait over the limit, a full queue, a KV watermark; not a tenant's budget, nor a
request no replica could ever admit), shadow mode's ``would_refuse`` ones included. ``R`` is the
calibrated service rate (``serviceTokensPerMs``), ``W`` the lane's wait limit.

Why this: the offered term is the lane's offered load over capacity — 0.5 at half the
capacity, 2 at twice it, whatever admission refused — so it is the factor by which the
replicas must grow, what an HPA's ``desired = ceil(current * value / target)`` needs (a
backlog-only signal reads near 0 at any load the replicas carry, and would scale a pool that
keeps up down until it no longer does). The backlog term keeps the signal up while a backlog
drains after arrivals stop: admission keeps each lane's queue within what ``R`` serves in
``W``, so it is the share of the lane's wait budget the backlog fills (1 at the limit). Both
react within one wait limit (arrivals leave the window after ``W``; the queue drains at the
spare rate), and neither needs a latency histogram or anything of the engine beyond the rate
admission already uses. A request refused at admission for its tenant's budget is the policy
working, not demand; one that expires in the queue was counted when it was admitted.

Pure and clock-free: the caller passes the time (the simulator's virtual clock, the sidecar's
model clock). O(1) amortised per event.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from tokenfair.core.jobs import (
    LANE_OF,
    QUEUE_FULL,
    SHED_KV_WATERMARK,
    SHED_QUEUE_TIMEOUT,
    SHED_QUEUE_WAIT_SLO,
    Decision,
)

CAPACITY_REASONS: Final = frozenset(
    {SHED_QUEUE_WAIT_SLO, SHED_QUEUE_TIMEOUT, QUEUE_FULL, SHED_KV_WATERMARK}
)
"""Refusals more capacity would have avoided (``shed_tenant_token_quota`` is a budget, and
``request_over_*`` no replica could admit)."""


class DemandGauge:
    """The scaling signal's state: per lane, running service tokens and the service tokens
    offered in the last wait limit."""

    __slots__ = ("_offered", "_offered_tokens", "_running", "_windows_ms", "rate_per_ms")

    def __init__(self, windows_ms: tuple[float, float], rate_per_ms: float) -> None:
        self._windows_ms = windows_ms
        self.rate_per_ms = rate_per_ms
        self._running = [0, 0]
        self._offered: tuple[deque[tuple[float, int]], ...] = (deque(), deque())
        self._offered_tokens = [0, 0]

    def retune(self, windows_ms: tuple[float, float], rate_per_ms: float) -> None:
        """A new wait limit or service rate (a reload; a replica count in the simulator)."""
        self._windows_ms = windows_ms
        self.rate_per_ms = rate_per_ms

    def admitted(self, decision_lane: int, service_tokens: int, now_ms: float) -> None:
        """A request of the lane was admitted (queued) now (what left the window goes first, so
        that the window stays bounded without reads)."""
        self._expire(decision_lane, now_ms)
        self._offered[decision_lane].append((now_ms, service_tokens))
        self._offered_tokens[decision_lane] += service_tokens

    def refused(self, decision: Decision, now_ms: float) -> None:
        """A refusal (or shadow mode's would-be refusal): offered load if it was refused at
        admission for capacity (one from the queue was counted when it was admitted)."""
        if decision.gate == "admission" and decision.reason in CAPACITY_REASONS:
            self.admitted(LANE_OF[decision.priority_class], decision.service_tokens, now_ms)

    def started(self, decision: Decision) -> None:
        """A request was dispatched (its estimate runs until :meth:`ended`)."""
        self._running[LANE_OF[decision.priority_class]] += decision.service_tokens

    def ended(self, decision: Decision) -> None:
        """A dispatched request ended (settled, or released unsettled)."""
        lane = LANE_OF[decision.priority_class]
        running = self._running[lane] - decision.service_tokens
        self._running[lane] = running if running > 0 else 0

    def offered_tokens(self, lane: int, now_ms: float) -> int:
        """Service tokens offered to the lane in ``(now - W, now]``."""
        self._expire(lane, now_ms)
        return self._offered_tokens[lane]

    def _expire(self, lane: int, now_ms: float) -> None:
        """Drop the lane's offers at or before ``now - W``."""
        window = self._offered[lane]
        horizon_ms = now_ms - self._windows_ms[lane]
        while window and window[0][0] <= horizon_ms:
            self._offered_tokens[lane] -= window.popleft()[1]

    def ratio(self, lane: int, queued_tokens: int, now_ms: float) -> float:
        """The lane's demand over capacity now, given its queued service tokens (the running
        ones are this gauge's, from :meth:`started` and :meth:`ended`)."""
        return self.ratio_of_backlog(lane, queued_tokens + self._running[lane], now_ms)

    def ratio_of_backlog(self, lane: int, backlog_tokens: int, now_ms: float) -> float:
        """The lane's demand over capacity now, given its queued and running service tokens
        (a caller that reads both off the scheduler: the sidecar, at a scrape)."""
        offered = self.offered_tokens(lane, now_ms)
        return max(backlog_tokens, offered) / (self.rate_per_ms * self._windows_ms[lane])
