"""``tokenfair calibrate`` on records taken under load: the batching engine's fit.

Behaviours under test:

* the concurrency sweep (``sim/concurrency.py``), by hand: time-averaged and service-weighted
  concurrency of a run, the count at a dispatch (an end at that instant not counted, a start
  counted), the momentary peak (an overlap of the records' rounding is one; the default S, the
  most a record ran with on average, rounded, is not moved by it);
* records of the simulator's batching replay (S = 8, R = 45, G in {1, 4, 8}, decodeWeight 3,
  each request's work 10 % noisy) give R, G and w back within a few percent and within four
  of their own standard errors, S as the most requests the records show at once; the serial
  fit of today reads the same records as a server of ~7 service tokens/ms;
* the prefill speed is fitted from TTFTs with the slowdown at dispatch removed;
* what cannot be fitted is said once each, and what can be is fitted: no spread of
  concurrency (batchThroughputGain unidentified, and serviceTokensPerMs too when the stated S is
  not the concurrency seen), a significantly negative slope (refitted at G = S), throughput
  falling with concurrency (refitted at G = 1), a poor R²; too few records is refused;
* records that never overlapped keep the serial fit, unchanged, and so do any with a stated S
  of 1;
* end to end through the console script: sidecar-format records -> ``calibrate --format json``
  and the table -> the ``--set`` flags are accepted by ``tokenfair simulate``;
  ``--max-batch-requests`` out of range exits 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import TraceRecord
from tokenfair.sim.calibrate import (
    CalibrationError,
    Outcome,
    PrefillQueueFit,
    Sample,
    calibrate,
    fit_prefill_queue,
    samples_from_records,
)
from tokenfair.sim.calibrate import fit_service as serial_fit
from tokenfair.sim.concurrency import ConcurrencyProfile
from tokenfair.sim.simulator import replay_timed
from tokenfair.sim.tracegen import MIXES, TenantWorkload, WorkloadSpec, generate

TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")
RATE, WEIGHT, BATCH = 45.0, 3.0, 8
TENANTS = (
    TenantWorkload("tenant_chat_pro", "interactive", MIXES["chat"], 6.0, "bursty"),
    TenantWorkload("tenant_ide_assist", "interactive", MIXES["completion"], 6.0, "bursty"),
    TenantWorkload("tenant_batch_rag", "batch", MIXES["rag"], 2.0, "bursty"),
)

Loaded = tuple[list[TraceRecord], dict[str, Outcome]]


# -- the sweep, by hand ----------------------------------------------------------------------


def test_concurrency_profile_by_hand() -> None:
    # A on [0, 10), B on [5, 15), C on [10, 12) (starts as A ends: no overlap with A).
    profile = ConcurrencyProfile([(0.0, 10.0), (5.0, 15.0), (10.0, 12.0)])
    assert profile.runs == 3
    assert profile.peak == 2
    assert [profile.at(t) for t in (0.0, 5.0, 10.0, 12.0, 15.0)] == [1, 2, 2, 1, 0]
    assert profile.mean(0.0, 10.0) == pytest.approx(1.5)  # 5 ms alone, 5 ms with B
    assert profile.mean(5.0, 15.0) == pytest.approx((5 * 2 + 2 * 2 + 3 * 1) / 10)
    assert profile.mean(10.0, 12.0) == pytest.approx(2.0)
    # Service-weighted at v(1) = 1, v(2) = 1/2: A gets 5 * 1 + 5 * 0.5 = 7.5 tokens, 2.5 of
    # them at c = 2: c̃ = (5 * 1 + 2.5 * 2) / 7.5 = 4 / 3 (less than its time-average 1.5).
    means = profile.service_means([(0.0, 10.0)], lambda c: 1.0 / c if c else 0.0)
    assert means == [pytest.approx(4 / 3)]
    # An overlap of 0.004 ms (a rounding, or an end stamped after the next dispatch) is a
    # momentary peak, but hardly moves a run's average.
    rounded = ConcurrencyProfile([(0.0, 10.004), (10.0, 20.0), (20.0, 30.0)])
    assert rounded.peak == 2
    assert rounded.means([(0.0, 10.004), (10.0, 20.0)]) == [
        pytest.approx(1.0004, abs=1e-6), pytest.approx(1.0004, abs=1e-6),
    ]  # fmt: skip


# -- records of the simulator's batching replay -----------------------------------------------


def replayed(
    gain: float, noise: float = 0.1, seed: int = 1, duration_ms: float = 120_000
) -> Loaded:
    """What a sidecar in front of an S = 8 engine (R = 45, G = ``gain``, w = 3) would record
    of a bursty trace: its requests' work is ``noise`` log-normal around the cost model's (the
    records carry the token counts, the engine ran the noisy work)."""
    requests = generate(WorkloadSpec(TENANTS, seed=seed, duration_ms=duration_ms))
    policy = PolicyConfig(
        max_batch_requests=BATCH,
        batch_throughput_gain=gain,
        service_tokens_per_ms=RATE,
        decode_weight=WEIGHT,
        total_kv_blocks=100_000,
    )
    tenants = [TenantConfig(t.tenant_id, 1.0, 10**8, 1e8, t.priority_class) for t in TENANTS]
    cost = CostModel.from_policy(policy)

    def work(request: Request) -> int:
        rng = random.Random(f"{seed}/{request.request_id}")
        factor = math.exp(rng.gauss(0.0, noise) - noise * noise / 2)
        return round(cost.service_tokens(request.prefill_tokens, request.decode_tokens) * factor)

    by_id = {r.request_id: r for r in requests}
    records: list[TraceRecord] = []
    outcomes: dict[str, Outcome] = {}
    arrivals = [(r, work(r), None) for r in requests]
    for decision, _, end_ms in replay_timed(build_config(policy, tenants), arrivals, "tokenfair"):
        request = by_id[decision.request_id]
        if end_ms is None:
            records.append(TraceRecord(request))
            outcomes[request.request_id] = Outcome(status_code=decision.status_code)
            continue
        records.append(
            TraceRecord(
                request,
                actual_prefill_tokens=request.prefill_tokens,
                actual_decode_tokens=request.decode_tokens,
                ttft_ms=decision.ttft_ms,
                e2e_ms=round(end_ms - decision.arrival_ms, 2),
            )
        )
        outcomes[request.request_id] = Outcome(
            queue_wait_ms=decision.queue_wait_ms, status_code=200, dispatch_ms=decision.dispatch_ms
        )
    return records, outcomes


@pytest.mark.parametrize("gain", [1.0, 4.0, 8.0])
def test_records_of_a_batching_replay_give_the_engine_back(gain: float) -> None:
    records, outcomes = replayed(gain)
    result = calibrate(records, outcomes)
    fit = result.batching
    assert fit is not None
    assert result.problems == ()
    assert fit.max_batch_requests == BATCH  # the most the records show at once
    assert not fit.max_batch_requests_given
    assert fit.records_used > 1200
    assert fit.concurrency_min == pytest.approx(1.0)
    assert fit.concurrency_max == pytest.approx(8.0, abs=0.01)
    # ~1300 records with 10 % noise: standard errors ~0.5 % (R), ~1 % (G), ~1.2 % (w).
    assert fit.service_tokens_per_ms is not None
    assert fit.batch_throughput_gain is not None
    assert fit.service_tokens_per_ms == pytest.approx(RATE, rel=0.02)
    assert fit.batch_throughput_gain == pytest.approx(gain, rel=0.05)
    assert fit.decode_weight == pytest.approx(WEIGHT, rel=0.04)
    assert fit.service_tokens_per_ms_stderr is not None
    assert abs(fit.service_tokens_per_ms - RATE) < 4 * fit.service_tokens_per_ms_stderr
    assert abs(fit.decode_weight - WEIGHT) < 4 * fit.decode_weight_stderr
    if fit.mode == "free":  # on a bound (G = 1 or S) the gain is the bound, without error
        assert fit.batch_throughput_gain_stderr is not None
        assert abs(fit.batch_throughput_gain - gain) < 4 * fit.batch_throughput_gain_stderr
    else:
        assert fit.batch_throughput_gain == gain
    assert fit.r_squared > 0.95
    # The prefill runs at the default 48 tokens/ms alone: found through the slowdown.
    assert result.prefill is not None
    assert result.prefill.prefill_tokens_per_ms == pytest.approx(48.0, rel=0.02)
    assert result.overrides() == [
        f"decodeWeight={float(f'{fit.decode_weight:.4g}')!r}",
        f"serviceTokensPerMs={float(f'{fit.service_tokens_per_ms:.4g}')!r}",
        "maxBatchRequests=8",
        f"batchThroughputGain={float(f'{fit.batch_throughput_gain:.4g}')!r}",
        f"prefillTokensPerMs={float(f'{result.prefill.prefill_tokens_per_ms:.4g}')!r}",
    ]
    # The serial fit reads the same records as a slow server: the per-request speed at the
    # records' concurrency, far below the throughput the engine sustains.
    samples, _, _ = samples_from_records(records, outcomes)
    assert serial_fit(samples).service_tokens_per_ms < 0.5 * RATE


def test_a_stated_batch_prices_the_same_engine_at_it() -> None:
    records, outcomes = replayed(4.0)
    fit = calibrate(records, outcomes, max_batch_requests=4).batching
    assert fit is not None
    assert fit.max_batch_requests_given
    # X(4) / X(1) of the engine with X(8) = 45, X(1) = 45 / 4: v(c) = 1 / (a + b c),
    # b = (8 / 45 - 4 / 45) / 7, a = 4 / 45 - b.
    slope = (8 / RATE - 4 / RATE) / 7
    base = 4 / RATE - slope
    assert fit.service_tokens_per_ms == pytest.approx(4 / (base + 4 * slope), rel=0.02)
    assert fit.batch_throughput_gain == pytest.approx(4 / (base + 4 * slope) / (RATE / 4), rel=0.05)


# -- what cannot be fitted ---------------------------------------------------------------------


def lockstep(
    phases: Sequence[tuple[int, int]],
    base: float,
    slope: float,
    noise: float = 0.0,
    seed: int = 0,
) -> Loaded:
    """Records of an engine with ``v(c) = 1 / (base + slope (c - 1))``, decodeWeight 3, run in
    lock step: phase by phase, ``(lanes, steps)``: ``lanes`` requests start together, and each
    step ends (and the next starts) when all of them end — their work is the same ``s`` in a step
    (prompt/output splits differ), so ``c`` is exactly ``lanes`` throughout each run."""
    rng = random.Random(seed)
    records: list[TraceRecord] = []
    outcomes: dict[str, Outcome] = {}
    clock_ms = 0.0
    for lanes, steps in phases:
        for _ in range(steps):
            service = rng.randint(300, 3000)
            run_ms = service * (base + slope * (lanes - 1))
            for lane in range(lanes):
                decode = rng.randint(1, service // 4)
                prefill = service - 3 * decode
                n = len(records)
                own_ms = run_ms * math.exp(rng.gauss(0.0, noise)) if noise else run_ms
                records.append(
                    TraceRecord(
                        Request(f"r{n}", "t", clock_ms, prefill, decode, "interactive"),
                        actual_prefill_tokens=prefill,
                        actual_decode_tokens=decode,
                        e2e_ms=own_ms,
                    )
                )
                outcomes[f"r{n}"] = Outcome(queue_wait_ms=0.0, status_code=200)
                del lane
            clock_ms += run_ms * 1.5 if noise else run_ms
    return records, outcomes


def test_no_spread_of_concurrency_fits_what_it_can() -> None:
    # Always 8 at once: A and b cannot be told apart; the per-request speed at 8 is known.
    base, slope = 1 / 11.25, (8 / 45 - 1 / 11.25) / 7  # R = 45, G = 4 at S = 8
    records, outcomes = lockstep([(8, 40)], base, slope)
    result = calibrate(records, outcomes)
    fit = result.batching
    assert fit is not None
    assert fit.max_batch_requests == 8
    assert fit.batch_throughput_gain is None
    assert fit.unidentified == ("batchThroughputGain",)
    assert fit.service_tokens_per_ms == pytest.approx(45.0)  # X(8): the engine was full
    assert fit.decode_weight == pytest.approx(3.0)
    [problem] = result.problems
    assert problem.startswith("no spread of concurrency: the records ran at 8.00 to 8.00")
    assert "batchThroughputGain is not identified" in problem
    assert result.overrides() == ["decodeWeight=3.0", "serviceTokensPerMs=45.0",
                                  "maxBatchRequests=8"]  # fmt: skip
    # Priced at a batch it never ran, the throughput is not known either.
    stated = calibrate(records, outcomes, max_batch_requests=16)
    assert stated.batching is not None
    assert stated.batching.unidentified == ("batchThroughputGain", "serviceTokensPerMs")
    assert "nor is serviceTokensPerMs at maxBatchRequests 16" in stated.problems[0]
    assert "the throughput at 8.00 requests is 45 service tokens/ms" in stated.problems[0]
    assert stated.overrides() == ["decodeWeight=3.0", "maxBatchRequests=16"]


def test_a_negative_slope_is_refitted_at_its_bound_and_said() -> None:
    # Four at once run faster than one alone: b = -A / 50.
    records, outcomes = lockstep([(1, 20), (4, 20)], 0.1, -0.002)
    result = calibrate(records, outcomes)
    fit = result.batching
    assert fit is not None
    assert fit.mode == "constant"
    assert fit.batch_throughput_gain == fit.max_batch_requests == 4
    [problem] = result.problems
    assert problem.startswith("negative slope: the fit has requests run faster beside others")
    assert "refitted with b = 0, so batchThroughputGain = maxBatchRequests = 4" in problem


def test_throughput_falling_with_concurrency_is_refitted_at_gain_1_and_said() -> None:
    records, outcomes = lockstep([(1, 20), (4, 20)], 0.1, 0.15)  # b > A: X(4) < X(1)
    result = calibrate(records, outcomes)
    fit = result.batching
    assert fit is not None
    assert fit.mode == "shared"
    assert fit.batch_throughput_gain == 1.0
    [problem] = result.problems
    assert problem.startswith("throughput falls as concurrency grows")
    assert "batchThroughputGain would be 0.727 ± " in problem  # 4 A / (A + 3 b)


def test_a_poor_fit_is_said() -> None:
    records, outcomes = lockstep([(1, 40), (4, 40)], 0.1, 0.02, noise=0.7, seed=3)
    result = calibrate(records, outcomes, max_relative_stderr=10.0)
    assert result.batching is not None
    assert result.service.r_squared < 0.9
    assert any(p.startswith("poor fit: R² ") for p in result.problems)


def test_too_few_records_under_load_are_refused() -> None:
    records, outcomes = lockstep([(1, 1), (2, 1)], 0.1, 0.02)
    with pytest.raises(CalibrationError, match=r"only 3 usable record\(s\); at least 20"):
        calibrate(records, outcomes)


def test_a_refused_fit_under_load_says_what_the_records_show() -> None:
    # The refusal names the records' spread of concurrency and of prompt/output ratios, and
    # what a usable fit needs (a live vLLM's noisy records were refused without either).
    records, outcomes = lockstep([(1, 1), (2, 1)], 0.1, 0.02)
    with pytest.raises(CalibrationError) as refused:
        calibrate(records, outcomes)
    message = str(refused.value)
    assert "the usable records ran at 1.00 to 2.00 requests at once (p10 1.00, p90 2.00)" in message
    ratios = sorted(r.actual_prefill_tokens / r.actual_decode_tokens for r in records)  # type: ignore[operator]
    assert f"prompt/output ratios {ratios[0]:.3g} to {ratios[-1]:.3g}" in message
    assert "a ramp of load from one request at a time to the full batch" in message


def test_a_fit_too_uncertain_says_what_is_not_identified_and_how_many_records_would_do() -> None:
    # Always 8 at once, 60 % noise, priced at S = 16: the throughput at 16 is not identified
    # (said so, not as a 0 % error), and decodeWeight's error of ~57 % from 32 records needs
    # about 32 x (0.565 / 0.2)² = 256 like them.
    records, outcomes = lockstep([(8, 4)], 0.1, 0.02, noise=0.6, seed=0)
    with pytest.raises(CalibrationError) as refused:
        calibrate(records, outcomes, max_batch_requests=16)
    message = str(refused.value)
    assert message.startswith("fit too uncertain: relative standard error of decode_weight 56.5%")
    assert "serviceTokensPerMs not identified (no spread of concurrency) (limit 20%)" in message
    assert "32 record(s) gave it; about 256 like them would bring it under the limit" in message


def test_the_engines_prefill_queue_is_fitted_first_come_first_served() -> None:
    # Waves of long prompts started together, and short ones just after: first tokens that
    # come after every prompt started before (at 5 prompt tokens/ms, floor 8 ms). The fit
    # finds 5 exactly; a slowdown by concurrency alone has no such rate (the short prompts'
    # first tokens wait for the long ones).
    rng = random.Random(7)
    samples: list[Sample] = []
    done = -math.inf
    for wave in range(30):
        at = wave * 2000.0
        for _ in range(rng.randint(1, 6)):
            prompt = rng.choice((1600, 1500, 400, 100))
            at += rng.uniform(0.1, 50.0)
            done = max(done, at) + prompt / 5.0
            first = max(8.0, done - at)
            samples.append(Sample(prompt, 50, first + 500.0, first, (at, at + first + 500.0)))
    fit = fit_prefill_queue(samples, 8.0)
    assert isinstance(fit, PrefillQueueFit)
    assert fit.records_used == len(samples)
    assert fit.prefill_tokens_per_ms == pytest.approx(5.0, rel=1e-6)
    assert fit.rms_log_error == pytest.approx(0.0, abs=1e-6)
    assert fit_prefill_queue(samples[:19], 8.0) is None  # fewer than 20


def test_the_prefill_queue_fits_each_prompts_overhead_beside_the_throughput() -> None:
    # An engine whose prompts each cost 10 ms (their step) plus their tokens at 12 prompt
    # tokens/ms, prompts started in waves: a 1,200-token prompt alone takes 10 + 100 = 110 ms,
    # a 120-token one 10 + 10 = 20 ms, and one started 5 ms after a long one 110 - 5 + 20 =
    # 125 ms. The fit finds both; the throughput alone cannot explain a short prompt at twice
    # its tokens' time and a long one at 1.1x, and settles on a slower engine between them.
    rng = random.Random(11)
    samples: list[Sample] = []
    done = -math.inf
    for wave in range(30):
        at = wave * 3000.0
        for _ in range(rng.randint(1, 5)):
            prompt = rng.choice((1200, 960, 240, 120))
            at += rng.uniform(1.0, 300.0)
            done = max(done, at) + 10.0 + prompt / 12.0
            first = done - at
            samples.append(Sample(prompt, 50, first + 500.0, first, (at, at + first + 500.0)))
    fit = fit_prefill_queue(samples, 8.0)
    assert isinstance(fit, PrefillQueueFit)
    assert fit.prefill_tokens_per_ms == pytest.approx(12.0, rel=1e-4)
    assert fit.prefill_overhead_ms == pytest.approx(10.0, rel=1e-4)
    assert fit.rms_log_error == pytest.approx(0.0, abs=1e-4)
    # The same records with every prompt's overhead left out: the queue of the tokens alone
    # (the exact fit of the test above), overhead 0.
    plain: list[Sample] = []
    done = -math.inf
    for sample in samples:
        assert sample.span is not None
        at = sample.span[0]
        done = max(done, at) + sample.prefill_tokens / 12.0
        first = max(8.0, done - at)
        plain.append(dataclasses.replace(sample, prefill_ms=first))
    alone = fit_prefill_queue(plain, 8.0)
    assert isinstance(alone, PrefillQueueFit)
    assert alone.prefill_overhead_ms == 0.0
    assert alone.prefill_tokens_per_ms == pytest.approx(12.0, rel=1e-6)


def test_a_prefill_the_first_tokens_do_not_show_is_not_identified() -> None:
    # Every first token at the 8 ms floor: any speed from ~12.5 prompt tokens/ms up explains
    # them equally (the loss is flat), and the search would end on its upper bound, 1e5.
    at_floor = [Sample(100, 50, 600.0, 8.0, (i * 1000.0, i * 1000.0 + 600)) for i in range(30)]
    why = fit_prefill_queue(at_floor, 8.0)
    assert isinstance(why, str)
    assert why.startswith("engine prefill not identified: 30 first tokens are explained as well")
    # First tokens later than any queue of these prompts explains (100 tokens, 1 s apart, a
    # first token at 100 s): the search's lower bound, not a fit.
    slow = [Sample(1, 50, 1e6, 1e5, (i * 1000.0, i * 1000.0 + 1e6)) for i in range(30)]
    why = fit_prefill_queue(slow, 8.0)
    assert isinstance(why, str)
    assert "the search's lower bound, 0.01 prompt tokens/ms" in why
    # calibrate reports it as a problem, with no fit to replay.
    records, outcomes = replayed(4.0)
    floored = []
    for record in records:
        outcome = outcomes[record.request.request_id]
        if record.ttft_ms is not None and outcome.queue_wait_ms is not None:
            record = dataclasses.replace(record, ttft_ms=round(outcome.queue_wait_ms + 8.0, 2))
        floored.append(record)
    result = calibrate(floored, outcomes)
    assert result.prefill_queue is None
    assert result.to_json()["prefill_queue"] is None
    assert [p for p in result.problems if p.startswith("engine prefill not identified")]


def test_records_under_load_carry_the_prefill_queue_fit() -> None:
    records, outcomes = replayed(4.0)
    result = calibrate(records, outcomes)
    assert result.prefill_queue is not None
    assert result.to_json()["prefill_queue"] == {
        "prefill_tokens_per_ms": result.prefill_queue.prefill_tokens_per_ms,
        "rms_log_error": result.prefill_queue.rms_log_error,
        "records_used": result.prefill_queue.records_used,
        "prefill_overhead_ms": result.prefill_queue.prefill_overhead_ms,
    }
    # Not a policy field: the --set flags are those of the fit.
    assert not any("prefill_queue" in item for item in result.overrides())
    # Records that ran alone (the serial fit) have none.
    alone, waits = lockstep([(1, 40)], 1 / 30, 0.0)
    assert calibrate(alone, waits).prefill_queue is None


def test_a_refused_serial_fit_says_nothing_of_concurrency() -> None:
    records, outcomes = lockstep([(1, 3)], 1 / 30, 0.0)  # one at a time: the serial fit
    with pytest.raises(CalibrationError) as refused:
        calibrate(records, outcomes)
    assert "requests at once" not in str(refused.value)


def test_records_that_never_overlapped_keep_the_serial_fit() -> None:
    records, outcomes = lockstep([(1, 40)], 1 / 30, 0.0)  # one at a time, back to back
    with_status = calibrate(records, outcomes)
    probes = calibrate(records, {k: Outcome(queue_wait_ms=0.0) for k in outcomes})
    assert with_status.batching is None
    assert with_status.service == probes.service
    assert with_status.service.service_tokens_per_ms == pytest.approx(30.0)
    assert with_status.overrides() == probes.overrides()
    stated = calibrate(records, outcomes, max_batch_requests=8)
    assert stated.problems[0].startswith("every record ran alone: the throughput of 8 requests")
    # A stated S of 1 asks for the serial fit whatever overlapped (a serial engine with one
    # request staged beside the running one shows two at once).
    overlapping, waits = lockstep([(2, 30)], 1 / 30, 1 / 30)
    assert calibrate(overlapping, waits).batching is not None
    assert calibrate(overlapping, waits, max_batch_requests=1).batching is None


# -- the console script -----------------------------------------------------------------------


def write_sidecar_records(path: Path, loaded: Loaded) -> None:
    """The records as a sidecar writes them (docs/records.md): request, outcome and times."""
    records, outcomes = loaded
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            request = record.request
            outcome = outcomes[request.request_id]
            line = {
                "policy": "live",
                "request_id": request.request_id,
                "tenant_id": request.tenant_id,
                "priority_class": request.priority_class,
                "status_code": outcome.status_code,
                "reason": "admitted" if outcome.status_code == 200 else "shed_queue_wait_slo",
                "gate": "dispatch" if outcome.status_code == 200 else "admission",
                "service_tokens": request.prefill_tokens + 3 * request.decode_tokens,
                "arrival_ms": request.arrival_ms,
                "kv_occupancy_ratio": 0.1,
                "queue_wait_ms": outcome.queue_wait_ms or 0.0,
                "ttft_ms": record.ttft_ms or 0.0,
                "dispatch_ms": outcome.dispatch_ms,
                "prefill_tokens": request.prefill_tokens,
                "decode_tokens": request.decode_tokens,
                "actual_prefill_tokens": record.actual_prefill_tokens,
                "actual_decode_tokens": record.actual_decode_tokens,
                "e2e_ms": record.e2e_ms,
            }
            handle.write(json.dumps(line) + "\n")


def strict_json(text: str) -> Any:
    """``json.loads`` refusing NaN and Infinity (Python's parser takes them; JSON has none)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_end_to_end_through_the_console_script(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    write_sidecar_records(path, replayed(4.0, duration_ms=60_000))
    done = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(path), "--format", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    report = strict_json(done.stdout)
    batching = report["batching"]
    assert batching["max_batch_requests"] == 8
    assert batching["service_tokens_per_ms"] == pytest.approx(RATE, rel=0.03)
    assert batching["batch_throughput_gain"] == pytest.approx(4.0, rel=0.08)
    assert report["problems"] == []
    assert [item.split("=")[0] for item in report["set"]] == [
        "decodeWeight", "serviceTokensPerMs", "maxBatchRequests", "batchThroughputGain",
        "prefillTokensPerMs",
    ]  # fmt: skip
    table = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "model: run_ms = (prefill + decodeWeight * decode) * (A + b * (c - 1))" in table
    assert "maxBatchRequests             8  (the most the records show at once)" in table
    assert "--set " + " --set ".join(report["set"]) in table
    assert "problem:" not in table
    tenants = Path(__file__).parents[3] / "examples" / "sidecar-standalone.yaml"
    flags = [arg for item in report["set"] for arg in ("--set", item)]
    simulated = subprocess.run(
        [TOKENFAIR, "simulate", "--trace", str(path), "--tenants", str(tenants), "--policy",
         "tokenfair", "--format", "json", "--no-progress", *flags],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert json.loads(simulated.stdout)["comparison"]["tokenfair"]["total_requests"] == len(
        path.read_text().splitlines()
    )
    bad = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(path), "--max-batch-requests", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "--max-batch-requests: must be in [1, 65536] (got 0)" in bad.stderr


def test_an_unidentified_fit_prints_its_problems_and_valid_json(tmp_path: Path) -> None:
    path = tmp_path / "flat.jsonl"
    write_sidecar_records(path, lockstep([(8, 40)], 1 / 11.25, (8 / 45 - 1 / 11.25) / 7))
    args = [TOKENFAIR, "calibrate", "--records", str(path), "--max-batch-requests", "16"]
    report = strict_json(
        subprocess.run([*args, "--format", "json"], check=True, capture_output=True,
                       text=True).stdout
    )  # fmt: skip
    assert report["batching"]["service_tokens_per_ms"] is None
    assert report["batching"]["unidentified"] == ["batchThroughputGain", "serviceTokensPerMs"]
    assert report["set"] == ["decodeWeight=3.0", "maxBatchRequests=16"]
    [problem] = report["problems"]
    table = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    assert f"problem: {problem}\n" in table
    assert "serviceTokensPerMs  not identified (the throughput at 8.00 requests at once is 45)" in (
        table
    )
    assert "batchThroughputGain not identified" in table
