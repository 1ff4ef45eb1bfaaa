"""``tokenfair loadgen``: replay a workload against a live sidecar and report like ``simulate``.

Keys: ``--keys FILE.yaml`` is a YAML mapping ``tenant_id: api_key``; ``--key TENANT=KEY``
(repeatable) adds or overrides one. Every tenant of the workload needs a key.

Defaults: ``--time-scale 1``, ``--concurrency-limit 256``, ``--request-timeout 30`` s,
``--timeout`` = the scaled span of the workload + ``--request-timeout`` + 5 s (by then every
request has either finished or timed out), ``--decode-weight`` the scenario's (4 for traces).

KV occupancy: with ``--admin URL`` (the sidecar's admin listener) the sidecar's
``tokenfair_kv_occupancy_ratio`` gauge is sampled every ``--kv-sample-ms`` and the report's
``peak_kv_occupancy_ratio`` is the largest sample (a lower bound of the peak); without it the
figure is not measured and the report says so (``null`` in JSON).

Exit codes: 0 when every request got an outcome within ``--timeout``; 1 when the run's timeout
cut it short or a connection failed (the report is still printed, the first connection error goes
to stderr); 2 for a bad flag or input (the message names it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from tokenfair.commands import add_format_flag, progress
from tokenfair.commands.simulate import EXPERIMENT, format_table
from tokenfair.config import MAX_DOCUMENT_BYTES, PolicyConfig
from tokenfair.config.fields import flag_number, positive, positive_int
from tokenfair.config.files import InputFileError, read_regular
from tokenfair.core import Request
from tokenfair.loadgen import (
    KV_GAUGE,
    LoadgenSettings,
    ReplayResult,
    record_line,
    replay,
    to_decision,
)
from tokenfair.records.codec import encode_record_line, read_trace
from tokenfair.sim.report import summarize
from tokenfair.sim.scenarios import SCENARIOS

RUN_LABEL: Final = "live"
"""Name of the run in the report's ``comparison`` (where ``simulate`` puts policy names)."""
TIMEOUT_SLACK_S: Final = 5.0


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "loadgen",
        help="replay a workload against a live OpenAI-compatible endpoint (the sidecar)",
        description=(
            "Send a built-in scenario or a recorded trace to a live endpoint over HTTP on its own "
            "timeline (/v1/completions, one API key per tenant) and print the same report as "
            "`tokenfair simulate`, TTFT scaled back to model time (wall ms / --time-scale)."
        ),
    )
    parser.add_argument(
        "--target", required=True, help="base URL of the endpoint, e.g. http://127.0.0.1:8080"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", choices=sorted(SCENARIOS), help="a built-in workload")
    source.add_argument("--trace", type=Path, help="request records to replay (JSONL)")
    parser.add_argument("--keys", type=Path, help="YAML mapping tenant_id: api_key")
    parser.add_argument(
        "--key",
        dest="key_pairs",
        action="append",
        default=[],
        metavar="TENANT=KEY",
        help="API key of one tenant (repeatable; overrides --keys)",
    )
    parser.add_argument(
        "--time-scale",
        type=flag_number,
        default=1.0,
        help="wall time per unit of trace time (default 1; 0.1 = ten times faster)",
    )
    parser.add_argument("--stream", action="store_true", help="stream (TTFT = first SSE chunk)")
    add_format_flag(parser)
    parser.add_argument("--records", type=Path, help="write one record per request (JSONL)")
    parser.add_argument(
        "--concurrency-limit",
        type=flag_number,
        default=256,
        help="most requests in flight (default 256)",
    )
    parser.add_argument(
        "--timeout", type=flag_number, help="bound on the whole run in seconds (default: see docs)"
    )
    parser.add_argument(
        "--request-timeout",
        type=flag_number,
        default=30.0,
        help="bound on one request in seconds (default 30)",
    )
    parser.add_argument(
        "--decode-weight",
        type=flag_number,
        help="service tokens per decoded token, for the report (default: the scenario's, or 4)",
    )
    parser.add_argument(
        "--model",
        help="`model` of every request body (default: the first model the target's GET "
        "/v1/models lists)",
    )
    parser.add_argument(
        "--admin",
        metavar="URL",
        help="the sidecar's admin listener, e.g. http://127.0.0.1:9090: its /metrics KV gauge "
        "is sampled during the run for the report's peak KV occupancy (without it, KV is not "
        "measured live)",
    )
    parser.add_argument(
        "--kv-sample-ms",
        type=flag_number,
        default=50.0,
        metavar="MS",
        help="wall ms between two samples of the KV gauge (default 50; with --admin)",
    )
    progress.add_flag(parser)
    parser.set_defaults(func=run)


def load_keys(path: Path | None, pairs: Sequence[str]) -> dict[str, str]:
    """Tenant -> API key from ``--keys`` then ``--key`` pairs (later wins)."""
    keys: dict[str, str] = {}
    if path is not None:
        try:
            data = yaml.safe_load(read_regular(path, MAX_DOCUMENT_BYTES).decode("utf-8"))
        except InputFileError as exc:
            raise ValueError(f"--keys {exc}") from None
        except OSError as exc:
            raise ValueError(f"--keys {path}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--keys {path}: not UTF-8 text ({exc.reason})") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--keys {path}: invalid YAML: {exc}") from None
        except RecursionError:
            raise ValueError(f"--keys {path}: invalid YAML: nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError(f"--keys {path}: must be a YAML mapping tenant_id: api_key")
        for tenant, key in data.items():
            if not isinstance(tenant, str) or not isinstance(key, str) or not key:
                raise ValueError(
                    f"--keys {path}: entry {tenant!r} must map a tenant id to a non-empty key"
                )
            keys[tenant] = key
    for pair in pairs:
        tenant, sep, key = pair.partition("=")
        if not sep or not tenant.strip() or not key:
            raise ValueError(f"--key {pair!r}: expected TENANT=KEY")
        keys[tenant.strip()] = key
    return keys


def _workload(args: argparse.Namespace) -> tuple[list[Request], float]:
    if args.scenario:
        config, requests = SCENARIOS[args.scenario]()
        return requests, config.policy.decode_weight
    return [record.request for record in read_trace(args.trace)], PolicyConfig().decode_weight


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its URL and number flags checked, the numbers parsed by the
    :mod:`~tokenfair.config.fields` rules (``--concurrency-limit 8.0`` is 8); a bad value raises
    ``ValueError`` naming its flag. Needs no input: :func:`run` calls it before the workload is
    read. Parsing again a value it parsed gives the same value."""
    for flag, url in (("--target", args.target), ("--admin", args.admin)):
        if url is not None and (
            not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0
        ):
            raise ValueError(f"{flag}: must be an http:// or https:// URL (got {url!r})")
    timeout, decode_weight = args.timeout, args.decode_weight
    return argparse.Namespace(
        **{
            **vars(args),
            "time_scale": positive("--time-scale", args.time_scale),
            "request_timeout": positive("--request-timeout", args.request_timeout),
            "concurrency_limit": positive_int("--concurrency-limit", args.concurrency_limit),
            "timeout": None if timeout is None else positive("--timeout", timeout),
            "decode_weight": None
            if decode_weight is None
            else positive("--decode-weight", decode_weight),
            "kv_sample_ms": positive("--kv-sample-ms", args.kv_sample_ms),
        }
    )


def settings_from(
    args: argparse.Namespace, requests: Sequence[Request], decode_weight: float
) -> LoadgenSettings:
    """Validated settings (the flags by :func:`check_flags`, then ``--timeout`` against the
    workload's span); a bad value raises ``ValueError`` naming its flag."""
    args = check_flags(args)
    time_scale = args.time_scale
    span_s = max((r.arrival_ms for r in requests), default=0.0) * time_scale / 1000.0
    if args.timeout is None:
        timeout_s = span_s + args.request_timeout + TIMEOUT_SLACK_S
    else:
        timeout_s = args.timeout
        if timeout_s <= span_s:
            raise ValueError(
                f"--timeout: {timeout_s:g} s ends before the last request is due "
                f"({span_s:g} s at --time-scale {time_scale:g}); raise it or lower --time-scale"
            )
    return LoadgenSettings(
        target_url=args.target,
        time_scale=time_scale,
        stream=args.stream,
        concurrency_limit=args.concurrency_limit,
        timeout_s=timeout_s,
        request_timeout_s=args.request_timeout,
        model=args.model,
        decode_weight=decode_weight if args.decode_weight is None else args.decode_weight,
        admin_url=args.admin,
        kv_sample_s=args.kv_sample_ms / 1000.0,
    )


def build_report(result: ReplayResult) -> dict[str, Any]:
    """``simulate``'s report (``experiment``, ``decode_weight``, ``comparison``) plus ``run``."""
    settings = result.settings
    decisions = [to_decision(o, settings) for o in result.observations]
    summary = summarize(decisions)
    # The client sees no KV: the figure is the sidecar's sampled gauge, or not measured (null).
    kv = result.kv
    summary["peak_kv_occupancy_ratio"] = (
        None if kv is None or kv.peak is None else round(kv.peak, 4)
    )
    run_info: dict[str, Any] = {
        "target": settings.target_url,
        "time_scale": settings.time_scale,
        "stream": settings.stream,
        "ttft_clock": "model ms (wall ms / time_scale)",
        "wall_seconds": round(result.wall_s, 3),
        "completed": result.completed,
    }
    metrics_url = settings.metrics_url
    run_info["kv_occupancy"] = (
        {"measured": False}
        if kv is None or metrics_url is None
        else {
            "measured": kv.peak is not None,
            "source": f"{metrics_url} {KV_GAUGE}",
            "sample_interval_ms": round(settings.kv_sample_s * 1000.0, 3),
            "samples": kv.samples,
            "peak": None if kv.peak is None else round(kv.peak, 4),
            **({"error": kv.error} if kv.error else {}),
        }
    )
    return {
        "experiment": EXPERIMENT,
        "decode_weight": settings.decode_weight,
        "comparison": {RUN_LABEL: summary},
        "run": run_info,
    }


def write_records(path: Path, result: ReplayResult) -> None:
    """One record line per request (``records/codec.py``'s schema and encoder), policy ``live``."""
    with path.open("wb") as handle:
        for observation in result.observations:
            line = record_line(observation, to_decision(observation, result.settings))
            handle.write(encode_record_line(line, RUN_LABEL) + b"\n")


def _missing_keys(requests: Sequence[Request], keys: Mapping[str, str]) -> list[str]:
    return sorted({r.tenant_id for r in requests} - set(keys))


def run(args: argparse.Namespace) -> int:
    args = check_flags(args)  # before the workload is read
    requests, decode_weight = _workload(args)
    keys = load_keys(args.keys, args.key_pairs)
    missing = _missing_keys(requests, keys)
    if missing:
        raise ValueError(
            f"--key/--keys: no API key for tenant(s) {', '.join(missing)} "
            "(give --key TENANT=KEY or a --keys file)"
        )
    settings = settings_from(args, requests, decode_weight)
    with progress.bar(args, "loadgen", total=len(requests)) as bar:
        result = asyncio.run(replay(requests, keys, settings, bar.update if bar.shown else None))
    report = build_report(result)
    if args.records:
        write_records(args.records, result)
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        run_info = report["run"]
        sys.stdout.write(
            f"live run against {run_info['target']}: {len(requests)} requests in "
            f"{run_info['wall_seconds']:.2f} s wall, time scale {settings.time_scale:g}, "
            f"{'streaming' if settings.stream else 'not streaming'}; "
            "TTFT in model ms (wall ms / time scale)\n"
        )
        kv_info = run_info["kv_occupancy"]
        if kv_info.get("samples"):
            sys.stdout.write(
                f"KV occupancy: {kv_info['samples']} samples of {kv_info['source']} every "
                f"{kv_info['sample_interval_ms']:g} ms; the peak is the largest sample (a lower "
                "bound)\n"
            )
        sys.stdout.write(format_table(report["comparison"]))
    if result.kv is not None and result.kv.error:
        print(
            f"tokenfair loadgen: KV occupancy sampling stopped: {result.kv.error}",
            file=sys.stderr,
        )
    failed = [o for o in result.observations if o.error]
    if failed:
        print(
            f"tokenfair loadgen: {len(failed)} request(s) got no HTTP response "
            f"(first: {failed[0].request.request_id}: {failed[0].error})",
            file=sys.stderr,
        )
    if not result.completed:
        print(
            f"tokenfair loadgen: --timeout {settings.timeout_s:g} s passed before every request "
            "finished; unfinished ones count as client_timeout or not_sent",
            file=sys.stderr,
        )
    return 0 if result.completed and not failed else 1
