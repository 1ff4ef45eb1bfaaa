"""Where the batch lane's Jain against the fluid reference is lost (issue 29): a diagnosis of
``bench_fairness.py``'s scenarios 3 and 9, no targets.

At each seed the scenario is replayed under ``tokenfair`` (the same workload as the bench), and
the batch lane's Jain over ``served / fluid reference`` (arrivals of ``[0, window -
maxBatchWaitMs]``, as the bench counts it) is computed again with one thing changed at a time:

* **door refusals not demand** — the requests refused at admission are left out of the fluid
  server's demand: what is left is how the lane split its service among the requests it
  admitted (round-robin order, expiries, weights, start-up);
* **served only** — only the requests the lane served are demand (the order of service alone);
* **equal weights** — the reference with every tenant at weight 1;
* **after start-up** — counted from ``maxBatchWaitMs`` on (the first wait limit left out);
* **whole-request bound** — not a replay: an upper bound on what any scheduler that serves
  a request whole or not at all could reach against these references. A tenant's service is
  then a subset sum of its requests' sizes (arrivals counted), and the bound is the largest
  Jain any such choice can have (:func:`whole_request_bound`). Capacity and timing are
  ignored (the tenants' choices need not fit the lane's service together), which only makes
  it higher; the references are this run's (another scheduler's service curve, and which
  requests it served, would move them).

With ``--per-tenant``, each seed's tenants, lowest ``served / fluid`` first. Then, over all
seeds, the mean ``served / fluid`` by tenant weight and the part of the offered
batch tokens refused at the door by weight; and with ``--why`` how the core placed each batch
request at admission (lifted ahead with or without joiners waiting, or at the ring's tail
because its tenant was backlogged, in debt, at or above its share lately, or its request could
not start in time for the KV cache), split by admitted and refused at the door. ``--why``
wraps a method of the interpreted core, so it needs ``TOKENFAIR_NATIVE=0``.

The fluid demand of each request follows ``fairness.py`` (``_add_fluid``): a served request is
demand until the fluid server has served it, a cancelled one until it left, any other until its
class's wait limit after its arrival.

    .venv/bin/python bench/diagnose_batch_jain.py --scenario 3 --seeds 1-32
    TOKENFAIR_NATIVE=0 .venv/bin/python bench/diagnose_batch_jain.py --scenario 9 --seeds 5,21 --why
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from bench_fairness import (
    HEAVY_SIZES,
    NARROW_SIZES,
    Workload,
    load_fairness,
    parse_seeds,
    zipf_workload,
)

from tokenfair.core import Decision
from tokenfair.core.jobs import LANE_BATCH, STATUS_CLIENT_CLOSED, STATUS_OK
from tokenfair.sim.fluid import FluidRequest, fluid_reference
from tokenfair.sim.simulator import simulate

LANE = "batch"
STEP = 1.002
"""The whole-request bound's cover of the mean: intervals ``[m, m * STEP]``."""


def served(decision: Decision) -> bool:
    return decision.status_code == STATUS_OK and decision.gate == "dispatch"


def size_of(decision: Decision, workload: Workload) -> int:
    actual = decision.actual_service_tokens
    if actual is None:
        actual = workload.actual.get(decision.request_id)
    return decision.service_tokens if actual is None else actual


def jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else 1.0


def ratios(
    decisions: Sequence[Decision],
    workload: Workload,
    counted: tuple[float, float],
    keep: Callable[[Decision], bool] = lambda d: True,
    equal_weights: bool = False,
) -> dict[str, tuple[float, float]]:
    """Per tenant of the batch lane with a reference > 0: (received, fluid reference), the
    fluid server's demand being the lane's decisions ``keep`` accepts."""
    policy = workload.config.policy
    slots: dict[str, int] = {}
    requests: list[FluidRequest] = []
    for d in decisions:
        if d.priority_class != LANE or not keep(d):
            continue
        slot = slots.setdefault(d.tenant_id, len(slots))
        size = size_of(d, workload)
        if served(d) and d.dispatch_ms is not None:
            requests.append(FluidRequest(d.arrival_ms, slot, size, math.inf, d.dispatch_ms))
        elif d.status_code == STATUS_CLIENT_CLOSED:
            requests.append(FluidRequest(d.arrival_ms, slot, size, d.arrival_ms + d.queue_wait_ms))
        else:
            leave_ms = d.arrival_ms + policy.max_batch_wait_ms
            requests.append(FluidRequest(d.arrival_ms, slot, size, leave_ms))
    weights = {t.tenant_id: t.weight for t in workload.config.tenants}
    result = fluid_reference(
        requests,
        [1.0 if equal_weights else weights[t] for t in slots],
        policy.service_tokens_per_ms,
        counted[0],
        counted[1],
    )
    return {
        t: (result.received_tokens[s], result.reference_tokens[s])
        for t, s in slots.items()
        if result.reference_tokens[s] > 0
    }


def jain_of(pairs: dict[str, tuple[float, float]]) -> float:
    return jain([received / reference for received, reference in pairs.values()])


def subset_sums(sizes: Sequence[int]) -> list[int]:
    """Every subset sum of ``sizes``, ascending (a bitset of the reachable sums)."""
    reachable = 1
    for size in sizes:
        reachable |= reachable << size
    text = bin(reachable)[:1:-1]  # bit k of the set is character k
    return [k for k, bit in enumerate(text) if bit == "1"]


def gap(sums: Sequence[int], low: float, high: float) -> float:
    """How far the nearest of ``sums`` lies from the interval ``[low, high]`` (0 inside it)."""
    k = bisect_left(sums, low)
    if k < len(sums) and sums[k] <= high:
        return 0.0
    above = sums[k] - high if k < len(sums) else math.inf
    below = low - sums[k - 1] if k > 0 else math.inf
    return min(above, below)


def whole_request_bound(
    pairs: dict[str, tuple[float, float]], sizes: dict[str, list[int]]
) -> float:
    """An upper bound on Jain over ``x_i = s_i / ref_i``, ``s_i`` any subset sum of tenant
    ``i``'s request sizes. For any choice of mean ``m``, ``n var = Σ (x_i - m)^2``; with
    ``m`` in ``[a, b]`` each term is at least the squared distance ``d_i`` of tenant ``i``'s
    reachable ratios from ``[a, b]``, so Jain ``= m^2 / (m^2 + var) <= b^2 / (b^2 + Σ d_i^2 /
    n)``; the maximum over a geometric cover of ``m`` (steps of 0.2 %, from 0.02 to the
    largest ratio any tenant can reach; a lower mean would leave nearly all the service the
    references share out unserved)."""
    tenants = [(subset_sums(sizes[t]), ref) for t, (_, ref) in pairs.items()]
    n = len(tenants)
    top = max(sums[-1] / ref for sums, ref in tenants)
    best = 0.0
    low = 0.02
    while low < top:
        high = low * STEP
        spread = sum((gap(sums, low * ref, high * ref) / ref) ** 2 for sums, ref in tenants)
        best = max(best, high * high / (high * high + spread / n))
        low = high
    return min(best, 1.0)


@dataclass
class Totals:
    by_weight: defaultdict[float, list[float]]
    door_by_weight: defaultdict[float, list[int]]
    placed_door: Counter[str]
    placed_admitted: Counter[str]


PLACED: dict[str, tuple[str, bool]] = {}
"""Request id → (how `_join_rank` placed it, whether joiners were waiting) under ``--why``."""


def instrument() -> None:
    """Wrap ``TokenfairScheduler._join_rank`` (interpreted core) to record each batch request's
    placement, by the same tests in the same order as the method."""
    from tokenfair.core import tokenfair as core

    scheduler: Any = core.TokenfairScheduler
    if not inspect.isfunction(vars(scheduler).get("_join_rank")):
        sys.exit("diagnose_batch_jain: --why needs the interpreted core (TOKENFAIR_NATIVE=0)")
    original = scheduler._join_rank
    original_share = scheduler.share_ratio
    last_share: list[float | None] = [None]

    def share_ratio(self: Any, tenant_id: str, lane: int, now_ms: float) -> float | None:
        # What the method itself read: calling it again could refresh the lane's cached
        # level at another moment, and the replay would no longer be the bench's.
        last_share[0] = original_share(self, tenant_id, lane, now_ms)
        return last_share[0]

    def join_rank(self: Any, job: Any, now_ms: float) -> float | None:
        last_share[0] = None
        rank: float | None = original(self, job, now_ms)
        if job.lane == LANE_BATCH:
            drr = self._lanes[job.lane]
            queue = drr.queues[job.tenant_id]
            share = last_share[0]
            if rank is not None:
                how = "lifted"
            elif queue.in_active:
                how = "tail: backlogged"
            elif queue.deficit_units < 0:
                how = "tail: in debt"
            elif share is None:
                how = "tail: lane served nothing lately"
            elif share >= 1.0:
                how = "tail: share ratio >= 1"
            else:
                how = "tail: cannot start in time (KV)"
            # (`ahead_joiners` as the admission that follows reads it: the joiners waiting)
            PLACED[job.request_id] = (how, bool(drr.ahead_joiners))
        return rank

    scheduler.share_ratio = share_ratio
    scheduler._join_rank = join_rank


def per_tenant(
    seed: int,
    base: dict[str, tuple[float, float]],
    lane: Sequence[Decision],
    weights: dict[str, float],
    counted: tuple[float, float],
) -> str:
    """One line per tenant of the lane, lowest served/fluid first."""
    offered: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for d in lane:
        if counted[0] <= d.arrival_ms <= counted[1]:
            offered[d.tenant_id] += 1
            refused[d.tenant_id] += d.gate == "admission"
    lines = [f"seed {seed}: tenant, weight, requests, refused at the door, fluid, received, x"]
    for t, (received, reference) in sorted(base.items(), key=lambda i: i[1][0] / i[1][1]):
        lines.append(
            f"  {t:<10} {weights[t]:>3g} {offered[t]:>5} {refused[t]:>5} {reference:>9.0f} "
            f"{received:>9.0f} {received / reference:>6.3f}"
        )
    return "\n".join(lines)


def diagnose(
    scenario: str, seed: int, window_ms: float, totals: Totals, tenants: bool = False
) -> str:
    sizing = NARROW_SIZES if scenario == "3" else HEAVY_SIZES
    workload = zipf_workload(seed, window_ms, sizing).workload
    PLACED.clear()
    decisions = simulate(workload.config, workload.requests, "tokenfair", workload.actual)
    tau = workload.config.policy.max_batch_wait_ms
    counted = (0.0, max(window_ms - tau, window_ms / 2))
    lane = [d for d in decisions if d.priority_class == LANE]
    base = ratios(lane, workload, counted)
    weights = {t.tenant_id: t.weight for t in workload.config.tenants}
    sizes: dict[str, list[int]] = defaultdict(list)
    for d in lane:
        if counted[0] <= d.arrival_ms <= counted[1]:
            size = size_of(d, workload)
            sizes[d.tenant_id].append(size)
            door = totals.door_by_weight[weights[d.tenant_id]]
            door[1] += size
            if d.gate == "admission":
                door[0] += size
            if d.request_id in PLACED:
                how, joiners = PLACED[d.request_id]
                if how == "lifted" and joiners:
                    how = "lifted behind joiners"
                placed = totals.placed_door if d.gate == "admission" else totals.placed_admitted
                placed[how] += size
    for t, (received, reference) in base.items():
        totals.by_weight[weights[t]].append(received / reference)
    if tenants:
        print(per_tenant(seed, base, lane, weights, counted))
    under = sum(1 for r, f in base.values() if r < 0.95 * f)
    figures = [
        jain_of(base),
        jain_of(ratios(lane, workload, counted, lambda d: d.gate != "admission")),
        jain_of(ratios(lane, workload, counted, served)),
        jain_of(ratios(lane, workload, counted, equal_weights=True)),
        jain_of(ratios(lane, workload, (tau, counted[1]))),
        whole_request_bound(base, sizes),
    ]
    return f"{seed:>6}" + "".join(f"{v:>10.3f}" for v in figures) + f"{under:>4}/{len(base)}"


HEADINGS = ("Jain", "no door", "served", "equal w", "after τ", "bound")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--scenario", choices=("3", "9"), default="3")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1-32"))
    parser.add_argument("--window", type=float, default=60.0, help="seconds (60)")
    parser.add_argument("--why", action="store_true", help="placement at admission (interpreted)")
    parser.add_argument("--per-tenant", action="store_true", help="a line per tenant and seed")
    args = parser.parse_args(argv)
    load_fairness()
    if args.why:
        instrument()
    totals = Totals(defaultdict(list), defaultdict(lambda: [0, 0]), Counter(), Counter())
    window_ms = args.window * 1000.0
    rows = [diagnose(args.scenario, s, window_ms, totals, args.per_tenant) for s in args.seeds]
    print(f"scenario {args.scenario}, batch lane, Jain against the fluid reference")
    print(f"{'seed':>6}" + "".join(f"{h:>10}" for h in HEADINGS) + "  x<0.95/tenants")
    print("\n".join(rows))
    columns = list(zip(*([float(v) for v in row.split()[1:7]] for row in rows), strict=True))
    print(f"{'mean':>6}" + "".join(f"{sum(c) / len(c):>10.3f}" for c in columns))
    print(f"{'< 0.95':>6}" + "".join(f"{sum(1 for v in c if v < 0.95):>10d}" for c in columns))
    for weight, values in sorted(totals.by_weight.items()):
        door, offered = totals.door_by_weight[weight]
        print(
            f"weight {weight:g}: mean served/fluid {sum(values) / len(values):.3f} over "
            f"{len(values)} tenant-seeds; refused at the door {door / offered:.3f} of offered"
        )
    for name, placed in (("refused at the door", totals.placed_door),
                         ("admitted", totals.placed_admitted)):  # fmt: skip
        total = sum(placed.values())
        if total:
            parts = ", ".join(f"{k} {v / total:.3f}" for k, v in placed.most_common())
            print(f"placement of the batch tokens {name}: {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
