"""The scaling signal (``core/demand.py``) and ``tokenfair simulate --autoscale``
(``sim/autoscale.py``), on a virtual clock.

Behaviours: on a trace whose offered load steps 0.5 C -> 2 C -> 0.5 C the signal is below 1
before the step, rises above 1 within 2 s of it, stays above 1 while the load is 2 C, and falls
below 1 within 2 s of the step down; it reads about the offered load over capacity (0.5, 2).
Refusals for a tenant's budget are not demand; a request that expires in the queue is counted
once. The autoscaled replay of the ``load-step`` scenario meets the interactive SLO with fewer
replica-seconds than the smallest fixed count that meets it (which one replica does not).
The CLI names a bad flag and its rule.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Decision
from tokenfair.core.demand import DemandGauge
from tokenfair.core.jobs import LANE_INTERACTIVE
from tokenfair.sim.autoscale import Autoscaler, Slo, compare, replay_pool, step_trace
from tokenfair.sim.scenarios import lesson_config, load_step

STEP_UP_MS, STEP_DOWN_MS = 10_000.0, 20_000.0


def sampled_signal() -> list[tuple[float, float, float]]:
    config = lesson_config()
    trace = step_trace(
        config.policy.service_tokens_per_ms, [(0.5, STEP_UP_MS), (2.0, 10_000), (0.5, 10_000)]
    )
    samples: list[tuple[float, float, float]] = []
    replay_pool(config, trace, "tokenfair", Slo(420.0), fixed=1, samples=samples,
                sample_every_ms=50.0)  # fmt: skip
    return samples


def test_the_signal_follows_a_step_of_the_load_within_two_seconds() -> None:
    samples = sampled_signal()
    assert samples[-1][0] > STEP_DOWN_MS + 2_000
    before = [s for t, s, _ in samples if 1_000 <= t < STEP_UP_MS]
    high = [s for t, s, _ in samples if STEP_UP_MS + 2_000 <= t < STEP_DOWN_MS]
    after = [s for t, s, _ in samples if t >= STEP_DOWN_MS + 2_000]
    assert max(before) < 1
    assert min(high) > 1
    assert max(after) < 1
    rise_ms = next(t for t, s, _ in samples if t >= STEP_UP_MS and s > 1) - STEP_UP_MS
    fall_ms = next(t for t, s, _ in samples if t >= STEP_DOWN_MS and s < 1) - STEP_DOWN_MS
    assert rise_ms <= 2_000, rise_ms
    assert fall_ms <= 2_000, fall_ms
    # It reads the offered load over capacity, not just "busy": 0.5 and 2 within a tenth.
    assert all(abs(s - 0.5) < 0.1 for s in before)
    assert all(abs(s - 2.0) < 0.1 for s in high)
    assert all(s == 0.0 for _, _, s in samples)  # no batch work offered


def decision(reason: str, gate: str, tokens: int = 1000) -> Decision:
    return Decision("r", "t", "interactive", 429, reason, gate, tokens, 0.0)


def test_the_signal_counts_capacity_refusals_at_admission_only() -> None:
    gauge = DemandGauge((1000.0, 5000.0), 1.0)  # R * W = 1000 tokens for the interactive lane
    gauge.refused(decision("shed_tenant_token_quota", "admission"), 0.0)  # a budget: no demand
    assert gauge.ratio(LANE_INTERACTIVE, 0, 1.0) == 0.0
    gauge.refused(decision("shed_queue_wait_slo", "admission", 500), 0.0)
    assert gauge.ratio(LANE_INTERACTIVE, 0, 1.0) == 0.5
    gauge.admitted(LANE_INTERACTIVE, 300, 10.0)
    gauge.refused(decision("shed_queue_timeout", "queue", 300), 20.0)  # counted when admitted
    assert gauge.ratio(LANE_INTERACTIVE, 0, 30.0) == 0.8
    assert gauge.ratio(LANE_INTERACTIVE, 0, 1000.0) == 0.3  # the first refusal left the window
    assert gauge.ratio(LANE_INTERACTIVE, 0, 1010.0) == 0.0
    # The backlog term: 1200 queued tokens read 1.2 whatever was offered lately.
    assert gauge.ratio(LANE_INTERACTIVE, 1200, 1010.0) == 1.2
    running = Decision("r", "t", "interactive", 200, "admitted", "dispatch", 400, 0.0)
    gauge.started(running)
    assert gauge.ratio(LANE_INTERACTIVE, 1200, 1010.0) == 1.6
    gauge.ended(running)
    assert gauge.ratio(LANE_INTERACTIVE, 0, 1010.0) == 0.0


def test_the_window_stays_bounded_without_reads() -> None:
    # A sidecar nobody scrapes: admissions alone must drop what left the window.
    gauge = DemandGauge((1000.0, 5000.0), 1.0)
    for n in range(10_000):
        gauge.admitted(LANE_INTERACTIVE, 10, n * 10.0)  # one every 10 ms, over 100 s
    assert len(gauge._offered[LANE_INTERACTIVE]) <= 1000 // 10 + 1
    # What is left is exactly the last wait limit's: (99,990 - 1000, 99,990], 100 offers.
    assert gauge.offered_tokens(LANE_INTERACTIVE, 99_990.0) == 100 * 10


def test_the_autoscaled_replay_meets_the_slo_for_fewer_replica_seconds() -> None:
    config, trace = load_step()
    slo = Slo(config.policy.max_interactive_wait_ms, 0.01)
    scaled, fixed = compare(config, trace, "tokenfair", Autoscaler(1, 8, 0.8, 500.0), slo)
    assert not fixed[0].meets_slo  # one replica cannot carry the 2 C phase
    cheapest = fixed[-1]
    assert cheapest.meets_slo
    assert cheapest.max_replicas >= 2
    assert scaled.meets_slo
    assert scaled.replica_seconds < cheapest.replica_seconds
    assert scaled.max_replicas > 1
    assert scaled.replicas[-1][1] == 1
    # Replica-seconds are the integral of the count: fixed n over the span is n * span.
    assert cheapest.replica_seconds == pytest.approx(
        cheapest.max_replicas * cheapest.span_ms / 1000
    )


def test_a_scale_up_delay_costs_misses() -> None:
    config, trace = load_step()
    slo = Slo(config.policy.max_interactive_wait_ms, 0.01)
    prompt = replay_pool(config, trace, "tokenfair", slo, autoscaler=Autoscaler(1, 8, 0.8, 500))
    slow = replay_pool(config, trace, "tokenfair", slo,
                       autoscaler=Autoscaler(1, 8, 0.8, 500, scale_up_delay_ms=5000))  # fmt: skip
    assert slow.misses > prompt.misses


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenfair.cli", "simulate", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_the_cli_reports_both_runs_and_names_bad_flags() -> None:
    done = run_cli("--scenario", "load-step", "--autoscale", "1:4", "--scale-interval-ms", "500",
                   "--format", "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    runs = {run["run"]: run for run in report["runs"]}
    assert runs["autoscaled"]["meets_slo"]
    assert runs["fixed 2"]["meets_slo"]
    assert runs["autoscaled"]["replica_seconds"] < runs["fixed 2"]["replica_seconds"]
    assert report["autoscaled_over_fixed_replica_seconds"] < 1
    for flags, message in [
        (["--autoscale", "4:1"], "--autoscale: must be MIN:MAX with 1 <= MIN <= MAX"),
        (["--autoscale", "1"], "--autoscale: must be MIN:MAX, two integers"),
        (["--autoscale", "1:2", "--scale-target", "0"], "--scale-target: must be a number > 0"),
        (["--autoscale", "1:2", "--slo-miss-budget", "1"], "--slo-miss-budget: must be in"),
        (["--autoscale", "1:2", "--policy", "tokenfair", "--policy", "tokenfair"],
         "--autoscale: give one --policy"),
        (["--autoscale", "1:2", "--set", "maxBatchRequests=4"],
         "--autoscale: the pool is modelled as serial servers (maxBatchRequests 1"),
    ]:  # fmt: skip
        done = run_cli("--scenario", "load-step", *flags)
        assert done.returncode != 0
        assert message in done.stderr, done.stderr


def test_every_request_is_decided_once_in_every_run() -> None:
    # Another config (one tenant): each run decides every interactive request of the trace.
    tenants = (TenantConfig("a", 1.0, 100_000, 1_000_000, "interactive"),)
    config = build_config(PolicyConfig(), tenants)
    trace = step_trace(45.0, [(0.5, 5_000), (2.0, 5_000), (0.5, 5_000)], tenants=("a",))
    scaled, fixed = compare(config, trace, "tokenfair", Autoscaler(1, 4, 0.8, 250.0),
                            Slo(420.0, 0.02))  # fmt: skip
    assert all(run.interactive_requests == len(trace) for run in (scaled, *fixed))
