"""Pool-wide budgets on a real redis-server: the lease-backed bucket of the core, the budget
store's config section, and the sidecars' lease client (:mod:`tokenfair.server.pool`).

Behaviours under test:

* the core's :class:`LeasedBucket` spends only what was granted, reports shortfalls, falls back
  to a time-refilled split and rejoins keeping debts and dropping credit;
* ``budgetStore`` parses from a config document and a SchedulingPolicy manifest, round-trips,
  and every bad field is refused by name and rule;
* one sidecar of four, carrying all of a tenant's traffic, is served its whole pool budget
  (>= 95 % of ``sustained * window``, where the split gives 25 %), with at most 0.1 store
  calls per request;
* four greedy sidecars together never exceed ``burst + sustained * window`` by more than the
  stated bound, ``replicas * (chunk + max(chunk, what the core asked for))``;
* idle balances, settlement refunds and debts, and the balance at shutdown reach the shared
  bucket;
* a store killed (or stopped) mid-run falls back to the split within one call's timeout, says
  so in ``/status`` and the metrics, and rejoins when it is back; over HTTP no request gets a
  5xx and the books end at zero;
* garbage in a tenant's key (a level of -1e300, -inf, NaN or no number, a time of 1e300 or
  NaN, a key of the wrong type) is repaired by the lease script to an empty bucket: the tenant
  is served again within a chunk's refill, the pool never falls back for it, the repair is
  counted; an answer out of range (as a store of another version could give) delays the
  tenant's next ask by at most a chunk's refill, so it recovers once the key is gone;
* the operator renders a policy with a store with whole budgets and the store section (key
  prefix per namespace and policy, the Ready sidecars as the fallback's replicas), and refuses
  a bad store by field.

Time is a fake wall clock handed to the lease client and the core: nothing depends on speed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis_asyncio
import yaml
from redis_store import RedisServer, redis_server
from sidecar_support import (
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    start,
    wait_for,
)

from tokenfair.config import (
    ConfigError,
    PolicyConfig,
    TenantConfig,
    build_config,
    config_to_document,
    loads_config,
)
from tokenfair.config.budget_store import BudgetStoreConfig, parse_budget_store
from tokenfair.core import Request, Scheduler, make_scheduler
from tokenfair.core.bucket import LeasedBucket
from tokenfair.server import load_sidecar_file
from tokenfair.server.pool import BudgetPool
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair_operator.render import PASSWORD_ENV, render_config
from tokenfair_operator.views import PolicyView, QuotaView

__all__ = ["redis_server"]  # the fixture, used by name

RATE = 30_000.0  # service tokens per second, the pool's
BURST = 15_000  # half a second of the rate: a lease chunk of 500 ms fits
REQUEST = 200 + 4 * 100  # service tokens of one request: prefill 200, decode 100
TENANT = TenantConfig("t", 1.0, BURST, RATE, "batch")
POLICY = PolicyConfig(max_batch_wait_ms=60_000)


class FakeClock:
    """Wall clock of the lease client and the core, in ms; moved by the test only."""

    def __init__(self) -> None:
        self.now_ms = 1_000_000.0

    def __call__(self) -> float:
        return self.now_ms


def store(url: str, **changes: Any) -> BudgetStoreConfig:
    defaults: dict[str, Any] = {"replicas": 4, "lease_ms": 500.0, "probe_interval_ms": 1000.0}
    return BudgetStoreConfig(url, **{**defaults, **changes})


class Replica:
    """One sidecar's scheduler and lease client, driven synchronously by the test."""

    _ids = itertools.count()

    def __init__(self, budget_store: BudgetStoreConfig, clock: FakeClock) -> None:
        config = build_config(POLICY, [TENANT], "v1", budget_store)
        self.clock = clock
        self.scheduler: Scheduler = make_scheduler("tokenfair", config, clock())
        self.pool = BudgetPool(budget_store, self.scheduler, wall_ms=clock)
        self.served = 0
        self.requests = 0

    @property
    def bucket(self) -> LeasedBucket:
        bucket = self.scheduler.tenants["t"].bucket
        assert isinstance(bucket, LeasedBucket)
        return bucket

    def spend(self, limit: int = 10_000, actual: int | None = None) -> int:
        """Dispatch requests of ``REQUEST`` tokens while the budget allows (at most ``limit``),
        each settled at ``actual`` (default: the estimate); the first one the budget cannot
        cover stays queued (a client with more to send). Returns the tokens dispatched."""
        now_ms = self.clock()
        spent = 0
        while spent < limit * REQUEST:
            decision = self.scheduler.next_dispatch(now_ms)
            if decision is None:
                if self.scheduler.queued_total:
                    break  # waiting for budget
                request = Request(f"r{next(self._ids)}", "t", now_ms, 200, 100, "batch")
                if self.scheduler.submit(request, now_ms) is not None:
                    break
                continue
            self.scheduler.complete(decision.request_id, now_ms, actual)
            spent += REQUEST
            self.requests += 1
        self.served += spent
        return spent

    def leave(self) -> None:
        """The waiting client goes away (nothing queued: the tenant may go idle)."""
        for request_id in list(self.scheduler.jobs):
            self.scheduler.cancel(request_id, self.clock())


async def store_level(url: str, key: str = "tokenfair:t") -> float | None:
    client = redis_asyncio.Redis.from_url(url, decode_responses=True)
    try:
        level = await client.hget(key, "level")
    finally:
        await client.aclose()
    return None if level is None else float(level)


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., list[Replica]]]:
    made: list[Replica] = []

    def make(n: int, clock: FakeClock, **changes: Any) -> list[Replica]:
        budget_store = store(redis_server.url, **changes)
        group = [Replica(budget_store, clock) for _ in range(n)]
        made.extend(group)
        return group

    yield make
    for replica in made:
        await replica.pool.client.aclose()


# -- the core's bucket ------------------------------------------------------------------------


def test_leased_bucket_spends_only_what_was_granted() -> None:
    shorts: list[int] = []
    bucket = LeasedBucket(BURST, RATE, 0.0, lambda: shorts.append(1))
    assert bucket.refill(10_000.0) == 0.0  # time alone adds nothing to a lease balance
    # 600 missing at the pool's 30 tokens/ms: 20 ms, and the shortfall is reported.
    assert bucket.ms_until(REQUEST, 0.0) == pytest.approx(20.0)
    assert bucket.shortfall_tokens == REQUEST
    assert shorts == [1]
    bucket.grant(3_000)
    assert bucket.shortfall_tokens == 0.0
    assert bucket.ms_until(REQUEST, 0.0) == 0.0
    assert bucket.surrender(1_000.5) == 1_999  # whole tokens above what is kept
    assert bucket.level == 1_001.0  # 3,000 - 1,999
    assert bucket.ms_until(20_000, 0.0) > 0
    assert bucket.shortfall_tokens == BURST  # never more than the bucket can hold


def test_leased_bucket_falls_back_to_a_refilled_split_and_rejoins_with_its_debt() -> None:
    bucket = LeasedBucket(BURST, RATE, 0.0)
    bucket.grant(1_000)
    bucket.fall_back(BURST // 4, RATE / 4, 0.0)
    assert (bucket.burst, bucket.sustained_per_second) == (3_750, 7_500.0)
    assert bucket.surrender(0.0) == 0  # nothing to return while fallen back
    bucket.grant(500)  # a late lease while fallen back is not counted twice
    assert bucket.level == 1_000.0
    bucket.level -= 1_400
    # 7.5 tokens/ms: 100 ms later the split refilled 750.
    assert bucket.refill(100.0) == pytest.approx(350.0)
    bucket.rejoin(BURST, RATE, 100.0)
    assert bucket.level == 0.0  # credit earned while fallen back is dropped
    bucket.level = -200.0
    bucket.fall_back(BURST // 4, RATE / 4, 100.0)
    bucket.rejoin(BURST, RATE, 100.0)
    assert bucket.level == -200.0  # a debt is kept


# -- the config section -----------------------------------------------------------------------

DOCUMENT = """
apiVersion: tokenfair.io/v1alpha1
kind: TokenfairConfig
budgetStore:
  redis: {url: "redis://store:6379/0", passwordEnv: REDIS_PASSWORD}
  keyPrefix: "tokenfair:ns:pool"
  replicas: 4
  leaseMs: 250
tenants:
  - {tenantId: a, weight: 1, burstServiceTokens: 100, sustainedServiceTokensPerSecond: 10}
"""


def test_budget_store_round_trips_through_documents_and_policy_manifests() -> None:
    config = loads_config(DOCUMENT)
    assert config.budget_store == BudgetStoreConfig(
        "redis://store:6379/0", "REDIS_PASSWORD", "tokenfair:ns:pool", 4, 250.0
    )
    assert loads_config(yaml.safe_dump(config_to_document(config))) == config
    manifests = """
apiVersion: tokenfair.io/v1alpha1
kind: SchedulingPolicy
metadata: {name: pool}
spec:
  budgetStore: {redis: {url: "rediss://store:6380"}}
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata: {name: a}
spec: {weight: 1, burstServiceTokens: 100, sustainedServiceTokensPerSecond: 10}
"""
    store_config = loads_config(manifests).budget_store
    assert store_config == BudgetStoreConfig("rediss://store:6380")
    assert store_config.lease_tokens(TENANT) == 7_500  # 0.5 s of 30,000/s, at most burst / 2
    assert store_config.lease_tokens(replace(TENANT, burst_service_tokens=20_000)) == 10_000
    assert store_config.lease_tokens(replace(TENANT, burst_service_tokens=40_000)) == 15_000
    assert store_config.lease_tokens(replace(TENANT, burst_service_tokens=1)) == 1
    without = DOCUMENT.split("budgetStore:")[0] + "tenants:" + DOCUMENT.split("tenants:")[1]
    assert "redis" not in without
    assert loads_config(without).budget_store is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "budgetStore: missing required field redis"),
        ({"redis": {"url": "http://x"}}, "budgetStore.redis.url: must be a redis:// or rediss://"),
        ({"redis": {"url": "redis://u:pw@x"}}, "budgetStore.redis.url: must not hold a password"),
        ({"redis": {"url": "redis://x", "port": 1}}, "budgetStore.redis: unknown field(s) port"),
        ({"redis": {"url": "redis://x", "passwordEnv": "1A"}}, "redis.passwordEnv: must be an"),
        ({"redis": {"url": "redis://x"}, "replicas": 0}, "budgetStore.replicas: must be in [1,"),
        ({"redis": {"url": "redis://x"}, "replicas": 1.5}, "replicas: must be an integer"),
        ({"redis": {"url": "redis://x"}, "leaseMs": 0}, "budgetStore.leaseMs: must be in [1,"),
        ({"redis": {"url": "redis://x"}, "timeoutMs": "1"}, "timeoutMs: must be a number"),
        ({"redis": {"url": "redis://x"}, "keyPrefix": "a b"}, "budgetStore.keyPrefix: must be"),
        ({"redis": {"url": "redis://x"}, "ttl": 1}, "budgetStore: unknown field(s) ttl"),
    ],
)
def test_bad_budget_store_fields_are_refused_by_name(section: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_budget_store(section)
    assert message in str(caught.value)


def test_a_second_budget_store_is_refused() -> None:
    twice = DOCUMENT + "---\napiVersion: tokenfair.io/v1alpha1\nkind: SchedulingPolicy\n"
    twice += "metadata: {name: p}\nspec: {budgetStore: {redis: {url: 'redis://y'}}}\n"
    with pytest.raises(ConfigError, match="the budgetStore is defined twice"):
        loads_config(twice)


# -- leasing on a real redis-server -----------------------------------------------------------


async def run_window(group: list[Replica], clock: FakeClock, window_ms: float, active: int) -> None:
    """``window_ms`` of virtual time in 10 ms steps: every replica's lease pass, then the first
    ``active`` replicas spend what their budgets allow. The replicas' passes run in a shuffled
    (seeded) order every step: the store serves whoever calls first, and real calls arrive in
    no fixed order."""
    order = random.Random(15)
    for _ in range(round(window_ms / 10)):
        clock.now_ms += 10
        for replica in order.sample(group, len(group)):
            await replica.pool.refresh()
        for replica in group[:active]:
            replica.spend()


async def test_one_sidecar_is_served_the_whole_pool_budget(
    replicas: Callable[..., list[Replica]],
) -> None:
    clock = FakeClock()
    group = replicas(4, clock)
    window_ms = 10_000.0
    await run_window(group, clock, window_ms, active=1)
    hot = group[0]
    pool_budget = RATE * window_ms / 1000.0
    # The split would serve 7,500/s + 1,500 of burst = 25 % of this; the pool serves it all.
    assert hot.served >= 0.95 * pool_budget
    assert hot.served <= BURST + pool_budget
    calls = sum(replica.pool.store_calls for replica in group)
    assert calls / hot.requests <= 0.1
    assert all(replica.pool.store_calls == 0 for replica in group[1:])  # idle: no calls


async def test_pool_overshoot_stays_within_the_lease_bound(
    replicas: Callable[..., list[Replica]],
) -> None:
    clock = FakeClock()
    group = replicas(4, clock, lease_ms=100.0)  # chunk 3,000
    window_ms = 5_000.0
    await run_window(group, clock, window_ms, active=4)
    served = sum(replica.served for replica in group)
    single_bucket = BURST + RATE * window_ms / 1000.0
    # replicas * (c + max(c, s)), s = a queued request and the one at admission.
    bound = 4 * (3_000 + max(3_000, 2 * REQUEST))
    assert served <= single_bucket + bound
    assert served >= 0.95 * RATE * window_ms / 1000.0
    # Every replica got a share: leases go to whoever asks.
    assert min(replica.served for replica in group) > 0.1 * served / 4


async def test_idle_balances_refunds_and_shutdown_reach_the_shared_bucket(
    replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    clock = FakeClock()  # moved only where the test says: the shared bucket refills 30/ms
    (replica,) = replicas(1, clock, lease_ms=100.0)  # chunk 3,000
    assert replica.spend() == 0  # a request waits for budget: the next pass leases a chunk
    await replica.pool.refresh()
    assert replica.bucket.level == 3_000
    assert await store_level(redis_server.url) == BURST - 3_000
    # Two requests estimated at 600 used 100 each: 1,000 refunded to the local balance.
    assert replica.spend(limit=2, actual=100) == 2 * REQUEST
    assert replica.bucket.level == 3_000 - 200
    # Idle for 2 leases (200 ms) after the last activity the pass saw: all returned (and the
    # shared bucket, refilled meanwhile, stays capped at the burst).
    clock.now_ms += 200.0
    await replica.pool.refresh()
    clock.now_ms += 201.0
    await replica.pool.refresh()
    assert replica.bucket.level == 0
    assert await store_level(redis_server.url) == BURST
    # A debt: estimated 600, used 3,600; the next lease pays it. (The clock stands still.)
    assert replica.spend() == 0
    await replica.pool.refresh()
    assert replica.spend(limit=1, actual=3_600) == REQUEST
    assert replica.bucket.level == 3_000 - 3_600
    await replica.pool.refresh()
    assert replica.bucket.level == 3_000  # granted 3,600: the debt, then a chunk
    assert await store_level(redis_server.url) == BURST - 3_000 - 3_600
    await replica.pool.close()
    assert await store_level(redis_server.url) == BURST - 3_600  # the balance came back
    assert replica.pool.status()["tenants"] == {
        "t": {
            "lease_balance_service_tokens": 0.0,
            "chunk_service_tokens": 3_000,
            "leased_service_tokens": 3_000 + 3_000 + 3_600,
            "returned_service_tokens": 2_800 + 3_000,
        }
    }


async def test_a_killed_store_falls_back_to_the_split_and_rejoins(
    replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    clock = FakeClock()
    group = replicas(4, clock)
    hot = group[0]
    await run_window(group, clock, 1_000.0, active=1)
    assert hot.pool.shared
    redis_server.kill()
    # Within the next lease: a chunk is 500 ms of the rate, asked for at half of it.
    await run_window(group, clock, 500.0, active=1)
    assert not hot.pool.shared
    assert hot.pool.fallbacks == 1
    assert (hot.bucket.burst, hot.bucket.sustained_per_second) == (BURST // 4, RATE / 4)
    status = hot.pool.status()
    assert status["mode"] == "fallback_split"
    assert "ConnectionError" in str(status["last_error"])
    # Fallen back: 2 s at the split's 7,500/s (+ what was left of the split's burst).
    before = hot.served
    await run_window(group, clock, 2_000.0, active=1)
    assert 7_500 * 2 <= hot.served - before <= 7_500 * 2 + BURST // 4 + REQUEST
    redis_server.start()  # empty: a restarted store starts every bucket full
    clock.now_ms += 1_000.0  # the probe interval
    calls = hot.pool.store_calls
    await run_window(group, clock, 2_000.0, active=1)
    assert hot.pool.shared
    assert hot.pool.store_calls > calls + 1  # a probe, then leases again
    assert hot.bucket.burst == BURST
    before = hot.served
    await run_window(group, clock, 2_000.0, active=1)
    assert hot.served - before >= 0.95 * RATE * 2


GARBAGE = {
    "a level of -1e300": {"level": "-1e300", "at_ms": "1000000"},
    "a level of -inf": {"level": "-inf", "at_ms": "1000000"},
    "a level of NaN": {"level": "nan", "at_ms": "1000000"},
    "a level that is no number": {"level": "lots", "at_ms": "1000000"},
    "no level at all": {"at_ms": "1000000"},
    "a time of 1e300": {"level": "100", "at_ms": "1e300"},
    "a time of NaN": {"level": "100", "at_ms": "nan"},
    "a string, not a hash": "not a bucket",
    "a list, not a hash": ["not", "a", "bucket"],
}


async def write_garbage(url: str, garbage: Any, key: str = "tokenfair:t") -> None:
    client = redis_asyncio.Redis.from_url(url, decode_responses=True)
    try:
        await client.delete(key)
        if isinstance(garbage, dict):
            await client.hset(key, mapping=garbage)
        elif isinstance(garbage, list):
            await client.rpush(key, *garbage)
        else:
            await client.set(key, garbage)
    finally:
        await client.aclose()


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
async def test_garbage_in_a_tenants_key_is_repaired_not_believed(
    replicas: Callable[..., list[Replica]], redis_server: RedisServer, garbage: Any
) -> None:
    """One garbage value locked a tenant out (a level of -1e300: for good, even after the key
    was deleted) or made the whole pool fall back (a key of the wrong type). Now the key is
    reset to an empty bucket at the first call: the tenant is served again within a chunk's
    refill (3,000 / 30 per ms = 100 ms, asked for at the next pass), the pool stays shared,
    and the repair is counted."""
    clock = FakeClock()
    (replica,) = replicas(1, clock, lease_ms=100.0)  # chunk 3,000
    await write_garbage(redis_server.url, garbage)
    await run_window([replica], clock, 200.0, active=1)
    assert replica.served > 0
    assert replica.pool.shared
    assert replica.pool.fallbacks == 0
    assert replica.pool.store_errors == 0
    assert replica.pool.repaired_keys == 1
    assert replica.pool.status()["repaired_keys"] == 1
    level = await store_level(redis_server.url)
    assert level is not None
    assert 0 <= level <= BURST
    # From then on the tenant is served its rate: 1 s at 30,000/s.
    before = replica.served
    await run_window([replica], clock, 1_000.0, active=1)
    assert replica.served - before >= 0.9 * RATE


async def test_a_tenant_recovers_once_the_garbage_is_gone(
    replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    """Whatever a store answered once (here a level far below zero, as a store of another
    version could), the sidecar asks again within a chunk's refill time: deleting the key
    lets the tenant lease at the next pass after that."""
    clock = FakeClock()
    (replica,) = replicas(1, clock, lease_ms=100.0)
    client = redis_asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        # A script that answers as the old one did for a level of -1e300.
        lying = "return {0, '-1e300'}"
        original = replica.pool._execute

        async def lied_to(calls: Any, now_ms: float) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for _ in calls:
                pipe.eval(lying, 0)
            replica.pool.store_calls += len(calls)
            return list(await pipe.execute())

        replica.pool._execute = lied_to  # type: ignore[method-assign]
        await run_window([replica], clock, 50.0, active=1)
        assert replica.served == 0
        replica.pool._execute = original  # type: ignore[method-assign]
        await client.delete("tokenfair:t")
    finally:
        await client.aclose()
    await run_window([replica], clock, 200.0, active=1)
    assert replica.served > 0
    assert replica.pool.fallbacks == 0


async def test_a_stopped_store_falls_back_within_its_timeout(
    replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    clock = FakeClock()
    # The healthy phase's calls must not hit the timeout on a busy machine (a 100 ms one did,
    # once in CI); the stopped store's call waits it out, whatever its length.
    (replica,) = replicas(1, clock, timeout_ms=1_000.0)
    await run_window([replica], clock, 100.0, active=1)
    assert replica.pool.shared
    redis_server.pause()
    try:
        clock.now_ms += 1_000.0  # the shared bucket is full again, the balance is spent
        replica.spend()
        await replica.pool.refresh()  # returns: the call is cut at timeoutMs
        assert not replica.pool.shared
        assert "TimeoutError" in replica.pool.last_error
        clock.now_ms += 100.0  # the split refills 7.5 tokens/ms: 750, one request
        assert replica.spend() == REQUEST
    finally:
        redis_server.resume()


# -- over HTTP ---------------------------------------------------------------------------------


async def test_sidecar_serves_through_a_store_outage_without_5xx(
    aiohttp_client: ClientFactory, redis_server: RedisServer
) -> None:
    budget_store = BudgetStoreConfig(
        redis_server.url, replicas=2, lease_ms=200.0, timeout_ms=200.0, probe_interval_ms=20.0,
        fairness_sync_ms=20.0,
    )  # fmt: skip
    config = keyed_config()
    config = replace(config, budget_store=budget_store)
    clients = await start(aiohttp_client, config)
    sidecar = clients.sidecar
    pool = sidecar.pool
    assert pool is not None
    fairness = sidecar.pool_fairness  # the pool-wide fair shares ride the same store
    assert fairness is not None
    headers = {"Authorization": "Bearer sk-local-chat-pro"}

    async def burst_of(n: int) -> list[int]:
        responses = await asyncio.gather(
            *(
                clients.proxy.post("/v1/completions", json=completion_body(20, 5), headers=headers)
                for _ in range(n)
            )
        )
        return [response.status for response in responses]

    assert set(await burst_of(10)) == {200}
    assert await wait_for(lambda: fairness.batches > 0)
    status = await (await clients.admin.get("/status")).json()
    assert status["budget_store"]["mode"] == "shared"
    assert status["budget_store"]["tenants"]["tenant_chat_pro"]["leased_service_tokens"] > 0
    assert status["budget_store"]["fairness"]["mode"] == "pool_wide"
    redis_server.kill()
    statuses = await burst_of(20)
    assert all(code in (200, 429) for code in statuses), statuses
    assert await wait_for(lambda: not pool.shared)
    # The fair shares notice at their next batch, which waits for service to send (the burst
    # may have been refused whole by the split): one now, as the task would send it.
    if fairness.shared:
        assert not await fairness.sync(fairness.monotonic_ms(), force=True)
    assert not fairness.shared
    metrics = await (await clients.admin.get("/metrics")).text()
    assert "tokenfair_budget_store_up 0.0" in metrics
    assert "tokenfair_pool_fairness_shared 0.0" in metrics
    status = await (await clients.admin.get("/status")).json()
    assert status["budget_store"]["mode"] == "fallback_split"
    assert status["budget_store"]["fairness"]["mode"] == "per_replica"
    assert status["tenants"]["tenant_chat_pro"]["burst_service_tokens"] == (
        config.tenant("tenant_chat_pro").burst_service_tokens // 2
    )
    assert set(await burst_of(10)) <= {200, 429}
    redis_server.start()
    assert await wait_for(lambda: pool.shared)
    assert set(await burst_of(10)) == {200}
    assert await wait_for(lambda: fairness.shared)
    assert await books_when_settled(sidecar) == ZERO_BOOKS


# -- a reload that adds, removes or moves the store ---------------------------------------------

POOL_QUOTA = QuotaView("a", "ns", "uid-a", 1, "2026-01-01T00:00:01Z", {
    "policyName": "pool", "weight": 1, "burstServiceTokens": 9_000,
    "sustainedServiceTokensPerSecond": 30_000})  # fmt: skip
PLAIN_POLICY = PolicyView("pool", "ns", "uid", 1, "2026-01-01T00:00:00Z", {})


def pooled_policy(url: str) -> PolicyView:
    return replace(PLAIN_POLICY, spec={"budgetStore": {"redis": {"url": url}}})


def write_rendered(path: Path, policy: PolicyView, replicas: int = 4) -> None:
    """The operator's document for ``policy`` (4 Ready sidecars), as a mounted file."""
    path.write_bytes(
        render_config(policy, [POOL_QUOTA], {}, ready_replicas=replicas).secret_payload
    )


async def start_from(aiohttp_client: ClientFactory, path: Path) -> Any:
    loaded = load_sidecar_file(path)
    settings = SidecarSettings(time_scale=1.0, reload_interval_s=0.02)
    return await start(
        aiohttp_client, loaded.config, settings, config_path=path, config_sha256=loaded.sha256
    )


async def test_a_reload_adding_the_store_keeps_the_split_until_a_restart(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    write_rendered(path, PLAIN_POLICY)
    clients = await start_from(aiohttp_client, path)
    sidecar = clients.sidecar
    assert sidecar.pool is None
    assert sidecar.scheduler.tenants["a"].bucket.burst == 2_250  # 9_000 / 4
    # The policy gains spec.budgetStore: the document's budgets are now the pool's (whole).
    write_rendered(path, pooled_policy("redis://127.0.0.1:1/0"))
    applied = sidecar.metrics.reloads.labels("applied")
    assert await wait_for(lambda: applied._value.get() == 1)
    assert sidecar.config.budget_store is not None
    assert sidecar.config.tenant("a").burst_service_tokens == 9_000
    bucket = sidecar.scheduler.tenants["a"].bucket
    assert sidecar.pool is None
    assert not isinstance(bucket, LeasedBucket)
    assert (bucket.burst, bucket.sustained_per_second) == (2_250, 7_500.0)  # not 9_000 each
    assert sidecar.scheduler.config.budget_store is None
    status = await (await clients.admin.get("/status")).json()
    assert "budgetStore added" in status["config"]["restart_needed"]
    assert "1/4" in status["config"]["restart_needed"]
    assert status["tenants"]["a"]["burst_service_tokens"] == 2_250
    # Three sidecars now: the store's replicas follow the document.
    write_rendered(path, pooled_policy("redis://127.0.0.1:1/0"), replicas=3)
    assert await wait_for(lambda: applied._value.get() == 2)
    assert sidecar.scheduler.tenants["a"].bucket.burst == 3_000
    # The store removed again: the document's split applies as it is, the notice goes.
    write_rendered(path, PLAIN_POLICY, replicas=2)
    assert await wait_for(lambda: applied._value.get() == 3)
    assert sidecar.scheduler.tenants["a"].bucket.burst == 4_500
    status = await (await clients.admin.get("/status")).json()
    assert "restart_needed" not in status["config"]


async def test_a_reload_removing_or_moving_the_store_keeps_the_running_pool(
    aiohttp_client: ClientFactory, tmp_path: Path, redis_server: RedisServer
) -> None:
    path = tmp_path / "config.yaml"
    write_rendered(path, pooled_policy(redis_server.url))
    clients = await start_from(aiohttp_client, path)
    sidecar = clients.sidecar
    pool = sidecar.pool
    assert pool is not None
    assert pool.store.key_prefix == "tokenfair:ns:pool"
    assert sidecar.scheduler.tenants["a"].bucket.burst == 9_000
    first_version = sidecar.config.version
    # The store removed: the document's budgets are 1/4 shares, wrong for the pool: refused.
    write_rendered(path, PLAIN_POLICY)
    invalid = sidecar.metrics.reloads.labels("invalid")
    assert await wait_for(lambda: invalid._value.get() == 1)
    assert sidecar.pool is pool
    assert sidecar.config.version == first_version
    bucket = sidecar.scheduler.tenants["a"].bucket
    assert isinstance(bucket, LeasedBucket)
    assert bucket.burst == 9_000
    status = await (await clients.admin.get("/status")).json()
    assert "budgetStore removed" in status["config"]["restart_needed"]
    assert status["budget_store"]["mode"] == "shared"
    # The store moved (another key prefix): applied, leasing on from the running store.
    moved = replace(pooled_policy(redis_server.url), name="other")
    write_rendered(path, moved, replicas=2)
    applied = sidecar.metrics.reloads.labels("applied")
    assert await wait_for(lambda: applied._value.get() == 1)
    assert sidecar.config.budget_store is not None
    assert sidecar.config.budget_store.key_prefix == "tokenfair:ns:other"
    assert pool.store.key_prefix == "tokenfair:ns:pool"
    assert pool.store.replicas == 2
    assert pool.leases["a"].key == "tokenfair:ns:pool:a"
    assert sidecar.scheduler.tenants["a"].bucket.burst == 9_000
    status = await (await clients.admin.get("/status")).json()
    assert "budgetStore changed" in status["config"]["restart_needed"]
    # The same store again: nothing pending.
    write_rendered(path, pooled_policy(redis_server.url), replicas=3)
    assert await wait_for(lambda: applied._value.get() == 2)
    assert pool.store.replicas == 3
    status = await (await clients.admin.get("/status")).json()
    assert "restart_needed" not in status["config"]
    # fairness turned off: the running fair shares stay pool-wide, and the status says so.
    fairness = sidecar.pool_fairness
    assert fairness is not None
    section = {"redis": {"url": redis_server.url}, "fairness": False}
    write_rendered(path, replace(PLAIN_POLICY, spec={"budgetStore": section}))
    assert await wait_for(lambda: applied._value.get() == 3)
    assert sidecar.config.budget_store is not None
    assert not sidecar.config.budget_store.fairness
    assert pool.store.fairness
    assert sidecar.pool_fairness is fairness
    assert fairness.service.sharing
    status = await (await clients.admin.get("/status")).json()
    assert "budgetStore.fairness changed to false" in status["config"]["restart_needed"]
    assert status["budget_store"]["fairness"]["mode"] == "pool_wide"


# -- the operator's rendering -----------------------------------------------------------------


def test_operator_renders_pool_budgets_whole_with_the_store_section() -> None:
    store_spec = {"redis": {"url": "redis://store:6379/0", "secretRef": {"name": "r"}}}
    pool = PolicyView("pool", "ns", "uid", 1, "2026-01-01T00:00:00Z", {"budgetStore": store_spec})
    spec = {"policyName": "pool", "weight": 1, "burstServiceTokens": 9_001,
            "sustainedServiceTokensPerSecond": 30_000}  # fmt: skip
    quota = QuotaView("a", "ns", "uid-a", 1, "2026-01-01T00:00:01Z", spec)
    rendering = render_config(pool, [quota], {}, ready_replicas=4)
    config = loads_config(rendering.secret_data["config.yaml"])
    assert config.tenant("a").burst_service_tokens == 9_001  # whole, not 9_001 // 4
    assert config.tenant("a").sustained_service_tokens_per_second == 30_000
    assert config.budget_store == BudgetStoreConfig(
        "redis://store:6379/0", PASSWORD_ENV, "tokenfair:ns:pool", replicas=4
    )
    split = render_config(replace(pool, spec={}), [quota], {}, ready_replicas=4)
    assert loads_config(split.secret_data["config.yaml"]).tenant("a").burst_service_tokens == 2_250
    bad = replace(pool, spec={"budgetStore": {"redis": {"url": "memcached://x"}}})
    refused = render_config(bad, [quota], {}, ready_replicas=4)
    assert refused.policy_error is not None
    assert "spec.budgetStore.redis.url: must be a redis:// or rediss:// URL" in refused.policy_error
