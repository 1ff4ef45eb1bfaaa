"""``tokenfair simulate``: replay a scenario or a recorded trace under policies, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenfair_sidecar.config import apply_overrides, load_config
from tokenfair_sidecar.core import DEFAULT_POLICY, LESSON_POLICIES, POLICIES, Decision
from tokenfair_sidecar.costmodel import CostModel
from tokenfair_sidecar.fairness import (
    FairnessReport,
    fairness_report,
    fairness_to_json,
    format_fairness,
)
from tokenfair_sidecar.records import TraceRecord, read_trace, write_decisions
from tokenfair_sidecar.report import summarize
from tokenfair_sidecar.scenarios import SCENARIOS
from tokenfair_sidecar.simulator import simulate

EXPERIMENT = "multi-tenant-service-token-drr-and-admission-control"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a workload under one or more policies and compare them",
        description=(
            "Replay a built-in scenario or a recorded trace on a virtual clock (one serial model "
            "server, the lesson's cost model) and report admissions, sheds and TTFT per policy, "
            "then each tenant's served service tokens against its weighted max-min fair share "
            "over the arrival window (docs/report.md). The JSON report keeps the lesson's "
            "'comparison' block and adds 'fairness' by policy beside it."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", choices=sorted(SCENARIOS), help="a built-in workload")
    source.add_argument("--trace", type=Path, help="request records (JSONL); needs --tenants")
    parser.add_argument(
        "--tenants",
        type=Path,
        help="YAML with TenantQuota manifests and/or a SchedulingPolicy or a TokenfairConfig",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=sorted(POLICIES),
        help="policy to run (repeatable; default: "
        f"{', '.join([*LESSON_POLICIES, DEFAULT_POLICY])})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a policy parameter (maxBatchWaitMs=5000) or tenant field "
        "(tenants.tenant_batch_rag.weight=2); repeatable",
    )
    parser.add_argument("--records", type=Path, help="write every decision record here (JSONL)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument(
        "--plot",
        type=Path,
        help="write a PNG of TTFT, admitted service and served vs fair share per tenant",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace: list[TraceRecord] = []
    if args.scenario:
        if args.tenants:
            config = load_config(args.tenants)
            _, requests = SCENARIOS[args.scenario]()
        else:
            config, requests = SCENARIOS[args.scenario]()
    else:
        if not args.tenants:
            raise ValueError("--trace needs --tenants FILE.yaml (the quotas to replay against)")
        config = load_config(args.tenants)
        trace = read_trace(args.trace, known_tenants=config.tenant_index)
        requests = [record.request for record in trace]
    config = apply_overrides(config, args.overrides)
    # Recorded usage: the replay runs it (time and KV) and settles it, priced by the (possibly
    # overridden) policy's cost model.
    cost = CostModel.from_policy(config.policy)
    actual: dict[str, int] = {}
    actual_kv: dict[str, int] = {}
    for record in trace:
        used = record.actual_tokens()
        if used is not None:
            actual[record.request.request_id] = cost.service_tokens(*used)
            actual_kv[record.request.request_id] = cost.kv_blocks(*used)
    policies = args.policy or [*LESSON_POLICIES, DEFAULT_POLICY]
    results: dict[str, list[Decision]] = {
        name: simulate(config, requests, name, actual, actual_kv) for name in policies
    }
    comparison = {name: summarize(decisions) for name, decisions in results.items()}
    # The trace's actual usage sizes refused requests too (offered demand), not only settled ones.
    fairness = {
        name: fairness_report(decisions, config, actual_service_tokens=actual)
        for name, decisions in results.items()
    }
    report = {
        "experiment": EXPERIMENT,
        "decode_weight": config.policy.decode_weight,
        "comparison": comparison,  # exactly the lesson's shape: nothing of ours inside
        "fairness": {name: fairness_to_json(f) for name, f in fairness.items()},
    }
    if args.records:
        write_decisions(args.records, results)
    if args.plot:
        from tokenfair_sidecar.plot import plot_report  # matplotlib is an optional extra

        plot_report(results, args.plot, fairness)
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(comparison, fairness))
    return 0


def format_table(
    comparison: dict[str, dict[str, Any]], fairness: Mapping[str, FairnessReport] | None = None
) -> str:
    """A fixed-width table: one block per policy, one row per tenant; with ``fairness`` (by
    policy), its table under each block."""
    lines = []
    for name, summary in comparison.items():
        lines.append(
            f"{name}: admitted {summary['admitted_requests']}/{summary['total_requests']}, "
            f"shed {summary['shed_429_requests']} {summary['shed_reasons'] or ''}".rstrip()
        )
        lines.append(
            f"  interactive TTFT p50 {summary['interactive_p50_ttft_ms']:.2f} ms, "
            f"p99 {summary['interactive_p99_ttft_ms']:.2f} ms; batch TTFT p99 "
            f"{summary['batch_p99_ttft_ms']:.2f} ms; peak admitted KV "
            f"{summary['peak_kv_occupancy_ratio']:.4f}"
        )
        lines.append(
            f"  {'tenant':<22}{'submitted':>10}{'admitted':>10}{'shed':>6}"
            f"{'service tokens':>16}{'p50 TTFT':>11}{'p99 TTFT':>11}"
        )
        for tenant_id, row in summary["tenants"].items():
            lines.append(
                f"  {tenant_id:<22}{row['submitted']:>10}{row['admitted']:>10}{row['shed_429']:>6}"
                f"{row['admitted_service_tokens']:>16}{row['p50_ttft_ms']:>11.2f}"
                f"{row['p99_ttft_ms']:>11.2f}"
            )
        if fairness is not None and name in fairness:
            lines.append(format_fairness(fairness[name]).rstrip("\n"))
        lines.append("")
    return "\n".join(lines)
