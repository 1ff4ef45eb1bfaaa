"""A live, time-scaled run of the lesson's noisy-neighbor workload through the sidecar.

The workload (:func:`tokenfair_sidecar.scenarios.noisy_neighbor`) is sent over real HTTP on its
own timeline (arrival ``t`` model ms is sent at ``t * time_scale`` real ms) to the app with the
``costmodel`` backend, whose clock runs at the same scale.

What is asserted always — it holds however slow the machine is:

* every request gets exactly one answer and exactly one record, and the record says what the
  client got (status and reason, joined by ``x-request-id``); the records replay through the
  simulator's trace reader with the sizes the workload asked for;
* no reservation is left behind (books zero) and each tenant's served service tokens are the sum
  of its records' settlements;
* a refusal, if any, is one that lateness can cause (``shed_queue_timeout``,
  ``shed_queue_wait_slo``, ``shed_tenant_token_quota``: waits and budget refills are measured in
  time); a refusal by size or bound (``shed_kv_watermark``, ``queue_full``) never is.

What depends on the machine keeping time: the lesson's interactive lane runs within ~70 model ms
of its 420 ms wait limit, so whether *every* request is served, as the simulator serves them, is
asserted only when the event loop kept to the timeline: no stall over
:data:`MAX_STALL_MODEL_MS` and stalls summing to at most :data:`TOTAL_STALL_MODEL_MS` (a
watchdog task measures them). On an idle machine that is every run (the stalls measured are a few
model ms); on a machine oversubscribed 3x, stalls of 25+ model ms shed a request now and then, and
the run is checked on the invariants alone (the stalls are printed). Timing itself is measured in
``bench/``, not here.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from test_sidecar_support import (
    KEYS,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    lesson_tenants_with_keys,
    start,
)

from tokenfair_sidecar.config import PolicyConfig, build_config
from tokenfair_sidecar.core import Request
from tokenfair_sidecar.records import read_trace
from tokenfair_sidecar.scenarios import noisy_neighbor
from tokenfair_sidecar.server.settings import SidecarSettings
from tokenfair_sidecar.simulator import simulate

TIME_SCALE = 2.0
"""Real seconds per model second: at 2.0 the ~3 model seconds of the workload take ~6 s, and a
20 ms stall of the event loop is 10 model ms."""
WATCH_INTERVAL_S = 0.002
"""How often the watchdog task wakes to measure the event loop's lateness."""
STALL_MODEL_MS = 2.5
"""A wake-up later than this (5 real ms) counts as a stall."""
MAX_STALL_MODEL_MS = 10.0
"""The longest stall under which the run is held to the simulator's outcome."""
TOTAL_STALL_MODEL_MS = 100.0
"""The most stalled time in total under which the run is held to the simulator's outcome."""
LATENESS_REFUSALS = frozenset(
    {"shed_queue_timeout", "shed_queue_wait_slo", "shed_tenant_token_quota"}
)


async def test_noisy_neighbor_live(aiohttp_client: ClientFactory, tmp_path: Path) -> None:
    _, requests = noisy_neighbor()
    config = build_config(PolicyConfig(), lesson_tenants_with_keys(), "noisy-neighbor")
    simulated = simulate(config, requests, "tokenfair")
    simulated_admitted = Counter(d.tenant_id for d in simulated if d.admitted)
    # The simulator serves every request of the workload: 24 chat, 18 ide, 18 batch.
    assert simulated_admitted == {
        "tenant_chat_pro": 24,
        "tenant_ide_assist": 18,
        "tenant_batch_rag": 18,
    }

    records = tmp_path / "records.jsonl"
    settings = SidecarSettings(time_scale=TIME_SCALE, records_path=str(records))
    clients = await start(aiohttp_client, config, settings)
    loop = asyncio.get_running_loop()
    origin = loop.time()
    stalls_model_ms: list[float] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            before = loop.time()
            await asyncio.sleep(WATCH_INTERVAL_S)
            late_model_ms = (loop.time() - before - WATCH_INTERVAL_S) * 1000 / TIME_SCALE
            if late_model_ms > STALL_MODEL_MS:
                stalls_model_ms.append(late_model_ms)

    async def send(request: Request) -> tuple[str, int, str, str]:
        due = origin + request.arrival_ms * TIME_SCALE / 1000
        await asyncio.sleep(max(0.0, due - loop.time()))
        late_model_ms = (loop.time() - due) * 1000 / TIME_SCALE
        if late_model_ms > STALL_MODEL_MS:
            stalls_model_ms.append(late_model_ms)
        response = await clients.proxy.post(
            "/v1/completions",
            json=completion_body(request.prefill_tokens, request.decode_tokens),
            headers={"Authorization": f"Bearer {KEYS[request.tenant_id]}"},
        )
        payload = await response.json()
        code = payload["error"]["code"] if response.status != 200 else "admitted"
        return request.tenant_id, response.status, code, response.headers["x-request-id"]

    watchdog = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(send(r) for r in requests))
    finally:
        done.set()
        await watchdog

    # -- the invariants: whatever the machine's speed ------------------------------------------
    assert len(results) == len(requests)
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    assert clients.sidecar.recorder is not None
    clients.sidecar.recorder.flush()
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines) == len(requests)  # one record per request
    for _, status, code, request_id in results:
        assert (by_id[request_id]["status_code"], by_id[request_id]["reason"]) == (status, code)
    trace = read_trace(records, known_tenants=config.tenant_index)
    assert len(trace) == len(requests)
    # Each record carries the estimate the workload asked for (4 characters per token).
    sizes = Counter((r.request.prefill_tokens, r.request.decode_tokens) for r in trace)
    assert sizes == {(3200, 350): 18, (280, 90): 24, (420, 60): 18}
    for tenant_id, state in clients.sidecar.scheduler.tenants.items():
        settled = sum(
            line["actual_service_tokens"]
            for line in lines
            if line["tenant_id"] == tenant_id and line["status_code"] == 200
        )
        assert state.served_tokens == settled, tenant_id
    assert all(line["ttft_ms"] > 0 for line in lines if line["status_code"] == 200)
    refused = Counter((tenant, code) for tenant, status, code, _ in results if status != 200)
    assert {code for _, code in refused} <= LATENESS_REFUSALS, refused

    # -- the outcome, when the machine kept time -----------------------------------------------
    longest, total = max(stalls_model_ms, default=0.0), sum(stalls_model_ms)
    if longest > MAX_STALL_MODEL_MS or total > TOTAL_STALL_MODEL_MS:
        print(
            f"noisy-neighbor live: the event loop stalled up to {longest:.1f} model ms "
            f"({total:.1f} in all): outcome not compared with the simulator; refused: {refused}"
        )
        return
    assert not refused, f"refused (longest stall {longest:.1f} model ms): {refused}"
    served = Counter(tenant for tenant, status, _, _ in results if status == 200)
    assert served == simulated_admitted
