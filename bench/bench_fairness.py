"""Fairness scenario suite (issue 10): tenant-aware admission, accounting in actual tokens, lending.

Not part of the test suite. Each scenario is a seeded synthetic workload over a window of
``--window`` seconds (60 by default), replayed through ``simulator.simulate(config, requests,
policy, actual)`` — a virtual clock, one serial server of capacity ``C =
policy.service_tokens_per_ms`` (45 service tokens/ms by default) — under ``tokenfair`` (the
figures with targets) and under the lesson's ``service_token_drr_with_admission`` (a reference
column, no targets). Each figure is printed next to its target with PASS/FAIL, then one summary
line; the exit code is 0, or with ``--strict`` 1 when a target is not met.

A request costs ``prefill + ceil(decodeWeight * decode)`` service tokens (``costmodel``);
interactive requests are 200 prompt + 50 output tokens (400 service tokens) unless a scenario says
otherwise. Budgets are non-binding (burst and sustained rate 10^9) unless the scenario is about
budgets; the policy is the default one. ``actual`` maps request id to the service tokens a request
really used where that differs from its estimate (the under-declarer).

Figures (``tokenfair/sim/fairness.py`` computes all but one; the window is ``[0, window]``,
sizes are actual service tokens where known, else the estimate):

* **demand served** of a tenant = service tokens of its requests that arrived in the window and
  were dispatched / service tokens of those offered;
* **utilisation** = service tokens dispatched in the window / (C * window);
* **admitted-then-expired, per lane** = requests of the lane that passed admission and were
  refused later (from the queue, ``shed_queue_timeout``, or at dispatch) / requests of the lane
  that passed admission;
* **Jain per lane, fluid reference** (scenarios 3 and 9) = ``(sum x)^2 / (n * sum x^2)`` over
  ``x = served / fluid reference`` of the lane's tenants (docs/report.md: what a weighted
  max-min fluid server would have given each tenant out of the lane's own service, moment by
  moment), counted over the arrivals of ``[0, window - maxBatchWaitMs]`` (:func:`settled`: the
  end of a finite trace is a drain, not load); the same over the whole window and the lowest
  ``x`` of a tenant are printed beside it;
* **Jain per lane, windowed share** = the same over ``x = served / fair share``, the fair share
  being the weighted max-min share (``water_fill``) of what the lane served over the window,
  given each tenant's offered tokens as its demand (information: the reference the targets were
  first stated in);
* **refusals while idle** (computed here): refusals (status 429) decided at a time ``t`` when no
  dispatched request was executing, i.e. ``t`` in no ``[dispatch_ms, dispatch_ms + size / C)``.
  ``t`` is the arrival for a refusal at admission, ``arrival + queue_wait_ms`` (rounded to
  0.01 ms by the core) for one from the queue or at dispatch. Split in two: *KV room* — the
  refused request also fit the KV cache at ``t`` (blocks resident then, each dispatched request
  holding its blocks for ``kvResidencyFactor * size / C`` as the simulator keeps them, plus its
  own, within its class watermark): the server had room for it, the target is 0; *KV full* —
  the cache was held (by requests that finished executing but whose KV is still resident), so
  the request could not have started then (printed, no target);
* **interactive p99 TTFT**: ``report.summarize`` (nearest rank) over dispatched interactive
  requests;
* diagnostics of scenario 3's batch Jain (computed here, no target): Jain over ``min(1, x)``;
  the share of the lane's service *started alone* — dispatched while no other admitted request
  of either lane waited, work the server had for nobody else at that moment, which any
  work-conserving policy serves; and Jain with the part of a tenant's service above its
  max-min share that started alone not counted (``x = max(fair, served - alone) / fair`` for a
  tenant above its share).

Scenarios (rates in units of C; Poisson = exponential gaps, constant = evenly spaced):

1. flood — equal weights, interactive: A Poisson 3 C, B Poisson 0.4 C.
   B demand served >= 0.97, utilisation >= 0.98, expired <= 0.02.
2. weighted flood — weights 3:1: the weight-3 tenant Poisson 0.7 C, the weight-1 one Poisson 3 C.
   Weight-3 demand served >= 0.97, utilisation >= 0.98, expired <= 0.02.
3. many tenants — 100 tenants (odd Zipf ranks interactive, even batch; weights 1, 2 or 4),
   Zipf rates (s = 1) over the ranks summing to 1.5 C, each tenant Poisson; log-normal lengths
   (sigma 0.6; medians interactive 200/50, batch 2000/300), clamped so no request's KV passes
   the batch watermark.
   Jain against the fluid reference >= 0.95 in each lane at every seed (>= 0.97 mean over the
   seeds of ``--seeds``); interactive p99 TTFT <= maxInteractiveWaitMs + the largest
   interactive prefill time; expired <= 0.02 per lane.
4. KV-heavy neighbour — interactive: a small tenant (200+50) Poisson 1.0 C next to a tenant
   flooding constant 1.0 C of 12000+200 requests (763 KV blocks, 48 % of the cache each).
   Utilisation >= 0.97, refusals while idle with KV room = 0, expired <= 0.02.
5. over-share — equal interactive tenants, A Poisson 1.0 C, B Poisson 0.5 C: expired <= 0.02.
   batch minimum share — two interactive tenants Poisson 0.65 C each, a batch tenant constant
   0.5 C of 3200+350 requests: expired <= 0.02 (the batch share of service is printed).
6. under-declarer — equal interactive tenants, each Poisson 1.0 C of declared tokens: the liar
   declares 200+16 (264) and uses 200 + 4*2000 = 8200; the honest one declares and uses 200+500
   (2200). Liar's share of actual service (liar / (liar + honest) served) <= 0.55.
7. idle capacity — one interactive tenant alone, Poisson 1.2 C, bucket burst 20000 and sustained
   0.5 C: utilisation with lending off (budgets cap: ~0.5 expected) and on (>= 0.97;
   ``PolicyConfig.lend_idle_capacity``, "not available" on a core without it).
8. no regression — the lesson fixture (``scenarios.SCENARIOS["noisy-neighbor"]``): 60/60 admitted,
   interactive p99 TTFT <= 358.97 ms.
9. many tenants, heavy-tailed sizes — scenario 3's tenants, weights and rates (its own random
   streams), log-normal lengths of sigma 1.0 (same medians), prompts <= 8000 tokens, outputs
   <= 2000, arrival rates from the clamped lengths' mean. Targets as scenario 3.

Every scenario's admitted-then-expired is per lane (<= 0.02 in each lane offered requests).

Seeded (``--seed``): every tenant draws from its own ``random.Random`` seeded with the seed, the
scenario and the tenant, so the output is the same on every run. ``--seeds 1-32`` runs the
scenarios (3 and 9 by default) at every seed and prints a line per seed, then each figure's
mean, minimum and maximum beside its targets: the mean's (``Row.mean_target``) and every
seed's.

The core under test is whichever ``tokenfair`` Python imports; ``--core-path DIR`` runs
the bench again with ``DIR`` first on ``PYTHONPATH`` (for instance a ``git worktree`` of the
commit before a change). ``fairness.py`` is always loaded by path from this bench's checkout
(and ``fluid.py`` when that core has none), so an older core is measured by the current
definitions.

    .venv/bin/python bench/bench_fairness.py                  # every scenario, 60 s windows
    .venv/bin/python bench/bench_fairness.py --quick          # 15 s windows (smoke run)
    .venv/bin/python bench/bench_fairness.py --seeds 1-32     # scenarios 3 and 9, 32 seeds
    .venv/bin/python bench/bench_fairness.py --scenarios 1,4 --seed 7 --strict
    .venv/bin/python bench/bench_fairness.py --core-path OTHER_CHECKOUT   # another core

Figures and how to read them: bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import random
import sys
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from bench_core import core_kind

from tokenfair.config import (
    PRIORITY_CLASSES,
    Config,
    PolicyConfig,
    PriorityClass,
    TenantConfig,
    build_config,
)
from tokenfair.core import Decision, Request
from tokenfair.core.cost import CostModel
from tokenfair.core.jobs import STATUS_SHED
from tokenfair.sim.report import summarize
from tokenfair.sim.scenarios import SCENARIOS
from tokenfair.sim.simulator import simulate

if TYPE_CHECKING:
    from tokenfair.sim.fairness import FairnessReport

TOKENFAIR: Final = "tokenfair"
LESSON_DRR: Final = "service_token_drr_with_admission"
DEFAULT_SEED: Final = 20261130
UNLIMITED: Final = 10**9
"""Burst and sustained rate of a non-binding budget."""
INTERACTIVE_SIZE: Final = (200, 50)
LOGNORMAL_SIGMA: Final = 0.6
HEAVY_SIGMA: Final = 1.0
"""The log-normal sigma of scenario 9's prompt and output lengths (heavy tails)."""
CHECKOUT: Final = Path(__file__).resolve().parent.parent
FAIRNESS_FILE: Final = CHECKOUT / "sidecar" / "tokenfair" / "sim" / "fairness.py"
FLUID_FILE: Final = CHECKOUT / "sidecar" / "tokenfair" / "sim" / "fluid.py"
CORE_ENV: Final = "TOKENFAIR_BENCH_CORE"
"""Set when the bench re-ran itself for ``--core-path`` (so it does so once)."""


# ---------------------------------------------------------------------------------------------
# Seeded workload generators


def rng_for(seed: int, *names: str) -> random.Random:
    """An independent stream per (seed, scenario, tenant); str seeds hash the same in every run."""
    return random.Random(":".join([str(seed), *names]))


def poisson_arrivals(rng: random.Random, per_ms: float, window_ms: float) -> list[float]:
    """Arrival times of a Poisson process of ``per_ms`` requests per ms over ``[0, window)``."""
    times: list[float] = []
    at_ms = rng.expovariate(per_ms)
    while at_ms < window_ms:
        times.append(round(at_ms, 3))
        at_ms += rng.expovariate(per_ms)
    return times


def constant_arrivals(per_ms: float, window_ms: float, phase_ms: float = 0.0) -> list[float]:
    """Evenly spaced arrivals, ``per_ms`` per ms from ``phase_ms`` over ``[0, window)``."""
    gap_ms = 1.0 / per_ms
    count = math.ceil((window_ms - phase_ms) / gap_ms)
    times = (round(phase_ms + i * gap_ms, 3) for i in range(count))
    return [t for t in times if t < window_ms]


def zipf_shares(count: int, exponent: float) -> list[float]:
    """Shares of ranks 1..count under Zipf's law, ``k^-s / sum_j j^-s`` (they sum to 1)."""
    raw = [rank**-exponent for rank in range(1, count + 1)]
    total = math.fsum(raw)
    return [value / total for value in raw]


def lognormal_tokens(rng: random.Random, median: float, sigma: float) -> int:
    """A log-normal token count of the given median (``exp(mu)``), at least 1."""
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def lognormal_mean(median: float, sigma: float) -> float:
    return median * math.exp(sigma * sigma / 2.0)


def tenant(
    tenant_id: str,
    weight: float = 1.0,
    priority_class: PriorityClass = "interactive",
    burst: int = UNLIMITED,
    sustained_per_s: float = float(UNLIMITED),
) -> TenantConfig:
    return TenantConfig(
        tenant_id=tenant_id,
        weight=weight,
        burst_service_tokens=burst,
        sustained_service_tokens_per_second=sustained_per_s,
        priority_class=priority_class,
    )


def fixed_size(
    tenant_id: str,
    priority_class: PriorityClass,
    times: Iterable[float],
    prefill: int,
    decode: int,
) -> list[Request]:
    return [
        Request(f"{tenant_id}-{i:06d}", tenant_id, at_ms, prefill, decode, priority_class)
        for i, at_ms in enumerate(times)
    ]


@dataclass(frozen=True)
class Workload:
    config: Config
    requests: list[Request]
    actual: dict[str, int] = field(default_factory=dict)
    """Actual service tokens by request id, where they differ from the estimate."""

    @property
    def capacity(self) -> float:
        return self.config.policy.service_tokens_per_ms

    @property
    def cost(self) -> CostModel:
        return CostModel.from_policy(self.config.policy)

    def per_ms(self, load_c: float, prefill: int, decode: int) -> float:
        """Requests per ms of ``prefill+decode`` requests that offer ``load_c`` times C."""
        return load_c * self.capacity / self.cost.service_tokens(prefill, decode)


def build(tenants: Sequence[TenantConfig], policy: PolicyConfig | None = None) -> Workload:
    return Workload(build_config(policy or PolicyConfig(), tenants), [])


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass(frozen=True)
class Target:
    op: Literal[">=", "<=", "=="]
    bound: float
    spec: str = ".2f"

    def met(self, value: float) -> bool:
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        return value == self.bound

    def __str__(self) -> str:
        return f"{self.op} {self.bound:{self.spec}}"


@dataclass(frozen=True)
class Row:
    """One figure: tokenfair's value, its target (None: informational) and the lesson's value."""

    figure: str
    value: float | None
    target: Target | None = None
    reference: float | None = None
    spec: str = ".3f"
    mean_target: Target | None = None
    """A target for the mean over seeds (``--seeds``), beside ``target`` at every seed."""
    short: str = ""
    """Its column heading in the ``--seeds`` table (shown there when it has one)."""

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.value is not None and self.target.met(self.value)


@dataclass
class Block:
    number: str
    title: str
    notes: list[str] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """One replay of a workload under one policy, and its fairness report."""

    policy: str
    decisions: list[Decision]
    report: FairnessReport

    def demand_served(self, tenant_id: str) -> float | None:
        return self.report.tenants[tenant_id].demand_served

    def served(self, tenant_ids: Iterable[str]) -> int:
        return sum(self.report.tenants[t].served_service_tokens for t in tenant_ids)

    def refusals(self) -> str:
        counts: dict[str, int] = {}
        for t in self.report.tenants.values():
            for reason, n in t.refused_by_reason.items():
                counts[reason] = counts.get(reason, 0) + n
        text = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
        return text or "none"


def replay(workload: Workload, policy: str, window_ms: float) -> Run:
    from tokenfair.sim.fairness import fairness_report

    decisions = simulate(workload.config, workload.requests, policy, workload.actual)
    report = fairness_report(
        decisions,
        workload.config,
        actual_service_tokens=workload.actual,
        window_ms=(0.0, window_ms),
    )
    return Run(policy, decisions, report)


def both(workload: Workload, window_ms: float) -> tuple[Run, Run]:
    """The workload under tokenfair and under the lesson's DRR (the reference column)."""
    return replay(workload, TOKENFAIR, window_ms), replay(workload, LESSON_DRR, window_ms)


def refusals_while_idle(run: Run, workload: Workload) -> tuple[int, int]:
    """Refusals decided while no dispatched request was executing (see the module docstring):
    ``(all of them, those whose request also fit the KV cache then)``. The second is the
    server having room for the request: the KV blocks resident at ``t`` (each dispatched
    request holds its blocks for ``kvResidencyFactor`` times its execution time, as the
    simulator keeps them) plus the request's own are within its class watermark."""
    from tokenfair.sim.fairness import request_size

    capacity = workload.capacity
    actual = workload.actual
    cost = workload.cost
    policy = workload.config.policy
    blocks = {
        r.request_id: cost.kv_blocks(r.prefill_tokens, r.decode_tokens) for r in workload.requests
    }
    spans = sorted(
        (d.dispatch_ms, d.dispatch_ms + request_size(d, actual) / capacity, d.request_id)
        for d in run.decisions
        if d.admitted and d.dispatch_ms is not None
    )
    starts = [start for start, _, _ in spans]
    reach = list(accumulate((end for _, end, _ in spans), max))  # latest end of spans so far
    holds = [
        (start, start + (end - start) * policy.kv_residency_factor, rid)
        for start, end, rid in spans
    ]
    idle = idle_with_room = 0
    for d in run.decisions:
        if d.status_code != STATUS_SHED:
            continue
        at_ms = d.arrival_ms if d.gate == "admission" else d.arrival_ms + d.queue_wait_ms
        index = bisect_right(starts, at_ms) - 1
        if index >= 0 and reach[index] > at_ms:
            continue
        idle += 1
        resident = sum(
            b for start, end, rid in holds[: index + 1] if end > at_ms for b in (blocks[rid],)
        )
        watermark = (
            policy.interactive_kv_watermark
            if d.priority_class == "interactive"
            else policy.batch_kv_watermark
        )
        if resident + blocks[d.request_id] <= watermark * policy.total_kv_blocks:
            idle_with_room += 1
    return idle, idle_with_room


def lane_expired(run: Run, lane: str) -> float | None:
    """Admitted-then-expired of one lane: its tenants' expired / admitted requests."""
    tenants = [t for t in run.report.tenants.values() if t.priority_class == lane]
    admitted = sum(t.admitted_requests for t in tenants)
    expired = sum(t.admitted_then_expired for t in tenants)
    return expired / admitted if admitted else None


def expired_rows(new: Run, old: Run) -> list[Row]:
    """Admitted-then-expired per lane that was offered any request, with its target (<= 0.02
    in every scenario, at every seed)."""
    rows = []
    for lane in PRIORITY_CLASSES:
        offered = sum(
            t.offered_requests for t in new.report.tenants.values() if t.priority_class == lane
        )
        if offered:
            rows.append(
                Row(
                    f"admitted-then-expired, {lane}",
                    lane_expired(new, lane),
                    Target("<=", 0.02),
                    lane_expired(old, lane),
                    short=f"exp {lane[:5]}",
                )
            )
    return rows


def settled(run: Run, workload: Workload, window_ms: float) -> FairnessReport:
    """The run's fairness over the arrivals of ``[0, window - maxBatchWaitMs]``: what the fluid
    targets are measured on. A request that arrives within one wait limit of the end of the
    trace meets a server that drains and stops, not continuing load: the lane serves whatever
    it admitted at full speed while the fluid server, whose capacity stops with it, splits the
    drain with every tenant still waiting, so a light tenant served last reads as served many
    times its share (6.8 times at seed 3 of scenario 3, Jain 0.67 over the whole window and 0.96
    without its last 3.5 s). Every request still competes: only the counting stops early."""
    from tokenfair.sim.fairness import fairness_report

    settle_ms = workload.config.policy.max_batch_wait_ms
    return fairness_report(
        run.decisions,
        workload.config,
        actual_service_tokens=workload.actual,
        window_ms=(0.0, max(window_ms - settle_ms, window_ms / 2)),
    )


def fluid_rows(
    new: FairnessReport,
    old: FairnessReport,
    new_whole: FairnessReport,
    old_whole: FairnessReport,
) -> list[Row]:
    """Per lane: Jain against the fluid reference over the settled window (:func:`settled`;
    >= 0.95 at every seed, >= 0.97 on average over the seeds of ``--seeds``), the lowest
    served/fluid of a tenant there, the same Jain over the whole window and Jain against the
    windowed max-min share (information: the reference the targets were first stated in)."""
    rows = []
    for lane in PRIORITY_CLASSES:
        rows.append(
            Row(
                f"Jain {lane}, fluid reference",
                new.fluid_jain_by_lane.get(lane),
                Target(">=", 0.95),
                old.fluid_jain_by_lane.get(lane),
                mean_target=Target(">=", 0.97),
                short=f"Jfl {lane[:5]}",
            )
        )
    for lane in PRIORITY_CLASSES:
        worst, worst_old = new.fluid_worst_by_lane.get(lane), old.fluid_worst_by_lane.get(lane)
        rows.append(
            Row(
                f"worst served/fluid, {lane}",
                None if worst is None else worst.served_over_fluid,
                None,
                None if worst_old is None else worst_old.served_over_fluid,
                short=f"min {lane[:5]}",
            )
        )
    for lane in PRIORITY_CLASSES:
        rows.append(
            Row(
                f"Jain {lane}, fluid, whole window",
                new_whole.fluid_jain_by_lane.get(lane),
                None,
                old_whole.fluid_jain_by_lane.get(lane),
                short=f"Jfw {lane[:5]}",
            )
        )
    for lane in PRIORITY_CLASSES:
        rows.append(
            Row(
                f"Jain {lane}, windowed share",
                new_whole.jain_by_lane[lane],
                None,
                old_whole.jain_by_lane[lane],
                short=f"Jwin {lane[:5]}",
            )
        )
    return rows


def worst_note(report: FairnessReport, label: str) -> str:
    """Which tenant is the worst of each lane against the fluid reference."""
    parts = []
    for lane in PRIORITY_CLASSES:
        worst = report.fluid_worst_by_lane.get(lane)
        if worst is not None:
            tenant = report.tenants[worst.tenant_id]
            parts.append(
                f"{lane} {worst.tenant_id} (weight {tenant.weight:g}, "
                f"{tenant.served_service_tokens}/{tenant.fluid_reference_service_tokens:.0f} "
                "tokens)"
            )
    return f"worst against the fluid reference, {label}: {'; '.join(parts) or 'none'}"


def offered_note(workload: Workload, window_ms: float) -> str:
    cost = workload.cost
    tokens = sum(
        workload.actual.get(r.request_id, cost.service_tokens(r.prefill_tokens, r.decode_tokens))
        for r in workload.requests
    )
    return (
        f"offered {tokens / (workload.capacity * window_ms):.2f} C over {window_ms / 1000:g} s "
        f"({len(workload.requests)} requests); C = {workload.capacity:g} service tokens/ms"
    )


def refusal_notes(new: Run, old: Run) -> list[str]:
    return [f"refused, tokenfair: {new.refusals()}", f"refused, lesson DRR: {old.refusals()}"]


# ---------------------------------------------------------------------------------------------
# Scenarios


def flood(seed: int, window_ms: float) -> Block:
    w = build([tenant("A"), tenant("B")])
    p, d = INTERACTIVE_SIZE
    for name, load in (("A", 3.0), ("B", 0.4)):
        times = poisson_arrivals(rng_for(seed, "flood", name), w.per_ms(load, p, d), window_ms)
        w.requests.extend(fixed_size(name, "interactive", times, p, d))
    new, old = both(w, window_ms)
    block = Block(
        "1", "flood", ["equal weights, interactive 200+50: A Poisson 3 C, B Poisson 0.4 C"]
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        Row("B demand served", new.demand_served("B"), Target(">=", 0.97), old.demand_served("B")),
        Row("A demand served", new.demand_served("A"), None, old.demand_served("A")),
        Row("utilisation", new.report.utilisation, Target(">=", 0.98), old.report.utilisation),
        *expired_rows(new, old),
    ]
    return block


def weighted_flood(seed: int, window_ms: float) -> Block:
    w = build([tenant("heavy3", weight=3.0), tenant("flood1", weight=1.0)])
    p, d = INTERACTIVE_SIZE
    times = poisson_arrivals(rng_for(seed, "weighted", "heavy3"), w.per_ms(0.7, p, d), window_ms)
    w.requests.extend(fixed_size("heavy3", "interactive", times, p, d))
    times = poisson_arrivals(rng_for(seed, "weighted", "flood1"), w.per_ms(3.0, p, d), window_ms)
    w.requests.extend(fixed_size("flood1", "interactive", times, p, d))
    new, old = both(w, window_ms)
    block = Block(
        "2",
        "weighted flood",
        ["interactive 200+50: heavy3 (weight 3) Poisson 0.7 C, flood1 (weight 1) Poisson 3 C"],
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        Row(
            "weight-3 demand served",
            new.demand_served("heavy3"),
            Target(">=", 0.97),
            old.demand_served("heavy3"),
        ),
        Row(
            "weight-1 demand served", new.demand_served("flood1"), None, old.demand_served("flood1")
        ),
        Row("utilisation", new.report.utilisation, Target(">=", 0.98), old.report.utilisation),
        *expired_rows(new, old),
    ]
    return block


def jain_capped(run: Run, lane: str) -> float | None:
    """Jain's index of the lane over ``min(1, served / fair)``: what is left of the unfairness
    when service above a tenant's max-min share is not counted against it (a diagnostic: a
    work-conserving server gives a heavy tenant what nobody else asked for at that moment,
    which the window's max-min share counts as taken from the others)."""
    ratios = [
        min(1.0, t.served_over_fair)
        for t in run.report.tenants.values()
        if t.priority_class == lane and t.served_over_fair is not None
    ]
    if not ratios or not any(ratios):
        return None
    return sum(ratios) ** 2 / (len(ratios) * sum(x * x for x in ratios))


def started_alone_tokens(run: Run, window_ms: float, lane: str) -> dict[str, int]:
    """Per tenant of ``lane``: service tokens of its requests (arrived in the window) dispatched
    while no other admitted request of either lane was waiting — work the server had for nobody
    else at that moment, so any work-conserving policy serves it. A request waits from its
    arrival until its dispatch, or until its refusal from the queue."""
    starts: list[float] = []
    ends: list[float] = []
    for d in run.decisions:
        if d.gate == "admission":
            continue
        starts.append(d.arrival_ms)
        ends.append(d.dispatch_ms if d.dispatch_ms is not None else d.arrival_ms + d.queue_wait_ms)
    starts.sort()
    ends.sort()
    alone: dict[str, int] = {}
    for d in run.decisions:
        if d.priority_class != lane or not d.admitted or d.dispatch_ms is None:
            continue
        if d.arrival_ms > window_ms:
            continue
        # Waiting at t: arrived at or before t, not yet gone ([arrival, leave) covers t).
        t = d.dispatch_ms
        if bisect_right(starts, t) - bisect_right(ends, t) <= 0:
            alone[d.tenant_id] = alone.get(d.tenant_id, 0) + d.service_tokens
    return alone


def started_alone_rows(run: Run, window_ms: float, lane: str) -> list[Row]:
    """Diagnostics of the lane's Jain: the share of its service started alone
    (:func:`started_alone_tokens`), and Jain with the part of each tenant's service above its
    max-min share that was started alone not counted — ``max(fair, served - alone) / fair``
    for a tenant served above its share, ``served / fair`` otherwise."""
    alone = started_alone_tokens(run, window_ms, lane)
    tenants = [t for t in run.report.tenants.values() if t.priority_class == lane]
    served = sum(t.served_service_tokens for t in tenants)
    ratios = []
    for t in tenants:
        if t.served_over_fair is None:
            continue
        fair = t.fair_share_service_tokens
        kept = float(t.served_service_tokens)
        if kept > fair:
            kept = max(fair, kept - alone.get(t.tenant_id, 0))
        ratios.append(kept / fair)
    jain = None
    if ratios and any(ratios):
        jain = sum(ratios) ** 2 / (len(ratios) * sum(x * x for x in ratios))
    share = sum(alone.values()) / served if served else None
    return [
        Row(f"{lane} service started alone (share)", share),
        Row(f"Jain {lane}, w/o excess started alone", jain),
    ]


@dataclass(frozen=True)
class ZipfSizes:
    """How the 100-tenant Zipf scenarios size their requests: log-normal prompt and output
    lengths of the given medians (by lane) and ``sigma``, each clamped."""

    sigma: float
    medians: dict[PriorityClass, tuple[float, float]]
    """(prompt, output) median tokens by lane."""
    max_prompt_tokens: int | None
    """None: ``token_limit - output`` (scenario 3, within the batch KV watermark)."""
    max_output_tokens: int | None
    """None: ``token_limit // 4`` (scenario 3)."""
    stream: str
    """The name in the seeds of its random streams (each scenario draws its own)."""
    clamped_mean: bool
    """Set the arrival rates from the clamped lengths' mean (else the unclamped log-normal
    mean, as scenario 3 always did: its workload stays the one its figures were measured on)."""


NARROW_SIZES: Final = ZipfSizes(
    LOGNORMAL_SIGMA,
    {"interactive": (200.0, 50.0), "batch": (2000.0, 300.0)},
    None,
    None,
    "many",
    clamped_mean=False,
)
HEAVY_SIZES: Final = ZipfSizes(
    HEAVY_SIGMA,
    {"interactive": (200.0, 50.0), "batch": (2000.0, 300.0)},
    8000,
    2000,
    "many-heavy",
    clamped_mean=True,
)


def clamped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """``E[min(X, cap)]`` for ``X`` log-normal of that median and ``sigma``:
    ``exp(mu + sigma^2/2) * Phi((ln cap - mu - sigma^2) / sigma) + cap * (1 - Phi((ln cap -
    mu) / sigma))``, ``mu = ln median``."""

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    mu, log_cap = math.log(median), math.log(cap)
    below = math.exp(mu + sigma * sigma / 2.0) * phi((log_cap - mu - sigma * sigma) / sigma)
    return below + cap * (1.0 - phi((log_cap - mu) / sigma))


def many_tenants(seed: int, window_ms: float) -> Block:
    return zipf_tenants(seed, window_ms, NARROW_SIZES, "3", "many tenants")


def many_tenants_heavy_tails(seed: int, window_ms: float) -> Block:
    return zipf_tenants(seed, window_ms, HEAVY_SIZES, "9", "many tenants, heavy-tailed sizes")


@dataclass
class ZipfWorkload:
    """A 100-tenant Zipf workload (scenarios 3 and 9) and what its block prints about it."""

    workload: Workload
    lane_load: dict[str, float]
    """Offered load by lane, in units of C."""
    largest_prefill_ms: float
    """The largest interactive prefill time (the p99 TTFT bound's second term)."""
    token_limit: int
    """No request's prompt + output passes it (the batch KV watermark)."""


def zipf_workload(seed: int, window_ms: float, sizing: ZipfSizes) -> ZipfWorkload:
    """Scenario 3's (``NARROW_SIZES``) or 9's (``HEAVY_SIZES``) tenants and requests at ``seed``
    (also read by ``diagnose_batch_jain.py``)."""
    count, total_load = 100, 1.5
    shares = zipf_shares(count, 1.0)
    rng = rng_for(seed, sizing.stream)
    policy = PolicyConfig()
    cost = CostModel.from_policy(policy)
    # No request's KV may pass the batch watermark: p + d <= blocks * block_tokens.
    kv_limit = math.floor(policy.batch_kv_watermark * policy.total_kv_blocks + 1e-9)
    token_limit = kv_limit * policy.kv_block_tokens
    max_output = sizing.max_output_tokens or token_limit // 4
    sigma = sizing.sigma
    tenants: list[TenantConfig] = []
    for rank in range(1, count + 1):
        # Alternate ranks, so both lanes hold heavy and light tenants and both are contended.
        klass: PriorityClass = "interactive" if rank % 2 else "batch"
        weight = rng.choice((1.0, 1.0, 1.0, 2.0, 4.0))
        tenants.append(tenant(f"{klass[:3]}-r{rank:03d}", weight, klass))
    order = list(tenants)
    rng.shuffle(order)  # DRR visiting order: not by rank
    w = build(order, policy)
    lane_load: dict[str, float] = {"interactive": 0.0, "batch": 0.0}
    largest_prefill_ms = 0.0
    for rank, t in enumerate(tenants, start=1):
        median_p, median_d = sizing.medians[t.priority_class]
        if sizing.clamped_mean:
            max_prompt = sizing.max_prompt_tokens or token_limit - max_output
            mean_cost = clamped_lognormal_mean(median_p, sigma, max_prompt) + (
                policy.decode_weight * clamped_lognormal_mean(median_d, sigma, max_output)
            )
        else:
            mean_cost = lognormal_mean(median_p, sigma) + policy.decode_weight * (
                lognormal_mean(median_d, sigma)
            )
        load = total_load * shares[rank - 1]
        lane_load[t.priority_class] += load
        trng = rng_for(seed, sizing.stream, t.tenant_id)
        times = poisson_arrivals(trng, load * w.capacity / mean_cost, window_ms)
        for i, at_ms in enumerate(times):
            decode = min(lognormal_tokens(trng, median_d, sigma), max_output)
            prefill_cap = sizing.max_prompt_tokens or token_limit - decode
            prefill = min(lognormal_tokens(trng, median_p, sigma), prefill_cap)
            w.requests.append(
                Request(
                    f"{t.tenant_id}-{i:06d}", t.tenant_id, at_ms, prefill, decode, t.priority_class
                )
            )
            if t.priority_class == "interactive":
                largest_prefill_ms = max(largest_prefill_ms, cost.prefill_ms(prefill))
    return ZipfWorkload(w, lane_load, largest_prefill_ms, token_limit)


def zipf_tenants(seed: int, window_ms: float, sizing: ZipfSizes, number: str, title: str) -> Block:
    zipf = zipf_workload(seed, window_ms, sizing)
    w, lane_load, token_limit = zipf.workload, zipf.lane_load, zipf.token_limit
    largest_prefill_ms = zipf.largest_prefill_ms
    policy = w.config.policy
    sigma = sizing.sigma
    new, old = both(w, window_ms)
    new_settled, old_settled = settled(new, w, window_ms), settled(old, w, window_ms)
    ttft_bound = policy.max_interactive_wait_ms + largest_prefill_ms
    if sizing.max_prompt_tokens is None:
        clamp = f"prefill + decode clamped to {token_limit} tokens (the batch KV watermark)"
    else:
        clamp = (
            f"prompts clamped to {sizing.max_prompt_tokens} tokens, outputs to "
            f"{sizing.max_output_tokens}; arrival rates from the clamped lengths' mean"
        )
    block = Block(
        number,
        title,
        [
            "50 interactive + 50 batch tenants (odd and even Zipf ranks), weights 1/2/4; Poisson "
            "at Zipf(s=1) rates, 1.5 C in all",
            f"log-normal sizes (sigma {sigma:g}): medians interactive 200+50, batch 2000+300",
            clamp,
        ],
    )
    block.notes += [
        offered_note(w, window_ms),
        f"Zipf load by lane: interactive {lane_load['interactive']:.2f} C, batch "
        f"{lane_load['batch']:.2f} C; largest interactive prefill {largest_prefill_ms:.2f} ms",
        *refusal_notes(new, old),
        f"fluid figures over arrivals in [0, {new_settled.window_ms[1] / 1000:g} s] (the "
        "last wait limit left out: bench/README.md), the others over the whole window",
        worst_note(new_settled, "tokenfair"),
    ]
    block.rows += [
        *fluid_rows(new_settled, old_settled, new.report, old.report),
        Row(
            "Jain batch, served/fair capped at 1",
            jain_capped(new, "batch"),
            None,
            jain_capped(old, "batch"),
        ),
        *(
            dataclasses.replace(mine, reference=theirs.value)
            for mine, theirs in zip(
                started_alone_rows(new, window_ms, "batch"),
                started_alone_rows(old, window_ms, "batch"),
                strict=True,
            )
        ),
        Row(
            "interactive p99 TTFT ms",
            float(summarize(new.decisions)["interactive_p99_ttft_ms"]),
            Target("<=", round(ttft_bound, 2)),
            float(summarize(old.decisions)["interactive_p99_ttft_ms"]),
            ".2f",
            short="p99 ms",
        ),
        Row("utilisation", new.report.utilisation, None, old.report.utilisation),
        *expired_rows(new, old),
    ]
    return block


def kv_heavy(seed: int, window_ms: float) -> Block:
    w = build([tenant("small"), tenant("kvheavy")])
    p, d = INTERACTIVE_SIZE
    times = poisson_arrivals(rng_for(seed, "kv", "small"), w.per_ms(1.0, p, d), window_ms)
    w.requests.extend(fixed_size("small", "interactive", times, p, d))
    heavy_p, heavy_d = 12_000, 200
    times = constant_arrivals(w.per_ms(1.0, heavy_p, heavy_d), window_ms, phase_ms=1.0)
    w.requests.extend(fixed_size("kvheavy", "interactive", times, heavy_p, heavy_d))
    new, old = both(w, window_ms)
    idle_new, idle_old = refusals_while_idle(new, w), refusals_while_idle(old, w)
    blocks = w.cost.kv_blocks(heavy_p, heavy_d)
    share = blocks / w.config.policy.total_kv_blocks
    block = Block(
        "4",
        "KV-heavy neighbour",
        [
            "interactive: small 200+50 Poisson 1.0 C; kvheavy 12000+200 constant 1.0 C",
            f"a kvheavy request holds {blocks} KV blocks ({share:.1%} of the cache)",
        ],
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        Row("utilisation", new.report.utilisation, Target(">=", 0.97), old.report.utilisation),
        Row(
            "refusals while idle, KV room",
            idle_new[1],
            Target("==", 0, ".0f"),
            idle_old[1],
            ".0f",
        ),
        Row(
            "refusals while idle, KV full",
            idle_new[0] - idle_new[1],
            None,
            idle_old[0] - idle_old[1],
            ".0f",
        ),
        Row("small demand served", new.demand_served("small"), None, old.demand_served("small")),
        Row(
            "kvheavy demand served",
            new.demand_served("kvheavy"),
            None,
            old.demand_served("kvheavy"),
        ),
        *expired_rows(new, old),
    ]
    return block


def over_share(seed: int, window_ms: float) -> Block:
    w = build([tenant("A"), tenant("B")])
    p, d = INTERACTIVE_SIZE
    for name, load in (("A", 1.0), ("B", 0.5)):
        times = poisson_arrivals(rng_for(seed, "over", name), w.per_ms(load, p, d), window_ms)
        w.requests.extend(fixed_size(name, "interactive", times, p, d))
    new, old = both(w, window_ms)
    block = Block(
        "5a", "over-share", ["equal weights, interactive 200+50: A Poisson 1.0 C, B Poisson 0.5 C"]
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        *expired_rows(new, old),
        Row("A demand served", new.demand_served("A"), None, old.demand_served("A")),
        Row("B demand served", new.demand_served("B"), None, old.demand_served("B")),
        Row("utilisation", new.report.utilisation, None, old.report.utilisation),
    ]
    return block


def batch_min_share(seed: int, window_ms: float) -> Block:
    w = build([tenant("chat"), tenant("ide"), tenant("batch", priority_class="batch")])
    p, d = INTERACTIVE_SIZE
    for name in ("chat", "ide"):
        times = poisson_arrivals(rng_for(seed, "minshare", name), w.per_ms(0.65, p, d), window_ms)
        w.requests.extend(fixed_size(name, "interactive", times, p, d))
    batch_p, batch_d = 3200, 350
    times = constant_arrivals(w.per_ms(0.5, batch_p, batch_d), window_ms, phase_ms=0.5)
    w.requests.extend(fixed_size("batch", "batch", times, batch_p, batch_d))
    new, old = both(w, window_ms)
    everyone = ("chat", "ide", "batch")

    def batch_share(run: Run) -> float | None:
        total = run.served(everyone)
        return run.served(["batch"]) / total if total else None

    min_share = w.config.policy.batch_min_share
    block = Block(
        "5b",
        "batch minimum share",
        ["chat, ide 200+50 Poisson 0.65 C each; batch 3200+350 constant 0.5 C"],
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        *expired_rows(new, old),
        Row(f"batch share (batchMinShare {min_share:g})", batch_share(new), None, batch_share(old)),
        Row("utilisation", new.report.utilisation, None, old.report.utilisation),
    ]
    return block


def under_declarer(seed: int, window_ms: float) -> Block:
    w = build([tenant("liar"), tenant("honest")])
    liar_p, liar_d, liar_real_d = 200, 16, 2000
    honest_p, honest_d = 200, 500
    times = poisson_arrivals(
        rng_for(seed, "liar", "liar"), w.per_ms(1.0, liar_p, liar_d), window_ms
    )
    liars = fixed_size("liar", "interactive", times, liar_p, liar_d)
    actual_tokens = w.cost.service_tokens(liar_p, liar_real_d)
    w.actual.update((r.request_id, actual_tokens) for r in liars)
    w.requests.extend(liars)
    times = poisson_arrivals(
        rng_for(seed, "liar", "honest"), w.per_ms(1.0, honest_p, honest_d), window_ms
    )
    w.requests.extend(fixed_size("honest", "interactive", times, honest_p, honest_d))
    new, old = both(w, window_ms)

    def liar_share(run: Run) -> float | None:
        total = run.served(("liar", "honest"))
        return run.served(["liar"]) / total if total else None

    declared = w.cost.service_tokens(liar_p, liar_d)
    block = Block(
        "6",
        "under-declarer",
        [
            f"liar declares {liar_p}+{liar_d} ({declared}) and uses {liar_p}+{liar_real_d} "
            f"({actual_tokens}); honest {honest_p}+{honest_d} "
            f"({w.cost.service_tokens(honest_p, honest_d)}), exact",
            "both interactive, Poisson at 1.0 C of declared tokens",
        ],
    )
    block.notes += [offered_note(w, window_ms), *refusal_notes(new, old)]
    block.rows += [
        Row("liar share of actual service", liar_share(new), Target("<=", 0.55), liar_share(old)),
        Row("utilisation", new.report.utilisation, None, old.report.utilisation),
        *expired_rows(new, old),
    ]
    return block


def idle_capacity(seed: int, window_ms: float) -> Block:
    policy = PolicyConfig()
    sustained_per_s = 0.5 * policy.service_tokens_per_ms * 1000.0
    solo = tenant("solo", burst=20_000, sustained_per_s=sustained_per_s)
    p, d = INTERACTIVE_SIZE
    w = build([solo], policy)
    times = poisson_arrivals(rng_for(seed, "idle", "solo"), w.per_ms(1.2, p, d), window_ms)
    w.requests.extend(fixed_size("solo", "interactive", times, p, d))
    off, old = both(w, window_ms)
    block = Block(
        "7",
        "idle capacity",
        ["one interactive tenant alone: 200+50 Poisson 1.2 C; bucket burst 20000, sustained 0.5 C"],
    )
    block.notes += [
        offered_note(w, window_ms),
        "the lesson's buckets do not limit interactive work: its column is not capped",
    ]
    block.rows.append(
        Row("utilisation, lending off (~0.5)", off.report.utilisation, None, old.report.utilisation)
    )
    lending: dict[str, Any] = {"lend_idle_capacity": True}
    try:
        lent = dataclasses.replace(policy, **lending)
    except TypeError:
        block.notes.append("lending: not available (PolicyConfig has no lend_idle_capacity)")
        block.rows.append(Row("utilisation, lending on", None, Target(">=", 0.97)))
        return block
    on = replay(Workload(build_config(lent, [solo]), w.requests), TOKENFAIR, window_ms)
    block.rows.append(Row("utilisation, lending on", on.report.utilisation, Target(">=", 0.97)))
    block.notes += [
        f"refused, tokenfair lending off: {off.refusals()}",
        f"refused, tokenfair lending on: {on.refusals()}",
        f"refused, lesson DRR: {old.refusals()}",
    ]
    return block


def no_regression(seed: int, window_ms: float) -> Block:
    config, requests = SCENARIOS["noisy-neighbor"]()
    new = summarize(simulate(config, requests, TOKENFAIR))
    old = summarize(simulate(config, requests, LESSON_DRR))
    block = Block("8", "no regression", ["the lesson's fixture (noisy-neighbor), as published"])
    block.notes.append(
        f"{len(requests)} requests; shed, tokenfair: {new['shed_reasons'] or 'none'}"
    )
    block.rows += [
        Row(
            "admitted",
            float(new["admitted_requests"]),
            Target("==", len(requests), ".0f"),
            float(old["admitted_requests"]),
            ".0f",
        ),
        Row(
            "interactive p99 TTFT ms",
            float(new["interactive_p99_ttft_ms"]),
            Target("<=", 358.97),
            float(old["interactive_p99_ttft_ms"]),
            ".2f",
        ),
    ]
    return block


def over_share_and_min_share(seed: int, window_ms: float) -> Block:
    """Scenario 5 is two workloads: one numbered block of two parts."""
    first, second = over_share(seed, window_ms), batch_min_share(seed, window_ms)
    notes = [f"5a {first.title}: {first.notes[0]}", *first.notes[1:]]
    notes += [f"5b {second.title}: {second.notes[0]}", *second.notes[1:]]
    rows = [dataclasses.replace(r, figure=f"5a {r.figure}") for r in first.rows]
    rows += [dataclasses.replace(r, figure=f"5b {r.figure}") for r in second.rows]
    return Block("5", "over-share and batch minimum share", notes, rows)


SEEDS_SCENARIOS: Final = ("3", "9")
"""What ``--seeds`` runs unless ``--scenarios`` says otherwise: the targets over many seeds."""

SUITE: Final[dict[str, Callable[[int, float], Block]]] = {
    "1": flood,
    "2": weighted_flood,
    "3": many_tenants,
    "4": kv_heavy,
    "5": over_share_and_min_share,
    "6": under_declarer,
    "7": idle_capacity,
    "8": no_regression,
    "9": many_tenants_heavy_tails,
}


# ---------------------------------------------------------------------------------------------
# Output


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render(block: Block, seconds: float) -> str:
    lines = [f"{block.number}. {block.title}  [{seconds:.1f} s]"]
    lines += [f"   {note}" for note in block.notes]
    lines.append(
        f"   {'figure':<38}{'tokenfair':>10}{'target':>11}  {'result':<6}{'lesson DRR':>11}"
    )
    for row in block.rows:
        target = "-" if row.target is None else str(row.target)
        result = {None: "info", True: "PASS", False: "FAIL"}[row.passed]
        reference = "-" if row.reference is None else fmt(row.reference, row.spec)
        lines.append(
            f"   {row.figure:<38}{fmt(row.value, row.spec):>10}{target:>11}  {result:<6}"
            f"{reference:>11}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The core under test and the fairness module


def core_dir(path: str) -> Path | None:
    """``DIR`` holding ``tokenfair/``: a checkout's ``sidecar/`` or the checkout itself."""
    candidate = Path(path).resolve()
    if (candidate / "sidecar" / "tokenfair").is_dir():
        candidate = candidate / "sidecar"
    return candidate if (candidate / "tokenfair").is_dir() else None


def rerun_with_core(core: Path, argv: Sequence[str]) -> None:
    """Run this script again with ``core`` first on PYTHONPATH (the imports above are done)."""
    if os.environ.get(CORE_ENV) == str(core):
        return
    env = dict(os.environ)
    env[CORE_ENV] = str(core)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(core), env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def load_by_path(name: str, path: Path) -> None:
    """Import module ``name`` from the file ``path`` (this bench's checkout)."""
    if not path.is_file():
        raise SystemExit(f"bench_fairness: {path.relative_to(CHECKOUT)} is missing")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"bench_fairness: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def load_fairness() -> Path:
    """Import ``fairness.py`` of this bench's checkout, whatever core the rest comes from, and
    the fluid reference it imports (``fluid.py``, which imports nothing of ours) from there too
    when that core has none.

    A core older than the module has none; loading it by path keeps one home for the rules.
    """
    if "tokenfair.sim.fairness" in sys.modules:
        return Path(str(sys.modules["tokenfair.sim.fairness"].__file__))
    try:
        importlib.import_module("tokenfair.sim.fluid")
    except ModuleNotFoundError:
        load_by_path("tokenfair.sim.fluid", FLUID_FILE)
    load_by_path("tokenfair.sim.fairness", FAIRNESS_FILE)
    return FAIRNESS_FILE


def positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text})")
    return value


def parse_scenarios(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in SUITE]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown scenario(s) {', '.join(unknown)} (known: {', '.join(SUITE)})"
        )
    return chosen


def parse_seeds(text: str) -> list[int]:
    """``1-32``, ``20261130,1-7`` ...: the seeds, in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            if "-" in part[1:]:
                first, _, last = part.partition("-")
                chosen = list(range(int(first), int(last) + 1))
            else:
                chosen = [int(part)]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected seeds such as 1-32 or 20261130,1-7 (got {text!r})"
            ) from None
        if not chosen:
            raise argparse.ArgumentTypeError(f"an empty range of seeds: {part!r}")
        seeds += [seed for seed in chosen if seed not in seeds]
    return seeds


@dataclass(frozen=True)
class SeedOutcome:
    """One figure over the seeds of ``--seeds``: its targets and which seeds missed them."""

    number: str
    row: Row
    targets: list[Target | None]
    """Each seed's (a bound can depend on the seed's workload, as the p99 TTFT's does)."""
    values: list[float | None]
    references: list[float | None]
    missed_seeds: list[int]
    mean: float | None
    mean_met: bool | None

    @property
    def passed(self) -> bool:
        return not self.missed_seeds and self.mean_met is not False


def seed_outcomes(number: str, seeds: list[int], blocks: list[Block]) -> list[SeedOutcome]:
    outcomes = []
    for index, row in enumerate(blocks[0].rows):
        rows = [block.rows[index] for block in blocks]
        values = [r.value for r in rows]
        known = [v for v in values if v is not None]
        mean = math.fsum(known) / len(known) if known else None
        mean_met = None
        if row.mean_target is not None:
            mean_met = mean is not None and len(known) == len(values) and row.mean_target.met(mean)
        missed = [seed for seed, r in zip(seeds, rows, strict=True) if r.passed is False]
        outcomes.append(
            SeedOutcome(
                number,
                row,
                [r.target for r in rows],
                values,
                [r.reference for r in rows],
                missed,
                mean,
                mean_met,
            )
        )
    return outcomes


def render_seeds(
    block: Block, seeds: list[int], outcomes: list[SeedOutcome], seconds: float
) -> str:
    """One line per seed (the figures with a column heading), then each figure's mean, minimum
    and maximum over the seeds beside its targets: the mean's, and every seed's."""
    shown = [(i, o) for i, o in enumerate(outcomes) if o.row.short]
    lines = [f"{block.number}. {block.title}: {len(seeds)} seeds  [{seconds:.1f} s]"]
    lines.append(f"   {'seed':>9}" + "".join(f"{o.row.short:>12}" for _, o in shown))
    for position, seed in enumerate(seeds):
        cells = "".join(f"{fmt(o.values[position], o.row.spec):>12}" for _, o in shown)
        lines.append(f"   {seed:>9}{cells}")
    lines.append(
        f"   {'figure':<38}{'mean':>8}{'min':>8}{'max':>8}{'mean target':>16}"
        f"{'every seed':>17}  {'lesson DRR mean':>15}"
    )
    for outcome in outcomes:
        row = outcome.row
        known = [v for v in outcome.values if v is not None]
        low = min(known) if known else None
        high = max(known) if known else None
        mean_target = "-"
        if row.mean_target is not None:
            mean_target = f"{row.mean_target} {'PASS' if outcome.mean_met else 'FAIL'}"
        every = "-"
        if row.target is not None:
            bound = str(row.target) if len(set(outcome.targets)) == 1 else "per seed"
            every = f"{bound} " + (
                "PASS" if not outcome.missed_seeds else f"FAIL x{len(outcome.missed_seeds)}"
            )
        references = [v for v in outcome.references if v is not None]
        reference = fmt(math.fsum(references) / len(references), row.spec) if references else "-"
        lines.append(
            f"   {row.figure:<38}{fmt(outcome.mean, row.spec):>8}{fmt(low, row.spec):>8}"
            f"{fmt(high, row.spec):>8}{mean_target:>16}{every:>17}  {reference:>15}"
        )
    return "\n".join(lines)


def run_seeds(scenarios: list[str], seeds: list[int], window_ms: float) -> list[SeedOutcome]:
    """Each scenario at each seed; its table. The figures of one scenario are the same rows
    at every seed (a block's rows do not depend on the seed)."""
    outcomes: list[SeedOutcome] = []
    for key in scenarios:
        started = time.perf_counter()
        blocks = [SUITE[key](seed, window_ms) for seed in seeds]
        mine = seed_outcomes(blocks[0].number, seeds, blocks)
        print()
        print(render_seeds(blocks[0], seeds, mine, time.perf_counter() - started))
        outcomes += mine
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Scenarios, formulas and targets: the module docstring and bench/README.md.",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"default {DEFAULT_SEED}")
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        metavar="LIST",
        help="run each scenario at every seed of LIST (e.g. 1-32 or 20261130,1-7) and print "
        "a line per seed and each figure's mean, minimum and maximum beside its targets "
        f"(default scenarios then: {','.join(SEEDS_SCENARIOS)})",
    )
    parser.add_argument(
        "--window",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="window of each scenario (60)",
    )
    parser.add_argument("--quick", action="store_true", help="15 s windows (a smoke run)")
    parser.add_argument(
        "--scenarios",
        type=parse_scenarios,
        metavar="LIST",
        help=f"comma-separated subset of {','.join(SUITE)} (default: all; with --seeds "
        f"{','.join(SEEDS_SCENARIOS)})",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with 1 when a target is not met"
    )
    parser.add_argument(
        "--core-path",
        metavar="DIR",
        help="take tokenfair (core, simulator, config) from DIR (a checkout or its "
        "sidecar/ directory); fairness.py always comes from this bench's checkout",
    )
    args = parser.parse_args(argv)
    if args.core_path:
        core = core_dir(args.core_path)
        if core is None:
            parser.error(f"--core-path: no tokenfair/ in {args.core_path} or its sidecar/")
        rerun_with_core(core, sys.argv[1:] if argv is None else argv)
    window_ms = (15.0 if args.quick else args.window) * 1000.0
    fairness_file = load_fairness()
    import tokenfair.core as core_package

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    seeds_text = f"seed {args.seed}" if args.seeds is None else f"{len(args.seeds)} seeds"
    print(
        f"python {sys.version.split()[0]}, load average {load}, {seeds_text}, "
        f"window {window_ms / 1000:g} s"
    )
    print(f"core: {Path(str(core_package.__file__)).parent}, {core_kind()}")
    print(f"fairness: {fairness_file}")
    started = time.perf_counter()
    if args.seeds is not None:
        outcomes = run_seeds(args.scenarios or list(SEEDS_SCENARIOS), args.seeds, window_ms)
        targeted = [o for o in outcomes if o.row.target is not None or o.row.mean_target]
        missed = [o for o in targeted if not o.passed]
        print()
        for outcome in missed:
            where = ", ".join(map(str, outcome.missed_seeds)) or "-"
            mean = "" if outcome.mean_met is not False else f"; mean {fmt(outcome.mean, '.3f')}"
            print(f"not met: {outcome.number}. {outcome.row.figure}: seeds {where}{mean}")
        print(
            f"summary: {len(targeted) - len(missed)} of {len(targeted)} figures met their "
            f"targets at every seed (and on average), {len(missed)} not "
            f"({time.perf_counter() - started:.1f} s)"
        )
        return 1 if args.strict and missed else 0
    results: list[tuple[str, Row]] = []
    for key in args.scenarios or list(SUITE):
        scenario_started = time.perf_counter()
        block = SUITE[key](args.seed, window_ms)
        print()
        print(render(block, time.perf_counter() - scenario_started))
        results += [(block.number, row) for row in block.rows if row.target is not None]
    failed = [(number, row) for number, row in results if not row.passed]
    print()
    for number, row in failed:
        print(f"not met: {number}. {row.figure} {fmt(row.value, row.spec)} (target {row.target})")
    print(
        f"summary: {len(results) - len(failed)} of {len(results)} targets met, {len(failed)} "
        f"not met ({time.perf_counter() - started:.1f} s)"
    )
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
