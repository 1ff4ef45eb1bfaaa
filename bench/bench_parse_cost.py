"""What a hostile body costs the sidecar's event loop before admission (issue 11 #4).

A real ``tokenfair sidecar`` (costmodel backend, time scale 0.01, policy budgets of
``examples/sidecar-standalone.yaml``) on loopback; each case runs it from a source tree
(``--tree``, default this checkout; pass an older checkout, e.g. a ``git worktree``, to compare):

* **cpu per hostile request** — the process's ``utime + stime`` (``/proc/PID/stat``) over
  ``--requests`` sequential POSTs of the hostile body (1 MiB of ``{"messages": [{}, {}, ...]}``:
  ~349,000 empty objects, under the 1 MiB body limit), divided by their count: the event-loop
  time each one costs before it is refused or admitted;
* **neighbour p50/p99/max** — the latency of a small request of another tenant, sent one at a
  time (``--samples``, 40 by default) while ``--attackers`` connections loop the hostile body:
  what the issue saw go from 12 ms to 5 s. The p99 is interpolated between the slowest samples
  (``statistics.quantiles``, inclusive); with 40 samples it lies close to the max.

Printed figures are medians over the run; the same machine and run give the baseline (a
``--tree`` of the old code), so compare ratios, not absolute numbers.

    .venv/bin/python bench/bench_parse_cost.py                      # this checkout
    .venv/bin/python bench/bench_parse_cost.py --tree ../old-tree   # another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import aiohttp

ROOT: Final = Path(__file__).resolve().parent.parent
CONFIG: Final = ROOT / "examples" / "sidecar-standalone.yaml"
ATTACKER_KEY: Final = "Bearer sk-local-batch-rag"
NEIGHBOUR_KEY: Final = "Bearer sk-local-chat-pro"
RUN_CLI: Final = "import sys; from tokenfair.cli import main; sys.exit(main())"
"""The CLI of whichever tree is first on PYTHONPATH (an older checkout's, to compare)."""
SMALL: Final = b'{"model":"m","prompt":"hello there","max_tokens":4}'


def hostile_body(limit_bytes: int = 1 << 20) -> bytes:
    """``{"model":"m","messages":[{},{},...]}`` as close to ``limit_bytes`` as fits."""
    head, tail = b'{"model":"m","messages":[', b"]}"
    count = (limit_bytes - len(head) - len(tail) + 1) // 3
    return head + b",".join([b"{}"] * count) + tail


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(admin: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(f"{admin}/readyz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("the sidecar did not become ready")


async def measure(
    url: str, pid: int, body: bytes, requests: int, attackers: int, samples: int
) -> None:
    headers = {"Authorization": ATTACKER_KEY, "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        statuses: dict[int, int] = {}
        before = cpu_s(pid)
        for _ in range(requests):
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1
        per_request_ms = (cpu_s(pid) - before) / requests * 1000
        print(f"  hostile body {len(body)} bytes: answers {statuses}")
        print(f"  sidecar CPU per hostile request: {per_request_ms:.1f} ms")

        stop = asyncio.Event()

        async def attack() -> None:
            while not stop.is_set():
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()

        tasks = [asyncio.create_task(attack()) for _ in range(attackers)]
        await asyncio.sleep(0.5)
        latencies: list[float] = []
        neighbour = {"Authorization": NEIGHBOUR_KEY, "Content-Type": "application/json"}
        for _ in range(samples):
            start = time.perf_counter()
            async with session.post(url, data=SMALL, headers=neighbour) as response:
                await response.read()
            latencies.append((time.perf_counter() - start) * 1000)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
        print(f"  neighbour latency with {attackers} attackers ({samples} samples): "
              f"p50 {statistics.median(latencies):.1f} ms, p99 {p99:.1f} ms, "
              f"max {max(latencies):.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="source tree to run")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--attackers", type=int, default=6)
    parser.add_argument("--samples", type=int, default=40, help="neighbour requests (>= 2)")
    args = parser.parse_args()
    port, admin_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve() / "sidecar")}
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "sidecar.log", "wb")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(
            [sys.executable, "-c", RUN_CLI,
             "sidecar", "--config", str(CONFIG), "--listen", f"127.0.0.1:{port}",
             "--admin-listen", f"127.0.0.1:{admin_port}", "--time-scale", "0.01",
             "--log-level", "WARNING"],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{admin_port}"))
            print(f"tree {args.tree}:")
            asyncio.run(
                measure(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    process.pid,
                    hostile_body(),
                    args.requests,
                    args.attackers,
                    max(2, args.samples),
                )
            )
        finally:
            process.terminate()
            process.wait(10)
            log.close()


if __name__ == "__main__":
    main()
