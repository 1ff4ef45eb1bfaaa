"""The core's fast paths (issue 17) decide exactly as the paths they shortcut.

Behaviours under test:

* ``DeficitRoundRobin`` indexes its heads' costs only from the first ``min_head_cost`` on: a
  lane asked late (after any mix of queueing, sending and cancelling) finds the cheapest live
  head, and keeps finding it as the lane moves on;
* the dispatch occupancy that ``Scheduler`` keeps rounded by resident block count is the
  rounded value itself, past the cache's bound too: every decision of a replay is the same with
  the cache off, bounded at two values, and at its default bound, for every policy;
* ``tokenfair`` settlement at the estimate (no refund, usage ratio 1, expected at the estimate)
  changes nothing — the ratio stays exactly 1.0 and no deficit or bucket moves — and any other
  settlement still moves the ratio;
* ``LaneCompetition.retire`` stops at once when the oldest admission is within the horizon, and
  retires the stale ones otherwise.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair import native
from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import POLICIES, Books, Decision, Lane, Request, scheduler
from tokenfair.core.drr import DeficitRoundRobin
from tokenfair.core.jobs import Job, JobState
from tokenfair.core.shares import LaneCompetition
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.sim.simulator import simulate

BASE_QUANTUM = 1200


def job(request_id: str, tenant_id: str, cost: int) -> Job:
    return Job(Request(request_id, tenant_id, 0.0, cost, 0, "batch"), cost, 1)


def live_heads(lane: DeficitRoundRobin) -> list[float]:
    return [head.expected_tokens for q in lane.queues.values() if (head := q.head()) is not None]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "pick", "forget"]),
        st.sampled_from("abcd"),
        st.integers(min_value=100, max_value=5000),
    ),
    max_size=200,
)


@given(OPS, OPS)
def test_head_costs_are_indexed_from_the_first_question(
    before: list[tuple[str, str, int]], after: list[tuple[str, str, int]]
) -> None:
    lane = DeficitRoundRobin()
    for tenant_id, weight in zip("abcd", (1.0, 2.0, 1.0, 4.0), strict=True):
        lane.add_tenant(tenant_id, BASE_QUANTUM * weight)
    queued: list[Job] = []

    def run(ops: list[tuple[str, str, int]], prefix: str, ask: bool) -> None:
        for step, (op, tenant_id, cost) in enumerate(ops):
            if op == "push":
                new = job(f"{prefix}{step}", tenant_id, cost)
                lane.push(new, join_ahead=0.5 if cost % 3 == 0 else None)
                queued.append(new)
            elif op == "pick":
                picked = lane.pick(lambda _: True)
                if picked is not None:
                    picked.state = JobState.DISPATCHED
                    queued.remove(picked)
            elif queued:
                victim = queued.pop(cost % len(queued))
                lane.forget(victim)
                victim.state = JobState.CANCELLED
            if ask:
                heads = live_heads(lane)
                assert lane.min_head_cost() == (min(heads) if heads else None)

    run(before, "x", ask=False)  # nobody asks: nothing indexed yet
    heads = live_heads(lane)
    assert lane.min_head_cost() == (min(heads) if heads else None)  # the first question
    run(after, "y", ask=True)  # indexed from then on


def lesson_config() -> Config:
    return build_config(
        PolicyConfig(),
        [
            TenantConfig("chat", 2.0, 48000, 180000.0, "interactive"),
            TenantConfig("ide", 1.5, 36000, 140000.0, "interactive"),
            TenantConfig("rag", 1.0, 28000, 60000.0, "batch"),
        ],
    )


REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(["chat", "ide", "rag"]),
        st.integers(min_value=0, max_value=40),  # arrival gap, ms
        st.integers(min_value=1, max_value=8000),  # prefill
        st.integers(min_value=0, max_value=800),  # decode
    ),
    min_size=1,
    max_size=120,
)


def replay_all(config: Config, requests: list[Request]) -> dict[str, list[Decision]]:
    return {policy: simulate(config, requests, policy) for policy in POLICIES}


@pytest.mark.skipif(
    native.status().active,
    reason="patches a module constant that the compiled core has inlined: "
    "tests/sidecar/native runs it on the interpreted core",
)
@settings(max_examples=40, deadline=None)
@given(REQUESTS)
def test_the_rounded_occupancy_cache_changes_no_decision(
    rows: list[tuple[str, int, int, int]],
) -> None:
    config = lesson_config()
    classes = {t.tenant_id: t.priority_class for t in config.tenants}
    arrival_ms = 0
    requests = []
    for number, (tenant_id, gap_ms, prefill, decode) in enumerate(rows):
        arrival_ms += gap_ms
        requests.append(
            Request(f"r{number:04d}", tenant_id, arrival_ms, prefill, decode, classes[tenant_id])
        )
    default = replay_all(config, requests)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "_ROUNDED_OCCUPANCY_BOUND", 0)  # nothing kept
        uncached = replay_all(config, requests)
        patch.setattr(scheduler, "_ROUNDED_OCCUPANCY_BOUND", 2)  # past the bound at once
        bounded = replay_all(config, requests)
    assert default == uncached == bounded
    for decisions in default.values():
        for decision in decisions:
            # 4 places, as the decision record has always had it
            assert decision.kv_occupancy_ratio == round(decision.kv_occupancy_ratio, 4)


def dispatch_and_settle(
    fair: TokenfairScheduler, request_id: str, now_ms: float, actual: int | None
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Submit, dispatch and settle one chat request (600 service tokens); the tenant's
    (DRR deficit, bucket level, served tokens) just before and just after settlement."""
    tenant = fair.tenants["chat"]
    queue = fair._lanes[Lane.INTERACTIVE].queues["chat"]
    assert fair.submit(Request(request_id, "chat", now_ms, 400, 50, "interactive"), now_ms) is None
    decision = fair.next_dispatch(now_ms)
    assert decision is not None
    assert decision.request_id == request_id
    before = (
        queue.deficit,
        tenant.bucket.level,
        fair._lane_served[Lane.INTERACTIVE].rate(now_ms, 1.0),
    )
    # It ran as long as its estimate takes at the full service rate: long enough for the
    # engine to have done any usage up to the estimate (the lane records no more than that).
    fair.complete(request_id, now_ms + 600 / fair.policy.service_tokens_per_ms, actual)
    after = (
        queue.deficit,
        tenant.bucket.level,
        fair._lane_served[Lane.INTERACTIVE].rate(now_ms, 1.0),
    )
    return before, after  # (rates read at `now_ms`, as before: a decay would hide the change)


def test_settling_at_the_estimate_changes_nothing_and_any_other_settlement_moves_the_ratio() -> (
    None
):
    fair = TokenfairScheduler(lesson_config())
    tenant = fair.tenants["chat"]
    before, after = dispatch_and_settle(fair, "r1", 0.0, None)  # at the estimate (600 tokens)
    assert tenant.usage_ratio == 1.0
    assert before == after
    before, after = dispatch_and_settle(fair, "r2", 10.0, 600)  # the estimate, given explicitly
    assert tenant.usage_ratio == 1.0
    assert before == after
    before, after = dispatch_and_settle(fair, "r3", 100.0, 300)  # used half: refund, ratio moves
    assert tenant.usage_ratio == pytest.approx(1.0 + (0.5 - 1.0) * 0.25)
    assert after[1] > before[1]  # the refund went back to the bucket
    moved = tenant.usage_ratio
    before, after = dispatch_and_settle(fair, "r4", 200.0, None)  # at the estimate, ratio < 1
    assert tenant.usage_ratio == pytest.approx(moved + (1.0 - moved) * 0.25)
    assert after[2] > before[2]  # expected below the estimate: the overrun is recorded
    fair.expire(300.0)
    assert fair.books() == Books(0, 0, 0, 0, 0)


def test_retire_stops_at_a_recent_oldest_admission_and_retires_stale_ones() -> None:
    competition = LaneCompetition()
    competition.retire(0.0, 50.0, lambda _: False)  # nobody: nothing to do
    assert competition.competing_quanta == 0.0
    competition.admitted("a", 1200.0, 0.0)
    competition.admitted("b", 2400.0, 40.0)
    competition.retire(45.0, 50.0, lambda _: False)  # a (0 ms) is within 50 ms of 45
    assert competition.competing_quanta == 3600.0
    competition.retire(60.0, 50.0, lambda _: False)  # a is stale, b (40 ms) is not
    assert (competition.competes("a"), competition.competes("b")) == (False, True)
    competition.retire(200.0, 50.0, lambda tenant_id: tenant_id == "b")  # b backlogged: stays
    assert competition.competing_quanta == 2400.0
