"""``tokenfair simulate --autoscale``: replay a trace against a replica count that follows the
scaling signal (:mod:`tokenfair.core.demand`), and against fixed counts, on a virtual clock.

The model (docs/observability.md, "Tuning the autoscaler offline"):

* **The pool.** ``n`` replicas behind a balancer that keeps them all busy are one serial server
  ``n`` times as fast, with ``n`` times the KV blocks: the policy's ``serviceTokensPerMs`` and
  ``totalKvBlocks`` times ``n`` (the simulator's serial rules otherwise). A request therefore
  runs ``n`` times faster than it would on one replica: its TTFT is optimistic by at most its
  own execution time on one replica, for the fixed and the autoscaled runs alike.
* **The autoscaler**, as KEDA or an HPA run it: every ``interval`` it reads the pool's signal,
  ``max`` over the lanes of :meth:`DemandGauge.ratio <tokenfair.core.demand.DemandGauge.ratio>`
  (one replica's worth of demand is ``1 / n`` of the pool's), and wants
  ``ceil(n * signal / target)`` replicas, within ``[min, max]``. A scale-up takes effect
  ``scale_up_delay`` later (a replica starting); a scale-down only once every wish of the last
  ``scale_down_window`` asked for no more (the HPA's stabilization window).
* **The SLO**: an interactive request *misses* if it is refused for capacity
  (:data:`~tokenfair.core.demand.CAPACITY_REASONS`) or its TTFT is above ``slo_ttft_ms``; a
  run meets the SLO if at most ``slo_miss_budget`` of the interactive requests miss. Refusals
  for a tenant's budget are the policy working, not misses.
* **Cost**: replica-seconds, the integral of the replica count from 0 to the last event (for a
  fixed count, ``n`` times that span).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenfair.config import Config, replace_policy
from tokenfair.core import Decision, Request, make_scheduler
from tokenfair.core.demand import CAPACITY_REASONS, DemandGauge
from tokenfair.core.jobs import LANE_BATCH, LANE_INTERACTIVE, LANE_OF, STATUS_OK
from tokenfair.core.rounding import round_hundredths


@dataclass(frozen=True, slots=True)
class Autoscaler:
    """The autoscaler's settings (``--autoscale min:max`` and the ``--scale-*`` flags)."""

    min_replicas: int = 1
    max_replicas: int = 8
    target: float = 0.7
    """The signal a replica should run at (KEDA's ``threshold``, an HPA's target value)."""
    interval_ms: float = 1000.0
    scale_up_delay_ms: float = 0.0
    scale_down_window_ms: float = 5000.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"--autoscale: must be MIN:MAX with 1 <= MIN <= MAX (got {self.min_replicas}:"
                f"{self.max_replicas})"
            )
        if not (self.target > 0 and math.isfinite(self.target)):
            raise ValueError(f"--scale-target: must be a number > 0 (got {self.target})")
        if not (self.interval_ms > 0 and math.isfinite(self.interval_ms)):
            raise ValueError(f"--scale-interval-ms: must be a number > 0 (got {self.interval_ms})")
        for name, value in (
            ("--scale-up-delay-ms", self.scale_up_delay_ms),
            ("--scale-down-window-ms", self.scale_down_window_ms),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a number >= 0 (got {value})")


@dataclass(frozen=True, slots=True)
class Slo:
    """The interactive SLO a run is held to."""

    ttft_ms: float
    miss_budget: float = 0.01


@dataclass(frozen=True, slots=True)
class RunResult:
    """One replay: its cost and how it met the SLO."""

    label: str
    replica_seconds: float
    interactive_requests: int
    misses: int
    refused_for_capacity: int
    max_replicas: int
    span_ms: float
    meets_slo: bool
    replicas: tuple[tuple[float, int], ...] = ()
    """``(time, count)`` at every change (the autoscaled run)."""

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.interactive_requests if self.interactive_requests else 0.0


def pool_config(config: Config, replicas: int) -> Config:
    """``replicas`` replicas as one pooled server (the module's model)."""
    policy = config.policy
    return replace_policy(
        config,
        service_tokens_per_ms=policy.service_tokens_per_ms * replicas,
        total_kv_blocks=policy.total_kv_blocks * replicas,
    )


def _windows(config: Config) -> tuple[float, float]:
    return (config.policy.max_interactive_wait_ms, config.policy.max_batch_wait_ms)


def replay_pool(
    config: Config,
    requests: Sequence[Request],
    policy: str,
    slo: Slo,
    fixed: int | None = None,
    autoscaler: Autoscaler | None = None,
    samples: list[tuple[float, float, float]] | None = None,
    sample_every_ms: float | None = None,
) -> RunResult:
    """Replay ``requests`` on ``fixed`` replicas, or on a count ``autoscaler`` moves (starting
    at its minimum). ``samples``, when given, receives ``(time, interactive signal, batch
    signal)`` of the pool every ``sample_every_ms`` (default: at every autoscaler tick)."""
    if (fixed is None) == (autoscaler is None):
        raise ValueError("replay_pool: give exactly one of fixed and autoscaler")
    if config.policy.max_batch_requests != 1:
        raise ValueError(
            "--autoscale: the pool is modelled as serial servers (maxBatchRequests 1; got "
            f"{config.policy.max_batch_requests}): replay with --set maxBatchRequests=1 and "
            "serviceTokensPerMs at the engine's full-batch throughput"
        )
    replicas = fixed if fixed is not None else autoscaler.min_replicas  # type: ignore[union-attr]
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1 (got {replicas})")
    scheduler = make_scheduler(policy, pool_config(config, replicas))
    gauge = DemandGauge(_windows(config), scheduler.cost.service_tokens_per_ms)
    cost = scheduler.cost
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    pending: dict[str, Request] = {}
    running: dict[str, Decision] = {}
    releases: list[tuple[float, int, str]] = []
    ends: list[tuple[float, int, str, int | None]] = []  # (end, seq, id, used)
    sequence = 0
    clock_ms = 0.0
    index = 0
    misses = interactive = refused_capacity = 0
    history: list[tuple[float, int]] = [(0.0, replicas)]
    wishes: list[tuple[float, int]] = []  # (time, desired) of the last scale_down_window
    pending_up: list[tuple[float, int]] = []  # (effective time, count)
    tick_every = autoscaler.interval_ms if autoscaler is not None else math.inf
    sample_every = sample_every_ms if sample_every_ms is not None else tick_every
    next_tick = tick_every
    next_sample = sample_every if samples is not None else math.inf

    def signal(now_ms: float) -> tuple[float, float]:
        return (
            gauge.ratio(LANE_INTERACTIVE, scheduler.queued_tokens[LANE_INTERACTIVE], now_ms),
            gauge.ratio(LANE_BATCH, scheduler.queued_tokens[LANE_BATCH], now_ms),
        )

    def settle(decision: Decision) -> None:
        nonlocal misses, interactive, refused_capacity
        if decision.priority_class != "interactive":
            return
        interactive += 1
        if decision.status_code != STATUS_OK or decision.would_refuse:
            if decision.reason in CAPACITY_REASONS:
                refused_capacity += 1
                misses += 1
        elif decision.ttft_ms > slo.ttft_ms:
            misses += 1

    def resize(count: int, now_ms: float) -> None:
        nonlocal replicas
        if count == replicas:
            return
        replicas = count
        scheduler.reconfigure(pool_config(config, count), now_ms)
        gauge.retune(_windows(config), scheduler.cost.service_tokens_per_ms)
        history.append((now_ms, count))

    def refusal(decision: Decision) -> None:
        gauge.refused(decision, clock_ms)
        settle(decision)

    while True:
        # Events at the clock: ends, KV releases, scale-ups due, arrivals, expiry, dispatch.
        while ends and ends[0][0] <= clock_ms:
            _, _, request_id, used = heapq.heappop(ends)
            scheduler.complete(request_id, clock_ms, used, release_kv=False)
            gauge.ended(running.pop(request_id))
        while releases and releases[0][0] <= clock_ms:
            scheduler.release_kv(heapq.heappop(releases)[2])
        while pending_up and pending_up[0][0] <= clock_ms:
            _, count = pending_up.pop(0)
            if count > replicas:
                resize(count, clock_ms)
        while index < len(ordered) and ordered[index].arrival_ms <= clock_ms:
            request = ordered[index]
            index += 1
            refused = scheduler.submit(request, clock_ms)
            if refused is None:
                pending[request.request_id] = request
                gauge.admitted(
                    LANE_OF[request.priority_class],
                    scheduler.jobs[request.request_id].service_tokens,
                    clock_ms,
                )
            else:
                refusal(refused)
        for expired in scheduler.expire(clock_ms):
            pending.pop(expired.request_id)
            refusal(expired)
        while samples is not None and next_sample <= clock_ms:
            samples.append((next_sample, *signal(next_sample)))
            next_sample += sample_every
        if autoscaler is not None and next_tick <= clock_ms:
            next_tick += tick_every
            desired = math.ceil(replicas * max(signal(clock_ms)) / autoscaler.target)
            desired = max(autoscaler.min_replicas, min(autoscaler.max_replicas, desired))
            wishes.append((clock_ms, desired))
            horizon = clock_ms - autoscaler.scale_down_window_ms
            wishes = [(at, want) for at, want in wishes if at > horizon] or [(clock_ms, desired)]
            if desired > replicas:
                if autoscaler.scale_up_delay_ms == 0:
                    resize(desired, clock_ms)
                elif not pending_up or pending_up[-1][1] < desired:
                    pending_up.append((clock_ms + autoscaler.scale_up_delay_ms, desired))
            else:
                floor = max(want for _, want in wishes)
                if floor < replicas:
                    pending_up.clear()
                    resize(floor, clock_ms)
        if not running:
            decision = scheduler.next_dispatch(clock_ms)
            if decision is not None:
                request = pending.pop(decision.request_id)
                if decision.status_code != STATUS_OK:
                    refusal(decision)
                    continue
                prefill_ms, execution_ms, kv_hold_ms = cost.run_ms(
                    request.prefill_tokens, decision.service_tokens
                )
                wait_ms = clock_ms - decision.arrival_ms
                decision.ttft_ms = round_hundredths(max(0.0, wait_ms) + prefill_ms)
                sequence += 1
                heapq.heappush(releases, (clock_ms + kv_hold_ms, sequence, decision.request_id))
                heapq.heappush(ends, (clock_ms + execution_ms, sequence, decision.request_id, None))
                running[decision.request_id] = decision
                gauge.started(decision)
                settle(decision)
                cost = scheduler.cost
                continue
        cost = scheduler.cost
        events = []
        if ends:
            events.append(ends[0][0])
        if index < len(ordered):
            events.append(ordered[index].arrival_ms)
        if releases and scheduler.queued_total:
            events.append(releases[0][0])
        if pending_up:
            events.append(pending_up[0][0])
        if scheduler.queued_total:
            wakeup = scheduler.next_wakeup_ms(clock_ms)
            if wakeup is not None:
                events.append(wakeup)
        busy = bool(events)
        if busy and autoscaler is not None:
            events.append(next_tick)
        if busy and samples is not None:
            events.append(next_sample)
        if not busy:
            break
        clock_ms = max(clock_ms, min(events))
    span_ms = clock_ms
    history_out = tuple(history)
    replica_ms = 0.0
    for (at, count), (until, _) in zip(history, [*history[1:], (span_ms, 0)], strict=True):
        replica_ms += count * (max(until, at) - at)
    return RunResult(
        label="autoscaled" if autoscaler is not None else f"fixed {fixed}",
        replica_seconds=replica_ms / 1000.0,
        interactive_requests=interactive,
        misses=misses,
        refused_for_capacity=refused_capacity,
        max_replicas=max(count for _, count in history),
        span_ms=span_ms,
        meets_slo=interactive == 0 or misses <= slo.miss_budget * interactive,
        replicas=history_out,
    )


def compare(
    config: Config,
    requests: Sequence[Request],
    policy: str,
    autoscaler: Autoscaler,
    slo: Slo,
) -> tuple[RunResult, list[RunResult]]:
    """The autoscaled run, and fixed runs of ``min`` replicas up to the first count that meets
    the SLO (or ``max``). Fixed spans are the autoscaled run's (the same trace, the same
    horizon), so their replica-seconds compare."""
    scaled = replay_pool(config, requests, policy, slo, autoscaler=autoscaler)
    fixed_runs = []
    for count in range(autoscaler.min_replicas, autoscaler.max_replicas + 1):
        run = replay_pool(config, requests, policy, slo, fixed=count)
        span_ms = max(run.span_ms, scaled.span_ms)
        fixed_runs.append(replace(run, replica_seconds=count * span_ms / 1000.0, span_ms=span_ms))
        if run.meets_slo:
            break
    return scaled, fixed_runs


def step_trace(
    capacity_tokens_per_ms: float,
    phases: Sequence[tuple[float, float]],
    prefill_tokens: int = 280,
    decode_tokens: int = 90,
    decode_weight: float = 4.0,
    tenants: Sequence[str] = ("tenant_chat_pro", "tenant_ide_assist"),
) -> list[Request]:
    """Interactive requests at evenly spaced arrivals whose offered load is, phase by phase,
    ``load`` times ``capacity_tokens_per_ms`` for ``duration_ms`` (``phases``: ``(load,
    duration_ms)``), alternating between ``tenants``. Deterministic."""
    size = prefill_tokens + math.ceil(decode_weight * decode_tokens)
    requests = []
    start_ms = 0.0
    number = 0
    for load, duration_ms in phases:
        if load > 0:
            gap_ms = size / (load * capacity_tokens_per_ms)
            at_ms = start_ms
            while at_ms < start_ms + duration_ms:
                tenant = tenants[number % len(tenants)]
                requests.append(
                    Request(
                        f"s{number:06d}",
                        tenant,
                        round(at_ms, 3),
                        prefill_tokens,
                        decode_tokens,
                        "interactive",
                    )
                )
                number += 1
                at_ms += gap_ms
        start_ms += duration_ms
    return requests
