"""The sidecar's KV view against the engine's own: vLLM's CPU build (``make vllm``) behind the
sidecar, a steady phase and a burst, the two figures sampled side by side (issue 27's target:
within 5 points at the p95 of the samples, in bursts too).

Not part of the test suite (minutes of real time on a real engine). One engine, the suite's
(tests/vllm_support.py: the tiny model, block size 32, 512 blocks, 16 requests a batch), and one
trace (seeded) replayed by ``tokenfair loadgen --stream`` through a sidecar per variant:

* steady: two interactive tenants (200 prompt / 32 output tokens, as the sidecar estimates them)
  and a batch tenant (800 / 160) at about two thirds of the engine's capacity;
* burst: on top of it, ``--burst`` batch requests within one second, at ``--burst-at-s``.

The sidecar may send the engine twice its batch (``maxInFlight`` 32), so in the burst requests
the sidecar counts as running wait in vLLM's own queue, as in the issue's run. Every
``--sample-ms`` a sampler reads vLLM's ``vllm:kv_cache_usage_perc`` and the sidecar's
``/status`` ``kv`` (``view_blocks``, ``gate_blocks``, the books' ``resident_kv_blocks``).

Variants (each its own sidecar, the same trace):

* ``loop``: the engine's metrics read (``engineMetrics: auto``, the default);
* ``fast`` (only if asked for): ``loop`` with the engine's metrics read every 0.1 s, not 0.25;
* ``model``: ``engineMetrics: off`` — the per-request model alone, what the sidecar shows while
  the engine's metrics are stale or missing;
* ``ratio-off`` (only if asked for): ``loop`` with ``kvPromptRatio: off`` — reservations at the
  sidecar's prompt estimate, not at the engine's learned count (the KV cache it leads the
  engine to, beside ``loop``'s);
* with ``--before PYTHONPATH``, ``before``: another tree's sidecar (e.g. ``git archive`` of the
  code before this change) with the engine's metrics read; its ``view_blocks`` is what that
  tree showed.

For each: p50 / p95 of ``|sidecar - engine|`` in points of the cache and the correlation, over
the samples taken under load (from the first arrival to the last answer), and over the burst's
samples alone (``--burst-window-s`` from the burst), for the view, the books and the gates.

    make vllm && .venv/bin/python bench/bench_kv_view.py                 # ~6 min
    .venv/bin/python bench/bench_kv_view.py --before /tmp/main-tree/sidecar --keep /tmp/kv-run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from engine_support import SIDECAR_LOG, EngineSidecar, engine_document, wait_ready
from kubecluster import start_process, stop_process
from loopback_support import free_ports
from sidecar_support import KEYS
from vllm_support import VllmServer, find_install, parse_samples, running_vllm

from tokenfair.sim.report import percentile

TOKENFAIR: Final = Path(sys.executable).with_name("tokenfair")
INTERACTIVE: Final = ("tenant_chat_pro", "tenant_ide_assist")
BATCH: Final = "tenant_batch_rag"
TARGET_POINTS: Final = 5.0
SHAPES: Final = {"interactive": (200, 32), "batch": (800, 160)}


def make_trace(path: Path, duration_s: float, burst_at_s: float, burst: int, seed: int,
               interactive_rps: float, batch_rps: float) -> float:  # fmt: skip
    """Poisson arrivals of each tenant over ``duration_s``, plus ``burst`` batch requests in
    the second from ``burst_at_s``; returns the burst's start in ms."""
    rng = random.Random(seed)
    rows: list[tuple[float, str, str]] = []
    for tenant, lane, rps in ((INTERACTIVE[0], "interactive", interactive_rps / 2),
                              (INTERACTIVE[1], "interactive", interactive_rps / 2),
                              (BATCH, "batch", batch_rps)):  # fmt: skip
        at = 0.0
        while rps > 0 and (at := at + rng.expovariate(rps)) < duration_s:
            rows.append((at * 1000.0, tenant, lane))
    rows += [((burst_at_s + rng.random()) * 1000.0, BATCH, "batch") for _ in range(burst)]
    rows.sort()
    with path.open("w", encoding="utf-8") as out:
        for number, (arrival_ms, tenant, lane) in enumerate(rows):
            prompt, output = SHAPES[lane]
            out.write(json.dumps({
                "request_id": f"{tenant}-{number:05d}", "tenant_id": tenant,
                "arrival_ms": round(arrival_ms, 3), "prefill_tokens": prompt,
                "decode_tokens": output, "priority_class": lane,
            }) + "\n")  # fmt: skip
    return burst_at_s * 1000.0


@dataclass
class Sampler:
    """vLLM's KV usage and the sidecar's ``/status`` ``kv``, every ``period_s``."""

    engine: VllmServer
    sidecar: EngineSidecar
    period_s: float
    samples: list[dict[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            # Both read at once (the engine's page in a thread): the two figures of a sample
            # are of the same moment, to within the slower read.
            page: list[bytes] = []
            reader = threading.Thread(target=self._read_engine, args=(page,))
            reader.start()
            try:
                status = self.sidecar.status()
            except OSError:
                reader.join()
                continue
            reader.join()
            if not page:
                continue
            engine = parse_samples(page[0].decode())
            kv, books = status["kv"], status["books"]
            total = float(kv["total_blocks"])
            self.samples.append({
                "at_s": (started + time.monotonic()) / 2,
                "engine": _one(engine, "vllm:kv_cache_usage_perc"),
                "engine_waiting": _one(engine, "vllm:num_requests_waiting"),
                "engine_running": _one(engine, "vllm:num_requests_running"),
                "polls": float(status.get("engine", {}).get("polls", 0)),
                "view": kv["view_blocks"] / total,
                # A tree without the split shows the gates' figure as its view.
                "gate": kv.get("gate_blocks", kv["view_blocks"]) / total,
                "books": books["resident_kv_blocks"] / total,
                "running": float(books["running_requests"]),
                "from_engine": 1.0 if kv["source"] == "engine" else 0.0,
            })  # fmt: skip
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    def _read_engine(self, into: list[bytes]) -> None:
        with contextlib.suppress(OSError):
            into.append(self.engine.get("/metrics", 5.0)[1])


def _one(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name)


@contextlib.contextmanager
def sidecar(engine: VllmServer, folder: Path, engine_metrics: str, pythonpath: str | None,
            settings: dict[str, Any] | None = None) -> Iterator[EngineSidecar]:  # fmt: skip
    """``tokenfair sidecar --backend openai`` in front of ``engine`` (the engine tests'
    config, ``maxInFlight`` twice the engine's batch)."""
    document = engine_document(engine)
    mode, _, interval = engine_metrics.partition("@")
    document["sidecar"] = {"maxInFlight": 2 * engine.settings.max_num_seqs,
                           "engineMetrics": mode}  # fmt: skip
    if interval:
        document["sidecar"]["engineMetricsIntervalSeconds"] = float(interval)
    document["sidecar"].update(settings or {})
    config = folder / "sidecar.yaml"
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    proxy_port, admin_port = free_ports(2)
    handle = EngineSidecar(f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}",
                           folder / "records.jsonl", folder)  # fmt: skip
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    command = [str(TOKENFAIR), "sidecar", "--config", str(config),
               "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
               "--backend", "openai", "--upstream", engine.base_url,
               "--records", str(handle.records_path), "--drain-grace", "5"]  # fmt: skip
    process = start_process(SIDECAR_LOG, command, folder, env)
    try:
        wait_ready(handle.admin, process, folder)
        yield handle
    finally:
        stop_process(process)


Run = tuple[list[dict[str, float]], float, dict[str, Any]]


def run_variant(engine: VllmServer, work: Path, name: str, trace: Path, keys: Path,
                engine_metrics: str, pythonpath: str | None, period_s: float,
                settings: dict[str, Any] | None = None) -> Run:  # fmt: skip
    """The trace through one sidecar; its samples and the loop time of the trace's start."""
    folder = work / name
    folder.mkdir()
    with sidecar(engine, folder, engine_metrics, pythonpath, settings) as handle:
        sampler = Sampler(engine, handle, period_s)
        sampler.start()
        started = time.monotonic()
        done = subprocess.run(
            [str(TOKENFAIR), "loadgen", "--target", handle.proxy, "--trace", str(trace),
             "--keys", str(keys), "--stream", "--records", str(folder / "client.jsonl"),
             "--format", "json", "--no-progress", "--request-timeout", "600"],
            capture_output=True, text=True,
        )  # fmt: skip
        ended = time.monotonic()
        sampler.stop()
    if done.returncode not in (0, 1):
        raise SystemExit(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    samples = [s for s in sampler.samples if started <= s["at_s"] <= ended]
    with (folder / "samples.jsonl").open("w", encoding="utf-8") as out:
        out.writelines(json.dumps({**s, "at_s": s["at_s"] - started}) + "\n" for s in samples)
    report: dict[str, Any] = json.loads(done.stdout)
    return samples, started, report


def agreement(samples: Sequence[dict[str, float]], key: str) -> tuple[float, float, float]:
    """p50 and p95 of ``|key - engine|`` in points, and the correlation."""
    gaps = sorted(abs(s[key] - s["engine"]) * 100.0 for s in samples)
    if not gaps:
        return math.nan, math.nan, math.nan
    ours = [s[key] for s in samples]
    theirs = [s["engine"] for s in samples]
    try:
        correlation = statistics.correlation(ours, theirs)
    except statistics.StatisticsError:
        correlation = math.nan
    return percentile(gaps, 50.0), percentile(gaps, 95.0), correlation


def report_variant(name: str, samples: list[dict[str, float]], started: float,
                   burst_ms: float, window_s: float) -> list[str]:  # fmt: skip
    burst_from = started + burst_ms / 1000.0
    burst = [s for s in samples if burst_from <= s["at_s"] <= burst_from + window_s]
    peak = max((s["engine"] for s in samples), default=0.0)
    waiting = max((s["engine_waiting"] for s in samples), default=0.0)
    fresh = sum(s["from_engine"] for s in samples)
    lines = [f"{name}: {len(samples)} samples under load, {len(burst)} in the burst; engine KV "
             f"peak {peak:.2f}, engine waiting peak {waiting:.0f}, gates from the engine's "
             f"report in {fresh:.0f}/{len(samples)}"]  # fmt: skip
    for key, what in (("view", "view (what the engine holds now)"),
                      ("books", "books (prompt + max_tokens booked)"),
                      ("gate", "gates (engine + running growth)")):  # fmt: skip
        for label, chosen in (("all", samples), ("burst", burst)):
            p50, p95, r = agreement(chosen, key)
            verdict = ""
            if key == "view":
                verdict = "ok" if p95 <= TARGET_POINTS else "MISSED"
            lines.append(f"  {what:<38} {label:<5} |d| p50 {p50:5.1f}  p95 {p95:5.1f} points"
                         f"  r {r:5.2f}   target p95 <= {TARGET_POINTS:g} {verdict}")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--burst-at-s", type=float, default=25.0)
    parser.add_argument("--burst", type=int, default=40, help="batch requests in the burst")
    parser.add_argument("--burst-window-s", type=float, default=20.0)
    parser.add_argument("--interactive-rps", type=float, default=1.2)
    parser.add_argument("--batch-rps", type=float, default=0.8)
    parser.add_argument("--sample-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument(
        "--before",
        metavar="PYTHONPATH",
        help="also run the sidecar of another tree (its sidecar/ folder)",
    )
    parser.add_argument("--keep", type=Path, help="copy the run's files here")
    parser.add_argument(
        "--variants",
        default="before,loop,model",
        help="which to run, of before (with --before), loop, model, fast, ratio-off",
    )
    args = parser.parse_args(argv)
    install = find_install()
    if isinstance(install, str):
        raise SystemExit(install)
    work = Path(tempfile.mkdtemp(prefix="tokenfair-kv-view-"))
    try:
        trace = work / "trace.jsonl"
        burst_ms = make_trace(trace, args.duration_s, args.burst_at_s, args.burst, args.seed,
                              args.interactive_rps, args.batch_rps)  # fmt: skip
        keys = work / "keys.yaml"
        keys.write_text(yaml.safe_dump(dict(KEYS)), encoding="utf-8")
        engine_dir = work / "engine"
        engine_dir.mkdir()
        off: dict[str, Any] = {"kvPromptRatio": "off"}
        variants: list[tuple[str, str, str | None, dict[str, Any]]] = [
            ("loop", "auto", None, {}),
            ("model", "off", None, {}),
            ("fast", "auto@0.1", None, {}),
            ("ratio-off", "auto", None, off),
        ]
        if args.before:
            variants.insert(0, ("before", "auto", args.before, {}))
        variants = [v for v in variants if v[0] in args.variants.split(",")]
        out: list[str] = []
        with running_vllm(install, engine_dir) as engine:
            for name, metrics, pythonpath, settings in variants:
                samples, started, _ = run_variant(
                    engine, work, name, trace, keys, metrics, pythonpath, args.sample_ms / 1000,
                    settings,
                )  # fmt: skip
                out += report_variant(name, samples, started, burst_ms, args.burst_window_s)
                clients = [
                    json.loads(x)
                    for x in (work / name / "client.jsonl").read_text().splitlines()
                    if x.strip()
                ]
                statuses = sorted({c["status_code"] for c in clients})
                counts = ", ".join(f"{status}: {sum(c['status_code'] == status for c in clients)}"
                                   for status in statuses)  # fmt: skip
                out.append(f"  client statuses: {counts}")
                print("\n".join(out[-8:]), flush=True)
        print(
            f"\nKV view vs vLLM's kv_cache_usage_perc ({args.duration_s:g} s, burst of "
            f"{args.burst} at {args.burst_at_s:g} s, samples every {args.sample_ms:g} ms)"
        )
        print("\n".join(out))
    finally:
        if args.keep is not None:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
