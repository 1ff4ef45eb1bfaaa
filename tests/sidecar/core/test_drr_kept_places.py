"""A head that needs more room than there is keeps its tenant's place in the round robin (issue 29).

Behaviours under test (``core/drr.py``, ``pick(eligible, need, room)``; docs/fairness.md §5.5,
change 9):

* a head passed over because it needs more than ``room`` goes back right behind the front
  when another head is sent, ahead of the tenants that join ahead later (before: to the
  ring's tail, behind every later joiner);
* a pick that sends nothing leaves the ring and the kept marks as they were, and a later
  joiner still goes after the kept tenants;
* a kept tenant that becomes the front when the front leaves keeps its mark: a joiner goes
  behind it, not before it;
* at most ``max_kept`` tenants keep their place; the others go to the tail;
* while ``room`` is below the least need among the kept heads, ``eligible`` is not asked of
  them;
* ``tokenfair``'s room (``kv_room_blocks``) is exactly the threshold of ``kv_fits``;
* on random operations the books stay consistent (the joiners and kept tenants sit where
  their lists say, the kept count is right) and a pick's choice is never a head that needs
  more than ``room``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from scheduler_support import fill

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.drr import DeficitRoundRobin
from tokenfair.core.jobs import LANE_BATCH, Job, JobState
from tokenfair.core.pool_order import LaneOrder
from tokenfair.core.tokenfair import TokenfairScheduler

BASE_QUANTUM = 1200


def job(request_id: str, tenant_id: str, cost: int) -> Job:
    """A queued job whose DRR cost is ``cost`` service tokens; its need is looked up by id."""
    return Job(Request(request_id, tenant_id, 0.0, cost, 0, "batch"), cost, 1)


def drr(max_kept: int = 8, **weights: float) -> DeficitRoundRobin:
    lane = DeficitRoundRobin(max_kept)
    for tenant_id, weight in weights.items():
        lane.add_tenant(tenant_id, BASE_QUANTUM * weight)
    return lane


class Room:
    """A KV cache in miniature: each request needs ``needs[id]`` blocks (1 if not listed);
    ``free`` blocks are free; ``asked`` counts ``eligible`` calls by request id."""

    def __init__(self, free: int, **needs: int) -> None:
        self.free = free
        self.needs = needs
        self.asked: dict[str, int] = {}

    def need(self, head: Job) -> int:
        return self.needs.get(head.request.request_id, 1)

    def eligible(self, head: Job) -> bool:
        request_id = head.request.request_id
        self.asked[request_id] = self.asked.get(request_id, 0) + 1
        return self.need(head) <= self.free

    def room(self) -> int:
        return self.free

    def pick(self, lane: DeficitRoundRobin) -> str | None:
        picked = lane.pick(self.eligible, self.need, self.room)
        return None if picked is None else picked.request.request_id

    def drain(self, lane: DeficitRoundRobin) -> list[str]:
        order = []
        while (picked := self.pick(lane)) is not None:
            order.append(picked)
        return order


def ring(lane: DeficitRoundRobin) -> list[str]:
    return [queue.tenant_id for queue in lane.active]


def test_a_blocked_head_keeps_its_place_ahead_of_a_later_joiner() -> None:
    lane = drr(big=1.0, x=1.0, j=1.0, k=1.0)
    lane.push(job("big0", "big", 1000), join_ahead=0.0)  # alone: it is the front
    lane.push(job("x0", "x", 400))
    lane.push(job("x1", "x", 400))
    room = Room(10, big0=50)
    assert room.pick(lane) == "x0"
    # big kept its place behind the front x, the first of the tenants waiting ahead.
    assert ring(lane) == ["x", "big"]
    assert lane.queues["big"].kept
    assert lane.kept_tenants == 1
    assert lane.ahead_joiners == 1
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    lane.push(job("k0", "k", 300), join_ahead=0.0)
    assert ring(lane) == ["x", "big", "j", "k"]
    # What a joiner now waits for counts big's turn (its lifted deficit, 1000) after x's open
    # turn (its credit 800 capped by its queued 400).
    assert lane.tokens_before_joining_ahead(0.0) == 400 + 1000 + 300 + 300
    room.free = 50  # the cache has room now: big goes before the later joiners
    assert room.drain(lane) == ["x1", "big0", "j0", "k0"]
    assert lane.ahead_joiners == 0
    assert lane.kept_tenants == 0


def test_without_need_a_passed_over_head_goes_to_the_tail() -> None:
    # The interactive lane (no `need`): as before, a later joiner passes a passed-over head.
    lane = drr(big=1.0, x=1.0, j=1.0)
    lane.push(job("big0", "big", 1000), join_ahead=0.0)
    lane.push(job("x0", "x", 400))
    lane.push(job("x1", "x", 400))
    room = Room(10, big0=50)
    picked = lane.pick(room.eligible)
    assert picked is not None
    assert picked.request.request_id == "x0"
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    room.free = 50
    order = []
    while (picked := lane.pick(room.eligible)) is not None:
        order.append(picked.request.request_id)
    assert order == ["x1", "j0", "big0"]


def test_the_place_survives_a_pick_where_every_head_is_blocked() -> None:
    lane = drr(big=1.0, x=1.0, j=1.0)
    lane.push(job("big0", "big", 1000), join_ahead=0.0)
    lane.push(job("x0", "x", 400))
    lane.push(job("x1", "x", 400))
    room = Room(10, big0=50, x1=50)
    assert room.pick(lane) == "x0"
    assert ring(lane) == ["x", "big"]
    # Nothing fits: the ring turns through every tenant and sends nothing.
    assert room.pick(lane) is None
    assert ring(lane) == ["x", "big"]
    # x, blocked at the front, keeps the front; big is still the first waiting ahead.
    assert lane.queues["x"].kept
    assert lane.queues["big"].kept
    assert lane.ahead_joiners == 1
    assert lane.kept_tenants == 2
    assert room.pick(lane) is None  # and again
    assert ring(lane) == ["x", "big"]
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    assert ring(lane) == ["x", "big", "j"]  # the joiner goes after the kept tenants
    room.free = 50
    assert room.drain(lane) == ["x1", "big0", "j0"]


def test_the_place_survives_the_front_leaving() -> None:
    lane = drr(big=1.0, x=1.0, j=1.0)
    lane.push(job("big0", "big", 1000))  # alone: the front, its turn not started
    lane.push(job("x0", "x", 400))
    lane.push(job("x1", "x", 400))
    room = Room(10, big0=50)
    assert room.pick(lane) == "x0"
    assert room.pick(lane) == "x1"  # x sent its last request and left: big is the front
    assert ring(lane) == ["big"]
    big = lane.queues["big"]
    assert big.kept
    assert not big.turn_open
    # A front that has not started its turn would let a joiner go before it; a kept one not.
    assert lane.tokens_before_joining_ahead(0.0) == 1000
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    assert ring(lane) == ["big", "j"]
    room.free = 50
    assert room.drain(lane) == ["big0", "j0"]


def test_at_most_max_kept_tenants_keep_their_place() -> None:
    lane = drr(2, a=1.0, b=1.0, c=1.0, x=1.0, j=1.0)
    for tenant_id in "abc":
        lane.push(job(f"{tenant_id}0", tenant_id, 500))
    lane.push(job("x0", "x", 400))
    lane.push(job("x1", "x", 400))
    room = Room(10, a0=50, b0=50, c0=50)
    assert room.pick(lane) == "x0"
    # a and b keep their place; c, over the bound, went to the tail as before.
    assert ring(lane) == ["x", "a", "b", "c"]
    assert lane.kept_tenants == 2
    assert not lane.queues["c"].kept
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    assert ring(lane) == ["x", "a", "b", "j", "c"]
    assert lane.kept_tenants == 2


def test_kept_heads_are_not_asked_while_room_is_below_their_least_need() -> None:
    lane = drr(a=1.0, b=1.0, x=1.0)
    lane.push(job("a0", "a", 500))
    lane.push(job("b0", "b", 500))
    for i in range(7):
        lane.push(job(f"x{i}", "x", 400))  # three a turn of x (quantum 1200)
    room = Room(10, a0=40, b0=30)
    assert room.pick(lane) == "x0"
    assert ring(lane) == ["x", "a", "b"]
    assert room.asked == {"a0": 1, "b0": 1, "x0": 1}
    # x's turn, then its next one: a and b are met at the front but not asked (free 10 < 30).
    assert [room.pick(lane) for _ in range(3)] == ["x1", "x2", "x3"]
    assert room.asked["a0"] == 1
    assert room.asked["b0"] == 1
    assert ring(lane) == ["x", "a", "b"]
    room.free = 35  # b fits now
    assert [room.pick(lane) for _ in range(2)] == ["x4", "x5"]  # x's turn goes on first
    assert room.asked["a0"] == 1
    assert room.asked["b0"] == 1
    # x's turn is spent: both kept heads are asked in ring order; b goes, a keeps its place
    # where b stood (b left), before x.
    assert room.pick(lane) == "b0"
    assert room.asked["a0"] == 2
    assert room.asked["b0"] == 2
    assert ring(lane) == ["a", "x"]
    assert lane.queues["a"].kept
    assert lane.kept_tenants == 1
    room.free = 40
    assert room.drain(lane) == ["a0", "x6"]


def check_books(lane: DeficitRoundRobin) -> None:
    """The joiners and kept tenants sit where the lists say; the kept count is right."""
    active = list(lane.active)
    waiting = lane.ahead_joiners
    for index, queue in enumerate(active):
        assert queue.in_active
        assert queue.joined_ahead == (1 <= index <= waiting)
    kept = [index for index, queue in enumerate(active) if queue.kept]
    assert kept == list(range(kept[0], kept[0] + len(kept))) if kept else True
    if kept:
        assert kept[0] in (0, 1)
    assert lane.kept_tenants == len(kept) <= lane.max_kept
    assert all(queue.kept == (index in kept) for index, queue in enumerate(active))
    assert not any(queue.kept for queue in lane.queues.values() if not queue.in_active)


@pytest.mark.parametrize("max_kept", [1, 3])  # 1: the shipped KEPT_PLACES_MAX
def test_random_operations_keep_the_books_and_send_only_what_fits(max_kept: int) -> None:
    rng = random.Random(29)
    tenants = [f"t{i}" for i in range(8)]
    lane = drr(max_kept, **{tenant_id: rng.choice([0.5, 1.0, 2.0]) for tenant_id in tenants})
    needs: dict[str, int] = {}
    live: list[Job] = []
    sent = 0
    for step in range(6000):
        roll = rng.random()
        if roll < 0.45:
            tenant_id = rng.choice(tenants)
            request_id = f"r{step}"
            needs[request_id] = rng.choice([1, 1, 2, 5, 20, 40])
            queued = job(request_id, tenant_id, rng.choice([100, 400, 1500, 5000]))
            join = 0.0 if rng.random() < 0.5 and not lane.queues[tenant_id].in_active else None
            lane.push(queued, join_ahead=join)
            live.append(queued)
        elif roll < 0.5 and live:
            victim = live.pop(rng.randrange(len(live)))
            lane.forget(victim)
            victim.state = JobState.CANCELLED
        else:
            free = rng.choice([0, 3, 10, 50])
            room = Room(free, **needs)
            blocked: Callable[[Job], bool] = room.eligible
            if rng.random() < 0.2:  # held for another reason too (a budget)

                def blocked(head: Job, inner: Callable[[Job], bool] = room.eligible) -> bool:
                    return inner(head) and not head.request.request_id.endswith("7")

            picked = lane.pick(blocked, room.need, room.room)
            if picked is not None:
                assert room.need(picked) <= free
                picked.state = JobState.DISPATCHED
                live.remove(picked)
                sent += 1
        check_books(lane)
    assert sent > 1000


@pytest.mark.parametrize(
    ("total", "watermark"), [(1600, 0.65), (1000, 0.7), (97, 0.33), (4096, 0.1), (7, 1.0)]
)
def test_the_room_is_exactly_what_kv_fits_lets_in(total: int, watermark: float) -> None:
    # `tokenfair` skips its kept heads while their need is above `kv_room_blocks`: the room
    # must be the float test's own threshold, or a head that fits would be skipped.
    policy = PolicyConfig(
        total_kv_blocks=total, batch_kv_watermark=watermark, interactive_kv_watermark=1.0
    )
    tenants = [TenantConfig("t", 1.0, 10**12, 10**12, "batch")]
    fair = TokenfairScheduler(build_config(policy, tenants))
    for resident in range(0, total + 3, max(1, total // 37)):
        fair.resident_blocks = resident
        room = fair.kv_room_blocks(LANE_BATCH)
        for blocks in (room - 1, room, room + 1):
            request = Job(Request("r", "t", 0.0, 10, 0, "batch"), 10, blocks)
            assert fair.kv_fits(request) == (blocks <= room), (resident, blocks, room)


def test_a_head_its_tenants_own_limit_holds_does_not_take_the_kept_place() -> None:
    # "capped" (maxConcurrentRequests 1) runs c0; its c1 and big's b0 both need more KV than
    # is free. c1 waits for its tenant's cap, not for KV: it goes to the tail, and the one kept
    # place is b0's (review rev1207h F2: c1 took it, and b0 went to the tail).
    policy = PolicyConfig(
        max_batch_requests=4, batch_throughput_gain=2.0, interactive_kv_watermark=1.0
    )
    tenants = [
        TenantConfig("capped", 1.0, 10**12, 10**12, "batch", max_concurrent_requests=1),
        TenantConfig("big", 1.0, 10**12, 10**12, "batch"),
    ]
    fair = TokenfairScheduler(build_config(policy, tenants))
    assert fair.submit(Request("c0", "capped", 0.0, 8000, 1000, "batch"), 0.0) is None
    assert fill(fair, 0.0) == ["c0"]
    assert fair.submit(Request("c1", "capped", 1.0, 8000, 1000, "batch"), 1.0) is None
    assert fair.submit(Request("b0", "big", 2.0, 8000, 1000, "batch"), 2.0) is None
    assert fill(fair, 2.0) == []
    lane = fair._lanes[LANE_BATCH]
    assert fair.kv_gate_job_blocks(lane.queues["big"].jobs[0]) > fair.kv_room_blocks(LANE_BATCH)
    assert {queue.tenant_id: queue.kept for queue in lane.active} == {
        "capped": False,
        "big": True,
    }


def test_a_kept_head_the_pool_wide_order_sends_leaves_no_kept_mark() -> None:
    # k's head k0 is blocked (50 blocks, 10 free) and keeps its place; with the pool-wide
    # order sharing, 60 free, the order sends k0. The mark went with it: when the store goes
    # down and the round robin takes over, k holds no kept place for a head long gone
    # (review rev1207h F3: it held the only place, and its -inf rank, ahead of joiners).
    lane = drr(1, k=1.0, x=1.0, j=1.0)
    for queued in (job("k0", "k", 1000), job("k1", "k", 1000), job("x0", "x", 400)):
        lane.push(queued)
    room = Room(10, k0=50)
    assert room.pick(lane) == "x0"
    assert lane.queues["k"].kept
    order = LaneOrder()
    lane.set_order(order)
    order.sharing = True
    room.free = 60
    assert room.pick(lane) == "k0"
    assert not lane.queues["k"].kept
    assert lane.kept_tenants == 0
    order.sharing = False
    lane.push(job("j0", "j", 300), join_ahead=0.0)
    check_books(lane)
