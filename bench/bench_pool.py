"""Pool-wide budgets through Redis against the 1/n split, in one run (issue 15; docs/pool.md).

Four ``tokenfair sidecar`` processes of one policy (cost-model backend: 45,000 service tokens/s
each), one ``redis-server`` on loopback. Tenant ``hot`` has a pool budget of 30,000 service
tokens/s (burst 15,000) and sends all of its traffic, more than its budget, to sidecar 0:
requests of 200 prompt + 100 decode tokens = 600 service tokens, from 16 closed-loop clients
(a 429 waits 20 ms before the next try). Runs, each ``--window`` seconds after a 2 s warm-up:

* ``split`` — no store: each sidecar enforces 1/4 of the budget (what the operator renders);
* ``pool`` — ``budgetStore`` on: served tokens / (budget * window) (target >= 95 %, the split
  ~25 %), store calls per request (target <= 0.1);
* ``spread`` — the same load spread over all four: the pool's total from its first request,
  against ``burst + sustained * elapsed`` and the stated bound ``4 * (chunk + max(chunk,
  backlog))``;
* ``fault`` — ``pool`` with redis-server killed (SIGKILL) a third into the window and restarted
  10 s later: 5xx count (target 0), seconds from the kill to sidecar 0's ``/status`` saying
  ``fallback_split`` (target <= 1 s), and that leasing resumes after the restart;
* ``latency`` — tiny requests, a backend without delay, well inside the budget, alternating
  request by request between a sidecar with the store and one without (one connection each):
  median latency on vs off (target: on - off <= 0.1 ms); the figure is the median over rounds.

    .venv/bin/python bench/bench_pool.py               # --window 60 (~5 min)
    .venv/bin/python bench/bench_pool.py --window 20   # shorter (~2 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

ROOT: Final = Path(__file__).resolve().parent.parent
TOKENFAIR: Final = ROOT / ".venv" / "bin" / "tokenfair"
REPLICAS: Final = 4
SUSTAINED_PER_S: Final = 30_000
BURST: Final = 15_000
LEASE_MS: Final = 500
PROMPT_TOKENS, DECODE_TOKENS = 200, 100
REQUEST_TOKENS: Final = PROMPT_TOKENS + 4 * DECODE_TOKENS
CLIENTS: Final = 16
WARMUP_S: Final = 2.0
TENANT_HEADER: Final = "x-tenant"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_yaml(
    store_url: str | None, *, split: bool, fast_backend: bool = False, replicas: int = REPLICAS
) -> str:
    burst, sustained = BURST, float(SUSTAINED_PER_S)
    if split:
        burst, sustained = BURST // replicas, SUSTAINED_PER_S / replicas
    policy: dict[str, Any] = {"maxBatchWaitMs": 3500}
    if fast_backend:  # the backend answers at once: latency is the sidecar's own
        policy.update(prefillFloorMs=0, prefillTokensPerMs=1e9, serviceTokensPerMs=1e9)
    doc: dict[str, Any] = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TokenfairConfig",
        "version": "bench-pool",
        "policy": policy,
        "tenants": [
            {"tenantId": "hot", "weight": 1, "burstServiceTokens": burst,
             "sustainedServiceTokensPerSecond": sustained, "priorityClass": "batch"},
        ],
    }  # fmt: skip
    if store_url is not None:
        doc["budgetStore"] = {
            "redis": {"url": store_url},
            "keyPrefix": f"bench:{time.monotonic_ns()}",  # a fresh bucket per run
            "replicas": replicas,
            "leaseMs": LEASE_MS,
        }
    return json.dumps(doc)


@dataclass
class Sidecar:
    proxy: str
    admin: str
    process: subprocess.Popen[bytes]


class Cluster:
    """The processes of one run; everything is killed on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: list[subprocess.Popen[bytes]] = []
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_port = free_port()

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench_pool: redis-server not found (Debian package redis-server)")
        self.redis = subprocess.Popen(
            [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(self.redis_port)

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
            self.redis = None

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_sidecar(self, name: str, config: str) -> Sidecar:
        path = self.tmp / f"{name}.yaml"
        path.write_text(config)
        proxy, admin = free_port(), free_port()
        log = (self.tmp / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [str(TOKENFAIR), "sidecar", "--config", str(path),
             "--listen", f"127.0.0.1:{proxy}", "--admin-listen", f"127.0.0.1:{admin}",
             "--trusted-tenant-header", TENANT_HEADER, "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        self.processes.append(process)
        wait_port(admin)
        return Sidecar(f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{admin}", process)

    def stop_sidecars(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()

    def close(self) -> None:
        self.stop_sidecars()
        self.kill_redis()


def wait_port(port: int, budget_s: float = 15.0) -> None:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"bench_pool: nothing listens on port {port} after {budget_s} s")


@contextmanager
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        running = Cluster(Path(tmp))
        try:
            yield running
        finally:
            running.close()


@dataclass
class Load:
    """Outcomes of one load run."""

    statuses: dict[int, int] = field(default_factory=dict)
    served_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def drive(
    session: aiohttp.ClientSession,
    targets: list[str],
    duration_s: float,
    load: Load,
    *,
    clients: int = CLIENTS,
    prompt_tokens: int = PROMPT_TOKENS,
    decode_tokens: int = DECODE_TOKENS,
) -> None:
    """``clients`` closed-loop workers, worker ``i`` on ``targets[i % len(targets)]``."""
    body = {"model": "m", "prompt": "x" * (4 * prompt_tokens), "max_tokens": decode_tokens}
    stop_at = time.monotonic() + duration_s

    async def worker(target: str) -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                async with session.post(
                    f"{target}/v1/completions", json=body, headers={TENANT_HEADER: "hot"}
                ) as response:
                    await response.read()
                    status = response.status
            except aiohttp.ClientError:
                status = 599
            load.count(status)
            if status == 200:
                load.latencies_s.append(time.perf_counter() - started)
            elif status == 429:
                await asyncio.sleep(0.02)

    await asyncio.gather(*(worker(targets[i % len(targets)]) for i in range(clients)))


async def status_of(session: aiohttp.ClientSession, sidecar: Sidecar) -> dict[str, Any]:
    async with session.get(f"{sidecar.admin}/status") as response:
        result: dict[str, Any] = await response.json()
        return result


async def served(session: aiohttp.ClientSession, sidecars: list[Sidecar]) -> int:
    total = 0
    for sidecar in sidecars:
        status = await status_of(session, sidecar)
        total += int(status["tenants"]["hot"]["served_service_tokens"])
    return total


async def store_calls(session: aiohttp.ClientSession, sidecars: list[Sidecar]) -> int:
    total = 0
    for sidecar in sidecars:
        status = await status_of(session, sidecar)
        total += int(status.get("budget_store", {}).get("store_calls", 0))
    return total


@dataclass
class Run:
    served_tokens: int
    window_s: float
    requests_ok: int
    statuses: dict[int, int]
    calls: int = 0
    total_from_start: int = 0
    elapsed_from_start_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.served_tokens / (SUSTAINED_PER_S * self.window_s)


async def budget_run(
    running: Cluster, name: str, *, store: bool, spread: bool, window_s: float
) -> Run:
    """Warm-up, then ``window_s`` of load; served tokens over the window, from ``/status``."""
    config = config_yaml(running.redis_url if store else None, split=not store)
    sidecars = [running.start_sidecar(f"{name}-{i}", config) for i in range(REPLICAS)]
    targets = [s.proxy for s in sidecars] if spread else [sidecars[0].proxy]
    load = Load()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            began = time.monotonic()
            load_task = asyncio.create_task(drive(session, targets, WARMUP_S + window_s, load))
            await asyncio.sleep(WARMUP_S)
            served_0, calls_0, ok_0 = (
                await served(session, sidecars),
                await store_calls(session, sidecars),
                load.statuses.get(200, 0),
            )
            t0 = time.monotonic()
            await load_task
            t1 = time.monotonic()
            served_1 = await served(session, sidecars)
            calls_1 = await store_calls(session, sidecars)
            return Run(
                served_1 - served_0,
                t1 - t0,
                load.statuses.get(200, 0) - ok_0,
                dict(load.statuses),
                calls_1 - calls_0,
                served_1,
                t1 - began,
            )
    finally:
        running.stop_sidecars()


@dataclass
class Fault:
    run: Run
    fallback_after_s: float | None
    rejoined_after_s: float | None
    leased_before: int
    leased_after: int


async def fault_run(running: Cluster, window_s: float, outage_s: float) -> Fault:
    config = config_yaml(running.redis_url, split=False)
    sidecars = [running.start_sidecar(f"fault-{i}", config) for i in range(REPLICAS)]
    load = Load()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            load_task = asyncio.create_task(drive(session, [sidecars[0].proxy], window_s, load))
            await asyncio.sleep(window_s / 3)
            leased_before = await leased(session, sidecars[0])
            running.kill_redis()
            killed = time.monotonic()
            fallback_after_s = await until_mode(session, sidecars[0], "fallback_split", killed)
            await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - killed)))
            running.start_redis()
            restarted = time.monotonic()
            rejoined_after_s = await until_mode(session, sidecars[0], "shared", restarted)
            await load_task
            leased_after = await leased(session, sidecars[0])
            return Fault(
                Run(0, window_s, load.statuses.get(200, 0), dict(load.statuses)),
                fallback_after_s,
                rejoined_after_s,
                leased_before,
                leased_after,
            )
    finally:
        running.stop_sidecars()


async def leased(session: aiohttp.ClientSession, sidecar: Sidecar) -> int:
    status = await status_of(session, sidecar)
    return int(status["budget_store"]["tenants"]["hot"]["leased_service_tokens"])


async def until_mode(
    session: aiohttp.ClientSession, sidecar: Sidecar, mode: str, since: float
) -> float | None:
    deadline = since + 15.0
    while time.monotonic() < deadline:
        if (await status_of(session, sidecar))["budget_store"]["mode"] == mode:
            return time.monotonic() - since
        await asyncio.sleep(0.01)
    return None


async def latency_pairs(running: Cluster, seconds: float) -> tuple[list[float], list[float], int]:
    """Tiny sequential requests on one connection each to two sidecars, one with the store and
    one without, alternating request by request (so the machine's noise hits both alike).
    Returns both latency lists (s) and the store calls of the one with the store."""
    sidecars: dict[bool, Sidecar] = {}
    for store in (False, True):
        url = running.redis_url if store else None
        config = config_yaml(url, split=False, fast_backend=True, replicas=1)
        sidecars[store] = running.start_sidecar(f"latency-{'on' if store else 'off'}", config)
    body = {"model": "m", "prompt": "xxxx", "max_tokens": 1}
    latencies: dict[bool, list[float]] = {False: [], True: []}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            warm_until = time.monotonic() + 0.5
            stop_at = warm_until + seconds
            while time.monotonic() < stop_at:
                for store, sidecar in sidecars.items():
                    started = time.perf_counter()
                    async with session.post(
                        f"{sidecar.proxy}/v1/completions",
                        json=body,
                        headers={TENANT_HEADER: "hot"},
                    ) as response:
                        await response.read()
                        if response.status != 200:
                            raise SystemExit(f"bench_pool: latency run got {response.status}")
                    if time.monotonic() >= warm_until:
                        latencies[store].append(time.perf_counter() - started)
            calls = await store_calls(session, [sidecars[True]])
        return latencies[False], latencies[True], calls
    finally:
        running.stop_sidecars()


def chunk_tokens() -> int:
    """``BudgetStoreConfig.lease_tokens``: at most half the burst."""
    return min(BURST // 2, -(-SUSTAINED_PER_S * LEASE_MS // 1000))


async def main_async(window_s: float, latency_rounds: int, latency_s: float) -> int:
    with cluster() as running:
        running.start_redis()
        split = await budget_run(running, "split", store=False, spread=False, window_s=window_s)
        pool = await budget_run(running, "pool", store=True, spread=False, window_s=window_s)
        spread = await budget_run(running, "spread", store=True, spread=True, window_s=window_s)
        fault = await fault_run(running, max(window_s, 30.0), 10.0)
        on: list[float] = []
        off: list[float] = []
        latency_calls = latency_requests = 0
        for _ in range(latency_rounds):
            off_s, on_s, calls = await latency_pairs(running, latency_s)
            off.append(statistics.median(off_s))
            on.append(statistics.median(on_s))
            latency_requests += len(on_s)
            latency_calls += calls

    chunk = chunk_tokens()
    bound = REPLICAS * (chunk + max(chunk, 2 * REQUEST_TOKENS))
    allowed = BURST + SUSTAINED_PER_S * spread.elapsed_from_start_s
    overshoot = spread.total_from_start - allowed
    calls_per_request = pool.calls / max(1, pool.requests_ok)
    added_ms = (statistics.median(on) - statistics.median(off)) * 1000.0
    fives = sum(n for status, n in fault.run.statuses.items() if status >= 500)
    print(f"bench_pool: {REPLICAS} sidecars, tenant budget {SUSTAINED_PER_S}/s burst {BURST}, "
          f"lease chunk {chunk}, window {window_s:.0f} s (+{WARMUP_S:.0f} s warm-up)")  # fmt: skip
    print(f"  split (1/n, no store)  served {split.served_tokens:>9} tokens = "
          f"{split.ratio:6.1%} of budget*window   statuses {split.statuses}")  # fmt: skip
    print(f"  pool  (store on)       served {pool.served_tokens:>9} tokens = "
          f"{pool.ratio:6.1%} of budget*window   statuses {pool.statuses}")  # fmt: skip
    print(f"    pool / split = {pool.ratio / max(split.ratio, 1e-9):.2f}x   target >= 95 %: "
          f"{'PASS' if pool.ratio >= 0.95 else 'FAIL'}")  # fmt: skip
    print(f"    store calls {pool.calls} / {pool.requests_ok} requests = "
          f"{calls_per_request:.3f} per request   target <= 0.1: "
          f"{'PASS' if calls_per_request <= 0.1 else 'FAIL'}")  # fmt: skip
    print(f"  spread (all 4 sidecars) total {spread.total_from_start} tokens in "
          f"{spread.elapsed_from_start_s:.1f} s; one bucket allows {allowed:.0f}; "
          f"over by {overshoot:.0f} (bound {bound}): "
          f"{'PASS' if overshoot <= bound else 'FAIL'}")  # fmt: skip
    print(f"  fault: redis killed {fault.run.window_s / 3:.0f} s in for 10 s: 5xx {fives}, "
          f"fallback after {fmt_s(fault.fallback_after_s)}, shared again "
          f"{fmt_s(fault.rejoined_after_s)} after the restart, leased "
          f"{fault.leased_before} -> {fault.leased_after}")  # fmt: skip
    print(f"    statuses {fault.run.statuses}")
    resumed = fault.leased_after > fault.leased_before
    fell_back = fault.fallback_after_s is not None and fault.fallback_after_s <= 1.0
    print(f"    zero 5xx, fallback <= 1 s, leasing resumed: "
          f"{'PASS' if fives == 0 and fell_back and resumed else 'FAIL'}")  # fmt: skip
    print(f"  latency p50 (tiny requests, 1 connection, {latency_rounds} rounds of "
          f"{latency_s:.0f} s): store off {statistics.median(off) * 1e3:.3f} ms, on "
          f"{statistics.median(on) * 1e3:.3f} ms, added {added_ms:+.3f} ms   target <= 0.1 ms: "
          f"{'PASS' if added_ms <= 0.1 else 'FAIL'}   "
          f"(store calls {latency_calls} / {latency_requests} requests)")  # fmt: skip
    return 0


def fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per run (60)")
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args.window, args.latency_rounds, args.latency_seconds))


if __name__ == "__main__":
    sys.exit(main())
