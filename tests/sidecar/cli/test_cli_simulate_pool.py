"""``tokenfair simulate --replicas N --routing R`` as a user runs it (the console script):

- the JSON report has one run per replica baseline and ``tokenfair+pool``, each tenant's
  pool-wide service beside its constrained max-min share, and the store's calls per request;
  on ``pool-skewed`` the pinned tenant gets about half of its share per replica and >= 90 % with
  the pool, in the same run;
- the table names the runs and tenants;
- bad flags exit 2 naming the flag: pool flags without ``--replicas``, ``--replicas`` out of
  range, an unknown ``--pinned`` tenant, ``--records`` with ``--replicas``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOKENFAIR = Path(sys.executable).parent / "tokenfair"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOKENFAIR), "simulate", *args], capture_output=True, text=True, check=False
    )


def test_the_skewed_pool_report() -> None:
    done = _run("--scenario", "pool-skewed", "--replicas", "4", "--routing", "skewed",
                "--format", "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    pool = json.loads(done.stdout)["pool"]
    assert (pool["replicas"], pool["routing"], pool["pinned"]) == (4, "skewed", ["tenant_pinned"])
    runs = pool["runs"]
    assert list(runs) == ["tokenfair", "tokenfair+pool"]
    alone = runs["tokenfair"]["tenants"]["tenant_pinned"]
    shared = runs["tokenfair+pool"]["tenants"]["tenant_pinned"]
    assert alone["replicas"] == [0]
    assert 0.45 <= alone["of_max_min"] <= 0.55
    assert shared["of_max_min"] >= 0.90
    assert runs["tokenfair"]["store_calls"] == 0
    assert 0 < runs["tokenfair"]["jain_of_max_min"] < runs["tokenfair+pool"]["jain_of_max_min"]
    assert 0 < runs["tokenfair+pool"]["store_calls_per_request"] <= 0.1


def test_the_table() -> None:
    done = _run("--scenario", "pool-weights", "--replicas", "2", "--routing", "affinity")
    assert done.returncode == 0, done.stderr
    assert "pool of 2 replicas, routing affinity" in done.stdout
    assert "tokenfair+pool: store calls" in done.stdout
    assert "tenant_heavy" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routing", "skewed"], "--routing: needs --replicas"),
        (["--pinned", "x"], "--pinned: needs --replicas"),
        (["--replicas", "0"], "--replicas: must be in [1, 16] (got 0)"),
        (["--replicas", "2", "--routing", "skewed", "--pinned", "nobody"],
         "--pinned: unknown tenant 'nobody'"),
        (["--replicas", "2", "--records", "x.jsonl"], "--records and --plot are not written"),
        (["--replicas", "2", "--pool-sync-ms", "0"], "--pool-sync-ms: must be positive"),
    ],
)  # fmt: skip
def test_bad_flags_name_the_flag(args: list[str], message: str) -> None:
    done = _run("--scenario", "noisy-neighbor", *args)
    assert done.returncode == 2
    assert message in done.stderr
