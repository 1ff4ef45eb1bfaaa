"""Parity with the reference lesson: the core's lesson policies decide exactly as the lesson's lab.

Behaviours under test:

* ``simulate()`` with ``request_count_no_admission`` and ``service_token_drr_with_admission`` on
  the ``noisy-neighbor`` scenario reproduces the published ``comparison`` field for field, except
  the DRR policy's ``peak_kv_occupancy_ratio`` (ours: peak of admitted work; published: a refusal's
  occupancy clamped to the watermark); its first 10 decisions are the published
  ``sample_decisions``, refusals carrying the attempted, unclamped occupancy;
* the oracle (``lesson_reference``, an independent naive restatement of the lab) reproduces the
  published result exactly, 0.65 included: the published peak is the clamp;
* on random traces and random policy parameters both policies make the oracle's decisions
  (id, status, reason, TTFT, queue wait, in the same order; occupancy equal, or unclamped >= the
  lab's clamp for admission KV refusals);
* a budget refusal leaves the tenant's bucket refilled to the arrival time only, as in the lab;
* the lesson's own unit checks: KV collapse without admission at 1024 blocks, full work charged to
  back-to-back batch requests, service tokens at decode weight 4.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lesson_bridge import DRR, NAIVE, oracle_inputs, run_oracle
from lesson_reference import (
    Klass,
    OracleOutcome,
    OracleRequest,
    lab_summary,
    run_service_token_drr,
    service_tokens,
)
from repo_paths import TEST_DATA

from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import Decision, Request
from tokenfair.core.cost import CostModel
from tokenfair.sim.report import summarize
from tokenfair.sim.scenarios import noisy_neighbor
from tokenfair.sim.simulator import simulate

PUBLISHED: Final[dict[str, Any]] = json.loads(
    (TEST_DATA / "lesson_published_result.json").read_text(encoding="utf-8")
)


def decision_row(d: Decision | OracleOutcome) -> tuple[str, int, str, float, float]:
    return (d.request_id, d.status_code, d.reason, d.ttft_ms, d.queue_wait_ms)


# -- (a) the published figures ----------------------------------------------------------------


def test_oracle_reproduces_the_published_result_exactly() -> None:
    config, requests = noisy_neighbor()
    for policy in (NAIVE, DRR):
        assert lab_summary(run_oracle(policy, config, requests)) == PUBLISHED["comparison"][policy]
    sample = [asdict(o) for o in run_oracle(DRR, config, requests)[:10]]
    assert sample == PUBLISHED["sample_decisions"]


def test_simulate_reproduces_the_published_comparison() -> None:
    config, requests = noisy_neighbor()
    assert summarize(simulate(config, requests, NAIVE)) == PUBLISHED["comparison"][NAIVE]

    ours = summarize(simulate(config, requests, DRR))
    expected = dict(PUBLISHED["comparison"][DRR])
    # The one deliberate difference: the published 0.65 is batch-04's refusal clamped to the
    # batch watermark, not an occupancy anything reached. Ours is the peak of admitted work,
    # which the independent oracle computes from its own admitted outcomes: 666/1600 blocks.
    assert expected["peak_kv_occupancy_ratio"] == 0.65
    oracle = run_oracle(DRR, config, requests)
    admitted_peak = max(o.kv_occupancy_ratio for o in oracle if o.status_code == 200)
    assert admitted_peak == round(666 / 1600, 4) == 0.4163
    expected["peak_kv_occupancy_ratio"] = admitted_peak
    assert ours == expected


def test_simulate_reproduces_the_published_sample_decisions() -> None:
    config, requests = noisy_neighbor()
    ours = simulate(config, requests, DRR)[:10]
    published = PUBLISHED["sample_decisions"]
    assert [decision_row(d) for d in ours] == [
        (p["request_id"], p["status_code"], p["reason"], p["ttft_ms"], p["queue_wait_ms"])
        for p in published
    ]
    assert [d.service_tokens for d in ours] == [p["service_tokens"] for p in published]
    watermark = config.policy.batch_kv_watermark
    for d, p in zip(ours, published, strict=True):
        if d.admitted:
            assert d.kv_occupancy_ratio == p["kv_occupancy_ratio"]
        else:
            # The lab wrote min(attempted, watermark); we keep the attempted value.
            assert p["kv_occupancy_ratio"] == watermark
            assert d.kv_occupancy_ratio > watermark
            assert d.observed["attempted_kv_occupancy"] > watermark
    # batch-04 at t=40, judged at 102.22 ms (batch-00 running): resident batch-00 222 blocks
    # (ceil(3550/16)); queued interactive chat-00..02 3*24 (ceil(370/16)) + ide-00..01 2*30
    # (ceil(480/16)) = 132; queued batch batch-01..03 3*222 = 666; its own 222 -> 1242 blocks.
    assert ours[1].request_id == "batch-04"
    assert ours[1].kv_occupancy_ratio == round((222 + 132 + 666 + 222) / 1600, 4)


# -- (b) random traces against the oracle -----------------------------------------------------


@st.composite
def lesson_cases(draw: st.DrawFn) -> tuple[Config, list[Request]]:
    tenant_count = draw(st.integers(1, 4))
    tenants = [
        TenantConfig(
            f"t{i}",
            draw(st.integers(1, 40)) / 10,
            draw(st.integers(1, 60_000)),
            float(draw(st.integers(1, 200_000))),
            draw(st.sampled_from(["interactive", "batch"])),
        )
        for i in range(tenant_count)
    ]
    interactive_mark = draw(st.integers(5, 100)) / 100
    policy = PolicyConfig(
        total_kv_blocks=draw(st.integers(16, 5000)),
        interactive_kv_watermark=interactive_mark,
        batch_kv_watermark=draw(st.integers(1, int(interactive_mark * 100))) / 100,
        max_interactive_wait_ms=float(draw(st.integers(1, 2000))),
        max_batch_wait_ms=float(draw(st.integers(1, 8000))),
        decode_weight=float(draw(st.integers(1, 6))),
        base_quantum_tokens=draw(st.integers(1, 3000)),
        service_tokens_per_ms=draw(st.integers(5, 1000)) / 10,
    )
    arrival_ms = 0
    requests = []
    for i in range(draw(st.integers(1, 60))):
        # Gaps of 0 make simultaneous arrivals; long gaps let the server drain.
        arrival_ms += draw(st.sampled_from([0, 0, 1, 5, 20, 100, 500]))
        large = draw(st.booleans()) and draw(st.booleans())
        klass: Klass = draw(st.sampled_from(["interactive", "batch"]))
        requests.append(
            Request(
                f"r{i:03d}",
                draw(st.sampled_from(tenants)).tenant_id,
                arrival_ms,
                draw(st.integers(1, 20_000 if large else 2_000)),
                draw(st.integers(0, 3_000 if large else 300)),
                klass,
            )
        )
    return build_config(policy, tenants), requests


@pytest.mark.parametrize("policy", [NAIVE, DRR])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=lesson_cases())
def test_same_decisions_as_the_oracle(policy: str, case: tuple[Config, list[Request]]) -> None:
    config, requests = case
    expected = run_oracle(policy, config, requests)
    ours = simulate(config, requests, policy)
    assert [decision_row(d) for d in ours] == [decision_row(o) for o in expected]
    for d, o in zip(ours, expected, strict=True):
        assert d.service_tokens == o.service_tokens
        if d.reason == "shed_kv_watermark" and d.queue_wait_ms == 0.0 and d.ttft_ms == 0.0:
            # Refused at admission: the lab clamped to the watermark, we keep the attempt.
            assert d.kv_occupancy_ratio >= o.kv_occupancy_ratio
        else:
            assert d.kv_occupancy_ratio == o.kv_occupancy_ratio


def test_budget_refusal_does_not_refill_to_the_clock() -> None:
    # One tenant: burst 100 tokens, refill 1000 tokens/s = 1 token/ms; the server does
    # 0.1 service tokens/ms. r0 (interactive, 100 tokens) is debited to 0 and runs 0..1000 ms.
    # r1 (batch, 200 > bucket) and r2 (batch, 60) are judged when the clock reaches 1000 ms,
    # with buckets refilled to their *arrival*: 10 tokens at 10 ms (< 200, refused), 20 tokens
    # at 20 ms (< 60, refused). Refilling to the clock would give 100 tokens and admit r2.
    config = build_config(
        PolicyConfig(service_tokens_per_ms=0.1), [TenantConfig("t", 1.0, 100, 1000.0, "batch")]
    )
    requests = [
        Request("r0", "t", 0, 100, 0, "interactive"),
        Request("r1", "t", 10, 200, 0, "batch"),
        Request("r2", "t", 20, 60, 0, "batch"),
    ]
    oracle = run_oracle(DRR, config, requests)
    assert [o.reason for o in oracle] == ["admitted", *["shed_tenant_token_quota"] * 2]
    ours = simulate(config, requests, DRR)
    assert [decision_row(d) for d in ours] == [decision_row(o) for o in oracle]


# -- (c) the lesson's other checks ------------------------------------------------------------


def test_kv_collapse_without_admission_at_1024_blocks() -> None:
    config, requests = noisy_neighbor()
    small = build_config(PolicyConfig(total_kv_blocks=1024), config.tenants)
    naive = summarize(simulate(small, requests, NAIVE))
    guarded = summarize(simulate(small, requests, DRR))
    # Without admission the schedule does not depend on the KV size: the published naive peak,
    # 0.7275 of 1600 blocks, is 1164 blocks; 1164/1024 > 1.
    assert naive["peak_kv_occupancy_ratio"] == round(1164 / 1024, 4)
    assert naive["peak_kv_occupancy_ratio"] > 1.0
    assert guarded["peak_kv_occupancy_ratio"] <= 0.90
    assert guarded["shed_429_requests"] > 0
    # The oracle agrees (its peak includes clamped refusals, still <= the watermark).
    tenants, trace, knobs = oracle_inputs(small, requests)
    assert (
        lab_summary(run_service_token_drr(tenants, trace, knobs))["shed_429_requests"]
        == (guarded["shed_429_requests"])
    )


def test_back_to_back_batch_requests_are_charged_their_full_work() -> None:
    # 4800 + 4*300 = 6000 service tokens each; at 30 tokens/ms the first runs 200 ms, so the
    # second (arrived at 0 too) starts at 200 ms. No gate binds: bucket 100000 >= 2*6000,
    # ceil(5100/16) = 319 of 100000 blocks, predicted wait 6000/30 = 200 <= 3500 ms.
    config = build_config(
        PolicyConfig(total_kv_blocks=100_000, service_tokens_per_ms=30.0),
        [TenantConfig("tenant", 1.0, 100_000, 100_000.0, "batch")],
    )
    requests = [Request(rid, "tenant", 0, 4800, 300, "batch") for rid in ("a", "b")]
    ours = simulate(config, requests, DRR)
    assert [(d.request_id, d.reason) for d in ours] == [("a", "admitted"), ("b", "admitted")]
    assert ours[1].queue_wait_ms == 6000 / 30 == 200.0
    assert [decision_row(o) for o in run_oracle(DRR, config, requests)] == [
        decision_row(d) for d in ours
    ]


def test_service_tokens_weight_decode_four_times_prefill() -> None:
    cost = CostModel(decode_weight=4.0)
    assert cost.service_tokens(250, 80) == 250 + 4 * 80 == 570
    assert cost.service_tokens(3200, 350) == 3200 + 4 * 350 == 4600
    chat = OracleRequest("c", "t", 0, 250, 80, "interactive")
    rag = OracleRequest("r", "t", 0, 3200, 350, "batch")
    assert (service_tokens(chat, 4), service_tokens(rag, 4)) == (570, 4600)
