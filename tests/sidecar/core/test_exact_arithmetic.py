"""The fairness state is exact (issue 14): integer fixed-point units, no tolerance, no drift.

Deficits, quanta, the lanes' credit and queued totals (``drr``), bucket levels (``bucket``,
``ExactTokenBucket``), the batch lane's minimum-share credit (``tokenfair``) and the competing
quanta (``shares``) are integers in ``UNITS_PER_TOKEN`` (10^9) units per service token.
Behaviours under test, each of which float accumulation breaks:

* a million small settlements sum exactly (a float deficit ends 1e-6 or so off);
* a million tiny refills leave exactly the level one refill over the whole time gives (the
  refill rule ``round((t - anchor) * rate)`` telescopes), and the float bucket does not;
* the lane's running totals equal the sums they stand for, with ``==``, through random pushes,
  picks, cancellations and settlements at non-integral usage ratios;
* the minimum share's credit is exact: 64 interactive dispatches of 41 400 tokens at ``s = 0.1``
  earn exactly 4 600, and a 4 600-token batch head is due at once, not one dispatch later;
* ``ms_until`` is 0 exactly when the level covers the cost (no 1e-6 tolerance either way), and a
  refill at the time it returns covers it;
* leases and surrenders of whole tokens keep the balance exact.
"""

from __future__ import annotations

import random

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core.bucket import ExactTokenBucket, LeasedBucket, TokenBucket
from tokenfair.core.drr import DeficitRoundRobin
from tokenfair.core.jobs import Job, JobState, Request
from tokenfair.core.shares import LaneCompetition
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.core.units import UNITS_PER_TOKEN

UNIT = UNITS_PER_TOKEN


def job(request_id: str, tenant_id: str, cost: int, ratio: float = 1.0) -> Job:
    made = Job(Request(request_id, tenant_id, 0.0, cost, 0, "interactive"), cost, 1)
    if ratio != 1.0:  # as `tokenfair._admit` prices it
        made.expected_units = round(cost * ratio * UNIT)
        made.expected_tokens = made.expected_units / UNIT
    return made


def test_a_million_small_settlements_sum_exactly() -> None:
    lane = DeficitRoundRobin()
    lane.add_tenant("a", 1200.0)
    lane.push(job("a0", "a", 100))  # backlogged: a credit is kept too
    for _ in range(1_000_000):
        lane.settle("a", 0.1)
    assert lane.queues["a"].deficit_units == -100_000 * UNIT
    assert lane.queues["a"].deficit == -100_000.0
    # The float sum of the same amounts is not exact: this is what the units are for.
    drift = 0.0
    for _ in range(1_000_000):
        drift -= 0.1
    assert drift != -100_000.0
    for _ in range(1_000_000):
        lane.settle("a", -0.1)
    assert lane.queues["a"].deficit_units == 0
    assert lane.credit_units == 0


def test_a_million_tiny_refills_leave_the_level_of_one_refill() -> None:
    rate_per_second = 3.0
    exact = ExactTokenBucket(10**9, rate_per_second, 0.0)
    exact.level_units = 0
    once = ExactTokenBucket(10**9, rate_per_second, 0.0)
    once.level_units = 0
    floating = TokenBucket(10**9, rate_per_second, 0.0)
    floating.level = 0.0
    now_ms = 0.0
    for step in range(1, 1_000_001):
        now_ms = step * 0.1
        exact.refill(now_ms)
        floating.refill(now_ms)
    once.refill(now_ms)
    assert exact.level_units == once.level_units == round(now_ms * rate_per_second * 10**6)
    assert exact.level == 300.0  # 100 s at 3 tokens/s
    assert floating.level != 300.0  # the float bucket drifts over the same refills


def test_refills_telescope_whatever_the_times() -> None:
    """Between caps, the level at ``t`` depends on ``t`` alone, not on when it was read."""
    rng = random.Random(14)
    for _ in range(200):
        rate = rng.uniform(0.001, 90_000.0)
        start_ms = rng.uniform(0.0, 1e7)
        many = ExactTokenBucket(2**40, rate, start_ms)
        once = ExactTokenBucket(2**40, rate, start_ms)
        many.level_units = once.level_units = -(10**15)  # deep in debt: never capped here
        times = sorted(rng.uniform(start_ms, start_ms + 1e6) for _ in range(rng.randint(1, 300)))
        spent = 0
        for now_ms in times:
            many.refill(now_ms)
            tokens = rng.randint(0, 50)
            many.debit(tokens, now_ms)
            spent += tokens
            previous = many.level_units
            many.refill(now_ms - rng.uniform(0.0, 10.0))  # earlier: a no-op
            assert many.level_units == previous
        once.refill(times[-1])
        assert many.level_units == once.level_units - spent * UNIT


def test_ms_until_is_zero_exactly_when_the_level_covers() -> None:
    bucket = ExactTokenBucket(10_000, 1000.0, 0.0)
    bucket.level_units = 640 * UNIT - 1  # one unit (1e-9 token) short
    assert bucket.ms_until(640, 0.0) > 0.0  # no tolerance hides a shortfall
    bucket.level_units = 640 * UNIT
    assert bucket.ms_until(640, 0.0) == 0.0
    bucket.level_units = 0
    wait_ms = bucket.ms_until(640, 5.0)  # 5 tokens refilled meanwhile, at 1 token per ms
    assert wait_ms == 635.0
    assert bucket.ms_until(640, 5.0 + wait_ms) == 0.0


def test_the_lane_totals_are_the_sums_they_stand_for() -> None:
    rng = random.Random(7)
    lane = DeficitRoundRobin()
    for tenant_id, weight in (("a", 1.0), ("b", 2.5), ("c", 0.3)):
        lane.add_tenant(tenant_id, 1200 * weight)
    queued: list[Job] = []
    for step in range(20_000):
        action = rng.random()
        if action < 0.5:
            tenant_id = rng.choice("abc")
            made = job(f"r{step}", tenant_id, rng.randint(1, 5000), rng.uniform(0.1, 3.0))
            lane.push(made, join_ahead=rng.random() if rng.random() < 0.2 else None)
            queued.append(made)
        elif action < 0.85:
            picked = lane.pick(lambda _: rng.random() < 0.9)
            if picked is not None:
                queued.remove(picked)
                picked.state = JobState.DISPATCHED
                lane.settle(picked.request.tenant_id, rng.uniform(-300.0, 300.0))
        elif queued:
            gone = queued.pop(rng.randrange(len(queued)))
            lane.forget(gone)
            gone.state = JobState.CANCELLED
        queues = lane.queues.values()
        assert lane.queued_units == sum(q.queued_units for q in queues)
        assert lane.queued_units == sum(j.expected_units for j in queued)
        assert lane.credit_units == sum(max(0, q.deficit_units) for q in queues)
        assert lane.active_quanta_units == sum(q.quantum_units for q in lane.active)
    while lane.pick(lambda _: True) is not None:
        pass
    assert lane.queued_units == lane.credit_units == lane.active_quanta_units == 0


def test_the_competing_quanta_return_to_zero_exactly() -> None:
    competition = LaneCompetition()
    rng = random.Random(3)
    quanta = {f"t{i}": 1200 * rng.uniform(0.1, 7.0) for i in range(50)}
    for round_number in range(200):
        for tenant_id, quantum in quanta.items():
            competition.admitted(tenant_id, quantum, float(round_number))
        for tenant_id in quanta:
            competition._uncount(tenant_id)
        assert competition.competing_units == 0


def test_the_minimum_share_credit_is_exact() -> None:
    """s = 0.1: each interactive dispatch earns 1/9 of its cost. 42 x 640 + 22 x 660 = 41 400
    tokens earn exactly 4 600, the batch head's cost: the batch request goes next."""
    unbounded = 10**9
    tenants = [
        TenantConfig("rag", 1.0, unbounded, 1e9, "batch"),
        TenantConfig("chat", 1.0, unbounded, 1e9, "interactive"),
    ]
    policy = PolicyConfig(max_interactive_wait_ms=1e12, max_batch_wait_ms=1e12)
    scheduler = TokenfairScheduler(build_config(policy, tenants))
    costs = [(280, 90)] * 42 + [(300, 90)] * 22 + [(280, 90)]  # 640 and 660 service tokens
    for number, (prefill, decode) in enumerate(costs):
        chat = Request(f"c{number}", "chat", 0.0, prefill, decode, "interactive")
        assert scheduler.submit(chat, 0.0) is None
    assert scheduler.submit(Request("b0", "rag", 0.0, 3200, 350, "batch"), 0.0) is None
    order = []
    for _ in range(len(costs) + 1):
        decision = scheduler.next_dispatch(0.0)
        assert decision is not None
        order.append(decision.request_id)
        if len(order) == 64:
            assert scheduler._batch_credit_scaled == 4600 * UNIT * 9
            assert scheduler._batch_credit == 4600.0
        scheduler.complete(decision.request_id, 0.0)
    assert order.index("b0") == 64


def test_leases_keep_the_balance_exact() -> None:
    bucket = LeasedBucket(50_000, 100.0, 0.0)
    for _ in range(10_000):
        bucket.grant(3)
        bucket.debit(1, 0.0)
        bucket.settle(-0.5)
    assert bucket.level_units == 10_000 * (3 - 1) * UNIT - 10_000 * UNIT // 2
    assert bucket.surrender(keep_tokens=0.25) == 14_999
    assert bucket.level_units == UNIT  # 15 000 - 14 999: the fractional keep is not given


def test_a_reload_that_changes_the_share_keeps_the_credit() -> None:
    """The credit is kept times ``q - p`` of the share ``p / q``: a new share rescales it, so it
    reads the same in tokens (within a unit)."""
    tenants = [
        TenantConfig("rag", 1.0, 10**9, 1e9, "batch"),
        TenantConfig("chat", 1.0, 10**9, 1e9, "interactive"),
    ]
    scheduler = TokenfairScheduler(build_config(PolicyConfig(batch_min_share=0.1), tenants))
    scheduler._batch_credit = 500.25
    assert scheduler._batch_credit_scaled == 500_250_000_000 * 9
    scheduler.reconfigure(build_config(PolicyConfig(batch_min_share=0.3), tenants), 0.0)
    assert scheduler._credit_spend == 7  # 1 - 3/10, times 10
    assert scheduler._batch_credit_scaled == 500_250_000_000 * 7
    assert scheduler._batch_credit == 500.25


def test_a_retune_refills_nothing_twice() -> None:
    """A reload at a time before the last refill (the caller's clock) starts the new refill run
    at the last refill, not at that earlier time."""
    bucket = ExactTokenBucket(10_000, 1000.0, 0.0)
    bucket.level_units = 0
    bucket.refill(100.0)  # 100 tokens
    bucket.retune(10_000, 1000.0, 0.0)
    bucket.refill(200.0)  # 100 more, from 100 ms: not 200 from 0 ms
    assert bucket.level_units == 200 * UNIT
