"""A real ``redis-server`` for the budget-store tests: started on a free loopback port, no
persistence, killed and restarted on the same port by the fault tests.

Debian's package ``redis-server`` provides it (``.ci/run`` installs it). Without it the tests
are skipped with that hint — unless ``TOKENFAIR_REQUIRE_REDIS=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_ENV = "TOKENFAIR_REQUIRE_REDIS"
START_BUDGET_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; :meth:`kill` and :meth:`start` keep its port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = (self.workdir / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + START_BUDGET_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer within {START_BUDGET_S} s")

    def kill(self) -> None:
        """SIGKILL (a crash, not a clean shutdown) and wait for it to go."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open and nothing answers (a store that is slow, not down)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def log_tail(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace")[-500:] if path.exists() else ""


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server not found: install Debian's package redis-server"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return binary


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` per test (empty, on its own port)."""
    server = RedisServer(redis_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.resume()  # a stopped process ignores SIGKILL's exit until continued
        server.kill()
