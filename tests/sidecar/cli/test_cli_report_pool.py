"""``tokenfair report`` over several replicas' records (``--records`` repeated, one file per
replica): each policy's fairness over all of them, and a ``pool`` block per policy with each
tenant's service against its weighted max-min share constrained by where its requests arrived
(``sim/pool_maxmin.pool_shares``). Replayed per replica (each its own serial server, no pool):
a tenant whose requests all reached replica 0 of 2, against a flooder on both, gets about half
of its share; ``--plot`` with several files is refused naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenfair.records.codec import encode_decision
from tokenfair.sim.scenarios import pool_skewed
from tokenfair.sim.simulator import simulate

TOKENFAIR = Path(sys.executable).parent / "tokenfair"


def _records(tmp_path: Path) -> list[Path]:
    config, requests = pool_skewed(4_000)
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    flood = [r for r in ordered if r.tenant_id == "tenant_flood"]
    routed = [
        [r for r in ordered if r.tenant_id == "tenant_pinned"] + flood[0::2],
        flood[1::2],
    ]
    paths = []
    for index, requests_here in enumerate(routed):
        path = tmp_path / f"replica-{index}.jsonl"
        decisions = simulate(config, requests_here, "tokenfair")
        path.write_bytes(b"".join(encode_decision(d, "tokenfair") for d in decisions))
        paths.append(path)
    return paths


def test_the_pool_block_over_two_replicas(tmp_path: Path) -> None:
    first, second = _records(tmp_path)
    done = subprocess.run(
        [str(TOKENFAIR), "report", "--records", str(first), "--records", str(second),
         "--format", "json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["records"] == [str(first), str(second)]
    pool = document["pool"]["tokenfair"]
    pinned = pool["tenants"]["tenant_pinned"]
    flood = pool["tenants"]["tenant_flood"]
    assert pinned["replicas"] == [0]
    assert flood["replicas"] == [0, 1]
    assert 0.4 <= pinned["of_max_min"] <= 0.6  # per replica: half of replica 0
    assert flood["of_max_min"] > 1.0
    assert 0 < pool["jain_of_max_min"] < 0.95
    table = subprocess.run(
        [str(TOKENFAIR), "report", "--records", str(first), "--records", str(second)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "pool-wide, against the max-min share constrained by where requests arrived" in table


def test_plot_with_several_files_is_refused(tmp_path: Path) -> None:
    first, second = _records(tmp_path)
    done = subprocess.run(
        [str(TOKENFAIR), "report", "--records", str(first), "--records", str(second),
         "--plot", str(tmp_path / "x.png")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--plot: one --records file only" in done.stderr


def test_one_file_reports_as_before(tmp_path: Path) -> None:
    first, _ = _records(tmp_path)
    done = subprocess.run(
        [str(TOKENFAIR), "report", "--records", str(first), "--format", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    document = json.loads(done.stdout)
    assert document["records"] == str(first)
    assert "pool" not in document
