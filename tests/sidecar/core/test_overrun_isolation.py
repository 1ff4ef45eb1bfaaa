"""A tenant's reported usage is that tenant's debt, never its neighbours' wait (issue 28, row 1).

The property, stated and proved in docs/fairness.md §5.4: when a request of tenant A settles
with any reported usage ``u`` instead of its estimate, every other tenant's predicted wait, in
either lane, right after that settlement, is at most its predicted wait had A settled at the
estimate, plus

* ``others / R`` on a serial engine (``maxBatchRequests`` 1), ``others`` being the expected work
  of the *other* requests still running: the residual work never extends past their end;
* nothing on a batching engine: a request that ended leaves the running work whatever it
  reported.

(The lane's recent service takes no more of the overrun than the engine can have done while the
request ran, and a larger recent service only lowers other tenants' share ratios, which lets them
join ahead, never later; A's debt goes to A's deficit and A's own recent service.)

Tested on random traces (hypothesis): two schedulers replay the same events; at a random
completion of one of A's requests, one settles it at the estimate and the other at 2^35
service tokens (far beyond any real request, as a lying upstream would report); then every
other tenant's predicted wait is compared, and their admission of the same probe requests.
"""

from __future__ import annotations

import heapq

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.jobs import LANE_OF
from tokenfair.core.tokenfair import TokenfairScheduler

TENANTS = (
    TenantConfig("a", 1.0, 40_000, 200_000, "interactive"),
    TenantConfig("b", 2.0, 40_000, 200_000, "interactive"),
    TenantConfig("c", 1.0, 60_000, 100_000, "batch"),
    TenantConfig("d", 1.5, 60_000, 100_000, "batch"),
)
HUGE = 2**35

arrival = st.tuples(
    st.sampled_from([t.tenant_id for t in TENANTS]),
    st.integers(1, 3000),  # prefill tokens
    st.integers(0, 800),  # decode tokens
    st.floats(0.0, 40.0),  # ms after the previous arrival
)


def replay(
    policy: PolicyConfig, arrivals: list[tuple[str, int, int, float]], attack_at: int, huge: bool
) -> tuple[TokenfairScheduler, float, float] | None:
    """Replay until the ``attack_at``-th completion of one of A's requests, settle it (at
    ``HUGE`` service tokens if ``huge``, else at the estimate), and return the scheduler, the
    time, and the other running requests' expected work then; None if A completes fewer."""
    fair = TokenfairScheduler(build_config(policy, TENANTS))
    in_flight = max(2, policy.max_batch_requests)
    ends: list[tuple[float, int, str]] = []  # (end ms, order, id): a fixed run time each
    classes = {t.tenant_id: t.priority_class for t in TENANTS}
    now_ms = 0.0
    order = 0
    a_completions = 0
    pending = list(arrivals)
    while pending or ends:
        next_arrival = now_ms + pending[0][3] if pending else None
        if ends and (next_arrival is None or ends[0][0] <= next_arrival):
            end_ms, _, request_id = heapq.heappop(ends)
            now_ms = max(now_ms, end_ms)
            if request_id.startswith("a-"):
                a_completions += 1
                if a_completions == attack_at:
                    others = sum(
                        job.expected_tokens
                        for job in fair.jobs.values()
                        if job.request_id != request_id and job.state.name == "DISPATCHED"
                    )
                    fair.complete(request_id, now_ms, HUGE if huge else None)
                    return fair, now_ms, others
            fair.complete(request_id, now_ms)
        else:
            assert next_arrival is not None
            tenant, prefill, decode, _ = pending.pop(0)
            now_ms = next_arrival
            order += 1
            fair.submit(
                Request(f"{tenant}-{order}", tenant, now_ms, prefill, decode, classes[tenant]),
                now_ms,
            )
        fair.expire(now_ms)
        while fair.running < in_flight and fair.queued_total:
            decision = fair.next_dispatch(now_ms)
            if decision is None:
                break
            if decision.status_code == 200:
                run_ms = decision.service_tokens / policy.service_tokens_per_ms
                heapq.heappush(ends, (now_ms + run_ms, order, decision.request_id))
                order += 1
    return None


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=5, max_size=60),
    attack_at=st.integers(1, 4),
    batch=st.sampled_from([1, 4]),
)
def test_a_huge_reported_usage_delays_no_other_tenant_beyond_the_work_running(
    arrivals: list[tuple[str, int, int, float]], attack_at: int, batch: int
) -> None:
    policy = PolicyConfig(max_batch_requests=batch, batch_throughput_gain=min(2.0, batch))
    honest_run = replay(policy, arrivals, attack_at, huge=False)
    assume(honest_run is not None)  # A completed fewer requests: nothing to compare
    assert honest_run is not None
    lying_run = replay(policy, arrivals, attack_at, huge=True)
    assert lying_run is not None
    (honest, now_ms, others), (lying, lying_now_ms, _) = honest_run, lying_run
    assert lying_now_ms == now_ms
    bound_ms = others / policy.service_tokens_per_ms if batch == 1 else 0.0
    for tenant in TENANTS[1:]:
        lane = LANE_OF[tenant.priority_class]
        for cost in (100, 2_000, 12_000):
            fair_wait = honest.predicted_wait_ms(tenant.tenant_id, lane, cost, now_ms)
            lied_wait = lying.predicted_wait_ms(tenant.tenant_id, lane, cost, now_ms)
            # (+1e-5 ms: the clamp lets float noise of up to 1e-6 ms through, see shares.py)
            assert lied_wait <= fair_wait + bound_ms + 1e-5, (tenant, cost)
    # The same probe requests of the others are decided alike, but where the honest run's
    # margin to the wait limit was within the bound.
    for tenant in TENANTS[1:]:
        probe = Request(
            f"probe-{tenant.tenant_id}", tenant.tenant_id, now_ms, 800, 200, tenant.priority_class
        )
        lane = LANE_OF[tenant.priority_class]
        limit_ms = honest.wait_limit_ms(lane)
        margin_ms = limit_ms - honest.predicted_wait_ms(tenant.tenant_id, lane, 1600, now_ms)
        fair_refusal = honest.submit(probe, now_ms)
        lied_refusal = lying.submit(probe, now_ms)
        if fair_refusal is None and margin_ms > bound_ms + 1e-5:
            assert lied_refusal is None or lied_refusal.reason != "shed_queue_wait_slo", tenant
    # And the debt is A's: its deficit took it.
    lane_a = LANE_OF["interactive"]
    assert lying._lanes[lane_a].queues["a"].deficit < honest._lanes[lane_a].queues["a"].deficit
