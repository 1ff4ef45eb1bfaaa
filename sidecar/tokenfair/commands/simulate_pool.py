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
from tokenfair.core import Decision
from tokenfair.core.jobs import STATUS_OK, STATUS_SHED
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
        help=f"replay over this many replicas (1-{MAX_REPLICAS}), each its own server "
        "(serial, or batching with maxBatchRequests above 1) and scheduler; tokenfair runs "
        "twice: per replica, and with pool-wide fairness (+pool)",
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
    expiries = ExpiryTally()
    for decision, _ in replay_pool(
        config, arrivals, policy, args.replicas, args.routing,
        pool=shared, pinned=pinned, sync_ms=args.pool_sync_ms,
        lease_tokens=args.pool_lease_tokens, outcome=outcome,
    ):  # fmt: skip
        summary.add(decision)
        expiries.add(decision)
    return pool_figures(config, outcome, summary.summary(), expiries)


class ExpiryTally:
    """Per tenant, the requests that passed admission (served, or expired from the queue) and
    those of them that expired: the admitted-then-expired of docs/fairness.md."""

    def __init__(self) -> None:
        self.admitted: dict[str, int] = {}
        self.expired: dict[str, int] = {}

    def add(self, decision: Decision) -> None:
        tenant_id = decision.tenant_id
        if decision.status_code == STATUS_OK:
            self.admitted[tenant_id] = self.admitted.get(tenant_id, 0) + 1
        elif decision.status_code == STATUS_SHED and decision.gate == "queue":
            self.admitted[tenant_id] = self.admitted.get(tenant_id, 0) + 1
            self.expired[tenant_id] = self.expired.get(tenant_id, 0) + 1

    def ratio(self, tenant_id: str | None = None) -> float | None:
        """Expired over admitted, of one tenant or of all; None if none was admitted."""
        if tenant_id is None:
            admitted = sum(self.admitted.values())
            expired = sum(self.expired.values())
        else:
            admitted = self.admitted.get(tenant_id, 0)
            expired = self.expired.get(tenant_id, 0)
        return round(expired / admitted, 4) if admitted else None


def pool_figures(
    config: Config, outcome: PoolReplay, summary: dict[str, Any], expiries: ExpiryTally
) -> dict[str, Any]:
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
            "admitted_then_expired": expiries.ratio(tenant_id),
            "replicas": [r for r in range(replicas) if outcome.offered[r].get(tenant_id)],
        }
    ratios = [row["of_max_min"] for row in rows.values() if row["of_max_min"] is not None]
    jain = _jain(ratios)
    sliced = sliced_jain(outcome, weights)
    dispatched = sum(row["admitted"] for row in summary["tenants"].values())
    return {
        "tenants": rows,
        "jain_of_max_min": None if jain is None else round(jain, 4),
        "jain_of_sliced_max_min": None if sliced is None else round(sliced, 4),
        "slice_ms": outcome.slice_ms,
        "admitted_then_expired": expiries.ratio(),
        "store_calls": outcome.store_calls,
        "requests": outcome.requests,
        "admitted_requests": dispatched,
        "store_calls_per_request": (
            round(outcome.store_calls / outcome.requests, 4) if outcome.requests else 0.0
        ),
        "summary": summary,
    }


def _jain(ratios: list[float]) -> float | None:
    return sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios)) if ratios else None


def sliced_jain(outcome: PoolReplay, weights: dict[str, float]) -> float | None:
    """Jain's index of each tenant's service over its constrained max-min share computed per
    slice of :attr:`PoolReplay.slice_ms` (offers by arrival, capacities and service by end)
    and summed: the reference constrained by when each request could run too (within about
    a slice of its arrival, as a wait limit allows), where :func:`pool_figures`' one over the
    whole window lets an offer of the first second be served in the last. A slice with
    service and no offer adds to the service (not to any share)."""
    replicas = len(outcome.served)
    # Grouped by slice once: O(entries + slices x max-min), not O(slices x entries).
    offers: dict[int, dict[str, list[float]]] = {}
    capacities: dict[int, list[float]] = {}
    served: dict[str, float] = {}
    for replica in range(replicas):
        for (number, tenant_id), tokens in outcome.sliced_offered[replica].items():
            row = offers.setdefault(number, {}).setdefault(tenant_id, [0.0] * replicas)
            row[replica] += tokens
        for (number, tenant_id), tokens in outcome.sliced_served[replica].items():
            capacities.setdefault(number, [0.0] * replicas)[replica] += tokens
            served[tenant_id] = served.get(tenant_id, 0.0) + tokens  # every slice's service
    shares: dict[str, float] = {}
    for number in sorted(offers):
        offered = offers[number]
        fair = constrained_max_min(
            capacities.get(number, [0.0] * replicas),
            offered,
            {t: weights[t] for t in offered},
        )
        for tenant_id, share in fair.items():
            shares[tenant_id] = shares.get(tenant_id, 0.0) + share
    return _jain([served.get(t, 0.0) / share for t, share in shares.items() if share > 0])


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
            f"service / max-min share {run['jain_of_max_min']} (per {run['slice_ms']:g} ms "
            f"slice {run['jain_of_sliced_max_min']}); admitted-then-expired "
            f"{_percent(run['admitted_then_expired'])}"
        )
        lines.append(
            f"  {'tenant':<22}{'weight':>7}{'served':>12}{'max-min':>12}{'of max-min':>12}"
            f"{'expired':>10}  replicas"
        )
        for tenant_id, row in run["tenants"].items():
            lines.append(
                f"  {tenant_id:<22}{row['weight']:>7g}{row['served_service_tokens']:>12}"
                f"{row['max_min_service_tokens']:>12.0f}{_percent(row['of_max_min']):>12}"
                f"{_percent(row['admitted_then_expired']):>10}"
                f"  {','.join(str(r) for r in row['replicas'])}"
            )
        lines.append("")
    return "\n".join(lines)


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f} %"
