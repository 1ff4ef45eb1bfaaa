"""The ``costmodel`` engine as a batching engine (``maxBatchRequests`` S > 1), over real HTTP.

Behaviours under test (model time at ``time_scale`` 1: a model ms is a real ms; only lower bounds
and orderings are asserted — a slow machine makes things later, never earlier):

* the default in-flight limit is S (the sidecar's dispatcher sends S at once), follows a reload
  that changes S, and a set ``maxInFlight`` stands; ``/status`` shows the batch lane's slots
  (the interactive reserve) on a batching engine only;
* two equal requests run at once and share the engine: at G = 1 each ends after ``2 s / R`` (a
  serial engine ends the first at ``s / R``), and their first tokens come after the prefill
  stretched by ``v(1) / v(2) = 2``;
* a lone request runs at ``v(1) = R / G``: at G = S = 2, ``s / r1 = 2 s / R``;
* a third request waits in the sidecar's queue for a slot and is dispatched only when one of the
  first two has ended (the records say so);
* a stream's chunks are paced by the service the request has received and its last token comes
  when the fluid ends it; embeddings run in the same fluid;
* a client leaving mid-run takes its request off the engine (the other runs on alone) and the
  books end at zero; a batching engine frees a request's KV when it ends.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from sidecar_support import (
    CHAT,
    IDE,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    records_of,
    start,
    wait_for,
)

from tokenfair.config import PolicyConfig
from tokenfair.core.cost import CostModel
from tokenfair.server import LoadedFile
from tokenfair.server.backends import CostModelBackend
from tokenfair.server.reload import apply_config
from tokenfair.server.runtime_settings import SidecarSettings

RATE = 45.0
# 1000 prompt + 4 x 750 output = 4000 service tokens: s / R = 88.9 model ms alone at G = 1.
PROMPT, OUTPUT = 1000, 750
SERVICE = PROMPT + 4 * OUTPUT
ALONE_MS = SERVICE / RATE
PREFILL_MS = PROMPT / PolicyConfig().prefill_tokens_per_ms  # 20.8 ms


def batching_policy(batch: int, gain: float) -> PolicyConfig:
    return PolicyConfig(
        max_batch_requests=batch,
        batch_throughput_gain=gain,
        max_interactive_wait_ms=60_000,
        max_batch_wait_ms=60_000,
    )


def settings(tmp_path: Path, **changes: Any) -> SidecarSettings:
    return SidecarSettings(time_scale=1.0, records_path=str(tmp_path / "records.jsonl"), **changes)


async def post(client: Any, authorization: str, **extra: Any) -> tuple[int, Any]:
    response = await client.post(
        "/v1/completions",
        json=completion_body(PROMPT, OUTPUT, **extra),
        headers={"Authorization": authorization},
    )
    body = await response.text()
    return response.status, body


def by_id(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: r["dispatch_ms"])


async def test_in_flight_defaults_to_the_batch_and_follows_a_reload(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    clients = await start(aiohttp_client, keyed_config(batching_policy(4, 2.0)), settings(tmp_path))
    status = await (await clients.admin.get("/status")).json()
    assert status["max_in_flight"] == 4
    config = keyed_config(batching_policy(6, 3.0))
    apply_config(clients.sidecar, LoadedFile(replace(config, version="test-2"), {}, "2"))
    status = await (await clients.admin.get("/status")).json()
    assert status["max_in_flight"] == 6
    apply_config(clients.sidecar, LoadedFile(replace(keyed_config(), version="test-3"), {}, "3"))
    assert (await (await clients.admin.get("/status")).json())["max_in_flight"] == 2  # serial
    pinned = await start(
        aiohttp_client, keyed_config(batching_policy(4, 2.0)), settings(tmp_path, max_in_flight=3)
    )
    assert (await (await pinned.admin.get("/status")).json())["max_in_flight"] == 3


async def test_status_shows_the_batch_lanes_slots(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # S = 4 with the lesson's interactive tenants and no demand yet: the interactive reserve
    # is the one free slot (docs/capacity.md), the batch lane may hold 3 and holds none.
    clients = await start(aiohttp_client, keyed_config(batching_policy(4, 2.0)), settings(tmp_path))
    status = await (await clients.admin.get("/status")).json()
    assert status["slots"] == {"engine": 4, "batch": 3, "batch_running": 0}
    # A serial engine has no reserve to show.
    apply_config(clients.sidecar, LoadedFile(replace(keyed_config(), version="test-2"), {}, "2"))
    assert "slots" not in await (await clients.admin.get("/status")).json()


async def test_two_requests_share_the_engine_and_a_third_waits_for_a_slot(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    clients = await start(aiohttp_client, keyed_config(batching_policy(2, 1.0)), settings(tmp_path))
    sidecar = clients.sidecar
    first = asyncio.create_task(post(clients.proxy, CHAT, stream=True))
    second = asyncio.create_task(post(clients.proxy, IDE, stream=True))
    assert await wait_for(lambda: sidecar.scheduler.running == 2)
    third = asyncio.create_task(post(clients.proxy, CHAT))
    assert await wait_for(lambda: sidecar.scheduler.books().queued_requests == 1)
    results = await asyncio.gather(first, second, third)
    assert [status for status, _ in results] == [200, 200, 200]
    records = by_id(records_of(sidecar))
    assert [r["status_code"] for r in records] == [200, 200, 200]
    pair, last = records[:2], records[2]
    ends = [r["arrival_ms"] + r["e2e_ms"] for r in pair]
    for record in pair:
        run_ms = record["e2e_ms"] - record["queue_wait_ms"]
        # Both ran at R / 2 (at G = 1 the pair shares one throughput): 2 s / R, not s / R; the
        # first token after the prefill at v(1) / v(2) = 2 times its time alone.
        assert run_ms >= 1.5 * ALONE_MS
        assert record["ttft_ms"] - record["queue_wait_ms"] >= 1.5 * PREFILL_MS
    # The third waited in the sidecar's queue for a slot: dispatched once one of the two ended
    # (the end is stamped when its last bytes are out, a fraction of a ms after the engine's
    # end settled it and freed the slot).
    assert last["dispatch_ms"] >= min(ends) - 1.0
    assert last["queue_wait_ms"] >= ALONE_MS
    backend = sidecar.backend
    assert isinstance(backend, CostModelBackend)
    assert await books_when_settled(sidecar) == ZERO_BOOKS


async def test_a_lone_request_runs_at_its_speed_alone(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    # G = S = 2: one request alone runs at r1 = R / 2, as it would beside another.
    clients = await start(aiohttp_client, keyed_config(batching_policy(2, 2.0)), settings(tmp_path))
    status, _ = await post(clients.proxy, CHAT)
    assert status == 200
    [record] = records_of(clients.sidecar)
    assert record["e2e_ms"] - record["queue_wait_ms"] >= 1.5 * ALONE_MS
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_a_stream_is_paced_by_its_attained_service(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    clients = await start(aiohttp_client, keyed_config(batching_policy(4, 2.0)), settings(tmp_path))
    response = await clients.proxy.post(
        "/v1/completions",
        json=completion_body(PROMPT, 64, stream=True, stream_options={"include_usage": True}),
        headers={"Authorization": CHAT},
    )
    text = ""
    async for data in response.content.iter_any():
        text += data.decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len([c for c in chunks if c["choices"]]) == 16
    assert chunks[-1]["usage"]["completion_tokens"] == 64
    # Alone at G = 2: 1000 + 4 x 64 = 1256 tokens at 22.5 tokens/ms = 55.8 ms after dispatch:
    # the engine paced the chunks over that time (a lower bound: a busy machine only delays
    # them; when the client reads them is its own loop's business, so it is not asserted).
    [record] = records_of(clients.sidecar)
    assert record["e2e_ms"] - record["queue_wait_ms"] >= 0.9 * (PROMPT + 4 * 64) / (RATE / 2)
    embedded = await clients.proxy.post(
        "/v1/embeddings",
        json={"model": "m", "input": "x" * 4000},
        headers={"Authorization": CHAT},
    )
    assert embedded.status == 200
    assert len((await embedded.json())["data"]) == 1
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_a_client_leaving_mid_run_frees_its_share_and_kv(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    clients = await start(aiohttp_client, keyed_config(batching_policy(2, 1.0)), settings(tmp_path))
    sidecar = clients.sidecar
    backend = sidecar.backend
    assert isinstance(backend, CostModelBackend)
    engine = backend._batching
    assert engine is not None
    staying = asyncio.create_task(post(clients.proxy, IDE))
    leaving = asyncio.create_task(post(clients.proxy, CHAT))
    assert await wait_for(lambda: engine.running == 2)
    leaving.cancel()
    assert await wait_for(lambda: engine.running == 1)  # off the engine: the other runs alone
    status, _ = await staying
    assert status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    assert engine.running == 0
    # KV is freed when a request ends (kvResidencyFactor's hold is the serial engine's).
    serial = CostModelBackend(CostModel(), 1.0)
    assert backend.kv_hold_ms(None) == 0.0  # type: ignore[arg-type]
    assert serial._batching is None
