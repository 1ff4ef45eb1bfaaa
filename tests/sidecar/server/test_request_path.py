"""The request's path as a reader follows it: ``bench/bench_request_path.py``'s structure figure.

The bench serves one completion and one streamed completion over loopback HTTP and records every
Python call (``sys.setprofile``). Its *spine* is the server modules that hand the request on to
another server module (the files a reader follows the request through; the others are leaves
it calls and returns from). A structure figure, not a timing: the same tree gives the same sets
on any machine, so the test pins them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from repo_paths import REPO_ROOT

SPINE_MAX = 6
"""Issue 31's bound on the modules a request crosses, read as its spine."""
SPINE = {
    "server/proxy.py",
    "server/lifecycle.py",
    "server/dispatcher.py",
    "server/outcomes.py",
    "server/backends/base.py",
    "server/backends/costmodel.py",
}
"""The route handler, the request's owner, the real-time driver of the core, the outcome sink,
and the backend (the cost-model engine writing through its call's writer)."""
LEAVES = {"server/ratelimit.py", "server/engine_link.py", "server/kv_view.py", "server/clock.py"}
"""Modules the request calls and returns from, handing nothing on (``ratelimit`` takes the
model time from its caller; the KV view learns a request's end itself)."""


def _measure() -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_request_path.py"), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "TOKENFAIR_NATIVE": "0"},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    figures: dict[str, Any] = json.loads(completed.stdout)
    return figures


def test_a_request_is_handed_on_through_six_server_modules_at_most() -> None:
    figures = _measure()
    assert set(figures) == {"whole", "stream"}
    for kind, path in figures.items():
        spine = set(path["server_callers"])
        assert spine == SPINE, (kind, sorted(spine))
        assert len(spine) <= SPINE_MAX
        crossed = set(path["per_module_lines"])
        assert not spine & LEAVES
        assert {"server/ratelimit.py", "server/clock.py"} <= crossed  # leaves, still run
        assert "server/app.py" not in crossed, kind  # the factory: no request runs through it
