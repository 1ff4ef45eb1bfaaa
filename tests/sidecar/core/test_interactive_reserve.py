"""The interactive reserve of a batching engine (``TokenfairScheduler.batch_slots``,
docs/capacity.md): a virtual clock throughout, no sleeping.

Behaviours under test:

- The rule by hand: ``batch_slots = S - min(S - max(1, ceil(s S)), 1 + round(rho S))`` with an
  interactive tenant configured, ``S`` without one; ``ceil(s S)`` is exact (``s = 0.3``,
  ``S = 10`` is 3, not the float product's 4); ``S = 1`` is 1.
- The dispatcher never starts a batch request while the batch lane holds ``batch_slots`` of
  the ``S`` slots, whatever arrives and ends (a seeded stream of both lanes); without an
  interactive tenant the batch lane takes every slot.
- An interactive arrival beside a batch flood finds the reserved slot free: predicted wait 0,
  admitted and dispatched at once (the flood held every slot before, and it was refused).
- The batch lane's predicted wait drains its queue at ``X(batch_slots)``, not at ``X(S)``,
  and waits for the engine's next end while it holds every slot it may.
- Batch work held back by the reserve is woken for when the reserve shrinks as the interactive
  demand fades (``next_wakeup_ms``): a dispatcher that sleeps until its next wake-up starts it
  then, instead of finding it at its deadline and expiring it.
"""

from __future__ import annotations

import random

import pytest
from scheduler_support import fill

from tokenfair.config import PolicyConfig, PriorityClass, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.jobs import LANE_BATCH, LANE_INTERACTIVE, STATUS_OK
from tokenfair.core.tokenfair import TokenfairScheduler

BIG_KV = 10**7  # blocks: KV never decides here


def tenants(interactive: bool = True) -> list[TenantConfig]:
    chosen = [TenantConfig("rag", 1.0, 10**12, 10**12, "batch")]
    if interactive:
        chosen += [
            TenantConfig("chat", 1.0, 10**12, 10**12, "interactive"),
            TenantConfig("ide", 1.0, 10**12, 10**12, "interactive"),
        ]
    return chosen


def scheduler(interactive: bool = True, **policy: object) -> TokenfairScheduler:
    settings: dict[str, object] = {"total_kv_blocks": BIG_KV, **policy}
    config = build_config(PolicyConfig(**settings), tenants(interactive))  # type: ignore[arg-type]
    return TokenfairScheduler(config)


def request(request_id: str, tenant: str, now_ms: float, prefill: int, decode: int) -> Request:
    lane: PriorityClass = "batch" if tenant == "rag" else "interactive"
    return Request(request_id, tenant, now_ms, prefill, decode, lane)


def admit_interactive(fair: TokenfairScheduler, count: int, prefill: int, decode: int) -> None:
    """``count`` interactive requests admitted, run and ended at 0 ms: demand on record."""
    for i in range(count):
        assert fair.submit(request(f"i{i}", "chat", 0.0, prefill, decode), 0.0) is None
        assert fair.next_dispatch(0.0) is not None
        fair.complete(f"i{i}", 0.0)


def test_the_rule_by_hand() -> None:
    # S = 8, s = 0.1: the batch lane's floor is max(1, ceil(0.8)) = 1, the reserve at most 7.
    assert scheduler(False, max_batch_requests=8).batch_slots(0.0) == 8  # no interactive tenant
    assert scheduler(max_batch_requests=1).batch_slots(0.0) == 1  # serial: no reserve
    fair = scheduler(max_batch_requests=8)
    assert fair.batch_slots(0.0) == 8 - 1  # no demand yet: the one free slot
    # 2 requests of 2000 + 4 x 500 = 4000 service tokens at 0 ms, time constant
    # maxBatchWaitMs 3500: rho = 8000 / 3500 / 45 = 0.0508; round(rho S) = round(0.41) = 0.
    admit_interactive(fair, 2, 2000, 500)
    assert fair.batch_slots(0.0) == 8 - 1
    # 3 of them: rho S = 12000 / 3500 / 45 * 8 = 0.61 -> reserve 1 + 1 = 2.
    admit_interactive(fair, 1, 2000, 500)
    assert fair.batch_slots(0.0) == 8 - 2
    # 13: rho S = 52000 / 3500 / 45 * 8 = 2.64 -> reserve 1 + 3 = 4.
    fair = scheduler(max_batch_requests=8)
    admit_interactive(fair, 13, 2000, 500)
    assert fair.batch_slots(0.0) == 8 - 4
    # The demand fades with the time constant: rho S = 2.64 e^(-t / 3500) is 2.5 at
    # 3500 ln(2.641 / 2.5) = 192 ms; at 200 ms it rounds to 2, the reserve is 3.
    assert fair.batch_slots(180.0) == 8 - 4
    assert fair.batch_slots(200.0) == 8 - 3
    # s = 0.5: the floor is ceil(4) = 4 slots, so the reserve stops at 4 however high rho.
    fair = scheduler(max_batch_requests=8, batch_min_share=0.5)
    admit_interactive(fair, 18, 2000, 500)  # rho S = 3.66: 1 + 4 = 5, capped at 8 - 4
    assert fair.batch_slots(0.0) == 4


def test_the_floor_is_the_exact_ceiling_of_the_share() -> None:
    # s = 0.3, S = 10: ceil(3) = 3 (0.3 * 10 is 3.0000000000000004 in floats: 4). A demand
    # above the whole throughput (rho capped at 1) asks for 1 + 10 slots; the floor keeps 3.
    fair = scheduler(max_batch_requests=10, batch_min_share=0.3)
    admit_interactive(fair, 1, 100_000, 20_000)  # 180,000 tokens: rho = 1.14
    assert fair.batch_slots(0.0) == 3


def test_the_batch_lane_never_holds_more_than_its_slots() -> None:
    # A seeded stream of both lanes on S = 6 (G = 3): batch at about 3x the engine's rate,
    # interactive at about a fifth of it; the running requests end in the order they started,
    # one every few ms. Every batch dispatch happens while the lane holds fewer than
    # batch_slots(now); the lane reaches its cap (the flood is real) and the reserve is used.
    fair = scheduler(max_batch_requests=6, batch_throughput_gain=3.0)
    rng = random.Random(27)
    batch_running: list[str] = []
    running: list[str] = []
    most_batch = 0
    reached = 0
    capped = 0
    now_ms = 0.0
    for step in range(3000):
        now_ms += rng.uniform(0.0, 10.0)
        if rng.random() < 0.6:
            fair.submit(request(f"b{step}", "rag", now_ms, 800, 160), now_ms)
        if rng.random() < 0.1:
            fair.submit(request(f"c{step}", "chat", now_ms, 200, 32), now_ms)
        fair.expire(now_ms)
        if running and rng.random() < 0.5:
            ended = running.pop(0)
            fair.complete(ended, now_ms)
            if ended in batch_running:
                batch_running.remove(ended)
        while fair.running < 6:
            slots = fair.batch_slots(now_ms)
            held = len(batch_running)
            decision = fair.next_dispatch(now_ms)
            if decision is None:
                capped += held >= slots and fair.queued_count[LANE_BATCH] > 0
                break
            assert decision.status_code == STATUS_OK
            running.append(decision.request_id)
            if decision.priority_class == "batch":
                assert held < slots, (now_ms, held, slots)
                batch_running.append(decision.request_id)
                most_batch = max(most_batch, len(batch_running))
                reached += len(batch_running) == slots
    assert reached > 100  # the cap was reached, often, and never passed
    assert most_batch < 6  # an interactive slot was always kept
    assert capped > 100  # and it held batch work back, often


def test_without_an_interactive_tenant_the_batch_lane_takes_every_slot() -> None:
    fair = scheduler(False, max_batch_requests=4)
    assert fair.batch_slots(0.0) == 4
    for i in range(6):
        assert fair.submit(request(f"b{i}", "rag", 0.0, 800, 160), 0.0) is None
    assert len(fill(fair, 0.0)) == 4


def flood(fair: TokenfairScheduler, count: int, prefill: int, decode: int) -> list[str]:
    for i in range(count):
        assert fair.submit(request(f"b{i}", "rag", 0.0, prefill, decode), 0.0) is None
    return fill(fair, 0.0)


def test_an_interactive_arrival_beside_a_batch_flood_starts_at_once() -> None:
    # S = 4, G = 1, R = 45: batch requests of 8000 + 4 x 2000 = 16,000 service tokens. Had
    # the flood taken all 4 slots (each at 45 / 4 per ms), the first would end at
    # 16000 / 11.25 = 1422 ms, beyond the interactive limit of 420 ms: refused
    # shed_queue_wait_slo. The reserve keeps one slot: the flood runs 3.
    fair = scheduler(max_batch_requests=4)
    started = flood(fair, 10, 8000, 2000)
    assert fair.predicted_wait_ms("chat", LANE_INTERACTIVE, 328, 5.0) == 0.0
    assert fair.submit(request("c", "chat", 5.0, 200, 32), 5.0) is None
    decision = fair.next_dispatch(5.0)
    assert decision is not None
    assert (decision.request_id, decision.queue_wait_ms) == ("c", 0.0)
    assert started == ["b0", "b1", "b2"]
    assert fair.queued_count[LANE_BATCH] == 7
    # The slot is the interactive lane's: when it ends, the flood still does not take it
    # (rho S = 328 / 3500 / 45 * 4 = 0.008: still one slot kept).
    assert fair.batch_slots(20.0) == 3
    fair.complete("c", 20.0)
    assert fair.next_dispatch(20.0) is None
    # A batch request's end frees one of the lane's own: the next of the flood starts.
    fair.complete("b0", 30.0)
    following = fair.next_dispatch(30.0)
    assert following is not None
    assert following.request_id == "b3"


def test_the_batch_lanes_wait_is_priced_at_the_throughput_of_its_slots() -> None:
    # S = 4, G = 4, R = 40: throughput linear in the batch, X(c) = 10 c; each request runs at
    # 10 per ms whatever runs beside it. The flood holds batch_slots = 3 (X(3) = 30), each
    # request 2000 + 4 x 500 = 4000 tokens: the first ends at 400 ms.
    fair = scheduler(max_batch_requests=4, batch_throughput_gain=4.0, service_tokens_per_ms=40.0)
    flood(fair, 8, 2000, 500)
    # A new batch request of the one batch tenant waits for the five queued ahead of it: the
    # engine's next end (400 ms), then 20,000 tokens at X(3) = 30 per ms, not X(4) = 40.
    wait_ms = fair.predicted_wait_ms("rag", LANE_BATCH, 4000, 0.0)
    assert wait_ms == pytest.approx(400.0 + 20_000 / 30.0)
    assert wait_ms != pytest.approx(400.0 + 20_000 / 40.0)
    assert fair.batch_slots(0.0) == fair._batch_running == 3
    assert fair.queued_tokens[LANE_BATCH] == 5 * 4000
    # Nothing queued behind the three it holds: it waits for the next end (the fourth slot
    # is the interactive lane's), where it was predicted 0 (a slot free) before.
    alone = scheduler(max_batch_requests=4, batch_throughput_gain=4.0, service_tokens_per_ms=40.0)
    assert flood(alone, 3, 2000, 500) == ["b0", "b1", "b2"]
    assert alone.predicted_wait_ms("rag", LANE_BATCH, 4000, 100.0) == pytest.approx(300.0)


def test_batch_work_held_by_the_reserve_starts_when_the_reserve_shrinks() -> None:
    # Heavy interactive demand on record at 0 ms (all of it ended): the reserve keeps 7 of the
    # 8 slots. Three batch requests of 10,000 service tokens arrive; one starts, two wait.
    fair = scheduler(max_batch_requests=8)
    admit_interactive(fair, 40, 2000, 500)
    assert fair.batch_slots(0.0) == 1
    for i in range(3):
        assert fair.submit(request(f"b{i}", "rag", 0.0, 2000, 2000), 0.0) is None
    assert fill(fair, 0.0) == ["b0"]
    # The dispatcher's loop: sleep until the next wake-up, expire what is due, dispatch.
    now_ms, started, expired = 0.0, [], []
    while fair.books().queued_requests:
        wake_ms = fair.next_wakeup_ms(now_ms)
        assert wake_ms is not None
        assert wake_ms > now_ms
        slots_before = fair.batch_slots(now_ms)
        now_ms = wake_ms
        expired += [decision.request_id for decision in fair.expire(now_ms)]
        newly = fill(fair, now_ms)
        if newly:
            # Woken the moment the reserve shrank (and not merely at some later time).
            assert fair.batch_slots(now_ms) > slots_before
            assert fair.batch_slots(now_ms - 1e-3) == slots_before
        started += newly
    assert expired == []
    assert started == ["b1", "b2"]
    assert now_ms < fair.policy.max_batch_wait_ms  # before the first deadline
