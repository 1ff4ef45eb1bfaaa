"""``tokenfair trace generate`` and the workload generator behind it.

Behaviours under test:

* the same flags and ``--seed`` give byte-identical output, another seed another trace, and a
  tenant's requests do not change when another tenant is added or ``--observe`` is switched on;
* every request belongs to a tenant of ``--tenants`` and carries that tenant's priority class;
  lengths follow the tenant's mix (clamped to its range, median near the mix's median);
* Poisson and bursty tenants both send ``--rate`` on average, bursty ones in bursts (count
  dispersion well above Poisson's 1); windows and a rate of 0 switch tenants on and off;
  ``--requests`` bounds the count; arrivals are in order and ids unique, for any seed, rate,
  process, mix and window too (hypothesis), with every length in its mix's range;
* ``--observe`` adds the cost model's idle-server times: exact without noise, mean 1 and the
  stated spread with it;
* the output passes ``read_trace`` and replays through ``tokenfair simulate --trace --tenants``
  (the real console script);
* bad flags exit 2 with a message that names the flag, and print nothing on stdout.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair_sidecar import cli
from tokenfair_sidecar.records import TraceRecord, read_trace
from tokenfair_sidecar.tracegen import MIXES, ArrivalProcess, TenantWorkload, WorkloadSpec, generate

TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")

TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: chat}
spec: {weight: 2, burstServiceTokens: 48000, sustainedServiceTokensPerSecond: 180000,
       priorityClass: interactive}
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: ide}
spec: {weight: 1.5, burstServiceTokens: 36000, sustainedServiceTokensPerSecond: 140000,
       priorityClass: interactive}
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: docs}
spec: {weight: 1, burstServiceTokens: 28000, sustainedServiceTokensPerSecond: 60000,
       priorityClass: batch}
"""
CLASSES = {"chat": "interactive", "ide": "interactive", "docs": "batch"}


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML, encoding="utf-8")
    return path


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The real command line in-process (argparse exits become the exit code)."""
    try:
        code = cli.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate_lines(
    capsys: pytest.CaptureFixture[str], tenants_file: Path, *flags: str
) -> list[dict[str, object]]:
    code, out, err = run_cli(["trace", "generate", "--tenants", str(tenants_file), *flags], capsys)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_same_seed_same_bytes_other_seed_other_trace(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["trace", "generate", "--tenants", str(tenants_file), "--duration-ms", "5000"]
    first = run_cli([*flags, "--seed", "11"], capsys)
    again = run_cli([*flags, "--seed", "11"], capsys)
    other = run_cli([*flags, "--seed", "12"], capsys)
    assert first[0] == again[0] == other[0] == 0
    assert first[1] == again[1]
    assert first[1] != other[1]


def test_a_tenant_stream_ignores_other_tenants_and_observe(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = generate_lines(capsys, tenants_file, "--duration-ms", "8000", "--seed", "3")
    alone = generate_lines(
        capsys, tenants_file, "--duration-ms", "8000", "--seed", "3", "--rate", "chat=0",
        "--rate", "ide=0", "--observe",
    )  # fmt: skip
    docs_both = [r for r in both if r["tenant_id"] == "docs"]
    assert {r["tenant_id"] for r in alone} == {"docs"}
    assert len(docs_both) > 10
    request_fields = ("request_id", "arrival_ms", "prefill_tokens", "decode_tokens")
    assert [[r[k] for k in request_fields] for r in alone] == [
        [r[k] for k in request_fields] for r in docs_both
    ]


def test_tenants_classes_and_mixes_are_respected(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = generate_lines(
        capsys, tenants_file, "--duration-ms", "200000", "--mix", "summarize",
        "--mix", "ide=completion", "--rate", "docs=2",
    )  # fmt: skip
    by_tenant: dict[str, list[dict[str, object]]] = {}
    for line in lines:
        by_tenant.setdefault(str(line["tenant_id"]), []).append(line)
    assert set(by_tenant) == set(CLASSES)
    # A later TENANT= entry overrides the bare one: ide -> completion, the others -> summarize.
    expected_mix = {"chat": "summarize", "ide": "completion", "docs": "summarize"}
    for tenant_id, rows in by_tenant.items():
        assert {r["priority_class"] for r in rows} == {CLASSES[tenant_id]}
        mix = MIXES[expected_mix[tenant_id]]
        for dist, key in ((mix.prompt, "prefill_tokens"), (mix.output, "decode_tokens")):
            lengths = [int(str(r[key])) for r in rows]
            assert dist.min_tokens <= min(lengths)
            assert max(lengths) <= dist.max_tokens
            # The median of a log-normal is its median parameter; with n >= 400 samples the
            # sample median's log has sd ~ 1.25 * sigma / sqrt(n) <= 1.25 * 0.5 / 20 = 3 %,
            # so 10 % is more than 3 standard errors (clamping moves only the tails).
            assert statistics.median(lengths) == pytest.approx(dist.median_tokens, rel=0.10)


def _spec(arrivals: ArrivalProcess, duration_ms: float) -> WorkloadSpec:
    """One tenant sending the chat mix at 5 requests/s."""
    workload = TenantWorkload("t", "interactive", MIXES["chat"], 5.0, arrivals=arrivals)
    return WorkloadSpec((workload,), seed=5, duration_ms=duration_ms)


def _dispersion(arrivals_ms: list[float], duration_ms: float) -> float:
    """Variance / mean of the counts in 1 s bins (1 for a Poisson process)."""
    counts = Counter(int(t // 1000) for t in arrivals_ms)
    bins = [counts.get(i, 0) for i in range(int(duration_ms // 1000))]
    return statistics.pvariance(bins) / statistics.fmean(bins)


def test_poisson_and_bursty_keep_the_mean_rate_bursty_in_bursts() -> None:
    duration_ms = 2_000_000.0
    poisson = [r.arrival_ms for r in generate(_spec("poisson", duration_ms))]
    bursty = [r.arrival_ms for r in generate(_spec("bursty", duration_ms))]
    expected = 5.0 * duration_ms / 1000  # 5 requests/s for 2000 s = 10 000
    # Poisson: sd sqrt(10 000) = 100, so 3 % is 3 sd. Bursty (on 1 s, off 4 s on average, 25/s
    # while on): ~400 cycles of count variance ~ 5 + 25^2 * 1 = 630, sd ~ sqrt(400 * 630) ~ 500,
    # so 15 % is 3 sd.
    assert len(poisson) == pytest.approx(expected, rel=0.03)
    assert len(bursty) == pytest.approx(expected, rel=0.15)
    assert _dispersion(poisson, duration_ms) == pytest.approx(1.0, abs=0.15)
    # While on, 1 s bins see 25/s; while off none: dispersion ~ 1 + 25 * (1 - 0.2) = 21 for
    # bins short against the periods, less for 1 s bins; anything above 4 is not Poisson.
    assert _dispersion(bursty, duration_ms) > 4


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    rate=st.floats(0.5, 50.0),
    arrivals=st.sampled_from(["poisson", "bursty"]),
    mix=st.sampled_from(sorted(MIXES)),
    start_ms=st.floats(0.0, 3000.0),
    length_ms=st.floats(1.0, 3000.0),
)
def test_any_workload_is_ordered_unique_in_window_and_in_range(
    seed: int, rate: float, arrivals: ArrivalProcess, mix: str, start_ms: float, length_ms: float
) -> None:
    windowed = TenantWorkload(
        "w", "batch", MIXES[mix], rate, arrivals, start_ms=start_ms, end_ms=start_ms + length_ms
    )
    steady = TenantWorkload("s", "interactive", MIXES["chat"], 20.0)  # never empty: ~80 requests
    requests = generate(WorkloadSpec((windowed, steady), seed=seed, duration_ms=4000.0))
    keys = [(r.arrival_ms, r.request_id) for r in requests]
    assert keys == sorted(keys)
    assert len({r.request_id for r in requests}) == len(requests)
    for r in requests:
        # Arrivals are truncated to 1 us: never past an end, at most 1 us before a start.
        assert 0 <= r.arrival_ms < 4000.0
        if r.tenant_id == "w":
            assert start_ms - 0.001 <= r.arrival_ms < start_ms + length_ms
            assert r.priority_class == "batch"
            dist_p, dist_d = MIXES[mix].prompt, MIXES[mix].output
            assert dist_p.min_tokens <= r.prefill_tokens <= dist_p.max_tokens
            assert dist_d.min_tokens <= r.decode_tokens <= dist_d.max_tokens


def test_windows_zero_rates_and_request_bounds(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = generate_lines(
        capsys, tenants_file, "--duration-ms", "20000", "--window", "docs=5000:12000",
        "--window", "chat=:3000", "--rate", "ide=0",
    )  # fmt: skip
    arrivals: dict[str, list[float]] = {}
    for line in lines:
        arrivals.setdefault(str(line["tenant_id"]), []).append(float(str(line["arrival_ms"])))
    assert "ide" not in arrivals
    assert 5000 <= min(arrivals["docs"]) <= max(arrivals["docs"]) < 12000
    assert 0 <= min(arrivals["chat"]) <= max(arrivals["chat"]) < 3000
    # 5/s over 7 s and 3 s: 35 and 15 expected; Poisson sd ~6 and ~4.
    assert 15 <= len(arrivals["docs"]) <= 55
    assert 3 <= len(arrivals["chat"]) <= 30

    bounded = generate_lines(capsys, tenants_file, "--requests", "250", "--arrivals", "bursty")
    assert len(bounded) == 250
    keys = [(float(str(r["arrival_ms"])), str(r["request_id"])) for r in bounded]
    assert keys == sorted(keys)
    assert len({r["request_id"] for r in bounded}) == 250


def test_observe_without_noise_is_the_cost_model(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = generate_lines(
        capsys, tenants_file, "--duration-ms", "4000", "--observe", "--noise", "0",
        "--set", "decodeWeight=2.5", "--set", "serviceTokensPerMs=20",
    )  # fmt: skip
    assert lines
    for r in lines:
        p, d = int(str(r["prefill_tokens"])), int(str(r["decode_tokens"]))
        assert (r["actual_prefill_tokens"], r["actual_decode_tokens"]) == (p, d)
        # execution = (p + ceil(2.5 d)) / 20 ms; prefill = max(8 ms, p / 48) (defaults kept);
        # both rounded to 3 decimals, so within 0.0005 ms (plus float slack).
        e2e = (p + math.ceil(2.5 * d)) / 20
        assert r["e2e_ms"] == pytest.approx(e2e, abs=0.0006)
        assert r["ttft_ms"] == pytest.approx(min(max(8.0, p / 48), e2e), abs=0.0006)


def test_observe_noise_has_mean_one_and_the_stated_spread(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = generate_lines(
        capsys, tenants_file, "--duration-ms", "200000", "--observe", "--noise", "0.05"
    )
    ratios = [
        float(str(r["e2e_ms"]))
        / ((int(str(r["prefill_tokens"])) + 4 * int(str(r["decode_tokens"]))) / 45)
        for r in lines
    ]
    # ~3000 ratios: the mean's standard error is 0.05 / sqrt(3000) ~ 0.1 %, so 0.5 % is 5 of
    # them; the sample sd of 3000 draws is within ~1.3 % of 0.05, so 10 % is generous.
    assert len(ratios) > 2500
    assert statistics.fmean(ratios) == pytest.approx(1.0, abs=0.005)
    assert statistics.stdev(ratios) == pytest.approx(0.05, rel=0.10)


def test_output_reads_back_and_replays_through_simulate(tmp_path: Path, tenants_file: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    subprocess.run(
        [TOKENFAIR, "trace", "generate", "--tenants", str(tenants_file), "--duration-ms",
         "10000", "--arrivals", "docs=bursty", "--mix", "ide=completion", "--seed", "9",
         "--observe", "--out", str(trace)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    records = read_trace(trace, known_tenants=CLASSES)
    assert all(isinstance(r, TraceRecord) and r.e2e_ms is not None for r in records)
    result = subprocess.run(
        [TOKENFAIR, "simulate", "--trace", str(trace), "--tenants", str(tenants_file),
         "--format", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads(result.stdout)
    for summary in report["comparison"].values():
        assert summary["total_requests"] == len(records)
        assert set(summary["tenants"]) == set(CLASSES)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rate", "nobody=3"], "--rate nobody=3: unknown tenant"),
        (["--rate", "-1"], "--rate -1: must be >= 0"),
        (["--rate", "fast"], "--rate fast: not a number"),
        (["--rate", "0"], "--rate: every tenant's rate is 0"),
        (["--window", "70000:80000"], "--window: no tenant sends within the trace"),
        (["--mix", "poetry"], "--mix poetry: unknown mix"),
        (["--arrivals", "chat=fractal"], "--arrivals chat=fractal: unknown arrival process"),
        (["--window", "docs=9000:3000"], "--window docs=9000:3000: needs 0 <= START_MS"),
        (["--window", "docs=soon"], "--window docs=soon: expected START_MS:END_MS"),
        (["--duration-ms", "0"], "--duration-ms: must be > 0"),
        (["--requests", "0"], "--requests: must be > 0"),
        (["--burst-off-ms", "-5"], "--burst-off-ms: must be > 0"),
        (["--noise", "0.1"], "--noise: only applies with --observe"),
        (["--observe", "--noise", "1.5"], "--noise: must be in [0, 1)"),
        (["--observe", "--set", "decodeWeight=0"], "decodeWeight: must be > 0"),
        (["--seed", "x"], "--seed: invalid int value"),
        (["--out", "/nonexistent-dir/trace.jsonl"], "--out /nonexistent-dir/trace.jsonl: cannot"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    flags: list[str], named: str, tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["trace", "generate", "--tenants", str(tenants_file), *flags], capsys)
    assert code == 2
    assert out == ""
    assert named in err


def test_bad_flag_exits_2_from_the_console_script(tmp_path: Path) -> None:
    result = subprocess.run(
        [TOKENFAIR, "trace", "generate", "--mix", "tenant_batch_rag=poetry"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    assert "--mix tenant_batch_rag=poetry: unknown mix" in result.stderr
