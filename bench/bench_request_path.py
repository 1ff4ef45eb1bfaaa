"""How many sidecar modules one request crosses: the structure figure of the request path.

Runs the sidecar in this process (the lesson's tenants and keys, access log and metrics on, as
a user runs it; served by aiohttp's own listener, where ``tokenfair sidecar`` adds its
connection cap, :mod:`tokenfair.server.runner`: one return more per request, no module more)
on each backend — the cost-model engine, and the ``openai`` backend relaying to a small
upstream served in the same process, with the engine's limits known (a context length per
model, as vLLM's ``/v1/models`` gives it) — sends one completion and one streamed completion
over real loopback HTTP, and follows every Python call made while each is served
(``sys.setprofile``). Prints, per backend and request:

* the distinct ``tokenfair.server`` modules whose code ran (the files a reader must open to
  follow the request; ``server/backends/`` included) and their lines: issue 31's figure, at most
  6 wanted;
* of those, the ones that call another server module (the files whose code hands the
  request on, or asks another module something: the clock included);
* the returns: how often the path came back to a server module it had already left (a call
  chain A → B → A counts one);
* every ``tokenfair`` module whose Python code ran, with its lines (the compiled core's modules
  run as C and are not seen: run with ``TOKENFAIR_NATIVE=0`` to see them).

The first request of each kind warms the app and is not measured. The profiler sees every call
the event loop makes while a request is measured, so the sidecar's periodic task (the live
fairness refresh) is switched off, and the engine's poller is off (its limits are given once):
what runs is the request's own work. A structure figure, not a timing: the same tree prints the
same numbers on any machine.

Usage: ``python bench/bench_request_path.py [--json] [--backend costmodel|openai]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from tokenfair.server.engine_state import EngineLimits
from tokenfair.server.proxy import SIDECAR
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.scenarios import LESSON_TENANTS

KEY = "sk-bench-path"
MODULES_MAX = 6
"""Issue 31's bound on the server modules one request crosses."""
BACKENDS = ("costmodel", "openai")
UPSTREAM_USAGE = {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
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


async def upstream_completions(request: web.Request) -> web.StreamResponse:
    """The upstream of the ``openai`` run: 8 tokens, whole or as an OpenAI stream with its usage
    event and ``[DONE]``."""
    body = await request.json()
    if not body.get("stream"):
        choice = {"index": 0, "text": "x" * 8, "finish_reason": "length"}
        return web.json_response({"id": "c", "choices": [choice], "usage": UPSTREAM_USAGE})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(8):
        chunk = {"id": "c", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    last = {"id": "c", "choices": [], "usage": UPSTREAM_USAGE}
    await response.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
    await response.write_eof()
    return response


async def start_site(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def measure(backend_name: str) -> dict[str, Any]:
    """The path of one whole and one streamed completion through a sidecar on ``backend_name``."""
    tenants = [
        replace(t, api_key_sha256=(api_key_digest(KEY),)) if t.tenant_id == "tenant_chat_pro" else t
        for t in LESSON_TENANTS
    ]
    # Long wait limits: the profiler slows the event loop, and a request shed for its predicted
    # wait would not walk the path being measured.
    policy = PolicyConfig(max_interactive_wait_ms=60_000, max_batch_wait_ms=60_000)
    config = build_config(policy, tenants, "bench-path")
    runners: list[web.AppRunner] = []
    settings = SidecarSettings(time_scale=0.01)
    if backend_name == "openai":
        upstream = web.Application()
        upstream.router.add_post("/v1/completions", upstream_completions)
        upstream_runner, upstream_port = await start_site(upstream)
        runners.append(upstream_runner)
        settings = SidecarSettings(
            backend="openai", upstream_url=f"http://127.0.0.1:{upstream_port}", engine_metrics="off"
        )
    backend = make_backend(settings, CostModel.from_policy(config.policy))
    app = create_app(settings, config, backend)
    sidecar = app[SIDECAR]
    sidecar.fairness.refresh_interval_s = math.inf  # its periodic task is not the request's work
    if backend_name == "openai":  # what vLLM's /v1/models says, read once (no poller running)
        sidecar.engine_link.adopt_limits(EngineLimits(max_model_len={"m": 4096}))
    runner, port = await start_site(app)
    runners.append(runner)
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
                        raise SystemExit(f"request {kind} on {backend_name} answered {status}")
                results[kind] = summarise(recorder.sequence, recorder.calls)
    finally:
        for each in reversed(runners):
            await each.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--backend", choices=BACKENDS, action="append", help="one backend (default: both)"
    )
    args = parser.parse_args()
    results = {name: asyncio.run(measure(name)) for name in args.backend or BACKENDS}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, kinds in results.items():
        for kind, figures in kinds.items():
            print(
                f"{name} {kind}: {figures['server_modules']} server modules (issue 31: at most "
                f"{MODULES_MAX}; {figures['server_lines']} lines, {figures['server_returns']} "
                f"returns to one already left); {figures['package_modules']} tokenfair modules "
                "in all"
            )
            print(
                f"  of them {len(figures['server_callers'])} call another server module: "
                f"{', '.join(figures['server_callers'])}"
            )
            for module, lines in figures["per_module_lines"].items():
                print(f"  {module:40} {lines:5}")


if __name__ == "__main__":
    main()
