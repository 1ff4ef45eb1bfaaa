"""A live, time-scaled run of the lesson's noisy-neighbor workload through the sidecar.

The workload (:func:`tokenfair.sim.scenarios.noisy_neighbor`) is sent over real HTTP on its
own timeline (arrival ``t`` model ms is sent at ``t * time_scale`` real ms) to the app with the
``costmodel`` backend, whose clock runs at the same scale. The run is made once (a module
fixture, on an event loop of its own) and checked by two tests.

``test_noisy_neighbor_live`` — asserted always, however slow the machine is:

* every request gets exactly one answer and exactly one record, and the record says what the
  client got (status and reason, joined by ``x-request-id``); the records replay through the
  simulator's trace reader with the sizes the workload asked for;
* no reservation is left behind (books zero) and each tenant's served service tokens are the sum
  of its records' settlements;
* a refusal, if any, is one lateness can cause: an interactive request shed from the queue
  (``shed_queue_timeout``) or at the door because its wait counted from its arrival passed the
  limit (``shed_queue_wait_slo``) — the interactive lane runs within ~40 model ms of its 420 ms
  wait limit; batch waits up to 3,500 ms, and nothing else depends on time here;
* with no refusal, every tenant is served exactly as the simulator serves it.

``test_noisy_neighbor_live_matches_the_simulator`` — what depends on the machine keeping time:
with no stall of the event loop over :data:`MAX_STALL_MODEL_MS` and stalls summing to at most
:data:`TOTAL_STALL_MODEL_MS` (a watchdog task measures them), there must be no refusal at all.
When the machine did stall and an interactive request was shed, that comparison is skipped —
visibly, with the stalls and refusals in the skip reason. On an idle machine the stalls
measured are a few model ms; on one oversubscribed 3x, stalls of 25+ model ms shed a request now
and then. Timing itself is measured in ``bench/``, not here.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sidecar_support import (
    KEYS,
    ZERO_BOOKS,
    books_when_settled,
    completion_body,
    lesson_tenants_with_keys,
    start,
)

from tokenfair.config import Config, PolicyConfig, build_config
from tokenfair.core import Books, Request
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.records import read_trace
from tokenfair.sim.scenarios import noisy_neighbor
from tokenfair.sim.simulator import simulate

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
LATENESS_REFUSALS = {("interactive", "shed_queue_timeout"), ("interactive", "shed_queue_wait_slo")}
"""What lateness alone can cause here: an interactive request expiring in the queue, or refused
at the door because its wait, counted from its arrival, already passed the limit (the simulator
admits ide-16 with 378 of its 420 ms predicted; a 45 ms stall refuses it)."""
"""The one refusal (priority class, reason) that lateness of the event loop can cause."""


@dataclass
class LiveRun:
    config: Config
    requests: list[Request]
    simulated_admitted: Counter[str]
    results: list[tuple[str, int, str, str]]
    """(tenant, status, code, x-request-id) per request."""
    stalls_model_ms: list[float]
    books: Books
    served_tokens: dict[str, int]
    records: Path

    @property
    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.records.read_text().splitlines()]

    @property
    def refused(self) -> Counter[tuple[str, str]]:
        return Counter((tenant, code) for tenant, status, code, _ in self.results if status != 200)

    @property
    def served(self) -> Counter[str]:
        return Counter(tenant for tenant, status, _, _ in self.results if status == 200)

    @property
    def stalled(self) -> bool:
        longest, total = max(self.stalls_model_ms, default=0.0), sum(self.stalls_model_ms)
        return longest > MAX_STALL_MODEL_MS or total > TOTAL_STALL_MODEL_MS

    def describe_stalls(self) -> str:
        return (
            f"the event loop stalled up to {max(self.stalls_model_ms, default=0.0):.1f} model ms "
            f"({sum(self.stalls_model_ms):.1f} in all)"
        )


async def _run(records: Path) -> LiveRun:
    _, requests = noisy_neighbor()
    config = build_config(PolicyConfig(), lesson_tenants_with_keys(), "noisy-neighbor")
    simulated = simulate(config, requests, "tokenfair")
    simulated_admitted = Counter(d.tenant_id for d in simulated if d.admitted)
    clients: list[TestClient[Any, Any]] = []

    async def client_for(app: web.Application) -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    try:
        settings = SidecarSettings(time_scale=TIME_SCALE, records_path=str(records))
        live = await start(client_for, config, settings)
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
            response = await live.proxy.post(
                "/v1/completions",
                json=completion_body(request.prefill_tokens, request.decode_tokens),
                headers={"Authorization": f"Bearer {KEYS[request.tenant_id]}"},
            )
            payload = await response.json()
            error = payload.get("error", {})
            code = (
                error.get("tokenfair_reason", error.get("code"))
                if response.status != 200
                else "admitted"
            )
            return request.tenant_id, response.status, code, response.headers["x-request-id"]

        watchdog = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(send(r) for r in requests))
        finally:
            done.set()
            await watchdog
        books = await books_when_settled(live.sidecar)
        assert live.sidecar.outcomes.record_writer is not None
        live.sidecar.outcomes.record_writer.flush()
        served_tokens = {
            tenant_id: state.served_tokens
            for tenant_id, state in live.sidecar.scheduler.tenants.items()
        }
    finally:
        for client in clients:
            await client.close()
    return LiveRun(
        config, list(requests), simulated_admitted, list(results), stalls_model_ms, books,
        served_tokens, records,
    )  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    """The workload run once for this module's tests."""
    return asyncio.run(_run(tmp_path_factory.mktemp("noisy-neighbor") / "records.jsonl"))


def test_noisy_neighbor_live(live: LiveRun) -> None:
    # The simulator serves every request of the workload: 24 chat, 18 ide, 18 batch.
    assert live.simulated_admitted == {
        "tenant_chat_pro": 24,
        "tenant_ide_assist": 18,
        "tenant_batch_rag": 18,
    }
    assert len(live.results) == len(live.requests)
    assert live.books == ZERO_BOOKS
    lines = live.lines
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines) == len(live.requests)  # one record per request
    for _, status, code, request_id in live.results:
        assert (by_id[request_id]["status_code"], by_id[request_id]["reason"]) == (status, code)
    trace = read_trace(live.records, known_tenants=live.config.tenant_index)
    assert len(trace) == len(live.requests)
    # Each record carries the estimate the workload asked for (4 characters per token).
    sizes = Counter((r.request.prefill_tokens, r.request.decode_tokens) for r in trace)
    assert sizes == {(3200, 350): 18, (280, 90): 24, (420, 60): 18}
    for tenant_id, served_tokens in live.served_tokens.items():
        settled = sum(
            line["actual_service_tokens"]
            for line in lines
            if line["tenant_id"] == tenant_id and line["status_code"] == 200
        )
        assert served_tokens == settled, tenant_id
    assert all(line["ttft_ms"] > 0 for line in lines if line["status_code"] == 200)
    refusals = Counter(
        (line["priority_class"], line["reason"]) for line in lines if line["status_code"] != 200
    )
    assert set(refusals) <= LATENESS_REFUSALS, (refusals, live.describe_stalls())
    if not refusals:
        assert live.served == live.simulated_admitted


def test_noisy_neighbor_live_matches_the_simulator(live: LiveRun) -> None:
    refused = live.refused
    if refused and live.stalled:
        pytest.skip(
            f"noisy-neighbor live: {live.describe_stalls()}, and {sum(refused.values())} "
            f"interactive request(s) were shed ({dict(refused)}): the outcome is not compared "
            "with the simulator's on a machine that did not keep time"
        )
    assert not refused, f"refused ({live.describe_stalls()}): {refused}"
    assert live.served == live.simulated_admitted
