"""``tokenfair calibrate``: least-squares fit of decode weight and service rate.

Behaviours under test:

* exact records (hand arithmetic) give the coefficients back exactly, with R^2 1 and no residual;
* ``queue_wait_ms`` and loadgen's ``observed.send_lag_ms`` are subtracted from ``e2e_ms`` and
  ``ttft_ms``; records without a queue wait count as idle-server records; a TTFT equal to the
  e2e time (a non-streamed response) never feeds the prefill fit;
* shed records, records without ``e2e_ms`` or actual token counts, and records whose queue wait
  covers their whole time are skipped and counted by reason;
* records generated with known coefficients plus 5 % noise give them back within 3 %, inside
  four of the fit's own standard errors, with the residual spread of the noise; the prefill
  speed is recovered from TTFTs above the floor;
* degenerate inputs are refused with a reason: too few records, proportional prompt/output
  lengths, empty outputs, a non-positive coefficient, a too uncertain fit;
* outcome fields are read from sidecar/loadgen records that ``read_trace`` validates but drops;
* end to end through the console script: generate -> calibrate -> the printed ``--set`` flags
  are accepted by ``tokenfair simulate``; a refusal exits 1, a bad flag 2.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenfair.core import Request
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import TraceRecord, read_trace
from tokenfair.sim.calibrate import (
    NO_ACTUAL_TOKENS,
    NO_E2E,
    NOT_ADMITTED,
    NOT_POSITIVE,
    CalibrationError,
    Outcome,
    calibrate,
    read_outcomes,
)
from tokenfair.sim.tracegen import MIXES, TenantWorkload, WorkloadSpec, generate, observe

TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")


def record(
    n: int, prefill: int, decode: int, e2e_ms: float | None, ttft_ms: float | None = None
) -> TraceRecord:
    return TraceRecord(
        Request(f"r{n}", "t", float(n), prefill, decode, "interactive"),
        actual_prefill_tokens=prefill,
        actual_decode_tokens=decode,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
    )


# w = 3, rate = 30 tokens/ms: execution = (p + 3 d) / 30 ms.
EXACT = [
    record(0, 300, 100, 20.0),  # (300 + 300) / 30 = 20
    record(1, 600, 50, 25.0),  # (600 + 150) / 30 = 25
    record(2, 90, 300, 33.0),  # (90 + 900) / 30 = 33
    record(3, 1500, 0, 50.0),  # 1500 / 30 = 50
]


def test_exact_records_give_the_coefficients_back() -> None:
    fit = calibrate(EXACT, min_records=3).service
    assert fit.decode_weight == pytest.approx(3.0, rel=1e-12)
    assert fit.service_tokens_per_ms == pytest.approx(30.0, rel=1e-12)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-12)
    assert fit.residual_rms_ms == pytest.approx(0.0, abs=1e-9)
    assert fit.records_used == 4


def test_queue_wait_is_subtracted_and_missing_waits_are_counted() -> None:
    # Each record waited 7n ms in the queue before the same execution as in EXACT.
    waited = [
        record(i, r.request.prefill_tokens, r.request.decode_tokens, (r.e2e_ms or 0) + 7 * i)
        for i, r in enumerate(EXACT)
    ]
    outcomes = {f"r{i}": Outcome(queue_wait_ms=7.0 * i) for i in range(4)}
    result = calibrate(waited, outcomes, min_records=3)
    assert result.service.decode_weight == pytest.approx(3.0, rel=1e-12)
    assert result.service.service_tokens_per_ms == pytest.approx(30.0, rel=1e-12)
    assert result.assumed_idle_records == 0
    # Without the waits the same records no longer fit (loosely enough that it takes a laxer
    # uncertainty limit to get a fit at all), the waits inflate the costs, and all count as idle.
    blind = calibrate(waited, min_records=3, max_relative_stderr=1.0)
    assert blind.service.r_squared < 0.99
    assert blind.service.service_tokens_per_ms < 0.9 * 30
    assert blind.assumed_idle_records == 4

    # The same for TTFTs: wait 3i ms, then prefill at 50 tokens/ms (p / 50 >= 13.2 ms, clear of
    # 1.5 * 8 ms), then execution at w = 3, 30 tokens/ms.
    prompts = [660, 1200, 2400, 4800, 900, 3000]
    timed = [
        record(i, p, 10 * i + 5, 3.0 * i + (p + 3 * (10 * i + 5)) / 30, 3.0 * i + p / 50)
        for i, p in enumerate(prompts)
    ]
    waits = {f"r{i}": Outcome(queue_wait_ms=3.0 * i) for i in range(len(prompts))}
    prefill = calibrate(timed, waits, min_records=3).prefill
    assert prefill is not None
    assert prefill.prefill_tokens_per_ms == pytest.approx(50.0, rel=1e-12)
    assert prefill.records_used == len(prompts)
    # A client's lateness in sending (loadgen's observed.send_lag_ms) is not execution either.
    lagged = {f"r{i}": Outcome(queue_wait_ms=1.0 * i, send_lag_ms=2.0 * i) for i in range(6)}
    assert calibrate(timed, lagged, min_records=3).service.r_squared == pytest.approx(1.0)
    # Non-streamed responses: the "TTFT" is the whole response, so no prefill speed is fitted.
    whole = [record(i, p, 10 * i + 5, (p + 30 * i + 15) / 30 + 1.0) for i, p in enumerate(prompts)]
    whole = [dataclasses.replace(r, ttft_ms=r.e2e_ms) for r in whole]
    unstreamed = calibrate(whole, min_records=3)
    assert unstreamed.prefill is None
    assert unstreamed.prefill_note == "only 0 usable record(s) with a first-token ttft_ms"


def test_unusable_records_are_skipped_by_reason() -> None:
    unusable = [
        record(10, 300, 100, None),  # never finished
        TraceRecord(Request("r11", "t", 0.0, 300, 100, "batch"), e2e_ms=20.0),  # no usage
        record(12, 300, 100, 5.0),  # its 9 ms queue wait is longer than its e2e
        record(13, 300, 100, 12.0),  # shed with a 429
    ]
    outcomes = {"r12": Outcome(queue_wait_ms=9.0), "r13": Outcome(status_code=429)}
    result = calibrate([*EXACT, *unusable], outcomes, min_records=3)
    assert result.skipped == {NO_E2E: 1, NO_ACTUAL_TOKENS: 1, NOT_POSITIVE: 1, NOT_ADMITTED: 1}
    assert result.records_read == 8
    assert result.service.records_used == 4
    assert result.service.decode_weight == pytest.approx(3.0, rel=1e-12)


def noisy_records(duration_ms: float, noise: float, seed: int = 1) -> list[TraceRecord]:
    """Chat, completion and rag tenants at 5/s each, timed by w = 3, 30 tokens/ms, 48 t/ms."""
    tenants = tuple(
        TenantWorkload(name, "interactive", MIXES[name]) for name in ("chat", "completion", "rag")
    )
    requests = generate(WorkloadSpec(tenants, seed=seed, duration_ms=duration_ms))
    cost = CostModel(decode_weight=3.0, service_tokens_per_ms=30.0)
    return observe(requests, cost, noise, seed)


def test_noisy_records_give_the_known_coefficients_back() -> None:
    records = noisy_records(300_000.0, 0.05)
    result = calibrate(records)
    fit = result.service
    # 3 tenants x 5/s x 300 s ~ 4500 records with 5 % noise each: the fit's standard errors are
    # ~0.35 % for w and ~0.13 % for the rate, so 3 % is more than 8 of them, and the estimates
    # must also lie within 4 of their own reported standard errors (the errors are honest).
    assert fit.records_used == len(records) > 4000
    assert fit.decode_weight == pytest.approx(3.0, rel=0.03)
    assert fit.service_tokens_per_ms == pytest.approx(30.0, rel=0.03)
    assert abs(fit.decode_weight - 3.0) < 4 * fit.decode_weight_stderr
    assert abs(fit.service_tokens_per_ms - 30.0) < 4 * fit.service_tokens_per_ms_stderr
    assert fit.decode_weight_stderr / fit.decode_weight < 0.01
    # The residuals are the noise: 5 % of the fitted time (the sample sd of ~4500 draws is
    # within ~1 % of 0.05; 10 % also absorbs the fit's own small error).
    assert fit.residual_rms_relative == pytest.approx(0.05, rel=0.10)
    assert fit.r_squared > 0.98
    assert result.assumed_idle_records == len(records)
    # Prefill at the default 48 tokens/ms above the 8 ms floor (prompts >= 1.5 * 8 * 48 = 576):
    # ~2500 such TTFTs with 5 % noise give a standard error of 0.05 / sqrt(2500) = 0.1 %.
    assert result.prefill is not None
    assert result.prefill.prefill_tokens_per_ms == pytest.approx(48.0, rel=0.03)
    assert result.overrides()[:2] == [
        f"decodeWeight={float(f'{fit.decode_weight:.4g}')!r}",
        f"serviceTokensPerMs={float(f'{fit.service_tokens_per_ms:.4g}')!r}",
    ]


def _refusal(records: Sequence[TraceRecord]) -> str:
    with pytest.raises(CalibrationError) as caught:
        calibrate(records)
    return str(caught.value)


def test_degenerate_inputs_are_refused_with_a_reason() -> None:
    assert "only 4 usable record(s); at least 20 are needed" in _refusal(EXACT)
    # Output always a tenth of the prompt: time = (p + 3 p / 10) / 30 fits any w with a rate to
    # match, so the two cannot be separated.
    proportional = [record(i, 100 * i, 10 * i, 13 * i / 30) for i in range(1, 30)]
    assert "(nearly) proportional" in _refusal(proportional)
    no_output = [record(i, 100 * i, 0, 100 * i / 30) for i in range(1, 30)]
    assert "empty output" in _refusal(no_output)
    # Times that shrink as the output grows: the decode coefficient comes out negative.
    shrinking = [record(i, 1000 + 10 * i, 5 * i, (1000 + 10 * i) / 30 - i / 10) for i in range(30)]
    assert "degenerate fit" in _refusal(shrinking)
    # 20 records with 60 % noise cannot pin w down to 20 %.
    noisy = noisy_records(2_000.0, 0.6, seed=4)[:20]
    message = _refusal(noisy)
    assert "too uncertain" in message
    assert "(20 record(s) read, 20 usable)" in message


def test_end_to_end_through_the_console_script(tmp_path: Path) -> None:
    trace = tmp_path / "observed.jsonl"
    subprocess.run(
        [TOKENFAIR, "trace", "generate", "--duration-ms", "120000", "--mix",
         "tenant_ide_assist=completion", "--observe", "--set", "decodeWeight=3",
         "--set", "serviceTokensPerMs=30", "--noise", "0.05", "--seed", "2",
         "--out", str(trace)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    result = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(trace), "--format", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert report["records_used"] == len(read_trace(trace)) > 1500
    # ~1800 records: standard errors ~0.6 % (w) and ~0.22 % (rate); 4 % is over 6 of them.
    assert report["service"]["decode_weight"] == pytest.approx(3.0, rel=0.04)
    assert report["service"]["service_tokens_per_ms"] == pytest.approx(30.0, rel=0.04)
    flags = [arg for item in report["set"] for arg in ("--set", item)]
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "apiVersion: tokenfair.io/v1alpha1\nkind: TokenfairConfig\ntenants:\n"
        + "".join(
            f"- {{tenantId: {t}, weight: 1, burstServiceTokens: 48000,"
            f" sustainedServiceTokensPerSecond: 180000, priorityClass: {c}}}\n"
            for t, c in (
                ("tenant_chat_pro", "interactive"),
                ("tenant_ide_assist", "interactive"),
                ("tenant_batch_rag", "batch"),
            )
        ),
        encoding="utf-8",
    )
    simulated = subprocess.run(
        [TOKENFAIR, "simulate", "--trace", str(trace), "--tenants", str(tenants), "--policy",
         "tokenfair", "--format", "json", *flags],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    fitted_weight = float(report["set"][0].removeprefix("decodeWeight="))
    assert json.loads(simulated.stdout)["decode_weight"] == fitted_weight

    text = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(trace)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "--set " + " --set ".join(report["set"]) in text
    assert f"{report['records_used']} used" in text


def test_cli_refusal_exits_1_and_bad_flags_exit_2(tmp_path: Path) -> None:
    trace = tmp_path / "plain.jsonl"
    subprocess.run(
        [TOKENFAIR, "trace", "generate", "--duration-ms", "3000", "--out", str(trace)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    refused = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(trace)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stdout == ""
    assert "cannot calibrate: only 0 usable record(s)" in refused.stderr
    assert "no e2e_ms" in refused.stderr
    bad = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(trace), "--min-records", "1"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--min-records: must be >= 3" in bad.stderr
    not_a_number = subprocess.run(
        [TOKENFAIR, "calibrate", "--records", str(trace), "--min-records", "abc"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (not_a_number.returncode, not_a_number.stdout) == (2, "")
    assert not_a_number.stderr == (
        "tokenfair calibrate: error: --min-records: must be an integer (got 'abc')\n"
    )


def test_outcome_fields_are_read_from_sidecar_records(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    lines = [
        {"request_id": "a", "tenant_id": "t", "arrival_ms": 0, "prefill_tokens": 300,
         "decode_tokens": 100, "priority_class": "interactive", "status_code": 200,
         "queue_wait_ms": 12.5, "e2e_ms": 32.5, "actual_prefill_tokens": 300,
         "actual_decode_tokens": 100, "policy": "live",
         "observed": {"e2e_ms": 32.5, "send_lag_ms": 2.5}},
        {"request_id": "b", "tenant_id": "t", "arrival_ms": 1, "prefill_tokens": 300,
         "decode_tokens": 100, "priority_class": "batch", "status_code": 429},
        {"request_id": "c", "tenant_id": "t", "arrival_ms": 2, "prefill_tokens": 300,
         "decode_tokens": 100, "priority_class": "batch"},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert read_outcomes(path) == {
        "a": Outcome(queue_wait_ms=12.5, status_code=200, send_lag_ms=2.5),
        "b": Outcome(status_code=429),
    }
