"""The kind quickstart end to end (``hack/kind-demo.sh``): a kind cluster, the image built and
loaded, the chart with the demo installed, and the noisy-neighbor workload sent through the
demo's sidecar by ``tokenfair loadgen``.

Behaviour under test: the script succeeds and its loadgen report admits every request of the
workload (the lesson's 60 requests, which the ``tokenfair`` policy serves all of).

It needs docker (with a running engine), kind, kubectl and helm, and minutes; it is skipped,
with the missing piece named, wherever one of them is absent. Everything it does short of
running Pods is covered by tests/deploy/test_chart.py on the test control plane.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from repo_paths import REPO_ROOT

REPO = REPO_ROOT
SCRIPT = REPO / "hack" / "kind-demo.sh"
TOOLS = ("docker", "kind", "kubectl", "helm")
# The noisy-neighbor scenario: 18 batch + 24 chat + 18 ide requests (scenarios.noisy_neighbor).
REQUESTS = 18 + 24 + 18
TIMEOUT_S = 900


def missing_prerequisite() -> str | None:
    """Why the e2e run cannot happen here, or None."""
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"kind e2e: `{tool}` is not on PATH (needs {', '.join(TOOLS)})"
    engine = subprocess.run(["docker", "info"], capture_output=True, check=False)
    if engine.returncode != 0:
        return "kind e2e: `docker info` fails: no Docker engine is running"
    return None


def test_kind_demo_serves_the_noisy_neighbor_workload() -> None:
    reason = missing_prerequisite()
    if reason is not None:
        pytest.skip(reason)
    result = subprocess.run(
        [str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # loadgen's table names its block `live`: "live: admitted 60/60, shed 0".
    assert f"admitted {REQUESTS}/{REQUESTS}" in result.stdout, result.stdout[-4000:]
