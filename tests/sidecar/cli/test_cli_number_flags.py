"""The number flags of ``calibrate``, ``trace generate`` and ``loadgen`` follow the config rules.

Behaviours under test:

* each number flag is read by ``fields.flag_number`` and checked by the ``fields`` parser of its
  rule: an integer flag takes an integral float (``--requests 2.0`` is 2, ``--seed 1e3`` 1000,
  an ``int``), a number flag an integer text (a ``float``);
* a bad value (not a number, a fraction for an integer, out of its range, not finite) exits 2
  with one line ``tokenfair <command>: error: <flag>: <rule> (got <value>)`` on stderr and
  nothing on stdout, before any input is read (the input files named here do not exist);
* spelling an integer as a float changes nothing: ``trace generate`` writes the same trace and
  ``calibrate`` prints the same fit, and ``loadgen``'s settings hold the same integer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenfair import cli
from tokenfair.cli import build_parser
from tokenfair.commands import calibrate, loadgen, trace
from tokenfair.core import Request

MISSING = "/nonexistent/input.jsonl"
CALIBRATE = ["calibrate", "--records", MISSING]
TRACE = ["trace", "generate", "--tenants", "/nonexistent/tenants.yaml"]
LOADGEN = ["loadgen", "--target", "http://127.0.0.1:1", "--trace", MISSING]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The real command line in-process (an argparse exit becomes the exit code)."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([*CALIBRATE, "--min-records", "abc"], "--min-records: must be an integer (got 'abc')"),
        ([*CALIBRATE, "--min-records", "3.5"], "--min-records: must be an integer (got 3.5)"),
        ([*CALIBRATE, "--min-records", "2.0"], "--min-records: must be >= 3 (got 2.0)"),
        ([*CALIBRATE, "--min-records", "1"], "--min-records: must be >= 3 (got 1)"),
        ([*CALIBRATE, "--max-relative-stderr", "x"],
         "--max-relative-stderr: must be a number (got 'x')"),
        ([*CALIBRATE, "--max-relative-stderr", "0"], "--max-relative-stderr: must be > 0 (got 0)"),
        ([*CALIBRATE, "--max-relative-stderr", "nan"],
         "--max-relative-stderr: must be finite (got nan)"),
        ([*CALIBRATE, "--prefill-floor-ms", "soon"],
         "--prefill-floor-ms: must be a number (got 'soon')"),
        ([*CALIBRATE, "--prefill-floor-ms", "-1"], "--prefill-floor-ms: must be >= 0 (got -1)"),
        ([*CALIBRATE, "--prefill-floor-ms", "inf"], "--prefill-floor-ms: must be finite (got inf)"),
        ([*TRACE, "--duration-ms", "long"], "--duration-ms: must be a number (got 'long')"),
        ([*TRACE, "--duration-ms", "0"], "--duration-ms: must be > 0 (got 0)"),
        ([*TRACE, "--requests", "many"], "--requests: must be an integer (got 'many')"),
        ([*TRACE, "--requests", "2.5"], "--requests: must be an integer (got 2.5)"),
        ([*TRACE, "--requests", "0.0"], "--requests: must be > 0 (got 0.0)"),
        ([*TRACE, "--seed", "x"], "--seed: must be an integer (got 'x')"),
        ([*TRACE, "--seed", "1.5"], "--seed: must be an integer (got 1.5)"),
        ([*TRACE, "--seed", "1e20"], "--seed: must be at most 9007199254740992 in magnitude"
         " (got 1e+20)"),
        ([*TRACE, "--observe", "--noise", "lots"], "--noise: must be a number (got 'lots')"),
        ([*TRACE, "--observe", "--noise", "1"], "--noise: must be in [0, 1) (got 1)"),
        ([*TRACE, "--observe", "--noise", "-0.1"], "--noise: must be in [0, 1) (got -0.1)"),
        ([*TRACE, "--noise", "0.1"], "--noise: only applies with --observe"),
        ([*LOADGEN, "--concurrency-limit", "many"],
         "--concurrency-limit: must be an integer (got 'many')"),
        ([*LOADGEN, "--concurrency-limit", "2.5"],
         "--concurrency-limit: must be an integer (got 2.5)"),
        ([*LOADGEN, "--concurrency-limit", "0"], "--concurrency-limit: must be > 0 (got 0)"),
        ([*LOADGEN, "--time-scale", "fast"], "--time-scale: must be a number (got 'fast')"),
        ([*LOADGEN, "--timeout", "never"], "--timeout: must be a number (got 'never')"),
        ([*LOADGEN, "--timeout", "inf"], "--timeout: must be finite (got inf)"),
        ([*LOADGEN, "--request-timeout", "x"], "--request-timeout: must be a number (got 'x')"),
        ([*LOADGEN, "--decode-weight", "x"], "--decode-weight: must be a number (got 'x')"),
        ([*LOADGEN, "--kv-sample-ms", "x"], "--kv-sample-ms: must be a number (got 'x')"),
        ([*LOADGEN, "--kv-sample-ms", "-5"], "--kv-sample-ms: must be > 0 (got -5)"),
    ],
)  # fmt: skip
def test_a_bad_value_exits_2_naming_the_flag_before_any_input_is_read(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(argv, capsys)
    assert (code, out) == (2, "")
    assert err == f"tokenfair {argv[0]}: error: {error}\n"


def _checked(argv: list[str]) -> argparse.Namespace:
    """``argv`` through the real parser, then its command's ``check_flags``."""
    args = build_parser((argv[0],)).parse_args(argv)
    module = {"calibrate": calibrate, "trace": trace, "loadgen": loadgen}[argv[0]]
    checked: argparse.Namespace = module.check_flags(args)
    return checked


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        ([*CALIBRATE, "--min-records", "5.0"], "min_records", 5),
        ([*CALIBRATE, "--min-records", "1e2"], "min_records", 100),
        ([*CALIBRATE, "--max-relative-stderr", "1"], "max_relative_stderr", 1.0),
        ([*CALIBRATE, "--prefill-floor-ms", "0"], "prefill_floor_ms", 0.0),
        ([*TRACE, "--requests", "2.0"], "requests", 2),
        ([*TRACE, "--seed", "7.0"], "seed", 7),
        ([*TRACE, "--seed", "-3"], "seed", -3),
        ([*TRACE, "--duration-ms", "60000"], "duration_ms", 60000.0),
        ([*TRACE, "--observe", "--noise", "0"], "noise", 0.0),
        ([*LOADGEN, "--concurrency-limit", "8.0"], "concurrency_limit", 8),
        ([*LOADGEN, "--time-scale", "1"], "time_scale", 1.0),
        ([*LOADGEN, "--timeout", "60"], "timeout", 60.0),
        ([*LOADGEN, "--request-timeout", "5"], "request_timeout", 5.0),
        ([*LOADGEN, "--decode-weight", "4"], "decode_weight", 4.0),
        ([*LOADGEN, "--kv-sample-ms", "20"], "kv_sample_ms", 20.0),
    ],
)
def test_an_integer_flag_takes_an_integral_float_and_a_number_flag_an_integer(
    argv: list[str], dest: str, value: float
) -> None:
    parsed = getattr(_checked(argv), dest)
    assert parsed == value
    assert type(parsed) is type(value)


def test_loadgen_settings_hold_the_integer_of_an_integral_float() -> None:
    args = build_parser(("loadgen",)).parse_args([*LOADGEN, "--concurrency-limit", "8.0"])
    settings = loadgen.settings_from(args, [Request("r", "t", 1000.0, 1, 1, "interactive")], 4.0)
    assert settings.concurrency_limit == 8
    assert type(settings.concurrency_limit) is int


def test_integers_spelled_as_floats_change_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generate = ["trace", "generate", "--observe", "--noise", "0.05", "--set", "decodeWeight=3"]
    as_ints = run_cli([*generate, "--requests", "400", "--seed", "2"], capsys)
    as_floats = run_cli([*generate, "--requests", "4e2", "--seed", "2.0"], capsys)
    assert as_ints[0] == as_floats[0] == 0
    assert as_floats[1] == as_ints[1]
    assert len(as_ints[1].splitlines()) == 400
    records = tmp_path / "observed.jsonl"
    records.write_text(as_ints[1], encoding="utf-8")
    fit = ["calibrate", "--records", str(records), "--format", "json"]
    fit_ints = run_cli([*fit, "--min-records", "3", "--prefill-floor-ms", "8"], capsys)
    fit_floats = run_cli([*fit, "--min-records", "3.0", "--prefill-floor-ms", "8.0"], capsys)
    assert fit_ints[0] == fit_floats[0] == 0
    assert fit_floats[1] == fit_ints[1]
