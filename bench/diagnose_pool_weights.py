"""Why ``bench_pool_fairness.py``'s 4:1 weights move from run to run (issue 30, review rev1207f):
the pool-wide order's swing, offline, over seeds.

``heavy`` (weight 4) and ``light`` (weight 1) each offer Poisson chats of 280 + 90 tokens (640
service tokens) at a mean gap of ``--gap-ms`` (3 ms: about 4.7 replicas' capacity each, as
``pool-weights``), the interactive wait limit 600 s (both stay backlogged on every replica, as
the live bench's closed-loop clients keep them), replayed by ``sim/pool_replay.replay_pool``
over 4 replicas with the counters shared (``--local``: per replica) with the given sync interval
and lease. Printed per seed: heavy / light over the whole run (past its first model second),
over consecutive windows of ``--window-s`` model seconds (the live bench's ``--window 30`` at
``--time-scale 6`` is 5 model s), and the least and largest ratio of a 1 model s slice.

    .venv/bin/python bench/diagnose_pool_weights.py                       # affinity, 6 seeds
    .venv/bin/python bench/diagnose_pool_weights.py --lease 5000          # a smaller lease
    .venv/bin/python bench/diagnose_pool_weights.py --routing round-robin --local
"""

from __future__ import annotations

import argparse
import random
import sys

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.sim.pool_replay import PoolReplay, replay_pool
from tokenfair.sim.scenarios import _poisson
from tokenfair.sim.simulator import Arrival

REPLICAS = 4


def served_per_slice(
    seed: int, routing: str, *, pool: bool, duration_ms: int, gap_ms: float, sync_ms: float,
    lease_tokens: int,
) -> dict[int, dict[str, int]]:  # fmt: skip
    """Pool-wide service per 1 model s slice (by the end of each request) and tenant."""
    rng = random.Random(seed)
    tenants = (
        TenantConfig("heavy", 4.0, 10**9, 10**7, "interactive"),
        TenantConfig("light", 1.0, 10**9, 10**7, "interactive"),
    )
    requests = _poisson(rng, "heavy", gap_ms, duration_ms)
    requests += _poisson(rng, "light", gap_ms, duration_ms)
    requests.sort(key=lambda r: (r.arrival_ms, r.request_id))
    config = build_config(PolicyConfig(max_interactive_wait_ms=600_000), tenants)
    arrivals: list[Arrival] = [(request, None, None) for request in requests]
    outcome = PoolReplay(REPLICAS)
    for _ in replay_pool(config, arrivals, "tokenfair", REPLICAS, routing, pool=pool,
                         outcome=outcome, sync_ms=sync_ms, lease_tokens=lease_tokens):  # fmt: skip
        pass
    slices: dict[int, dict[str, int]] = {}
    for replica in outcome.sliced_served:
        for (number, tenant_id), tokens in replica.items():
            row = slices.setdefault(number, {"heavy": 0, "light": 0})
            row[tenant_id] += tokens
    return slices


def ratio(slices: dict[int, dict[str, int]], first: int, count: int) -> float:
    heavy = sum(slices.get(n, {}).get("heavy", 0) for n in range(first, first + count))
    light = sum(slices.get(n, {}).get("light", 0) for n in range(first, first + count))
    return heavy / max(1, light)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routing", default="affinity", choices=("affinity", "round-robin"))
    parser.add_argument("--local", action="store_true", help="per replica (no shared counters)")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--duration-ms", type=int, default=40_000)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    parser.add_argument("--sync-ms", type=float, default=500.0)
    parser.add_argument("--lease", type=int, default=20_000, help="service tokens (20,000)")
    parser.add_argument("--window-s", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"diagnose_pool_weights: {args.routing}, {'per replica' if args.local else 'pool'}, "
          f"sync {args.sync_ms:g} ms, lease {args.lease}, {args.duration_ms / 1000:g} model s, "
          f"windows of {args.window_s} model s")  # fmt: skip
    for seed in range(1, args.seeds + 1):
        slices = served_per_slice(
            seed, args.routing, pool=not args.local, duration_ms=args.duration_ms,
            gap_ms=args.gap_ms, sync_ms=args.sync_ms, lease_tokens=args.lease,
        )  # fmt: skip
        last = max(slices)  # the partial slice at the end is left out
        whole = ratio(slices, 1, last - 1)
        windows = [ratio(slices, n, args.window_s) for n in range(1, last - args.window_s + 1,
                                                                   args.window_s)]  # fmt: skip
        ones = [ratio(slices, n, 1) for n in range(1, last)]
        print(f"  seed {seed}: whole {whole:.2f}:1   windows "
              f"{' '.join(f'{w:.2f}' for w in windows)}   1 s slices {min(ones):.2f}-"
              f"{max(ones):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
