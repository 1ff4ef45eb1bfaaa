"""Paths that name no regular file, and the records file's log rotation (issue 28, rows 7, 9
and 12).

* ``tokenfair sidecar`` started with its config at a FIFO nobody writes, or at a symlink to
  ``/dev/zero``, or its records at a FIFO, exits 2 at once with one line naming the path and the
  rule (it blocked until a writer came, or read ``/dev/zero`` until memory ran out);
* a running sidecar whose config path becomes a FIFO, then a symlink to ``/dev/zero``, keeps
  serving on both ports, refuses each (counted in
  ``tokenfair_config_reloads_total{result="invalid"}``), and applies the next regular file;
* the upstream key file and the config loaders of the library refuse the same paths by name;
* :meth:`RecordWriter.reopen` (``Sidecar.reopen_logs``, what ``SIGHUP`` calls) after a rename
  sends the next records to a new file at the path while the renamed one keeps its own; a
  reopen that cannot open the path keeps writing the file it has.

Each sidecar process runs under a 2 GiB address-space limit, so that reading ``/dev/zero`` ends
in a ``MemoryError`` rather than taking the machine's memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from loopback_support import free_ports
from sidecar_support import CHAT, ClientFactory, completion_body, keyed_config, start, wait_for

from tokenfair.config import ConfigError, config_to_document, load_config, load_tenants_file
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.runtime_settings import SidecarSettings, read_upstream_api_key

pytestmark = pytest.mark.virtual_time

TOKENFAIR = Path(sys.executable).with_name("tokenfair")
MEMORY_LIMIT_BYTES = 2 << 30
START_BUDGET_S = 30.0


def limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def config_yaml(version: str) -> str:
    document = config_to_document(keyed_config())
    document["version"] = version
    document["sidecar"] = {"reloadIntervalSeconds": 0.05, "timeScale": 0.01}
    return yaml.safe_dump(document)


def hostile(tmp_path: Path, kind: str) -> Path:
    """A path in ``tmp_path`` that is a FIFO, a symlink to ``/dev/zero`` or a directory."""
    path = tmp_path / f"hostile-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


RULES = {
    "fifo": "must be a regular file (it is a FIFO)",
    "zero": "must be a regular file (it is a character device)",
    "dir": "must be a regular file (it is a directory)",
}


def run_sidecar(*args: str, timeout_s: float = START_BUDGET_S) -> subprocess.CompletedProcess[str]:
    proxy, admin = free_ports(2)
    return subprocess.run(
        [str(TOKENFAIR), "sidecar", "--listen", f"127.0.0.1:{proxy}",
         "--admin-listen", f"127.0.0.1:{admin}", "--access-log", "off", *args],
        capture_output=True, text=True, timeout=timeout_s, preexec_fn=limited_memory,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_a_config_path_that_is_no_regular_file_is_refused_at_start(
    tmp_path: Path, kind: str
) -> None:
    path = hostile(tmp_path, kind)
    done = run_sidecar("--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"tokenfair sidecar: error: {path}: {RULES[kind]}"]


def test_a_records_path_that_is_a_fifo_is_refused_at_start(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(config_yaml("v1"), encoding="utf-8")
    path = hostile(tmp_path, "fifo")
    done = run_sidecar("--config", str(config), "--records", str(path), "--log-level", "ERROR")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"tokenfair sidecar: error: {path}: {RULES['fifo']}"


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_the_librarys_config_readers_refuse_them_by_name(tmp_path: Path, kind: str) -> None:
    path = hostile(tmp_path, kind)
    for read in (load_config, load_tenants_file):
        with pytest.raises(ConfigError) as caught:
            read(path)
        assert str(caught.value) == f"{path}: {RULES[kind]}"
    with pytest.raises(ConfigError) as caught:
        read_upstream_api_key(str(path))
    assert str(caught.value) == f"upstreamApiKeyFile: {path}: {RULES[kind]}"


def test_a_config_file_over_the_document_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as handle:  # sparse: 100 MB that take no disk
        handle.truncate(100_000_000)
    with pytest.raises(ConfigError, match=r"huge.yaml: must be at most 16777216 bytes \(16 MiB\)"):
        load_tenants_file(path)


# -- a running sidecar whose config path turns hostile ----------------------------------------


class Running:
    def __init__(self, process: subprocess.Popen[bytes], proxy: str, admin: str) -> None:
        self.process, self.proxy, self.admin = process, proxy, admin

    async def metric(self, session: aiohttp.ClientSession, prefix: str) -> float:
        async with session.get(f"{self.admin}/metrics", timeout=ANSWER) as response:
            text = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(prefix))  # fmt: skip


ANSWER = aiohttp.ClientTimeout(total=5)
INVALID = 'tokenfair_config_reloads_total{result="invalid"}'


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[Running, Path]]:
    config = tmp_path / "config.yaml"
    config.write_text(config_yaml("v1"), encoding="utf-8")
    proxy, admin = free_ports(2)
    process = subprocess.Popen(
        [str(TOKENFAIR), "sidecar", "--config", str(config), "--listen", f"127.0.0.1:{proxy}",
         "--admin-listen", f"127.0.0.1:{admin}", "--access-log", "off", "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limited_memory,
    )  # fmt: skip
    sidecar = Running(process, f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{admin}")
    try:
        async with aiohttp.ClientSession() as session:
            assert await until(lambda: answers(session, f"{sidecar.admin}/readyz"))
        yield sidecar, config
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:  # a loop blocked in a read does not see SIGTERM
            process.kill()
            process.wait()


async def answers(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=ANSWER) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def until(probe: Callable[[], Any], budget_s: float = START_BUDGET_S) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while loop.time() < deadline:
        if await probe():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.wall_time  # the sidecar is a process
async def test_a_running_sidecar_refuses_a_config_path_turned_hostile_and_keeps_serving(
    running: tuple[Running, Path], tmp_path: Path
) -> None:
    sidecar, config = running
    async with aiohttp.ClientSession() as session:
        for count, kind in enumerate(("fifo", "zero"), start=1):
            os.replace(hostile(tmp_path, kind), config)  # atomic: never a missing file

            async def refused(count: int = count) -> bool:
                return await sidecar.metric(session, INVALID) >= count

            assert await until(refused), kind
            assert await answers(session, f"{sidecar.admin}/healthz"), kind
            async with session.post(
                f"{sidecar.proxy}/v1/completions", json=completion_body(10, 5),
                headers={"Authorization": CHAT}, timeout=ANSWER,
            ) as response:  # fmt: skip
                assert response.status == 200, kind
        fresh = tmp_path / "fresh.yaml"
        fresh.write_text(config_yaml("v2"), encoding="utf-8")
        os.replace(fresh, config)

        async def applied() -> bool:
            async with session.get(f"{sidecar.admin}/status", timeout=ANSWER) as response:
                return bool((await response.json())["config"]["version"] == "v2")

        assert await until(applied)
    assert sidecar.process.poll() is None


# -- the records file's rotation ----------------------------------------------------------------


def test_reopen_after_a_rename_writes_a_new_file_at_the_path(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    writer = RecordWriter(path)
    writer.write('{"n":1}')
    rotated = tmp_path / "records.jsonl.1"
    path.rename(rotated)  # logrotate's rename; the writer still holds the renamed file
    writer.write('{"n":2}')
    assert writer.reopen()
    writer.write('{"n":3}')
    writer.close()
    assert rotated.read_text() == '{"n":1}\n{"n":2}\n'
    assert path.read_text() == '{"n":3}\n'


def test_a_reopen_that_cannot_open_the_path_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    writer = RecordWriter(path)
    writer.write('{"n":1}')
    path.rename(tmp_path / "records.jsonl.1")
    os.mkfifo(path)  # no longer a regular file
    assert not writer.reopen()
    writer.write('{"n":2}')
    writer.close()
    assert (tmp_path / "records.jsonl.1").read_text() == '{"n":1}\n{"n":2}\n'


async def test_reopen_logs_moves_the_records_of_a_running_sidecar(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    path = tmp_path / "records.jsonl"
    clients = await start(
        aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01, records_path=str(path))
    )
    body = completion_body(10, 5)
    headers = {"Authorization": CHAT}
    assert (await clients.proxy.post("/v1/completions", json=body, headers=headers)).status == 200
    rotated = tmp_path / "records.jsonl.1"
    assert await wait_for(lambda: path.exists() and path.stat().st_size > 0)
    path.rename(rotated)
    clients.sidecar.reopen_logs()
    assert (await clients.proxy.post("/v1/completions", json=body, headers=headers)).status == 200
    assert await wait_for(lambda: path.exists() and path.stat().st_size > 0)
    old = [json.loads(line) for line in rotated.read_text().splitlines()]
    new = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(old) == 1
    assert len(new) == 1
    assert old[0]["request_id"] != new[0]["request_id"]
