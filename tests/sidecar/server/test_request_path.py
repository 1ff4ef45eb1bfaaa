"""The request's path as a reader follows it: ``bench/bench_request_path.py``'s structure figure.

The bench serves one completion and one streamed completion over loopback HTTP, on the
cost-model engine and on the ``openai`` backend (an upstream in the same process, the engine's
limits known), and records every Python call made meanwhile (``sys.setprofile``; the sidecar's
periodic task switched off, so only the request's own work runs). A structure figure, not a
timing: the same tree gives the same sets on any machine. The test holds the figures where the
last pass left them (``bench/README.md``), so a change that puts more modules on the path has
to say so; issue 31's bound (6 modules) is not met.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from repo_paths import REPO_ROOT

MOST_CROSSED = {"costmodel": 16, "openai": 18}
"""Server modules whose code runs while one request is served, per backend, at most."""
MOST_CALLING = {"costmodel": 7, "openai": 9}
"""Of those, the ones that call another server module, at most."""


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


def test_a_request_crosses_no_more_server_modules_than_the_last_pass_left() -> None:
    figures = _measure()
    assert set(figures) == set(MOST_CROSSED)
    for backend, kinds in figures.items():
        assert set(kinds) == {"whole", "stream"}
        for kind, path in kinds.items():
            crossed = {name for name in path["per_module_lines"] if name.startswith("server/")}
            assert len(crossed) == path["server_modules"]
            assert path["server_modules"] <= MOST_CROSSED[backend], (backend, kind, crossed)
            assert len(path["server_callers"]) <= MOST_CALLING[backend], (backend, kind)
            # The factory builds and tears down; the proxy app's middleware is proxy.py's.
            assert "server/app.py" not in crossed, (backend, kind)
            assert {"server/proxy.py", "server/lifecycle.py", "server/dispatcher.py"} <= crossed
