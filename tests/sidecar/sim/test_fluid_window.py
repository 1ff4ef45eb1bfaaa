"""The live fluid-reference signal (``tokenfair.sim.fluid_window``): the report's fluid
reference kept up over a sliding window as decisions come.

Behaviours under test:

* on a replay's decisions, observed as they become final with the clock moving along (and a
  settling delay that covers every request's wait and run), or all at once and settled at the
  end, a window as long as the run gives each tenant the report's served tokens and fluid
  reference, and each lane the report's Jain index and worst tenant — the batch computation of
  ``fairness_report`` on the same decisions;
* over a sliding window, each tenant's service received and fluid reference are what the
  independent oracle (``tests/fluid_support.py``) delivers between the window's start and end;
* at most ``top_tenants`` tenants are named, the rest summed into ``other`` (Jain and the worst
  ratio still over every tenant); unknown tenants count as ``other``;
* bounded: never more than ``max_pending`` decisions wait to be settled; a decision observed
  after the fluid server passed its arrival is counted late and taken as arriving now;
* bad parameters are refused naming them.
"""

from __future__ import annotations

import math

import pytest
from fluid_support import Request, delivered, gps_oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.config import Config, PolicyConfig, TenantConfig
from tokenfair.core import Decision
from tokenfair.sim.fairness import fairness_report
from tokenfair.sim.fluid_window import OTHER, FluidWindow, rest_name
from tokenfair.sim.scenarios import SCENARIOS
from tokenfair.sim.simulator import simulate

INF = math.inf


def final_ms(decision: Decision, rate: float) -> float:
    """When a decision is final: the end of its run, or when it was refused."""
    if decision.dispatch_ms is not None:
        return decision.dispatch_ms + decision.service_tokens / rate
    return decision.arrival_ms + decision.queue_wait_ms


@pytest.mark.parametrize("scenario", ["starvation", "noisy-neighbor"])
@pytest.mark.parametrize("policy", ["tokenfair", "service_token_drr_with_admission"])
@pytest.mark.parametrize("live", [True, False])
def test_over_a_whole_run_it_gives_the_reports_figures(
    scenario: str, policy: str, live: bool
) -> None:
    config, requests = SCENARIOS[scenario]()
    decisions = simulate(config, requests, policy)
    rate = config.policy.service_tokens_per_ms
    # Settled once every request has waited and run (the lesson's policy bounds no wait).
    settle_ms = max(final_ms(d, rate) - d.arrival_ms for d in decisions) + 1.0
    window = FluidWindow(config, window_ms=1e9, buckets=1, settle_ms=settle_ms)
    for decision in decisions:  # in the order the replay decided them
        window.observe(decision, decision.service_tokens)
        if live:
            window.advance(final_ms(decision, rate))
    window.advance(INF)
    report = fairness_report(decisions, config)
    snapshot = window.snapshot()
    assert snapshot.late_requests == 0
    for lane, seen in snapshot.lanes.items():
        assert seen.jain == pytest.approx(report.fluid_jain_by_lane[lane], abs=1e-9)
        worst = report.fluid_worst_by_lane[lane]
        if worst is None:
            assert seen.worst is None
        else:
            assert seen.worst is not None
            assert seen.worst.tenant_id == worst.tenant_id
            assert seen.worst.served_over_fluid == pytest.approx(worst.served_over_fluid)
        for row in seen.tenants:
            tenant = report.tenants[row.tenant_id]
            assert row.received_tokens == pytest.approx(tenant.served_service_tokens)
            assert row.reference_tokens == pytest.approx(tenant.fluid_reference_service_tokens)
    named = {row.tenant_id for lane in snapshot.lanes.values() for row in lane.tenants}
    served = {t for t, row in report.tenants.items() if row.fluid_reference_service_tokens > 0}
    assert named == served


# ---------------------------------------------------------------------------------------------
# A sliding window against the independent oracle

RATE = 2.0
WAIT_MS = 150.0
LANE_CONFIG = Config(
    PolicyConfig(service_tokens_per_ms=RATE, max_interactive_wait_ms=WAIT_MS),
    tuple(TenantConfig(f"t{i}", w, 10**9, 10**9, "interactive") for i, w in enumerate((1, 2, 4))),
)


@st.composite
def lane_decisions(draw: st.DrawFn) -> list[Decision]:
    """Interactive decisions of three tenants (weights 1, 2, 4): the served ones run one at a
    time in a random order, no earlier than they arrive; the refused ones wait ``WAIT_MS``."""
    count = draw(st.integers(1, 16))
    drawn = [
        (
            float(draw(st.integers(0, 400))),
            draw(st.integers(0, 2)),
            draw(st.integers(1, 300)),
            draw(st.booleans()),
        )
        for _ in range(count)
    ]
    starts: dict[int, float] = {}
    free_ms = 0.0
    for index in draw(st.permutations([i for i, d in enumerate(drawn) if d[3]])):
        arrival, _, size, _ = drawn[index]
        starts[index] = max(free_ms, arrival) + draw(st.integers(0, 40))
        free_ms = starts[index] + size / RATE
    decisions = []
    for index, (arrival, tenant, size, is_served) in enumerate(drawn):
        if is_served:
            decisions.append(
                Decision(
                    f"r{index}", f"t{tenant}", "interactive", 200, "admitted", "dispatch",
                    size, arrival, dispatch_ms=starts[index],
                )
            )  # fmt: skip
        else:
            decisions.append(
                Decision(
                    f"r{index}", f"t{tenant}", "interactive", 429, "shed_queue_wait_slo",
                    "admission", size, arrival,
                )
            )  # fmt: skip
    return decisions


def as_oracle(decisions: list[Decision]) -> list[Request]:
    requests: list[Request] = []
    for d in decisions:
        tenant, size = int(d.tenant_id[1:]), float(d.service_tokens)
        if d.dispatch_ms is not None:
            requests.append((d.arrival_ms, tenant, size, INF, d.dispatch_ms))
        else:
            requests.append((d.arrival_ms, tenant, size, d.arrival_ms + WAIT_MS, INF))
    return requests


@settings(max_examples=200, deadline=None, derandomize=True)
@given(decisions=lane_decisions(), end=st.integers(1, 24))
def test_a_sliding_window_delivers_what_the_oracle_delivers_in_it(
    decisions: list[Decision], end: int
) -> None:
    # Buckets of 50 ms, a window of 4 of them; the fluid server moved to a boundary or between
    # two (then the window starts at the first boundary inside the last 200 ms).
    window = FluidWindow(LANE_CONFIG, window_ms=200.0, buckets=4, settle_ms=0.0)
    for decision in decisions:
        window.observe(decision, decision.service_tokens)
    now_ms = 25.0 * end
    window.advance(now_ms)
    snapshot = window.snapshot()
    assert snapshot.end_ms == now_ms
    start_ms = snapshot.start_ms
    assert now_ms - 200.0 <= start_ms <= now_ms
    requests = as_oracle(decisions)
    weights = [1.0, 2.0, 4.0]
    reference = [
        late - early
        for late, early in zip(
            gps_oracle(requests, weights, RATE, until_ms=now_ms)[1],
            gps_oracle(requests, weights, RATE, until_ms=start_ms)[1],
            strict=True,
        )
    ]
    received = [
        late - early
        for late, early in zip(
            delivered(requests, 3, RATE, now_ms),
            delivered(requests, 3, RATE, start_ms),
            strict=True,
        )
    ]
    rows = {row.tenant_id: row for row in snapshot.lanes["interactive"].tenants}
    for tenant in range(3):
        row = rows.get(f"t{tenant}")
        got = (0.0, 0.0) if row is None else (row.received_tokens, row.reference_tokens)
        assert got[0] == pytest.approx(received[tenant], abs=1e-6)
        assert got[1] == pytest.approx(reference[tenant], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Bounds


def many_tenants_config(count: int) -> Config:
    return Config(
        PolicyConfig(service_tokens_per_ms=10.0),
        tuple(TenantConfig(f"t{i:02d}", 1.0, 10**9, 10**9, "batch") for i in range(count)),
    )


def test_only_the_top_tenants_are_named_and_the_rest_is_other() -> None:
    # Thirty tenants each send one request at 0; the lane serves them one after the other, 100
    # tokens each at 10 tokens/ms (tenant k over [10k, 10k + 10]). Window: the whole run.
    config = many_tenants_config(30)
    window = FluidWindow(config, window_ms=1e6, buckets=1, top_tenants=5, settle_ms=0.0)
    for k in range(30):
        window.observe(
            Decision(f"r{k}", f"t{k:02d}", "batch", 200, "admitted", "dispatch", 100, 0.0,
                     dispatch_ms=10.0 * k),
            100 + k,  # sizes 100..129: the later, the larger
        )  # fmt: skip
    window.observe(
        Decision("x", "stranger", "batch", 429, "shed_queue_wait_slo", "admission", 50, 0.0), 50
    )
    window.advance(INF)
    lane = window.snapshot().lanes["batch"]
    names = [row.tenant_id for row in lane.tenants]
    assert names == ["t29", "t28", "t27", "t26", "t25", OTHER]
    other = lane.tenants[-1]
    assert other.received_tokens == pytest.approx(sum(100 + k for k in range(25)))
    total_reference = sum(row.reference_tokens for row in lane.tenants)
    assert total_reference == pytest.approx(sum(100 + k for k in range(30)))
    assert lane.jain is not None
    assert lane.worst is not None
    assert lane.worst.tenant_id not in names[:-1]  # a tenant summed into `other`


def test_a_tenant_named_other_keeps_its_own_row() -> None:
    # Tenants "other", "a" and "b", the top one named: the rest is summed under "other~", so
    # no two rows (and no two metric series) share a name.
    config = Config(
        PolicyConfig(service_tokens_per_ms=10.0),
        tuple(TenantConfig(name, 1.0, 10**9, 10**9, "batch") for name in ("other", "a", "b")),
    )
    window = FluidWindow(config, window_ms=1e6, buckets=1, top_tenants=1, settle_ms=0.0)
    for k, name in enumerate(("other", "a", "b")):
        window.observe(
            Decision(f"r{k}", name, "batch", 200, "admitted", "dispatch", 100, 0.0,
                     dispatch_ms=10.0 * k),
            100 + 50 * k,
        )  # fmt: skip
    window.advance(INF)
    names = [row.tenant_id for row in window.snapshot().lanes["batch"].tenants]
    assert names == ["b", "other~"]
    assert rest_name({"other", "other~"}) == "other~~"
    assert rest_name({"a"}) == OTHER


def test_pending_decisions_stay_bounded_and_late_ones_are_counted() -> None:
    config = many_tenants_config(2)
    window = FluidWindow(config, window_ms=1000.0, buckets=2, settle_ms=1e9, max_pending=10)
    for k in range(100):
        window.observe(
            Decision(f"r{k}", "t00", "batch", 200, "admitted", "dispatch", 10, float(k),
                     dispatch_ms=float(k)),
            10,
        )  # fmt: skip
        assert window.pending_events <= 10
    # The fluid server was moved along by the bound: a decision that arrived before its
    # present is late, and taken as arriving now.
    assert window.snapshot().end_ms > 50.0
    window.observe(Decision("old", "t01", "batch", 429, "queue_full", "admission", 10, 1.0), 10)
    assert window.late_requests == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window_ms": 0.0}, "window_ms must be a finite number > 0"),
        ({"window_ms": INF}, "window_ms must be a finite number > 0"),
        ({"buckets": 0}, "buckets must be an integer >= 1"),
        ({"top_tenants": -1}, "top_tenants must be an integer >= 0"),
        ({"settle_ms": -1.0}, "settle_ms must be a finite number >= 0"),
        ({"max_pending": 0}, "max_pending must be an integer >= 1"),
    ],
)
def test_bad_parameters_are_refused(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FluidWindow(many_tenants_config(1), **options)  # type: ignore[arg-type]
