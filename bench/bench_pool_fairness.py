"""Pool-wide fair shares over four sidecars against per-sidecar fairness, in one run (issue 30;
docs/fairness.md §9, docs/pool.md).

Four ``tokenfair sidecar`` processes (cost-model backend, the default policy: 45,000 service
tokens per model second each, one request at a time, ``--time-scale 6``: see
:data:`TIME_SCALE`), one Debian ``redis-server``, real HTTP on loopback. Requests of 280 prompt +
90 decode tokens = 640 service tokens, from closed-loop clients (a 429 waits 20 ms before the
next try); budgets never bind, and the interactive wait limit is 60 s (requests queue instead of
being shed). Runs, each ``--window`` seconds after a 3 s warm-up, every figure from the
sidecars' ``/status`` at the window's start and end:

* ``skewed`` — ``pinned`` (weight 1) has 6 clients, all on sidecar 0; ``flood`` (weight 1) has 6
  clients on each sidecar. Per sidecar (no store) and pool-wide (``budgetStore`` with
  ``fairness``): the pinned tenant's service against its weighted max-min share constrained by
  where its requests land (``sim/pool_maxmin.py``; capacities: what each sidecar served in the
  window). Target >= 90 % pool-wide; per sidecar ~50 %.
* ``weights`` — ``heavy`` (weight 4) and ``light`` (weight 1), 64 clients each, ``round-robin``
  (every client sends each request to the next sidecar) and ``affinity`` (each client keeps one
  sidecar, by a CRC-32 of its name: 16 clients of each tenant per sidecar, as it happens).
  Target: heavy / light over the window within 10 % of 4; beside it the ratio's range over
  the window's 1 model s slices (``TIME_SCALE`` real s each), which shows the pool-wide order's
  swing (docs/fairness.md §9.3.2): over a window of a few model seconds the ratio is as much
  where the swing stood at the window's ends as the scheduler's weighting.
* store calls per request (fairness batches / requests served, over the pool runs; the budget
  leases besides): target <= 0.1.
* ``latency`` — tiny requests, a backend without delay, one connection each, alternating request
  by request between a sidecar with the store and fairness and one without a store: median
  added (target <= 0.1 ms), the median over rounds.
* ``fault`` — the skewed pool with redis-server killed (SIGKILL) a third into the window and
  restarted 5 s later: 5xx count (target 0), seconds from the kill to sidecar 0's ``/status``
  saying ``per_replica`` (target <= 1 s), from the restart to ``pool_wide`` again (target <= 5
  s), and the pinned tenant's share of sidecar 0 over the 5 s after it rejoined.
* ``many`` — 100 tenants of weight 1, 1, 2 or 4: the arrivals of ``tokenfair simulate
  --scenario pool-many`` (``sim/scenarios.py``, about 3.3 times the pool's capacity) sent open
  loop at their model times (each request at its time, whatever happened to the ones before;
  a refusal is not retried), each to the sidecar the simulator's ``affinity`` routing gives it
  (``sim/pool_replay.route``: each run of 16 requests of a tenant, a session, to one sidecar by
  a hash of the tenant and the run's number), the policy's own wait limit (so requests are
  refused and expire, as offline). Each sidecar writes its decision records; the pool-wide
  Jain index of each tenant's service over its weighted max-min share constrained by where its
  requests landed is ``tokenfair report``'s (``sim/pool_maxmin.pool_shares``, over the records
  that arrived in the window, each sidecar's window read from its own clock), and per 1 s
  model slice ``tokenfair simulate``'s (``commands/simulate_pool.sliced_jain``). Target >= 0.95
  pool-wide, beside the same arrivals replayed offline; and the throughput that fairness
  costs: the service tokens and requests served in the window per model second, pool-wide
  against per sidecar (target: pool-wide within :data:`THROUGHPUT_BOUND` of per sidecar), with
  each as a share of the engines' capacity (4 x 45,000 service tokens per model s). The
  verdicts judge every figure as computed (a Jain of 0.94996 is no pass), printed rounded.

    .venv/bin/python bench/bench_pool_fairness.py               # all runs: ~9 min
    .venv/bin/python bench/bench_pool_fairness.py --window 15   # shorter
    .venv/bin/python bench/bench_pool_fairness.py --runs many   # one run (or a comma list)
    .venv/bin/python bench/bench_pool_fairness.py --runs weights --weights-lease 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from bench_pool import TENANT_HEADER, TOKENFAIR, Cluster, Sidecar, cluster, free_port, status_of
from bench_pool import wait_port as wait_for_port

from tokenfair.commands.simulate_pool import ExpiryTally, pool_figures, sliced_jain
from tokenfair.core import Decision
from tokenfair.records.codec import read_decisions
from tokenfair.sim.fairness import decision_size, is_served
from tokenfair.sim.pool_maxmin import constrained_max_min, pool_shares
from tokenfair.sim.pool_replay import PoolReplay, replay_pool, route
from tokenfair.sim.report import SummaryTally
from tokenfair.sim.scenarios import pool_many
from tokenfair.sim.simulator import Arrival

REPLICAS: Final = 4
PROMPT_TOKENS, DECODE_TOKENS = 280, 90
REQUEST_TOKENS: Final = PROMPT_TOKENS + 4 * DECODE_TOKENS
CLIENTS: Final = 6
WEIGHT_CLIENTS: Final = 64
"""Clients per tenant of the ``weights`` runs (16 per sidecar on average): enough that both
tenants stay backlogged on every sidecar (with 6 the heavy tenant's queue emptied between its
clients' round trips and even per sidecar the ratio was 2.8:1)."""
TIME_SCALE: Final = 6.0
"""Real seconds per model second of the pool runs: at 1.0 (and still at 2.0 with 64 clients a
tenant) the four sidecars, the clients and redis on two cores run out of CPU before the engines
fill, so the sidecars' queues empty and their schedulers have no choice to make (even one
sidecar alone served 4:1 weights 2.6:1 so); at 6.0 each engine serves 7,500 service tokens per
real second. ``fairnessSyncMs`` is in model ms, like ``leaseMs``."""
FAULT_TIME_SCALE: Final = 1.0
"""The fault run's: the fallback and the rejoin are timed in real seconds, and a batch is due
every 500 model ms (or 20,000 service tokens)."""
WARMUP_S: Final = 3.0
BIG: Final = 10**9
JAIN_TARGET: Final = 0.95
THROUGHPUT_BOUND: Final = 0.05
"""The ``many`` verdict's bound on what pool-wide fairness may cost: the service tokens served
in the window per model second at least 95 % of the per-sidecar run's (the two runs offer the
same arrivals; a fairer order that idles engines or refuses what could run is no win)."""
ENGINE_TOKENS_PER_MS: Final = 45.0
"""Each cost-model engine's rate (the default policy's ``serviceTokensPerMs``)."""
RUNS: Final = ("skewed", "weights", "latency", "fault", "many")


def start_sidecar(
    running: Cluster, name: str, config: str, time_scale: float, records: Path | None = None
) -> Sidecar:
    """``Cluster.start_sidecar`` with ``--time-scale`` (and ``--records``, if given)."""
    path = running.tmp / f"{name}.yaml"
    path.write_text(config)
    proxy, admin = free_port(), free_port()
    log = (running.tmp / f"{name}.log").open("wb")
    process = subprocess.Popen(
        [str(TOKENFAIR), "sidecar", "--config", str(path),
         "--listen", f"127.0.0.1:{proxy}", "--admin-listen", f"127.0.0.1:{admin}",
         "--trusted-tenant-header", TENANT_HEADER, "--log-level", "WARNING",
         "--time-scale", str(time_scale),
         *(["--records", str(records)] if records is not None else [])],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    running.processes.append(process)
    wait_for_port(admin)
    return Sidecar(f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{admin}", process)


def config_yaml(
    store_url: str | None,
    weights: dict[str, float],
    *,
    fast_backend: bool = False,
    queue_not_shed: bool = True,
    lease_tokens: int | None = None,
) -> str:
    # Requests queue rather than being shed (a 429 storm of closed-loop clients burns the CPU
    # the engines need, and queues that empty leave no scheduler a choice to make); the open
    # loop of ``many`` does not retry, so it keeps the policy's own wait limit.
    policy: dict[str, Any] = {"maxInteractiveWaitMs": 60_000} if queue_not_shed else {}
    if fast_backend:  # the backend answers at once: latency is the sidecar's own
        policy.update(prefillFloorMs=0, prefillTokensPerMs=1e9, serviceTokensPerMs=1e9)
    doc: dict[str, Any] = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TokenfairConfig",
        "version": "bench-pool-fairness",
        "policy": policy,
        "tenants": [
            {"tenantId": name, "weight": weight, "burstServiceTokens": BIG,
             "sustainedServiceTokensPerSecond": BIG // 100, "priorityClass": "interactive"}
            for name, weight in weights.items()
        ],
    }  # fmt: skip
    if store_url is not None:
        doc["budgetStore"] = {
            "redis": {"url": store_url},
            "keyPrefix": f"bench-fair:{time.monotonic_ns()}",  # fresh counters per run
            "replicas": REPLICAS,
        }
        if lease_tokens is not None:  # else the product's default (20,000)
            doc["budgetStore"]["fairnessLeaseServiceTokens"] = lease_tokens
    return json.dumps(doc)


CLIENT_GAVE_UP = 0
"""The status counted for a request whose client session timed out before the answer."""


@dataclass
class Load:
    statuses: dict[int, int] = field(default_factory=dict)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def post_completion(
    session: aiohttp.ClientSession, target: str, body: dict[str, Any], tenant: str
) -> int:
    """POST ``body`` to ``target``'s ``/v1/completions`` as ``tenant``, read the answer whole:
    its status, 599 for a connection error (counted as a 5xx), :data:`CLIENT_GAVE_UP` when the
    session's timeout ran out first (a flood request queued that long: the client's limit, not
    the sidecar's error; it ended the run with a traceback before)."""
    try:
        async with session.post(
            f"{target}/v1/completions", json=body, headers={TENANT_HEADER: tenant}
        ) as response:
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return 599
    except TimeoutError:
        return CLIENT_GAVE_UP


async def drive(
    session: aiohttp.ClientSession,
    clients: list[tuple[str, Callable[[int], str]]],
    duration_s: float,
    load: Load,
) -> None:
    """One closed-loop worker per ``(tenant, target of its k-th request)``."""
    body = {"model": "m", "prompt": "x" * (4 * PROMPT_TOKENS), "max_tokens": DECODE_TOKENS}
    stop_at = time.monotonic() + duration_s

    async def worker(tenant: str, target: Callable[[int], str]) -> None:
        sent = 0
        while time.monotonic() < stop_at:
            status = await post_completion(session, target(sent), body, tenant)
            sent += 1
            load.count(status)
            if status == 429:
                await asyncio.sleep(0.02)

    await asyncio.gather(*(worker(tenant, target) for tenant, target in clients))


async def served_by(
    session: aiohttp.ClientSession, sidecars: list[Sidecar], tenants: list[str]
) -> list[dict[str, int]]:
    """Per sidecar, each tenant's served service tokens (cumulative)."""
    result = []
    for sidecar in sidecars:
        status = await status_of(session, sidecar)
        result.append({t: int(status["tenants"][t]["served_service_tokens"]) for t in tenants})
    return result


async def fairness_calls(session: aiohttp.ClientSession, sidecars: list[Sidecar]) -> int:
    total = 0
    for sidecar in sidecars:
        store = (await status_of(session, sidecar)).get("budget_store", {})
        total += int(store.get("fairness", {}).get("store_calls", 0))
    return total


@dataclass
class Run:
    name: str
    served: list[dict[str, int]]  # per sidecar, per tenant, over the window
    statuses: dict[int, int]
    calls: int
    where: dict[str, list[int]]  # the sidecars each tenant's clients reach
    weights: dict[str, float]
    slices: list[dict[str, int]] = field(default_factory=list)
    """Pool-wide service per tenant in each 1 model s slice of the window."""

    def total(self, tenant: str) -> int:
        return sum(s[tenant] for s in self.served)

    @property
    def requests(self) -> int:
        return sum(self.total(t) for t in self.weights) // REQUEST_TOKENS

    def slice_ratios(self, high: str, low: str) -> list[float]:
        """``high``'s service over ``low``'s in each slice with service of ``low``."""
        return [piece[high] / piece[low] for piece in self.slices if piece[low] > 0]

    def of_max_min(self, tenant: str) -> float:
        capacities = [float(sum(s.values())) for s in self.served]
        offered = {
            t: [1e15 if r in self.where[t] else 0.0 for r in range(REPLICAS)] for t in self.weights
        }
        shares = constrained_max_min(capacities, offered, self.weights)
        return self.total(tenant) / shares[tenant]


def spread(sidecars: list[Sidecar], start: int) -> Callable[[int], str]:
    return lambda k: sidecars[(start + k) % REPLICAS].proxy


def pinned_to(sidecar: Sidecar) -> Callable[[int], str]:
    return lambda k: sidecar.proxy


def affinity(sidecars: list[Sidecar], client: str) -> int:
    return zlib.crc32(client.encode()) % REPLICAS


async def pool_run(
    running: Cluster, name: str, weights: dict[str, float], routing: str, *,
    store: bool, window_s: float, lease_tokens: int | None = None,
) -> Run:  # fmt: skip
    config = config_yaml(running.redis_url if store else None, weights, lease_tokens=lease_tokens)
    sidecars = [start_sidecar(running, f"{name}-{i}", config, TIME_SCALE) for i in range(REPLICAS)]
    clients: list[tuple[str, Callable[[int], str]]] = []
    where: dict[str, list[int]] = {t: [] for t in weights}
    if routing == "skewed":
        clients += [("pinned", pinned_to(sidecars[0])) for _ in range(CLIENTS)]
        clients += [("flood", pinned_to(s)) for s in sidecars for _ in range(CLIENTS)]
        where = {"pinned": [0], "flood": list(range(REPLICAS))}
    else:
        for tenant in weights:
            for number in range(WEIGHT_CLIENTS):
                if routing == "round-robin":
                    clients.append((tenant, spread(sidecars, number)))
                    where[tenant] = list(range(REPLICAS))
                else:
                    replica = affinity(sidecars, f"{tenant}-{number}")
                    clients.append((tenant, pinned_to(sidecars[replica])))
                    where[tenant] = sorted({*where[tenant], replica})
    load = Load()
    tenants = list(weights)
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            task = asyncio.create_task(drive(session, clients, WARMUP_S + window_s, load))
            await asyncio.sleep(WARMUP_S)
            before = await served_by(session, sidecars, tenants)
            calls_0 = await fairness_calls(session, sidecars)
            slices = await served_per_slice(session, sidecars, tenants, before, window_s)
            # Read at the window's end, not once every client is done: the requests still queued
            # then (up to the wait limit) are served with nobody competing.
            after = await served_by(session, sidecars, tenants)
            calls_1 = await fairness_calls(session, sidecars)
            await task
    finally:
        running.stop_sidecars()
    served = [{t: a[t] - b[t] for t in tenants} for a, b in zip(after, before, strict=True)]
    return Run(name, served, load.statuses, calls_1 - calls_0, where, weights, slices)


async def served_per_slice(
    session: aiohttp.ClientSession, sidecars: list[Sidecar], tenants: list[str],
    start: list[dict[str, int]], window_s: float,
) -> list[dict[str, int]]:  # fmt: skip
    """The pool-wide service of each tenant per 1 model s slice (``TIME_SCALE`` real s) until
    ``window_s`` has passed since the call, from ``start`` (each sidecar's counters then); a
    last partial slice is left out. Each slice ends where the next begins (the reading's own
    time is in the next slice)."""
    pieces: list[dict[str, int]] = []
    ends_at = time.monotonic() + window_s
    previous = start
    while time.monotonic() + TIME_SCALE <= ends_at:
        await asyncio.sleep(TIME_SCALE)
        now = await served_by(session, sidecars, tenants)
        pieces.append({t: sum(a[t] - b[t] for a, b in zip(now, previous, strict=True))
                       for t in tenants})  # fmt: skip
        previous = now
    await asyncio.sleep(max(0.0, ends_at - time.monotonic()))
    return pieces


async def until_fairness_mode(
    session: aiohttp.ClientSession, sidecar: Sidecar, mode: str, since: float
) -> float | None:
    deadline = since + 15.0
    while time.monotonic() < deadline:
        status = await status_of(session, sidecar)
        if status["budget_store"]["fairness"]["mode"] == mode:
            return time.monotonic() - since
        await asyncio.sleep(0.01)
    return None


@dataclass
class Fault:
    statuses: dict[int, int]
    fallback_after_s: float | None
    rejoined_after_s: float | None
    pinned_share_after: float


async def fault_run(running: Cluster, window_s: float, outage_s: float) -> Fault:
    weights = {"pinned": 1.0, "flood": 1.0}
    config = config_yaml(running.redis_url, weights)
    sidecars = [
        start_sidecar(running, f"fault-{i}", config, FAULT_TIME_SCALE) for i in range(REPLICAS)
    ]
    clients = [("pinned", pinned_to(sidecars[0])) for _ in range(CLIENTS)]
    clients += [("flood", pinned_to(s)) for s in sidecars for _ in range(CLIENTS)]
    load = Load()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            task = asyncio.create_task(drive(session, clients, window_s, load))
            await asyncio.sleep(window_s / 3)
            running.kill_redis()
            killed = time.monotonic()
            fallback = await until_fairness_mode(session, sidecars[0], "per_replica", killed)
            await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - killed)))
            running.start_redis()
            restarted = time.monotonic()
            rejoined = await until_fairness_mode(session, sidecars[0], "pool_wide", restarted)
            first = (await served_by(session, sidecars[:1], list(weights)))[0]
            await asyncio.sleep(5.0)
            second = (await served_by(session, sidecars[:1], list(weights)))[0]
            await task
    finally:
        running.stop_sidecars()
    pinned = second["pinned"] - first["pinned"]
    total = pinned + second["flood"] - first["flood"]
    return Fault(load.statuses, fallback, rejoined, pinned / total if total else 0.0)


async def latency_pairs(running: Cluster, seconds: float) -> tuple[float, float, int]:
    """Median latency (s) off (no store) and on (store + fairness), alternating request by
    request, one connection each; and the store calls for fairness of the one on."""
    weights = {"pinned": 1.0, "flood": 1.0}
    sidecars: dict[bool, Sidecar] = {}
    for store in (False, True):
        url = running.redis_url if store else None
        config = config_yaml(url, weights, fast_backend=True)
        sidecars[store] = running.start_sidecar(f"latency-{'on' if store else 'off'}", config)
    body = {"model": "m", "prompt": "xxxx", "max_tokens": 1}
    latencies: dict[bool, list[float]] = {False: [], True: []}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            warm_until = time.monotonic() + 0.5
            stop_at = warm_until + seconds
            turn = 0
            while time.monotonic() < stop_at:
                tenant = ("pinned", "flood")[turn % 2]
                turn += 1
                for store, sidecar in sidecars.items():
                    started = time.perf_counter()
                    async with session.post(
                        f"{sidecar.proxy}/v1/completions", json=body,
                        headers={TENANT_HEADER: tenant},
                    ) as response:  # fmt: skip
                        await response.read()
                        if response.status != 200:
                            raise SystemExit(f"bench: latency run got {response.status}")
                    if time.monotonic() >= warm_until:
                        latencies[store].append(time.perf_counter() - started)
            calls = await fairness_calls(session, [sidecars[True]])
    finally:
        running.stop_sidecars()
    return statistics.median(latencies[False]), statistics.median(latencies[True]), calls


def many_arrivals(horizon_ms: float) -> tuple[dict[str, float], list[Arrival], list[int]]:
    """``pool-many``'s weights, its arrivals before ``horizon_ms`` (model ms) and the sidecar of
    each by the simulator's ``affinity`` routing: the same requests, routed alike, as
    ``tokenfair simulate --scenario pool-many --replicas 4 --routing affinity`` replays."""
    config, requests = pool_many()
    weights = {tenant.tenant_id: tenant.weight for tenant in config.tenants}
    kept = sorted(
        (r for r in requests if r.arrival_ms < horizon_ms),
        key=lambda r: (r.arrival_ms, r.request_id),
    )
    arrivals: list[Arrival] = [(request, None, None) for request in kept]
    return weights, arrivals, route(arrivals, REPLICAS, "affinity")


async def send_open_loop(
    session: aiohttp.ClientSession,
    sidecars: list[Sidecar],
    arrivals: list[Arrival],
    places: list[int],
    load: Load,
) -> float:
    """Each arrival posted to its sidecar at its model time (``TIME_SCALE`` real seconds per
    model second from now), whatever became of the earlier ones; returns once every answer is
    in, with the largest lateness of a send (s: the client's own lag)."""
    started = time.monotonic()
    late_s = 0.0

    async def one(request_tokens: tuple[int, int], tenant: str, target: str) -> None:
        prompt, decode = request_tokens
        body = {"model": "m", "prompt": "x" * (4 * prompt), "max_tokens": decode}
        load.count(await post_completion(session, target, body, tenant))

    tasks = []
    for (request, _, _), replica in zip(arrivals, places, strict=True):
        due = started + request.arrival_ms * TIME_SCALE / 1000.0
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        late_s = max(late_s, time.monotonic() - due)
        tokens = (request.prefill_tokens, request.decode_tokens)
        tasks.append(asyncio.create_task(one(tokens, request.tenant_id, sidecars[replica].proxy)))
    await asyncio.gather(*tasks)
    return late_s


async def clocks_ms(session: aiohttp.ClientSession, sidecars: list[Sidecar]) -> list[float]:
    """Each sidecar's model clock now (its records' time: model ms since it started)."""
    return [float((await status_of(session, sidecar))["clock_ms"]) for sidecar in sidecars]


def in_window(
    per_sidecar: Sequence[Sequence[Decision]], windows: Sequence[tuple[float, float]]
) -> list[list[Decision]]:
    """Each sidecar's decisions of the requests that arrived in its own window (its clock's
    reading at the window's start and end: the sidecars started apart, so their clocks
    differ by seconds)."""
    return [
        [d for d in decisions if start <= d.arrival_ms <= end]
        for decisions, (start, end) in zip(per_sidecar, windows, strict=True)
    ]


def sliced_of_records(
    per_sidecar: Sequence[Sequence[Decision]], starts_ms: Sequence[float]
) -> PoolReplay:
    """The records as ``tokenfair simulate``'s pool outcome, each sidecar's times from its own
    window start: offered by arrival, served (answered) by dispatch, per 1 s model slice."""
    outcome = PoolReplay(len(per_sidecar))
    for replica, (decisions, start) in enumerate(zip(per_sidecar, starts_ms, strict=True)):
        for decision in decisions:
            size = decision_size(decision, None)
            outcome.add_offered(replica, decision.tenant_id, size, decision.arrival_ms - start)
            if is_served(decision) and decision.dispatch_ms is not None:
                end = decision.dispatch_ms - start
                outcome.add_served(replica, decision.tenant_id, size, end)
    return outcome


@dataclass
class Many:
    name: str
    shares: dict[str, Any]  # pool_shares' result
    sliced_jain: float | None
    statuses: dict[int, int]
    calls: int
    requests: int
    late_s: float
    clock_spread_ms: float  # how far apart the sidecars' record clocks are (model ms)
    served_requests: int  # of the requests that arrived in the window, those answered
    window_ms: float  # the window's length, model ms (the mean over the sidecars' clocks)

    @property
    def served_tokens(self) -> float:
        """Service tokens served of the requests that arrived in the window."""
        return sum(float(row["served_service_tokens"]) for row in self.shares["tenants"].values())

    def tokens_per_s(self) -> float:
        """:attr:`served_tokens` per model second of the window."""
        return self.served_tokens * 1000.0 / self.window_ms

    def requests_per_s(self) -> float:
        return self.served_requests * 1000.0 / self.window_ms

    @property
    def jain(self) -> float:
        """Unrounded (``pool_shares(..., rounded=False)``): the verdict judges this one."""
        return float(self.shares["jain_of_max_min"])

    def ratios(self) -> dict[str, tuple[float, float]]:
        """Tenant -> (weight, served / constrained max-min share), tenants with a share."""
        return {
            tenant: (row["weight"], row["of_max_min"])
            for tenant, row in self.shares["tenants"].items()
            if row["of_max_min"] is not None
        }


async def many_run(running: Cluster, name: str, *, store: bool, window_s: float) -> Many:
    horizon_ms = (WARMUP_S + window_s) * 1000.0 / TIME_SCALE
    weights, arrivals, places = many_arrivals(horizon_ms)
    config = config_yaml(running.redis_url if store else None, weights, queue_not_shed=False)
    paths = [running.tmp / f"{name}-{i}.jsonl" for i in range(REPLICAS)]
    sidecars = [
        start_sidecar(running, f"{name}-{i}", config, TIME_SCALE, records=paths[i])
        for i in range(REPLICAS)
    ]
    load = Load()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            task = asyncio.create_task(send_open_loop(session, sidecars, arrivals, places, load))
            await asyncio.sleep(WARMUP_S)
            starts = await clocks_ms(session, sidecars)
            calls_0 = await fairness_calls(session, sidecars)
            await asyncio.sleep(window_s)
            ends = await clocks_ms(session, sidecars)
            calls_1 = await fairness_calls(session, sidecars)
            late_s = await task
    finally:
        running.stop_sidecars()  # SIGTERM: each sidecar flushes and closes its records
    recorded = [[d for ds in read_decisions(path).values() for d in ds] for path in paths]
    windowed = in_window(recorded, list(zip(starts, ends, strict=True)))
    shares = pool_shares(windowed, weights, rounded=False)  # judged unrounded
    by_slice = sliced_jain(sliced_of_records(windowed, starts), weights)
    requests = sum(len(decisions) for decisions in windowed)
    served = sum(1 for decisions in windowed for d in decisions if is_served(d))
    spread_ms = max(starts) - min(starts)
    window_ms = statistics.mean(end - start for start, end in zip(starts, ends, strict=True))
    return Many(name, shares, by_slice, load.statuses, calls_1 - calls_0, requests, late_s,
                spread_ms, served, window_ms)  # fmt: skip


def offline_many(window_s: float) -> dict[str, float | None]:
    """``tokenfair simulate``'s Jain (whole trace) for the same arrivals, per replica and
    ``+pool``: the figure the live one is to be read beside."""
    horizon_ms = (WARMUP_S + window_s) * 1000.0 / TIME_SCALE
    config, _ = pool_many()
    _, arrivals, _ = many_arrivals(horizon_ms)
    result: dict[str, float | None] = {}
    for shared in (False, True):
        outcome = PoolReplay(REPLICAS)
        summary, expiries = SummaryTally(), ExpiryTally()
        for decision, _ in replay_pool(
            config, arrivals, "tokenfair", REPLICAS, "affinity", pool=shared, outcome=outcome
        ):
            summary.add(decision)
            expiries.add(decision)
        figures = pool_figures(config, outcome, summary.summary(), expiries)
        result["pool" if shared else "local"] = figures["jain_of_max_min"]
    return result


def by_weight(ratios: dict[str, tuple[float, float]]) -> str:
    """Mean served / share per weight class: ``w1 0.93 (n 48), ...``."""
    classes: dict[float, list[float]] = {}
    for weight, ratio in ratios.values():
        classes.setdefault(weight, []).append(ratio)
    return ", ".join(
        f"w{weight:g} {statistics.mean(values):.2f} (n {len(values)})"
        for weight, values in sorted(classes.items())
    )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def fmt_jain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


async def main_async(
    window_s: float, many_window_s: float, latency_rounds: int, latency_s: float,
    runs: Sequence[str], lease_tokens: int | None = None,
) -> int:  # fmt: skip
    skew = {"pinned": 1.0, "flood": 1.0}
    weights = {"heavy": 4.0, "light": 1.0}
    skew_runs: list[Run] = []
    weighted: dict[tuple[str, bool], Run] = {}
    fault: Fault | None = None
    offs: list[float] = []
    ons: list[float] = []
    latency_calls = 0
    many: list[Many] = []
    offline = offline_many(many_window_s) if "many" in runs else {}
    with cluster() as running:
        running.start_redis()
        if "skewed" in runs:
            for store in (False, True):
                skew_runs.append(await pool_run(
                    running, "skew-pool" if store else "skew-local", skew, "skewed",
                    store=store, window_s=window_s,
                ))  # fmt: skip
        if "weights" in runs:
            for routing in ("round-robin", "affinity"):
                for store in (False, True):
                    weighted[routing, store] = await pool_run(
                        running, f"w-{routing}-{store}", weights, routing, store=store,
                        window_s=window_s, lease_tokens=lease_tokens,
                    )  # fmt: skip
        if "fault" in runs:
            fault = await fault_run(running, max(window_s, 21.0), 5.0)
        if "latency" in runs:
            for _ in range(latency_rounds):
                off, on, calls = await latency_pairs(running, latency_s)
                offs.append(off)
                ons.append(on)
                latency_calls += calls
        if "many" in runs:
            for store in (False, True):
                many.append(await many_run(
                    running, "many-pool" if store else "many-local", store=store,
                    window_s=many_window_s,
                ))  # fmt: skip

    print(f"bench_pool_fairness: {REPLICAS} sidecars (cost-model backend), requests of "
          f"{REQUEST_TOKENS} service tokens, {CLIENTS} closed-loop clients per tenant and "
          f"target, window {window_s:.0f} s (many: {many_window_s:.0f} s) (+{WARMUP_S:.0f} s "
          f"warm-up); runs {','.join(runs)}; weights' fairness lease "
          f"{lease_tokens or 'default'}")  # fmt: skip
    if skew_runs:
        print_skewed(*skew_runs)
    if weighted:
        print_weights(weighted)
    pool_runs = [*skew_runs[1:], *(run for (_, store), run in weighted.items() if store)]
    if pool_runs:
        calls = sum(run.calls for run in pool_runs)
        requests = sum(run.requests for run in pool_runs)
        per_request = calls / max(1, requests)
        print(f"  store calls for fairness {calls} / {requests} requests served = "
              f"{per_request:.4f} per request   target <= 0.1: "
              f"{verdict(per_request <= 0.1)}")  # fmt: skip
    if offs:
        print_latency(offs, ons, latency_rounds, latency_s, latency_calls)
    if fault is not None:
        print_fault(fault)
    if many:
        print_many(many, offline)
    return 0


def print_skewed(skew_local: Run, skew_pool: Run) -> None:
    local, pool = skew_local.of_max_min("pinned"), skew_pool.of_max_min("pinned")
    print(
        "  skewed: pinned on sidecar 0, flood on all four; pinned's service / its constrained "
        "max-min share"
    )
    for run, ratio in ((skew_local, local), (skew_pool, pool)):
        print(f"    {run.name:<11} {ratio:6.1%}   pinned {run.total('pinned'):>9} flood "
              f"{run.total('flood'):>9} tokens; per sidecar {run.served}   "
              f"statuses {run.statuses}")  # fmt: skip
    print(f"    target pool >= 90 %: {verdict(pool >= 0.9)}   (per sidecar {local:.1%}, "
          f"pool / per sidecar = {pool / max(local, 1e-9):.2f}x)")  # fmt: skip


def print_weights(weighted: dict[tuple[str, bool], Run]) -> None:
    print("  weights heavy:light = 4:1")  # (the lease: the run's header line)
    for (routing, store), run in weighted.items():
        ratio = run.total("heavy") / max(1, run.total("light"))
        ok = abs(ratio / 4.0 - 1.0) <= 0.10
        pieces = run.slice_ratios("heavy", "light")
        swing = f"{min(pieces):.2f}-{max(pieces):.2f}" if pieces else "-"
        print(f"    {routing:<12} {'pool' if store else 'per sidecar':<12} {ratio:5.2f}:1   "
              f"per 1 model s slice {swing} ({len(pieces)} slices)   served "
              f"{run.total('heavy') + run.total('light')} tokens   "
              f"{'' if not store else 'within 10 %: ' + verdict(ok)}")  # fmt: skip


def print_latency(
    offs: list[float], ons: list[float], rounds: int, seconds: float, calls: int
) -> None:
    added_ms = (statistics.median(ons) - statistics.median(offs)) * 1000.0
    print(f"  latency p50 (tiny requests, {rounds} rounds of {seconds:.0f} s): no store "
          f"{statistics.median(offs) * 1e3:.3f} ms, store + fairness "
          f"{statistics.median(ons) * 1e3:.3f} ms, added {added_ms:+.3f} ms   target <= 0.1 ms: "
          f"{verdict(added_ms <= 0.1)}   (fairness store calls {calls})")  # fmt: skip


def print_fault(fault: Fault) -> None:
    fives = sum(n for status, n in fault.statuses.items() if status >= 500)
    fell_back = fault.fallback_after_s is not None and fault.fallback_after_s <= 1.0
    back = fault.rejoined_after_s is not None and fault.rejoined_after_s <= 5.0
    print(f"  fault: redis killed for 5 s: 5xx {fives}, per_replica after "
          f"{fmt_s(fault.fallback_after_s)}, pool_wide {fmt_s(fault.rejoined_after_s)} after "
          f"the restart; pinned's share of sidecar 0 over the next 5 s "
          f"{fault.pinned_share_after:.1%}   zero 5xx, fallback <= 1 s, back <= 5 s: "
          f"{verdict(fives == 0 and fell_back and back)}")  # fmt: skip
    print(f"    statuses {fault.statuses}")


def print_many(runs: list[Many], offline: dict[str, float | None]) -> None:
    print(
        "  many: 100 tenants (pool-many's arrivals, open loop, affinity routing); Jain of "
        "service / constrained max-min share (tokenfair report), per 1 s slice"
    )
    for run in runs:
        ratios = run.ratios()
        worst = min(ratios, key=lambda t: ratios[t][1])
        weight, ratio = ratios[worst]
        sliced = fmt_jain(run.sliced_jain)
        print(f"    {run.name:<10} Jain {run.jain:.3f} (per slice {sliced})   worst "
              f"{worst} (weight {weight:g}) {ratio:.1%}; mean by weight {by_weight(ratios)}   "
              f"{run.requests} requests in the window, fairness store calls {run.calls}, "
              f"statuses {run.statuses}, sends up to {run.late_s * 1e3:.0f} ms late, record "
              f"clocks {run.clock_spread_ms:.0f} model ms apart")  # fmt: skip
    capacity = REPLICAS * ENGINE_TOKENS_PER_MS * 1000.0  # service tokens per model s
    for run in runs:
        print(f"    {run.name:<10} served {run.tokens_per_s():,.0f} service tokens per model s "
              f"({run.tokens_per_s() / capacity:.1%} of the engines' {capacity:,.0f}), "
              f"{run.requests_per_s():.1f} requests per model s ({run.served_requests} in "
              f"{run.window_ms / 1000:.2f} model s)")  # fmt: skip
    pool = runs[-1]
    fair = pool.jain >= JAIN_TARGET
    print(f"    Jain pool {pool.jain:.4f} >= {JAIN_TARGET}: {verdict(fair)}   (per sidecar "
          f"{runs[0].jain:.4f}; offline, the same arrivals, whole trace: per replica "
          f"{offline.get('local')}, +pool {offline.get('pool')})")  # fmt: skip
    if len(runs) > 1:
        local = runs[0]
        tokens = pool.tokens_per_s() / max(local.tokens_per_s(), 1e-9)
        requests = pool.requests_per_s() / max(local.requests_per_s(), 1e-9)
        kept = tokens >= 1.0 - THROUGHPUT_BOUND
        cost = "within the bound" if kept else "fairness cost throughput past the bound"
        jain = "met" if fair else "missed"
        print(f"    served pool / per sidecar: service tokens {tokens:.3f}, requests "
              f"{requests:.3f}   within {THROUGHPUT_BOUND:.0%}: {verdict(kept)}   many: "
              f"{verdict(fair and kept)} (Jain {jain}, served {cost})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=30.0, help="seconds per run (30)")
    parser.add_argument(
        "--many-window",
        type=float,
        default=60.0,
        help="seconds of the many runs' window (60: 10 model s; offline, pool-many's first "
        "5 model s score 0.93 pool-wide, its first 10 and its 20 0.96)",
    )
    parser.add_argument(
        "--weights-lease",
        type=int,
        default=None,
        help="fairnessLeaseServiceTokens of the weights runs (default: the product's, 20,000; "
        "smaller damps the pool order's swing, docs/fairness.md §9.3.2)",
    )
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=4.0)
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"the runs, a comma list of {', '.join(RUNS)} (all)",
    )
    args = parser.parse_args(argv)
    if args.window <= 0 or args.many_window <= 0:
        parser.error("--window, --many-window: must be positive")
    runs = [name for name in args.runs.split(",") if name]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown or not runs:
        parser.error(f"--runs: expected a comma list of {', '.join(RUNS)} (got {args.runs!r})")
    return asyncio.run(
        main_async(
            args.window,
            args.many_window,
            args.latency_rounds,
            args.latency_seconds,
            runs,
            args.weights_lease,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
