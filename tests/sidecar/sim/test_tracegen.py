"""``tokenfair trace generate`` and the workload generator behind it.

Behaviours under test:

* the same flags and ``--seed`` give byte-identical output, another seed another trace, and a
  tenant's requests do not change when another tenant is added or ``--observe`` is switched on;
* every request belongs to a tenant of ``--tenants`` and carries that tenant's priority class;
  lengths follow the tenant's mix (clamped to its range, median near the mix's median);
* Poisson and bursty tenants both send ``--rate`` on average, bursty ones in bursts (count
  dispersion well above Poisson's 1); windows and a rate of 0 switch tenants on and off;
  ``--requests`` bounds the count; arrivals are in order and ids unique, for any seed, rate,
  process, mix, window and on/off periods too (hypothesis), with every length in its mix's range;
* constant tenants arrive exactly every ``1000 / rate`` ms from a per-tenant phase (exact counts,
  no drift); periodic tenants send only in their on periods, every one of them, at ``--rate`` on
  average over whole cycles; a tenant's requests under the new processes ignore other tenants too;
* ``--prompt-tokens``/``--output-tokens`` fix one side exactly, per tenant, and change nothing
  else in the trace;
* ``--observe`` adds the cost model's idle-server times: exact without noise, mean 1 and the
  stated spread with it;
* the output passes ``read_trace`` and replays through ``tokenfair simulate --trace --tenants``
  (the real console script);
* bad flags exit 2 with a message that names the flag, and print nothing on stdout.
"""

from __future__ import annotations

import dataclasses
import itertools
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

from tokenfair import cli
from tokenfair.core import Request
from tokenfair.records.codec import TraceRecord, read_trace
from tokenfair.sim.tracegen import (
    ARRIVAL_PROCESSES,
    MIXES,
    ArrivalProcess,
    LengthDist,
    TenantWorkload,
    WorkloadError,
    WorkloadSpec,
    generate,
)

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


def _us(requests: list[Request]) -> list[int]:
    """Arrival times in whole microseconds (they are truncated to 1 us, so this is exact)."""
    return [round(r.arrival_ms * 1000) for r in requests]


def test_constant_gaps_are_exact_from_a_per_tenant_phase() -> None:
    # 8/s: g = 1000 / 8 = 125 ms, exact in binary. Arrivals at phase + 125 k with phase in
    # [0, 125): k < (60 000 - phase) / 125 = 480 - phase / 125, so k = 0 .. 479: 480 arrivals.
    # Truncation to 1 us: floor(1000 phase + 125 000 k) = floor(1000 phase) + 125 000 k, so in
    # whole microseconds every gap is exactly 125 000.
    eight = TenantWorkload("eight", "interactive", MIXES["chat"], 8.0, "constant")
    # 337.5/s (3 x the lesson's 112.5/s capacity at 400 service tokens a request):
    # g = 1000 / 337.5 = 80/27 ms ~ 2.963 ms; 60 000 / g = 60 000 * 27 / 80 = 20 250 exactly,
    # so 20 250 arrivals by the same argument. The k-th is phase + k * 80/27 (a product, not a
    # sum of k rounded gaps), so after truncation it is within 1 us of first + k * 80/27 for
    # every k: no drift over 20 250 gaps.
    flood = TenantWorkload("flood", "interactive", MIXES["chat"], 337.5, "constant")
    # 4/s in the window [5000, 20 000): g = 250 ms, 15 000 / 250 = 60 arrivals from 5000 + phase.
    late = TenantWorkload("late", "batch", MIXES["rag"], 4.0, "constant", 5000.0, 20_000.0)
    requests = generate(WorkloadSpec((eight, flood, late), seed=21, duration_ms=60_000.0))
    by_tenant = {t: [r for r in requests if r.tenant_id == t] for t in ("eight", "flood", "late")}

    eight_us = _us(by_tenant["eight"])
    assert len(eight_us) == 480
    assert 0 <= eight_us[0] < 125_000
    assert {b - a for a, b in itertools.pairwise(eight_us)} == {125_000}

    flood_us = _us(by_tenant["flood"])
    assert len(flood_us) == 20_250
    assert 0 <= flood_us[0] < 2963
    # 80/27 ms = 2962.96 us: a truncated gap reads 2962 or 2963 us, never more or less.
    assert {b - a for a, b in itertools.pairwise(flood_us)} == {2962, 2963}
    assert all(abs(us - flood_us[0] - k * 80_000 / 27) <= 1 for k, us in enumerate(flood_us))

    late_us = _us(by_tenant["late"])
    assert len(late_us) == 60
    assert 5_000_000 <= late_us[0] < 5_250_000
    assert {b - a for a, b in itertools.pairwise(late_us)} == {250_000}

    # Same rate, different streams: the phases differ, so the two are not in lock step.
    twin = TenantWorkload("twin", "interactive", MIXES["chat"], 8.0, "constant")
    twins = generate(WorkloadSpec((eight, twin), seed=21, duration_ms=1000.0))
    firsts = {r.tenant_id: r.arrival_ms for r in reversed(twins)}
    assert firsts["eight"] != firsts["twin"]


def test_periodic_sends_only_while_on_and_keeps_the_mean_rate() -> None:
    # 5/s, on exactly 1000 ms then off 4000 ms from 0: 25/s while on (5 * 5000 / 1000). Over
    # 2 000 000 ms = 400 whole cycles the count is Poisson with mean 400 s on * 25/s = 10 000
    # (= 5/s * 2000 s), sd 100: 3 % is 3 sd.
    duration_ms = 2_000_000.0
    spec = WorkloadSpec(
        (TenantWorkload("p", "batch", MIXES["rag"], 5.0, "periodic", burst_on_ms=1000.0),),
        seed=5,
        duration_ms=duration_ms,
    )
    arrivals_ms = [r.arrival_ms for r in generate(spec)]
    assert len(arrivals_ms) == pytest.approx(10_000, rel=0.03)
    # On periods start at whole ms and truncation only moves a time down, never below them.
    assert all(t % 5000 < 1000 for t in arrivals_ms)
    # Each on period expects 25 arrivals; P(none) = e^-25 ~ 1e-11, so every one of the 400
    # cycles has some: the source really switches on every time, deterministically.
    assert {int(t // 5000) for t in arrivals_ms} == set(range(400))

    # It starts on at its window start (2500), on 500 ms and off 1500 ms: on in
    # [2500 + 2000 k, 3000 + 2000 k); 4/s -> 16/s while on, ~8 per on period, 15 periods.
    windowed = TenantWorkload(
        "w", "batch", MIXES["rag"], 4.0, "periodic", 2500.0, 32_500.0, 500.0, 1500.0
    )
    times = [r.arrival_ms for r in generate(WorkloadSpec((windowed,), duration_ms=60_000.0))]
    assert times
    assert all(2500 <= t < 32_500 and (t - 2500) % 2000 < 500 for t in times)
    assert {int((t - 2500) // 2000) for t in times} == set(range(15))


def test_new_processes_keep_each_tenant_stream_independent() -> None:
    tenants = (
        TenantWorkload("c", "interactive", MIXES["chat"], 30.0, "constant"),
        TenantWorkload("p", "batch", MIXES["rag"], 10.0, "periodic", burst_on_ms=300.0,
                       burst_off_ms=700.0),
        TenantWorkload("f", "interactive", MIXES["completion"].with_fixed(200, 50), 20.0),
        TenantWorkload("b", "batch", MIXES["summarize"], 10.0, "bursty"),
    )  # fmt: skip

    def fields(requests: list[Request], tenant_id: str) -> list[tuple[object, ...]]:
        return [
            (r.request_id, r.arrival_ms, r.prefill_tokens, r.decode_tokens)
            for r in requests
            if r.tenant_id == tenant_id
        ]

    duration_ms = 20_000.0
    together = generate(WorkloadSpec(tenants, seed=8, duration_ms=duration_ms))
    for index, tenant in enumerate(tenants):
        alone = generate(WorkloadSpec((tenant,), seed=8, duration_ms=duration_ms))
        assert len(alone) > 20
        assert fields(together, tenant.tenant_id) == fields(alone, tenant.tenant_id)
        # Re-rating and re-timing every other tenant (and reordering them) changes nothing here.
        others = tuple(
            dataclasses.replace(t, rate_per_second=t.rate_per_second * 2, burst_on_ms=50.0)
            for t in tenants
            if t is not tenant
        )
        rerated = generate(WorkloadSpec((*others[::-1], tenant), seed=8, duration_ms=duration_ms))
        assert fields(rerated, tenant.tenant_id) == fields(alone, tenant.tenant_id), index


def test_fixed_sizes_are_exact_and_change_nothing_else(
    tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--duration-ms", "20000", "--arrivals", "docs=periodic", "--seed", "4")
    fixed = generate_lines(
        capsys, tenants_file, *flags, "--prompt-tokens", "200", "--output-tokens", "50",
        "--prompt-tokens", "docs=12000", "--output-tokens", "docs=200",
    )  # fmt: skip
    sizes = {(r["tenant_id"], r["prefill_tokens"], r["decode_tokens"]) for r in fixed}
    assert sizes == {("chat", 200, 50), ("ide", 200, 50), ("docs", 12000, 200)}

    # One side fixed for one tenant: that side is exactly N; everything else (arrivals, the
    # other side, the other tenants) is the unfixed trace's, because a fixed length draws its
    # unused variate like the distribution it replaces.
    plain = generate_lines(capsys, tenants_file, *flags)
    one_side = generate_lines(capsys, tenants_file, *flags, "--output-tokens", "ide=0")
    assert len(one_side) == len(plain) > 100
    for before, after in zip(plain, one_side, strict=True):
        if after["tenant_id"] == "ide":
            assert after["decode_tokens"] == 0
            after = {**after, "decode_tokens": before["decode_tokens"]}
        assert after == before
    assert len({r["prefill_tokens"] for r in one_side if r["tenant_id"] == "ide"}) > 10

    assert LengthDist.fixed(0) == LengthDist(0, 0.0, 0, 0)
    with pytest.raises(WorkloadError, match="must be >= 0 tokens"):
        LengthDist.fixed(-1)


def test_new_flags_round_trip_through_a_file(
    tmp_path: Path, tenants_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fairness.jsonl"
    code, stdout, err = run_cli(
        ["trace", "generate", "--tenants", str(tenants_file), "--duration-ms", "12000",
         "--arrivals", "chat=constant", "--rate", "chat=20", "--prompt-tokens", "chat=200",
         "--output-tokens", "chat=50", "--arrivals", "docs=periodic", "--rate", "docs=2",
         "--burst-on-ms", "docs=500", "--burst-off-ms", "docs=1500", "--seed", "6",
         "--out", str(out)],
        capsys,
    )  # fmt: skip
    assert (code, stdout, err) == (0, "", "")
    records = read_trace(out, known_tenants=CLASSES)
    by_tenant: dict[str, list[Request]] = {}
    for record in records:
        by_tenant.setdefault(record.request.tenant_id, []).append(record.request)
    # chat: 20/s constant, g = 50 ms, 12 000 / 50 = 240 arrivals exactly, all 200 + 50 tokens.
    chat_us = _us(by_tenant["chat"])
    assert len(chat_us) == 240
    assert {b - a for a, b in itertools.pairwise(chat_us)} == {50_000}
    assert {(r.prefill_tokens, r.decode_tokens) for r in by_tenant["chat"]} == {(200, 50)}
    # docs: on [2000 k, 2000 k + 500), 2/s -> 8/s while on; 6 cycles of ~4 each.
    assert by_tenant["docs"]
    assert all(r.arrival_ms % 2000 < 500 for r in by_tenant["docs"])
    assert {int(r.arrival_ms // 2000) for r in by_tenant["docs"]} <= set(range(6))
    # ide keeps the defaults (Poisson, the chat mix's varying lengths) and its class.
    assert len({r.prefill_tokens for r in by_tenant["ide"]}) > 10
    assert {r.priority_class for r in by_tenant["ide"]} == {"interactive"}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    rate=st.floats(0.5, 50.0),
    arrivals=st.sampled_from(ARRIVAL_PROCESSES),
    mix=st.sampled_from(sorted(MIXES)),
    start_ms=st.floats(0.0, 3000.0),
    length_ms=st.floats(1.0, 3000.0),
    on_ms=st.floats(1.0, 3000.0),
    off_ms=st.floats(1.0, 3000.0),
)
def test_any_workload_is_ordered_unique_in_window_and_in_range(
    seed: int,
    rate: float,
    arrivals: ArrivalProcess,
    mix: str,
    start_ms: float,
    length_ms: float,
    on_ms: float,
    off_ms: float,
) -> None:
    windowed = TenantWorkload(
        "w", "batch", MIXES[mix], rate, arrivals, start_ms, start_ms + length_ms, on_ms, off_ms
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
            if arrivals == "periodic":
                # Inside an on period, or (truncation) at most 1 us before one starts.
                position_ms = (r.arrival_ms - start_ms) % (on_ms + off_ms)
                assert position_ms < on_ms or position_ms > on_ms + off_ms - 0.0011
    if arrivals == "constant":
        # Each time is truncated by less than 1 us, so a gap is within 1 us of 1000 / rate.
        times = [r.arrival_ms for r in requests if r.tenant_id == "w"]
        assert all(abs(b - a - 1000 / rate) < 0.0011 for a, b in itertools.pairwise(times))


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


def test_a_time_past_the_largest_a_record_may_carry_is_refused_before_writing(
    tenants_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trace.jsonl"
    flags = ["trace", "generate", "--tenants", str(tenants_file), "--requests", "3"]
    code, _, err = run_cli([*flags, "--window", "2e15:", "--out", str(out)], capsys)
    assert code == 2
    assert "past 1e+15 ms, the largest time a record may carry" in err
    assert not out.exists()
    # Within it, the trace is written and replays.
    code, _, err = run_cli([*flags, "--window", "9e14:", "--out", str(out)], capsys)
    assert code == 0, err
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    replay = ["simulate", "--trace", str(out), "--tenants", str(tenants_file), "--format", "json"]
    code, _, err = run_cli(replay, capsys)
    assert code == 0, err


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
        (["--burst-off-ms", "-5"], "--burst-off-ms -5: must be > 0 ms"),
        (["--burst-on-ms", "docs=0"], "--burst-on-ms docs=0: must be > 0 ms"),
        (["--burst-on-ms", "docs=long"], "--burst-on-ms docs=long: not a number of ms"),
        (["--prompt-tokens", "-3"], "--prompt-tokens -3: must be an integer >= 0 tokens"),
        (["--prompt-tokens", "nobody=3"], "--prompt-tokens nobody=3: unknown tenant"),
        (["--output-tokens", "chat=1.5"], "--output-tokens chat=1.5: not an integer"),
        (["--output-tokens", "many"], "--output-tokens many: not an integer number of tokens"),
        (["--arrivals", "onoff"], "(known: poisson, constant, bursty, periodic)"),
        (["--noise", "0.1"], "--noise: only applies with --observe"),
        (["--observe", "--noise", "1.5"], "--noise: must be in [0, 1)"),
        (["--observe", "--set", "decodeWeight=0"], "decodeWeight: must be > 0"),
        (["--seed", "x"], "--seed: must be an integer (got 'x')"),
        (["--requests", "2.5"], "--requests: must be an integer (got 2.5)"),
        (["--observe", "--noise", "nan"], "--noise: must be finite (got nan)"),
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


def test_bad_periods_in_a_spec_name_the_flag_and_tenant() -> None:
    with pytest.raises(WorkloadError, match="--burst-on-ms t: must be > 0 ms"):
        WorkloadSpec((TenantWorkload("t", "batch", MIXES["rag"], 1.0, "periodic", 0, 10, 0.0),))
