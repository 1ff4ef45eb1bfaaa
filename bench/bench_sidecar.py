"""The sidecar's cost per request, against a fast stub upstream, in one run (see bench/README.md).

Targets behind the same nginx stub on loopback, each loaded by ``wrk`` (pinned to core 0, with
nginx) while the proxy under test runs pinned to core 1:

* ``direct`` — wrk straight at nginx (``return 200`` JSON; a static SSE file for streams);
* ``minimal`` — a minimal aiohttp pass-through proxy (one pooled ``ClientSession``, no parsing,
  streamed relay): the baseline every ratio is taken against; it is this file, run as
  ``passthrough LISTEN UPSTREAM aiohttp``;
* ``passthru-tf`` — the same relay over the sidecar's own upstream client
  (``passthrough LISTEN UPSTREAM tokenfair``): not a target, it isolates the sidecar's logic;
* ``sidecar`` — ``tokenfair sidecar --backend openai`` as a user runs it: the JSON access log
  on stdout, metrics, no records (auth, body parse, estimate, admission, lanes/DRR,
  settlement), budgets and bounds so large that nothing is refused;
* ``sidecar+rec`` — the same with request records (``--records``);
* ``sidecar-nolog`` — the same as ``sidecar`` with ``--access-log off``: the access log's share
  of the sidecar's CPU is ``1 - nolog / sidecar``.

Measured per target: requests/s at 64 connections (non-streaming chat, a ~1 KB prompt),
streamed responses/s at 128 concurrent streams, median latency at one connection, and the
proxy's CPU per request (``utime + stime`` from ``/proc/PID/stat`` over the run, divided by
wrk's request count). Then a second sidecar (defaults) with a tiny budget and queue bound takes
10x the connections for the same time: its RSS before and after must stay flat (bounded
queues). Every process started here is killed in ``finally:``; everything listens on
127.0.0.1.

Each measurement runs 3 rounds interleaved over the targets; a figure is the target's best round.
``--instructions`` instead counts instructions per request of each proxy under callgrind (the
figure to trust on a loaded machine): per chat request and per streamed request (the SSE stream
above), each load counted on its own, net of what the proxy executes idle (its timers: counted
as long again with no load). It still moves with the request rate the proxy reaches under
callgrind: at a lower rate the event loop handles fewer requests per wake-up (and the access
log writes fewer lines per batch), so compare runs whose request counts are alike.

    .venv/bin/python bench/bench_sidecar.py                 # 3 rounds of 10 s (~10 min)
    .venv/bin/python bench/bench_sidecar.py --quick         # 1 round of 3 s (~2 min)
    .venv/bin/python bench/bench_sidecar.py --instructions  # callgrind (~5 min)
    .venv/bin/python bench/bench_sidecar.py --instructions --uvloop  # + both on uvloop

``--uvloop`` (uvloop installed in the venv; not a dependency) adds ``minimal-uv`` and
``sidecar-uv``: the same minimal proxy and sidecar (defaults) on uvloop's event loop, printed
against the minimal proxy on asyncio and on uvloop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
VENV_BIN: Final = ROOT / ".venv" / "bin"
LOAD_CORE: Final = "0"
"""wrk and nginx run here."""
PROXY_CORE: Final = "1"
"""The proxy under test runs here, alone."""
CONNECTIONS: Final = 64
STREAMS: Final = 128
OVERLOAD_FACTOR: Final = 10
BENCH_KEY: Final = "sk-bench-key"
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")

TARGETS: Final = {
    "c64 throughput x minimal": (">=", 1.2),
    "cpu per request x minimal": ("<=", 0.8),
    "streams128 x minimal": (">=", 1.2),
    "c1 added p50 over minimal ms": ("<=", 0.0),
    "access log share of cpu": ("<=", 0.10),
}
"""Issue 34's targets, each a ratio against the minimal aiohttp proxy in the same run (the
access log's share: the sidecar's CPU per request with it on, minus off, over on)."""
OVERLOAD_GROWTH_MIB: Final = 2.0
"""Most the overloaded sidecar's RSS may grow over the second half of its run ("flat")."""
PROMPT_BYTES: Final = 1024

COMPLETION_JSON: Final = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 1764400000,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The quick brown fox jumps over it."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    },
    separators=(",", ":"),
)
SSE_EVENTS: Final = 64
"""Token events per streamed response (plus the usage event and ``[DONE]``): ~9 KiB."""

_PROMPT: Final = ("Say something short about foxes, please. " * 30)[:PROMPT_BYTES]
CHAT_BODY: Final = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": _PROMPT}], "max_tokens": 16},
    separators=(",", ":"),
)
"""A chat request with a ~1 KB prompt (the issue's workload)."""
# No stream_options: the sidecar must add include_usage itself (the common client).
STREAM_BODY: Final = json.dumps(
    {"model": "bench", "prompt": "Count to sixty-four, slowly.", "max_tokens": 64, "stream": True},
    separators=(",", ":"),
)


def sse_document() -> str:
    """A ``/v1/completions`` stream: many small token events, a usage event, ``[DONE]``."""
    events = []
    for i in range(SSE_EVENTS):
        chunk = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1764400000,
            "model": "bench",
            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
        }
        events.append("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n")
    usage = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1764400000,
        "model": "bench",
        "choices": [],
        "usage": {"prompt_tokens": 7, "completion_tokens": SSE_EVENTS, "total_tokens": 71},
    }
    events.append("data: " + json.dumps(usage, separators=(",", ":")) + "\n\n")
    events.append("data: [DONE]\n\n")
    return "".join(events)


NGINX_CONF: Final = """\
worker_processes 1;
error_log {dir}/nginx-error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/nginx-body;
    proxy_temp_path {dir}/nginx-proxy;
    fastcgi_temp_path {dir}/nginx-fastcgi;
    uwsgi_temp_path {dir}/nginx-uwsgi;
    scgi_temp_path {dir}/nginx-scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    server {{
        listen 127.0.0.1:{port};
        location = /v1/chat/completions {{
            default_type application/json;
            return 200 '{completion}';
        }}
        # A static file answers GET only: turn the POST's 405 into the file itself.
        location = /v1/completions {{
            if ($http_x_bench_pace) {{ rewrite ^ /paced/v1/completions last; }}
            root {dir}/www;
            default_type text/event-stream;
            error_page 405 =200 $uri;
        }}
        # The same stream paced like a model's tokens: 512-byte writes at 32 KB/s, ~20 pieces
        # ~16 ms apart, so the proxies relay each piece on its own.
        location = /paced/v1/completions {{
            internal;
            root {dir}/www;
            default_type text/event-stream;
            error_page 405 =200 $uri;
            sendfile off;
            output_buffers 1 {pace_bytes};
            limit_rate {pace_rate};
        }}
    }}
}}
"""

WRK_LUA: Final = """\
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""
PACE_HEADER: Final = "x-bench-pace"
"""Asks nginx for the paced stream; the proxies forward it."""
PACE_BYTES: Final = 512
PACE_RATE: Final = "32k"


def _config_yaml(*, overload: bool) -> str:
    """A sidecar config with one interactive tenant keyed by :data:`BENCH_KEY`.

    Normal: KV, budget, wait limits and queue bounds far beyond anything a 10 s run reaches, so
    every request is admitted and dispatched at once. Overload: a budget of 2000 service tokens
    per second (a chat request with its ~1 KB prompt costs a few hundred, so a few requests/s
    are admitted) and a queue bound of 8: nearly every request is refused ``429`` at once.
    """
    import hashlib

    digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
    if overload:
        burst, sustained, queued = 2000, 2000, 8
    else:
        burst, sustained, queued = 10**12, 10**12, 100_000
    return f"""\
apiVersion: tokenfair.io/v1alpha1
kind: TokenfairConfig
version: bench-{"overload" if overload else "open"}
sidecar:
  maxInFlight: 1024
policy:
  totalKvBlocks: 1000000000
  maxInteractiveWaitMs: 3600000
  maxBatchWaitMs: 3600000
  serviceTokensPerMs: 1000000000
  maxQueuedRequests: {queued}
  maxQueuedRequestsPerTenant: {queued}
tenants:
  - tenantId: bench
    weight: 1
    burstServiceTokens: {burst}
    sustainedServiceTokensPerSecond: {sustained}
    priorityClass: interactive
    apiKeySha256: ["{digest}"]
"""


# -- the minimal pass-through proxy ---------------------------------------------------------------


def run_passthrough(listen: str, upstream: str, client: str, loop: str = "asyncio") -> None:
    """Relay every request to ``upstream``: body and response as bytes, SSE chunk by chunk, no
    parsing. ``client``: ``aiohttp`` (one pooled ``ClientSession``: the issue's ceiling for
    Python) or ``tokenfair`` (the sidecar's own upstream client, to isolate the sidecar's logic).
    ``loop``: ``asyncio`` or ``uvloop`` (the event loop it runs on)."""
    import asyncio

    from aiohttp import ClientSession, TCPConnector, web

    if loop == "uvloop":
        import importlib

        # Imported by name: not a dependency, so no stubs where it is not installed.
        uvloop = importlib.import_module("uvloop")
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    from tokenfair.server.upstream import UpstreamClient

    def _forwarded(request: web.Request) -> dict[str, str]:
        """Content-Type, and the bench's pace header when present: nothing else is parsed."""
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        pace = request.headers.get(PACE_HEADER)
        if pace is not None:
            headers[PACE_HEADER] = pace
        return headers

    async def relay_aiohttp(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session: ClientSession = request.app["session"]
        async with session.post(
            upstream + request.path_qs, data=body, headers=_forwarded(request)
        ) as upstream_response:
            content_type = upstream_response.headers.get("Content-Type", "")
            if content_type.startswith("text/event-stream"):
                response = web.StreamResponse(
                    status=upstream_response.status, headers={"Content-Type": content_type}
                )
                await response.prepare(request)
                async for chunk in upstream_response.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
            data = await upstream_response.read()
            return web.Response(
                body=data, status=upstream_response.status, headers={"Content-Type": content_type}
            )

    async def relay_tokenfair(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        pool: UpstreamClient = request.app["pool"]
        answer = await pool.request(
            "POST", request.raw_path, list(_forwarded(request).items()), body
        )
        try:
            content_type = next(
                (value for name, value in answer.headers if name.lower() == "content-type"), ""
            )
            if content_type.startswith("text/event-stream"):
                response = web.StreamResponse(
                    status=answer.status, headers={"Content-Type": content_type}
                )
                await response.prepare(request)
                while chunk := await answer.next_chunk():
                    await response.write(chunk)
                await response.write_eof()
                return response
            data = await answer.read()
            return web.Response(
                body=data, status=answer.status, headers={"Content-Type": content_type}
            )
        finally:
            answer.release()

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        if client == "aiohttp":
            app["session"] = ClientSession(connector=TCPConnector(limit=0))
            yield
            await app["session"].close()
        else:
            app["pool"] = UpstreamClient(upstream, connect_timeout_s=5.0, read_timeout_s=60.0)
            yield
            await app["pool"].close()

    app = web.Application()
    app.cleanup_ctx.append(upstream_ctx)
    relay = relay_aiohttp if client == "aiohttp" else relay_tokenfair
    app.router.add_route("*", "/{tail:.*}", relay)
    host, _, port = listen.rpartition(":")
    web.run_app(app, host=host, port=int(port), access_log=None, print=None)


# -- processes ------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all bound at once, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_http(url: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers (404, 405: fine)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up in {timeout_s} s") from None
            time.sleep(0.05)


class Processes:
    """Every process the bench starts; :meth:`stop_all` kills them (called in ``finally:``)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as handle:
            proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT)
        return self.adopt(proc)

    def adopt(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self._procs):
            self.stop(proc)


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- wrk ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    requests_per_s: float
    p50_ms: float
    non_2xx: int
    socket_errors: int


_UNITS_MS: Final = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _duration_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def parse_wrk(output: str) -> WrkResult:
    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"^\s+50%\s+(\S+)", output, re.MULTILINE)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    return WrkResult(
        requests,
        rate,
        _duration_ms(p50.group(1)) if p50 else float("nan"),
        int(non_2xx.group(1)) if non_2xx else 0,
        sum(int(g) for g in errors.groups()) if errors else 0,
    )


def run_wrk(url: str, lua: Path, connections: int, duration_s: float) -> WrkResult:
    seconds = max(1, round(duration_s))  # wrk takes whole seconds
    argv = ["taskset", "-c", LOAD_CORE, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s",
            "--latency", "--timeout", "10s", "-s", str(lua), url]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=duration_s + 30)
    if os.environ.get("BENCH_WRK_OUTPUT"):
        print(" ".join(argv), done.stdout, sep="\n", flush=True)
    return parse_wrk(done.stdout)


@dataclass(frozen=True, slots=True)
class Measured:
    wrk: WrkResult
    cpu_us_per_request: float | None


def measure(url: str, lua: Path, connections: int, duration_s: float, pid: int | None) -> Measured:
    """A 1 s warm-up, then the timed run; CPU of ``pid`` over the timed run only."""
    run_wrk(url, lua, connections, 1.0)
    before = cpu_ticks(pid) if pid is not None else 0
    result = run_wrk(url, lua, connections, duration_s)
    cpu = None
    if pid is not None and result.requests:
        cpu = (cpu_ticks(pid) - before) / CLK_TCK * 1e6 / result.requests
    return Measured(result, cpu)


# -- the run --------------------------------------------------------------------------------------


def check_tools(*, valgrind: bool = False) -> None:
    tools = ("nginx", "wrk", "taskset", *(("valgrind", "callgrind_control") if valgrind else ()))
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        sys.exit(
            f"missing: {', '.join(missing)}. Install them (Debian, as root):\n"
            "    apt-get update && apt-get install -y nginx-light wrk util-linux valgrind"
        )
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs 2 cores (wrk pinned to core 0, the proxy under test to core 1)")


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokenfair-bench-") as name:
        yield Path(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per measurement instead of 10")
    parser.add_argument("--duration", type=float, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, help="rounds over the targets (3; --quick: 1)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instead: instructions per request of each proxy under callgrind (valgrind)",
    )
    parser.add_argument(
        "--base-path",
        type=Path,
        metavar="DIR",
        help="another checkout (e.g. git archive of a base commit): its sidecar runs too, as "
        "base and base-nolog, in the same run",
    )
    parser.add_argument(
        "--uvloop",
        action="store_true",
        help="also the minimal proxy and the sidecar on uvloop (minimal-uv, sidecar-uv)",
    )
    args = parser.parse_args(argv)
    duration_s = args.duration or (3.0 if args.quick else 10.0)
    rounds_n = args.rounds or (1 if args.quick else 3)
    check_tools(valgrind=args.instructions)
    if args.uvloop and importlib.util.find_spec("uvloop") is None:
        sys.exit("--uvloop: uvloop is not installed here (.venv/bin/pip install uvloop)")
    procs = Processes()
    with workdir() as tmp:
        try:
            variants = _variants(args.base_path, args.uvloop)
            if args.instructions:
                return _instructions(tmp, procs, variants, args.uvloop)
            return _run(tmp, procs, duration_s, rounds_n, variants, args.uvloop)
        finally:
            procs.stop_all()


@dataclass(frozen=True, slots=True)
class Stage:
    """The files of a run in its temp dir, and nginx's URL."""

    upstream: str
    chat_lua: Path
    stream_lua: Path
    paced_lua: Path


def _stage(tmp: Path, procs: Processes, nginx_port: int) -> Stage:
    """Write nginx's config and files, the wrk scripts and the sidecar configs; start nginx."""
    tmp.chmod(0o755)  # nginx's workers (not root) read the SSE file under it
    (tmp / "www" / "v1").mkdir(parents=True)
    (tmp / "www" / "v1" / "completions").write_text(sse_document())
    (tmp / "www" / "paced" / "v1").mkdir(parents=True)
    (tmp / "www" / "paced" / "v1" / "completions").write_text(sse_document())
    (tmp / "nginx.conf").write_text(
        NGINX_CONF.format(dir=tmp, port=nginx_port, completion=COMPLETION_JSON,
                          pace_bytes=PACE_BYTES, pace_rate=PACE_RATE)
    )  # fmt: skip
    chat_lua, stream_lua, paced_lua = tmp / "chat.lua", tmp / "stream.lua", tmp / "paced.lua"
    chat_lua.write_text(WRK_LUA.format(body=CHAT_BODY, key=BENCH_KEY))
    stream_lua.write_text(WRK_LUA.format(body=STREAM_BODY, key=BENCH_KEY))
    paced_lua.write_text(
        WRK_LUA.format(body=STREAM_BODY, key=BENCH_KEY) + f'wrk.headers["{PACE_HEADER}"] = "1"\n'
    )
    (tmp / "open.yaml").write_text(_config_yaml(overload=False))
    (tmp / "overload.yaml").write_text(_config_yaml(overload=True))
    upstream = f"http://127.0.0.1:{nginx_port}"
    procs.start(["taskset", "-c", LOAD_CORE, "nginx", "-p", str(tmp), "-c",
                 str(tmp / "nginx.conf"), "-g", "daemon off;"], tmp / "nginx.log")  # fmt: skip
    wait_http(upstream + "/v1/chat/completions")
    return Stage(upstream, chat_lua, stream_lua, paced_lua)


SIDECAR_VARIANTS: Final = {
    "sidecar": [],
    "sidecar+rec": ["--records", "{tmp}/records-{name}.jsonl"],
    "sidecar-nolog": ["--access-log", "off"],
}
"""The sidecars measured, each with the defaults a user runs (JSON access log on stdout,
metrics) plus these flags."""
NOLOG: Final = {"sidecar": "sidecar-nolog", "sidecar+rec": "sidecar-nolog", "base": "base-nolog"}
"""The same sidecar with the access log off (the access log's share of CPU: 1 - off / on)."""


@dataclass(frozen=True, slots=True)
class Variant:
    flags: list[str]
    pythonpath: str | None = None
    """``PYTHONPATH`` of a base checkout's ``sidecar/`` (None: this one)."""
    loop: str = "asyncio"
    """The event loop the sidecar runs on: ``asyncio`` or ``uvloop``."""


UVLOOP_LAUNCH: Final = (
    "import asyncio, sys, uvloop; asyncio.set_event_loop_policy(uvloop.EventLoopPolicy()); "
    "from tokenfair.cli import console; sys.exit(console())"
)
"""``python -c`` this, then the sidecar's arguments: the sidecar on uvloop."""


def _sidecar_command(loop: str) -> list[str]:
    """The command that runs ``tokenfair`` on ``loop`` (its arguments follow)."""
    python = str(VENV_BIN / "python")
    if loop == "uvloop":
        return [python, "-c", UVLOOP_LAUNCH]
    return [python, str(VENV_BIN / "tokenfair")]


def _variants(base_path: Path | None, uvloop: bool = False) -> dict[str, Variant]:
    variants = {name: Variant(flags) for name, flags in SIDECAR_VARIANTS.items()}
    if uvloop:
        variants["sidecar-uv"] = Variant([], loop="uvloop")
    if base_path is not None:
        sidecar_dir = base_path / "sidecar" if (base_path / "sidecar").is_dir() else base_path
        if not (sidecar_dir / "tokenfair").is_dir():
            sys.exit(f"--base-path: no tokenfair package under {base_path}")
        variants["base"] = Variant([], str(sidecar_dir.resolve()))
        variants["base-nolog"] = Variant(["--access-log", "off"], str(sidecar_dir.resolve()))
    return variants


def _run(
    tmp: Path,
    procs: Processes,
    duration_s: float,
    rounds_n: int,
    variants: dict[str, Variant],
    uvloop: bool = False,
) -> int:
    python = str(VENV_BIN / "python")
    nginx_port, pass_port, pass_tf_port, pass_uv_port, *ports = free_ports(4 + 2 * len(variants))
    stage = _stage(tmp, procs, nginx_port)
    upstream, chat_lua, stream_lua = stage.upstream, stage.chat_lua, stage.stream_lua
    load_start = loadavg()
    print(f"python {sys.version.split()[0]}, {duration_s:g} s per measurement, "
          f"{rounds_n} round(s), "
          f"wrk + nginx on core {LOAD_CORE}, proxy on core {PROXY_CORE}; "
          f"load average at start {load_start}", flush=True)  # fmt: skip

    passthrough = procs.start(
        ["taskset", "-c", PROXY_CORE, python, __file__, "passthrough",
         f"127.0.0.1:{pass_port}", upstream, "aiohttp"],
        tmp / "passthrough.log",
    )  # fmt: skip
    passthrough_tf = procs.start(
        ["taskset", "-c", PROXY_CORE, python, __file__, "passthrough",
         f"127.0.0.1:{pass_tf_port}", upstream, "tokenfair"],
        tmp / "passthrough-tf.log",
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{pass_port}/")
    wait_http(f"http://127.0.0.1:{pass_tf_port}/")
    targets: dict[str, tuple[str, int | None]] = {
        "direct": (upstream, None),
        "minimal": (f"http://127.0.0.1:{pass_port}", passthrough.pid),
        "passthru-tf": (f"http://127.0.0.1:{pass_tf_port}", passthrough_tf.pid),
    }
    passthroughs = [passthrough, passthrough_tf]
    if uvloop:
        passthrough_uv = procs.start(
            ["taskset", "-c", PROXY_CORE, python, __file__, "passthrough",
             f"127.0.0.1:{pass_uv_port}", upstream, "aiohttp", "uvloop"],
            tmp / "passthrough-uv.log",
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{pass_uv_port}/")
        targets["minimal-uv"] = (f"http://127.0.0.1:{pass_uv_port}", passthrough_uv.pid)
        passthroughs.append(passthrough_uv)
    sidecars: dict[str, subprocess.Popen[bytes]] = {}
    for index, (name, variant) in enumerate(variants.items()):
        port, admin_port = ports[2 * index], ports[2 * index + 1]
        extra = [flag.format(tmp=tmp, name=name) for flag in variant.flags]
        sidecars[name] = _start_sidecar(procs, tmp, "open", upstream, port, admin_port, name,
                                        extra, variant.pythonpath, variant.loop)  # fmt: skip
        _check_sidecar_answers(port)
        targets[name] = (f"http://127.0.0.1:{port}", sidecars[name].pid)
    paced_targets = ("minimal", "passthru-tf", "sidecar", "minimal-uv", "sidecar-uv")
    """The paced stream (3 s of 128 slow streams) measures CPU per relayed piece: the baseline,
    the same-client relay and the sidecar only."""

    # Rounds interleave the targets, so a burst of load from elsewhere on the machine hits one
    # round of each rather than all of one target; each figure is the target's best round (the
    # least disturbed by the rest of the machine).
    rounds: dict[str, dict[str, list[Measured]]] = {
        name: {"chat": [], "stream": [], "paced": [], "latency": []} for name in targets
    }
    for round_index in range(rounds_n):
        for name, (base, pid) in targets.items():
            runs = rounds[name]
            chat_url, stream_url = base + "/v1/chat/completions", base + "/v1/completions"
            runs["chat"].append(measure(chat_url, chat_lua, CONNECTIONS, duration_s, pid))
            runs["stream"].append(measure(stream_url, stream_lua, STREAMS, duration_s, pid))
            if name in paced_targets:
                runs["paced"].append(measure(stream_url, stage.paced_lua, STREAMS, duration_s, pid))
            runs["latency"].append(measure(chat_url, chat_lua, 1, duration_s, pid))
        print(f"  round {round_index + 1}/{rounds_n} done (load average {loadavg()})", flush=True)
    results = {name: _best(runs) for name, runs in rounds.items()}
    peak_rss_kib = {name: status_kib(proc.pid, "VmHWM") for name, proc in sidecars.items()}
    records = sum(1 for _ in (tmp / "records-sidecar+rec.jsonl").open())
    access_lines = sum(1 for _ in (tmp / "sidecar-sidecar.log").open())
    for proc in (*sidecars.values(), *passthroughs):
        procs.stop(proc)

    overload_port, overload_admin = free_ports(2)
    overloaded = _start_sidecar(procs, tmp, "overload", upstream, overload_port, overload_admin,
                                "overload", [])  # fmt: skip
    _check_sidecar_answers(overload_port)
    overload_url = f"http://127.0.0.1:{overload_port}/v1/chat/completions"
    run_wrk(overload_url, chat_lua, CONNECTIONS, 1.0)
    # Two halves: the first grows the heap to hold 640 connections; the second must not grow it
    # further (queues and budgets are bounded, refusals are answered and forgotten).
    rss_kib = [status_kib(overloaded.pid, "VmRSS")]
    halves = []
    for _ in range(2):
        overload_connections = CONNECTIONS * OVERLOAD_FACTOR
        halves.append(run_wrk(overload_url, chat_lua, overload_connections, duration_s / 2))
        rss_kib.append(status_kib(overloaded.pid, "VmRSS"))
    overload_hwm_kib = status_kib(overloaded.pid, "VmHWM")
    overload = WrkResult(
        sum(h.requests for h in halves),
        sum(h.requests_per_s for h in halves) / 2,
        float("nan"),
        sum(h.non_2xx for h in halves),
        sum(h.socket_errors for h in halves),
    )
    load_end = loadavg()
    _report(results, records, access_lines, list(variants))
    for name in targets:
        if name == "direct":
            continue
        spread = ", ".join(
            f"{kind} {' / '.join(_us(m.cpu_us_per_request) for m in rounds[name][kind])}"
            for kind in ("chat", "stream", "paced")
            if rounds[name][kind]
        )
        print(f"  {name} cpu us per request, every round: {spread}")
    peaks = ", ".join(f"{name} {kib / 1024:.1f}" for name, kib in peak_rss_kib.items())
    print(f"  peak RSS (VmHWM) MiB: {peaks}")
    print(f"\n10x overload ({CONNECTIONS * OVERLOAD_FACTOR} connections, {duration_s:g} s; "
          "budget 2000 service tokens/s, queue bound 8):")  # fmt: skip
    print(f"  requests {overload.requests}, {overload.requests_per_s:.0f}/s, refused (non-2xx) "
          f"{overload.non_2xx} ({100 * overload.non_2xx / max(1, overload.requests):.1f} %), "
          f"socket errors {overload.socket_errors}")  # fmt: skip
    before, middle, after = (kib / 1024 for kib in rss_kib)
    growth = after - middle
    print(f"  sidecar RSS before {before:.1f} MiB, after the first half {middle:.1f} MiB, after "
          f"the second {after:.1f} MiB (second half {growth:+.1f} MiB, target <= "
          f"{OVERLOAD_GROWTH_MIB:g}: {'met' if growth <= OVERLOAD_GROWTH_MIB else 'NOT met'}), "
          f"VmHWM {overload_hwm_kib / 1024:.1f} MiB")  # fmt: skip
    print(f"\nload average at start {load_start}, at end {load_end}")
    return 0


# -- instruction counts (callgrind) ---------------------------------------------------------------

CALLGRIND_CONNECTIONS: Final = 8
CALLGRIND_SECONDS: Final = 10
CALLGRIND_SETTLE_S: Final = 3
"""After a timed run, before the idle count: the requests still in flight finish."""


def _instructions(
    tmp: Path, procs: Processes, variants: dict[str, Variant], uvloop: bool = False
) -> int:
    """Instructions per chat request of each proxy under callgrind: repeatable whatever else the
    machine does (the proxy runs ~50x slower, so throughput and latency mean nothing here)."""
    python = str(VENV_BIN / "python")
    nginx_port, port, admin_port = free_ports(3)
    stage = _stage(tmp, procs, nginx_port)
    listen = f"127.0.0.1:{port}"
    sidecar = ["sidecar", "--config", str(tmp / "open.yaml"),
               "--backend", "openai", "--upstream", stage.upstream, "--listen", listen,
               "--admin-listen", f"127.0.0.1:{admin_port}", "--log-level", "WARNING",
               # The engine poller's 4 reads a second are per time, not per request: under
               # callgrind (~10 requests/s) they would count as ~1/3 of a request's work.
               "--engine-metrics", "off"]  # fmt: skip
    proxies: dict[str, tuple[list[str], str | None]] = {
        "minimal": ([python, __file__, "passthrough", listen, stage.upstream, "aiohttp"], None),
        "passthru-tf": ([python, __file__, "passthrough", listen, stage.upstream, "tokenfair"],
                        None),
        **({"minimal-uv": ([python, __file__, "passthrough", listen, stage.upstream, "aiohttp",
                            "uvloop"], None)} if uvloop else {}),
        **{name: ([*_sidecar_command(variant.loop), *sidecar,
                   *(flag.format(tmp=tmp, name=name) for flag in variant.flags)],
                  variant.pythonpath)
           for name, variant in variants.items()},
    }  # fmt: skip
    url = f"http://{listen}/v1/chat/completions"
    stream_url = f"http://{listen}/v1/completions"
    print(f"python {sys.version.split()[0]}; instructions per chat request and per streamed "
          f"request ({SSE_EVENTS + 2} SSE events) under callgrind, wrk at "
          f"{CALLGRIND_CONNECTIONS} connections for {CALLGRIND_SECONDS} s each after a 3 s "
          "warm-up", flush=True)  # fmt: skip
    counts: dict[str, float] = {}
    stream_counts: dict[str, float] = {}
    for name, (argv, pythonpath) in proxies.items():
        out = tmp / f"callgrind.{name}"
        with (tmp / f"callgrind-{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv],
                stdout=log, stderr=subprocess.STDOUT, env=_env(pythonpath),
            )  # fmt: skip
        procs.adopt(proc)
        wait_http(f"http://{listen}/", timeout_s=900.0)
        run_wrk(url, stage.chat_lua, CALLGRIND_CONNECTIONS, 3.0)
        run_wrk(stream_url, stage.stream_lua, CALLGRIND_CONNECTIONS, 3.0)
        results = []
        for load_url, lua in ((url, stage.chat_lua), (stream_url, stage.stream_lua)):
            # Each load counted on its own (zeroed, run, dumped): dumps 1 (chat) and 2 (streams).
            _callgrind(proc.pid, "-z")
            results.append(run_wrk(load_url, lua, CALLGRIND_CONNECTIONS, CALLGRIND_SECONDS))
            _callgrind(proc.pid, "-d")
        # Then as long with no load: the proxy's own timers (sweeps, refreshes, flushes) cost
        # instructions per second, not per request; on a loaded machine the proxy serves fewer
        # requests in the same time and they would weigh more per request. Counted once the
        # requests still in flight when wrk stopped are done (as the warm-up's were before).
        time.sleep(CALLGRIND_SETTLE_S)
        _callgrind(proc.pid, "-z")
        time.sleep(CALLGRIND_SECONDS)
        _callgrind(proc.pid, "-d")
        procs.stop(proc)
        if any(result.non_2xx for result in results):
            raise RuntimeError(f"{name}: failed requests ({results})")
        if not all(result.requests for result in results):
            # Under callgrind on a loaded machine a proxy can be starved for the whole 10 s:
            # no figure for it, the run goes on (its ratios are left out).
            print(f"  {name:<13} no request completed in {CALLGRIND_SECONDS} s ({results}): "
                  "machine overloaded? not counted", flush=True)  # fmt: skip
            continue
        idle = _callgrind_total(tmp / f"callgrind.{name}.3")
        for kind, result, dump, into in (
            ("chat", results[0], 1, counts), ("stream", results[1], 2, stream_counts)
        ):  # fmt: skip
            loaded = _callgrind_total(tmp / f"callgrind.{name}.{dump}")
            per_request = loaded / result.requests
            into[name] = net = (loaded - idle) / result.requests
            print(f"  {name:<13} {kind:<6} {result.requests:>6} requests  {net / 1000:>8.0f}k "
                  f"instructions per request, {net / into.get('minimal', net):.2f}x minimal  (raw "
                  f"{per_request / 1000:.0f}k, idle {idle / CALLGRIND_SECONDS / 1000:.0f}k a "
                  "second)", flush=True)  # fmt: skip
    for name, base in (("sidecar", "base"), ("sidecar-nolog", "base-nolog")):
        if name in counts and base in counts:
            print(f"  {name} / {base}: chat {counts[name] / counts[base]:.3f}, streamed "
                  f"{stream_counts[name] / stream_counts[base]:.3f}")  # fmt: skip
    for name, base in (("sidecar-uv", "minimal-uv"), ("sidecar-uv", "sidecar")):
        if name in counts and base in counts:
            print(f"  {name} / {base}: {counts[name] / counts[base]:.3f}")
    op, target = TARGETS["access log share of cpu"]
    for name in ("sidecar", "base"):
        if name in counts and NOLOG[name] in counts:
            share = 1 - counts[NOLOG[name]] / counts[name]
            print(f"  access log share of {name}'s instructions: {share:.3f}  target {op} "
                  f"{target:g}  {'met' if share <= target else 'NOT met'}")  # fmt: skip
    return 0


def _callgrind(pid: int, action: str) -> None:
    """``callgrind_control ACTION PID``: ``-z`` zeroes the counters, ``-d`` dumps them."""
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)


def _callgrind_total(dump: Path) -> int:
    """The instructions a ``callgrind_control -d`` dump counted (since the last zeroing)."""
    totals = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.MULTILINE)
    if totals is None:
        raise RuntimeError(f"{dump.name}: no usable callgrind dump")
    return int(totals.group(1))


def _env(pythonpath: str | None) -> dict[str, str] | None:
    """The environment of a proxy: this one's, or with a base checkout first on the path."""
    if pythonpath is None:
        return None
    return {**os.environ, "PYTHONPATH": pythonpath}


def _start_sidecar(
    procs: Processes,
    tmp: Path,
    config: str,
    upstream: str,
    port: int,
    admin_port: int,
    name: str,
    extra: list[str],
    pythonpath: str | None = None,
    loop: str = "asyncio",
) -> subprocess.Popen[bytes]:
    """A sidecar on ``config`` (``open`` or ``overload``) with the user's defaults plus
    ``extra`` flags; its stdout (the access log) and stderr go to ``sidecar-NAME.log`` and
    ``sidecar-NAME.err``."""
    argv = ["taskset", "-c", PROXY_CORE, *_sidecar_command(loop), "sidecar",
            "--config", str(tmp / f"{config}.yaml"), "--backend", "openai", "--upstream", upstream,
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}",
            "--log-level", "WARNING", *extra]  # fmt: skip
    with (
        (tmp / f"sidecar-{name}.log").open("ab") as out,
        (tmp / f"sidecar-{name}.err").open("ab") as err,
    ):
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=_env(pythonpath))
    procs.adopt(proc)
    wait_http(f"http://127.0.0.1:{admin_port}/readyz")
    return proc


def _check_sidecar_answers(port: int) -> None:
    """One request through the sidecar must be 200 with the stub's usage (else the run is void)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=CHAT_BODY.encode(),
        headers={"Authorization": f"Bearer {BENCH_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        body = json.loads(response.read())
    if body.get("usage", {}).get("completion_tokens") != 9:
        raise RuntimeError(f"unexpected answer through the sidecar: {body}")


def _report(
    results: dict[str, dict[str, Measured]], records: int, access_lines: int, variants: list[str]
) -> None:
    print(f"\n{'target':<13} {'req/s @64':>10} {'cpu us/req':>10} {'streams/s @128':>15} "
          f"{'cpu us/stream':>13} {'p50 ms @1':>10} {'+p50 ms':>8} {'non-2xx':>8}")  # fmt: skip
    direct_p50 = results["direct"]["latency"].wrk.p50_ms
    for name, measured in results.items():
        chat, stream, latency = measured["chat"], measured["stream"], measured["latency"]
        non_2xx = sum(m.wrk.non_2xx + m.wrk.socket_errors for m in measured.values())
        print(
            f"{name:<13} {chat.wrk.requests_per_s:>10.0f} {_us(chat.cpu_us_per_request):>10} "
            f"{stream.wrk.requests_per_s:>15.0f} {_us(stream.cpu_us_per_request):>13} "
            f"{latency.wrk.p50_ms:>10.3f} {latency.wrk.p50_ms - direct_p50:>8.3f} {non_2xx:>8}"
        )
    minimal = results["minimal"]
    print(f"\nissue 34 ratios against the minimal aiohttp proxy, same run (records written: "
          f"{records}, access log lines: {access_lines}):")  # fmt: skip
    print(f"  {'':<32}" + "".join(f" {name:>13}" for name in variants) + "  target")
    ratios: dict[str, dict[str, float]] = {}
    for name in variants:
        side = results[name]
        cpu = side["chat"].cpu_us_per_request or float("nan")
        nolog = NOLOG.get(name)
        nolog_cpu = (results[nolog]["chat"].cpu_us_per_request if nolog else None) or float("nan")
        ratios[name] = {
            "c64 throughput x minimal": side["chat"].wrk.requests_per_s
            / minimal["chat"].wrk.requests_per_s,
            "cpu per request x minimal": cpu / (minimal["chat"].cpu_us_per_request or float("nan")),
            "streams128 x minimal": side["stream"].wrk.requests_per_s
            / minimal["stream"].wrk.requests_per_s,
            "c1 added p50 over minimal ms": side["latency"].wrk.p50_ms
            - minimal["latency"].wrk.p50_ms,
            "access log share of cpu": 1 - nolog_cpu / cpu,
        }
    for label, (op, target) in TARGETS.items():
        main = ratios["sidecar"][label]
        met = main >= target if op == ">=" else main <= target
        shown = "".join(f" {ratios[name][label]:>13.3f}" for name in variants).replace("nan", "  -")
        print(f"  {label:<32}{shown}  {op} {target:g} {'met' if met else 'NOT met'} (sidecar)")
    if "minimal-uv" in results and "sidecar-uv" in results:
        # Not a target: both proxies on uvloop, the sidecar's ratios against the minimal proxy on
        # the same loop (the ratios above stay against the minimal proxy on asyncio).
        side, base = results["sidecar-uv"], results["minimal-uv"]
        cpu_ratio = (side["chat"].cpu_us_per_request or float("nan")) / (
            base["chat"].cpu_us_per_request or float("nan")
        )
        print(
            f"  on uvloop, sidecar-uv against minimal-uv: c64 throughput "
            f"{side['chat'].wrk.requests_per_s / base['chat'].wrk.requests_per_s:.3f}x, "
            f"cpu per request {cpu_ratio:.3f}x, streams128 "
            f"{side['stream'].wrk.requests_per_s / base['stream'].wrk.requests_per_s:.3f}x, "
            f"c1 added p50 {side['latency'].wrk.p50_ms - base['latency'].wrk.p50_ms:+.3f} ms"
        )
    # Not a target: streams whose pieces arrive apart, as a model's tokens do (the static file
    # above usually arrives in one read); CPU per stream is what this measures (the rate is
    # nginx's pacing).
    pieces = -(-len(sse_document()) // PACE_BYTES)
    paced = {name: results[name]["paced"].cpu_us_per_request for name in results
             if "paced" in results[name]}  # fmt: skip
    if all(value is not None for value in paced.values()) and "sidecar" in paced:
        listed = ", ".join(f"{name} {cpu_us:.0f}" for name, cpu_us in paced.items())
        print(f"  paced streams (~{pieces} pieces of {PACE_BYTES} B at {PACE_RATE}B/s), cpu us "
              f"per stream: {listed}; sidecar / minimal "
              f"{paced['sidecar'] / paced['minimal']:.2f}")  # type: ignore[operator]  # fmt: skip
    # Not a target: the same minimal relay over the sidecar's own upstream client, so the
    # difference is what the sidecar's logic (auth, parse, admission, settlement, ...) costs.
    same, side = results["passthru-tf"], results["sidecar"]
    print("  the sidecar's own work (sidecar minus passthru-tf, same upstream client):")
    for kind, unit in (("chat", "request"), ("stream", "stream")):
        side_cpu, same_cpu = side[kind].cpu_us_per_request, same[kind].cpu_us_per_request
        if side_cpu is not None and same_cpu is not None:
            ratio = side[kind].wrk.requests_per_s / same[kind].wrk.requests_per_s
            print(f"    {kind:<6} +{side_cpu - same_cpu:.0f} us CPU per {unit}, "
                  f"{ratio:.2f}x its throughput")  # fmt: skip


def _best(runs: dict[str, list[Measured]]) -> dict[str, Measured]:
    """Per kind, the best of the rounds: the most requests/s (latency: the lowest median) and,
    separately, the least CPU per request."""
    best: dict[str, Measured] = {}
    for kind, measured in runs.items():
        if not measured:
            continue
        if kind == "latency":
            wrk = min(measured, key=lambda m: m.wrk.p50_ms).wrk
        else:
            wrk = max(measured, key=lambda m: m.wrk.requests_per_s).wrk
        cpus = [m.cpu_us_per_request for m in measured if m.cpu_us_per_request is not None]
        best[kind] = Measured(wrk, min(cpus) if cpus else None)
    return best


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "passthrough":
        run_passthrough(*sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
