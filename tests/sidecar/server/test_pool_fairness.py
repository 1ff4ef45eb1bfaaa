"""Pool-wide fair shares on a real redis-server (server/pool_fairness.py), the core driven
synchronously on fake clocks:

- two replicas share service counters: a tenant served on the other replica yields here, so the
  tenant only this replica can serve takes it (per replica it would get half); one store call
  per batch, batches only when due;
- the store's hashes hold each tenant's cumulative whole tokens, per lane;
- redis-server killed: the batch fails, the replica falls back to its own round robin at once
  (order and counters say so), keeps counting, probes every probeIntervalMs, and rejoins when
  the server is back (restarted empty), sending what it gave meanwhile;
- redis-server stopped (SIGSTOP) past timeoutMs: the same fallback, bounded by the timeout;
- garbage in the store (a key of the wrong type, a field that is no integer or negative) is
  repaired and counted, the garbled tenant set to the highest valid total: a negative field
  does not starve the other tenants; no total is written below 0 nor believed below 0;
- a tenant a reload removed is dropped from the counters and its fields deleted once it has
  nothing left here; backlogged again while the delete is in flight, its rank follows;
- the config fields (``fairness``, ``fairnessSyncMs``, ``fairnessLeaseServiceTokens``) and their
  errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as redis_asyncio
from clock_support import run_virtual
from redis_store import RedisServer, redis_server

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.config.budget_store import BudgetStoreConfig, parse_budget_store
from tokenfair.config.fields import ConfigError
from tokenfair.core import Request
from tokenfair.core.cost import CostModel
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.server.backends import make_backend
from tokenfair.server.pool_fairness import FAIRNESS_SCRIPT, KEY_TTL_MS, PoolFairness, _totals
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.server.sidecar import Sidecar

__all__ = ["redis_server"]  # the fixture, used by name

TENANTS = (
    TenantConfig("pinned", 1.0, 10**9, 10**7, "interactive"),
    TenantConfig("flood", 1.0, 10**9, 10**7, "interactive"),
)
COST = 280 + 4 * 90  # service tokens of one request


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 1000.0

    def __call__(self) -> float:
        return self.now_ms


class Replica:
    _ids = itertools.count()

    def __init__(self, store: BudgetStoreConfig, client: object, clock: FakeClock) -> None:
        config = build_config(PolicyConfig(max_interactive_wait_ms=10**6), TENANTS)
        self.scheduler = TokenfairScheduler(config)
        self.fairness = PoolFairness(store, self.scheduler, client, monotonic_ms=clock)
        self.clock = clock
        self.served: dict[str, int] = {"pinned": 0, "flood": 0}

    def offer(self, tenant_id: str, count: int) -> None:
        for _ in range(count):
            request = Request(f"{tenant_id}{next(self._ids)}", tenant_id, 0.0, 280, 90,
                              "interactive")  # fmt: skip
            assert self.scheduler.submit(request, self.clock()) is None

    def serve(self, count: int) -> None:
        for _ in range(count):
            decision = self.scheduler.next_dispatch(self.clock())
            assert decision is not None
            self.scheduler.complete(decision.request_id, self.clock())
            self.served[decision.tenant_id] += decision.service_tokens


def _store(url: str, **changes: object) -> BudgetStoreConfig:
    settings: dict[str, object] = {
        "timeout_ms": 5000.0,  # a loaded machine never times out a live store
        "probe_interval_ms": 1000.0,
        "fairness_sync_ms": 100.0,
        "fairness_lease_tokens": 5 * COST,
        **changes,
    }
    return BudgetStoreConfig(url, key_prefix="t30", **settings)  # type: ignore[arg-type]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis_asyncio.Redis]:
    connection = redis_asyncio.Redis.from_url(
        redis_server.url, socket_timeout=5.0, socket_connect_timeout=5.0
    )
    yield connection
    await connection.aclose()


async def test_a_tenant_served_elsewhere_yields_here(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    clock = FakeClock()
    store = _store(redis_server.url)
    here, there = Replica(store, client, clock), Replica(store, client, clock)
    here.offer("pinned", 200)
    here.offer("flood", 200)
    there.offer("flood", 200)
    for _ in range(30):  # the two replicas serve side by side, syncing when due
        here.serve(5)
        there.serve(5)
        clock.now_ms += 10.0
        for replica in (here, there):
            await replica.fairness.refresh()
    # flood got 150 requests there and some here: here, pinned is owed all but a batch's worth
    assert here.served["pinned"] >= 0.85 * 150 * COST
    assert here.served["flood"] <= 0.15 * 150 * COST
    calls = here.fairness.store_calls + there.fairness.store_calls
    assert calls == 300 // 5  # one call per batch, one batch per lease (5 requests' tokens)
    totals = await client.hgetall("t30:fair:interactive")
    assert int(totals[b"flood"]) + int(totals[b"pinned"]) <= 300 * COST
    assert int(totals[b"flood"]) >= (150 - 5) * COST


async def test_per_replica_without_the_pool_gives_half(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    """The baseline of the test above: the same traffic, the counters not shared."""
    clock = FakeClock()
    here = Replica(_store(redis_server.url), client, clock)
    here.scheduler.share_pool_service(None)
    here.offer("pinned", 200)
    here.offer("flood", 200)
    here.serve(150)
    assert here.served["pinned"] == pytest.approx(75 * COST, rel=0.05)


async def test_killed_store_falls_back_and_rejoins(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    clock = FakeClock()
    replica = Replica(_store(redis_server.url), client, clock)
    replica.offer("pinned", 50)
    replica.offer("flood", 50)
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert replica.fairness.batches == 1
    redis_server.kill()
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    fairness = replica.fairness
    assert not fairness.shared
    assert fairness.fallbacks == 1
    assert not fairness.service.sharing
    assert fairness.status()["mode"] == "per_replica"
    # per replica: the round robin (its bound: 3 quanta of 1200 and two requests apart)
    before = dict(replica.served)
    replica.serve(20)
    pinned = replica.served["pinned"] - before["pinned"]
    gap = pinned - (replica.served["flood"] - before["flood"])
    assert abs(gap) <= 3 * 1200 + 2 * COST
    redis_server.start()  # empty
    clock.now_ms += 500.0  # before the probe is due: nothing is tried
    calls = fairness.store_calls
    await fairness.refresh()
    assert fairness.store_calls == calls
    clock.now_ms += 600.0
    await fairness.refresh()
    assert fairness.shared
    assert fairness.service.sharing
    totals = await client.hgetall("t30:fair:interactive")
    # the batch that failed (6 requests) is not sent again; the 20 given while fallen back are
    assert sum(int(v) for v in totals.values()) == 20 * COST


async def test_a_stopped_store_falls_back_within_the_timeout(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    clock = FakeClock()
    replica = Replica(_store(redis_server.url, timeout_ms=50.0), client, clock)
    replica.offer("pinned", 20)
    replica.offer("flood", 20)
    replica.serve(6)
    redis_server.pause()
    try:
        clock.now_ms += 200.0
        await replica.fairness.refresh()
        assert not replica.fairness.shared
        assert "Timeout" in replica.fairness.last_error
    finally:
        redis_server.resume()


async def test_garbage_is_repaired(redis_server: RedisServer, client: redis_asyncio.Redis) -> None:
    await client.set("t30:fair:batch", "not a hash")
    await client.hset("t30:fair:interactive", mapping={"flood": "1e400", "other": "900"})
    clock = FakeClock()
    replica = Replica(_store(redis_server.url), client, clock)
    replica.offer("pinned", 5)
    replica.offer("flood", 5)
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert replica.fairness.shared
    assert replica.fairness.repaired_fields == 2
    assert await client.type("t30:fair:batch") in (b"none", b"hash")
    totals = await client.hgetall("t30:fair:interactive")
    # flood: repaired to the highest valid total of the hash (pinned's, written first in the
    # same batch, or other's 900), plus what it was given here
    highest = max(900, replica.served["pinned"])
    assert int(totals[b"flood"]) == highest + replica.served["flood"]


@pytest.mark.parametrize("planted", ["-9000000000000000", "-1000000000"])
async def test_a_negative_field_starves_no_one(
    redis_server: RedisServer, client: redis_asyncio.Redis, planted: str
) -> None:
    await client.hset("t30:fair:interactive", "flood", planted)
    clock = FakeClock()
    replica = Replica(_store(redis_server.url), client, clock)
    replica.offer("pinned", 40)
    replica.offer("flood", 40)
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert replica.fairness.shared
    assert replica.fairness.repaired_fields == 1
    totals = await client.hgetall("t30:fair:interactive")
    assert int(totals[b"flood"]) >= replica.served["flood"]
    # believed, the planted total would give flood every one of the next requests
    before = dict(replica.served)
    replica.serve(20)
    pinned = replica.served["pinned"] - before["pinned"]
    flood = replica.served["flood"] - before["flood"]
    assert pinned >= 8 * COST
    assert abs(pinned - flood) <= 3 * 1200 + 2 * COST


async def test_no_total_is_written_or_believed_below_zero(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    keys = ("t30:fair:interactive", "t30:fair:batch")
    # a refund (negative tokens) sent after the store restarted empty
    reply = await client.eval(FAIRNESS_SCRIPT, 2, *keys, 1, "flood", -50, 0, KEY_TTL_MS)
    assert reply == [[0], [], 0]
    assert await client.hget(keys[0], "flood") == b"0"
    with pytest.raises(ValueError, match="negative total"):
        _totals([[-50], [], 0], ([("flood", -50)], []))


async def test_a_removed_tenant_is_dropped_here_and_in_the_store(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    clock = FakeClock()
    replica = Replica(_store(redis_server.url), client, clock)
    replica.offer("pinned", 10)
    replica.offer("flood", 3)
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert set(await client.hkeys("t30:fair:interactive")) == {b"pinned", b"flood"}
    lane = replica.fairness.service.lanes[0]
    replica.fairness.forget({"flood"}, {"pinned"})
    replica.serve(1)  # flood's last queued request, if any: still served, then dropped
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert await client.hkeys("t30:fair:interactive") == [b"pinned"]
    assert "flood" not in lane.pool_units
    assert "flood" not in lane.active_epoch
    assert "pinned" in lane.pool_units
    # the tenant added back by a later reload is not dropped again
    replica.fairness.forget(set(), {"pinned", "flood"})
    replica.offer("flood", 1)
    replica.serve(3)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert b"flood" in await client.hkeys("t30:fair:interactive")


class _RejoinDuringHdel:
    """The store's client, but its ``hdel`` first runs ``during`` (what the event loop may do
    while the call is in flight)."""

    def __init__(self, client: redis_asyncio.Redis, during: Callable[[], None]) -> None:
        self._client = client
        self._during = during

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def hdel(self, key: str, *fields: str) -> Any:
        self._during()
        return await self._client.hdel(key, *fields)


async def test_a_removed_tenant_backlogged_again_during_the_delete_is_ranked_afresh(
    redis_server: RedisServer, client: redis_asyncio.Redis
) -> None:
    # Its counters are dropped after the call: its place in the lane's ranking moves with them
    # (review rev1207c F3: deleting that rekey left every test green).
    clock = FakeClock()
    replica = Replica(_store(redis_server.url), client, clock)
    replica.fairness.client = _RejoinDuringHdel(client, lambda: replica.offer("flood", 1))
    replica.offer("pinned", 10)
    replica.offer("flood", 3)
    replica.serve(6)
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    lane = replica.fairness.service.lanes[0]
    replica.fairness.forget({"flood"}, {"pinned"})
    replica.serve(1)  # flood's last queued request, if any
    assert "flood" not in set(lane.backlog())
    clock.now_ms += 200.0
    await replica.fairness.refresh()
    assert "flood" in set(lane.backlog())  # it sent again during the call
    assert "flood" not in lane.pool_units
    fresh = sorted((lane.counter(t, lane.ranked_quanta[t]), t) for t in lane.ranked_keys)
    assert lane.ranked == fresh
    assert set(lane.ranked_keys) == set(lane.backlog())


def test_the_config_fields() -> None:
    url = {"redis": {"url": "redis://r:6379"}}
    parsed = parse_budget_store(
        {**url, "fairness": False, "fairnessSyncMs": 50, "fairnessLeaseServiceTokens": 1000}
    )
    assert (parsed.fairness, parsed.fairness_sync_ms, parsed.fairness_lease_tokens) == (
        False,
        50.0,
        1000,
    )
    for field, value, rule in (
        ("fairness", "yes", "must be true or false"),
        ("fairnessSyncMs", 0, "must be in [1, 60000]"),
        ("fairnessLeaseServiceTokens", 0.5, "must be an integer"),
    ):
        with pytest.raises(ConfigError) as error:
            parse_budget_store({**url, field: value})
        assert str(error.value).startswith(f"budgetStore.{field}: ")
        assert rule in str(error.value)


# -- the sidecar's clocks (review rev1207f F5) ---------------------------------------------------


class _FakeStore:
    """An in-process stand-in for the store's client: :data:`FAIRNESS_SCRIPT` as arithmetic
    (cumulative totals per lane and tenant), or every call failing (``down``)."""

    def __init__(self, *, down: bool = False) -> None:
        self.down = down
        self.totals: list[dict[str, int]] = [{}, {}]
        self.pings = 0

    async def eval(self, _script: str, key_count: int, *args: object) -> list[object]:
        if self.down:
            raise ConnectionError("down")
        arguments = list(args[key_count:])
        answer: list[object] = []
        at = 0
        for lane in range(key_count):
            count = int(str(arguments[at]))
            at += 1
            values = []
            for _ in range(count):
                tenant_id, tokens = str(arguments[at]), int(str(arguments[at + 1]))
                at += 2
                self.totals[lane][tenant_id] = self.totals[lane].get(tenant_id, 0) + tokens
                values.append(self.totals[lane][tenant_id])
            answer.append(values)
        return [*answer, 0]

    async def ping(self) -> bool:
        self.pings += 1
        if self.down:
            raise ConnectionError("down")
        return True


def _sidecar(time_scale: float, store: BudgetStoreConfig) -> Sidecar:
    """A sidecar with ``store`` (made inside the running loop, as the app makes it), the two
    tenants backlogged in its scheduler (nothing dispatched: their order is what a batch is
    for), its fairness task's store replaced by a :class:`_FakeStore`."""
    config = replace(
        build_config(PolicyConfig(max_interactive_wait_ms=10**7), TENANTS), budget_store=store
    )
    settings = SidecarSettings(time_scale=time_scale)
    sidecar = Sidecar(
        settings, config, make_backend(settings, CostModel.from_policy(config.policy))
    )
    for tenant_id in ("pinned", "flood"):
        request = Request(f"{tenant_id}-1", tenant_id, 0.0, 280, 90, "interactive")
        assert sidecar.scheduler.submit(request, sidecar.clock.now_ms()) is None
    return sidecar


async def _run_for(fairness: PoolFairness, seconds: float) -> None:
    task = asyncio.create_task(fairness.run())
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_the_sidecars_batches_follow_its_clock_in_model_ms() -> None:
    """``fairnessSyncMs`` is model time on the sidecar's own clock (``--time-scale 2``: a batch
    every 20 real s at 10,000 model ms), so it follows the virtual loop: batches at 0, 20, 40
    and 60 s in 65 s. (It read ``time.monotonic()``, which a virtual minute does not move: one
    batch.) ``/status``' ``since_ms`` is on the same clock as the records' ``clock_ms``."""

    async def scenario() -> tuple[int, float, float]:
        sidecar = _sidecar(2.0, _store("redis://127.0.0.1:9", fairness_sync_ms=10_000.0))
        fairness = sidecar.pool_fairness
        assert fairness is not None
        fairness.client = store = _FakeStore()
        await _run_for(fairness, 65.0)
        assert store.totals[0] == {"pinned": 0, "flood": 0}  # named, nothing served yet
        since_ms = fairness.status()["since_ms"]
        assert isinstance(since_ms, float)
        return fairness.batches, since_ms, sidecar.clock.now_ms()

    batches, since_ms, now_ms = run_virtual(scenario())
    assert batches == 4
    assert 0.0 <= since_ms <= now_ms  # the sidecar's model ms since its start


def test_the_sidecars_probes_follow_its_clock_in_real_ms() -> None:
    """Fallen back, the store is probed every ``probeIntervalMs`` of *real* time on the
    sidecar's clock: about 10 probes in 10 virtual s at 1,000 ms, whatever ``--time-scale``
    (at 4 it probed every 4 real s when the probe read model ms; on ``time.monotonic()`` a
    virtual run did not probe again at all)."""

    async def scenario() -> tuple[int, bool]:
        sidecar = _sidecar(4.0, _store("redis://127.0.0.1:9", probe_interval_ms=1_000.0))
        fairness = sidecar.pool_fairness
        assert fairness is not None
        fairness.client = store = _FakeStore(down=True)
        await _run_for(fairness, 0.5)  # the first batch fails: per replica
        assert not fairness.shared
        pings_before = store.pings
        await _run_for(fairness, 10.0)
        return store.pings - pings_before, fairness.shared

    pings, shared = run_virtual(scenario())
    assert 9 <= pings <= 11
    assert not shared
