"""``tokenfair calibrate``: fit decodeWeight and serviceTokensPerMs to observed request times.

Exit codes: 0 a fit was printed; 1 the records cannot support a fit (too few usable records,
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
from tokenfair.config.fields import (
    ConfigError,
    flag_number,
    integer,
    non_negative,
    positive,
    shown,
)
from tokenfair.config.files import InputFileError, open_regular
from tokenfair.sim.calibrate import (
    DEFAULT_MAX_RELATIVE_STDERR,
    DEFAULT_MIN_RECORDS,
    DEFAULT_PREFILL_FLOOR_MS,
    Calibration,
    CalibrationError,
    calibrate,
    read_outcomes,
)
from tokenfair.sim.records import TraceError, TraceRecord, iter_trace_lines


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="fit decodeWeight and serviceTokensPerMs to observed request times",
        description=(
            "Fit the cost model execution_ms = (prefill + decodeWeight * decode) / "
            "serviceTokensPerMs to request records carrying e2e_ms (and ttft_ms) with actual "
            "token counts, by least squares on the relative error; execution_ms = e2e_ms - "
            "queue_wait_ms - observed.send_lag_ms (0 when a record has none). Prints the fit "
            "quality and the --set flags that apply it. Exit 1 when the records cannot support "
            "a fit. See docs/calibration.md."
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
        }
    )


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
        "model: execution_ms = (prefill + decodeWeight * decode) / serviceTokensPerMs, "
        "execution_ms = e2e_ms - queue wait",
        f"  decodeWeight        {service.decode_weight:10.4g}  "
        f"± {service.decode_weight_stderr:.2g} (standard error)",
        f"  serviceTokensPerMs  {service.service_tokens_per_ms:10.4g}  "
        f"± {service.service_tokens_per_ms_stderr:.2g}",
        f"  fit: R² {service.r_squared:.4f}, residual RMS {service.residual_rms_ms:.3g} ms "
        f"({service.residual_rms_relative:.1%} of the fitted time)",
    ]
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
    lines.append("apply with:")
    lines.append("  " + " ".join(f"--set {item}" for item in result.overrides()))
    return "\n".join(lines) + "\n"
