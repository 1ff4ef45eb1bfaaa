"""Weighted deficit round robin: hand-calculated departure orders, directly and via the scheduler.

Behaviours under test (``core/drr.py``, then ``TokenfairScheduler`` on a fake clock):

* weights 2:1 with equal costs give a 2:1 departure pattern;
* a request dearer than a quantum waits until the deficit covers its *full* cost, and that full
  cost is charged at once (never a slice);
* a tenant's deficit resets when its queue empties (idle tenants bank nothing);
* rounds in which nobody could send are skipped in one grant, equal to the textbook's rounds;
* an ineligible head is passed over without earning a quantum;
* FIFO inside a tenant, whatever the costs;
* cancellation removes lazily and keeps the live counts, the deficit and the books right;
* an unknown tenant or a duplicate request id is refused before any state changes, and so is
  a cancellation asked of a policy without one (the lesson's).

Quanta: ``Q = base_quantum_tokens * weight`` with the default base of 1200 service tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import (
    LESSON_POLICIES,
    Books,
    DuplicateRequestError,
    Request,
    UnknownTenantError,
    make_scheduler,
)
from tokenfair.core.drr import DeficitRoundRobin
from tokenfair.core.jobs import Job, JobState
from tokenfair.core.tokenfair import TokenfairScheduler

BASE_QUANTUM = 1200


def job(request_id: str, tenant_id: str, cost: int) -> Job:
    """A queued job whose DRR cost is ``cost`` service tokens (sizes do not matter to DRR)."""
    return Job(Request(request_id, tenant_id, 0.0, cost, 0, "interactive"), cost, 1)


def drr(**weights: float) -> DeficitRoundRobin:
    lane = DeficitRoundRobin()
    for tenant_id, weight in weights.items():
        lane.add_tenant(tenant_id, BASE_QUANTUM * weight)
    return lane


def always(_: Job) -> bool:
    return True


def drain(lane: DeficitRoundRobin, eligible: Callable[[Job], bool] = always) -> list[str]:
    order = []
    while (picked := lane.pick(eligible)) is not None:
        order.append(picked.request.request_id)
    return order


def test_weights_two_to_one_with_equal_costs() -> None:
    lane = drr(a=2.0, b=1.0)
    for i in range(8):
        lane.push(job(f"a{i}", "a", 600))
    for i in range(4):
        lane.push(job(f"b{i}", "b", 600))
    # Q_a = 2400 covers 4 requests of 600 per turn (D: 2400 -> 0), Q_b = 1200 covers 2.
    assert drain(lane) == [
        *["a0", "a1", "a2", "a3"],
        *["b0", "b1"],
        *["a4", "a5", "a6", "a7"],
        *["b2", "b3"],
    ]


def test_deficit_carries_over_while_backlogged() -> None:
    lane = drr(a=1.0, b=1.0)
    for i in range(4):
        lane.push(job(f"a{i}", "a", 640))
        lane.push(job(f"b{i}", "b", 640))
    # Turn 1: D = 1200 -> sends 640, D = 560 < 640 ends the turn (for a, then for b).
    # Turn 2: D = 560 + 1200 = 1760 -> sends two (1120, 480).
    # Turn 3: D = 480 + 1200 = 1680 -> sends the last one (1040), queue empty, D reset.
    assert drain(lane) == ["a0", "b0", "a1", "a2", "b1", "b2", "a3", "b3"]


def test_a_large_request_is_charged_its_full_cost() -> None:
    lane = drr(a=1.0, b=1.0)
    lane.push(job("big", "a", 4600))
    lane.push(job("a-small", "a", 640))
    for i in range(6):
        lane.push(job(f"b{i}", "b", 640))
    order = []
    deficits = []
    while (picked := lane.pick(always)) is not None:
        order.append(picked.request.request_id)
        deficits.append(lane.queues["a"].deficit)
    # a's turns: D = 1200, 2400, 3600 < 4600 (three turns pass); turn 4: D = 4800 >= 4600 sends
    # "big" and pays all 4600: D = 200 < 640, so "a-small" waits for turn 5 (D = 1400).
    # b meanwhile: turn 1 D=1200 sends b0 (560); turn 2 D=1760 sends b1, b2 (480); turn 3
    # D=1680 sends b3, b4 (400); turn 4 D=1600 sends b5 (960) and empties.
    assert order == ["b0", "b1", "b2", "b3", "b4", "big", "b5", "a-small"]
    assert deficits[order.index("big")] == 4800 - 4600
    # Never a slice: "big" left once, the deficit fell by exactly its cost.
    assert order.count("big") == 1


def test_deficit_resets_when_the_queue_empties() -> None:
    lane = drr(a=1.0, b=1.0)
    lane.push(job("a0", "a", 640))
    assert lane.pick(always) is not None
    # D would be 1200 - 640 = 560, but a is idle now: it banks nothing and leaves the rotation.
    assert lane.queues["a"].deficit == 0.0
    assert not lane.active
    # Back with a request of 1700: with the 560 banked it would go after 1 grant (560 + 1200 =
    # 1760), but from 0 it needs 2 grants, so b's 1200-token head (1 grant) goes first.
    lane.push(job("a1", "a", 1700))
    lane.push(job("b0", "b", 1200))
    assert drain(lane) == ["b0", "a1"]


def test_empty_rounds_are_granted_at_once() -> None:
    lane = drr(a=1.0, b=1.0)
    lane.push(job("a0", "a", 6000))
    lane.push(job("b0", "b", 9000))
    lane.push(job("b1", "b", 100))
    first = lane.pick(always)
    assert first is not None
    assert first.request.request_id == "a0"
    # Textbook DRR: a needs ceil(6000/1200) = 5 rounds, b ceil(9000/1200) = 8. After the pass of
    # round 1 (D = 1200 each) the skip grants min(ceil(4800/1200), ceil(7800/1200)) - 1 = 3 more
    # rounds at once (D = 4800 each); round 5 gives a 6000 and sends a0 (D = 0, a leaves).
    assert lane.queues["b"].deficit == 4 * 1200
    second = lane.pick(always)
    assert second is not None
    assert second.request.request_id == "b0"
    # b alone: turn 6 gives 6000 < 9000; skip ceil(3000/1200) - 1 = 2 rounds (8400); turn 8
    # gives 9600 and sends b0 (D = 600), and b1 (100) fits in the same turn (D = 500).
    assert lane.queues["b"].deficit == 8 * 1200 - 9000
    third = lane.pick(always)
    assert third is not None
    assert third.request.request_id == "b1"


def test_an_ineligible_head_earns_no_quantum() -> None:
    lane = drr(a=1.0, b=1.0)
    lane.push(job("a0", "a", 640))
    lane.push(job("b0", "b", 640))
    lane.push(job("b1", "b", 640))

    def not_a(candidate: Job) -> bool:
        return candidate.request.tenant_id != "a"

    picked = lane.pick(not_a)
    assert picked is not None
    assert picked.request.request_id == "b0"
    assert lane.queues["a"].deficit == 0.0  # passed over: no quantum, no turn
    assert lane.queues["b"].deficit == 1200 - 640
    # Nobody eligible: None, and nobody earns anything.
    assert lane.pick(lambda _: False) is None
    assert (lane.queues["a"].deficit, lane.queues["b"].deficit) == (0.0, 560.0)
    # a eligible again: b's turn ends (560 < 640), a gets its first quantum and goes.
    assert drain(lane) == ["a0", "b1"]


def test_a_throttled_tenant_banks_at_most_one_quantum() -> None:
    lane = drr(a=1.0, b=1.0)
    for i in range(300):
        lane.push(job(f"a{i}", "a", 100))
        lane.push(job(f"b{i}", "b", 100))
    # a's budget lets one request through per tick, b is never throttled. Were a's open turn
    # closed each time it became ineligible, it would earn 1200 per tick and spend 100, banking
    # 1100 a tick, then starve b with a long run of sends once unthrottled.
    throttled: set[str] = set()

    def budget(candidate: Job) -> bool:
        return candidate.request.tenant_id not in throttled

    for _tick in range(40):
        throttled.clear()
        for _ in range(4):
            picked = lane.pick(budget)
            assert picked is not None
            if picked.request.tenant_id == "a":
                throttled.add("a")
            # The DRR invariant 0 <= D < max_cost + Q holds throughout.
            assert 0 <= lane.queues["a"].deficit < 100 + 1200
    throttled.clear()
    run = "".join(request_id[0] for request_id in drain(lane)[:40])
    assert "a" * 13 not in run  # one turn is at most (1300 - 100) / 100 + 1 = 12 sends


def test_fifo_inside_a_tenant_whatever_the_costs() -> None:
    lane = drr(a=1.0)
    lane.push(job("a0", "a", 2000))
    lane.push(job("a1", "a", 100))
    lane.push(job("a2", "a", 100))
    # The cheap ones could go at once (1200 >= 100) but wait behind a0: D = 1200 < 2000, one
    # more turn (2400) sends a0 (400), a1 (300), a2 (200).
    assert drain(lane) == ["a0", "a1", "a2"]


def cancel(lane: DeficitRoundRobin, queued: Job) -> None:
    """What the scheduler does on cancel: mark the job, tell the lane (lazy removal)."""
    queued.state = JobState.CANCELLED
    lane.forget(queued)


def test_cancelled_jobs_are_skipped_lazily() -> None:
    lane = drr(a=1.0, b=1.0)
    a_jobs = [job(f"a{i}", "a", 640) for i in range(3)]
    for queued in a_jobs:
        lane.push(queued)
    lane.push(job("b0", "b", 640))
    cancel(lane, a_jobs[1])
    assert lane.queues["a"].live == 2
    assert len(lane.queues["a"].jobs) == 3  # behind the head: in the deque until it reaches it
    cancel(lane, a_jobs[0])
    assert len(lane.queues["a"].jobs) == 1  # the head leaves at once, and the dead job behind it
    assert drain(lane) == ["a2", "b0"]


def test_cancelling_every_queued_job_resets_the_tenant() -> None:
    lane = drr(a=1.0, b=1.0)
    a_jobs = [job(f"a{i}", "a", 640) for i in range(2)]
    for queued in a_jobs:
        lane.push(queued)
    lane.push(job("b0", "b", 640))
    lane.push(job("b1", "b", 640))
    first = lane.pick(always)
    assert first is not None
    assert first.request.request_id == "a0"
    assert lane.queues["a"].deficit == 560
    cancel(lane, a_jobs[1])
    # a has nothing live: its 560 is forfeited at once, as if its queue had emptied.
    assert lane.queues["a"].deficit == 0.0
    assert drain(lane) == ["b0", "b1"]
    assert not lane.active


# -- through the scheduler ------------------------------------------------------------------------


def config(*tenants: tuple[str, float]) -> Config:
    """Interactive tenants with budgets too large to matter and a wait limit that never fires."""
    return build_config(
        PolicyConfig(max_interactive_wait_ms=60_000.0),
        [
            TenantConfig(tenant_id, weight, 10**9, 1e9, "interactive")
            for tenant_id, weight in tenants
        ],
    )


def request(request_id: str, tenant_id: str, prefill: int, decode: int) -> Request:
    return Request(request_id, tenant_id, 0.0, prefill, decode, "interactive")


def run(scheduler: TokenfairScheduler, requests: Iterable[Request]) -> list[str]:
    """Submit everything at t=0, then dispatch and complete one request per millisecond."""
    for item in requests:
        assert scheduler.submit(item, 0.0) is None
    order = []
    now_ms = 0.0
    while (decision := scheduler.next_dispatch(now_ms)) is not None:
        assert decision.admitted
        order.append(decision.request_id)
        now_ms += 1.0
        scheduler.complete(decision.request_id, now_ms)
    assert scheduler.books() == Books(0, 0, 0, 0, 0)
    return order


def test_scheduler_weights_two_to_one() -> None:
    scheduler = TokenfairScheduler(config(("a", 2.0), ("b", 1.0)))
    # 200 prefill + 4 * 100 decode = 600 service tokens each.
    requests = [request(f"a{i}", "a", 200, 100) for i in range(8)]
    requests += [request(f"b{i}", "b", 200, 100) for i in range(4)]
    assert run(scheduler, requests) == [
        *["a0", "a1", "a2", "a3"],
        *["b0", "b1"],
        *["a4", "a5", "a6", "a7"],
        *["b2", "b3"],
    ]
    # Served 8 * 600 and 4 * 600: exactly the 2:1 of the weights.
    assert scheduler.tenants["a"].served_tokens == 4800
    assert scheduler.tenants["b"].served_tokens == 2400


def test_scheduler_charges_the_lesson_batch_request_in_full() -> None:
    scheduler = TokenfairScheduler(config(("rag", 1.0), ("chat", 1.0)))
    # The lesson's sizes: 3200 + 4 * 350 = 4600 against 280 + 4 * 90 = 640.
    requests = [request("big", "rag", 3200, 350)]
    requests += [request(f"c{i}", "chat", 280, 90) for i in range(6)]
    order = run(scheduler, requests)
    # As in test_a_large_request_is_charged_its_full_cost: four turns of 1200 for "big".
    assert order == ["c0", "c1", "c2", "c3", "c4", "big", "c5"]
    assert scheduler.tenants["rag"].served_tokens == 4600
    assert scheduler.tenants["chat"].served_tokens == 6 * 640


def test_scheduler_cancellation_keeps_the_books() -> None:
    scheduler = TokenfairScheduler(config(("a", 1.0), ("b", 1.0)))
    for i in range(3):
        assert scheduler.submit(request(f"a{i}", "a", 280, 90), 0.0) is None
    assert scheduler.submit(request("b0", "b", 280, 90), 0.0) is None
    blocks = 24  # ceil((280 + 90) / 16)
    assert scheduler.books() == Books(4, 4 * 640, 4 * blocks, 0, 0)
    cancelled = scheduler.cancel("a1", 5.0)
    assert cancelled is not None
    assert (cancelled.status_code, cancelled.reason, cancelled.queue_wait_ms) == (
        499,
        "cancelled",
        5.0,
    )
    assert scheduler.cancel("a1", 5.0) is None  # exactly one outcome
    assert scheduler.books() == Books(3, 3 * 640, 3 * blocks, 0, 0)
    order = []
    while (decision := scheduler.next_dispatch(6.0)) is not None:
        order.append(decision.request_id)
        scheduler.complete(decision.request_id, 6.0)
    # a: D = 1200 sends a0 (560); the cancelled a1 is skipped at the head; 560 < 640 ends the
    # turn; b0; then a2 on a's next quantum.
    assert order == ["a0", "b0", "a2"]
    assert scheduler.books() == Books(0, 0, 0, 0, 0)


def test_unknown_tenant_is_refused_before_any_state_changes() -> None:
    scheduler = TokenfairScheduler(config(("a", 1.0)))
    assert scheduler.submit(request("a0", "a", 280, 90), 0.0) is None
    before = scheduler.books()
    with pytest.raises(UnknownTenantError):
        scheduler.submit(request("x0", "nobody", 280, 90), 0.0)
    assert scheduler.books() == before
    assert "x0" not in scheduler.jobs
    assert "nobody" not in scheduler.tenants


def test_duplicate_request_id_is_refused_queued_or_running() -> None:
    scheduler = TokenfairScheduler(config(("a", 1.0), ("b", 1.0)))
    assert scheduler.submit(request("r1", "a", 280, 90), 0.0) is None
    with pytest.raises(DuplicateRequestError):
        scheduler.submit(request("r1", "b", 420, 60), 0.0)
    assert scheduler.books() == Books(1, 640, 24, 0, 0)
    decision = scheduler.next_dispatch(0.0)
    assert decision is not None
    assert decision.request_id == "r1"
    with pytest.raises(DuplicateRequestError):
        scheduler.submit(request("r1", "a", 280, 90), 0.0)
    assert scheduler.books() == Books(0, 0, 0, 1, 24)
    assert scheduler.tenants["b"].queued == 0


@pytest.mark.parametrize("policy", LESSON_POLICIES)
def test_cancel_on_a_policy_without_it_changes_nothing(policy: str) -> None:
    """The lesson's lab has no cancellation; asking for one must not corrupt the totals."""
    scheduler = make_scheduler(policy, config(("a", 1.0)))
    assert scheduler.submit(request("a0", "a", 280, 90), 0.0) is None
    before = scheduler.books()
    with pytest.raises(NotImplementedError):
        scheduler.cancel("a0", 1.0)
    assert scheduler.books() == before == Books(1, 640, 24, 0, 0)
    decision = scheduler.next_dispatch(1.0)
    assert decision is not None
    assert decision.request_id == "a0"
    scheduler.complete("a0", 2.0)
    assert scheduler.books() == Books(0, 0, 0, 0, 0)


# -- settlement in actual tokens, credit bookkeeping, joining ahead -----------------------------


def test_a_settled_overrun_is_a_debt_that_outlives_the_queue() -> None:
    lane = drr(a=1.0, b=1.0)
    lane.push(job("a0", "a", 400))
    assert drain(lane) == ["a0"]  # D_a: 0 + 1200 - 400 = 800, then the queue empties: credit 0
    assert lane.queues["a"].deficit == 0.0
    # a0 really used 4000: D_a = 0 - (4000 - 400) = -3600, kept although a is idle.
    lane.settle("a", 4000 - 400)
    assert lane.queues["a"].deficit == -3600.0
    for i in range(3):
        lane.push(job(f"a{i + 1}", "a", 400))
        lane.push(job(f"b{i}", "b", 400))
    # a needs ceil((400 + 3600) / 1200) = 4 quanta before it sends again; b sends 3 per quantum.
    # Pass 1: a: -3600 + 1200 = -2400 (short), b: 1200 -> b0 b1 b2 (D_b 0, queue empty).
    # Then a is alone: the empty rounds are granted at once (2 more: D_a = 0 + 1200 -> sends).
    assert drain(lane) == ["b0", "b1", "b2", "a1", "a2", "a3"]


def test_a_refund_is_a_credit_only_while_backlogged() -> None:
    lane = drr(a=1.0)
    lane.push(job("a0", "a", 400))
    assert drain(lane) == ["a0"]
    lane.settle("a", -300)  # used 100 of 400: a credit, but a is idle: dropped
    assert lane.queues["a"].deficit == 0.0
    lane.push(job("a1", "a", 400))
    lane.push(job("a2", "a", 400))
    assert lane.pick(always) is not None  # D_a = 1200 - 400 = 800, a2 still queued
    lane.settle("a", -300)  # backlogged: the credit stays
    assert lane.queues["a"].deficit == 800 + 300


def test_credit_tokens_is_the_sum_of_positive_deficits() -> None:
    lane = drr(a=1.0, b=2.0, c=0.5)
    costs = {"a": [500, 1700, 300], "b": [2600, 100], "c": [900, 900, 900]}
    for tenant_id, tenant_costs in costs.items():
        for i, cost in enumerate(tenant_costs):
            lane.push(job(f"{tenant_id}{i}", tenant_id, cost))

    def positive_sum() -> float:
        return sum(max(0.0, q.deficit) for q in lane.queues.values())

    while (picked := lane.pick(always)) is not None:
        assert lane.credit_tokens == pytest.approx(positive_sum())
        lane.settle(picked.request.tenant_id, 250)  # every request ran 250 tokens over
        assert lane.credit_tokens == pytest.approx(positive_sum())
    assert lane.credit_tokens == 0.0


def test_joining_ahead_sends_next_least_served_first() -> None:
    lane = drr(a=1.0, b=1.0, c=1.0, d=1.0)
    for i in range(3):
        lane.push(job(f"a{i}", "a", 600))
    lane.push(job("b0", "b", 600))
    assert lane.pick(always) is not None  # a's turn is open: D_a = 1200 - 600 = 600
    # c joins ahead with rank 0.5, d with rank 0.2: d goes before c, both before b (the tail).
    lane.push(job("c0", "c", 3000), join_ahead=0.5)
    lane.push(job("d0", "d", 1000), join_ahead=0.2)
    # What the ring sends before a tenant joining now with rank 0.3: a's open turn (its credit
    # 600, capped by its queued 1200), then d's lifted first turn (1000); not c (rank 0.5).
    assert lane.tokens_before_joining_ahead(0.3) == 600 + 1000
    # a finishes its turn (a1), then d and c send at once on lifted deficits (no quanta needed
    # for c's 3000), then b, then a.
    assert drain(lane) == ["a1", "d0", "c0", "b0", "a2"]
    assert lane.ahead_joiners == 0


def test_a_joiner_that_reaches_the_front_leaves_the_joiners_in_order() -> None:
    lane = drr(a=1.0, x=1.0, j=1.0, k=1.0)
    for request_id, tenant_id, cost in [("a0", "a", 400), ("a1", "a", 400), ("x0", "x", 600)]:
        lane.push(job(request_id, tenant_id, cost))
    lane.push(job("x1", "x", 600))
    assert drain_one(lane) == "a0"  # a's turn is open (D 800); x waits
    lane.push(job("j0", "j", 400), join_ahead=0.5)  # behind the front a, ahead of x
    assert drain_one(lane) == "a1"  # a's queue empties: a leaves and j is the front now
    assert lane.ahead_joiners == 0  # j's first turn has come: it no longer waits ahead
    # The front j may still send its lifted 400; k joins ahead of x's tail turn.
    assert lane.tokens_before_joining_ahead(0.9) == 400
    lane.push(job("k0", "k", 400), join_ahead=0.9)
    assert [q.tenant_id for q in lane.active] == ["j", "k", "x"]
    assert drain(lane) == ["j0", "k0", "x0", "x1"]


def test_a_queue_emptied_by_cancellations_banks_no_refund() -> None:
    lane = drr(a=1.0, b=1.0)
    a_jobs = [job(f"a{i}", "a", 300) for i in range(2)]
    for queued in a_jobs:
        lane.push(queued)
    lane.push(job("b0", "b", 300))
    assert drain_one(lane) == "a0"  # D_a = 1200 - 300 = 900, a1 still queued
    cancel(lane, a_jobs[1])  # a has nothing live: it leaves the ring
    lane.settle("a", -2900)  # a0 used nothing: the refund would be credit, but a is idle
    assert lane.queues["a"].deficit == 0.0
    assert lane.credit_tokens == pytest.approx(
        sum(max(0.0, q.deficit) for q in lane.queues.values())
    )


def drain_one(lane: DeficitRoundRobin) -> str:
    picked = lane.pick(always)
    assert picked is not None
    return picked.request.request_id


def test_a_queue_emptied_by_cancellation_leaves_the_ring_at_once() -> None:
    lane = drr(a=1.0, b=1.0, c=2.0)
    for tenant_id in "abc":
        lane.push(job(f"{tenant_id}0", tenant_id, 600))
    b0 = lane.queues["b"].jobs[0]
    cancel(lane, b0)
    # b is not backlogged any more, wherever it stood in the ring: admission must not count it.
    assert [q.tenant_id for q in lane.active] == ["a", "c"]
    assert not lane.queues["b"].in_active
    assert lane.active_quanta == BASE_QUANTUM * (1.0 + 2.0)
    # Its next request is that of a newcomer: it may join ahead — before the front even, as
    # a has not started its turn.
    lane.push(job("b1", "b", 600), join_ahead=0.1)
    assert [q.tenant_id for q in lane.active] == ["b", "a", "c"]
    assert lane.ahead_joiners == 0  # b's turn has come
    assert drain(lane) == ["b1", "a0", "c0"]


def test_a_joiner_goes_before_a_front_that_has_not_started_its_turn() -> None:
    lane = drr(a=1.0, b=1.0, j=1.0, k=1.0)
    lane.push(job("a0", "a", 600))
    lane.push(job("b0", "b", 600))
    assert lane.tokens_before_joining_ahead(0.5) == 0.0  # a has been granted nothing yet
    lane.push(job("j0", "j", 900), join_ahead=0.5)
    # Now j's turn is open at the front: a later joiner waits for j's lifted 900 only.
    assert lane.tokens_before_joining_ahead(0.1) == 900
    lane.push(job("k0", "k", 300), join_ahead=0.1)
    assert [q.tenant_id for q in lane.active] == ["j", "k", "a", "b"]
    assert drain(lane) == ["j0", "k0", "a0", "b0"]


def test_a_joiner_cancelled_before_its_first_turn_leaves_the_joiners() -> None:
    lane = drr(a=1.0, j=1.0, k=1.0, x=1.0)
    lane.push(job("a0", "a", 400))
    lane.push(job("a1", "a", 400))
    lane.push(job("x0", "x", 400))
    assert drain_one(lane) == "a0"  # a's turn is open with 800 left; a1 waits
    lane.push(job("j0", "j", 500), join_ahead=0.2)
    lane.push(job("k0", "k", 700), join_ahead=0.6)
    assert lane.ahead_joiners == 2
    cancel(lane, lane.queues["j"].jobs[0])
    assert lane.ahead_joiners == 1
    assert [q.tenant_id for q in lane.active] == ["a", "k", "x"]
    # Promised before a joiner of rank 0.9: a's open turn (its 400 queued) and k's lifted 700.
    assert lane.tokens_before_joining_ahead(0.9) == 400 + 700
    assert drain(lane) == ["a1", "k0", "x0"]
    assert lane.ahead_joiners == 0


def live_heads(lane: DeficitRoundRobin) -> list[float]:
    """Every tenant's first queued job, found without touching the queues (``head()`` pops)."""
    heads = []
    for queue in lane.queues.values():
        first = next((j for j in queue.jobs if j.state is JobState.QUEUED), None)
        if first is not None:
            heads.append(first.expected_tokens)
    return heads


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "pick", "cancel", "cancel_after"]),
            st.sampled_from("abcd"),
            st.integers(min_value=100, max_value=5000),
        ),
        max_size=300,
    ),
    st.integers(min_value=1, max_value=40),
)
def test_min_head_cost_is_the_cheapest_live_head_after_any_sequence(
    ops: list[tuple[str, str, int]], every: int
) -> None:
    """The heap behind ``min_head_cost`` against a scan of every live head, whatever mix of
    queueing, sending and cancelling (the scheduler cancels before it marks the job; the
    ``cancel`` helper marks it first: both orders). Asked only every ``every`` steps, so stale
    entries pile up and the heap is rebuilt between the questions too."""
    lane = drr(a=1.0, b=2.0, c=1.0, d=4.0)
    queued: list[Job] = []
    for step, (op, tenant_id, cost) in enumerate(ops):
        if op == "push":
            new = job(f"j{step}", tenant_id, cost)
            lane.push(new, join_ahead=0.5 if cost % 3 == 0 else None)
            queued.append(new)
        elif op == "pick":
            picked = lane.pick(always)
            if picked is not None:
                picked.state = JobState.DISPATCHED
                queued.remove(picked)
        elif queued:
            victim = queued.pop(cost % len(queued))
            if op == "cancel":
                cancel(lane, victim)
            else:
                lane.forget(victim)
                victim.state = JobState.CANCELLED
        if step % every == 0 or step == len(ops) - 1:
            heads = live_heads(lane)
            assert lane.min_head_cost() == (min(heads) if heads else None)


@pytest.mark.parametrize("forgotten", range(1, 120))
def test_forgetting_heads_keeps_the_next_head_indexed(forgotten: int) -> None:
    """The scheduler's order (``forget``, then the job is marked) through however many head
    cancellations it takes to rebuild the head-cost heap: the next head is never lost, so the
    cheapest head is still found (it was not: a rebuild during ``forget`` kept the departing
    head and dropped the next one)."""
    lane = drr(a=1.0, b=1.0)
    a_jobs = [job(f"a{i}", "a", 100) for i in range(forgotten + 1)]
    for queued in a_jobs:
        lane.push(queued)
    lane.push(job("b0", "b", 5000))
    for victim in a_jobs[:forgotten]:
        lane.forget(victim)
        victim.state = JobState.CANCELLED
    assert lane.min_head_cost() == 100
