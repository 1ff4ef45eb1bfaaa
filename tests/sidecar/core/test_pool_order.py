"""Pool-wide service counters (core/pool_order.py) and the DRR's one hook that reads them:

- with counters shared, a lane serves the eligible head whose tenant has the least pool-wide
  service per quantum, counting what it gives (at dispatch the expected cost, at settlement the
  overrun), and keeps its books (queued totals, the ring) as the round robin does;
- a tenant served elsewhere (the store's totals) yields here; weights divide the counters;
- joining clamps the counter of a tenant idle pool-wide into [least - JOIN_LAG_QUANTA, least +
  JOIN_GAP_QUANTA]; one served here or elsewhere within IDLE_EPOCHS batches keeps its counter;
- the store down (sharing False): the round robin's own order, service still counted;
- batches move whole tokens from unsynced to pushing; the answer replaces the pool view; a lost
  answer keeps the service locally and is not sent again; ``due`` fires on tokens or time;
- ``share_pool_service(None)`` is the lane's plain round robin again.
"""

from __future__ import annotations

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.drr import DeficitRoundRobin
from tokenfair.core.jobs import UNITS_PER_TOKEN, Job
from tokenfair.core.pool_order import (
    IDLE_EPOCHS,
    JOIN_GAP_QUANTA,
    JOIN_LAG_QUANTA,
    LaneOrder,
    PoolService,
)
from tokenfair.core.tokenfair import TokenfairScheduler

U = UNITS_PER_TOKEN


def _job(request_id: str, tenant_id: str, tokens: int) -> Job:
    request = Request(request_id, tenant_id, 0.0, tokens, 0, "interactive")
    job = Job(request, tokens, 1)
    job.expected_units = tokens * U
    return job


def _lane(order: LaneOrder | None, quanta: dict[str, float]) -> DeficitRoundRobin:
    lane = DeficitRoundRobin()
    for tenant_id, quantum in quanta.items():
        lane.add_tenant(tenant_id, quantum)
    lane.order = order
    return lane


def _always(_: Job) -> bool:
    return True


def test_a_tenant_served_elsewhere_yields_here() -> None:
    order = LaneOrder()
    lane = _lane(order, {"a": 1000.0, "b": 1000.0})
    for i in range(14):
        lane.push(_job(f"a{i}", "a", 1000))
        lane.push(_job(f"b{i}", "b", 1000))
    # b joined behind a, both at 0: within the join window, unchanged.
    assert order.counter("b", 1000 * U) == 0.0
    order.pool_units["b"] = 10_000 * U  # a batch's answer: b got 10,000 tokens elsewhere
    picked = [lane.pick(_always) for _ in range(12)]
    # b's counter is 10 quanta: a (1 quantum per pick) is picked at 0, 1, ..., 10 (a tie goes
    # to the first in ring order: a), 11 picks, then b.
    assert [job.tenant_id for job in picked if job is not None] == ["a"] * 11 + ["b"]
    assert order.unsynced == {"a": 11_000 * U, "b": 1000 * U}
    assert lane.queued_units == 16_000 * U
    assert lane.backlogged_tenants() == ["a", "b"]


def test_plain_round_robin_alternates_on_the_same_jobs() -> None:
    """The baseline the test above differs from: no order, one quantum each per turn."""
    lane = _lane(None, {"a": 1000.0, "b": 1000.0})
    for i in range(4):
        lane.push(_job(f"a{i}", "a", 1000))
        lane.push(_job(f"b{i}", "b", 1000))
    assert [lane.pick(_always).tenant_id for _ in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]


def test_weights_divide_the_counters() -> None:
    order = LaneOrder()
    lane = _lane(order, {"heavy": 4000.0, "light": 1000.0})
    for i in range(50):
        lane.push(_job(f"h{i}", "heavy", 100))
        lane.push(_job(f"l{i}", "light", 100))
    served = {"heavy": 0, "light": 0}
    for _ in range(50):
        job = lane.pick(_always)
        assert job is not None
        served[job.tenant_id] += 1
    assert served == {"heavy": 40, "light": 10}


def test_an_ineligible_head_is_passed_over() -> None:
    order = LaneOrder()
    order.pool_units["b"] = 5000 * U
    lane = _lane(order, {"a": 1000.0, "b": 1000.0})
    lane.push(_job("a0", "a", 1000))
    lane.push(_job("b0", "b", 1000))
    job = lane.pick(lambda j: j.tenant_id != "a")
    assert job is not None
    assert job.tenant_id == "b"
    assert lane.pick(lambda j: False) is None
    last = lane.pick(_always)
    assert last is not None
    assert last.tenant_id == "a"
    assert lane.pick(_always) is None
    assert lane.active_quanta_units == 0
    assert not lane.active
    assert lane.queued_units == 0


def test_settlement_counts_the_overrun() -> None:
    order = LaneOrder()
    lane = _lane(order, {"a": 1000.0})
    lane.push(_job("a0", "a", 1000))
    assert lane.pick(_always) is not None
    lane.settle_units("a", 300 * U)  # used 300 tokens more than expected
    lane.settle_units("a", -500 * U)  # a refund
    assert order.service_units("a") == 800 * U
    assert order.unsynced_units == (1000 + 300 + 500) * U


def test_joining_clamps_into_the_window_around_the_least_counter() -> None:
    order = LaneOrder()
    order.pool_units.update({"old": 100_000 * U, "idle": 0, "busy": 50_000 * U})
    lane = _lane(order, {"busy": 1000.0, "old": 1000.0, "idle": 1000.0})
    lane.push(_job("busy0", "busy", 10))  # alone: no clamp
    assert order.counter("busy", 1000 * U) == 50.0
    lane.push(_job("old0", "old", 10))
    assert order.counter("old", 1000 * U) == 50.0 + JOIN_GAP_QUANTA
    lane.push(_job("idle0", "idle", 10))
    assert order.counter("idle", 1000 * U) == 50.0 - JOIN_LAG_QUANTA
    # the clamp is an offset: service still moves the counter one for one
    order.served("idle", 2000 * U)
    assert order.counter("idle", 1000 * U) == 52.0 - JOIN_LAG_QUANTA


def _sync_alone(pool: PoolService) -> None:
    """A batch answered by a store that only this replica writes (nothing moved elsewhere)."""
    batch = pool.take_batch(([], []), now_ms=0.0)
    totals = tuple(
        [lane.pool_units.get(tenant_id, 0) // U + tokens for tenant_id, tokens in entries]
        for lane, entries in zip(pool.lanes, batch, strict=True)
    )
    pool.absorb(batch, totals)


def test_a_tenant_served_elsewhere_lately_is_not_clamped_when_it_rejoins() -> None:
    pool = PoolService()
    order = pool.lanes[0]
    lane = _lane(order, {"busy": 1000.0, "moving": 1000.0})
    order.pool_units.update({"busy": 50_000 * U, "moving": 10_000 * U})
    batch = pool.take_batch((["moving"], []), now_ms=0.0)
    pool.absorb(batch, ([30_000], []))  # moving got 20,000 tokens elsewhere: active
    lane.push(_job("busy0", "busy", 10))
    lane.push(_job("moving0", "moving", 10))  # 20 quanta behind busy, but not idle
    assert order.counter("moving", 1000 * U) == 30.0
    for _ in range(IDLE_EPOCHS + 1):  # batches in which moving is neither served nor moves
        _sync_alone(pool)
    assert lane.pick(lambda j: j.tenant_id == "moving") is not None  # served here: active again
    assert lane.pick(_always) is not None  # busy's job; both queues are empty now
    for _ in range(IDLE_EPOCHS + 1):
        _sync_alone(pool)
    lane.push(_job("busy1", "busy", 10))
    lane.push(_job("moving1", "moving", 10))  # idle for 3 batches: clamped to busy - 4 quanta
    assert order.counter("moving", 1000 * U) == order.counter("busy", 1000 * U) - JOIN_LAG_QUANTA


def test_the_store_down_means_the_round_robin_and_service_still_counted() -> None:
    order = LaneOrder()
    order.pool_units["b"] = 10_000 * U
    order.sharing = False
    lane = _lane(order, {"a": 1000.0, "b": 1000.0})
    for i in range(2):
        lane.push(_job(f"a{i}", "a", 1000))
        lane.push(_job(f"b{i}", "b", 1000))
    assert [lane.pick(_always).tenant_id for _ in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]
    assert order.unsynced == {"a": 2000 * U, "b": 2000 * U}


def test_batches_send_whole_tokens_and_absorb_the_totals() -> None:
    pool = PoolService()
    interactive = pool.lanes[0]
    interactive.served("a", 1500 * U + 7)  # 1500 tokens and a remainder
    interactive.served("b", -(20 * U))  # a refund
    batch = pool.take_batch((["a", "c"], []), now_ms=10.0)
    assert batch == ([("a", 1500), ("b", -20), ("c", 0)], [])
    assert interactive.unsynced == {"a": 7}
    assert interactive.unsynced_units == 7
    assert interactive.service_units("a") == 1500 * U + 7  # pushing still counts
    pool.absorb(batch, ([4000, 980, 12], []))  # the others' service is in the totals
    assert interactive.pushing_units == {}
    assert interactive.service_units("a") == 4000 * U + 7
    assert interactive.service_units("b") == 980 * U
    assert interactive.service_units("c") == 12 * U
    assert pool.synced_at_ms == 10.0


def test_a_lost_answer_keeps_the_service_here_and_is_not_sent_again() -> None:
    pool = PoolService()
    pool.lanes[1].served("a", 300 * U)
    batch = pool.take_batch(([], []), now_ms=0.0)
    pool.lost(batch)
    assert pool.lanes[1].pool_units == {"a": 300 * U}
    assert pool.lanes[1].pushing_units == {}
    assert pool.take_batch(([], []), now_ms=1.0) == ([], [])


def test_due_on_tokens_or_on_time_with_work() -> None:
    pool = PoolService()
    assert not pool.due(0.0, 500.0, 1000, ([], []))  # never synced, but nothing to do
    pool.take_batch(([], []), now_ms=0.0)
    assert not pool.due(499.0, 500.0, 1000, (["a", "b"], []))  # too early
    assert not pool.due(600.0, 500.0, 1000, (["a"], []))  # nothing to send, nobody to order
    assert pool.due(600.0, 500.0, 1000, (["a", "b"], []))  # two to order
    pool.lanes[0].served("a", 10 * U)
    assert pool.due(600.0, 500.0, 1000, (["a"], []))  # something to send
    assert not pool.due(100.0, 500.0, 1000, ([], []))
    pool.lanes[1].served("a", 990 * U)
    assert pool.due(100.0, 500.0, 1000, ([], []))  # a lease's worth of service


def test_the_scheduler_hook_installs_and_removes_the_order() -> None:
    config = build_config(PolicyConfig(), (TenantConfig("a", 1.0, 10**6, 10**5, "interactive"),))
    scheduler = TokenfairScheduler(config)
    pool = PoolService()
    scheduler.share_pool_service(pool)
    scheduler.submit(Request("r0", "a", 0.0, 100, 10, "interactive"), 0.0)
    assert pool.backlogged() == (["a"], [])
    decision = scheduler.next_dispatch(0.0)
    assert decision is not None
    assert decision.status_code == 200
    assert pool.lanes[0].service_units("a") > 0
    scheduler.share_pool_service(None)
    assert all(lane.order is None for lane in scheduler._lanes)
