"""What the engine tests (tests/engine/) share: a real ``tokenfair sidecar`` process in front of
the session's vLLM (tests/vllm_support.py), configured from the engine's own facts, its request
records, the official ``openai`` SDK pointed at it, and the engine's token counters.

The sidecar's config describes the engine as it is: ``kvBlockTokens`` is the engine's block
size and ``totalKvBlocks`` its block count (both read from vLLM's ``vllm:cache_config_info``),
``maxInFlight`` its ``--max-num-seqs``. The lesson's three tenants with their local keys
(tests/sidecar_support.py) and 60 s wait limits, so that a slow machine never sheds.

Everything asynchronously written is waited for, never read once: records are flushed by the
sidecar once per event-loop turn, the engine's counters are updated after its response is sent.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import openai
import yaml
from kubecluster import log_tail, start_process, stop_process
from loopback_support import free_ports
from sidecar_support import KEYS, PATIENT_POLICY, keyed_config
from vllm_support import VllmServer, sample

from tokenfair.config import config_to_document

TOKENFAIR = Path(sys.executable).with_name("tokenfair")
READY_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 30.0
"""How long a test waits for records or counters to catch up (they take milliseconds)."""
SIDECAR_LOG = "sidecar"
T = TypeVar("T")


def wait_until(read: Callable[[], T], done: Callable[[T], bool],
               timeout_s: float = WAIT_TIMEOUT_S) -> T:  # fmt: skip
    """Poll ``read()`` until ``done`` holds for its value; return that value. After
    ``timeout_s`` return the last value read (the caller's assertion then says what differs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@dataclass(frozen=True)
class EngineTokens:
    """The engine's cumulative ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``."""

    prompt: int
    generation: int

    @classmethod
    def read(cls, vllm: VllmServer) -> EngineTokens:
        samples = vllm.metrics()
        return cls(
            int(sample(samples, "vllm:prompt_tokens_total", model_name=vllm.model)),
            int(sample(samples, "vllm:generation_tokens_total", model_name=vllm.model)),
        )

    def __sub__(self, before: EngineTokens) -> EngineTokens:
        return EngineTokens(self.prompt - before.prompt, self.generation - before.generation)


def engine_tokens_after(vllm: VllmServer, before: EngineTokens,
                        expected: EngineTokens) -> EngineTokens:  # fmt: skip
    """The counters' growth since ``before``, once it reaches ``expected`` (or as it is after
    :data:`WAIT_TIMEOUT_S`)."""
    return wait_until(lambda: EngineTokens.read(vllm) - before, lambda d: d == expected)


@dataclass
class EngineSidecar:
    """A running ``tokenfair sidecar --backend openai`` in front of vLLM."""

    proxy: str
    admin: str
    records_path: Path
    workdir: Path

    def records(self) -> list[dict[str, Any]]:
        """Every record written so far (one dict per JSON line)."""
        if not self.records_path.exists():
            return []
        lines = self.records_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def record(self, client_request_id: str) -> dict[str, Any]:
        """The one record of the request the client sent with ``x-request-id`` =
        ``client_request_id`` (the sidecar's id ends in it), once it is written."""

        def matching(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in records if r["request_id"].endswith(f"-{client_request_id}")]

        records = wait_until(self.records, lambda rs: len(matching(rs)) == 1)
        found = matching(records)
        assert len(found) == 1, f"{len(found)} records of {client_request_id}\n{self.log_tail()}"
        return found[0]

    def status(self) -> dict[str, Any]:
        """The admin listener's ``/status``."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.admin}/status", timeout=10) as response:
            payload: dict[str, Any] = json.loads(response.read())
            return payload

    def client(self, tenant: str = "tenant_chat_pro") -> openai.OpenAI:
        """The official SDK as ``tenant`` (its local key), no retries: every attempt counts."""
        return openai.OpenAI(base_url=f"{self.proxy}/v1", api_key=KEYS[tenant], max_retries=0)

    def log_tail(self) -> str:
        return log_tail(self.workdir, SIDECAR_LOG, 40)


def engine_document(
    vllm: VllmServer, sidecar_settings: dict[str, Any] | None = None, **policy: Any
) -> dict[str, Any]:
    """The lesson's tenants with local keys, under a policy that describes ``vllm`` (its block
    size and count) with ``policy``'s changes, and a ``sidecar:`` section (``maxInFlight`` = the
    engine's ``--max-num-seqs``, and ``sidecar_settings``' keys)."""
    changes = {
        "kv_block_tokens": vllm.block_size_tokens,
        "total_kv_blocks": vllm.kv_blocks,
        **policy,
    }
    document = config_to_document(keyed_config(replace(PATIENT_POLICY, **changes)))
    document["sidecar"] = {"maxInFlight": vllm.settings.max_num_seqs, **(sidecar_settings or {})}
    return document


def wait_ready(admin: str, process: subprocess.Popen[bytes], workdir: Path) -> None:
    """Poll the admin ``/readyz`` until 200; raise with the log if the sidecar exits first."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the sidecar exited\n{log_tail(workdir, SIDECAR_LOG, 40)}")
        with contextlib.suppress(OSError), opener.open(f"{admin}/readyz", timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the sidecar was not ready\n{log_tail(workdir, SIDECAR_LOG, 40)}")


@contextlib.contextmanager
def sidecar_in_front_of(
    vllm: VllmServer,
    workdir: Path,
    sidecar_settings: dict[str, Any] | None = None,
    **policy: Any,
) -> Iterator[EngineSidecar]:
    """``tokenfair sidecar --backend openai --upstream <vllm>`` on free loopback ports, with
    :func:`engine_document`'s config (``sidecar_settings``: more ``sidecar:`` keys) and
    ``--records``; stopped (SIGTERM, drain) on exit."""
    config = workdir / "sidecar.yaml"
    document = engine_document(vllm, sidecar_settings, **policy)
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    proxy_port, admin_port = free_ports(2)
    sidecar = EngineSidecar(
        proxy=f"http://127.0.0.1:{proxy_port}",
        admin=f"http://127.0.0.1:{admin_port}",
        records_path=workdir / "records.jsonl",
        workdir=workdir,
    )
    command = [
        str(TOKENFAIR), "sidecar", "--config", str(config),
        "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
        "--backend", "openai", "--upstream", vllm.base_url,
        "--records", str(sidecar.records_path), "--drain-grace", "5",
    ]  # fmt: skip
    process = start_process(SIDECAR_LOG, command, workdir)
    try:
        wait_ready(sidecar.admin, process, workdir)
        yield sidecar
    finally:
        stop_process(process)
