"""``tokenfair simulate --replicas N``: replay a workload over a pool of replicas, each replica's
own scheduler alone (per replica) and, for ``tokenfair``, with pool-wide service counters shared
through the simulated store (``+pool``), and compare each tenant's pool-wide service with its
weighted max-min share constrained by where its requests landed
(:mod:`tokenfair.sim.pool_maxmin`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tokenfair.config import Config
from tokenfair.sim.pool_maxmin import MAX_REPLICAS, constrained_max_min
from tokenfair.sim.pool_replay import (
    DEFAULT_LEASE_TOKENS,
    DEFAULT_SYNC_MS,
    ROUTINGS,
    PoolReplay,
    replay_pool,
)
from tokenfair.sim.report import SummaryTally
from tokenfair.sim.simulator import Arrival


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a pool of replicas (docs/fairness.md, pool-wide)")
    group.add_argument(
        "--replicas",
        type=int,
        help=f"replay over this many replicas (1-{MAX_REPLICAS}), each its own serial server "
        "and scheduler; tokenfair runs twice: per replica, and with pool-wide fairness (+pool)",
    )
    group.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="round-robin",
        help="where each request lands (with --replicas): round-robin over the requests, "
        "affinity (runs of 16 requests of a tenant to one replica), skewed (the --pinned "
        "tenants on replica 0, the others round robin)",
    )
    group.add_argument(
        "--pinned",
        action="append",
        default=[],
        metavar="TENANT",
        help="a tenant that --routing skewed sends to replica 0 only (repeatable; default: "
        "the configuration's first tenant)",
    )
    group.add_argument(
        "--pool-sync-ms",
        type=float,
        default=DEFAULT_SYNC_MS,
        help=f"the batching interval of the pool's counters (default {DEFAULT_SYNC_MS:g})",
    )
    group.add_argument(
        "--pool-lease-tokens",
        type=int,
        default=DEFAULT_LEASE_TOKENS,
        help="a replica sends its batch once it gave this many service tokens "
        f"(default {DEFAULT_LEASE_TOKENS})",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag and its rule."""
    replicas = args.replicas
    if replicas is None:
        for flag, value, default in (
            ("--pinned", args.pinned, []),
            ("--pool-sync-ms", args.pool_sync_ms, DEFAULT_SYNC_MS),
            ("--pool-lease-tokens", args.pool_lease_tokens, DEFAULT_LEASE_TOKENS),
        ):
            if value != default:
                raise ValueError(f"{flag}: needs --replicas")
        if args.routing != "round-robin":
            raise ValueError("--routing: needs --replicas")
        return
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"--replicas: must be in [1, {MAX_REPLICAS}] (got {replicas})")
    if not args.pool_sync_ms > 0:
        raise ValueError(f"--pool-sync-ms: must be positive (got {args.pool_sync_ms})")
    if args.pool_lease_tokens < 1:
        raise ValueError(f"--pool-lease-tokens: must be at least 1 (got {args.pool_lease_tokens})")
    if args.records is not None or args.plot is not None:
        raise ValueError("--replicas: --records and --plot are not written for a pool replay")


def run_pool(
    args: argparse.Namespace, config: Config, arrivals: Sequence[Arrival], policies: list[str]
) -> int:
    """Every policy per replica, and tokenfair with the pool's counters; print the report."""
    pinned = list(args.pinned) or [config.tenants[0].tenant_id]
    for tenant_id in pinned:
        if tenant_id not in config.tenant_index:
            raise ValueError(f"--pinned: unknown tenant {tenant_id!r}")
    runs: dict[str, dict[str, Any]] = {}
    for policy in policies:
        shared_too = [False, True] if policy == "tokenfair" else [False]
        for shared in shared_too:
            name = f"{policy}+pool" if shared else policy
            runs[name] = _run_one(args, config, arrivals, policy, shared, pinned)
    report = {
        "pool": {
            "replicas": args.replicas,
            "routing": args.routing,
            "pinned": pinned if args.routing == "skewed" else [],
            "sync_ms": args.pool_sync_ms,
            "lease_tokens": args.pool_lease_tokens,
            "runs": runs,
        }
    }
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_pool(report["pool"]))
    return 0


def _run_one(
    args: argparse.Namespace,
    config: Config,
    arrivals: Sequence[Arrival],
    policy: str,
    shared: bool,
    pinned: list[str],
) -> dict[str, Any]:
    outcome = PoolReplay(args.replicas)
    summary = SummaryTally()
    for decision, _ in replay_pool(
        config, arrivals, policy, args.replicas, args.routing,
        pool=shared, pinned=pinned, sync_ms=args.pool_sync_ms,
        lease_tokens=args.pool_lease_tokens, outcome=outcome,
    ):  # fmt: skip
        summary.add(decision)
    return pool_figures(config, outcome, summary.summary())


def pool_figures(config: Config, outcome: PoolReplay, summary: dict[str, Any]) -> dict[str, Any]:
    """Each tenant's pool-wide service beside its constrained max-min share: the capacity of a
    replica is what it served (a serial server serves whenever it has work)."""
    replicas = len(outcome.served)
    capacities = [float(sum(served.values())) for served in outcome.served]
    tenants = sorted({t for offered in outcome.offered for t in offered})
    offered = {t: [float(outcome.offered[r].get(t, 0)) for r in range(replicas)] for t in tenants}
    weights = {t: config.tenant_index[t].weight for t in tenants}
    shares = constrained_max_min(capacities, offered, weights)
    rows: dict[str, Any] = {}
    for tenant_id in tenants:
        served = sum(outcome.served[r].get(tenant_id, 0) for r in range(replicas))
        share = shares.get(tenant_id, 0.0)
        rows[tenant_id] = {
            "weight": weights[tenant_id],
            "served_service_tokens": served,
            "max_min_service_tokens": round(share, 2),
            "of_max_min": round(served / share, 4) if share > 0 else None,
            "replicas": [r for r in range(replicas) if outcome.offered[r].get(tenant_id)],
        }
    ratios = [row["of_max_min"] for row in rows.values() if row["of_max_min"] is not None]
    jain = sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios)) if ratios else None
    dispatched = sum(row["admitted"] for row in summary["tenants"].values())
    return {
        "tenants": rows,
        "jain_of_max_min": None if jain is None else round(jain, 4),
        "store_calls": outcome.store_calls,
        "requests": outcome.requests,
        "admitted_requests": dispatched,
        "store_calls_per_request": (
            round(outcome.store_calls / outcome.requests, 4) if outcome.requests else 0.0
        ),
        "summary": summary,
    }


def format_pool(pool: dict[str, Any]) -> str:
    lines = [
        f"pool of {pool['replicas']} replicas, routing {pool['routing']}"
        + (f" (pinned: {', '.join(pool['pinned'])})" if pool["pinned"] else "")
        + f"; counters batched every {pool['sync_ms']:g} ms or {pool['lease_tokens']} "
        "service tokens",
        "",
    ]
    for name, run in pool["runs"].items():
        lines.append(
            f"{name}: store calls {run['store_calls']} for {run['requests']} requests "
            f"({run['store_calls_per_request']:g} per request); Jain index of the tenants' "
            f"service / max-min share {run['jain_of_max_min']}"
        )
        lines.append(
            f"  {'tenant':<22}{'weight':>7}{'served':>12}{'max-min':>12}{'of max-min':>12}"
            f"  replicas"
        )
        for tenant_id, row in run["tenants"].items():
            ratio = row["of_max_min"]
            lines.append(
                f"  {tenant_id:<22}{row['weight']:>7g}{row['served_service_tokens']:>12}"
                f"{row['max_min_service_tokens']:>12.0f}"
                f"{'-' if ratio is None else f'{ratio * 100:.1f} %':>12}"
                f"  {','.join(str(r) for r in row['replicas'])}"
            )
        lines.append("")
    return "\n".join(lines)
