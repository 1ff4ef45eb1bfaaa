"""``tokenfair report``: per-tenant fairness of recorded decisions (a live sidecar's or a replay's).

Reads decision records (``records.read_decisions``: the sidecar's records file, ``tokenfair
loadgen --records`` or ``tokenfair simulate --records``), groups them by ``policy`` and prints,
per group, each tenant's served service tokens against its fluid fair-share reference and its
windowed weighted max-min share (``fairness.py``, ``fluid.py``; definitions in docs/report.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from tokenfair.commands import add_format_flag
from tokenfair.config import Config, PolicyConfig, load_tenants_file
from tokenfair.records.codec import read_decisions
from tokenfair.sim.fairness import fairness_report, fairness_to_json, format_fairness
from tokenfair.sim.pool_maxmin import pool_shares

DEFAULT_RATE = PolicyConfig().service_tokens_per_ms


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="per-tenant fairness of recorded decisions: served vs a fluid fair-share reference",
        description=(
            "Read decision records (a sidecar's records file, loadgen --records or simulate "
            "--records; grouped by their 'policy' field) and report, per tenant, the service "
            "tokens offered and served, its fluid reference (what a weighted max-min fluid "
            "server would have given it out of its lane's own service, moment by moment) and "
            "served/fluid, its windowed max-min share of what its lane served and served/fair, "
            "Jain's index per lane against each and the worst tenant, utilisation, refusals by "
            "reason and the admitted requests that expired later. Sizes are actual service "
            "tokens where a record has them (actual_service_tokens), else the estimate. See "
            "docs/report.md."
        ),
    )
    parser.add_argument(
        "--records",
        type=Path,
        required=True,
        action="append",
        metavar="FILE",
        help="decision records (JSONL); repeatable: one file per replica of a pool (each "
        "sidecar's records), reported together and pool-wide against the weighted max-min "
        "share constrained by where each request arrived (docs/fairness.md §9)",
    )
    parser.add_argument(
        "--tenants",
        type=Path,
        metavar="FILE.yaml",
        help="TenantQuota manifests / SchedulingPolicy or a TokenfairConfig (a sidecar's "
        "config file as it is): the tenants' "
        "weights and lanes and the policy's serviceTokensPerMs. Without it every tenant has "
        "weight 1 and the lane of its records, and utilisation is measured against the "
        f"default serviceTokensPerMs ({DEFAULT_RATE:g})",
    )
    add_format_flag(parser)
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="write a PNG of TTFT, admitted and refused service and served vs fluid reference "
        "and windowed share per tenant, one column per policy",
    )
    parser.add_argument(
        "--window",
        metavar="START_MS:END_MS",
        help="the window, in the records' model ms (default: first to last arrival; if every "
        "request arrived at once, up to the end of the last dispatch)",
    )
    parser.set_defaults(func=run)


def _run_pool(
    args: argparse.Namespace,
    paths: list[Path],
    config: Config,
    window: tuple[float, float] | None,
) -> int:
    """Several replicas' records: each policy's fairness over all of them together, and its
    pool-wide shares against the constrained max-min (``sim/pool_maxmin.pool_shares``)."""
    if args.plot:
        raise ValueError("--plot: one --records file only")
    per_file = [read_decisions(path) for path in paths]
    policies = list(dict.fromkeys(policy for results in per_file for policy in results))
    weights = {tenant.tenant_id: tenant.weight for tenant in config.tenants}
    fairness = {}
    pool = {}
    for policy in policies:
        replicas = [results.get(policy, []) for results in per_file]
        merged = [decision for decisions in replicas for decision in decisions]
        fairness[policy] = fairness_report(merged, config, window_ms=window)
        pool[policy] = pool_shares(replicas, weights, window)
    if args.format == "json":
        document = {
            "records": [str(path) for path in paths],
            "fairness": {policy: fairness_to_json(f) for policy, f in fairness.items()},
            "pool": pool,
        }
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    blocks = []
    for policy in policies:
        lines = [
            f"policy {policy}: {len(paths)} replicas' records\n"
            f"{format_fairness(fairness[policy])}".rstrip("\n"),
            f"pool-wide, against the max-min share constrained by where requests arrived "
            f"(Jain {pool[policy]['jain_of_max_min']}):",
            f"  {'tenant':<22}{'weight':>7}{'served':>12}{'max-min':>12}{'of max-min':>12}"
            "  replicas",
        ]
        tenants = pool[policy]["tenants"]
        assert isinstance(tenants, dict)
        for tenant_id, row in tenants.items():
            ratio = row["of_max_min"]
            lines.append(
                f"  {tenant_id:<22}{row['weight']:>7g}{row['served_service_tokens']:>12.0f}"
                f"{row['max_min_service_tokens']:>12.0f}"
                f"{'-' if ratio is None else f'{ratio * 100:.1f} %':>12}"
                f"  {','.join(str(r) for r in row['replicas'])}"
            )
        blocks.append("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(blocks))
    return 0


def parse_window(text: str) -> tuple[float, float]:
    """``START_MS:END_MS`` -> ``(start, end)``: finite numbers, ``end > start``."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (float(start), float(end))
    except ValueError:
        raise ValueError(
            f"--window: expected START_MS:END_MS, e.g. 0:60000 (got {text!r})"
        ) from None
    if not all(math.isfinite(v) for v in window) or not window[1] > window[0]:
        raise ValueError(f"--window: END_MS must be greater than START_MS (got {text!r})")
    return window


def load_tenants(path: Path) -> Config:
    """The policy and tenants of a config file, including the sidecar's own (its ``sidecar:``
    section is accepted and ignored): the file a live sidecar that wrote the records ran with."""
    return load_tenants_file(path)


def run(args: argparse.Namespace) -> int:
    window = None if args.window is None else parse_window(args.window)
    config = load_tenants(args.tenants) if args.tenants else Config(PolicyConfig(), ())
    paths: list[Path] = args.records
    if len(paths) > 1:
        return _run_pool(args, paths, config, window)
    args.records = paths[0]
    results = read_decisions(args.records)
    fairness = {
        policy: fairness_report(decisions, config, window_ms=window)
        for policy, decisions in results.items()
    }
    if args.plot:
        from tokenfair.sim.plot import plot_report  # matplotlib is an optional extra

        count = sum(len(decisions) for decisions in results.values())
        plot_report(
            results,
            args.plot,
            fairness,
            title=f"tokenfair report {args.records.name}: {count} records",
        )
    if args.format == "json":
        document = {
            "records": str(args.records),
            "fairness": {policy: fairness_to_json(f) for policy, f in fairness.items()},
        }
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    blocks = [
        f"policy {policy}: {len(results[policy])} records\n{format_fairness(report)}"
        for policy, report in fairness.items()
    ]
    sys.stdout.write("\n".join(blocks))
    return 0
