"""Cost of a round-robin pick when most tenants' heads wait for KV room (issue 29, kept places).

A DRR-only replay (``DeficitRoundRobin`` alone, no scheduler): ``--tenants`` tenants in one
lane, weights 1, 2 and 3 in turn, two heads each (1,000 service tokens against a quantum of
1,200 a weight), of which ``--blocked`` (spread evenly through the ring) have heads that
need more KV blocks than are free; the others' heads fit. Each pick is timed alone
(``perf_counter_ns``, the collector off); the tenant whose head was sent gets a new one (untimed),
so the ring stays as it was set up. Printed: microseconds a pick — ``block us``, the median
over blocks of 200 picks of their mean (the figure compared: an amortised cost, robust to the
preemptions of a shared machine), the mean over all picks, the median, the 99th percentile
and the most — and the kept tenants at the end. A pick passes ``need`` and ``room`` when the
core's ``pick`` takes them (this tree: a blocked head keeps its place, at most ``max_kept``
tenants), else ``eligible`` alone (a core from before the change).

``--core-path DIR`` measures another checkout's core too, in its own process, and
``--core-native DIR`` names that core's compiled build (``tokenfair native build DIR``, run with
that checkout's sources); without it that core runs interpreted. Both are printed, with the
ratio. The compiled core is used when a fresh build is there (docs/native.md).

    .venv/bin/python bench/bench_kept_places.py
    .venv/bin/python bench/bench_kept_places.py --core-path OTHER_CHECKOUT --core-native BUILD
    .venv/bin/python bench/bench_kept_places.py --tenants 1000 --blocked 900
    .venv/bin/python bench/bench_kept_places.py --max-kept 8      # a larger bound's cost

Figures and how to read them: bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
CHILD_ENV = "TOKENFAIR_KEPT_BENCH_CHILD"
NEED_BLOCKED = 100
"""Blocks a blocked tenant's head needs; the others need 1, and 10 are free."""
ROOM = 10
COST = 1000
"""Service tokens of every request: a weight-1 tenant's quantum (1200) sends one a turn."""
QUANTUM = 1200.0
BLOCK = 200
"""Picks a block: the printed ``block us`` is the median over blocks of their mean a pick."""


def measure(
    tenants: int, blocked: int, picks: int, seed: int, max_kept: int | None
) -> dict[str, float | str]:
    """One replay in this process (the core on ``sys.path``): microseconds a pick."""
    from tokenfair import native

    status = native.activate()
    import tokenfair.core.drr as drr_module
    from tokenfair.core import Request
    from tokenfair.core.drr import DeficitRoundRobin
    from tokenfair.core.jobs import Job, JobState

    lane = DeficitRoundRobin()
    if max_kept is not None and hasattr(lane, "max_kept"):
        lane.max_kept = max_kept
    every = tenants / blocked if blocked else 0.0
    blocked_ids = {round(i * every) for i in range(blocked)} if blocked else set()
    sequence = 0

    def push(tenant: int) -> None:
        nonlocal sequence
        need = NEED_BLOCKED if tenant in blocked_ids else 1
        request = Request(f"r{sequence}", f"t{tenant}", 0.0, COST, 0, "batch")
        lane.push(Job(request, COST, need))
        sequence += 1

    for tenant in range(tenants):
        lane.add_tenant(f"t{tenant}", QUANTUM * (1 + (tenant + seed) % 3))
    for _ in range(2):
        for tenant in range(tenants):
            push(tenant)

    def need(job: Job) -> int:
        return job.kv_blocks

    def eligible(job: Job) -> bool:
        return job.kv_blocks <= ROOM

    def room() -> int:
        return ROOM

    takes_need = hasattr(lane, "kept_tenants")  # this tree's core: `pick(eligible, need, room)`
    times: list[int] = []
    gc.disable()
    try:
        for _ in range(picks):
            if takes_need:
                start = time.perf_counter_ns()
                picked = lane.pick(eligible, need, room)  # type: ignore[call-arg,unused-ignore]
                elapsed = time.perf_counter_ns() - start
            else:
                start = time.perf_counter_ns()
                picked = lane.pick(eligible)
                elapsed = time.perf_counter_ns() - start
            times.append(elapsed)
            if picked is None:
                break
            picked.state = JobState.DISPATCHED
            push(int(picked.tenant_id[1:]))
    finally:
        gc.enable()
    kept = getattr(lane, "kept_tenants", 0)
    return {
        "core": str(Path(drr_module.__file__).resolve().parent),
        "compiled": "yes" if status.active else "no",
        "mean_us": statistics.fmean(times) / 1000.0,
        # A block's mean is the cost a pick amortised; their median leaves out the blocks a
        # preemption of this process landed in (a shared machine), which the mean does not.
        "block_us": statistics.median(
            statistics.fmean(times[i : i + BLOCK]) for i in range(0, len(times) - BLOCK + 1, BLOCK)
        )
        / 1000.0,
        "median_us": statistics.median(times) / 1000.0,
        "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] / 1000.0,
        "max_us": max(times) / 1000.0,
        "picks": float(len(times)),
        "kept": float(kept),
        "keeps_places": "yes" if takes_need else "no",
    }


def run_child(core: Path | None, native_dir: str | None, argv: Sequence[str]) -> dict[str, object]:
    env = dict(os.environ)
    env[CHILD_ENV] = "1"
    if core is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(core), env.get("PYTHONPATH", "")) if p)
    if native_dir is not None:
        env["TOKENFAIR_NATIVE_DIR"] = native_dir
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tenants", type=int, default=5000)
    parser.add_argument("--blocked", type=int, default=4500, help="tenants whose heads wait")
    parser.add_argument("--picks", type=int, default=20000, help="picks timed")
    parser.add_argument("--seed", type=int, default=1, help="varies the weights")
    parser.add_argument(
        "--max-kept", type=int, help="this tree's bound on kept tenants (default: the core's)"
    )
    parser.add_argument("--core-path", metavar="DIR", help="another checkout's core, compared")
    parser.add_argument("--core-native", metavar="DIR", help="that core's compiled build")
    args = parser.parse_args(argv)
    if not 0 <= args.blocked < args.tenants:
        parser.error("--blocked must be at least 0 and fewer than --tenants")
    forwarded = [
        *("--tenants", str(args.tenants), "--blocked", str(args.blocked)),
        *("--picks", str(args.picks), "--seed", str(args.seed)),
        *(("--max-kept", str(args.max_kept)) if args.max_kept is not None else ()),
    ]
    if os.environ.get(CHILD_ENV):
        print(json.dumps(measure(args.tenants, args.blocked, args.picks, args.seed, args.max_kept)))
        return 0
    print(
        f"python {sys.version.split()[0]}, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"; {args.tenants} tenants, {args.blocked} blocked, two heads each, {args.picks} picks"
    )
    rows = [("this tree", run_child(CHECKOUT / "sidecar", None, forwarded))]
    if args.core_path:
        other = Path(args.core_path).resolve()
        if (other / "sidecar" / "tokenfair").is_dir():
            other = other / "sidecar"
        rows.append(("--core-path", run_child(other, args.core_native, forwarded)))
    figures = ("block_us", "mean_us", "median_us", "p99_us", "max_us")
    print(
        f"{'core':<12} {'compiled':>8} {'keeps':>6} "
        + " ".join(f"{name.replace('_us', ' us'):>10}" for name in figures)
        + f" {'kept':>5}"
    )
    for name, row in rows:
        print(
            f"{name:<12} {row['compiled']!s:>8} {row['keeps_places']!s:>6} "
            + " ".join(f"{float(str(row[figure])):>10.2f}" for figure in figures)
            + f" {int(float(str(row['kept']))):>5}"
        )
    if len(rows) == 2:
        for figure in ("block_us", "mean_us"):
            ratio = float(str(rows[0][1][figure])) / float(str(rows[1][1][figure]))
            print(f"ratio this tree / --core-path, {figure.replace('_us', '')}: {ratio:.2f}")
        print("target: block ratio <= 1.5")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
