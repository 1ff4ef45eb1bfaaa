"""The batch lane's KV-bound concurrency in the wait prediction
(``TokenfairScheduler.batch_concurrency``, docs/capacity.md): a virtual clock throughout.

Behaviours under test:

- The rule by hand: ``min(batch_slots, max(1, floor(batch_kv_watermark * totalKvBlocks /
  mean booking)))``, the mean over the batch requests queued and the request's own booking;
  ``batch_slots`` where nothing is queued and no booking is given, or where KV binds later.
- A KV-bound batch lane's wait is priced at the throughput of the requests its watermark
  holds, after the engine's next end, not as if the slots KV does not allow were free (the
  prediction was 0 ms for a request that waits 800 ms).
- The model alone keeps its promise: a flood admitted at one instant on a KV-bound lane
  (before any wait is known, so the wait correction is 1) is admitted only as far as it
  starts within the batch wait limit; run on an engine of the policy's curve, none of the
  admitted requests expires (priced at the full batch, 36 of the 68 admitted did).
"""

from __future__ import annotations

import math

import pytest
from scheduler_support import fill

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.batching import BatchingCurve, RunningWork
from tokenfair.core.jobs import LANE_BATCH, SHED_QUEUE_TIMEOUT
from tokenfair.core.tokenfair import TAIL_WAIT_FACTOR, TokenfairScheduler


def scheduler(**policy: object) -> TokenfairScheduler:
    # S = 8, G = 8, R = 80: throughput linear in the batch, X(c) = 10 c. KV: 1000 blocks of
    # 16 tokens, the batch watermark 0.65 (650 blocks). A batch tenant only: no reserve.
    settings: dict[str, object] = {
        "max_batch_requests": 8,
        "batch_throughput_gain": 8.0,
        "service_tokens_per_ms": 80.0,
        "total_kv_blocks": 1000,
        "batch_kv_watermark": 0.65,
        **policy,
    }
    config = build_config(
        PolicyConfig(**settings),  # type: ignore[arg-type]
        [TenantConfig("rag", 1.0, 10**12, 10**12, "batch")],
    )
    return TokenfairScheduler(config)


def batch(request_id: str, now_ms: float, prefill: int = 2000, decode: int = 500) -> Request:
    return Request(request_id, "rag", now_ms, prefill, decode, "batch")


def test_the_rule_by_hand() -> None:
    fair = scheduler()
    # Nothing queued, no booking: the slots (8, no interactive tenant to reserve for).
    assert fair.batch_concurrency(0.0) == fair.batch_slots(0.0) == 8
    # Its own booking of 157 blocks (2500 tokens / 16): floor(650 / 157) = 4.
    assert fair.batch_concurrency(0.0, 157) == 4
    # Small requests: KV holds more than the slots, the slots decide.
    assert fair.batch_concurrency(0.0, 20) == 8
    # A booking above the watermark's blocks still lets one run.
    assert fair.batch_concurrency(0.0, 700) == 1
    # Queued: 4 of 157 blocks run (5 would take 785 > 650), 2 wait. The mean over those
    # queued (157), with a booking of 40 blocks: (2 x 157 + 40) / 3 = 118 -> floor(5.5) = 5.
    for i in range(6):
        assert fair.submit(batch(f"b{i}", 0.0), 0.0) is None
    assert fill(fair, 0.0) == ["b0", "b1", "b2", "b3"]
    assert fair.queued_count[LANE_BATCH] == 2
    assert fair.batch_concurrency(0.0) == 4
    assert fair.batch_concurrency(0.0, 40) == 5


def test_a_kv_bound_lanes_wait_is_priced_at_the_concurrency_kv_allows() -> None:
    # Each request 2000 + 4 x 500 = 4000 service tokens, 157 blocks: the lane runs 4 (KV), 4
    # queue. A new one waits for the engine's next end (every request at 10 per ms: 400 ms),
    # then for the 16,000 tokens ahead at X(4) = 40 per ms: 800 ms. Priced at the 8 slots it
    # was 0 (4 "free" slots took the 4 ahead at once).
    fair = scheduler()
    for i in range(8):
        assert fair.submit(batch(f"b{i}", 0.0), 0.0) is None
    assert fill(fair, 0.0) == ["b0", "b1", "b2", "b3"]
    wait_ms = fair.predicted_wait_ms("rag", LANE_BATCH, 4000, 0.0, None, 157)
    assert wait_ms == pytest.approx(400.0 + 16_000 / 40.0)
    # Without the request's booking the queued requests' mean decides the same.
    assert fair.predicted_wait_ms("rag", LANE_BATCH, 4000, 0.0) == pytest.approx(800.0)
    # Where KV does not bind (the same flood, a cache 10x larger) the slots price it as before:
    # all 8 run, a new request waits for the first end (400 ms), nothing ahead of it.
    roomy = scheduler(total_kv_blocks=10_000)
    for i in range(8):
        assert roomy.submit(batch(f"b{i}", 0.0), 0.0) is None
    assert len(fill(roomy, 0.0)) == 8
    assert roomy.predicted_wait_ms("rag", LANE_BATCH, 4000, 0.0, None, 157) == pytest.approx(400.0)


def test_a_flood_admitted_on_a_kv_bound_lane_starts_within_the_limit() -> None:
    # maxBatchWaitMs 3500. The lane runs the 4 requests KV holds (from 0 ms); 96 more arrive
    # at 0 ms, before any wait is known (the correction is 1: the model alone decides). The
    # engine is the policy's curve (a fluid of the running requests), and the dispatcher
    # starts what KV lets start at each end.
    fair = scheduler(max_batch_wait_ms=3500.0)
    engine = RunningWork(BatchingCurve.from_policy(fair.policy))
    for i in range(4):
        assert fair.submit(batch(f"b{i}", 0.0), 0.0) is None
    for request_id in fill(fair, 0.0):
        engine.start(request_id, 4000.0, 0.0)
    assert engine.running == 4
    queued = [f"q{i}" for i in range(96) if fair.submit(batch(f"q{i}", 0.0), 0.0) is None]
    # The k-th queued is predicted the first end (400 ms) and k x 4000 / X(4) = 100 k ms,
    # admitted on TAIL_WAIT_FACTOR times that (a joiner at the ring's tail) within 3.5 s
    # (priced at the 8 slots: 4 "free" at once, the rest at X(8) = 80 per ms, 68 were).
    most = 1 + math.floor((3500.0 / TAIL_WAIT_FACTOR - 400.0) / 100.0)
    assert most - 1 <= len(queued) <= most
    now_ms = 0.0
    expired: list[str] = []
    started: dict[str, float] = {}
    while engine.running:
        now_ms += engine.next_departure_ms(now_ms)
        expired += [d.request_id for d in fair.expire(now_ms) if d.reason == SHED_QUEUE_TIMEOUT]
        fair.complete(engine.finish_first(now_ms), now_ms)
        for request_id in fill(fair, now_ms):
            engine.start(request_id, 4000.0, now_ms)
            started[request_id] = now_ms
    assert expired == []
    assert sorted(started) == sorted(queued)
    assert max(started.values()) <= 3500.0
