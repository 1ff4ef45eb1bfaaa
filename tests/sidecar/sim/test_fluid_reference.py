"""The fluid fair-share reference (``tokenfair.sim.fluid``): a weighted max-min (GPS) fluid
server whose capacity is what the lane actually served.

Behaviours under test:

* hand-worked cases, the arithmetic in comments: one tenant alone gets everything the lane
  served; two tenants backlogged at weights 3:1 share it 3:1 (a lane that served only the
  heavier one shows it); a tenant that arrives late is owed only its share of what was served
  after it came (where the windowed max-min share counts the late tenant short); a light tenant
  under its share is owed all it asked for (and refusing it shows);
* on random lanes (a serial server's schedule of the served requests, refused ones leaving
  after a random wait): the same service per tenant as an independent oracle
  (``tests/fluid_support.py``: a water-fill between every two instants an input changes), in all
  and for the requests of a window; the reference shares out exactly what the lane served (no
  capacity unused); a tenant alone gets all of it; scaling sizes and rate, time and rate, or
  weights scales the reference as it should;
* bad weights and rates are refused naming the value; the module imports nothing of ours (the
  yardstick owes nothing to the scheduler it measures).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence

import pytest
from fluid_support import Request, gps_oracle
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT

from tokenfair.config import Config, PolicyConfig, TenantConfig
from tokenfair.core import Decision
from tokenfair.sim.fairness import fairness_report
from tokenfair.sim.fluid import FluidLane, FluidRequest, FluidResult, fluid_reference

INF = math.inf


def served(arrival_ms: float, tenant: int, size: float, start_ms: float) -> FluidRequest:
    return FluidRequest(arrival_ms, tenant, size, INF, start_ms)


def refused(arrival_ms: float, tenant: int, size: float, leave_ms: float) -> FluidRequest:
    return FluidRequest(arrival_ms, tenant, size, leave_ms, INF)


def ratios(result: FluidResult) -> list[float]:
    return [r / f for r, f in zip(result.received_tokens, result.reference_tokens, strict=True)]


# ---------------------------------------------------------------------------------------------
# Hand-worked cases (45 service tokens a ms, as the default policy; a 450-token request runs
# 10 ms, a 900-token one 20 ms)


def test_one_tenant_alone_gets_everything_the_lane_served() -> None:
    # Served at 0, 10 and 30 (idle 20..30): 3 x 450 = 1350. The refused request of 5 ms waits
    # behind them (first come, first served inside a tenant) and leaves unserved at 425.
    requests = [
        served(0, 0, 450, 0),
        served(0, 0, 450, 10),
        served(0, 0, 450, 30),
        refused(5, 0, 450, 425),
    ]
    result = fluid_reference(requests, [1.0], 45.0)
    assert result.reference_tokens == [pytest.approx(1350)]
    assert result.received_tokens == [1350]
    assert result.unused_tokens == pytest.approx(0)


def test_two_backlogged_tenants_at_weights_3_to_1_share_it_3_to_1() -> None:
    # A (weight 3) and B (weight 1) each send four 900-token requests at 0; the lane serves four
    # of them, one after the other, over [0, 80]: 3600 tokens. The others are refused and wait
    # until 80 (a wait limit of 80 ms). Both stay backlogged until 80, so the fluid server gives
    # A 45 * 3/4 = 33.75 tokens/ms and B 11.25: A 2700, B 900, whoever the lane served.
    def lane(served_tenants: Sequence[int]) -> FluidResult:
        requests = [served(0, tenant, 900, 20 * k) for k, tenant in enumerate(served_tenants)]
        for tenant in (0, 1):
            left = 4 - list(served_tenants).count(tenant)
            requests += [refused(0, tenant, 900, 80) for _ in range(left)]
        return fluid_reference(requests, [3.0, 1.0], 45.0)

    fair = lane([0, 0, 0, 1])  # A A A B
    assert fair.reference_tokens == [pytest.approx(2700), pytest.approx(900)]
    assert ratios(fair) == [pytest.approx(1.0), pytest.approx(1.0)]
    unfair = lane([0, 0, 0, 0])  # A took everything
    assert unfair.reference_tokens == [pytest.approx(2700), pytest.approx(900)]
    assert ratios(unfair) == [pytest.approx(4 / 3), 0.0]


def test_a_tenant_arriving_late_is_owed_its_share_of_what_came_after() -> None:
    # A sends ten 450-token requests at 0, B four at 40 (equal weights). The lane serves A four
    # times over [0, 40], then B, A, B, A over [40, 80]: A 2700, B 900; the rest is refused.
    # Fluid: A alone over [0, 40] (1800), then 22.5 tokens/ms each over [40, 80] (900 each):
    # A 2700, B 900. Both got exactly their reference.
    starts_a = [0, 10, 20, 30, 50, 70]
    starts_b = [40, 60]
    requests = [served(0, 0, 450, start) for start in starts_a]
    requests += [refused(0, 0, 450, 420) for _ in range(4)]
    requests += [served(40, 1, 450, start) for start in starts_b]
    requests += [refused(40, 1, 450, 460) for _ in range(2)]
    result = fluid_reference(requests, [1.0, 1.0], 45.0)
    assert result.reference_tokens == [pytest.approx(2700), pytest.approx(900)]
    assert ratios(result) == [pytest.approx(1.0), pytest.approx(1.0)]


def test_the_late_tenant_seen_by_the_report_fluid_against_windowed() -> None:
    # The same lane as decisions. The windowed max-min share water-fills the 3600 served tokens
    # over the whole window's demands (A 4500, B 1800, equal weights): 1800 each, so A's lone
    # service over [0, 40] reads as taken from B: A 2700/1800 = 1.5, B 900/1800 = 0.5, Jain
    # (1.5 + 0.5)^2 / (2 * (2.25 + 0.25)) = 0.8. Against the fluid reference both are at 1.
    config = Config(
        PolicyConfig(service_tokens_per_ms=45.0, max_interactive_wait_ms=420.0),
        (
            TenantConfig("A", 1.0, 10**9, 10**9, "interactive"),
            TenantConfig("B", 1.0, 10**9, 10**9, "interactive"),
        ),
    )

    def decision(request_id: str, tenant: str, arrival_ms: float, start: float | None) -> Decision:
        if start is None:
            return Decision(
                request_id, tenant, "interactive", 429, "shed_queue_wait_slo", "admission",
                450, arrival_ms,
            )  # fmt: skip
        return Decision(
            request_id, tenant, "interactive", 200, "admitted", "dispatch", 450, arrival_ms,
            dispatch_ms=start,
        )  # fmt: skip

    starts_a: list[float | None] = [0, 10, 20, 30, 50, 70, None, None, None, None]
    starts_b: list[float | None] = [40, 60, None, None]
    decisions = [decision(f"a{k}", "A", 0, s) for k, s in enumerate(starts_a)]
    decisions += [decision(f"b{k}", "B", 40, s) for k, s in enumerate(starts_b)]
    report = fairness_report(decisions, config)
    assert report.jain_by_lane["interactive"] == pytest.approx(0.8)
    assert report.tenants["B"].served_over_fair == pytest.approx(0.5)
    assert report.fluid_jain_by_lane["interactive"] == pytest.approx(1.0)
    assert report.tenants["A"].fluid_reference_service_tokens == pytest.approx(2700)
    assert report.tenants["B"].served_over_fluid == pytest.approx(1.0)


def test_a_light_tenant_under_its_share_is_owed_all_it_asked_for() -> None:
    # A sends ten 450-token requests at 0; L one at 20 (equal weights). The lane serves 4500
    # tokens over [0, 100]. Fluid: A alone over [0, 20] (900); from 20 both at 22.5 tokens/ms,
    # L's 450 done at 40 (A +450); A alone over [40, 100] (2700). A 4050, L 450.
    fair = [served(0, 0, 450, start) for start in (0, 10, 30, 40, 50, 60, 70, 80, 90)]
    fair += [refused(0, 0, 450, 420), served(20, 1, 450, 20)]
    result = fluid_reference(fair, [1.0, 1.0], 45.0)
    assert result.reference_tokens == [pytest.approx(4050), pytest.approx(450)]
    assert ratios(result) == [pytest.approx(1.0), pytest.approx(1.0)]
    # Refused instead (it would have waited until 20 + 420): the lane served A ten times. The
    # fluid reference is the same; A got 4500/4050 of it and L nothing: Jain 0.5.
    unfair = [served(0, 0, 450, 10 * k) for k in range(10)] + [refused(20, 1, 450, 440)]
    result = fluid_reference(unfair, [1.0, 1.0], 45.0)
    assert result.reference_tokens == [pytest.approx(4050), pytest.approx(450)]
    assert ratios(result) == [pytest.approx(4500 / 4050), 0.0]


def test_what_a_request_was_served_when_it_left_counts_for_its_tenant() -> None:
    # A (served) and B (refused, leaves at 10) both arrive at 0 with 900 tokens, weights 1:1; the
    # lane serves A over [0, 20]. Until 10 they split 45 tokens/ms: 225 each; B leaves with its
    # 225, and A is served the other 450 + 225 alone: A 675, B 225 (A got 900 of it, B none).
    requests = [served(0, 0, 900, 0), refused(0, 1, 900, 10)]
    result = fluid_reference(requests, [1.0, 1.0], 45.0)
    assert result.reference_tokens == [pytest.approx(675), pytest.approx(225)]
    assert result.total_reference_tokens == [pytest.approx(675), pytest.approx(225)]


def test_only_requests_of_the_counted_window_are_counted() -> None:
    # The one-tenant lane of the first case: the reference of the requests that arrived in
    # [0, 4] is the three served ones (1350); of those in [5, 10], the refused one (0).
    requests = [served(0, 0, 450, start) for start in (0, 10, 30)] + [refused(5, 0, 450, 425)]
    assert fluid_reference(requests, [1.0], 45.0, 0, 4).reference_tokens == [pytest.approx(1350)]
    late = fluid_reference(requests, [1.0], 45.0, 5, 10)
    assert late.reference_tokens == [0.0]
    assert late.received_tokens == [0.0]
    assert late.total_reference_tokens == [pytest.approx(1350)]


# ---------------------------------------------------------------------------------------------
# Random lanes against an independent oracle, and properties


@st.composite
def lanes(draw: st.DrawFn) -> tuple[list[Request], list[float], float]:
    """Requests of up to twelve tenants (more than eight backlogged at once: the fluid server's
    finish tags go into a heap; fewer, a scan); the served ones run one at a time (in a random
    order, each no earlier than its arrival, with random idle gaps); each refused one waits a
    random time (0: no demand at all)."""
    tenants = draw(st.integers(1, 12))
    weights = [draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0])) for _ in range(tenants)]
    rate = draw(st.sampled_from([1.0, 2.5, 45.0]))
    count = draw(st.integers(1, 30))
    drawn = [
        (
            float(draw(st.integers(0, 300))),
            draw(st.integers(0, tenants - 1)),
            float(draw(st.integers(1, 500))),
            draw(st.booleans()),
            float(draw(st.integers(0, 400))),
        )
        for _ in range(count)
    ]
    order = draw(st.permutations([i for i, d in enumerate(drawn) if d[3]]))
    starts: dict[int, float] = {}
    free_ms = 0.0
    for index in order:
        arrival, _, size, _, _ = drawn[index]
        start = max(free_ms, arrival) + draw(st.integers(0, 30))
        starts[index] = start
        free_ms = start + size / rate
    requests: list[Request] = [
        (arrival, tenant, size, INF, starts[i])
        if is_served
        else (arrival, tenant, size, arrival + wait, INF)
        for i, (arrival, tenant, size, is_served, wait) in enumerate(drawn)
    ]
    return requests, weights, rate


def run(
    requests: Sequence[Request],
    weights: Sequence[float],
    rate: float,
    counted: tuple[float, float] = (-INF, INF),
) -> FluidResult:
    return fluid_reference([FluidRequest(*r) for r in requests], weights, rate, *counted)


def close(got: Sequence[float], expected: Sequence[float], scale: float) -> None:
    assert list(got) == pytest.approx(list(expected), rel=1e-7, abs=1e-7 * max(1.0, scale))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(lane=lanes(), window=st.tuples(st.integers(0, 300), st.integers(0, 300)))
def test_the_fluid_server_gives_what_an_independent_gps_oracle_gives(
    lane: tuple[list[Request], list[float], float], window: tuple[int, int]
) -> None:
    requests, weights, rate = lane
    counted = (float(min(window)), float(max(window)))
    result = run(requests, weights, rate, counted)
    expected_counted, expected_total = gps_oracle(requests, weights, rate, *counted)
    scale = sum(r[2] for r in requests)
    close(result.total_reference_tokens, expected_total, scale)
    close(result.reference_tokens, expected_counted, scale)


@pytest.mark.parametrize("tenants", [9, 12, 20])
def test_many_backlogged_tenants_then_few_match_the_oracle(tenants: int) -> None:
    # Every tenant waits from 0 (more than eight at once: the heap), with its own request sizes,
    # weights 1..4; the lane serves them in turn, the light ones drain first, and the last few
    # tenants share the end (a scan again).
    requests: list[Request] = []
    free_ms = 0.0
    for tenant in range(tenants):
        for k in range(3):
            size = 50.0 * (tenant + 1) + 10 * k
            requests.append((0.0, tenant, size, INF, free_ms))
            free_ms += size / 45.0
        requests.append((float(tenant), tenant, 100.0, 200.0 + tenant, INF))  # refused
    weights = [1.0 + tenant % 4 for tenant in range(tenants)]
    result = run(requests, weights, 45.0)
    expected_counted, expected_total = gps_oracle(requests, weights, 45.0)
    scale = sum(r[2] for r in requests)
    close(result.total_reference_tokens, expected_total, scale)
    close(result.reference_tokens, expected_counted, scale)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(lane=lanes())
def test_the_reference_shares_out_exactly_what_the_lane_served(
    lane: tuple[list[Request], list[float], float],
) -> None:
    requests, weights, rate = lane
    result = run(requests, weights, rate)
    lane_service = math.fsum(size for _, _, size, _, start in requests if start < INF)
    assert math.fsum(result.total_reference_tokens) == pytest.approx(lane_service, rel=1e-9)
    assert math.fsum(result.received_tokens) == lane_service
    assert result.unused_tokens == pytest.approx(0, abs=1e-9 * max(1.0, lane_service))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(lane=lanes())
def test_a_tenant_alone_gets_all_the_lane_served(
    lane: tuple[list[Request], list[float], float],
) -> None:
    requests, _, rate = lane
    alone = [(arrival, 0, size, leave, start) for arrival, _, size, leave, start in requests]
    result = run(alone, [3.0], rate)
    lane_service = math.fsum(size for _, _, size, _, start in requests if start < INF)
    assert result.total_reference_tokens == [pytest.approx(lane_service, rel=1e-9)]
    assert result.reference_tokens == result.total_reference_tokens


@settings(max_examples=200, deadline=None, derandomize=True)
@given(lane=lanes(), factor=st.sampled_from([0.25, 3.0, 1000.0]))
def test_the_reference_scales_with_sizes_and_not_with_time_or_weights(
    lane: tuple[list[Request], list[float], float], factor: float
) -> None:
    requests, weights, rate = lane
    base = run(requests, weights, rate).total_reference_tokens
    scale = sum(r[2] for r in requests)
    # Sizes and rate times k: the same schedule (durations size / rate unchanged), k times the
    # service everywhere.
    bigger = [(a, t, s * factor, leave, start) for a, t, s, leave, start in requests]
    close(run(bigger, weights, rate * factor).total_reference_tokens, [x * factor for x in base],
          scale * factor)  # fmt: skip
    # Every time times k and the rate over k: the same service, later.
    slower = [
        (a * factor, t, s, leave * factor, start * factor) for a, t, s, leave, start in requests
    ]
    close(run(slower, weights, rate / factor).total_reference_tokens, base, scale)
    # Weights times k: the same split.
    close(run(requests, [w * factor for w in weights], rate).total_reference_tokens, base, scale)


# ---------------------------------------------------------------------------------------------
# Bad input, independence


@pytest.mark.parametrize("weight", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_weight_is_refused_naming_the_tenant(weight: float) -> None:
    with pytest.raises(ValueError, match="weight of tenant 1 must be a finite number > 0"):
        FluidLane([1.0, weight])
    with pytest.raises(ValueError, match="weight of tenant 1 must be a finite number > 0"):
        fluid_reference([served(0, 0, 10, 0)], [1.0, weight], 45.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_rate_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        fluid_reference([served(0, 0, 10, 0)], [1.0], rate)
    if rate == 0.0:
        FluidLane([1.0]).set_rate(rate)  # no capacity is a capacity
    else:
        with pytest.raises(ValueError, match="rate must be a finite number >= 0"):
            FluidLane([1.0]).set_rate(rate)


def test_the_fluid_module_imports_nothing_of_ours() -> None:
    source = REPO_ROOT / "sidecar" / "tokenfair" / "sim" / "fluid.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported
    assert not [name for name in imported if name.split(".")[0] == "tokenfair"]
