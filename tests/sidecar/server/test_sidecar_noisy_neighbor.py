"""A live, time-scaled run of the lesson's noisy-neighbor workload through the sidecar.

The workload (:func:`tokenfair.sim.scenarios.noisy_neighbor`) is sent over real HTTP on its
own timeline (arrival ``t`` model ms is sent at ``t * time_scale`` real ms) to the app with the
``costmodel`` backend, whose clock runs at the same scale. The run is made once (a module
fixture, on an event loop of its own) and checked by two tests.

The run is on virtual time (:func:`clock_support.run_virtual`): the event loop's clock, which
the sidecar's model clock, the dispatcher's timers, the ``costmodel`` backend and the sender all
read, moves only when the loop has nothing left to do. Work takes no time on it, so however
slow or loaded the machine, no request is sent late, no timer fires late and no interactive
request is shed for the machine's sake: the run is held to the simulator's outcome always (it
used to skip that comparison when the event loop stalled). Timing itself is measured in
``bench/``, not here.

``test_noisy_neighbor_live`` — every request gets exactly one answer and exactly one record, and
the record says what the client got (status and reason, joined by ``x-request-id``); the records
replay through the simulator's trace reader with the sizes the workload asked for; no
reservation is left behind (books zero) and each tenant's served service tokens are the sum of
its records' settlements.

``test_noisy_neighbor_live_matches_the_simulator`` — no refusal, and every tenant is served
exactly as the simulator serves it; each request's arrival on the sidecar's model clock is the
workload's own.
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
from clock_support import run_virtual
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
from tokenfair.records.codec import read_trace
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.scenarios import noisy_neighbor
from tokenfair.sim.simulator import simulate

TIME_SCALE = 2.0
"""Real (virtual) seconds per model second: the scaling between the two clocks is exercised."""


@dataclass
class LiveRun:
    config: Config
    requests: list[Request]
    simulated_admitted: Counter[str]
    results: list[tuple[str, int, str, str]]
    """(tenant, status, code, x-request-id) per request."""
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
        clock = live.sidecar.clock
        origin = clock.monotonic_s() - clock.real_seconds(clock.now_ms())  # model time 0

        async def send(request: Request) -> tuple[str, int, str, str]:
            await asyncio.sleep(origin + clock.real_seconds(request.arrival_ms) - loop.time())
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

        results = await asyncio.gather(*(send(r) for r in requests))
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
        config, list(requests), simulated_admitted, list(results), books, served_tokens, records,
    )  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    """The workload run once for this module's tests."""
    return run_virtual(_run(tmp_path_factory.mktemp("noisy-neighbor") / "records.jsonl"))


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


def test_noisy_neighbor_live_matches_the_simulator(live: LiveRun) -> None:
    assert not live.refused
    assert live.served == live.simulated_admitted
    # Each request reached the sidecar at its own arrival on the sidecar's model clock.
    arrivals = sorted(line["arrival_ms"] for line in live.lines)
    assert arrivals == pytest.approx(sorted(r.arrival_ms for r in live.requests), abs=1e-3)
