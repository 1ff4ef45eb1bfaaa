"""Admission's model of the scheduler (``core/shares.py``), hand-calculated.

Behaviours under test:

* ``tokens_ahead``: a tenant waits for its own queue, the others' current turn (their credit plus
  one quantum each, never more than the lane holds) and one quantum of each other backlogged
  tenant per further quantum it needs; an open turn at the front that covers the request waits
  for nothing else; a tenant that joins ahead waits only for what is promised before it;
* ``LaneCompetition``: a tenant competes while backlogged and for the horizon after its last
  admission, the sum of quanta follows, and a reweighted tenant is counted at its new quantum;
* ``DemandRate``: a steady stream reads its rate, a stopped one fades with the time constant;
* ``RateSum``: the sum of its members' rates; read at a time before its last change it reads as
  at that change (no extrapolation backwards), never above the rates read one by one;
* ``ResidualWork``: dispatched work drains at the service rate and settlement corrects it;
* ``water_level``: the level at which the weighted max-min allocations (``min(demand, L * w)``)
  use the capacity, by hand and against the fairness report's ``water_fill`` on random inputs.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfair.core.drr import TenantQueue
from tokenfair.core.shares import (
    DemandRate,
    LaneCompetition,
    RateSum,
    ResidualWork,
    tokens_ahead,
    water_level,
)
from tokenfair.core.units import to_units
from tokenfair.sim.fairness import water_fill


def turn(quantum: float, deficit: float = 0.0, turn_open: bool = False) -> TenantQueue:
    """A tenant's DRR state (``drr.TenantQueue``, what the admission reads) with these values."""
    queue = TenantQueue("t", quantum)
    queue.deficit_units = to_units(deficit)
    queue.turn_open = turn_open
    return queue


def test_alone_a_tenant_waits_for_its_own_queue_only() -> None:
    own = turn(1200.0)
    # q = 2000 queued, nobody else competes (W = B = Q_i), the lane holds only its work; it still
    # needs ceil(2400 / 1200) = 2 quanta: one later turn, in which nobody else sends.
    assert tokens_ahead(2000, 400, own, 1200.0, 1200.0, 2000, 0.0, None) == (2000, 1)


def test_the_others_take_one_quantum_per_quantum_it_still_needs() -> None:
    own, front = turn(1200.0), turn(2400.0, deficit=500.0, turn_open=True)
    # k = ceil((2000 + 400 - 0) / 1200) = 2 quanta. W = B = 1200 + 2400 + 1200 (a third
    # tenant, backlogged). First turn of the others: credit 500 (the front's) + (W - Q_i = 3600)
    # - the front's quantum already granted (2400) = 1700, within the lane's 9000 - 2000 others'
    # tokens. Then one more turn of the backlogged others: 3600. Ahead: 2000 + 1700 + 3600.
    assert tokens_ahead(2000, 400, own, 4800.0, 4800.0, 9000, 500.0, front) == (7300, 1)


def test_the_first_turn_is_capped_by_what_the_lane_holds() -> None:
    own = turn(1200.0)
    # Ten other tenants compete (W - Q_i = 12000) but only 800 tokens of theirs are queued:
    # a tenant arriving later joins behind this one. k = 1: no further turns.
    assert tokens_ahead(0, 400, own, 13200.0, 2400.0, 800, 0.0, None) == (800, 0)


def test_an_open_turn_that_covers_the_request_waits_for_nothing_else() -> None:
    own = turn(1200.0, deficit=900.0, turn_open=True)
    # It is the front, its turn is open and D = 900 covers its queued 400 and the new 400.
    assert tokens_ahead(400, 400, own, 6000.0, 6000.0, 5000, 900.0, own) == (400, 0)


def test_a_debt_costs_more_quanta() -> None:
    own = turn(1200.0, deficit=-2400.0)
    # k = ceil((0 + 400 + 2400) / 1200) = 3: the backlogged others (B - Q_i = 1200) get 2 more
    # turns; the idle competitor (W - B = 1200) is left to the caller's arrival estimate.
    assert tokens_ahead(0, 400, own, 3600.0, 2400.0, 1000, 0.0, None) == (1000 + 2 * 1200, 2)


def test_joining_ahead_waits_only_for_what_is_promised_before_it() -> None:
    own = turn(1200.0)
    # Its first turn will cover the request (the lift): k = 1 whatever the cost.
    ahead = tokens_ahead(0, 9000, own, 60000.0, 60000.0, 50000, 8000.0, None, first_turn_tokens=700)
    assert ahead == (700, 0)


def test_a_tenant_competes_while_backlogged_and_for_the_horizon_after() -> None:
    competition = LaneCompetition()
    backlogged: set[str] = set()
    competition.admitted("a", 1200.0, 0.0)
    competition.admitted("b", 2400.0, 10.0)
    backlogged.add("a")
    assert competition.competing_quanta == 3600.0
    competition.retire(100.0, 50.0, backlogged.__contains__)
    # a: last admitted at 0 < 100 - 50 but still backlogged: it stays; b is idle and out.
    assert (competition.competes("a"), competition.competes("b")) == (True, False)
    assert competition.competing_quanta == 1200.0
    backlogged.clear()
    competition.drained("a")  # its queue emptied after its horizon passed: out
    assert competition.competing_quanta == 0.0
    competition.admitted("c", 1200.0, 200.0)
    competition.drained("c")  # emptied within its horizon: still competing
    assert competition.competes("c")
    competition.quantum_changed("c", 4800.0)
    assert competition.competing_quanta == 4800.0


def test_a_steady_stream_reads_its_rate_and_a_stopped_one_fades() -> None:
    rate = DemandRate()
    tau_ms = 100.0
    for step in range(2000):  # 50 tokens every 1 ms: 50 tokens/ms for 20 time constants
        rate.add(50, float(step), tau_ms)
    assert rate.rate(1999.0, tau_ms) == pytest.approx(50.0, rel=0.01)
    # One time constant later without arrivals: e^-1 of it.
    assert rate.rate(2099.0, tau_ms) == pytest.approx(rate.rate(1999.0, tau_ms) * math.exp(-1))


def test_a_rate_sum_read_before_its_last_change_does_not_extrapolate_backwards() -> None:
    tau = 1000.0
    rates = {"a": DemandRate(), "b": DemandRate()}
    rates["a"].add(1000.0, 0.0, tau)  # 1 token per ms at 0
    rates["b"].add(2000.0, 500.0, tau)  # 2 tokens per ms at 500
    total = RateSum(rates, tau)
    total.put("a", tau)
    total.put("b", tau)
    after = 1.0 * math.exp(-1.5) + 2.0 * math.exp(-1.0)
    assert total.rate(1500.0, tau) == pytest.approx(after, rel=1e-12)
    at_last = 1.0 * math.exp(-0.5) + 2.0
    assert total.rate(500.0, tau) == pytest.approx(at_last, rel=1e-12)
    # Before b's add (rate(t) = term * exp(-(t - ref) / tau) would give 2.7 and 148 times its
    # value 1 and 5 tau back): read as at that add, below the one-by-one sum.
    for before_ms in (250.0, -500.0, -4500.0):
        one_by_one = rates["a"].rate(before_ms, tau) + rates["b"].rate(before_ms, tau)
        assert total.rate(before_ms, tau) == pytest.approx(at_last, rel=1e-12)
        assert total.rate(before_ms, tau) <= one_by_one


def test_residual_work_drains_at_the_rate_and_is_settled() -> None:
    residual = ResidualWork()
    residual.dispatched(450.0, 45.0, 0.0)  # 10 ms of work
    residual.dispatched(450.0, 45.0, 5.0)  # queued behind: busy until 20 ms
    assert residual.wait_ms(5.0) == pytest.approx(15.0)
    residual.settled(-225.0, 45.0)  # the second used half its expectation: busy until 15 ms
    assert residual.wait_ms(5.0) == pytest.approx(10.0)
    assert residual.wait_ms(30.0) == 0.0


def test_water_level_by_hand() -> None:
    # Capacity 10 over demands 1 (w 1), 4 (w 1), 20 (w 2): 1 is met, the rest share 9 by
    # weight: level 3 gives 3 and 6.
    assert water_level(10.0, [(1.0, 1.0), (4.0, 1.0), (20.0, 2.0)]) == pytest.approx(3.0)
    assert water_level(25.0, [(1.0, 1.0), (4.0, 1.0), (20.0, 2.0)]) == math.inf  # all fit
    assert water_level(0.0, [(1.0, 1.0)]) == 0.0
    assert water_level(5.0, []) == math.inf


@given(
    st.floats(min_value=0.0, max_value=1e6),
    st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=1e6), st.floats(min_value=0.01, max_value=8)),
        min_size=1,
        max_size=30,
    ),
)
def test_water_level_agrees_with_the_reports_water_fill(
    capacity: float, pairs: list[tuple[float, float]]
) -> None:
    level = water_level(capacity, pairs)
    names = [f"t{i}" for i in range(len(pairs))]
    filled = water_fill(
        capacity,
        dict(zip(names, (d for d, _ in pairs), strict=True)),
        dict(zip(names, (w for _, w in pairs), strict=True)),
    )
    for name, (demand, weight) in zip(names, pairs, strict=True):
        expected = demand if math.isinf(level) else min(demand, level * weight)
        assert expected == pytest.approx(filled[name], rel=1e-6, abs=1e-6)


def test_water_level_survives_weights_of_very_different_sizes() -> None:
    # Subtracting 1.2e19 from a running weight sum of 1.2e19 + 600 left 0, and a division by it.
    level = water_level(10.0, [(1.0, 1.2e19), (100.0, 600.0)])
    assert level == pytest.approx(9.0 / 600.0)
