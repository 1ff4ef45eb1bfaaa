"""A pool replayed offline (sim/pool_replay.py, sim/pool_maxmin.py):

- routing: round-robin over the requests, affinity runs of AFFINITY_RUN requests of a tenant to
  one replica, skewed (the pinned tenants on replica 0, the others round robin); bad arguments
  name the field;
- one replica without a pool decides exactly as the serial replay (``simulate``);
- the constrained max-min reference on hand-computed pools (a pinned tenant gets its whole
  replica, weights split a shared replica, an offer below its share is met, a request runs only
  where it landed);
- the targets of issue 30, offline: a pinned tenant against a flooder gets >= 90 % of its
  constrained max-min with pool-wide fairness and about half without, in the same run; 4:1
  weights over all replicas stay within 10 % of 4:1; the store sees <= 0.1 calls per request;
  100 tenants of mixed weights on 4 replicas with affinity routing: Jain of service over the
  constrained max-min >= 0.95 with the pool's order (0.916 with a join clamp of [m - 4, m + 1],
  docs/fairness.md §9.3), above the per-replica round robin's;
- every replica's books are zero at the end;
- a batching engine (maxBatchRequests > 1): one replica without a pool decides exactly as the
  single-replica batching replay; in the skewed pool at ~1.3x the pool's capacity, the flooder's
  admitted requests on the pinned tenant's replica do not expire (admission follows the pool's
  order, docs/fairness.md §9.2.1): admitted-then-expired <= 2 % pool-wide and per tenant, the
  pinned tenant still >= 90 % of its constrained max-min;
- the reference per slice of time (a request waits at most a wait limit, so what was offered in
  one second cannot be served in another) on a hand-computed pool of two slices.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenfair.commands.simulate_pool import sliced_jain
from tokenfair.config import Config, build_config
from tokenfair.core import Decision, Request
from tokenfair.core.jobs import STATUS_OK, STATUS_SHED
from tokenfair.core.scheduler import Books
from tokenfair.sim.fairness import jain_index
from tokenfair.sim.pool_maxmin import constrained_max_min, pool_shares
from tokenfair.sim.pool_replay import AFFINITY_RUN, PoolReplay, replay_pool, route
from tokenfair.sim.scenarios import noisy_neighbor, pool_many, pool_skewed, pool_weights
from tokenfair.sim.simulator import Arrival, simulate


def _arrivals(requests: list[Request]) -> list[Arrival]:
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    return [(r, None, None) for r in ordered]


def _request(number: int, tenant_id: str) -> Arrival:
    return (Request(f"r{number:03d}", tenant_id, float(number), 10, 1, "interactive"), None, None)


def test_routing_rules() -> None:
    arrivals = [_request(i, "a" if i % 3 else "b") for i in range(96)]
    assert route(arrivals, 4, "round-robin") == [i % 4 for i in range(96)]
    skewed = route(arrivals, 4, "skewed", ["b"])
    assert all(r == 0 for (a, _, _), r in zip(arrivals, skewed, strict=True) if a.tenant_id == "b")
    spread = [r for (a, _, _), r in zip(arrivals, skewed, strict=True) if a.tenant_id == "a"]
    assert spread == [i % 4 for i in range(len(spread))]
    affinity = route(arrivals, 4, "affinity")
    a_replicas = [r for (a, _, _), r in zip(arrivals, affinity, strict=True) if a.tenant_id == "a"]
    runs = [a_replicas[i : i + AFFINITY_RUN] for i in range(0, len(a_replicas), AFFINITY_RUN)]
    assert all(len(set(run)) == 1 for run in runs)
    with pytest.raises(ValueError, match="routing: must be one of"):
        route(arrivals, 4, "random")
    with pytest.raises(ValueError, match="replicas: must be at least 1"):
        route(arrivals, 0, "round-robin")


def test_one_replica_without_a_pool_is_the_serial_replay() -> None:
    config, requests = noisy_neighbor()
    expected = simulate(config, requests, "tokenfair")
    got = [d for d, _ in replay_pool(config, _arrivals(requests), "tokenfair", 1, "round-robin",
                                     pool=False)]  # fmt: skip
    assert [(d.request_id, d.status_code, d.reason, d.dispatch_ms, d.ttft_ms) for d in got] == [
        (d.request_id, d.status_code, d.reason, d.dispatch_ms, d.ttft_ms) for d in expected
    ]


def test_pool_shares_unrounded_for_a_verdict() -> None:
    """``pool_shares`` rounds its figures for a report (J to 4 decimals) and leaves them as
    computed with ``rounded=False``, the figure a verdict judges (review rev1207f F4: a J of
    0.94996 read 0.95, a pass)."""

    def decision(number: int, tenant_id: str, tokens: int, served: bool) -> Decision:
        status, gate = (STATUS_OK, "dispatch") if served else (STATUS_SHED, "queue")
        dispatch_ms = float(number) if served else None
        return Decision(f"{tenant_id}-{number}", tenant_id, "interactive", status, "", gate,
                        tokens, float(number), dispatch_ms=dispatch_ms)  # fmt: skip

    replicas = [
        [decision(n, "a", 700, True) for n in range(7)]
        + [decision(10 + n, "b", 300, n < 4) for n in range(9)],
        [decision(n, "b", 300, True) for n in range(3)] + [decision(3, "c", 1100, True)],
    ]
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    exact = pool_shares(replicas, weights, rounded=False)
    shown = pool_shares(replicas, weights)
    jain = exact["jain_of_max_min"]
    assert isinstance(jain, float)
    ratios = [row["of_max_min"] for row in exact["tenants"].values()]  # type: ignore[attr-defined]
    assert jain == jain_index(ratios)
    assert jain != round(jain, 4)  # the case has more than 4 decimals to lose
    assert shown["jain_of_max_min"] == round(jain, 4)


def test_constrained_max_min_by_hand() -> None:
    # a only on replica 0, b everywhere: a gets replica 0, b the rest.
    shares = constrained_max_min([100, 100, 100, 100], {"a": [1e6, 0, 0, 0], "b": [1e6] * 4},
                                 {"a": 1, "b": 1})  # fmt: skip
    assert shares["a"] == pytest.approx(100, rel=1e-6)
    assert shares["b"] == pytest.approx(300, rel=1e-6)
    # both on both: 4:1 of 200.
    shares = constrained_max_min([100, 100], {"a": [1e6, 1e6], "b": [1e6, 1e6]}, {"a": 4, "b": 1})
    assert shares["a"] == pytest.approx(160, rel=1e-6)
    # an offer below the fair share is met, the rest goes to the other.
    shares = constrained_max_min([100, 100], {"a": [10, 0], "b": [1e6, 1e6]}, {"a": 1, "b": 1})
    assert shares == pytest.approx({"a": 10, "b": 190}, rel=1e-6)
    # a request runs only where it landed: b offered 30 at replica 1 only.
    shares = constrained_max_min([100, 100], {"a": [1e6, 1e6], "b": [0, 30]}, {"a": 1, "b": 1})
    assert shares == pytest.approx({"a": 170, "b": 30}, rel=1e-6)
    with pytest.raises(ValueError, match=r"weights\['a'\]: must be positive"):
        constrained_max_min([1], {"a": [1]}, {"a": 0})


def _shares(
    outcome: PoolReplay, weights: dict[str, float]
) -> tuple[dict[str, float], dict[str, int]]:
    capacities = [float(sum(s.values())) for s in outcome.served]
    offered = {t: [float(o.get(t, 0)) for o in outcome.offered] for t in weights}
    served = {t: sum(s.get(t, 0) for s in outcome.served) for t in weights}
    return constrained_max_min(capacities, offered, weights), served


def test_skewed_pinned_tenant_gets_its_replica_with_the_pool_only() -> None:
    config, requests = pool_skewed()
    arrivals = _arrivals(requests)
    ratios = {}
    for shared in (False, True):
        outcome = PoolReplay(4)
        for _ in replay_pool(config, arrivals, "tokenfair", 4, "skewed", pool=shared,
                             pinned=["tenant_pinned"], outcome=outcome):  # fmt: skip
            pass
        shares, served = _shares(outcome, {"tenant_pinned": 1.0, "tenant_flood": 1.0})
        ratios[shared] = served["tenant_pinned"] / shares["tenant_pinned"]
        if shared:
            assert outcome.store_calls / outcome.requests <= 0.1
            assert outcome.store_calls > 0
        assert all(s.books() == Books(0, 0, 0, 0, 0) for s in outcome.schedulers)
    assert 0.45 <= ratios[False] <= 0.55
    assert ratios[True] >= 0.90


@pytest.mark.parametrize("routing", ["round-robin", "affinity"])
def test_weights_hold_pool_wide(routing: str) -> None:
    config, requests = pool_weights()
    outcome = PoolReplay(4)
    for _ in replay_pool(config, _arrivals(requests), "tokenfair", 4, routing, pool=True,
                         outcome=outcome):  # fmt: skip
        pass
    _, served = _shares(outcome, {"tenant_heavy": 4.0, "tenant_light": 1.0})
    assert served["tenant_heavy"] / served["tenant_light"] == pytest.approx(4.0, rel=0.10)
    assert outcome.store_calls / outcome.requests <= 0.1


def test_many_tenants_with_affinity_get_their_constrained_max_min() -> None:
    config, requests = pool_many()
    weights = {tenant.tenant_id: tenant.weight for tenant in config.tenants}
    jain: dict[bool, float] = {}
    for shared in (False, True):
        outcome = PoolReplay(4)
        for _ in replay_pool(config, _arrivals(requests), "tokenfair", 4, "affinity",
                             pool=shared, outcome=outcome):  # fmt: skip
            pass
        shares, served = _shares(outcome, weights)
        index = jain_index([served[t] / shares[t] for t in weights if shares[t] > 0])
        assert index is not None
        jain[shared] = index
    assert jain[True] >= 0.95
    assert jain[True] > jain[False]


def _batching(config: Config, rate: float) -> Config:
    """The configuration on a batching engine of 8 slots, 4 times one request's speed at the
    full batch, ``rate`` service tokens per ms then."""
    policy = replace(
        config.policy, max_batch_requests=8, batch_throughput_gain=4.0, service_tokens_per_ms=rate
    )
    return build_config(policy, config.tenants)


def _key(d: Decision) -> tuple[object, ...]:
    return (d.request_id, d.status_code, d.reason, d.dispatch_ms, d.ttft_ms)


def test_one_batching_replica_without_a_pool_is_the_batching_replay() -> None:
    config, requests = pool_skewed(4_000)
    config = _batching(config, 53.0)
    expected = simulate(config, requests, "tokenfair")
    got = [d for d, _ in replay_pool(config, _arrivals(requests), "tokenfair", 1, "round-robin",
                                     pool=False)]  # fmt: skip
    assert [_key(d) for d in got] == [_key(d) for d in expected]
    assert any(d.status_code == STATUS_OK for d in got)


def _expired(decisions: list[Decision], tenant_id: str | None = None) -> float:
    """Admitted-then-expired: of the requests that passed admission, those that expired."""
    mine = [d for d in decisions if tenant_id is None or d.tenant_id == tenant_id]
    expired = sum(1 for d in mine if d.status_code == STATUS_SHED and d.gate == "queue")
    admitted = expired + sum(1 for d in mine if d.status_code == STATUS_OK)
    return expired / admitted


def test_skewed_batching_pool_admits_what_it_serves() -> None:
    # ~1.3x: the offers (~277 tokens/ms) over 4 replicas of 53 tokens/ms at the full batch.
    config, requests = pool_skewed(10_000)
    config = _batching(config, 53.0)
    outcome = PoolReplay(4)
    decisions = [d for d, _ in replay_pool(config, _arrivals(requests), "tokenfair", 4, "skewed",
                                           pool=True, pinned=["tenant_pinned"],
                                           outcome=outcome)]  # fmt: skip
    assert len(decisions) == len(requests)
    assert _expired(decisions) <= 0.02
    assert _expired(decisions, "tenant_flood") <= 0.02
    assert _expired(decisions, "tenant_pinned") <= 0.02
    shares, served = _shares(outcome, {"tenant_pinned": 1.0, "tenant_flood": 1.0})
    assert served["tenant_pinned"] / shares["tenant_pinned"] >= 0.90
    assert outcome.store_calls / outcome.requests <= 0.1
    assert all(s.books() == Books(0, 0, 0, 0, 0) for s in outcome.schedulers)


def test_the_reference_per_slice_of_time_by_hand() -> None:
    # One replica, slices of 1 s. Slice 0: a offers 1000, the replica serves 500 of it. Slice
    # 1: a offers 100 and b 1000; max-min of 500 gives a its 100 and b 400, which they get.
    # Per slice the shares are a 500 + 100, b 400: what they got, Jain 1. Over the whole
    # window (capacity 1000, offers 1100 and 1000) each is owed 500: a got 600 (1.2), b 400
    # (0.8), Jain (2.0)^2 / (2 * (1.44 + 0.64)) = 0.9615.
    outcome = PoolReplay(1)
    outcome.add_offered(0, "a", 1000, 10.0)
    outcome.add_served(0, "a", 500, 900.0)
    outcome.add_offered(0, "a", 100, 1100.0)
    outcome.add_offered(0, "b", 1000, 1200.0)
    outcome.add_served(0, "a", 100, 1300.0)
    outcome.add_served(0, "b", 400, 1900.0)
    assert sliced_jain(outcome, {"a": 1.0, "b": 1.0}) == pytest.approx(1.0)
    shares, served = _shares(outcome, {"a": 1.0, "b": 1.0})
    ratios = [served[t] / shares[t] for t in ("a", "b")]
    assert ratios == pytest.approx([1.2, 0.8])
    assert sum(ratios) ** 2 / (2 * sum(r * r for r in ratios)) == pytest.approx(4.0 / 4.16)
