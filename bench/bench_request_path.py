"""How many sidecar modules one request crosses: the structure figure of the request path.

Runs the sidecar in this process on the cost-model engine (the lesson's tenants and keys,
access log and metrics on, as a user runs it), sends one completion and one streamed completion
over real loopback HTTP, and follows every Python call made while each is served
(``sys.setprofile``). Prints, per request:

* the distinct ``tokenfair.server`` modules whose code ran (the files a reader must open to
  follow the request; ``server/backends/`` included) and their lines;
* of those, the ones that call into another server module (the request's spine: the files
  whose code hands it on; the others are leaves it calls and returns from);
* the returns: how often the path came back to a server module it had already left (a call
  chain A → B → A counts one);
* every ``tokenfair`` module whose Python code ran, with its lines (the compiled core's modules
  run as C and are not seen: run with ``TOKENFAIR_NATIVE=0`` to see them).

The first request of each kind warms the app and is not measured. A structure figure, not a
timing: the same tree prints the same numbers on any machine.

Usage: ``python bench/bench_request_path.py [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from aiohttp import web

from tokenfair.config import (
    PolicyConfig,
    api_key_digest,
    build_config,
)
from tokenfair.core.cost import CostModel
from tokenfair.server import create_app, make_backend
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.scenarios import LESSON_TENANTS

KEY = "sk-bench-path"
SPINE_MAX = 6
"""Issue 31's bound on the server modules a request is handed on through."""
PACKAGE = Path(sys.modules["tokenfair"].__file__ or "").parent


def package_module(filename: str) -> str | None:
    """``server/x.py`` style name of a file inside ``tokenfair``, else None."""
    path = Path(filename)
    try:
        return str(path.relative_to(PACKAGE))
    except ValueError:
        return None


class PathRecorder:
    """Records which server modules run, in order, while switched on."""

    def __init__(self) -> None:
        self.sequence: list[str] = []
        self.calls: set[tuple[str, str]] = set()
        """(caller, callee) module pairs: a server module calling into another one."""
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        name = package_module(frame.f_code.co_filename)
        if name is None:
            return
        if not self.sequence or self.sequence[-1] != name:
            self.sequence.append(name)
        caller = frame.f_back
        while caller is not None:  # the nearest tokenfair frame below (skipping asyncio, aiohttp)
            below = package_module(caller.f_code.co_filename)
            if below is not None:
                if below != name:
                    self.calls.add((below, name))
                break
            caller = caller.f_back


def summarise(sequence: list[str], calls: set[tuple[str, str]]) -> dict[str, Any]:
    server = [name for name in sequence if name.startswith("server/")]
    server = [name for i, name in enumerate(server) if i == 0 or server[i - 1] != name]
    modules = sorted(set(server))
    seen: set[str] = set()
    returns = 0
    for name in server:
        if name in seen:
            returns += 1
        seen.add(name)
    lines = {m: sum(1 for _ in (PACKAGE / m).open()) for m in sorted(set(sequence))}
    callers = sorted({a for a, b in calls if a in modules and b in modules})
    return {
        "server_modules": len(modules),
        "server_callers": callers,
        "server_lines": sum(lines[m] for m in modules),
        "server_returns": returns,
        "package_modules": len(lines),
        "per_module_lines": lines,
    }


async def measure() -> dict[str, Any]:
    tenants = [
        replace(t, api_key_sha256=(api_key_digest(KEY),)) if t.tenant_id == "tenant_chat_pro" else t
        for t in LESSON_TENANTS
    ]
    # Long wait limits: the profiler slows the event loop, and a request shed for its predicted
    # wait would not walk the path being measured.
    policy = PolicyConfig(max_interactive_wait_ms=60_000, max_batch_wait_ms=60_000)
    config = build_config(policy, tenants, "bench-path")
    settings = SidecarSettings(time_scale=0.01)
    backend = make_backend(settings, CostModel.from_policy(config.policy))
    app = create_app(settings, config, backend)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    results: dict[str, Any] = {}
    recorder = PathRecorder()
    try:
        async with aiohttp.ClientSession() as session:
            for kind, body in (
                ("whole", {"model": "m", "prompt": "def f():", "max_tokens": 8}),
                ("stream", {"model": "m", "prompt": "def f():", "max_tokens": 8, "stream": True}),
            ):
                for measured in (False, True):
                    recorder.sequence.clear()
                    recorder.calls.clear()
                    sys.setprofile(recorder)
                    recorder.on = measured
                    async with session.post(url, json=body, headers=headers) as response:
                        await response.read()
                        status = response.status
                    await asyncio.sleep(0)
                    recorder.on = False
                    sys.setprofile(None)
                    if status != 200:
                        raise SystemExit(f"request {kind} answered {status}")
                results[kind] = summarise(recorder.sequence, recorder.calls)
    finally:
        await runner.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    results = asyncio.run(measure())
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for kind, figures in results.items():
        print(
            f"{kind}: {figures['server_modules']} server modules "
            f"({figures['server_lines']} lines, {figures['server_returns']} returns to one "
            f"already left); {figures['package_modules']} tokenfair modules in all"
        )
        print(
            f"  of them {len(figures['server_callers'])} hand the request on to another server "
            f"module (the spine; issue 31: at most {SPINE_MAX}): "
            f"{', '.join(figures['server_callers'])}"
        )
        for module, lines in figures["per_module_lines"].items():
            print(f"  {module:40} {lines:5}")


if __name__ == "__main__":
    main()
