"""The admin port at 10,000 tenants leaves the event loop to the proxy, and a bad key costs the
same whatever the tenant count (issue 28, row 4).

* ``/metrics`` with 2,000 tenants' series and ``/status`` with 10,000 tenants are written a
  bounded chunk at a time: between two turns of the event loop the renderer touches at most a
  chunk's worth of series (``/metrics``) or tenants (``/status``) — counted, not timed — and a
  proxied request sent while a scrape is being written is answered before the scrape's last
  series is read. Both documents stay whole and valid (the text parses, every series is there;
  the JSON parses, every tenant is there); ``HEAD`` gets the head alone, and a scraper that
  leaves mid-way ends the rendering with nothing logged.
* API keys are looked up by digest: every tenant's key finds its tenant among 10,000, a bad
  key finds none, and no lookup compares the presented digest with each known one.

The timing targets (a neighbour's p99 under scrapes, the 401's cost) are
``bench/bench_admin_scale.py``'s.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from loopback_support import free_ports
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from sidecar_support import (
    PATIENT_POLICY,
    ClientFactory,
    Clients,
    completion_body,
    start,
)

from tokenfair.config import Config, api_key_digest, build_config
from tokenfair.server import create_admin_app
from tokenfair.server.auth import Authenticator
from tokenfair.server.exposition import COUNTER_CHUNK
from tokenfair.server.metrics import LaneSeries
from tokenfair.server.status import STATUS_CHUNK
from tokenfair.sim.scenarios import LESSON_TENANTS

pytestmark = pytest.mark.virtual_time

TENANTS = 10_000
ACTIVE = 2_000


def many_tenants(count: int = TENANTS) -> Config:
    """``count`` tenants, ``tenant-00000`` …, each with the key ``key-<n>``."""
    template = LESSON_TENANTS[0]
    tenants = [
        replace(
            template,
            tenant_id=f"tenant-{n:05d}",
            priority_class="interactive" if n % 2 else "batch",
            api_key_sha256=(api_key_digest(f"key-{n}"),),
        )
        for n in range(count)
    ]
    return build_config(PATIENT_POLICY, tenants, "scale-1")


class Touched:
    """Which objects the renderer read, and the most it read between two turns of the loop."""

    def __init__(self) -> None:
        self.since_turn: set[int] = set()
        self.total: set[int] = set()
        self.most_per_turn = 0
        self.reads = 0

    def touch(self, one: object) -> None:
        self.reads += 1
        self.since_turn.add(id(one))
        self.total.add(id(one))

    def turn(self) -> None:
        self.most_per_turn = max(self.most_per_turn, len(self.since_turn))
        self.since_turn = set()


def watched_series(touched: Touched) -> type[LaneSeries]:
    class Watched(LaneSeries):
        """A series that notes every read of its attributes by the renderer."""

        def __getattribute__(self, name: str) -> Any:
            touched.touch(self)
            return super().__getattribute__(name)

    return Watched


async def fetch(clients: Clients, path: str) -> tuple[int, str, str]:
    """Status, content type and the whole body of an admin GET."""
    response = await clients.admin.get(path)
    return response.status, response.headers["Content-Type"], await response.text()


async def turns_until(done: Callable[[], bool], touched: Touched) -> None:
    """One :meth:`Touched.turn` per turn of the event loop until ``done()``."""
    while not done():
        await asyncio.sleep(0)
        touched.turn()


@pytest.mark.wall_time  # the ticker turns the loop without pause: virtual time would stand still
async def test_metrics_are_written_a_chunk_at_a_time_and_a_request_goes_between(
    aiohttp_client: ClientFactory,
) -> None:
    clients = await start(aiohttp_client, many_tenants())
    metrics = clients.sidecar.metrics
    touched = Touched()
    watched = watched_series(touched)
    for n in range(ACTIVE):
        lane = "interactive" if n % 2 else "batch"
        series = watched(f"tenant-{n:05d}", lane, metrics.lane_series("probe", lane).ttft)
        series.admitted = n
        series.queue_wait.observe(0.02)
        metrics.series[(series.tenant, lane)] = series
    del metrics.series[("probe", "interactive")], metrics.series[("probe", "batch")]
    touched.since_turn.clear()  # the set-up's reads
    touched.total.clear()

    scrape = asyncio.create_task(fetch(clients, "/metrics"))
    ticker = asyncio.create_task(turns_until(scrape.done, touched))
    # Once the renderer has begun, a tenant's request is served before it ends.
    while not touched.total:
        await asyncio.sleep(0)
    answer = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 5), headers={"Authorization": "Bearer key-2001"}
    )
    assert answer.status == 200
    reads_when_answered = touched.reads
    status, content_type, text = await scrape
    await ticker
    assert reads_when_answered < touched.reads, "the request waited for the whole scrape"

    assert status == 200
    assert content_type == CONTENT_TYPE_LATEST
    assert 0 < touched.most_per_turn <= COUNTER_CHUNK
    admitted = {
        sample.labels["tenant"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenfair_admitted_requests_total"
    }
    assert {f"tenant-{n:05d}" for n in range(ACTIVE)} <= admitted.keys()
    assert admitted["tenant-01999"] == 1999


async def test_status_is_written_a_chunk_at_a_time(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, many_tenants())
    touched = Touched()

    class WatchedCounts(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            touched.touch(key)
            return super().get(key, default)

    clients.sidecar.outcomes.tenant_counts = WatchedCounts()
    scrape = asyncio.create_task(fetch(clients, "/status"))
    ticker = asyncio.create_task(turns_until(scrape.done, touched))
    status, content_type, text = await scrape
    await ticker
    document = json.loads(text)

    assert status == 200
    assert content_type == "application/json; charset=utf-8"
    assert len(touched.total) == TENANTS
    assert 0 < touched.most_per_turn <= STATUS_CHUNK
    assert len(document["tenants"]) == TENANTS
    assert document["tenants"]["tenant-09999"]["queued_requests"] == 0
    assert document["books"]["queued_requests"] == 0
    assert document["config"]["version"] == "scale-1"
    for path in ("/status", "/metrics"):  # HEAD: the head alone
        head = await clients.admin.head(path)
        assert head.status == 200
        assert await head.read() == b""


async def test_status_and_metrics_stay_whole_with_a_budget_store_section(
    aiohttp_client: ClientFactory, clients_with_pool: Clients
) -> None:
    """The pool's per-tenant parts (``/status``' ``budget_store.tenants``, the leased and
    returned counters) are streamed too, and the documents stay valid."""
    status = await (await clients_with_pool.admin.get("/status")).json()
    assert set(status["budget_store"]["tenants"]) == set(status["tenants"])
    assert status["budget_store"]["kind"] == "redis"
    text = await (await clients_with_pool.admin.get("/metrics")).text()
    leased = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenfair_budget_store_leased_service_tokens_total"
    ]
    assert {sample.labels["tenant"] for sample in leased} == set(status["tenants"])


async def test_a_scraper_that_leaves_mid_scrape_ends_it_quietly(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """On an admin listener set up as ``runner.py`` sets it up (no handler cancellation: the
    handler meets the closed socket at its next write), a scraper that leaves after the first
    chunk ends the rendering with nothing logged, and the next scrape is whole."""
    clients = await start(aiohttp_client, many_tenants(2_000))
    for n in range(2_000):
        clients.sidecar.metrics.lane_series(f"tenant-{n:05d}", "batch").admitted += 1
    runner = web.AppRunner(create_admin_app(clients.sidecar), access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        for path in ("/metrics", "/status"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode())
            await writer.drain()
            await reader.read(1_000)  # the head and the first chunk, then gone
            writer.transport.abort()
            for _ in range(100):  # the handler meets the closed socket at its next chunk
                await asyncio.sleep(0)
        # A whole scrape afterwards (hundreds of turns of the loop more).
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as response,
        ):
            assert response.status == 200
            assert 'tenant="tenant-01999"' in await response.text()
    finally:
        await runner.cleanup()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.fixture
async def clients_with_pool(aiohttp_client: ClientFactory) -> Clients:
    """A sidecar of 1,200 tenants with a budget store nobody answers (its pool falls back)."""
    from tokenfair.config.budget_store import BudgetStoreConfig

    config = many_tenants(1_200)
    store = BudgetStoreConfig(url="redis://127.0.0.1:1", replicas=2)
    return await start(aiohttp_client, replace(config, budget_store=store))


def test_every_key_finds_its_tenant_among_10000_and_no_digest_is_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = many_tenants()
    auth = Authenticator(config)
    comparisons = 0
    compare = hmac.compare_digest

    def counted(a: Any, b: Any) -> bool:
        nonlocal comparisons
        comparisons += 1
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    for n in (0, 1, 4_999, 9_999):
        tenant = auth.authenticate(f"Bearer key-{n}", None)
        assert tenant is not None
        assert tenant.tenant_id == f"tenant-{n:05d}"
    assert auth.authenticate("Bearer key-10000", None) is None
    assert auth.authenticate("Bearer \udcff", None) is None
    assert auth.authenticate("Bearer  key-7 \n", None) is not None  # trimmed, as documented
    # A lookup by digest: a bad key is not compared with each of the 10,000 known digests.
    assert comparisons == 0
