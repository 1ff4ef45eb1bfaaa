"""``tokenfair calibrate``: fit the cost model (decodeWeight, serviceTokensPerMs, the prefill
speed and, from records taken under load, the batching engine's maxBatchRequests and
batchThroughputGain) to observed request times.

Exit codes: 0 a fit was printed (with a ``problem:`` line for each thing the records could not
determine or fit well); 1 the records cannot support a fit (too few usable records,
proportional prompt/output lengths, a non-positive coefficient, too uncertain), with the reason
on stderr; 2 a bad flag or an unreadable or invalid records file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenfair.commands import add_format_flag, progress
from tokenfair.config.document import MAX_BATCH_REQUESTS
from tokenfair.config.fields import (
    ConfigError,
    flag_number,
    integer,
    non_negative,
    positive,
    shown,
)
from tokenfair.config.files import InputFileError, open_regular
from tokenfair.records.codec import TraceError, TraceRecord, iter_trace_lines
from tokenfair.sim.batchfit import BatchingFit
from tokenfair.sim.calibrate import (
    DEFAULT_MAX_RELATIVE_STDERR,
    DEFAULT_MIN_RECORDS,
    DEFAULT_PREFILL_FLOOR_MS,
    Calibration,
    CalibrationError,
    calibrate,
    read_outcomes,
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="fit the cost model (a batching engine's, from records under load) to observed "
        "request times",
        description=(
            "Fit the cost model execution_ms = (prefill + decodeWeight * decode) / "
            "serviceTokensPerMs to request records carrying e2e_ms (and ttft_ms) with actual "
            "token counts, by least squares on the relative error; execution_ms = e2e_ms - "
            "queue_wait_ms - observed.send_lag_ms (0 when a record has none). Records taken "
            "under load (a sidecar's or loadgen's, whose runs overlap) fit a batching engine: "
            "each request's concurrency is swept from every record's run, and run_ms = "
            "(prefill + decodeWeight * decode) * (A + b * (c - 1)) gives serviceTokensPerMs, "
            "batchThroughputGain and maxBatchRequests. Prints the fit quality, a problem line "
            "for what the records cannot determine, and the --set flags that apply it. Exit 1 "
            "when the records cannot support a fit. See docs/calibration.md."
        ),
    )
    parser.add_argument(
        "--records", type=Path, required=True, metavar="FILE", help="request records (JSONL)"
    )
    parser.add_argument(
        "--min-records",
        type=flag_number,
        default=DEFAULT_MIN_RECORDS,
        metavar="N",
        help=f"refuse with fewer usable records (default {DEFAULT_MIN_RECORDS})",
    )
    parser.add_argument(
        "--max-relative-stderr",
        type=flag_number,
        default=DEFAULT_MAX_RELATIVE_STDERR,
        metavar="FRACTION",
        help="refuse when the standard error of decodeWeight or serviceTokensPerMs exceeds this "
        f"fraction of it (default {DEFAULT_MAX_RELATIVE_STDERR:g})",
    )
    parser.add_argument(
        "--prefill-floor-ms",
        type=flag_number,
        default=DEFAULT_PREFILL_FLOOR_MS,
        metavar="MS",
        help="shortest prefill of the model (prefillFloorMs); TTFTs it may explain are left out "
        f"of the prefill-speed fit (default {DEFAULT_PREFILL_FLOOR_MS:g})",
    )
    parser.add_argument(
        "--max-batch-requests",
        type=flag_number,
        default=None,
        metavar="S",
        help="the batching engine's most requests at once (maxBatchRequests, vLLM's "
        "--max-num-seqs) to price serviceTokensPerMs and batchThroughputGain at, for records "
        "taken under load (default: the most the records show running at once)",
    )
    add_format_flag(parser, table="the fit, its quality and the --set flags")
    progress.add_flag(parser)
    parser.set_defaults(func=run)


def _line_count(path: Path) -> int | None:
    """Lines of ``path`` (the bar's total; blank lines included), or None if unreadable or no
    regular file (the reader then says why)."""
    try:
        with open_regular(path) as handle:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    except (OSError, InputFileError):
        return None


def read_records(path: Path, bar: progress.Bar) -> list[TraceRecord]:
    """``records.read_trace``, counting the records on ``bar``."""
    lines = bar.iterate(iter_trace_lines(path))
    records = [TraceRecord.from_line(line) for line in lines]
    if not records:
        raise TraceError(f"{path}: no records")
    return records


MIN_RECORDS_FLOOR = 3
"""The fewest records ``--min-records`` may ask for: two coefficients and a residual."""


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its number flags parsed by the :mod:`~tokenfair.config.fields` rules
    (``--min-records 5.0`` is 5); a bad one raises :class:`ConfigError` naming the flag."""
    min_records = integer("--min-records", args.min_records)
    if min_records < MIN_RECORDS_FLOOR:
        raise ConfigError(
            f"--min-records: must be >= {MIN_RECORDS_FLOOR} (got {shown(args.min_records)})"
        )
    return argparse.Namespace(
        **{
            **vars(args),
            "min_records": min_records,
            "max_relative_stderr": positive("--max-relative-stderr", args.max_relative_stderr),
            "prefill_floor_ms": non_negative("--prefill-floor-ms", args.prefill_floor_ms),
            "max_batch_requests": _batch_flag(args.max_batch_requests),
        }
    )


def _batch_flag(value: object) -> int | None:
    """``--max-batch-requests``: an integer in ``[1, MAX_BATCH_REQUESTS]`` (the policy field's
    rule), or None when not given."""
    if value is None:
        return None
    batch = integer("--max-batch-requests", value)
    if not 1 <= batch <= MAX_BATCH_REQUESTS:
        raise ConfigError(
            f"--max-batch-requests: must be in [1, {MAX_BATCH_REQUESTS}] (got {shown(value)})"
        )
    return batch


def run(args: argparse.Namespace) -> int:
    args = check_flags(args)  # before the records are read
    # The bar counts the file's lines over its two passes (the records, then their outcomes),
    # then says "fitting" while the fit runs; it is cleared before anything is printed.
    try:
        with progress.bar(args, "calibrate", unit="line") as bar:
            if bar.shown:
                lines = _line_count(args.records)
                bar.set_total(None if lines is None else 2 * lines)
            records = read_records(args.records, bar)
            outcomes = read_outcomes(args.records, bar.iterate)
            bar.note("fitting", refresh=True)
            result = calibrate(
                records,
                outcomes,
                min_records=args.min_records,
                max_relative_stderr=args.max_relative_stderr,
                prefill_floor_ms=args.prefill_floor_ms,
                max_batch_requests=args.max_batch_requests,
            )
    except CalibrationError as exc:
        print(f"tokenfair calibrate: cannot calibrate: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(result))
    return 0


def format_table(result: Calibration) -> str:
    service = result.service
    skipped = ", ".join(f"{count} {reason}" for reason, count in result.skipped.items())
    lines = [
        f"records: {result.records_read} read, {service.records_used} used"
        + (f", skipped: {skipped}" if skipped else ""),
    ]
    batching = result.batching
    if batching is None:
        lines += [
            "model: execution_ms = (prefill + decodeWeight * decode) / serviceTokensPerMs, "
            "execution_ms = e2e_ms - queue wait",
            f"  decodeWeight        {service.decode_weight:10.4g}  "
            f"± {service.decode_weight_stderr:.2g} (standard error)",
            f"  serviceTokensPerMs  {service.service_tokens_per_ms:10.4g}  "
            f"± {service.service_tokens_per_ms_stderr:.2g}",
        ]
    else:
        lines += _batching_lines(batching)
    lines.append(
        f"  fit: R² {service.r_squared:.4f}, residual RMS {service.residual_rms_ms:.3g} ms "
        f"({service.residual_rms_relative:.1%} of the fitted time)"
    )
    if result.assumed_idle_records:
        lines.append(
            f"  note: {result.assumed_idle_records} used record(s) have no queue_wait_ms; their "
            "e2e_ms was taken as execution time (right for an idle-server probe only)"
        )
    prefill = result.prefill
    if prefill is not None:
        lines.append(
            f"  prefillTokensPerMs  {prefill.prefill_tokens_per_ms:10.4g}  "
            f"± {prefill.prefill_tokens_per_ms_stderr:.2g} from {prefill.records_used} TTFTs "
            f"above the {prefill.prefill_floor_ms:g} ms floor (R² {prefill.r_squared:.4f})"
        )
    else:
        lines.append(f"  prefillTokensPerMs not fitted: {result.prefill_note}")
    queue = result.prefill_queue
    if queue is not None:
        lines.append(
            f"  engine prefill      {queue.prefill_tokens_per_ms:10.4g}  prompt tokens/ms + "
            f"{queue.prefill_overhead_ms:.3g} ms a prompt, first come first served, from "
            f"{queue.records_used} TTFTs (RMS log error "
            f"{queue.rms_log_error:.2f}; for a replay of these records' engine, not a policy "
            "field)"
        )
    lines.extend(f"problem: {problem}" for problem in result.problems)
    lines.append("apply with:")
    lines.append("  " + " ".join(f"--set {item}" for item in result.overrides()))
    return "\n".join(lines) + "\n"


def _batching_lines(fit: BatchingFit) -> list[str]:
    """The batching engine's part of the table."""
    batch = fit.max_batch_requests
    source = "as given" if fit.max_batch_requests_given else "the most the records show at once"
    lines = [
        f"concurrency: {fit.runs_swept} runs swept; a used record ran with "
        f"{fit.concurrency_min:.2f} to {fit.concurrency_max:.2f} requests at once (itself "
        f"included), {fit.seen_concurrency:.2f} on average over their service; at most "
        f"{fit.peak_concurrency} at once",
        "model: run_ms = (prefill + decodeWeight * decode) * (A + b * (c - 1)), a batching "
        "engine; run_ms = e2e_ms - queue wait",
        f"  decodeWeight        {fit.decode_weight:10.4g}  ± {fit.decode_weight_stderr:.2g} "
        "(standard error)",
    ]
    if fit.request_service_tokens_per_ms is not None:
        lines.append(
            f"  one request alone   {fit.request_service_tokens_per_ms:10.4g}  "
            f"± {fit.request_service_tokens_per_ms_stderr or 0.0:.2g} service tokens/ms (1 / A)"
        )
    lines.append(f"  maxBatchRequests    {batch:10d}  ({source})")
    rate = fit.service_tokens_per_ms
    if rate is not None:
        lines.append(
            f"  serviceTokensPerMs  {rate:10.4g}  ± {fit.service_tokens_per_ms_stderr or 0.0:.2g}"
            f" (the throughput of {batch} at once)"
        )
    else:
        lines.append(
            f"  serviceTokensPerMs  not identified (the throughput at "
            f"{fit.seen_concurrency:.2f} requests at once is "
            f"{fit.throughput_at_seen_concurrency:.4g})"
        )
    gain = fit.batch_throughput_gain
    if gain is not None:
        bound = {"constant": " (its bound S)", "shared": " (its bound 1)"}.get(fit.mode, "")
        lines.append(
            f"  batchThroughputGain {gain:10.4g}  ± {fit.batch_throughput_gain_stderr or 0.0:.2g}"
            + bound
        )
    else:
        lines.append("  batchThroughputGain not identified")
    return lines
