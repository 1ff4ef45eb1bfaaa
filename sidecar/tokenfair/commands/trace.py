"""``tokenfair trace generate``: write a synthetic mixed workload as request records (JSONL)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tokenfair.commands import progress
from tokenfair.config import Config, apply_overrides, load_tenants_file
from tokenfair.config.fields import (
    ConfigError,
    flag_number,
    integer,
    number,
    positive,
    positive_int,
    shown,
)
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import TraceRecord, dump_trace
from tokenfair.records.schema import MAX_RECORD_MS
from tokenfair.sim.scenarios import lesson_config
from tokenfair.sim.tracegen import (
    ARRIVAL_PROCESSES,
    DEFAULT_BURST_OFF_MS,
    DEFAULT_BURST_ON_MS,
    DEFAULT_DURATION_MS,
    DEFAULT_MIX_BY_CLASS,
    DEFAULT_NOISE_FRACTION,
    DEFAULT_RATE_PER_SECOND,
    MIXES,
    ArrivalProcess,
    Mix,
    TenantWorkload,
    WorkloadError,
    WorkloadSpec,
    generate,
    observe,
)

T = TypeVar("T")


def _mix_line(mix: Mix) -> str:
    prompt, output = mix.prompt, mix.output
    prompt_range = f"{prompt.median_tokens} [{prompt.min_tokens}-{prompt.max_tokens}]"
    output_range = f"{output.median_tokens} [{output.min_tokens}-{output.max_tokens}]"
    return f"  {mix.name:<11} {prompt_range:<18} {output_range:<15} {mix.description}\n"


EPILOG = (
    "mixes (prompt tokens, output tokens: median [min-max], log-normal):\n"
    + "".join(_mix_line(m) for m in MIXES.values())
    + "--prompt-tokens and --output-tokens replace a side of the mix with a fixed length.\n"
    "\narrival processes (mean rate r = --rate, gap g = 1000/r ms):\n"
    "  poisson     exponential gaps of mean g\n"
    "  constant    gaps of exactly g, from a random phase in [0, g) per tenant\n"
    "  bursty      random on/off: exponential periods of mean --burst-on-ms/--burst-off-ms,\n"
    "              Poisson while on at r*(on+off)/on, so the mean stays r\n"
    "  periodic    on for exactly --burst-on-ms, then off for exactly --burst-off-ms, from the\n"
    "              tenant's window start; Poisson while on at r*(on+off)/on\n"
    "\nexamples:\n"
    "  tokenfair trace generate --duration-ms 30000 --rate tenant_batch_rag=2 \\\n"
    "      --mix tenant_ide_assist=completion --arrivals tenant_batch_rag=bursty \\\n"
    "      --window tenant_batch_rag=5000:20000 --seed 7 --out trace.jsonl\n"
    "  # a flood at a constant 337.5/s and a Poisson victim at 45/s, 200+50 tokens each\n"
    "  tokenfair trace generate --tenants tenants.yaml --duration-ms 60000 \\\n"
    "      --arrivals flood=constant --rate flood=337.5 --rate victim=45 \\\n"
    "      --prompt-tokens 200 --output-tokens 50 --out flood.jsonl\n"
    "  # a batch tenant of 12000+200 tokens, on for 5 s then off for 5 s, repeatedly\n"
    "  tokenfair trace generate --arrivals tenant_batch_rag=periodic \\\n"
    "      --burst-on-ms tenant_batch_rag=5000 --burst-off-ms tenant_batch_rag=5000 \\\n"
    "      --prompt-tokens tenant_batch_rag=12000 --output-tokens tenant_batch_rag=200\n"
    "\nFlags marked [TENANT=] take a bare value (every tenant) or TENANT=VALUE (one tenant);\n"
    "repeat them. Schema of the output: docs/records.md."
)


def register(subparsers: Any) -> None:
    group: argparse.ArgumentParser = subparsers.add_parser(
        "trace", help="make request traces", description="Make request traces (JSONL records)."
    )
    actions = group.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    parser: argparse.ArgumentParser = actions.add_parser(
        "generate",
        help="generate a synthetic mixed workload",
        description=(
            "Generate a synthetic workload from several tenants (Poisson, constant-rate, bursty "
            "or periodic on/off arrivals; named prompt/output mixes or fixed sizes) as request "
            "records, deterministic under --seed. "
            "With --observe, add the times the cost model predicts (plus noise) for calibration."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tenants",
        type=Path,
        metavar="FILE.yaml",
        help="TenantQuota manifests / TokenfairConfig giving the tenants and their priority "
        "classes, the sidecar's config file as it is (default: the lesson's tenant_chat_pro, "
        "tenant_ide_assist, tenant_batch_rag)",
    )
    parser.add_argument(
        "--duration-ms",
        type=flag_number,
        metavar="MS",
        help=f"length of the trace in ms (default {DEFAULT_DURATION_MS:.0f} unless --requests)",
    )
    parser.add_argument(
        "--requests",
        type=flag_number,
        metavar="N",
        help="stop after N requests in all (with --duration-ms: whichever comes first)",
    )
    parser.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="[TENANT=]RPS",
        help=f"mean requests per second per tenant (default {DEFAULT_RATE_PER_SECOND:g}; "
        "0 switches a tenant off)",
    )
    parser.add_argument(
        "--mix",
        action="append",
        default=[],
        metavar="[TENANT=]MIX",
        help=f"prompt/output mix: {', '.join(MIXES)} (default: "
        f"{DEFAULT_MIX_BY_CLASS['interactive']} for interactive tenants, "
        f"{DEFAULT_MIX_BY_CLASS['batch']} for batch tenants)",
    )
    parser.add_argument(
        "--prompt-tokens",
        action="append",
        default=[],
        metavar="[TENANT=]N",
        help="every prompt exactly N tokens (integer >= 0) instead of the mix's prompt lengths; "
        "the output side still follows the mix unless --output-tokens fixes it too",
    )
    parser.add_argument(
        "--output-tokens",
        action="append",
        default=[],
        metavar="[TENANT=]N",
        help="every output exactly N tokens (integer >= 0) instead of the mix's output lengths",
    )
    parser.add_argument(
        "--arrivals",
        action="append",
        default=[],
        metavar="[TENANT=]PROCESS",
        help=f"arrival process: {', '.join(ARRIVAL_PROCESSES)} (default poisson); every one "
        "keeps the mean --rate (list below)",
    )
    parser.add_argument(
        "--burst-on-ms",
        action="append",
        default=[],
        metavar="[TENANT=]MS",
        help="on period: the mean of the exponential on periods of bursty tenants, the exact "
        f"on period of periodic ones (default {DEFAULT_BURST_ON_MS:.0f})",
    )
    parser.add_argument(
        "--burst-off-ms",
        action="append",
        default=[],
        metavar="[TENANT=]MS",
        help="off period: the mean of the exponential off periods of bursty tenants, the exact "
        f"off period of periodic ones (default {DEFAULT_BURST_OFF_MS:.0f})",
    )
    parser.add_argument(
        "--window",
        action="append",
        default=[],
        metavar="[TENANT=]START_MS:END_MS",
        help="send only in [START_MS, END_MS); either side may be empty (a tenant that joins "
        "late or leaves early)",
    )
    parser.add_argument("--seed", type=flag_number, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--observe",
        action="store_true",
        help="add actual_* token counts, ttft_ms and e2e_ms: the cost model's idle-server "
        "times (policy of --tenants, with --set) times log-normal noise",
    )
    parser.add_argument(
        "--noise",
        type=flag_number,
        default=None,
        metavar="FRACTION",
        help=f"relative standard deviation of the observed times, in [0, 1) (default "
        f"{DEFAULT_NOISE_FRACTION:g}; with --observe)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cost-model coefficient for --observe (decodeWeight=3, serviceTokensPerMs=30, "
        "prefillTokensPerMs, prefillFloorMs); repeatable",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="write the records here (default: stdout)"
    )
    progress.add_flag(parser)
    parser.set_defaults(func=run)


def _noise(value: object) -> float:
    """``--noise``: a number in [0, 1)."""
    noise = number("--noise", value)
    if not 0 <= noise < 1:
        raise ConfigError(f"--noise: must be in [0, 1) (got {shown(value)})")
    return noise


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its number flags parsed by the :mod:`~tokenfair.config.fields` rules
    (``--requests 2.0`` is 2); a bad one raises :class:`ConfigError` naming the flag, and
    ``--noise`` or ``--set`` without ``--observe`` a :class:`WorkloadError`."""
    if not args.observe and (args.overrides or args.noise is not None):
        flag = "--set" if args.overrides else "--noise"
        raise WorkloadError(f"{flag}: only applies with --observe")
    duration_ms, requests, noise = args.duration_ms, args.requests, args.noise
    return argparse.Namespace(
        **{
            **vars(args),
            "duration_ms": None if duration_ms is None else positive("--duration-ms", duration_ms),
            "requests": None if requests is None else positive_int("--requests", requests),
            "seed": integer("--seed", args.seed),
            "noise": None if noise is None else _noise(noise),
        }
    )


def run(args: argparse.Namespace) -> int:
    args = check_flags(args)  # before the tenants file is read
    config = load_tenants_file(args.tenants) if args.tenants else lesson_config()
    cost = CostModel.from_policy(apply_overrides(config, args.overrides).policy)
    spec = build_spec(config, args)
    with progress.bar(args, "trace generate", total=spec.max_requests) as bar:
        requests = generate(spec, bar.iterate)
    if args.observe:
        noise = DEFAULT_NOISE_FRACTION if args.noise is None else args.noise
        records = observe(requests, cost, noise, args.seed)
    else:
        records = [TraceRecord(r) for r in requests]
    _check_times(records)
    with progress.bar(args, "trace write", total=len(records)) as bar:
        if args.out is None:
            dump_trace(sys.stdout, bar.iterate(records))
            return 0
        try:
            with args.out.open("w", encoding="utf-8") as handle:
                dump_trace(handle, bar.iterate(records))
        except OSError as exc:
            raise WorkloadError(f"--out {args.out}: cannot write ({exc.strerror})") from None
    return 0


def _check_times(records: Sequence[TraceRecord]) -> None:
    """Refuse, before anything is written, a trace with a time past ``MAX_RECORD_MS`` (the
    largest a record may carry: the reader would refuse the file)."""
    for record in records:
        for name, value in (
            ("arrival_ms", record.request.arrival_ms),
            ("ttft_ms", record.ttft_ms),
            ("e2e_ms", record.e2e_ms),
        ):
            if value is not None and value > MAX_RECORD_MS:
                raise WorkloadError(
                    f"request {record.request.request_id}: {name} {value:g} is past "
                    f"{MAX_RECORD_MS:g} ms, the largest time a record may carry "
                    "(--window, --duration-ms, or the observed times' --set)"
                )


def build_spec(config: Config, args: argparse.Namespace) -> WorkloadSpec:
    """Resolve the per-tenant flags against the config's tenants."""
    known = list(config.tenant_index)
    rates = _keyed("--rate", args.rate, known, _rate)
    mixes = _keyed("--mix", args.mix, known, _mix)
    arrivals = _keyed("--arrivals", args.arrivals, known, _arrival)
    windows = _keyed("--window", args.window, known, _window)
    prompt_tokens = _keyed("--prompt-tokens", args.prompt_tokens, known, _tokens)
    output_tokens = _keyed("--output-tokens", args.output_tokens, known, _tokens)
    burst_on_ms = _keyed("--burst-on-ms", args.burst_on_ms, known, _period)
    burst_off_ms = _keyed("--burst-off-ms", args.burst_off_ms, known, _period)
    duration_ms = args.duration_ms
    if duration_ms is None and args.requests is None:
        duration_ms = DEFAULT_DURATION_MS
    tenants = []
    for tenant in config.tenants:
        tid = tenant.tenant_id
        start_ms, end_ms = windows.get(tid, (0.0, math.inf))
        mix = mixes.get(tid, MIXES[DEFAULT_MIX_BY_CLASS[tenant.priority_class]])
        tenants.append(
            TenantWorkload(
                tenant_id=tid,
                priority_class=tenant.priority_class,
                # A fixed side overrides the mix whatever the flags' order; the other side stays.
                mix=mix.with_fixed(prompt_tokens.get(tid), output_tokens.get(tid)),
                rate_per_second=rates.get(tid, DEFAULT_RATE_PER_SECOND),
                arrivals=arrivals.get(tid, "poisson"),
                start_ms=start_ms,
                end_ms=end_ms,
                burst_on_ms=burst_on_ms.get(tid, DEFAULT_BURST_ON_MS),
                burst_off_ms=burst_off_ms.get(tid, DEFAULT_BURST_OFF_MS),
            )
        )
    return WorkloadSpec(
        tenants=tuple(tenants),
        seed=args.seed,
        duration_ms=duration_ms,
        max_requests=args.requests,
    )


def _keyed(
    flag: str, entries: Sequence[str], known: Sequence[str], parse: Callable[[str, str], T]
) -> Mapping[str, T]:
    """``[TENANT=]VALUE`` entries -> value by tenant; a bare value sets every tenant, and a later
    entry overrides an earlier one."""
    values: dict[str, T] = {}
    for entry in entries:
        tenant_id, sep, raw = entry.rpartition("=")
        if sep and tenant_id not in known:
            raise WorkloadError(
                f"{flag} {entry}: unknown tenant {tenant_id!r} (known: {', '.join(known)})"
            )
        value = parse(f"{flag} {entry}", raw)
        for tid in [tenant_id] if sep else known:
            values[tid] = value
    return values


def _rate(where: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise WorkloadError(f"{where}: not a number of requests per second") from None
    if not 0 <= value < math.inf:
        raise WorkloadError(f"{where}: must be >= 0 requests per second")
    return value


def _mix(where: str, raw: str) -> Mix:
    if raw not in MIXES:
        raise WorkloadError(f"{where}: unknown mix (known: {', '.join(MIXES)})")
    return MIXES[raw]


def _arrival(where: str, raw: str) -> ArrivalProcess:
    for process in ARRIVAL_PROCESSES:
        if raw == process:
            return process
    raise WorkloadError(f"{where}: unknown arrival process (known: {', '.join(ARRIVAL_PROCESSES)})")


def _tokens(where: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise WorkloadError(f"{where}: not an integer number of tokens") from None
    if value < 0:
        raise WorkloadError(f"{where}: must be an integer >= 0 tokens")
    return value


def _period(where: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise WorkloadError(f"{where}: not a number of ms") from None
    if not 0 < value < math.inf:
        raise WorkloadError(f"{where}: must be > 0 ms")
    return value


def _window(where: str, raw: str) -> tuple[float, float]:
    start, sep, end = raw.partition(":")
    try:
        if not sep:
            raise ValueError
        start_ms = float(start) if start.strip() else 0.0
        end_ms = float(end) if end.strip() else math.inf
    except ValueError:
        raise WorkloadError(f"{where}: expected START_MS:END_MS (e.g. 5000:20000)") from None
    if not 0 <= start_ms < end_ms:
        raise WorkloadError(f"{where}: needs 0 <= START_MS < END_MS")
    return start_ms, end_ms
