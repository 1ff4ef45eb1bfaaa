"""Clients that hold the sidecar's resources without paying for them (issue 28 rows 2 and 3).

A real ``tokenfair sidecar`` (costmodel engine, time scale 1, the lesson's tenants of
``examples/sidecar-standalone.yaml``) on loopback, run from each ``--tree`` in turn (default
this checkout; pass an older checkout too to compare in the same run). Two cases:

* **rss** — ``--clients`` (100) connections each ask for a large non-streamed answer
  (embeddings of 16 inputs x 16,384 dimensions: ~5 MB of JSON) and never read it (4 KiB receive
  buffers). The sidecar's RSS (``VmRSS``) is read before (after a warm-up of the same requests,
  read whole), at its peak while the clients hold their answers, and ``2 x
  clientWriteTimeoutSeconds + 5 s`` (``--write-timeout``, 5 s) after every request was answered
  (all dispatched, none running: ``/status``): target, the RSS after within 10 % of the one
  before. Also printed: how many clients the sidecar cut.
* **sockets** — ``--sockets`` (5,000) anonymous connections from 20 loopback addresses
  (127.0.0.2-21), half idle, half trickling a request head that never ends, all held open; then
  a tenant (127.0.0.1) sends ``--requests`` (50) requests, each on a new connection: target,
  all of them served (``200``). The sidecar runs with its defaults (``maxClientConnections``
  4,096, ``maxUnauthenticatedConnections`` 1,024, 256 per peer); the idle timeout is raised to
  10 minutes so that nothing but the cap decides.

The process's open-file limit is raised to its hard limit (the sidecar inherits it): the
sockets case needs ~5,000 descriptors on each side.

    .venv/bin/python bench/bench_hostile_clients.py                        # both cases, ~2 min
    .venv/bin/python bench/bench_hostile_clients.py --case rss --tree ../old-tree --tree .
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml

ROOT: Final = Path(__file__).resolve().parent.parent
CONFIG: Final = ROOT / "examples" / "sidecar-standalone.yaml"
TENANT_KEY: Final = "Bearer sk-local-chat-pro"
RUN_CLI: Final = "import sys; from tokenfair.cli import main; sys.exit(main())"
"""The CLI of whichever tree is first on PYTHONPATH (an older checkout's, to compare)."""
EMBEDDINGS: Final = json.dumps(
    {"model": "m", "input": [f"input {i}" for i in range(16)], "dimensions": 16384}
).encode()
CHAT: Final = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
RSS_TARGET: Final = 1.10
FLOOD_PEERS: Final = 20


def request(path: str, body: bytes, key: str = TENANT_KEY) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: sidecar\r\nAuthorization: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cut(sock: socket.socket) -> bool:
    """The sidecar reset or ended the connection (Linux TCP_INFO state CLOSE / CLOSE_WAIT)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] in (7, 8)


class Sidecar:
    """A sidecar process from ``tree`` with ``section`` as its ``sidecar:`` settings."""

    def __init__(self, tree: Path, section: dict[str, Any], tmp: Path) -> None:
        documents = list(yaml.safe_load_all(CONFIG.read_text()))
        documents[0]["sidecar"] = {**documents[0].get("sidecar", {}), **section}
        config = tmp / "sidecar.yaml"
        config.write_text(yaml.safe_dump_all(documents), encoding="utf-8")
        self.port, admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.log = open(tmp / "sidecar.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-c", RUN_CLI, "sidecar", "--config", str(config),
             "--listen", f"127.0.0.1:{self.port}", "--admin-listen", f"127.0.0.1:{admin_port}",
             "--log-level", "WARNING", "--access-log", "off"],
            env={**os.environ, "PYTHONPATH": str(tree.resolve() / "sidecar")},
            stdout=self.log, stderr=self.log,
        )  # fmt: skip

    async def ready(self) -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(400):
                try:
                    async with session.get(f"{self.admin}/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError("the sidecar did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


async def connect(port: int, *, source: str = "127.0.0.1", rcvbuf: int | None = None
                  ) -> socket.socket:  # fmt: skip
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def until_answered(sidecar: Sidecar, count: int, sample: Callable[[], None]) -> float:
    """Seconds until the tenant's ``count`` requests were all dispatched and none runs (the
    answers built and handed to their clients' connections), read from ``/status``;
    ``sample()`` is called between two reads."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - started < 600:
            async with session.get(f"{sidecar.admin}/status") as response:
                status = await response.json()
            counts = status["tenants"]["tenant_chat_pro"]["counts"]
            books = status["books"]
            if counts.get("admitted", 0) >= count and books["running_requests"] == 0:
                return time.monotonic() - started
            sample()
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the sidecar did not answer {count} requests in 600 s")


async def case_rss(tree: Path, clients: int, write_timeout_s: float) -> None:
    section = {"clientWriteTimeoutSeconds": write_timeout_s, "maxInFlight": 256}
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = Sidecar(tree, section, Path(tmp))
        try:
            await sidecar.ready()
            async with aiohttp.ClientSession() as session:
                for _ in range(5):  # warm up with the same answers, read whole
                    async with session.post(
                        f"{sidecar.url}/v1/embeddings", data=EMBEDDINGS,
                        headers={"Authorization": TENANT_KEY},
                    ) as response:  # fmt: skip
                        assert response.status == 200, await response.text()
                        await response.read()
            await asyncio.sleep(1.0)
            before = rss_mib(sidecar.process.pid)
            loop = asyncio.get_running_loop()
            socks = []
            for _ in range(clients):
                sock = await connect(sidecar.port, rcvbuf=4096)
                await loop.sock_sendall(sock, request("/v1/embeddings", EMBEDDINGS))
                socks.append(sock)
            pid = sidecar.process.pid
            readings = [before]
            answered_s = await until_answered(
                sidecar, 5 + clients, lambda: readings.append(rss_mib(pid))
            )
            peak = max(readings)
            settle_s = 2 * write_timeout_s + 5.0
            until = time.monotonic() + settle_s
            while time.monotonic() < until:
                peak = max(peak, rss_mib(sidecar.process.pid))
                await asyncio.sleep(0.1)
            after = rss_mib(sidecar.process.pid)
            cut_count = sum(cut(sock) for sock in socks)
            for sock in socks:
                sock.close()
            ratio = after / before
            verdict = "ok" if ratio <= RSS_TARGET else "MISSED"
            print(f"  rss: {clients} non-reading clients of ~{5.0:.0f} MB answers, write timeout "
                  f"{write_timeout_s:g} s")  # fmt: skip
            print(f"    every request answered (handed to its connection) {answered_s:.1f} s after "
                  "the first was sent")  # fmt: skip
            print(f"    RSS before {before:.1f} MiB, peak {peak:.1f} MiB, {settle_s:g} s after "
                  f"the last answer {after:.1f} MiB")  # fmt: skip
            print(
                f"    after / before = {ratio:.3f} (target <= {RSS_TARGET:.2f}: {verdict}); "
                f"clients cut by the sidecar: {cut_count}/{clients}"
            )
        finally:
            sidecar.stop()


async def case_sockets(tree: Path, sockets: int, requests: int) -> None:
    section = {"clientIdleTimeoutSeconds": 600}
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = Sidecar(tree, section, Path(tmp))
        flood: list[socket.socket] = []
        try:
            await sidecar.ready()
            started = time.monotonic()
            for index in range(sockets):
                peer = f"127.0.0.{2 + index % FLOOD_PEERS}"
                try:
                    sock = await connect(sidecar.port, source=peer)
                except OSError:
                    continue
                if index % 2:
                    with contextlib.suppress(OSError):
                        sock.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                flood.append(sock)
            opened_s = time.monotonic() - started
            await asyncio.sleep(1.0)
            still = sum(not cut(sock) for sock in flood)
            statuses: dict[int, int] = {}
            latencies: list[float] = []
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0)
            ) as session:
                for _ in range(requests):
                    start = time.perf_counter()
                    try:
                        async with asyncio.timeout(60):
                            async with session.post(
                                f"{sidecar.url}/v1/chat/completions", data=CHAT,
                                headers={"Authorization": TENANT_KEY},
                            ) as response:  # fmt: skip
                                await response.read()
                                status = response.status
                    except (aiohttp.ClientError, TimeoutError):
                        status = 0
                    latencies.append((time.perf_counter() - start) * 1000)
                    statuses[status] = statuses.get(status, 0) + 1
            served = statuses.get(200, 0)
            verdict = "ok" if served == requests else "MISSED"
            print(f"  sockets: {len(flood)} anonymous sockets opened from {FLOOD_PEERS} peers in "
                  f"{opened_s:.1f} s; {still} still open 1 s later")  # fmt: skip
            print(
                f"    tenant on new connections: {served}/{requests} served (target all: "
                f"{verdict}); answers {dict(sorted(statuses.items()))}; latency p50 "
                f"{statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms"
            )
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{sidecar.admin}/status") as response,
            ):
                connections = (await response.json()).get("connections")
            if connections is not None:
                print(f"    the sidecar's connections: {connections}")
        finally:
            for sock in flood:
                sock.close()
            sidecar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, action="append", help="source tree (repeatable)")
    parser.add_argument("--case", choices=["rss", "sockets", "all"], default="all")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--write-timeout", type=float, default=5.0)
    parser.add_argument("--sockets", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for tree in args.tree or [ROOT]:
        print(f"tree {tree}:")
        if args.case in ("rss", "all"):
            asyncio.run(case_rss(tree, args.clients, args.write_timeout))
        if args.case in ("sockets", "all"):
            asyncio.run(case_sockets(tree, args.sockets, args.requests))


if __name__ == "__main__":
    main()
