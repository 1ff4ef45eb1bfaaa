"""An independent fluid GPS oracle for the fluid-reference tests (imports nothing of ours).

Slow and plain on purpose: it cuts time at every instant an input changes (an arrival, a leave
time, the start or end of a service segment), and between two such instants, where neither the
capacity nor the demand changes but by service, gives the interval's whole capacity out by one
weighted water-fill over the tenants' backlogs — which is what generalised processor sharing
does over an interval with constant capacity and no arrivals (progressive filling) — then
serves each tenant's requests in arrival order. O(instants x requests): for small inputs.

A request is ``(arrival_ms, tenant, size_tokens, leave_ms, start_ms)``: demand from its
arrival; what is unserved at ``leave_ms`` leaves; ``start_ms`` (finite: the lane served it)
opens a service segment of ``size_tokens / rate`` ms at ``rate`` tokens a ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Request = tuple[float, int, float, float, float]


@dataclass
class _Waiting:
    remaining: float
    leave_ms: float
    counted: bool
    served: float = 0.0


def water_fill(capacity: float, demands: Sequence[float], weights: Sequence[float]) -> list[float]:
    """``min(demand_i, level * weight_i)`` with the level at which the sum is
    ``min(capacity, Σ demand)``: fill tenants in order of ``demand / weight``."""
    order = sorted(range(len(demands)), key=lambda i: demands[i] / weights[i])
    shares = [0.0] * len(demands)
    left = capacity
    weight_left = sum(weights[i] for i in order)
    for position, index in enumerate(order):
        level = left / weight_left
        if demands[index] <= level * weights[index]:
            shares[index] = demands[index]
            left -= demands[index]
            weight_left -= weights[index]
            continue
        for rest in order[position:]:
            shares[rest] = level * weights[rest]
        break
    return shares


def gps_oracle(
    requests: Sequence[Request],
    weights: Sequence[float],
    rate_tokens_per_ms: float,
    counted_from_ms: float = -math.inf,
    counted_to_ms: float = math.inf,
    until_ms: float = math.inf,
) -> tuple[list[float], list[float]]:
    """Per tenant: (fluid service of its requests arrived in the counted interval, its fluid
    service in all), delivered up to ``until_ms``."""
    segments = [
        (start, start + size / rate_tokens_per_ms)
        for _, _, size, _, start in requests
        if math.isfinite(start) and size > 0
    ]
    instants = sorted(
        t
        for t in (
            {r[0] for r in requests}
            | {r[3] for r in requests if math.isfinite(r[3])}
            | {t for segment in segments for t in segment}
            | ({until_ms} if math.isfinite(until_ms) else set())
        )
        if t <= until_ms
    )
    tenants = len(weights)
    queues: list[list[_Waiting]] = [[] for _ in range(tenants)]
    done: list[list[_Waiting]] = [[] for _ in range(tenants)]
    by_arrival = sorted(range(len(requests)), key=lambda i: requests[i][0])
    next_arrival = 0
    for index, now in enumerate(instants):
        for tenant in range(tenants):  # leave first: demand that leaves at `now` is gone
            kept: list[_Waiting] = []
            for waiting in queues[tenant]:
                (done[tenant] if waiting.leave_ms <= now else kept).append(waiting)
            queues[tenant] = kept
        while next_arrival < len(by_arrival) and requests[by_arrival[next_arrival]][0] <= now:
            arrival, tenant, size, leave, _ = requests[by_arrival[next_arrival]]
            next_arrival += 1
            if size > 0 and leave > now:
                in_window = counted_from_ms <= arrival <= counted_to_ms
                queues[tenant].append(_Waiting(size, leave, in_window))
        if index + 1 == len(instants):
            break
        until = instants[index + 1]
        running = sum(1 for start, end in segments if start <= now < end)
        capacity = running * rate_tokens_per_ms * (until - now)
        demands = [sum(w.remaining for w in queue) for queue in queues]
        busy = [t for t in range(tenants) if demands[t] > 0]
        if not busy or capacity <= 0:
            continue
        shares = water_fill(capacity, [demands[t] for t in busy], [weights[t] for t in busy])
        for tenant, share in zip(busy, shares, strict=True):
            for waiting in queues[tenant]:  # in arrival order
                given = min(share, waiting.remaining)
                waiting.remaining -= given
                waiting.served += given
                share -= given
            done[tenant].extend(w for w in queues[tenant] if w.remaining <= 0)
            queues[tenant] = [w for w in queues[tenant] if w.remaining > 0]
    counted = [
        math.fsum(w.served for w in done[t] + queues[t] if w.counted) for t in range(tenants)
    ]
    total = [math.fsum(w.served for w in done[t] + queues[t]) for t in range(tenants)]
    return counted, total


def delivered(requests: Sequence[Request], tenants: int, rate_tokens_per_ms: float,
              until_ms: float) -> list[float]:  # fmt: skip
    """Per tenant: what the lane's segments delivered up to ``until_ms``."""
    totals = [0.0] * tenants
    for _, tenant, size, _, start in requests:
        if math.isfinite(start) and size > 0:
            end = start + size / rate_tokens_per_ms
            totals[tenant] += max(0.0, min(end, until_ms) - start) * rate_tokens_per_ms
    return totals
