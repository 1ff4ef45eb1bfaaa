"""Live usage: the sidecars' Prometheus metrics -> ``TenantQuota.status.usage`` (pure parts).

Behaviours under test (``tokenfair_operator.usage``), on metrics texts produced by the real
``prometheus_client`` with the sidecar's metric names:

- admitted service tokens and refusals by reason are summed over sidecars and lanes per tenant;
- p99 queue wait is the tenant's own (``tokenfair_queue_wait_seconds{tenant, lane}``): two
  tenants of one lane with different waits get different p99s; the tenant's bucket counts are
  merged over sidecars (and lanes), reported as the upper bound of the bucket holding the 99th
  percentile (ms); a tenant with no observation reports 0;
- ``sidecars`` counts the texts; a tenant absent from every sidecar gets zeros;
- ``usage_changed`` ignores ``updatedAt``, so unchanged numbers cause no write;
- the families are the ones a real sidecar writes (``tokenfair.server.metrics.Metrics``): the
  names live in ``tokenfair.config.wire``, and the operator's readers find them in its text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from sidecar_support import keyed_config

from tokenfair.core import DEFAULT_POLICY, make_scheduler
from tokenfair.server.metrics import Metrics
from tokenfair_operator.rollout import running_version
from tokenfair_operator.usage import aggregate_usage, usage_changed

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1)


def sidecar_metrics(
    admitted: dict[str, int],
    refused: dict[tuple[str, str], int],
    waits_s: dict[tuple[str, str], list[float]],
) -> str:
    """One sidecar's /metrics text; ``waits_s`` by (tenant, lane)."""
    registry = CollectorRegistry()
    tokens = Counter(
        "tokenfair_estimated_service_tokens", "t", ["tenant", "lane"], registry=registry
    )
    refusals = Counter(
        "tokenfair_refused_requests", "r", ["tenant", "lane", "reason"], registry=registry
    )
    wait = Histogram(
        "tokenfair_queue_wait_seconds",
        "w",
        ["tenant", "lane"],
        buckets=BUCKETS_S,
        registry=registry,
    )
    for tenant, amount in admitted.items():
        tokens.labels(tenant, "interactive").inc(amount)
    for (tenant, reason), count in refused.items():
        refusals.labels(tenant, "interactive", reason).inc(count)
    for (tenant, lane), observations in waits_s.items():
        for seconds in observations:
            wait.labels(tenant, lane).observe(seconds)
    return generate_latest(registry).decode()


LANES = {"chat": "interactive", "ide": "interactive", "rag": "batch", "idle": "interactive"}


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


def test_p99_is_the_tenants_merged_bucket_bound() -> None:
    # chat: 99 fast waits (1 ms -> the 5 ms bucket) and 1 slow one (40 ms -> the 50 ms bucket)
    # over two sidecars: cumulative at 5 ms is 99 >= 0.99 * 100 = 99, so p99 = 5 ms.
    fast = sidecar_metrics({}, {}, {("chat", "interactive"): [0.001] * 60})
    mixed = sidecar_metrics({}, {}, {("chat", "interactive"): [0.001] * 39 + [0.040]})
    assert aggregate_usage([fast, mixed], LANES)["chat"]["p99QueueWaitMs"] == 5.0
    # 98 fast + 2 slow: cumulative at 5 ms is 98 < 99, at 50 ms it is 100 -> 50 ms.
    slower = sidecar_metrics({}, {}, {("chat", "interactive"): [0.001] * 38 + [0.040] * 2})
    assert aggregate_usage([fast, slower], LANES)["chat"]["p99QueueWaitMs"] == 50.0
    # Beyond the last finite bucket: reported as that bound (100 ms), not infinity.
    slowest = sidecar_metrics({}, {}, {("rag", "batch"): [3.0]})
    assert aggregate_usage([slowest], LANES)["rag"]["p99QueueWaitMs"] == 100.0


def test_two_tenants_of_one_lane_get_their_own_p99() -> None:
    # chat and ide share the interactive lane. chat: 60 + 39 waits of 1 ms and one of 40 ms
    # (100 in all, 99 of them <= 5 ms). ide: 10 waits of 20 ms (the 25 ms bucket) on one
    # sidecar and 5 of 80 ms (the 100 ms bucket) on the other.
    one = sidecar_metrics(
        {}, {}, {("chat", "interactive"): [0.001] * 60, ("ide", "interactive"): [0.020] * 10}
    )
    two = sidecar_metrics(
        {},
        {},
        {("chat", "interactive"): [0.001] * 39 + [0.040], ("ide", "interactive"): [0.080] * 5},
    )
    usage = aggregate_usage([one, two], LANES)
    # chat: cumulative at 5 ms is 99 >= 0.99 * 100 = 99 -> 5 ms.
    assert usage["chat"]["p99QueueWaitMs"] == 5.0
    # ide: 15 waits; 0.99 * 15 = 14.85; cumulative at 25 ms and 50 ms is 10, at 100 ms 15 -> 100.
    assert usage["ide"]["p99QueueWaitMs"] == 100.0
    # (The lane's merged histogram, 115 waits, would have given both tenants 100 ms:
    # 0.99 * 115 = 113.85 > 110, the lane's cumulative count at 50 ms.)
    assert usage["idle"]["p99QueueWaitMs"] == 0.0


def test_a_tenant_that_changed_lane_is_merged_over_both() -> None:
    # chat: 98 waits of 1 ms as interactive, then 2 of 40 ms as batch: 100 in all, cumulative
    # at 5 ms is 98 < 99, at 50 ms 100 -> 50 ms (the interactive series alone would give 5 ms).
    text = sidecar_metrics(
        {}, {}, {("chat", "interactive"): [0.001] * 98, ("chat", "batch"): [0.040] * 2}
    )
    assert aggregate_usage([text], LANES)["chat"]["p99QueueWaitMs"] == 50.0


def test_usage_changed_ignores_the_timestamp() -> None:
    fresh = {"admittedServiceTokens": 5, "refusals": {}, "p99QueueWaitMs": 0.0, "sidecars": 1}
    stored = {**fresh, "updatedAt": "2026-01-01T00:00:00Z"}
    assert not usage_changed(stored, fresh)
    assert usage_changed(stored, {**fresh, "admittedServiceTokens": 6})
    assert usage_changed(None, fresh)


def test_the_operator_reads_what_a_real_sidecar_writes() -> None:
    config = keyed_config()
    scheduler = make_scheduler(DEFAULT_POLICY, config, 0.0)
    metrics = Metrics(lambda: (scheduler, False, "v7", ""))
    chat = metrics.lane_series("chat", "interactive")
    chat.estimated_tokens += 1_234
    chat.count_refused("rate_limited")
    chat.queue_wait.observe(0.2)
    text = metrics.render()
    usage = aggregate_usage([text], ["chat", "rag"])
    assert usage["chat"] == {
        "admittedServiceTokens": 1_234,
        "refusals": {"rate_limited": 1},
        "p99QueueWaitMs": 250.0,
        "sidecars": 1,
    }
    assert usage["rag"]["admittedServiceTokens"] == 0
    assert running_version(text) == "v7"
