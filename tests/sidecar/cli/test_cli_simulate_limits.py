"""``tokenfair simulate`` with the tenant limits beside the budget (the installed console script
in a subprocess): ``--set tenants.ID.maxConcurrentRequests=…`` holds the tenant's requests on a
batching engine — records of requests that waited for it say ``held_by_max_concurrent_requests``,
one that expired held says ``shed_tenant_concurrency`` with the limit and the tenant's count,
and the report counts that reason — while the same run without the limit has neither. A bad
limit exits 2 naming the field and its rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TOKENFAIR = Path(sys.executable).parent / "tokenfair"
BASE = [
    "simulate", "--scenario", "noisy-neighbor", "--policy", "tokenfair", "--format", "json",
    "--set", "maxBatchRequests=4", "--set", "maxInteractiveWaitMs=150",
]  # fmt: skip


def run(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    records = tmp_path / "records.jsonl"
    done = subprocess.run(
        [str(TOKENFAIR), *BASE, *extra, "--records", str(records)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    return json.loads(done.stdout), lines


def test_a_concurrency_limit_holds_and_expires_with_its_reason(tmp_path: Path) -> None:
    report, records = run(tmp_path, "--set", "tenants.tenant_chat_pro.maxConcurrentRequests=1")
    chat = [r for r in records if r["tenant_id"] == "tenant_chat_pro"]
    held = [r for r in chat if r["observed"].get("held_by_max_concurrent_requests") == 1]
    assert held
    assert all(r["reason"] == "admitted" for r in held)
    expired = [r for r in chat if r["reason"] == "shed_tenant_concurrency"]
    assert expired
    for record in expired:
        assert (record["gate"], record["status_code"]) == ("queue", 429)
        assert record["observed"]["max_concurrent_requests"] == 1
        assert record["observed"]["tenant_running_requests"] == 1
    shed = report["comparison"]["tokenfair"]["shed_reasons"]
    assert shed["shed_tenant_concurrency"] == len(expired)
    # The other tenants are never marked: the limit is chat's alone.
    assert not any(
        key.startswith("held_by") for r in records if r["tenant_id"] != "tenant_chat_pro"
        for key in r["observed"]
    )  # fmt: skip

    unlimited_report, unlimited = run(tmp_path)
    assert not any(key.startswith("held_by") for r in unlimited for key in r["observed"])
    assert (
        "shed_tenant_concurrency" not in unlimited_report["comparison"]["tokenfair"]["shed_reasons"]
    )


def test_a_bad_limit_exits_2_naming_the_field(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(TOKENFAIR), *BASE, "--set", "tenants.tenant_chat_pro.maxKvShare=0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "maxKvShare: must be in (0, 1] (got 0)" in done.stderr
