"""Pool-wide budgets: one shared bucket per tenant in Redis, leased to the sidecars in chunks.

The scheduling core never waits for Redis. Each tenant's bucket in the core is a
:class:`~tokenfair.core.bucket.LeasedBucket` whose level is a local **lease balance**;
:class:`BudgetPool` (one asyncio task per sidecar) keeps it topped up and returns what is not
needed, in one pipelined round trip per pass for every tenant that needs a call. This module
is the pool's port to the core's buckets: the one place in the server that holds a tenant's
bucket itself (to grant and surrender leases); everything else reads a budget through the
core's read-only view (:meth:`Scheduler.budget <tokenfair.core.scheduler.Scheduler.budget>`).

**The shared bucket** (hash ``<keyPrefix>:<tenantId>``: ``level``, ``at_ms``) is refilled and
leased by one Lua script, atomically (:data:`LEASE_SCRIPT`): ``level = min(burst, level +
(now - at) * sustained)``, then ``+ give`` (capped at ``burst``), then a grant of
``min(take, floor(level))`` if ``level >= min_take``, else nothing. ``now`` is the caller's
wall clock in model milliseconds (a clock behind ``at_ms`` refills nothing), so every sidecar
refills the same bucket on one time line, and tests inject a clock. A missing key is a full
bucket; keys expire once they would be full anyway (``burst / sustained`` + 60 s, the key's
*lifetime*).

**Garbage in the store is repaired per key, never believed.** A legal bucket is a hash whose
``level`` is a number in ``[0, burst]`` and whose ``at_ms`` is a number at most a lifetime
ahead of ``now``. The script resets, to an *empty* bucket refilling from ``now`` (so the
tenant is served again one chunk's refill later, ``c / sustained``), a key that is not a hash
(deleted first), a ``level`` that is no number, NaN or negative (a level of -1e300 was a
lock-out that outlived the key: the old answer put the next ask ~1e300 ms away), and an
``at_ms`` that is no number, NaN or further ahead than a lifetime (1e300 stopped every
refill); a ``level`` above the burst is capped as before. Each repair is counted
(``tokenfair_budget_store_repaired_keys_total``, ``/status``' ``repaired_keys``) and logged
with the key. On the sidecar's side an answer is believed only in range (a grant within what
was asked, a finite level, taken as within ``[0, burst]``), and a call that fails or answers
out of range costs its tenant one ``probeIntervalMs`` without leases; the pool falls back only
when the connection fails or every call of a pass fails (the store, not a key).

**Per tenant, per pass** (chunk ``c = ceil(sustained * leaseMs / 1000)``, at most half the
burst):

* *active* — the tenant queued or spent anything within the last ``2 * leaseMs``, or the core
  asked for more than the balance (``shortfall``, at most ``burst``): the target balance is
  ``T = min(burst, max(c, shortfall))``; below ``max(c / 2, shortfall)`` the pool asks for
  ``take = max(c, T - level)`` with ``min_take = c`` (every grant is at least a chunk, so about
  ``request cost / c`` store calls are made per request); above ``T + c`` the excess
  (settlement refunds) is returned;
* *idle* — the whole balance is returned;
* every answer carries the store's level: the tenant is not asked for again until the store
  could hold a chunk, ``(c - level) / sustained`` later (so a saturated pool costs one call per
  chunk, not a refused one and a granted one).

**Overshoot bound.** Leased tokens leave the shared bucket at once, and it refills while they
sit unspent, so over any window of ``W`` ms the pool can serve at most ``burst + sustained * W
+ sum of the balances held at the window's start``. A grant lands only on a balance below
``max(c / 2, shortfall)`` and brings it to ``max(level + c, T)``, and refunds are returned
once the balance passes ``T + c``, so a sidecar's balance stays at most ``c + max(c, s)``,
``s`` the most the core asked for at once (a request's cost, or its tenant's backlog at
admission; at most ``burst``). Hence: **pool overshoot <= replicas * (c + max(c, s))** — with
short queues ``s`` is a request or two, so about two chunks per sidecar — and never more than
``replicas * (c + burst)``. (A debt from settlement — actual above the estimate — is paid from
the next lease; a restarted, empty Redis starts every bucket full.)

**Store down or slow.** A call that fails or takes longer than ``timeoutMs`` switches every
tenant to the local split at once (:func:`~tokenfair.config.budget_store.split_budgets`,
``1/replicas``; the metric ``tokenfair_budget_store_up`` goes 0 and ``/status`` says why): no
request ever fails or waits because of Redis. The store is tried again every
``probeIntervalMs``; when it answers, the sidecars rejoin (credit earned while fallen back is
dropped, debts kept) and lease again. Leases are returned at shutdown (best effort, within
``timeoutMs``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.config import Config, TenantConfig
from tokenfair.config.budget_store import BudgetStoreConfig, split_budgets
from tokenfair.core import Scheduler
from tokenfair.core.bucket import LeasedBucket
from tokenfair.server.exposition import counter_chunks, label_value, number

log = logging.getLogger("tokenfair.sidecar")

LEASE_SCRIPT: Final = """
local now = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local give = tonumber(ARGV[4])
local take = tonumber(ARGV[5])
local min_take = tonumber(ARGV[6])
local ttl_ms = math.min(math.ceil(burst / rate), 86400000) + 60000
local repaired = 0
local level, at
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  level = burst
  at = now
elseif kind ~= 'hash' then
  redis.call('DEL', KEYS[1])
  level = 0
  at = now
  repaired = 1
else
  local state = redis.call('HMGET', KEYS[1], 'level', 'at_ms')
  level = tonumber(state[1])
  at = tonumber(state[2])
  if level == nil or level ~= level or level < 0 then
    level = 0
    repaired = 1
  end
  if at == nil or at ~= at or at > now + ttl_ms then
    at = now
    repaired = 1
  end
end
if now > at then
  level = level + (now - at) * rate
  at = now
end
level = math.min(burst, level + give)
local granted = 0
if take > 0 and level >= min_take then
  granted = math.min(take, math.floor(level))
  level = level - granted
end
redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level),
           'at_ms', string.format('%.17g', at))
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return {granted, string.format('%.17g', level), repaired}
"""
"""KEYS: the tenant's bucket. ARGV: now_ms, burst, sustained per ms, give, take, min_take.
Returns ``{granted, level after, repaired}`` (the level as a string: Redis truncates Lua
floats; ``repaired`` 1 when the key held garbage, see :data:`LEASE_SCRIPT`'s rules in the
module docstring)."""

PASS_INTERVAL_S: Final = 0.02
"""Real seconds between passes when nothing wakes the task sooner (a shortfall does)."""
IDLE_LEASES: Final = 2.0
"""A tenant that neither queued nor spent for this many ``leaseMs`` returns its balance."""


@dataclass(slots=True)
class TenantLease:
    """The lease client's view of one tenant."""

    tenant_id: str
    key: str
    chunk_tokens: int
    last_served_tokens: int
    active_until_ms: float = -math.inf
    retry_at_ms: float = -math.inf
    leased_tokens: int = 0
    """Service tokens granted by the store since start (a counter)."""
    returned_tokens: int = 0
    label: str = ""
    """``tenant="<id>"``, escaped for the metrics text (made once)."""

    def __post_init__(self) -> None:
        self.label = f'tenant="{label_value(self.tenant_id)}"'


@dataclass(slots=True)
class _Call:
    lease: TenantLease
    bucket: LeasedBucket
    config: TenantConfig
    give: int
    take: int
    min_take: int


class BudgetPool:
    """The lease client of one sidecar. All methods run on the event loop's thread.

    ``wall_ms`` is the store's clock (model milliseconds, shared by the pool's sidecars) and
    times every decision here; ``on_tokens`` is called when a grant or a fallback may let a
    queued request start (the dispatcher's ``pump``). ``client`` is a ``redis.asyncio.Redis``
    (default: one from ``store.url``)."""

    def __init__(
        self,
        store: BudgetStoreConfig,
        scheduler: Scheduler,
        *,
        wall_ms: Callable[[], float] | None = None,
        on_tokens: Callable[[], object] = lambda: None,
        client: Any = None,
    ) -> None:
        self.store = store
        self.scheduler = scheduler
        self.wall_ms = wall_ms or (lambda: time.time() * 1000.0)
        self.on_tokens = on_tokens
        self.client = client if client is not None else connect(store)
        self.leases: dict[str, TenantLease] = {}
        self.shared = True
        self.fallbacks = 0
        """Times the pool fell back to the local split (a counter)."""
        self.store_calls = 0
        """Commands sent to the store (a counter): one per tenant per pass that needs one."""
        self.store_errors = 0
        self.repaired_keys = 0
        """Tenant keys the lease script found holding garbage and reset (a counter)."""
        self.last_error = ""
        self.changed_at_ms = self.wall_ms()
        self.next_probe_ms = -math.inf
        self._wake = asyncio.Event()
        self.adopt(scheduler.config)

    # -- configuration -------------------------------------------------------------------

    def adopt(self, config: Config) -> None:
        """Give every tenant of ``config`` a :class:`LeasedBucket` (new tenants) and the
        current limits (pool's when shared, split when fallen back). Call after every
        ``scheduler.reconfigure``."""
        if config.budget_store is not None:
            self.store = config.budget_store
        now_ms = self.wall_ms()
        for tenant in config.tenants:
            state = self.scheduler.tenants[tenant.tenant_id]
            bucket = state.bucket
            if not isinstance(bucket, LeasedBucket):
                bucket = LeasedBucket(
                    tenant.burst_service_tokens,
                    tenant.sustained_service_tokens_per_second,
                    now_ms,
                    self._wake.set,
                )
                state.bucket = bucket
                if not self.shared:
                    self._split(bucket, tenant, now_ms)
            elif not self.shared:
                self._split(bucket, tenant, now_ms)
            lease = self.leases.get(tenant.tenant_id)
            chunk = self.store.lease_tokens(tenant)
            if lease is None:
                self.leases[tenant.tenant_id] = TenantLease(
                    tenant.tenant_id,
                    f"{self.store.key_prefix}:{tenant.tenant_id}",
                    chunk,
                    state.served_tokens,
                )
            else:
                lease.chunk_tokens = chunk

    def _split(self, bucket: LeasedBucket, tenant: TenantConfig, now_ms: float) -> None:
        share = split_budgets(tenant, self.store.replicas)
        bucket.fall_back(
            share.burst_service_tokens, share.sustained_service_tokens_per_second, now_ms
        )

    # -- the lease loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Pass after pass until cancelled; a pass that fails unexpectedly is logged."""
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("budget store: a lease pass failed")
            try:
                async with asyncio.timeout(PASS_INTERVAL_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def refresh(self) -> None:
        """One pass: probe the store if fallen back (and due), else lease and return."""
        now_ms = self.wall_ms()
        if not self.shared:
            if now_ms < self.next_probe_ms:
                return
            self.next_probe_ms = now_ms + self.store.probe_interval_ms
            try:
                await self._bounded(self._ping())
            except Exception as exc:
                self._failed(exc)
                return
            self._rejoin(now_ms)
        calls = self._plan(now_ms)
        if not calls:
            return
        try:
            replies = await self._bounded(self._execute(calls, now_ms))
        except Exception as exc:
            self._fall_back(now_ms, exc)
            return
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if failed and len(failed) == len(replies):
            # Every call failed: the store, not a key (out of memory, read-only, no script).
            self._fall_back(now_ms, failed[0])
            return
        granted_any = False
        for call, reply in zip(calls, replies, strict=True):
            granted_any |= self._settle_call(call, reply, now_ms)
        if granted_any:
            self.on_tokens()

    def _settle_call(self, call: _Call, reply: Any, now_ms: float) -> bool:
        """Apply one tenant's answer; True if it granted tokens. A failed call, or an answer
        out of range (a store of another version, a script changed under us), costs that
        tenant one ``probeIntervalMs`` without leases, never the pool its sharing: the tokens
        it gave back count as returned (a lost return errs on the budget's side)."""
        lease = call.lease
        try:
            if isinstance(reply, Exception):
                raise reply
            granted = int(reply[0])
            store_level = float(reply[1])
            repaired = len(reply) > 2 and int(reply[2]) == 1
            if not (0 <= granted <= call.take and math.isfinite(store_level)):
                raise ValueError(f"lease answer out of range: {reply[:2]!r}")
        except Exception as exc:
            self._failed(exc)
            lease.retry_at_ms = now_ms + self.store.probe_interval_ms
            log.warning("budget store: tenant %s: lease call failed (%s); retrying in %g ms",
                        lease.tenant_id, self.last_error, self.store.probe_interval_ms)  # fmt: skip
            return False
        if repaired:
            self.repaired_keys += 1
            log.warning("budget store: key %s held garbage (not a bucket, or a level or time "
                        "out of range): reset to an empty bucket refilling from now",
                        lease.key)  # fmt: skip
        lease.leased_tokens += granted
        if granted:
            call.bucket.grant(granted)
        if call.take:
            # Ask next once the store could hold a chunk (a call before would be refused);
            # the store's level is at most the burst and at least 0, so this is at most a
            # chunk's refill time away.
            rate_per_ms = call.config.sustained_service_tokens_per_second / 1000.0
            missing = lease.chunk_tokens - min(
                max(store_level, 0.0), call.config.burst_service_tokens
            )
            lease.retry_at_ms = now_ms + max(0.0, missing) / rate_per_ms
        return granted > 0

    def _plan(self, now_ms: float) -> list[_Call]:
        calls: list[_Call] = []
        idle_ms = IDLE_LEASES * self.store.lease_ms
        tenants = self.scheduler.tenants
        index = self.scheduler.config.tenant_index
        for tenant_id, lease in self.leases.items():
            state = tenants.get(tenant_id)
            config = index.get(tenant_id)
            if state is None or config is None or not isinstance(state.bucket, LeasedBucket):
                continue
            bucket = state.bucket
            if state.queued == 0:
                bucket.shortfall_tokens = 0.0  # an ask for a request refused, or long gone
            if state.served_tokens != lease.last_served_tokens or state.queued:
                lease.last_served_tokens = state.served_tokens
                lease.active_until_ms = now_ms + idle_ms
            chunk = lease.chunk_tokens
            shortfall = bucket.shortfall_tokens
            give = take = min_take = 0
            if now_ms < lease.active_until_ms or shortfall > 0:
                target = min(float(bucket.burst), max(float(chunk), shortfall))
                if bucket.level < max(chunk / 2.0, shortfall) and now_ms >= lease.retry_at_ms:
                    # At least a chunk per call: store calls per request stay ~cost / chunk.
                    take = max(chunk, math.ceil(target - bucket.level))
                    min_take = chunk
                elif bucket.level > target + chunk:
                    give = bucket.surrender(target)
            else:
                give = bucket.surrender(0.0)
            if give or take:
                lease.returned_tokens += give
                calls.append(_Call(lease, bucket, config, give, take, min_take))
        return calls

    async def _execute(self, calls: list[_Call], now_ms: float) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            config = call.config
            pipe.eval(
                LEASE_SCRIPT,
                1,
                call.lease.key,
                repr(now_ms),
                config.burst_service_tokens,
                repr(config.sustained_service_tokens_per_second / 1000.0),
                call.give,
                call.take,
                call.min_take,
            )
        self.store_calls += len(calls)
        # A failed command comes back as its exception, in its place: one tenant's failure is
        # that tenant's (a lost connection still raises, for the whole pass).
        return list(await pipe.execute(raise_on_error=False))

    async def _ping(self) -> None:
        self.store_calls += 1
        await self.client.ping()

    async def _bounded(self, call: Any) -> Any:
        async with asyncio.timeout(self.store.timeout_ms / 1000.0):
            return await call

    # -- fallback ------------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        self.store_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__

    def _fall_back(self, now_ms: float, exc: BaseException) -> None:
        """The store failed: every tenant to the local split, at once. Tokens given back in
        the failed call count as returned (a lost return errs on the budget's side)."""
        self._failed(exc)
        self.shared = False
        self.fallbacks += 1
        self.changed_at_ms = now_ms
        self.next_probe_ms = now_ms + self.store.probe_interval_ms
        log.warning("budget store unreachable (%s): each sidecar enforces 1/%d of every budget "
                    "until it is back", self.last_error, self.store.replicas)  # fmt: skip
        index = self.scheduler.config.tenant_index
        for tenant_id, state in self.scheduler.tenants.items():
            config = index.get(tenant_id)
            if config is not None and isinstance(state.bucket, LeasedBucket):
                self._split(state.bucket, config, now_ms)
        self.on_tokens()

    def _rejoin(self, now_ms: float) -> None:
        self.shared = True
        self.changed_at_ms = now_ms
        log.warning("budget store is back: budgets are pool-wide again")
        index = self.scheduler.config.tenant_index
        for tenant_id, state in self.scheduler.tenants.items():
            config = index.get(tenant_id)
            if config is not None and isinstance(state.bucket, LeasedBucket):
                state.bucket.rejoin(
                    config.burst_service_tokens,
                    config.sustained_service_tokens_per_second,
                    now_ms,
                )
        for lease in self.leases.values():
            lease.retry_at_ms = -math.inf

    # -- shutdown and reporting ----------------------------------------------------------

    async def close(self) -> None:
        """Return every balance to the store (best effort, within ``timeoutMs``), then close
        the connection."""
        try:
            if self.shared:
                calls = []
                index = self.scheduler.config.tenant_index
                for tenant_id, lease in self.leases.items():
                    state = self.scheduler.tenants.get(tenant_id)
                    config = index.get(tenant_id)
                    if state is None or config is None:
                        continue
                    if isinstance(state.bucket, LeasedBucket):
                        give = state.bucket.surrender(0.0)
                        if give:
                            lease.returned_tokens += give
                            calls.append(_Call(lease, state.bucket, config, give, 0, 0))
                if calls:
                    await self._bounded(self._execute(calls, self.wall_ms()))
        except Exception as exc:
            self._failed(exc)
            log.warning("budget store: leases not returned at shutdown (%s)", self.last_error)
        finally:
            await self.client.aclose()

    def status(self) -> dict[str, object]:
        """The ``budget_store`` section of ``/status`` (the admin handler streams it:
        :meth:`status_head`, then :meth:`tenant_statuses`)."""
        return {**self.status_head(), "tenants": dict(self.tenant_statuses())}

    def status_head(self) -> dict[str, object]:
        """The ``budget_store`` section of ``/status`` but its ``tenants``."""
        return {
            "kind": "redis",
            "shared": self.shared,
            "mode": "shared" if self.shared else "fallback_split",
            "replicas": self.store.replicas,
            "since_ms": round(self.changed_at_ms, 1),
            "fallbacks": self.fallbacks,
            "store_calls": self.store_calls,
            "store_errors": self.store_errors,
            "repaired_keys": self.repaired_keys,
            "last_error": self.last_error,
        }

    def tenant_statuses(self) -> Iterator[tuple[str, object]]:
        """Each tenant's lease, read lazily (over a copy of the tenants: a reload during a
        scrape shows in the next one)."""
        for tenant_id, lease in list(self.leases.items()):
            yield (
                tenant_id,
                {
                    "lease_balance_service_tokens": round(self._level(tenant_id), 3),
                    "chunk_service_tokens": lease.chunk_tokens,
                    "leased_service_tokens": lease.leased_tokens,
                    "returned_service_tokens": lease.returned_tokens,
                },
            )

    def _level(self, tenant_id: str) -> float:
        state = self.scheduler.tenants.get(tenant_id)
        return state.bucket.level if state is not None else 0.0

    def collector(self) -> Collector:
        return _PoolCollector(self)

    def tenant_families(self) -> Iterator[str]:
        """``tokenfair_budget_store_leased_service_tokens_total`` and
        ``..._returned_service_tokens_total`` per tenant, in chunks
        (``Metrics.add_tenant_families``)."""
        leases = list(self.leases.values())
        for name, documentation, lines in _LEASE_FAMILIES:
            yield from counter_chunks(name, documentation, leases, lines)


class _PoolCollector(Collector):
    """``tokenfair_budget_store_up`` (1 shared, 0 fallen back to the split),
    ``tokenfair_budget_store_fallbacks_total``, ``tokenfair_budget_store_calls_total`` and
    ``tokenfair_budget_store_errors_total``, ``tokenfair_budget_store_repaired_keys_total``;
    the per-tenant families are
    :meth:`BudgetPool.tenant_families`'."""

    def __init__(self, pool: BudgetPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        yield GaugeMetricFamily(
            "tokenfair_budget_store_up",
            "1 while budgets are pool-wide through the store, 0 while fallen back to 1/replicas.",
            1.0 if pool.shared else 0.0,
        )
        yield CounterMetricFamily(
            "tokenfair_budget_store_fallbacks", "Falls back to the split.", pool.fallbacks
        )
        yield CounterMetricFamily(
            "tokenfair_budget_store_calls", "Commands sent to the store.", pool.store_calls
        )
        yield CounterMetricFamily(
            "tokenfair_budget_store_errors", "Store calls failed.", pool.store_errors
        )
        yield CounterMetricFamily(
            "tokenfair_budget_store_repaired_keys",
            "Tenant keys found holding garbage and reset to an empty bucket.",
            pool.repaired_keys,
        )


_LEASE_FAMILIES: Final = (
    (
        "tokenfair_budget_store_leased_service_tokens",
        "Service tokens leased from the pool's buckets.",
        lambda lease: (
            f"tokenfair_budget_store_leased_service_tokens_total{{{lease.label}}} "
            f"{number(lease.leased_tokens)}\n"
        ),
    ),
    (
        "tokenfair_budget_store_returned_service_tokens",
        "Service tokens returned to the pool's buckets.",
        lambda lease: (
            f"tokenfair_budget_store_returned_service_tokens_total{{{lease.label}}} "
            f"{number(lease.returned_tokens)}\n"
        ),
    ),
)


def connect(store: BudgetStoreConfig) -> Any:
    """A ``redis.asyncio`` client for ``store``: no retries (a failure falls back at once),
    socket timeouts of ``timeoutMs``, the password from ``passwordEnv`` if set."""
    try:
        import redis.asyncio as redis_asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
    except ImportError as exc:  # pragma: no cover - redis is a dependency
        raise RuntimeError("budgetStore needs the redis package (pip install redis)") from exc
    timeout_s = store.timeout_ms / 1000.0
    password = os.environ.get(store.password_env) if store.password_env else None
    return redis_asyncio.Redis.from_url(
        store.url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
