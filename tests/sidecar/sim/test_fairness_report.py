"""The fairness report: weighted max-min fair shares, Jain's index, and ``tokenfair report``.

Behaviours under test:

* ``water_fill`` gives hand-calculated weighted max-min allocations (equal weights, 2:1 weights,
  a demand below its share, capacity above the total demand, nothing to share) and refuses a
  zero, negative or missing weight, a negative demand or capacity with a ``ValueError`` naming
  it; on random inputs it never gives a tenant more than its demand, hands out
  ``min(capacity, Σ demand)``, and every tenant it leaves short sits at one common level;
* ``jain_index`` gives its known values (1 for equal, ``1/n`` for one-takes-all, 0.9 for 1:2),
  None for no values, 1 for all zeros;
* ``fairness_report`` on hand-built decisions: sizes prefer the decision's actual tokens, then
  the caller's mapping, then the estimate; offered/served/fair share/served-over-fair/demand
  served per tenant; Jain per lane; utilisation from dispatches inside the window; requests
  refused from the queue (429) or at dispatch counted as admitted-then-expired, cancelled ones
  not; an explicit window; the zero-length and empty defaults; tenants absent from the config
  (weight 1, lane of their decisions); a bad window refused;
* ``read_decisions`` reads back exactly what ``write_decisions`` wrote, grouped by policy, and
  the lines the sidecar's record writer writes;
* ``tokenfair simulate`` puts ``fairness`` beside (not inside) the lesson-shaped ``comparison``
  and prints the fairness table under each policy's block;
* ``tokenfair report`` on ``tokenfair simulate --records`` output (three policies, grouped)
  reproduces the simulator's own fairness and independently derived offered/served tokens; on a
  hand-written live-sidecar-shaped file (actual tokens, 502, 499, 503 records) it gives the
  hand-calculated values; ``--window`` narrows it; ``--plot`` writes a PNG;
* bad inputs exit 2 with one line on stderr naming the file, line and field: a missing file, a
  bad JSON line, a missing field, a bad field value, a bad ``--window``, a bad tenants file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.cli import main
from tokenfair.config import Config, PolicyConfig, PriorityClass, TenantConfig
from tokenfair.core import Decision, Request
from tokenfair.records.codec import read_decisions, write_decisions
from tokenfair.records.live import Usage, encode_record
from tokenfair.sim.fairness import (
    fairness_report,
    format_fairness,
    jain_index,
    water_fill,
)

# ---------------------------------------------------------------------------------------------
# water_fill


def test_water_fill_equal_weights_split_evenly() -> None:
    # 90 among three tenants wanting 50 each, weights 1: level 90 / 3 = 30, below every demand.
    shares = water_fill(90, {"a": 50, "b": 50, "c": 50}, {"a": 1, "b": 1, "c": 1})
    assert shares == pytest.approx({"a": 30, "b": 30, "c": 30})


def test_water_fill_two_to_one_weights() -> None:
    # 90 between a (weight 2) and b (weight 1), both wanting 100: level 90 / (2 + 1) = 30,
    # a gets 2 * 30 = 60, b gets 1 * 30 = 30.
    shares = water_fill(90, {"a": 100, "b": 100}, {"a": 2, "b": 1})
    assert shares == pytest.approx({"a": 60, "b": 30})


def test_water_fill_a_demand_below_its_share_frees_the_rest() -> None:
    # 90 among demands 10, 50, 60 (weights 1): the first level 90 / 3 = 30 covers a's 10, so a
    # gets 10; 80 is left for b and c: level 80 / 2 = 40, below both demands -> 40 each.
    shares = water_fill(90, {"a": 10, "b": 50, "c": 60}, {"a": 1, "b": 1, "c": 1})
    assert shares == pytest.approx({"a": 10, "b": 40, "c": 40})
    # Weighted: 100 among a 10 (w 1), b 100 (w 2), c 100 (w 1). Order by demand / weight:
    # a 10, b 50, c 100. Level 100 / 4 = 25 covers a (10 <= 25): a = 10, 90 left for weight 3,
    # level 30: b wants 100 > 2 * 30, so the level is final: b = 60, c = 30.
    shares = water_fill(100, {"a": 10, "b": 100, "c": 100}, {"a": 1, "b": 2, "c": 1})
    assert shares == pytest.approx({"a": 10, "b": 60, "c": 30})


def test_water_fill_capacity_above_total_demand_serves_every_demand() -> None:
    # 500 for demands totalling 10 + 20 = 30: everyone gets its demand, 470 stays unused.
    shares = water_fill(500, {"a": 10, "b": 20}, {"a": 1, "b": 3})
    assert shares == pytest.approx({"a": 10, "b": 20})


def test_water_fill_with_nothing_to_share() -> None:
    assert water_fill(0, {"a": 10, "b": 20}, {"a": 1, "b": 1}) == {"a": 0.0, "b": 0.0}
    assert water_fill(100, {}, {}) == {}


@pytest.mark.parametrize(
    ("capacity", "demands", "weights", "message"),
    [
        (10, {"a": 5, "b": 5}, {"a": 1, "b": 0}, "weight of 'b' must be a finite number > 0"),
        (10, {"a": 5}, {"a": -1}, "weight of 'a' must be a finite number > 0"),
        (10, {"a": 5, "b": 5}, {"a": 1}, "no weight for 'b'"),
        (10, {"a": -5}, {"a": 1}, "demand of 'a' must be a finite number >= 0"),
        (-1, {"a": 5}, {"a": 1}, "capacity must be a finite number >= 0"),
        (math.inf, {"a": 5}, {"a": 1}, "capacity must be a finite number >= 0"),
    ],
)
def test_water_fill_refuses_bad_input(
    capacity: float, demands: dict[str, float], weights: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=f"water_fill: {message}"):
        water_fill(capacity, demands, weights)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    capacity=st.floats(0, 1e6),
    tenants=st.lists(st.tuples(st.floats(0, 1e5), st.floats(0.1, 10)), min_size=1, max_size=8),
)
def test_water_fill_is_max_min_fair(capacity: float, tenants: list[tuple[float, float]]) -> None:
    demands = {f"t{i}": demand for i, (demand, _) in enumerate(tenants)}
    weights = {f"t{i}": weight for i, (_, weight) in enumerate(tenants)}
    shares = water_fill(capacity, demands, weights)
    tolerance = 1e-6 * max(1.0, capacity, sum(demands.values()))
    assert math.fsum(shares.values()) == pytest.approx(
        min(capacity, math.fsum(demands.values())), abs=tolerance
    )
    for tenant_id, share in shares.items():
        assert -tolerance <= share <= demands[tenant_id] + tolerance
    # Max-min: every tenant left short of its demand is at one level (share / weight), and no
    # satisfied tenant is above it (it would have given up share to a short one).
    short = [t for t in shares if shares[t] < demands[t] - tolerance]
    if short:
        level = shares[short[0]] / weights[short[0]]
        for tenant_id in short:
            assert shares[tenant_id] / weights[tenant_id] == pytest.approx(level, rel=1e-6)
        for tenant_id in set(shares) - set(short):
            assert shares[tenant_id] / weights[tenant_id] <= level * (1 + 1e-6) + tolerance


# ---------------------------------------------------------------------------------------------
# jain_index


def test_jain_index_known_values() -> None:
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    # One of four takes everything: 1^2 / (4 * 1^2) = 1/4.
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    # 1 and 2: (1 + 2)^2 / (2 * (1 + 4)) = 9 / 10.
    assert jain_index([1.0, 2.0]) == pytest.approx(0.9)
    assert jain_index([]) is None
    assert jain_index([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="values must be >= 0"):
        jain_index([1.0, -1.0])


# ---------------------------------------------------------------------------------------------
# fairness_report on hand-built decisions

RATE = 10.0  # service tokens per ms: round numbers for the utilisation arithmetic
CONFIG = Config(
    PolicyConfig(service_tokens_per_ms=RATE),
    (
        TenantConfig("A", 2.0, 10_000, 10_000, "interactive"),
        TenantConfig("B", 1.0, 10_000, 10_000, "interactive"),
        TenantConfig("C", 1.0, 10_000, 10_000, "batch"),
    ),
)


def decision(
    request_id: str,
    tenant_id: str,
    arrival_ms: float,
    estimate: int,
    outcome: str,
    *,
    dispatch_ms: float | None = None,
    actual: int | None = None,
) -> Decision:
    """``outcome``: served, admission (429), timeout (429 queue), cancelled (499 queue),
    dispatch_kv (429 at dispatch)."""
    status, reason, gate = {
        "served": (200, "admitted", "dispatch"),
        "admission": (429, "shed_queue_wait_slo", "admission"),
        "timeout": (429, "shed_queue_timeout", "queue"),
        "cancelled": (499, "cancelled", "queue"),
        "dispatch_kv": (429, "shed_kv_watermark", "dispatch"),
    }[outcome]
    lane: PriorityClass = "batch" if tenant_id == "C" else "interactive"
    return Decision(
        request_id,
        tenant_id,
        lane,
        status,
        reason,
        gate,
        estimate,
        arrival_ms,
        dispatch_ms=dispatch_ms,
        actual_service_tokens=actual,
    )


DECISIONS = [
    # A (interactive, weight 2)
    decision("a1", "A", 0, 100, "served", dispatch_ms=0, actual=80),  # size 80 (not 999)
    decision("a2", "A", 10, 100, "served", dispatch_ms=10),  # size 120 from the mapping
    decision("a3", "A", 20, 100, "admission"),  # size 50 from the mapping
    # B (interactive, weight 1)
    decision("b1", "B", 0, 200, "served", dispatch_ms=30, actual=200),
    decision("b2", "B", 40, 200, "timeout"),  # admitted, expired in the queue
    decision("b3", "B", 50, 100, "cancelled"),  # admitted, cancelled: not expired
    # C (batch, weight 1)
    decision("c1", "C", 60, 300, "dispatch_kv"),  # admitted, refused at dispatch: expired
    decision("c2", "C", 100, 300, "served", dispatch_ms=100, actual=250),
    decision("c3", "C", 100, 400, "served", dispatch_ms=150),  # dispatched after the window
]
ACTUAL = {"a1": 999, "a2": 120, "a3": 50}


def test_fairness_report_on_hand_built_decisions() -> None:
    report = fairness_report(DECISIONS, CONFIG, actual_service_tokens=ACTUAL)
    assert report.window_ms == (0.0, 100.0)  # first to last arrival
    a, b, c = report.tenants["A"], report.tenants["B"], report.tenants["C"]
    assert list(report.tenants) == ["A", "B", "C"]  # interactive first, then batch
    # Offered: A 80 + 120 + 50, B 200 + 200 + 100, C 300 + 250 + 400 (c3 arrived at 100,
    # inside the window; it counts as served though it was dispatched after it).
    assert (a.offered_service_tokens, a.served_service_tokens) == (250, 200)
    assert (b.offered_service_tokens, b.served_service_tokens) == (500, 200)
    assert (c.offered_service_tokens, c.served_service_tokens) == (950, 650)
    assert (a.offered_requests, a.served_requests, a.admitted_requests) == (3, 2, 2)
    assert (b.offered_requests, b.served_requests, b.admitted_requests) == (3, 1, 3)
    assert (c.offered_requests, c.served_requests, c.admitted_requests) == (3, 2, 3)
    # Interactive lane served 200 + 200 = 400. Fair: A wants 250 at weight 2, B 500 at weight 1;
    # level 400 / 3 = 133.3 covers A (250 <= 266.7): A = 250, B gets the other 150.
    assert a.fair_share_service_tokens == pytest.approx(250)
    assert b.fair_share_service_tokens == pytest.approx(150)
    assert a.served_over_fair == pytest.approx(200 / 250)
    assert b.served_over_fair == pytest.approx(200 / 150)
    # Jain over 4/5 and 4/3: (32/15)^2 / (2 * (16/25 + 16/9)) = (1024/225) / (1088/225) = 16/17.
    assert report.jain_by_lane["interactive"] == pytest.approx(16 / 17)
    # Batch: C alone gets everything the lane served.
    assert c.fair_share_service_tokens == pytest.approx(650)
    assert c.served_over_fair == pytest.approx(1.0)
    assert report.jain_by_lane["batch"] == pytest.approx(1.0)
    assert a.demand_served == pytest.approx(0.8)
    assert b.demand_served == pytest.approx(0.4)
    assert c.demand_served == pytest.approx(650 / 950)
    # Expired: b2 (queue timeout) and c1 (refused at dispatch); b3 was cancelled.
    assert (a.admitted_then_expired, b.admitted_then_expired, c.admitted_then_expired) == (0, 1, 1)
    assert a.refused_by_reason == {"shed_queue_wait_slo": 1}
    assert b.refused_by_reason == {"cancelled": 1, "shed_queue_timeout": 1}
    assert c.refused_by_reason == {"shed_kv_watermark": 1}
    assert (report.admitted_requests, report.admitted_then_expired) == (2 + 3 + 3, 2)
    assert report.admitted_then_expired_ratio == pytest.approx(2 / 8)
    # Dispatched in [0, 100]: a1 80 + a2 120 + b1 200 + c2 250 (at 100, ends included) = 650;
    # c3 (at 150) is outside. 650 / (10 tokens/ms * 100 ms).
    assert report.dispatched_service_tokens == 650
    assert report.utilisation == pytest.approx(0.65)


def test_fluid_reference_of_the_hand_built_decisions() -> None:
    report = fairness_report(DECISIONS, CONFIG, actual_service_tokens=ACTUAL)
    a, b, c = report.tenants["A"], report.tenants["B"], report.tenants["C"]
    # Interactive lane at 10 tokens/ms while a1 [0, 8], a2 [10, 22] and b1 [30, 50] run: 400.
    # Demand: a1 80 and b1 200 at 0, a2 120 at 10, a3 50 at 20 (refused: until 20 + 420),
    # b2 200 at 40 (expired: until 440), b3 at 50 (cancelled after 0 ms: no demand).
    # A (weight 2) gets 20/3 a ms and B 10/3 while both wait:
    #   [0, 8]    A 53.33 of a1, B 26.67;       [10, 14] A the rest of a1 (26.67), B 40;
    #   [14, 22]  A 53.33 of a2, B 66.67;       [30, 40] A the rest of a2 (66.67), B 100;
    #   [40, 47.5] A a3 (50), B 125;            [47.5, 50] B alone, 150 (50 of b1 short).
    assert a.fluid_reference_service_tokens == pytest.approx(250)
    assert b.fluid_reference_service_tokens == pytest.approx(150)
    assert a.served_over_fluid == pytest.approx(200 / 250)
    assert b.served_over_fluid == pytest.approx(200 / 150)
    assert report.fluid_jain_by_lane["interactive"] == pytest.approx(16 / 17)
    worst = report.fluid_worst_by_lane["interactive"]
    assert worst is not None
    assert worst.tenant_id == "A"
    assert worst.served_over_fluid == pytest.approx(0.8)
    # Batch: C alone gets all 650 the lane served (c1 300 from 60, refused at dispatch, is
    # served first by the fluid server, then c2 and 100 of c3's 400).
    assert c.fluid_reference_service_tokens == pytest.approx(650)
    assert c.served_over_fluid == pytest.approx(1.0)
    assert report.fluid_unused_by_lane == {"interactive": pytest.approx(0), "batch": 0.0}


def test_fairness_report_over_an_explicit_window() -> None:
    report = fairness_report(DECISIONS, CONFIG, actual_service_tokens=ACTUAL, window_ms=(0, 45))
    # Arrivals in [0, 45]: a1-a3, b1, b2. C has none: zeros, no ratio, no batch Jain.
    assert report.tenants["B"].offered_service_tokens == 400
    c = report.tenants["C"]
    assert (c.offered_service_tokens, c.fair_share_service_tokens) == (0, 0.0)
    assert c.served_over_fair is None
    assert c.demand_served is None
    assert report.jain_by_lane["batch"] is None
    # A 250 at weight 2, B 400 at weight 1, 400 served: A 250 (covered by 2 * 133.3), B 150.
    assert report.tenants["B"].fair_share_service_tokens == pytest.approx(150)
    # Dispatched in [0, 45]: 80 + 120 + 200 = 400 over 10 * 45.
    assert report.utilisation == pytest.approx(400 / 450)
    assert report.admitted_requests == 4  # a1, a2, b1, b2 (a3 was refused at admission)
    assert report.admitted_then_expired_ratio == pytest.approx(1 / 4)  # b2


def test_default_window_when_every_request_arrived_at_once() -> None:
    rows = [
        decision("x1", "A", 0, 100, "served", dispatch_ms=0),
        decision("x2", "A", 0, 200, "served", dispatch_ms=10),
    ]
    # Zero-length arrival window: up to the end of the last dispatch, 10 + 200 / 10 = 30 ms.
    report = fairness_report(rows, CONFIG)
    assert report.window_ms == (0.0, 30.0)
    assert report.utilisation == pytest.approx(300 / (RATE * 30))
    # Nothing dispatched after the start: one millisecond.
    refused = [decision("y1", "A", 5, 100, "admission")]
    assert fairness_report(refused, CONFIG).window_ms == (5.0, 6.0)


def test_no_decisions_shows_the_configured_tenants_with_zeros() -> None:
    report = fairness_report([], CONFIG)
    assert report.window_ms == (0.0, 1.0)
    assert report.utilisation == 0.0
    assert set(report.tenants) == {"A", "B", "C"}
    assert report.jain_by_lane == {"interactive": None, "batch": None}
    assert report.admitted_then_expired_ratio is None


def test_tenants_absent_from_the_config_weigh_one() -> None:
    empty = Config(PolicyConfig(service_tokens_per_ms=RATE), ())
    report = fairness_report(DECISIONS, empty, actual_service_tokens=ACTUAL)
    assert report.tenants["A"].weight == 1.0
    assert report.tenants["C"].priority_class == "batch"
    # Equal weights now: level 400 / 2 = 200 is below both demands (250, 500): 200 each.
    assert report.tenants["A"].fair_share_service_tokens == pytest.approx(200)
    assert report.tenants["B"].fair_share_service_tokens == pytest.approx(200)
    assert report.jain_by_lane["interactive"] == pytest.approx(1.0)


@pytest.mark.parametrize("window", [(10.0, 10.0), (10.0, 5.0), (0.0, math.inf)])
def test_a_bad_window_is_refused(window: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="window: END_MS must be greater than START_MS"):
        fairness_report(DECISIONS, CONFIG, window_ms=window)


def test_format_fairness_has_one_row_per_tenant() -> None:
    text = format_fairness(fairness_report(DECISIONS, CONFIG, actual_service_tokens=ACTUAL))
    lines = text.splitlines()
    assert lines[0].startswith("  fairness over 0.00..100.00 ms: utilisation 0.6500;")
    assert "admitted then expired 2/8 (25.00%)" in lines[0]
    assert lines[1] == (
        "  Jain vs fluid reference: interactive 0.9412, batch 1.0000; worst served/fluid: "
        "interactive A 0.8000, batch C 1.0000"
    )
    assert lines[2] == "  Jain vs windowed max-min share: interactive 0.9412, batch 1.0000"
    rows = {line.split()[0]: line.split() for line in lines[4:]}
    assert set(rows) == {"A", "B", "C"}
    # served/offered, served, offered, fluid reference, served/fluid, windowed share,
    # served/windowed share, demand served (the fluid figures: test_fluid_reference_of_...).
    assert rows["B"][3:11] == [
        "1/3", "200", "500", "150.0", "1.3333", "150.0", "1.3333", "40.0%"
    ]  # fmt: skip
    assert rows["B"][-2:] == ["cancelled=1", "shed_queue_timeout=1"]


# ---------------------------------------------------------------------------------------------
# Reading decision records back


def test_read_decisions_reads_back_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    observed = decision("b9", "B", 40, 200, "timeout")
    observed.observed = {"max_wait_ms": 420.0}
    observed.retry_after_ms = 0.0
    written = {"one": DECISIONS[:4], "two": [*DECISIONS[4:], observed]}
    write_decisions(path, written)
    assert read_decisions(path) == written


def test_read_decisions_reads_the_sidecar_recorders_lines(tmp_path: Path) -> None:
    # The live shape as the record writer really writes it (not a copy of it): decision fields plus
    # the request's tokens and the reported usage; the outcome is the status the client saw.
    request = Request("r1", "chat", 12.5, 300, 40, "interactive")
    dispatched = Decision("r1", "chat", "interactive", 200, "admitted", "dispatch", 460, 12.5)
    dispatched.dispatch_ms = 20.0
    dispatched.actual_service_tokens = 436
    line = encode_record(
        request,
        dispatched,
        "tokenfair",
        status_code=502,
        reason="upstream_error",
        usage=Usage(prompt_tokens=300, completion_tokens=34, ttft_ms=30.0, e2e_ms=80.0),
    )
    path = tmp_path / "sidecar.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    [read] = read_decisions(path)["tokenfair"]
    assert (read.status_code, read.reason, read.gate) == (502, "upstream_error", "dispatch")
    assert (read.dispatch_ms, read.actual_service_tokens, read.ttft_ms) == (20.0, 436, 30.0)
    assert read.service_tokens == 460


# ---------------------------------------------------------------------------------------------
# The commands

LESSON_TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: chat-pro}
spec: {tenantId: tenant_chat_pro, weight: 2, burstServiceTokens: 48000,
       sustainedServiceTokensPerSecond: 180000, priorityClass: interactive}
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: ide-assist}
spec: {tenantId: tenant_ide_assist, weight: 1.5, burstServiceTokens: 36000,
       sustainedServiceTokensPerSecond: 140000, priorityClass: interactive}
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: batch-rag}
spec: {tenantId: tenant_batch_rag, weight: 1, burstServiceTokens: 28000,
       sustainedServiceTokensPerSecond: 60000, priorityClass: batch}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--format", "json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.fixture
def simulated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, Any]]:
    """``tokenfair simulate --scenario noisy-neighbor --records``: the file and the JSON report."""
    records = tmp_path / "records.jsonl"
    report = run_json(capsys, "simulate", "--scenario", "noisy-neighbor", "--records", records)
    return records, report


def test_simulate_puts_fairness_beside_the_lesson_comparison(
    simulated: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, report = simulated
    assert set(report) == {"experiment", "decode_weight", "comparison", "fairness"}
    assert list(report["fairness"]) == list(report["comparison"])
    for summary in report["comparison"].values():
        assert "fairness" not in summary
    code, out, _ = run(capsys, "simulate", "--scenario", "noisy-neighbor")
    assert code == 0
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 3
    for block in blocks:
        assert "\n  fairness over 0.00..350.00 ms: utilisation " in block


def test_report_on_simulate_records_matches_the_simulator(
    tmp_path: Path,
    simulated: tuple[Path, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    records, simulation = simulated
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(LESSON_TENANTS_YAML, encoding="utf-8")
    report = run_json(capsys, "report", "--records", records, "--tenants", tenants)
    # Grouped by policy, in file order; the same numbers the simulator printed.
    assert report["fairness"] == simulation["fairness"]
    lesson_drr = report["fairness"]["service_token_drr_with_admission"]
    # Independently: the fixture's last arrival is chat-23 at 5 + 23 * 15 = 350 ms; the lesson's
    # policy admits 4 of the 18 batch requests of 3200 + 4 * 350 = 4600, all 24 chats of
    # 280 + 4 * 90 = 640 and all 18 completions of 420 + 4 * 60 = 660.
    assert lesson_drr["window_ms"] == [0.0, 350.0]
    batch = lesson_drr["tenants"]["tenant_batch_rag"]
    assert (batch["offered_service_tokens"], batch["served_service_tokens"]) == (82800, 18400)
    assert batch["refused_by_reason"] == {"shed_kv_watermark": 14}
    assert batch["demand_served"] == pytest.approx(4 / 18, abs=1e-4)
    chat = lesson_drr["tenants"]["tenant_chat_pro"]
    assert chat["offered_service_tokens"] == chat["served_service_tokens"] == 24 * 640
    # Utilisation from the records themselves: what was dispatched by 350 ms over 45 * 350.
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    for policy, fairness in report["fairness"].items():
        dispatched = sum(
            r["service_tokens"]
            for r in rows
            if r["policy"] == policy and r["dispatch_ms"] is not None and r["dispatch_ms"] <= 350
        )
        assert fairness["utilisation"] == pytest.approx(dispatched / (45 * 350), abs=1e-4)
    # Without --tenants every weight is 1: chat and ide split the interactive lane equally.
    unweighted = run_json(capsys, "report", "--records", records)["fairness"]["tokenfair"]
    assert {t["weight"] for t in unweighted["tenants"].values()} == {1.0}
    code, out, _ = run(capsys, "report", "--records", records)
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("policy ")] == [
        "policy request_count_no_admission: 60 records",
        "policy service_token_drr_with_admission: 60 records",
        "policy tokenfair: 60 records",
    ]


def live_record(
    request_id: str,
    tenant_id: str,
    lane: str,
    arrival_ms: float,
    estimate: int,
    status: int,
    reason: str,
    gate: str,
    *,
    dispatch_ms: float | None = None,
    actual: int | None = None,
) -> dict[str, object]:
    """A line as the sidecar's record writer writes it (decision fields + the request's tokens)."""
    record: dict[str, object] = {
        "policy": "tokenfair",
        "request_id": request_id,
        "tenant_id": tenant_id,
        "priority_class": lane,
        "status_code": status,
        "reason": reason,
        "gate": gate,
        "service_tokens": estimate,
        "arrival_ms": arrival_ms,
        "kv_occupancy_ratio": 0.1,
        "queue_wait_ms": 0.0 if dispatch_ms is None else dispatch_ms - arrival_ms,
        "ttft_ms": 0.0,
        "dispatch_ms": dispatch_ms,
        "retry_after_ms": None,
        "actual_service_tokens": actual,
        "observed": {},
        "prefill_tokens": 100,
        "decode_tokens": 10,
    }
    if actual is not None:
        record |= {"actual_prefill_tokens": 100, "actual_decode_tokens": 9, "e2e_ms": 50.0}
    return record


LIVE = [
    live_record("c1", "chat", "interactive", 0, 640, 200, "admitted", "dispatch",
                dispatch_ms=0, actual=600),
    live_record("c2", "chat", "interactive", 100, 640, 200, "admitted", "dispatch",
                dispatch_ms=120, actual=700),
    live_record("c3", "chat", "interactive", 200, 640, 429, "shed_tenant_token_quota",
                "admission"),
    live_record("i1", "ide", "interactive", 50, 660, 200, "admitted", "dispatch",
                dispatch_ms=60, actual=660),
    # Dispatched, then the upstream timed out: settled at the estimate, not served.
    live_record("i2", "ide", "interactive", 150, 660, 502, "upstream_error", "dispatch",
                dispatch_ms=160, actual=660),
    live_record("i3", "ide", "interactive", 250, 660, 499, "cancelled", "queue"),
    live_record("b1", "batch", "batch", 0, 4600, 200, "admitted", "dispatch",
                dispatch_ms=200, actual=4000),
    live_record("b2", "batch", "batch", 300, 4600, 503, "draining", "queue"),
]  # fmt: skip
LIVE_TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TokenfairConfig
sidecar: {listen: "127.0.0.1:8080"}
policy: {serviceTokensPerMs: 45}
tenants:
  - {tenantId: chat, weight: 2, burstServiceTokens: 9000, sustainedServiceTokensPerSecond: 9000,
     priorityClass: interactive}
  - {tenantId: ide, weight: 1, burstServiceTokens: 9000, sustainedServiceTokensPerSecond: 9000,
     priorityClass: interactive}
  - {tenantId: batch, weight: 1, burstServiceTokens: 9000, sustainedServiceTokensPerSecond: 9000,
     priorityClass: batch}
"""


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_report_on_live_sidecar_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = write_jsonl(tmp_path / "sidecar.jsonl", LIVE)
    tenants = tmp_path / "sidecar.yaml"  # the sidecar's own config file, sidecar: section and all
    tenants.write_text(LIVE_TENANTS_YAML, encoding="utf-8")
    report = run_json(capsys, "report", "--records", records, "--tenants", tenants)
    assert list(report["fairness"]) == ["tokenfair"]
    fairness = report["fairness"]["tokenfair"]
    assert fairness["window_ms"] == [0.0, 300.0]
    chat, ide, batch = (fairness["tenants"][t] for t in ("chat", "ide", "batch"))
    # Sizes are the recorded actual tokens, the estimate where there are none (c3, i3, b2).
    # chat: offered 600 + 700 + 640, served 600 + 700; ide: 660 * 3, served 660 (i1).
    assert (chat["offered_service_tokens"], chat["served_service_tokens"]) == (1940, 1300)
    assert (ide["offered_service_tokens"], ide["served_service_tokens"]) == (1980, 660)
    assert (batch["offered_service_tokens"], batch["served_service_tokens"]) == (8600, 4000)
    # Interactive served 1300 + 660 = 1960. chat wants 1940 at weight 2, ide 1980 at weight 1:
    # level 1960 / 3 = 653.3 covers neither (chat would need 970), so chat 1306.67, ide 653.33.
    assert chat["fair_share_service_tokens"] == pytest.approx(1960 * 2 / 3, abs=0.01)
    assert ide["fair_share_service_tokens"] == pytest.approx(1960 / 3, abs=0.01)
    assert chat["served_over_fair"] == pytest.approx(1300 / (1960 * 2 / 3), abs=1e-4)
    assert ide["served_over_fair"] == pytest.approx(660 / (1960 / 3), abs=1e-4)
    # Against the fluid reference (serviceTokensPerMs 45): the lane served c1 over [0, 13.3]
    # while only chat waited, i1 over [60, 74.7] while only ide waited (arrived at 50), c2 over
    # [120, 135.6] while only chat waited (i2 came at 150); nothing after. So chat's reference is
    # its 1300 and ide's its 660: both exactly served, Jain 1 (windowed: 0.995 and 1.010).
    assert chat["fluid_reference_service_tokens"] == pytest.approx(1300)
    assert ide["fluid_reference_service_tokens"] == pytest.approx(660)
    assert (chat["served_over_fluid"], ide["served_over_fluid"]) == (1.0, 1.0)
    assert batch["fluid_reference_service_tokens"] == pytest.approx(4000)  # b1, alone
    assert fairness["fluid_jain_by_lane"] == {"interactive": 1.0, "batch": 1.0}
    assert fairness["fluid_worst_by_lane"]["batch"] == {
        "tenant_id": "batch",
        "served_over_fluid": 1.0,
    }
    assert fairness["fluid_unused_service_tokens_by_lane"] == {"interactive": 0.0, "batch": 0.0}
    # i2 (502 after dispatch) expired; i3 (cancelled) and b2 (drained) did not.
    assert (chat["admitted_then_expired"], ide["admitted_then_expired"]) == (0, 1)
    assert batch["admitted_then_expired"] == 0
    assert ide["refused_by_reason"] == {"cancelled": 1, "upstream_error": 1}
    assert batch["refused_by_reason"] == {"draining": 1}
    # Admitted: all but c3 (7); expired 1.
    assert (fairness["admitted_requests"], fairness["admitted_then_expired"]) == (7, 1)
    assert fairness["admitted_then_expired_ratio"] == pytest.approx(1 / 7, abs=1e-4)
    # Dispatched in [0, 300]: 600 + 700 + 660 + 660 (i2 ran) + 4000 = 6620 over 45 * 300.
    assert fairness["dispatched_service_tokens"] == 6620
    assert fairness["utilisation"] == pytest.approx(6620 / 13500, abs=1e-4)
    # --window: only arrivals in [100, 200] (c2, c3, i2); dispatches at 120, 160, 200.
    narrow = run_json(capsys, "report", "--records", records, "--window", "100:200")
    narrow_fairness = narrow["fairness"]["tokenfair"]
    assert narrow_fairness["window_ms"] == [100.0, 200.0]
    assert narrow_fairness["tenants"]["chat"]["offered_service_tokens"] == 700 + 640
    assert narrow_fairness["utilisation"] == pytest.approx((700 + 660 + 4000) / 4500, abs=1e-4)
    code, out, _ = run(capsys, "report", "--records", records, "--tenants", tenants)
    assert code == 0
    assert out.startswith("policy tokenfair: 8 records\n  fairness over 0.00..300.00 ms:")


def test_report_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = write_jsonl(tmp_path / "sidecar.jsonl", LIVE)
    picture = tmp_path / "fair.png"
    code, _, err = run(capsys, "report", "--records", records, "--plot", picture)
    assert code == 0, err
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def bad_report(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> str:
    code, out, err = run(capsys, "report", *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tokenfair report: error: ")
    return lines[0]


def test_a_missing_records_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert f"{missing}: cannot read" in bad_report(capsys, "--records", missing)


def with_line(
    tmp_path: Path, number: int, line: str | Mapping[str, object]
) -> tuple[Path, list[str]]:
    lines = [json.dumps(row) for row in LIVE]
    lines[number - 1] = line if isinstance(line, str) else json.dumps(line)
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, lines


def test_a_bad_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = with_line(tmp_path, 2, '{"request_id": "c2", ')
    assert f"{path}:2: invalid JSON" in bad_report(capsys, "--records", path)


def test_a_missing_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = {k: v for k, v in LIVE[2].items() if k != "gate"}
    path, _ = with_line(tmp_path, 3, row)
    assert f"{path}:3: missing field(s) gate" in bad_report(capsys, "--records", path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("status_code", "200", "status_code must be an integer >= 0"),
        ("arrival_ms", -5, "arrival_ms must be a number >= 0 and <= 1e+15"),
        ("arrival_ms", 1e20, "arrival_ms must be a number >= 0 and <= 1e+15"),
        ("actual_service_tokens", 1.5, "actual_service_tokens must be an integer >= 0"),
        ("priority_class", "realtime", "priority_class must be one of interactive, batch"),
        ("observed", {"x": "y"}, "observed.x must be a number"),
        ("surprise", 1, "unknown field(s) surprise"),
    ],
)
def test_a_bad_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object, message: str
) -> None:
    path, _ = with_line(tmp_path, 4, {**LIVE[3], field: value})
    assert f"{path}:4: {message}" in bad_report(capsys, "--records", path)


def test_a_duplicate_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = with_line(tmp_path, 5, LIVE[0])
    line = bad_report(capsys, "--records", path)
    assert f"{path}:5: duplicate request_id 'c1'" in line


@pytest.mark.parametrize("window", ["100", "a:b", "200:100", "5:5"])
def test_a_bad_window(tmp_path: Path, capsys: pytest.CaptureFixture[str], window: str) -> None:
    records = write_jsonl(tmp_path / "sidecar.jsonl", LIVE)
    line = bad_report(capsys, "--records", records, "--window", window)
    assert "--window: " in line
    assert repr(window) in line


def test_a_bad_tenants_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = write_jsonl(tmp_path / "sidecar.jsonl", LIVE)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(LIVE_TENANTS_YAML.replace("weight: 1,", "weight: 0,", 1), encoding="utf-8")
    line = bad_report(capsys, "--records", records, "--tenants", tenants)
    assert str(tenants) in line
    assert "weight: must be > 0" in line
