"""Replay a trace through a policy on a virtual clock: one model server, serial, non-preemptive.

Event rules (the lesson's, so its policies decide exactly as its lab did):

* the clock only moves forward; KV blocks whose residency ended at or before the clock are freed
  first, then every arrival at or before the clock is submitted (in ``(arrival_ms, request_id)``
  order), then queued requests past their deadline expire, then one request is dispatched;
* a dispatched request runs for ``execution_ms`` of its *actual* service tokens when the trace
  records them (else its estimate; the server is busy and the clock jumps to its end), its first
  token comes ``prefill_ms`` after it starts (``ttft = queue_wait + prefill_ms``), it is settled
  with its actual usage when it ends (its actual KV blocks replace the reservation then), and its
  KV stays resident for ``kv_residency_factor * execution_ms`` after it started;
* when nothing can start, the clock jumps to the next event: an arrival, a KV release, or the
  scheduler's own wake-up (a deadline, a budget refill).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Mapping, Sequence

from tokenfair_sidecar.config import Config
from tokenfair_sidecar.core import Decision, Request, make_scheduler
from tokenfair_sidecar.core.jobs import STATUS_OK


class SimulationStuckError(RuntimeError):
    """Queued work that no future event can release (a policy bug, never an input error)."""


def simulate(
    config: Config,
    requests: Sequence[Request],
    policy: str,
    actual_service_tokens: Mapping[str, int] | None = None,
    actual_kv_blocks: Mapping[str, int] | None = None,
) -> list[Decision]:
    """Run ``requests`` under ``policy``; returns one decision per request, in decision order.

    ``actual_service_tokens`` (by request id) is what a request really used: it runs for that
    long and is settled with it. ``actual_kv_blocks`` likewise replaces its KV reservation when it
    ends. Without them, the estimate is exact.
    """
    # The replay creates no reference cycles (everything it allocates is freed by reference
    # counting), so the cyclic collector only rescans the live backlog: pause it meanwhile.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _replay(
            config, requests, policy, actual_service_tokens or {}, actual_kv_blocks or {}
        )
    finally:
        if collecting:
            gc.enable()


def _replay(
    config: Config,
    requests: Sequence[Request],
    policy: str,
    actual: Mapping[str, int],
    actual_kv: Mapping[str, int],
) -> list[Decision]:
    scheduler = make_scheduler(policy, config)
    cost = scheduler.cost
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    by_id = {r.request_id: r for r in ordered}
    if len(by_id) != len(ordered):
        raise ValueError("request ids must be unique within a trace")
    # The loop runs once per event: keep everything it touches in locals.
    rate = cost.service_tokens_per_ms
    prefill_floor_ms = cost.prefill_floor_ms
    prefill_rate = cost.prefill_tokens_per_ms
    residency = cost.kv_residency_factor
    expires = scheduler.expires_queued
    submit, next_dispatch, complete = scheduler.submit, scheduler.next_dispatch, scheduler.complete
    release_kv = scheduler.release_kv
    releases: list[tuple[float, int, str]] = []  # (release_ms, tie-break, request_id)
    outcomes: list[Decision] = []
    append = outcomes.append
    heappush, heappop = heapq.heappush, heapq.heappop
    total = len(ordered)
    clock_ms = 0.0
    next_arrival = 0
    sequence = 0
    while True:
        while releases and releases[0][0] <= clock_ms:
            release_kv(heappop(releases)[2])
        while next_arrival < total and ordered[next_arrival].arrival_ms <= clock_ms:
            refusal = submit(ordered[next_arrival], clock_ms)
            if refusal is not None:
                append(refusal)
            next_arrival += 1
        if expires:
            outcomes.extend(scheduler.expire(clock_ms))
        decision = next_dispatch(clock_ms)
        if decision is None:
            queued = scheduler.queued_total
            events = []
            if next_arrival < total:
                events.append(ordered[next_arrival].arrival_ms)
            if queued:
                if releases:
                    events.append(releases[0][0])
                wakeup = scheduler.next_wakeup_ms(clock_ms)
                if wakeup is not None:
                    events.append(wakeup)
            if not events:
                if queued:
                    raise SimulationStuckError(
                        f"{policy}: {queued} request(s) queued at {clock_ms} ms with no event left"
                    )
                break
            clock_ms = max(clock_ms, min(events))
            continue
        append(decision)
        if decision.status_code != STATUS_OK:
            continue
        request_id = decision.request_id
        request = by_id[request_id]
        used = actual.get(request_id)
        execution_ms = (decision.service_tokens if used is None else used) / rate
        prefill_ms = max(prefill_floor_ms, request.prefill_tokens / prefill_rate)
        decision.ttft_ms = round(max(0.0, clock_ms - request.arrival_ms) + prefill_ms, 2)
        sequence += 1
        heappush(releases, (clock_ms + execution_ms * residency, sequence, request_id))
        clock_ms += execution_ms
        complete(
            request_id,
            clock_ms,
            used,
            actual_kv_blocks=actual_kv.get(request_id) if actual_kv else None,
            release_kv=False,
        )
    return outcomes
