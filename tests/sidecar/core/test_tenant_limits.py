"""Entitlements beside the token budget: ``maxConcurrentRequests`` and ``maxKvShare``.

Behaviours under test (``tokenfair``, the policy that enforces them; docs/fairness.md):

* a tenant at its limit never delays another tenant's dispatch: on random traces with the core
  on a virtual clock, whenever a slot is free and the dispatcher gets nothing, no other
  tenant has a head that could start (it would pass its KV watermark, or the batch lane holds
  every slot the interactive reserve leaves it — the reserve computed by the test's own model,
  in which a request of ``a`` admitted while ``a``'s running and queued requests fill its
  ``maxConcurrentRequests`` counts in the interactive demand only when it starts) — property
  test, and the flood of one interactive tenant held at one request beside a batch backlog;
* the limited tenant never runs more than ``maxConcurrentRequests`` requests nor holds more than
  ``maxKvShare`` of the pool's KV blocks, and its DRR deficit stays below ``quantum + largest
  cost`` however long it is held (it earns no quantum while passed over);
* a request held at expiry is refused with the limit's reason and values; one that alone is
  above the tenant's KV share is refused at admission (400 before it, for the sidecar); a
  dispatched request that was held says so in its record;
* a reload adopts, changes and lifts the limits without dropping work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.config import Config, PolicyConfig, PriorityClass, TenantConfig, build_config
from tokenfair.core import Decision, Request
from tokenfair.core.jobs import SHED_QUEUE_TIMEOUT
from tokenfair.core.scheduler import OVER_TENANT_KV_SHARE
from tokenfair.core.shares import DemandRate
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.core.units import UNITS_PER_TOKEN

SLOTS = 4  # the engine's maxBatchRequests: the driver keeps at most this many running
CLASSES: tuple[PriorityClass, ...] = ("interactive", "interactive", "batch", "batch")
UNLIMITED_BUDGET = (10**12, 10**12)  # burst, rate: budgets never hold anything here


def limited_config(
    max_running: int | None,
    max_kv_share: float | None,
    limited_class: PriorityClass = "interactive",
    **policy: object,
) -> Config:
    """Tenant ``a`` (``limited_class``) carries the limits; ``t0``..``t3`` none."""
    burst, rate = UNLIMITED_BUDGET
    tenants = [
        TenantConfig(
            "a",
            1.0,
            burst,
            float(rate),
            limited_class,
            max_concurrent_requests=max_running,
            max_kv_share=max_kv_share,
        )
    ]
    tenants += [
        TenantConfig(f"t{i}", 1.0 + i % 2, burst, float(rate), klass)
        for i, klass in enumerate(CLASSES)
    ]
    settings_: dict[str, object] = {
        "max_batch_requests": SLOTS,
        "batch_throughput_gain": 2.0,
        "max_interactive_wait_ms": 2_000.0,
        "max_batch_wait_ms": 8_000.0,
    }
    settings_.update(policy)
    return build_config(PolicyConfig(**settings_), tenants)  # type: ignore[arg-type]


@st.composite
def traces(draw: st.DrawFn) -> list[Request]:
    """The limited tenant floods (about half the requests); the others send alongside."""
    count = draw(st.integers(5, 60))
    arrival_ms = 0.0
    requests = []
    for i in range(count):
        arrival_ms += draw(st.sampled_from([0.0, 0.0, 2.0, 10.0, 50.0, 200.0]))
        if draw(st.booleans()):
            tenant, klass = "a", None
        else:
            index = draw(st.integers(0, len(CLASSES) - 1))
            tenant, klass = f"t{index}", CLASSES[index]
        requests.append(
            Request(
                f"r{i:03d}",
                tenant,
                arrival_ms,
                draw(st.integers(1, 3_000)),
                draw(st.integers(0, 400)),
                klass or "interactive",
            )
        )
    return requests


def _others_can_start(
    scheduler: TokenfairScheduler, now_ms: float, batch_slots: int | None = None
) -> list[str]:
    """Heads of tenants other than ``a`` that nothing but the dispatcher keeps from starting
    now: their KV fits their watermark and, in the batch lane, a slot is left to batch
    (``batch_slots``: the model's, :class:`ReserveModel`; default the scheduler's)."""
    if batch_slots is None:
        batch_slots = scheduler.batch_slots(now_ms)
    ready = []
    for lane_index, lane in enumerate(scheduler._lanes):
        if lane_index == 1 and scheduler.batch_running >= batch_slots:
            continue
        for tenant_id, queue in lane.queues.items():
            head = queue.head()
            if tenant_id != "a" and head is not None and scheduler.kv_fits(head):
                ready.append(head.request_id)
    return ready


class ReserveModel:
    """The interactive reserve as docs/capacity.md states it, with the tenant limits: the
    batch lane's slots ``S - min(S - floor, n + round(rho * S))``, where ``rho`` counts each
    admitted interactive request at admission, except one of ``a`` admitted while ``a``'s
    running and queued requests fill its ``maxConcurrentRequests``: that one counts when it
    starts (the demand ``a`` cannot run does not shrink the others' batch slots); ``n`` is 0
    only while every interactive tenant runs its ``maxConcurrentRequests``."""

    def __init__(self, config: Config, slots: int) -> None:
        policy = config.policy
        self.config = config
        self.slots = slots
        self.tau_ms = policy.max_batch_wait_ms
        self.rate = policy.service_tokens_per_ms
        self.floor = max(1, math.ceil(round(policy.batch_min_share * slots, 9)))
        self.interactive = [t for t in config.tenants if t.priority_class == "interactive"]
        self.demand = DemandRate()
        self.deferred: set[str] = set()

    def defers(self, scheduler: TokenfairScheduler, request: Request) -> bool:
        """Whether ``request``, submitted now, counts only when it starts."""
        limit = self.config.tenant(request.tenant_id).max_concurrent_requests
        if request.priority_class != "interactive" or limit is None:
            return False
        tenant = scheduler.tenants[request.tenant_id]
        return tenant.running + tenant.queued >= limit

    def admitted(
        self, scheduler: TokenfairScheduler, request: Request, deferred: bool, now_ms: float
    ) -> None:
        if request.priority_class != "interactive":
            return
        if deferred:
            self.deferred.add(request.request_id)
        else:
            tokens = scheduler.cost.service_tokens(request.prefill_tokens, request.decode_tokens)
            self.demand.add(tokens, now_ms, self.tau_ms)

    def started(self, decision: Decision, now_ms: float) -> None:
        if decision.request_id in self.deferred:
            self.deferred.discard(decision.request_id)
            self.demand.add(decision.service_tokens, now_ms, self.tau_ms)

    def batch_slots(self, scheduler: TokenfairScheduler, now_ms: float) -> int:
        if self.slots == 1 or not self.interactive:
            return self.slots
        all_held = all(
            t.max_concurrent_requests is not None
            and scheduler.tenants[t.tenant_id].running >= t.max_concurrent_requests
            for t in self.interactive
        )
        load = min(1.0, self.demand.rate(now_ms, self.tau_ms) / self.rate)
        reserve = (0 if all_held else 1) + math.floor(load * self.slots + 0.5)
        return self.slots - min(self.slots - self.floor, reserve)


def drive_limited(
    config: Config, requests: Sequence[Request], slots: int = SLOTS
) -> list[Decision]:
    """A batching engine on a virtual clock: at each event, ends first (settled at the estimate,
    KV freed), then arrivals, then expiry, then ``next_dispatch`` while fewer than ``slots``
    run. A request runs ``slots`` times its serial execution time (the slots share the engine).
    Checks, at every step, the properties of the module docstring."""
    scheduler = TokenfairScheduler(config)
    model = ReserveModel(config, slots)
    cost = scheduler.cost
    tenant_a = scheduler.tenants["a"]
    limit_running = config.tenant("a").max_concurrent_requests
    limit_share = config.tenant("a").max_kv_share
    total_blocks = config.policy.total_kv_blocks
    decisions: list[Decision] = []
    ends: list[tuple[float, str]] = []
    clock_ms = 0.0
    arrivals = 0
    largest_units = max(cost.service_tokens(r.prefill_tokens, r.decode_tokens) for r in requests)
    largest_units *= UNITS_PER_TOKEN
    while True:
        while ends and ends[0][0] <= clock_ms:
            scheduler.complete(heapq.heappop(ends)[1], clock_ms)
        while arrivals < len(requests) and requests[arrivals].arrival_ms <= clock_ms:
            request = requests[arrivals]
            deferred = model.defers(scheduler, request)  # the counts admission sees
            refusal = scheduler.submit(request, clock_ms)
            if refusal is not None:
                decisions.append(refusal)
            else:
                model.admitted(scheduler, request, deferred, clock_ms)
            arrivals += 1
        decisions.extend(scheduler.expire(clock_ms))
        while scheduler.running < slots:
            decision = scheduler.next_dispatch(clock_ms)
            if decision is None:
                # The property: the free slot went to nobody because nobody else could start.
                batch_slots = model.batch_slots(scheduler, clock_ms)
                assert _others_can_start(scheduler, clock_ms, batch_slots) == [], clock_ms
                break
            decisions.append(decision)
            if decision.admitted:
                model.started(decision, clock_ms)
                execution_ms = slots * cost.execution_ms(decision.service_tokens)
                heapq.heappush(ends, (clock_ms + execution_ms, decision.request_id))
            if limit_running is not None:
                assert tenant_a.running <= limit_running
            if limit_share is not None:
                assert tenant_a.resident_blocks <= limit_share * total_blocks
        for lane in scheduler._lanes:
            queue = lane.queues["a"]
            # The deficit rule: no quantum while passed over, so at most one quantum on top of
            # the largest head it could not cover.
            assert queue.deficit_units <= queue.quantum_units + largest_units
        events = [requests[arrivals].arrival_ms] if arrivals < len(requests) else []
        events += [ends[0][0]] if ends else []
        wakeup = scheduler.next_wakeup_ms(clock_ms)
        events += [wakeup] if wakeup is not None else []
        if not events:
            break
        clock_ms = max(clock_ms, min(events))
    assert scheduler.books().queued_requests == 0
    assert tenant_a.running == 0
    assert tenant_a.resident_blocks == 0
    return decisions


limits = st.one_of(
    st.tuples(st.integers(1, 3), st.none()),
    st.tuples(st.none(), st.sampled_from([0.05, 0.1, 0.2, 0.3])),
    st.tuples(st.integers(1, 2), st.sampled_from([0.1, 0.25])),
)


@settings(max_examples=300, deadline=None)
@given(
    requests=traces(),
    limit=limits,
    limited_class=st.sampled_from(["interactive", "batch"]),
    # The reserve's time constant: at 1 s a flood of a few dozen requests is a slot of demand.
    batch_wait_ms=st.sampled_from([8_000.0, 1_000.0]),
)
def test_a_tenant_at_its_limits_never_delays_another_tenants_dispatch(
    requests: list[Request],
    limit: tuple[int | None, float | None],
    limited_class: PriorityClass,
    batch_wait_ms: float,
) -> None:
    requests = [
        Request(r.request_id, r.tenant_id, r.arrival_ms, r.prefill_tokens, r.decode_tokens,
                limited_class)
        if r.tenant_id == "a" else r
        for r in requests
    ]  # fmt: skip
    config = limited_config(*limit, limited_class=limited_class, max_batch_wait_ms=batch_wait_ms)
    decisions = drive_limited(config, requests)
    assert sorted(d.request_id for d in decisions) == sorted(r.request_id for r in requests)


def test_the_property_sees_a_limit_that_blocks_the_others() -> None:
    """The check above can fail: a selection that stopped at the held head of ``a`` (what a
    limit enforced *after* selection would do) leaves ``t0``'s work waiting with a slot free."""
    config = limited_config(1, None)
    scheduler = TokenfairScheduler(config)
    scheduler.submit(Request("a1", "a", 0.0, 100, 10, "interactive"), 0.0)
    scheduler.submit(Request("a2", "a", 0.0, 100, 10, "interactive"), 0.0)
    first = scheduler.next_dispatch(0.0)
    assert first is not None
    assert first.request_id == "a1"
    scheduler.submit(Request("b1", "t0", 1.0, 100, 10, "interactive"), 1.0)
    assert _others_can_start(scheduler, 1.0) == ["b1"]  # a free slot, and b1 could start
    started = scheduler.next_dispatch(1.0)
    assert started is not None
    assert started.request_id == "b1"
    assert scheduler.next_dispatch(1.0) is None  # a2 waits for a1
    assert _others_can_start(scheduler, 1.0) == []
    scheduler.complete("a1", 5.0)
    after = scheduler.next_dispatch(5.0)
    assert after is not None
    assert after.request_id == "a2"
    assert after.observed["held_by_max_concurrent_requests"] == 1


def test_unlimited_tenants_have_no_held_marks_and_same_decisions() -> None:
    """Without limits the dispatch decisions equal those of a config whose limits are never
    reached (a share of 1, more concurrency than requests), and carry no held mark."""
    requests = [
        Request(f"r{i:02d}", ("a", "t0", "t2")[i % 3], 3.0 * i, 500 + 37 * i, 50,
                ("interactive", "interactive", "batch")[i % 3])
        for i in range(30)
    ]  # fmt: skip
    plain = drive_limited(limited_config(None, None), requests)
    loose = drive_limited(limited_config(1_000, 1.0), requests)
    assert [(d.request_id, d.reason, d.dispatch_ms) for d in plain] == [
        (d.request_id, d.reason, d.dispatch_ms) for d in loose
    ]
    assert not any(key.startswith("held_by") for d in plain for key in d.observed)


def test_a_request_that_expires_held_by_its_concurrency_limit_says_so() -> None:
    config = limited_config(1, None, max_interactive_wait_ms=100.0)
    scheduler = TokenfairScheduler(config)
    assert scheduler.submit(Request("a1", "a", 0.0, 100, 10, "interactive"), 0.0) is None
    assert scheduler.submit(Request("a2", "a", 0.0, 100, 10, "interactive"), 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    assert scheduler.next_dispatch(0.0) is None  # a2 held: a runs its one request
    (expired,) = scheduler.expire(150.0)
    assert (expired.request_id, expired.status_code) == ("a2", 429)
    assert (expired.reason, expired.gate) == ("shed_tenant_concurrency", "queue")
    assert expired.observed["max_concurrent_requests"] == 1
    assert expired.observed["tenant_running_requests"] == 1
    assert expired.retry_after_ms is not None


def test_a_request_that_expires_for_its_turn_stays_a_queue_timeout() -> None:
    """Held by the KV watermark, not by its tenant's limits: the reason is unchanged."""
    config = limited_config(5, None, max_interactive_wait_ms=100.0, total_kv_blocks=100)
    scheduler = TokenfairScheduler(config)
    # 60 blocks each (960 tokens of 16): two do not fit the 0.9 watermark of 100 blocks.
    assert scheduler.submit(Request("b1", "t0", 0.0, 900, 60, "interactive"), 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    assert scheduler.submit(Request("a1", "a", 0.0, 900, 60, "interactive"), 0.0) is None
    assert scheduler.next_dispatch(0.0) is None
    (expired,) = scheduler.expire(150.0)
    assert expired.reason == SHED_QUEUE_TIMEOUT


def test_a_request_held_by_its_kv_share_expires_with_the_shares() -> None:
    config = limited_config(None, 0.5, max_interactive_wait_ms=100.0, total_kv_blocks=100)
    scheduler = TokenfairScheduler(config)
    # 30 blocks each: two are 60 % of the cache, above a's half.
    assert scheduler.submit(Request("a1", "a", 0.0, 460, 20, "interactive"), 0.0) is None
    assert scheduler.submit(Request("a2", "a", 0.0, 460, 20, "interactive"), 0.0) is None
    assert scheduler.submit(Request("b1", "t0", 0.0, 460, 20, "interactive"), 0.0) is None
    started = [scheduler.next_dispatch(0.0) for _ in range(3)]
    assert [d.request_id for d in started if d is not None] == ["a1", "b1"]
    (expired,) = scheduler.expire(150.0)
    assert (expired.request_id, expired.reason) == ("a2", "shed_tenant_kv_share")
    assert expired.observed["max_kv_share"] == 0.5
    assert expired.observed["tenant_kv_share"] == 0.3
    assert expired.observed["request_kv_share"] == 0.3


def test_a_request_above_its_tenants_kv_share_is_refused_at_admission() -> None:
    config = limited_config(None, 0.2, total_kv_blocks=100)
    scheduler = TokenfairScheduler(config)
    big = Request("a1", "a", 0.0, 460, 20, "interactive")  # 30 blocks: 0.3 > 0.2
    never = scheduler.never_admissible(big)
    assert never is not None
    assert never.status_code == 400
    assert never.reason == OVER_TENANT_KV_SHARE
    assert never.observed == {"request_kv_blocks": 30, "max_kv_blocks": 20}
    refusal = scheduler.submit(big, 0.0)
    assert refusal is not None
    assert (refusal.reason, refusal.gate, refusal.status_code) == (
        "shed_tenant_kv_share",
        "admission",
        429,
    )
    assert refusal.observed["request_kv_share"] == 0.3
    # Another tenant's request of the same size is not its business.
    assert scheduler.never_admissible(Request("b1", "t0", 0.0, 460, 20, "interactive")) is None
    assert scheduler.submit(Request("b1", "t0", 0.0, 460, 20, "interactive"), 0.0) is None


def test_a_reload_adopts_changes_and_lifts_the_limits() -> None:
    scheduler = TokenfairScheduler(limited_config(None, None))
    for i in range(3):
        scheduler.submit(Request(f"a{i}", "a", 0.0, 100, 10, "interactive"), 0.0)
    assert scheduler.next_dispatch(0.0) is not None
    scheduler.reconfigure(limited_config(1, None), 1.0)
    assert scheduler.next_dispatch(1.0) is None  # a runs one: the limit holds the rest
    scheduler.reconfigure(limited_config(2, None), 2.0)
    second = scheduler.next_dispatch(2.0)
    assert second is not None
    assert second.request_id == "a1"
    assert scheduler.next_dispatch(2.0) is None
    scheduler.reconfigure(limited_config(None, None), 3.0)
    scheduler.submit(Request("a3", "a", 3.0, 100, 10, "interactive"), 3.0)
    third = scheduler.next_dispatch(3.0)
    assert third is not None
    assert third.request_id == "a2"
    # Limits again: the counts (not kept while unlimited) are taken again from the jobs.
    scheduler.reconfigure(limited_config(3, None), 4.0)
    assert scheduler.tenants["a"].running == 3
    assert scheduler.next_dispatch(4.0) is None
    scheduler.complete("a0", 5.0)
    fourth = scheduler.next_dispatch(5.0)
    assert fourth is not None
    assert fourth.request_id == "a3"


def test_in_shadow_mode_the_limits_hold_and_an_expiry_is_a_would_refuse() -> None:
    """Shadow mode keeps ``Enforce``'s dispatch order, limits included; a request that expires
    held is the same refusal, marked ``would_refuse`` (the sidecar serves it anyway)."""
    config = limited_config(1, None, max_interactive_wait_ms=100.0, enforcement="Shadow")
    scheduler = TokenfairScheduler(config)
    assert scheduler.submit(Request("a1", "a", 0.0, 100, 10, "interactive"), 0.0) is None
    assert scheduler.submit(Request("a2", "a", 0.0, 100, 10, "interactive"), 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    assert scheduler.next_dispatch(0.0) is None
    (expired,) = scheduler.expire(150.0)
    assert (expired.reason, expired.would_refuse) == ("shed_tenant_concurrency", True)


def test_a_held_interactive_flood_leaves_its_slots_to_another_tenants_batch_work() -> None:
    """The review's case: 8 slots, ``a`` (interactive, ``maxConcurrentRequests`` 1) floods,
    ``b`` has a batch backlog of hundreds. ``a`` can run one request, so the reserve keeps no
    slot for the rest of its flood: ``b`` runs the other 7 (the old reserve counted the flood at
    admission and held ``b`` to 4, 3 slots idle)."""
    burst, rate = UNLIMITED_BUDGET
    tenants = [
        TenantConfig("a", 1.0, burst, float(rate), "interactive", max_concurrent_requests=1),
        TenantConfig("b", 1.0, burst, float(rate), "batch"),
    ]
    policy = PolicyConfig(max_batch_requests=8, batch_throughput_gain=2.0)
    config = build_config(policy, tenants)
    requests = [Request(f"b{i:03d}", "b", 0.0, 400, 40, "batch") for i in range(300)]
    requests += [Request(f"a{i:03d}", "a", 5.0 * i, 400, 40, "interactive") for i in range(300)]
    requests.sort(key=lambda r: r.arrival_ms)
    decisions = drive_limited(config, requests, slots=8)
    # Beside the per-step property (nothing idle that `b` could use), the count itself:
    # while both were backlogged, `b` ran 7 at once.
    scheduler = TokenfairScheduler(config)
    for request in requests[:300] + requests[300:340]:
        scheduler.submit(request, request.arrival_ms)
    now_ms = requests[339].arrival_ms
    while scheduler.running < 8 and scheduler.next_dispatch(now_ms) is not None:
        pass
    assert (scheduler.tenants["a"].running, scheduler.batch_running) == (1, 7)
    assert sorted(d.request_id for d in decisions) == sorted(r.request_id for r in requests)
