"""Live usage: the sidecars' Prometheus metrics -> ``TenantQuota.status.usage`` (pure parts).

Behaviours under test (``tokenfair_operator.usage``), on metrics texts produced by the real
``prometheus_client`` with the sidecar's metric names:

- admitted service tokens and refusals by reason are summed over sidecars and lanes per tenant;
- p99 queue wait is the lane's: bucket counts merged over sidecars, reported as the upper bound
  of the bucket holding the 99th percentile (ms); a lane with no observation reports 0;
- ``sidecars`` counts the texts; a tenant absent from every sidecar gets zeros;
- ``usage_changed`` ignores ``updatedAt``, so unchanged numbers cause no write.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenfair_operator.usage import aggregate_usage, usage_changed

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1)


def sidecar_metrics(
    admitted: dict[str, int], refused: dict[tuple[str, str], int], waits_s: dict[str, list[float]]
) -> str:
    """One sidecar's /metrics text."""
    registry = CollectorRegistry()
    tokens = Counter(
        "tokenfair_estimated_service_tokens", "t", ["tenant", "lane"], registry=registry
    )
    refusals = Counter(
        "tokenfair_refused_requests", "r", ["tenant", "lane", "reason"], registry=registry
    )
    wait = Histogram(
        "tokenfair_queue_wait_seconds", "w", ["lane"], buckets=BUCKETS_S, registry=registry
    )
    for tenant, amount in admitted.items():
        tokens.labels(tenant, "interactive").inc(amount)
    for (tenant, reason), count in refused.items():
        refusals.labels(tenant, "interactive", reason).inc(count)
    for lane, observations in waits_s.items():
        for seconds in observations:
            wait.labels(lane).observe(seconds)
    return generate_latest(registry).decode()


LANES = {"chat": "interactive", "rag": "batch", "idle": "interactive"}


def test_sums_over_sidecars() -> None:
    one = sidecar_metrics({"chat": 1000}, {("chat", "shed_queue_wait_slo"): 2}, {})
    two = sidecar_metrics(
        {"chat": 500, "rag": 7000},
        {("chat", "shed_queue_wait_slo"): 1, ("chat", "queue_full"): 4},
        {},
    )

    usage = aggregate_usage([one, two], LANES)

    assert usage["chat"]["admittedServiceTokens"] == 1500  # 1000 + 500
    assert usage["chat"]["refusals"] == {"queue_full": 4, "shed_queue_wait_slo": 3}  # 2 + 1
    assert usage["rag"]["admittedServiceTokens"] == 7000
    assert usage["idle"] == {
        "admittedServiceTokens": 0,
        "refusals": {},
        "p99QueueWaitMs": 0.0,
        "sidecars": 2,
    }


def test_p99_is_the_lanes_merged_bucket_bound() -> None:
    # 99 fast waits (<= 5 ms) and 1 slow one (40 ms -> the 50 ms bucket) over two sidecars:
    # the 99th of 100 observations is fast, so p99 <= 5 ms.
    fast = sidecar_metrics({}, {}, {"interactive": [0.001] * 60})
    mixed = sidecar_metrics({}, {}, {"interactive": [0.001] * 39 + [0.040]})
    assert aggregate_usage([fast, mixed], LANES)["chat"]["p99QueueWaitMs"] == 5.0
    # 98 fast + 2 slow: cumulative at 5 ms is 98 < 99, at 50 ms it is 100 -> 50 ms.
    slower = sidecar_metrics({}, {}, {"interactive": [0.001] * 38 + [0.040] * 2})
    assert aggregate_usage([fast, slower], LANES)["chat"]["p99QueueWaitMs"] == 50.0
    # Beyond the last finite bucket: reported as that bound (100 ms), not infinity.
    slowest = sidecar_metrics({}, {}, {"batch": [3.0]})
    assert aggregate_usage([slowest], LANES)["rag"]["p99QueueWaitMs"] == 100.0


def test_usage_changed_ignores_the_timestamp() -> None:
    fresh = {"admittedServiceTokens": 5, "refusals": {}, "p99QueueWaitMs": 0.0, "sidecars": 1}
    stored = {**fresh, "updatedAt": "2026-01-01T00:00:00Z"}
    assert not usage_changed(stored, fresh)
    assert usage_changed(stored, {**fresh, "admittedServiceTokens": 6})
    assert usage_changed(None, fresh)
