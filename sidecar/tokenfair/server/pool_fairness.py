"""Pool-wide fair shares on the budget store: each sidecar's service counters, shared in batches.

The scheduling core keeps, per lane and tenant, the weighted service the pool gave
(:class:`~tokenfair.core.pool_order.PoolService`, installed by
``TokenfairScheduler.share_pool_service``); its DRR serves the tenant with the least. This
module is the sidecar's side of it: one asyncio task that sends the counters' batches to Redis
and reads the others' back. No request waits for it.

**The store.** One hash per lane, ``<keyPrefix>:fair:interactive`` and ``<keyPrefix>:fair:batch``,
field = tenant id, value = the tenant's pool-wide service in whole service tokens (cumulative,
an integer). A batch is **one** call of :data:`FAIRNESS_SCRIPT` (Lua, atomic): each named
tenant's tokens added, then every named tenant's total answered in order (the tenants with
service to send, and those backlogged here: the ones whose order the answer decides). Both keys
expire 7 days after their last batch (a pool idle that long starts again from zero, as an
emptied store does). Garbage is repaired, never believed: a key that is not a hash is deleted; a
field that is no integer, negative or beyond 2^53 is set to the highest valid total of its hash
(the tenant yields until the others catch up, rather than being served as if it had had
nothing — a negative total would have it served before every other tenant of every replica),
and counted (``repaired_fields``). A total is never written below 0 (a refund sent after the
store restarted empty stops at 0), and a negative total answered is refused (the batch fails).

**When.** Every :data:`PASS_INTERVAL_S` the task asks the core whether a batch is due
(``PoolService.due``: ``fairnessLeaseServiceTokens`` given since the last batch, or
``fairnessSyncMs`` passed with service to send or two tenants of a lane to order). One batch is
in flight at a time; what the DRR gives meanwhile waits for the next. Store calls per request
are about ``request cost / fairnessLeaseServiceTokens`` under load (plus one per
``fairnessSyncMs`` per sidecar with work, at most).

**Store down or slow.** A batch that fails or outlasts ``timeoutMs`` switches the core to each
sidecar's own round robin at once (``PoolService.set_sharing(False)``: docs/fairness.md §2-3, as
without a store) — within ``fairnessSyncMs + timeoutMs`` of the store going quiet, while there
is work (``fairnessSyncMs`` in model ms, ``timeoutMs`` real: ``s * fairnessSyncMs + timeoutMs``
real ms at time scale ``s``). Its service counts as delivered here and is not sent again. The
store is tried again (``PING``) every ``probeIntervalMs``; when it answers the next batch is
sent at once (with the service given meanwhile) and the order is pool-wide again. A store
restarted empty restarts every total from zero: each sidecar's view follows at its next batch.
Batches are sent at shutdown (best effort, within ``timeoutMs``), so a sidecar that stops leaves
no service unsent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.config.budget_store import BudgetStoreConfig
from tokenfair.core.pool_order import PoolService
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.core.units import whole_tokens
from tokenfair.server.clock import EventClock, ModelClock

log = logging.getLogger("tokenfair.sidecar")

PASS_INTERVAL_S: Final = 0.01
"""How often the task asks whether a batch is due (real seconds)."""
KEY_TTL_MS: Final = 7 * 24 * 3600 * 1000
LANE_KEYS: Final = ("interactive", "batch")

FAIRNESS_SCRIPT: Final = """
local out = {}
local repaired = 0
local at = 1
for lane = 1, #KEYS do
  local key = KEYS[lane]
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'hash' and kind ~= 'none' then
    redis.call('DEL', key)
    repaired = repaired + 1
  end
  local n = tonumber(ARGV[at])
  at = at + 1
  local values = {}
  local highest = nil
  for i = 1, n do
    local field = ARGV[at]
    local delta = tonumber(ARGV[at + 1])
    at = at + 2
    local stored = redis.call('HGET', key, field)
    local value = 0
    if stored then
      value = tonumber(stored)
      if value == nil or value ~= value or value ~= math.floor(value)
          or value > 9007199254740992 or value < 0 then
        if highest == nil then
          highest = 0
          local all = redis.call('HVALS', key)
          for j = 1, #all do
            local v = tonumber(all[j])
            if v and v == v and v == math.floor(v) and v <= 9007199254740992
                and v > highest then
              highest = v
            end
          end
        end
        value = highest
        repaired = repaired + 1
        stored = nil
      end
    end
    value = value + delta
    if value < 0 then
      value = 0
    end
    if delta ~= 0 or stored == nil then
      redis.call('HSET', key, field, string.format('%.0f', value))
    end
    values[i] = value
  end
  if n > 0 then
    redis.call('PEXPIRE', key, ARGV[#ARGV])
  end
  out[lane] = values
end
out[#KEYS + 1] = repaired
return out
"""
"""KEYS: the lanes' hashes. ARGV: per lane ``n``, then ``n`` pairs ``tenant, tokens to add``;
last, the keys' lifetime in ms. Answers ``{totals of lane 1, totals of lane 2, repaired}``."""


class PoolFairness:
    """The counters' task of one sidecar. All methods run on the event loop's thread.

    ``client`` is a ``redis.asyncio.Redis`` (the budget pool's); ``clock`` (an
    :class:`~tokenfair.server.clock.EventClock`: the sidecar's, by default a
    :class:`~tokenfair.server.clock.ModelClock` of the running loop) times the passes and is
    the default of both clocks: ``monotonic_ms``, the clock of ``fairnessSyncMs`` (default
    ``clock.now_ms``: model milliseconds, like ``leaseMs`` and the scheduler's time), and
    ``real_ms``, the clock of ``probeIntervalMs`` (default ``clock.monotonic_s() * 1000``: real
    milliseconds; ``monotonic_ms`` when only that one is injected, as the unit tests do). Every
    reading goes through the one clock, never :func:`time.monotonic`: on a virtual loop the
    batches and probes follow virtual time (review rev1207f F5)."""

    def __init__(
        self,
        store: BudgetStoreConfig,
        scheduler: TokenfairScheduler,
        client: Any,
        *,
        monotonic_ms: Callable[[], float] | None = None,
        real_ms: Callable[[], float] | None = None,
        clock: EventClock | None = None,
    ) -> None:
        self.store = store
        self.client = client
        self._clock: EventClock = clock or ModelClock()
        """The passes' timer, and the default of both clocks."""
        self.monotonic_ms = monotonic_ms or self._clock.now_ms
        self.real_ms = real_ms or monotonic_ms or self._real_clock_ms
        self.service = PoolService()
        scheduler.share_pool_service(self.service)
        self.keys = [f"{store.key_prefix}:fair:{lane}" for lane in LANE_KEYS]
        self.shared = True
        self.fallbacks = 0
        self.store_calls = 0
        """Commands sent to the store: one per batch, one per probe."""
        self.store_errors = 0
        self.repaired_fields = 0
        self.batches = 0
        self.last_error = ""
        self.changed_at_ms = self.monotonic_ms()
        self.next_probe_ms = 0.0
        self.forgotten: set[str] = set()
        """Tenants a reload removed (:meth:`forget`)."""

    def adopt(self, store: BudgetStoreConfig) -> None:
        """A reload's settings (the sync interval, the lease, the timeouts); the keys stay."""
        self.store = store

    def forget(self, removed: set[str], present: set[str]) -> None:
        """A reload removed the tenants ``removed`` (and has ``present``): their counters and
        their fields in the store are dropped once nothing of theirs is left here to order or
        to send (:meth:`_drop_forgotten`, at each batch). The ids stay remembered (one string
        each) until a reload adds them again, so a late settlement is cleaned too."""
        self.forgotten |= removed
        self.forgotten -= present

    async def run(self) -> None:
        """Pass after pass until cancelled; a pass that fails unexpectedly is logged."""
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("pool fairness: a pass failed")
            await self._clock.sleep(PASS_INTERVAL_S)

    def _real_clock_ms(self) -> float:
        return self._clock.monotonic_s() * 1000.0

    async def refresh(self) -> None:
        """One pass: probe the store if fallen back (and due), then send a batch if due."""
        now_ms = self.monotonic_ms()
        if not self.shared:
            real_ms = self.real_ms()
            if real_ms < self.next_probe_ms:
                return
            self.next_probe_ms = real_ms + self.store.probe_interval_ms
            try:
                self.store_calls += 1
                await self._bounded(self.client.ping())
            except Exception as exc:
                self._failed(exc)
                return
            self._rejoin(now_ms)
            await self.sync(now_ms, force=True)
            return
        await self.sync(now_ms)

    async def sync(self, now_ms: float, *, force: bool = False) -> bool:
        """Send a batch if one is due (or ``force``); whether the store answered it."""
        service = self.service
        store = self.store
        backlogged = service.backlogged()
        if not force and not service.due(
            now_ms, store.fairness_sync_ms, store.fairness_lease_tokens, backlogged
        ):
            return False
        batch = service.take_batch(backlogged, now_ms)
        arguments: list[object] = []
        for entries in batch:
            arguments.append(len(entries))
            for tenant_id, tokens in entries:
                arguments.extend((tenant_id, tokens))
        arguments.append(KEY_TTL_MS)
        try:
            self.store_calls += 1
            reply = await self._bounded(
                self.client.eval(FAIRNESS_SCRIPT, len(self.keys), *self.keys, *arguments)
            )
            totals = _totals(reply, batch)
        except Exception as exc:
            service.lost(batch)
            self._fall_back(now_ms, exc)
            return False
        service.absorb(batch, totals)
        self.batches += 1
        if self.forgotten:
            await self._drop_forgotten()
        repaired = int(reply[-1])
        if repaired:
            self.repaired_fields += repaired
            log.warning("pool fairness: %d field(s) or key(s) of %s held garbage: repaired",
                        repaired, ", ".join(self.keys))  # fmt: skip
        return True

    async def _drop_forgotten(self) -> None:
        """Drop the counters of removed tenants with nothing here left to order or send (not
        backlogged, no whole token unsent, none in flight), and HDEL their fields (one call per lane
        with some; a failure is counted and tried again at the next batch)."""
        for key, lane in zip(self.keys, self.service.lanes, strict=True):
            backlogged = set(lane.backlog())
            idle = [
                tenant_id
                for tenant_id in self.forgotten
                if tenant_id not in backlogged
                and whole_tokens(lane.unsynced.get(tenant_id, 0)) == 0
                and tenant_id not in lane.pushing_units
                and (tenant_id in lane.pool_units or tenant_id in lane.active_epoch)
            ]
            if not idle:
                continue
            try:
                self.store_calls += 1
                await self._bounded(self.client.hdel(key, *idle))
            except Exception as exc:
                self._failed(exc)
                continue
            for tenant_id in idle:
                lane.unsynced_units -= abs(lane.unsynced.pop(tenant_id, 0))  # below a token
                lane.pool_units.pop(tenant_id, None)
                lane.offsets.pop(tenant_id, None)
                lane.active_epoch.pop(tenant_id, None)
                lane.gain.pop(tenant_id, None)
                lane.gain_own.pop(tenant_id, None)
                lane.gain_pool.pop(tenant_id, None)
                lane.rekey(tenant_id)  # backlogged again during the call: its rank moves

    async def _bounded(self, call: Any) -> Any:
        async with asyncio.timeout(self.store.timeout_ms / 1000.0):
            return await call

    def _failed(self, exc: BaseException) -> None:
        self.store_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__

    def _fall_back(self, now_ms: float, exc: BaseException) -> None:
        """The store failed: each sidecar's own round robin, at once."""
        self._failed(exc)
        if not self.shared:
            return
        self.shared = False
        self.service.set_sharing(False)
        self.fallbacks += 1
        self.changed_at_ms = now_ms
        self.next_probe_ms = self.real_ms() + self.store.probe_interval_ms
        log.warning("pool fairness: the store is unreachable (%s): each sidecar is fair on its "
                    "own traffic until it is back", self.last_error)  # fmt: skip

    def _rejoin(self, now_ms: float) -> None:
        self.shared = True
        self.service.set_sharing(True)
        self.changed_at_ms = now_ms
        log.warning("pool fairness: the store is back: fair shares are pool-wide again")

    async def close(self) -> None:
        """Send what is left (best effort, within ``timeoutMs``); the client is the budget
        pool's, closed by it."""
        if self.shared:
            await self.sync(self.monotonic_ms(), force=True)

    def status(self) -> dict[str, object]:
        """The ``fairness`` part of ``/status``' ``budget_store``."""
        return {
            "shared": self.shared,
            "mode": "pool_wide" if self.shared else "per_replica",
            "since_ms": round(self.changed_at_ms, 1),
            "fallbacks": self.fallbacks,
            "batches": self.batches,
            "store_calls": self.store_calls,
            "store_errors": self.store_errors,
            "repaired_fields": self.repaired_fields,
            "last_error": self.last_error,
            "sync_ms": self.store.fairness_sync_ms,
            "lease_service_tokens": self.store.fairness_lease_tokens,
        }

    def collector(self) -> Collector:
        return _FairnessCollector(self)


def _totals(reply: Any, batch: tuple[list[tuple[str, int]], ...]) -> tuple[list[int], ...]:
    """The script's answer, believed only in shape: one integer per named tenant, per lane,
    none negative (a negative total would put its tenant before every other one)."""
    if not isinstance(reply, list) or len(reply) != len(batch) + 1:
        raise ValueError(f"fairness answer out of shape: {str(reply)[:100]}")
    totals: list[list[int]] = []
    for values, entries in zip(reply, batch, strict=False):
        if not isinstance(values, list) or len(values) != len(entries):
            raise ValueError(f"fairness answer out of shape: {str(reply)[:100]}")
        lane = [int(value) for value in values]
        if any(value < 0 for value in lane):
            raise ValueError(f"fairness answer holds a negative total: {str(reply)[:100]}")
        totals.append(lane)
    return tuple(totals)


class _FairnessCollector(Collector):
    """``tokenfair_pool_fairness_*``, read at each scrape."""

    def __init__(self, fairness: PoolFairness) -> None:
        self.fairness = fairness

    def collect(self) -> Iterator[Metric]:
        fairness = self.fairness
        yield GaugeMetricFamily(
            "tokenfair_pool_fairness_shared",
            "1: tenants ordered by pool-wide service; 0: per replica (the store is down)",
            value=1.0 if fairness.shared else 0.0,
        )
        for name, text, value in (
            ("batches", "batches of service counters the store answered", fairness.batches),
            ("store_calls", "commands sent to the store for fairness", fairness.store_calls),
            ("store_errors", "fairness store calls that failed", fairness.store_errors),
            ("fallbacks", "times fairness fell back to per replica", fairness.fallbacks),
            ("repaired_fields", "fairness fields found holding garbage", fairness.repaired_fields),
        ):
            yield CounterMetricFamily(f"tokenfair_pool_fairness_{name}", text, value=value)
