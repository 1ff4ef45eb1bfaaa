"""Benchmark of the whole ``tokenfair simulate`` command against the lesson's lab, end to end.

Not part of the test suite (speed is measured here only). What a user pays, measured as a user
runs it: the installed console script in a subprocess,

    tokenfair simulate --trace T.jsonl --tenants Q.yaml --policy P --format json

(interpreter start, imports, reading and validating the trace, the replay with whatever the
command does about the cyclic collector, the report) against **the lab**: the lesson's
bookkeeping (``tests/lesson_reference.py``, loaded through ``tests/lesson_bridge.py`` as
``bench/bench_core.py`` does) reading the *same* JSONL line by line with ``json.loads`` into
its request objects, replaying it and summarising it as the lesson's lab does, in-process,
with the cyclic collector on as a plain script has it. The lab runs in a child process of this
script (``--lab``) so its peak RSS is its own; its time is measured inside that process, from
opening the trace to the report written (interpreter start and imports excluded: the lab's
favour).

Regimes (``bench/bench_core.py``'s trace: the lesson's three tenants, ~1.4x overload):

1. **default** — the lesson's default parameters at ``--default-size`` requests (200k);
2. **relaxed** — wait limits 10^12 ms, queue bounds 10^8, KV 10^9 blocks (the backlog grows) at
   ``--relaxed-sizes`` (32k); the lab's cost grows with the backlog (quadratic), so it runs at
   the sizes up to ``--lab-max`` only; ``--million`` adds the 1M relaxed run (minutes) of the
   command alone, and the ratio of its cost per request to the smallest relaxed size's.

In each regime the command also runs with ``--policy tokenfair``: its time over the lesson
DRR policy's is the fair-admission work's price (target <= 1.5). ``--profile`` adds a cProfile
top-15 (by own time) of the ``tokenfair`` policy's command at ``--profile-size`` requests;
``--phases`` adds where the lesson DRR command's time goes at ``--phases-size`` requests of the
relaxed regime (interpreter start, imports, tenants file, the validating read of the trace,
replay, fold, reports; each step timed in a child process, best of ``--repeat``, at least 3;
the command reads and replays in one pass, which the phases take apart: the read into a list,
then the replay over it).

**Bytecode.** The command runs from cached bytecode, as an installed package does (``pip
install`` compiles it): before the first run this script compiles the ``tokenfair`` package it
runs (``compileall``, into the package's ``__pycache__``). An editable install in an
environment with ``PYTHONDONTWRITEBYTECODE=1`` (set on some CI machines) otherwise compiles the
package at every start, ~10-15 ms a run; ``--no-bytecode`` measures that case (it compiles
nothing, and says whether bytecode was there). The lab's time starts after its imports, so its
bytecode does not count either way.

Figures per run: wall seconds (``time.perf_counter`` around the child), CPU seconds (user +
system of that child, ``os.wait4``), microseconds per request, peak RSS (``ru_maxrss``) and the
admitted count (the lab's and the command's must agree for the lesson policy: same decisions).
Ratios are lab / command (above 1: the command is faster). Each run is the best of
``--repeat`` (runs alternate lab, command).

    .venv/bin/python bench/bench_simulate.py                  # default 200k + relaxed 32k
    .venv/bin/python bench/bench_simulate.py --million        # + relaxed 1M (several minutes)
    .venv/bin/python bench/bench_simulate.py --million --relaxed-only   # relaxed 32k + 1M only
    .venv/bin/python bench/bench_simulate.py --quick          # smoke run, ~10 s
    .venv/bin/python bench/bench_simulate.py --records-only --tree ../old-tree   # records only

**Records** (``--records``, or ``--records-only`` for that section alone): the trace reader and
the record writers of ``records/codec.py``, in microseconds per record (best of ``--repeat``, at
least 3; ``--records-count`` records, 100k): decoding a trace (``stream_requests``, what the
replay reads once per policy; ``iter_trace_lines``, validated with unique ids) and encoding the
records each writer writes (the sidecar's ``encode_record``, ``simulate --records``'
``encode_decision``, loadgen's record line, ``trace generate``'s ``dump_trace``), plus the plain
reference encoder (``records.plain_line``) where the tree has it. Each tree (this checkout, and
``--tree DIR`` for another checkout's ``sidecar/``) runs in a child process of its own, in
turn; ratios are the other tree over this one (above 1: this one is faster).

Figures and how to read them: bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import multiprocessing
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import yaml

# The lab (the oracle) is a test helper; the trace is bench_core's.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import core_kind, default_config, overloaded_trace, relaxed_config
from lesson_bridge import DRR, oracle_inputs
from lesson_reference import OracleRequest, lab_summary, run_service_token_drr

from tokenfair.config import Config, config_to_document, load_config

TOKENFAIR = Path(sys.executable).parent / "tokenfair"
OURS = "tokenfair"
EXPERIMENT = "multi-tenant-service-token-drr-and-admission-control"
MILLION = 1_000_000


class Run(NamedTuple):
    """One child process: its times, peak memory and the admitted count it reported."""

    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    admitted: int


def write_trace(path: Path, count: int) -> None:
    """``bench_core.overloaded_trace(count)`` as JSONL (the trace format of docs/records.md),
    written by a spawned child process: this process never holds the requests. On Linux a
    child's ``ru_maxrss`` starts from its parent's high-water RSS (it is forked or vforked from
    it before its exec), so a parent that had built 1M requests would report every run it
    measures afterwards at no less than its own peak."""
    child = multiprocessing.get_context("spawn").Process(
        target=_write_trace, args=(path, count), name="write-trace"
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"writing {path}: the trace writer exited with {child.exitcode}")


def _write_trace(path: Path, count: int) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for r in overloaded_trace(count):
            handle.write(
                json.dumps(
                    {
                        "request_id": r.request_id,
                        "tenant_id": r.tenant_id,
                        "arrival_ms": r.arrival_ms,
                        "prefill_tokens": r.prefill_tokens,
                        "decode_tokens": r.decode_tokens,
                        "priority_class": r.priority_class,
                    },
                    separators=(",", ":"),
                )
                + "\n"
            )


def write_tenants(path: Path, config: Config) -> None:
    path.write_text(yaml.safe_dump(config_to_document(config), sort_keys=False), encoding="utf-8")


def run_child(argv: Sequence[str], stdout_path: Path) -> tuple[float, float, float]:
    """Run ``argv`` with stdout to a file; ``(wall s, cpu s, peak RSS MB)`` of that child."""
    with stdout_path.open("wb") as out:
        start = time.perf_counter()
        child = subprocess.Popen(argv, stdout=out)
        _, status, usage = os.wait4(child.pid, 0)
        wall_s = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {child.returncode}")
    # ru_maxrss is in KiB on Linux.
    return wall_s, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024.0


def run_command(trace: Path, tenants: Path, policy: str, work: Path) -> Run:
    out = work / "command.json"
    argv = [str(TOKENFAIR), "simulate", "--trace", str(trace), "--tenants", str(tenants)]
    wall_s, cpu_s, rss = run_child([*argv, "--policy", policy, "--format", "json"], out)
    report = json.loads(out.read_text(encoding="utf-8"))
    return Run(wall_s, cpu_s, rss, int(report["comparison"][policy]["admitted_requests"]))


def run_lab(trace: Path, tenants: Path, work: Path) -> Run:
    out = work / "lab.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--lab", str(trace), str(tenants)]
    _, _, rss = run_child(argv, out)
    measured = json.loads(out.read_text(encoding="utf-8"))
    # The lab's own times, in-process (its start-up and imports excluded); RSS of the child.
    return Run(measured["wall_s"], measured["cpu_s"], rss, int(measured["admitted"]))


def lab_main(trace: Path, tenants: Path) -> None:
    """The lab, in-process: read the JSONL with ``json.loads``, replay, summarise, report."""
    tenant_rows, _, knobs = oracle_inputs(load_config(tenants), [])
    start, cpu_start = time.perf_counter(), time.process_time()
    requests: list[OracleRequest] = []
    with trace.open(encoding="utf-8") as handle:
        for line in handle:
            data = json.loads(line)
            requests.append(
                OracleRequest(
                    data["request_id"],
                    data["tenant_id"],
                    data["arrival_ms"],
                    data["prefill_tokens"],
                    data["decode_tokens"],
                    data["priority_class"],
                )
            )
    outcomes = run_service_token_drr(tenant_rows, requests, knobs)
    summary = lab_summary(outcomes)
    report = json.dumps(
        {
            "experiment": EXPERIMENT,
            "decode_weight": knobs.decode_weight,
            "comparison": {DRR: summary},
        },
        indent=2,
    )
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    print(
        json.dumps(
            {
                "wall_s": wall_s,
                "cpu_s": cpu_s,
                "admitted": summary["admitted_requests"],
                "bytes": len(report),
            }
        )
    )


def cache_bytecode(compile_it: bool) -> str:
    """Compile the ``tokenfair`` package the command runs into its ``__pycache__`` (unless
    ``compile_it`` is false); returns a line saying what the runs will load."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("tokenfair")
    if spec is None or spec.origin is None:
        raise SystemExit("tokenfair is not importable from this interpreter")
    package = Path(spec.origin).parent
    if compile_it:
        if not compileall.compile_dir(package, quiet=1):
            return f"bytecode: could not compile all of {package} (some modules compile at start)"
        return f"bytecode: cached ({package} compiled before the runs, as an install does)"
    cached = any(package.glob("__pycache__/*.pyc"))
    return f"bytecode: not compiled by this script (--no-bytecode); cached files present: {cached}"


def best(runs: Sequence[Run]) -> Run:
    return min(runs, key=lambda r: r.wall_s)


HEADER = (
    f"  {'run':<38}{'requests':>9}{'wall s':>9}{'wall us':>9}{'cpu s':>9}{'cpu us':>9}"
    f"{'peak MB':>9}{'admitted':>10}"
)


def row(label: str, size: int, run: Run) -> str:
    return (
        f"  {label:<38}{size:>9}{run.wall_s:>9.3f}{run.wall_s / size * 1e6:>9.2f}"
        f"{run.cpu_s:>9.3f}{run.cpu_s / size * 1e6:>9.2f}{run.peak_rss_mb:>9.1f}{run.admitted:>10}"
    )


def bench_regime(
    name: str, config: Config, sizes: Sequence[int], lab_max: int, repeat: int, work: Path
) -> dict[int, Run]:
    """Lab, command (lesson DRR) and command (tokenfair) at each size; the command's runs."""
    tenants = work / f"{name}.yaml"
    write_tenants(tenants, config)
    print(f"{name} regime")
    print(HEADER)
    commands: dict[int, Run] = {}
    for size in sizes:
        trace = work / f"trace-{size}.jsonl"
        if not trace.exists():
            write_trace(trace, size)
        labs: list[Run] = []
        ours: list[Run] = []
        for _ in range(max(1, repeat)):
            if size <= lab_max:
                labs.append(run_lab(trace, tenants, work))
            ours.append(run_command(trace, tenants, DRR, work))
        command = commands[size] = best(ours)
        if labs:
            lab = best(labs)
            print(row("lab (lesson DRR, json.loads)", size, lab))
        print(row(f"tokenfair simulate --policy {DRR}"[:38], size, command))
        fair = best([run_command(trace, tenants, OURS, work) for _ in range(max(1, repeat))])
        print(row(f"tokenfair simulate --policy {OURS}", size, fair))
        if labs:
            print(
                f"    lab / command: wall {lab.wall_s / command.wall_s:.2f}, "
                f"cpu {lab.cpu_s / command.cpu_s:.2f}; same admitted count: "
                f"{lab.admitted == command.admitted}"
            )
        print(
            f"    command tokenfair / {DRR}: wall {fair.wall_s / command.wall_s:.2f}, "
            f"cpu {fair.cpu_s / command.cpu_s:.2f}"
        )
    if len(commands) > 1:
        small, large = min(commands), max(commands)
        first, last = commands[small], commands[large]
        print(
            f"    command per request, {large} / {small} requests: "
            f"wall {last.wall_s / large / (first.wall_s / small):.2f}, "
            f"cpu {last.cpu_s / large / (first.cpu_s / small):.2f}"
        )
    return commands


def profile(config: Config, size: int, work: Path, top: int = 15) -> None:
    """cProfile of the ``tokenfair`` policy's command; the top functions by own time."""
    tenants = work / "profile.yaml"
    write_tenants(tenants, config)
    trace = work / f"trace-{size}.jsonl"
    if not trace.exists():
        write_trace(trace, size)
    stats_path = work / "tokenfair.prof"
    argv = [sys.executable, "-m", "cProfile", "-o", str(stats_path), "-m", "tokenfair.cli"]
    argv += ["simulate", "--trace", str(trace), "--tenants", str(tenants)]
    run_child([*argv, "--policy", OURS, "--format", "json"], work / "profile.json")
    print(
        f"cProfile of `tokenfair simulate --policy {OURS}` (default regime, {size} requests), "
        f"top {top} by own time:"
    )
    stats = pstats.Stats(str(stats_path), stream=sys.stdout)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)


def _records_child(count: int, repeat: int) -> None:
    """Run in a child with the tree's ``sidecar/`` first on ``sys.path`` (its source is sent
    with ``python -c``: nothing of this checkout is imported). Prints a JSON object of
    microseconds per record."""
    import io
    import json
    import tempfile
    import time
    from pathlib import Path

    from tokenfair import loadgen
    from tokenfair.core import Decision, Request
    from tokenfair.records import codec as records
    from tokenfair.records.live import Usage, encode_record

    requests, decisions, usages = [], [], []
    for i in range(count):
        tenant = ("tenant_chat_pro", "tenant_batch_rag", "tenant_ide_assist")[i % 3]
        arrival = round(i * 0.731, 3)
        request = Request(f"{tenant}-{i:06d}", tenant, arrival, 200 + i % 3000, 16 + i % 400,
                          "batch" if i % 3 == 1 else "interactive")  # fmt: skip
        if i % 5 == 4:  # a refusal, with the values its gate saw
            decision = Decision(request.request_id, tenant, request.priority_class, 429,
                                "shed_queue_wait_slo", "admission", 300 + i % 5000, arrival,
                                round(0.3 + i % 50 / 100, 4), 0.0, 0.0, None,
                                round(10 + i % 900 * 0.37, 3), None,
                                {"predicted_wait_ms": 400 + i % 300 * 1.7,
                                 "max_wait_ms": 420.0})  # fmt: skip
            usage = Usage()
        else:
            wait = round(i % 700 * 0.41, 3)
            decision = Decision(request.request_id, tenant, request.priority_class, 200,
                                "admitted", "dispatch", 300 + i % 5000, arrival,
                                round(0.2 + i % 60 / 100, 4), wait, round(wait + 35.2, 3),
                                round(arrival + wait, 3), None, 310 + i % 5000, {})  # fmt: skip
            usage = Usage(request.prefill_tokens, request.decode_tokens - i % 3,
                          35.2 + i % 100 * 0.113, 90.7 + i % 300 * 0.97)  # fmt: skip
        requests.append(request)
        decisions.append(decision)
        usages.append(usage)
    settings = loadgen.LoadgenSettings("http://127.0.0.1:1")
    observations = []
    for request, decision, usage in zip(requests, decisions, usages, strict=True):
        o = loadgen.Observation(
            request, request.arrival_ms, sent_offset_ms=request.arrival_ms + 0.2
        )
        o.status_code, o.reason = decision.status_code, decision.reason
        o.ttft_wall_ms, o.e2e_wall_ms = usage.ttft_ms, usage.e2e_ms
        o.prompt_tokens, o.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        observations.append((o, loadgen.to_decision(o, settings)))
    trace_records = [records.TraceRecord(r) for r in requests]
    zipped = list(zip(requests, decisions, usages, strict=True))

    def sidecar() -> None:
        for r, d, u in zipped:
            encode_record(r, d, "tokenfair", status_code=d.status_code, reason=d.reason, usage=u)

    def simulate() -> None:
        for d in decisions:
            records.encode_decision(d, "tokenfair")

    if hasattr(loadgen, "record_line"):  # this change: the one encoder

        def live() -> None:
            for o, d in observations:
                records.encode_record_line(loadgen.record_line(o, d), "live")

    else:  # before it: a dict, then json.dumps

        def live() -> None:
            for o, d in observations:
                line = loadgen.record_json(o, d, "live")  # type: ignore[attr-defined]
                json.dumps(line, separators=(",", ":"))

    def trace() -> None:
        records.dump_trace(io.StringIO(), trace_records)

    cases = {"encode: sidecar encode_record": sidecar,
             "encode: simulate encode_decision": simulate,
             "encode: loadgen record line": live,
             "encode: trace generate dump_trace": trace}  # fmt: skip
    if hasattr(records, "plain_line"):
        lines = [records.decision_line(d) for d in decisions]

        def plain() -> None:
            for line in lines:
                records.plain_line(line, "tokenfair")

        def fast() -> None:
            for line in lines:
                records.encode_record_line(line, "tokenfair")

        cases["  plain_line (reference), decision lines"] = plain
        cases["  encode_record_line (fast), same lines"] = fast
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            for r in requests:
                handle.write(json.dumps({"request_id": r.request_id, "tenant_id": r.tenant_id,
                                         "arrival_ms": r.arrival_ms,
                                         "prefill_tokens": r.prefill_tokens,
                                         "decode_tokens": r.decode_tokens,
                                         "priority_class": r.priority_class},
                                        separators=(",", ":")) + "\n")  # fmt: skip

        def streamed() -> None:
            for _ in records.stream_requests(path):
                pass

        def validated() -> None:
            for _ in records.iter_trace_lines(path):
                pass

        cases = {"decode: stream_requests (replay)": streamed,
                 "decode: iter_trace_lines (validated)": validated, **cases}  # fmt: skip
        figures = {}
        for name, case in cases.items():
            best = float("inf")
            for _ in range(repeat):
                start = time.process_time()
                case()
                best = min(best, time.process_time() - start)
            figures[name] = best / count * 1e6
    print(json.dumps(figures))


def _phases_child(trace: str, tenants: str, policy: str) -> None:
    """Run with ``python -c`` (nothing of this script imported first): the steps of
    ``tokenfair simulate --trace T --tenants Q --policy P`` one after another, each timed
    (``time.perf_counter``), the imports first; prints a JSON object of milliseconds."""
    import time

    started = time.perf_counter()
    import json
    from pathlib import Path

    from tokenfair.commands import simulate
    from tokenfair.config import load_tenants_file
    from tokenfair.records.codec import TraceReading, stream_validated
    from tokenfair.sim.fairness import FairnessTally
    from tokenfair.sim.report import SummaryTally
    from tokenfair.sim.simulator import replay

    marks = [("imports", started, time.perf_counter())]
    config = load_tenants_file(Path(tenants))
    marks.append(("tenants file", marks[-1][2], time.perf_counter()))
    reading = TraceReading()
    # (the bench's trace records no usage: `priced` is never called)
    read = stream_validated(
        Path(trace), config.tenant_index, reading, lambda line: (line, None, None)
    )
    arrivals = list(read)
    marks.append(("validating read (one pass)", marks[-1][2], time.perf_counter()))
    decisions = list(replay(config, arrivals, policy))
    marks.append(("replay", marks[-1][2], time.perf_counter()))
    summary = SummaryTally()
    window = simulate._window(reading.first_arrival_ms, reading.last_arrival_ms)
    fairness = FairnessTally(config, window)
    simulate.fold(decisions, summary, fairness)
    marks.append(("fold (summary, fairness)", marks[-1][2], time.perf_counter()))
    json.dumps({"summary": summary.summary(), "fairness": repr(fairness.report())})
    marks.append(("reports", marks[-1][2], time.perf_counter()))
    print(json.dumps({name: (end - start) * 1e3 for name, start, end in marks}))


def bench_phases(config: Config, size: int, repeat: int, work: Path) -> None:
    """Where the lesson DRR command's time goes at ``size`` requests (``_phases_child``), best
    of ``repeat`` children per step; interpreter start-up is measured apart (``python -c
    pass``)."""
    tenants = work / "phases.yaml"
    write_tenants(tenants, config)
    trace = work / f"trace-{size}.jsonl"
    if not trace.exists():
        write_trace(trace, size)
    code = (
        inspect.getsource(_phases_child)
        + f"\n_phases_child({str(trace)!r}, {str(tenants)!r}, {DRR!r})\n"
    )
    best: dict[str, float] = {}
    for _ in range(max(3, repeat)):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        best["interpreter start"] = min(
            best.get("interpreter start", 1e9), (time.perf_counter() - start) * 1e3
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"phases child: {done.stderr}")
        for name, ms in json.loads(done.stdout).items():
            best[name] = min(best.get(name, 1e9), ms)
    print(
        f"phases of `tokenfair simulate --policy {DRR}`, relaxed {size}, "
        f"best of {max(3, repeat)} (ms, us/request):"
    )
    for name, ms in best.items():
        print(f"  {name:<28}{ms:>9.1f}{ms * 1e3 / size:>9.2f}")
    print(f"  {'sum':<28}{sum(best.values()):>9.1f}{sum(best.values()) * 1e3 / size:>9.2f}")


def bench_records(trees: Sequence[Path], count: int, repeat: int) -> None:
    """The records section: each tree's figures from a child of its own, in turn."""
    code = inspect.getsource(_records_child) + f"\n_records_child({count}, {max(3, repeat)})\n"
    figures = []
    for tree in trees:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "sidecar")}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"records bench of {tree}: {done.stderr}")
        figures.append(json.loads(done.stdout))
    names = ["this checkout", *(f"--tree {tree}" for tree in trees[1:])]
    print(f"records: CPU µs per record, {count} records, best of {max(3, repeat)}")
    print(f"  {'':<42}" + "".join(f"{name[:22]:>24}" for name in names)
          + ("   other / this" if len(trees) > 1 else ""))  # fmt: skip
    for case in dict.fromkeys(name for f in figures for name in f):
        cells = [f.get(case) for f in figures]
        text = "".join(f"{'-' if c is None else f'{c:.2f}':>24}" for c in cells)
        ratio = ""
        if len(cells) > 1 and cells[0] and cells[1]:
            ratio = f"   {cells[1] / cells[0]:.2f}"
        print(f"  {case:<42}{text}{ratio}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--lab", nargs=2, type=Path, metavar=("TRACE", "TENANTS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--default-size", type=int, default=200_000)
    parser.add_argument("--relaxed-sizes", default="32000", help="comma-separated (32000)")
    parser.add_argument("--lab-max", type=int, default=32_000, help="largest relaxed lab size")
    parser.add_argument("--million", action="store_true", help="add the relaxed 1M command run")
    parser.add_argument(
        "--relaxed-only", action="store_true", help="skip the default regime (e.g. with --million)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="best of N runs (1)")
    parser.add_argument("--profile", action="store_true", help="cProfile top-15 of tokenfair")
    parser.add_argument("--profile-size", type=int, default=50_000)
    parser.add_argument(
        "--phases", action="store_true", help="add where the command's time goes (relaxed)"
    )
    parser.add_argument("--phases-size", type=int, default=32_000)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--keep", type=Path, help="write the traces here and keep them")
    parser.add_argument("--records", action="store_true", help="add the records section")
    parser.add_argument("--records-only", action="store_true", help="the records section only")
    parser.add_argument("--records-count", type=int, default=100_000)
    parser.add_argument("--tree", type=Path, help="another checkout, for the records section")
    parser.add_argument(
        "--no-bytecode",
        dest="bytecode",
        action="store_false",
        help="do not compile the package before the runs (see the module's docstring)",
    )
    args = parser.parse_args(argv)
    if args.lab:
        lab_main(*args.lab)
        return 0
    relaxed_sizes = [int(s) for s in args.relaxed_sizes.split(",") if s]
    if args.million:
        relaxed_sizes.append(MILLION)
    if args.quick:
        args.default_size, relaxed_sizes, args.lab_max, args.profile_size = (
            10_000,
            [2_000, 4_000],
            4_000,
            5_000,
        )
        args.phases_size = 4_000
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
    )
    print(f"core: {core_kind()}")
    if not args.records_only:
        print(cache_bytecode(args.bytecode))
    root = Path(__file__).resolve().parent.parent
    trees = [root] if args.tree is None else [root, args.tree]
    if args.records_only:
        bench_records(trees, args.records_count, args.repeat)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        if not args.relaxed_only:
            bench_regime(
                "default",
                default_config(),
                [args.default_size],
                args.default_size,
                args.repeat,
                work,
            )
        bench_regime("relaxed", relaxed_config(), relaxed_sizes, args.lab_max, args.repeat, work)
        if args.profile:
            profile(default_config(), args.profile_size, work)
        if args.phases:
            bench_phases(relaxed_config(), args.phases_size, args.repeat, work)
    if args.records:
        bench_records(trees, args.records_count, args.repeat)
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
