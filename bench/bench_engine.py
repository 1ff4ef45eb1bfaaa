"""tokenfair in front of a real engine: vLLM's CPU build (``make vllm``), direct vs through the
sidecar in one run, every figure of issue 27 printed beside its target.

Not part of the test suite (minutes of real time on a real engine). One engine, the suite's
(tests/vllm_support.py: the tiny model, block size 32, 512 blocks, 16 requests a batch), and
four phases of the same length on it:

1. **calibrate** — a mixed workload (two interactive tenants, one batch tenant) of varied
   prompt and output lengths at a ramp of load that adapts to the engine (``next_factor``:
   steps of a fifth of ``--duration-ms``, from a quarter of the base rates down by halves until
   a tenth of a step's records ran about alone, up by doubling until one filled the engine's batch,
   then on at the highest load the sidecar did not hold back until 400 records were served; a
   fixed ramp saturated a loaded machine's engine from its first step and never filled a quiet
   one's) through the sidecar under hand-set coefficients (``HAND_SET``); ``tokenfair
   calibrate`` on its records fits ``serviceTokensPerMs``, ``batchThroughputGain``,
   ``maxBatchRequests``, ``decodeWeight`` and the prefill speed. The flood rate of the next
   phases comes from it. A fit ``calibrate`` refuses is printed as a missed target, and the run
   goes on with the hand-set coefficients (each step's load and concurrency are printed either
   way).
2. **direct** — the flood trace (the batch tenant at ``--flood`` x the calibrated capacity,
   the interactive tenants at a fixed rate well under their share) sent straight to vLLM by
   ``tokenfair loadgen``, streamed: every client's TTFT.
3. **calibrated** — the same trace through the sidecar with the calibrated policy (the
   defaults a user runs: access log on, metrics on, records on, engine metrics ``auto``). A
   sampler reads the engine's ``/metrics`` and the sidecar's ``/status`` every 100 ms.
4. **hand-set** — the same trace through the sidecar with the lesson's coefficients (serial,
   ``serviceTokensPerMs`` 45), the policy a user had before calibrating.

Then the simulator replays the flood trace's requests (same arrivals, same recorded usage) under
the calibrated policy, on the engine the records describe (each prompt at the engine's count,
the engine's KV cache holding back what does not fit, the gates seeing the engine's KV:
``sim.simulator.EngineFacts``), and compares its interactive TTFT with phase 3's
(``bench_engine_model.compare``; the replay on the policy's engine alone is printed beside).

Targets (issue 27):

* calibrate: a usable fit from the records taken under load;
* records match clients: no stream a client read to its end (status 200) recorded otherwise;
  the records' prompt and completion tokens equal the growth of vLLM's
  ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` over the phase;
* interactive TTFT p99 through the sidecar <= 1/10 of direct; the interactive tenants served
  >= 97 % of what they sent; admitted-then-expired <= 2 %; the flood refused at the door
  (refusals from the queue a small part of its refusals);
* no refusal for capacity (``shed_queue_wait_slo``, ``shed_queue_timeout``, ``shed_kv_watermark``,
  ``queue_full``) while the engine had a free slot, nothing waiting and KV for the request
  under its watermark (the engine's KV with the request's own blocks, the gates' rule), by the
  engine's metrics sampled nearest the decision — for a batch request, a slot its lane may take
  (``/status`` ``slots``: the interactive reserve is not its room): 0;
* calibrated: serves at least as many service tokens as hand-set, at an interactive p99 no
  worse than hand-set's;
* the sidecar's KV view (``/status`` ``kv``) within 5 points of the engine's
  ``vllm:kv_cache_usage_perc`` at the p95 of the paired samples;
* the simulator's interactive p50 / p99 TTFT within 25 % of the live run's.

    make vllm && .venv/bin/python bench/bench_engine.py                   # ~10-15 min
    .venv/bin/python bench/bench_engine.py --duration-ms 90000 --keep /tmp/engine-run
    .venv/bin/python bench/bench_engine.py --engine http://127.0.0.1:PORT  # a running vLLM
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)
from bench_engine_model import compare, format_comparison
from engine_support import EngineSidecar, sidecar_in_front_of
from sidecar_support import KEYS
from vllm_support import (
    VllmServer,
    VllmSettings,
    find_install,
    parse_samples,
    read_facts,
    running_vllm,
)

from tokenfair.config import PolicyConfig, apply_overrides
from tokenfair.config.document import replace_policy
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import read_trace
from tokenfair.server.kv_view import KV_DECODE_BOOKING_MODES
from tokenfair.server.runtime_settings import SidecarSettings
from tokenfair.sim.calibrate import (
    Calibration,
    CalibrationError,
    calibrate,
    read_outcomes,
    run_spans,
    samples_from_records,
)
from tokenfair.sim.concurrency import ConcurrencyProfile
from tokenfair.sim.report import percentile

TOKENFAIR: Final = Path(sys.executable).with_name("tokenfair")
INTERACTIVE: Final = ("tenant_chat_pro", "tenant_ide_assist")
BATCH: Final = "tenant_batch_rag"
CAPACITY_REASONS: Final = frozenset(
    {"shed_queue_wait_slo", "shed_queue_timeout", "shed_kv_watermark", "queue_full"}
)
SAMPLE_S: Final = 0.1
# The workload's shapes (prompt tokens as the sidecar estimates them: loadgen sends 4 characters
# a token; the engine's tokenizer counts its own, which the records carry).
INTERACTIVE_PROMPT: Final = 200
INTERACTIVE_OUTPUT: Final = 32
BATCH_PROMPT: Final = 800
BATCH_OUTPUT: Final = 160
# The calibration phase (`next_factor`): the batch tenant's and each interactive tenant's requests
# per second at the ramp's factor 1, and the ranges of the lengths drawn (the sidecar's
# estimate; the engine's tokenizer counts about twice as many prompt tokens, and 2 x 1000 + 256
# stays within the model's 4,096).
CALIBRATION_RPS: Final = (1.0, 0.5)
# The ramp adapts to the engine: its first step at RAMP_START, then down by halves (at most
# RAMP_DOWN_STEPS) until a step's p10 concurrency is at most RAMP_LOW_CONCURRENCY, up by
# doubling until its p90 reaches RAMP_HIGH_SHARE of the batch (or RAMP_HELD_SHARE of its
# requests were refused or queued past RAMP_QUEUED_MS: the sidecar held the load back), then on
# until RAMP_RECORDS were served; each step a fifth of --duration-ms, at most RAMP_MAX_STEPS.
RAMP_START: Final = 0.25
RAMP_DOWN_STEPS: Final = 3
RAMP_LOW_CONCURRENCY: Final = 1.5
RAMP_HIGH_SHARE: Final = 0.75
RAMP_HELD_SHARE: Final = 0.1
RAMP_QUEUED_MS: Final = 100.0
RAMP_RECORDS: Final = 400
RAMP_MAX_STEPS: Final = 10
CALIBRATION_PROMPT: Final = (50, 1000)
CALIBRATION_OUTPUT: Final = (8, 256)
# The wait limits for this engine: a request alone takes a few hundred ms on 2 CPU cores.
WAITS: Final = {"max_interactive_wait_ms": 1500.0, "max_batch_wait_ms": 15000.0}


@dataclass
class Sampler:
    """The engine's KV use, running and waiting, and the sidecar's KV view, every 100 ms."""

    engine: VllmServer
    sidecar: EngineSidecar
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
            try:
                engine = parse_samples(self.engine.get("/metrics", 5.0)[1].decode())
                status_s = time.monotonic()
                status = self.sidecar.status()
                # The engine again after the sidecar: the sidecar's figures were read between
                # the two (a read of the engine's page took up to 0.5 s on the loaded machine,
                # and a burst moves the cache by a batch prompt, 10-13 points, in less).
                after = parse_samples(self.engine.get("/metrics", 5.0)[1].decode())
            except OSError:
                continue
            read_s = (started + time.monotonic()) / 2
            kv = status["kv"]
            slots = status.get("slots", {})
            books = status.get("books", {})
            self.samples.append(
                {
                    "clock_ms": float(status["clock_ms"]),
                    "at_s": read_s,
                    "engine_kv": _one(engine, "vllm:kv_cache_usage_perc"),
                    "engine_kv_after": _one(after, "vllm:kv_cache_usage_perc"),
                    "window_ms": 1000.0 * (time.monotonic() - started),
                    "status_after_ms": 1000.0 * (status_s - started),
                    "engine_running": _one(engine, "vllm:num_requests_running"),
                    "engine_waiting": _one(engine, "vllm:num_requests_waiting"),
                    "sidecar_kv": kv["view_blocks"] / kv["total_blocks"],
                    "sidecar_kv_source_engine": 1.0 if kv["source"] == "engine" else 0.0,
                    # What the gates see, the prompt ratio reservations are booked at, and
                    # the requests the sidecar has sent and not seen end (those the engine
                    # does not count running or waiting are on their way to it).
                    "sidecar_gate_kv": kv["gate_blocks"] / kv["total_blocks"],
                    "gate_prompt_ratio": float(kv.get("gate_prompt_ratio", 1.0)),
                    "sidecar_running": float(books.get("running_requests", 0)),
                    # The batch lane's slots (the interactive reserve: docs/capacity.md).
                    "batch_slots": float(slots.get("batch", math.inf)),
                    "batch_running": float(slots.get("batch_running", 0)),
                }
            )
            self._stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - started)))


def _bracket_gap(sample: dict[str, float]) -> float:
    """The view's distance to the engine's KV figures read just before and just after it (0
    between them; the one before alone in samples without the second read)."""
    before = sample["engine_kv"]
    after = sample.get("engine_kv_after", before)
    view = sample["sidecar_kv"]
    return max(0.0, min(before, after) - view, view - max(before, after))


def _one(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name)


def engine_tokens(engine: VllmServer) -> tuple[float, float]:
    samples = parse_samples(engine.get("/metrics")[1].decode())
    return _one(samples, "vllm:prompt_tokens_total"), _one(samples, "vllm:generation_tokens_total")


def engine_preemptions(engine: VllmServer) -> float:
    """vLLM's ``vllm:num_preemptions_total``: requests it preempted (freed their KV blocks and
    requeued them) for want of a block."""
    return _one(parse_samples(engine.get("/metrics")[1].decode()), "vllm:num_preemptions_total")


def wait_counters(engine: VllmServer, before: tuple[float, float], expected: tuple[float, float],
                  timeout_s: float = 30.0) -> tuple[float, float]:  # fmt: skip
    """The counters' growth since ``before``, once it reaches ``expected`` (or after the
    timeout: vLLM updates them just after a response is sent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = engine_tokens(engine)
        grown = (now[0] - before[0], now[1] - before[1])
        if grown == expected or time.monotonic() > deadline:
            return grown
        time.sleep(0.2)


def generate_trace(path: Path, duration_ms: float, seed: int, batch_rps: float,
                   interactive_rps: float) -> None:  # fmt: skip
    keys = ["--rate", f"{BATCH}={batch_rps:.3f}"]
    for tenant in INTERACTIVE:
        keys += ["--rate", f"{tenant}={interactive_rps:.3f}",
                 "--prompt-tokens", f"{tenant}={INTERACTIVE_PROMPT}",
                 "--output-tokens", f"{tenant}={INTERACTIVE_OUTPUT}"]  # fmt: skip
    subprocess.run(
        [str(TOKENFAIR), "trace", "generate", "--duration-ms", f"{duration_ms:g}",
         "--seed", str(seed), "--prompt-tokens", f"{BATCH}={BATCH_PROMPT}",
         "--output-tokens", f"{BATCH}={BATCH_OUTPUT}", *keys, "--out", str(path),
         "--no-progress"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def step_trace(path: Path, step_ms: float, seed: int, factor: float, index: int) -> None:
    """One step of the calibration ramp: the mixed workload of :data:`CALIBRATION_RPS` times
    ``factor`` for ``step_ms``, each request's prompt and output lengths drawn log-uniformly
    from :data:`CALIBRATION_PROMPT` and :data:`CALIBRATION_OUTPUT` (independently: the ratio of
    prompt to output varies, which is what separates ``decodeWeight`` from the speed; two fixed
    shapes left it at a relative standard error of 44-54 %)."""
    rng = random.Random(seed * 1000 + index)
    part = path.with_name(f"{path.stem}-raw.jsonl")
    generate_trace(part, step_ms, seed + index, CALIBRATION_RPS[0] * factor,
                   CALIBRATION_RPS[1] * factor)  # fmt: skip
    lines = []
    for record in read_lines(part):
        record["request_id"] = f"ramp{index}-{record['request_id']}"
        record["prefill_tokens"] = _log_uniform(rng, CALIBRATION_PROMPT)
        record["decode_tokens"] = _log_uniform(rng, CALIBRATION_OUTPUT)
        lines.append(json.dumps(record, separators=(",", ":")))
    part.unlink()
    path.write_text("\n".join(lines) + "\n" if lines else "")


@dataclass(frozen=True)
class RampStep:
    """One step of the calibration ramp and what its clients saw."""

    factor: float
    sent: int
    served: int
    waited: int
    """Requests refused, or queued in the sidecar past :data:`RAMP_QUEUED_MS`: the sidecar
    held the load back (the engine was full by its model)."""
    concurrency: tuple[float, float, float]
    """p10 / p50 / p90 of the served requests' time-averaged concurrency (their runs, from
    the clients' records: each step runs alone, loadgen waits for its last answer)."""

    @property
    def low(self) -> bool:
        return self.served > 0 and self.concurrency[0] <= RAMP_LOW_CONCURRENCY

    def high(self, batch: int) -> bool:
        held = self.sent > 0 and self.waited >= RAMP_HELD_SHARE * self.sent
        return held or (self.served > 0 and self.concurrency[2] >= RAMP_HIGH_SHARE * batch)


def ramp_step(client: Path, factor: float) -> RampStep:
    """The step's clients' records, summed up (:class:`RampStep`)."""
    records = read_trace(client)
    outcomes = read_outcomes(client)
    samples, _skipped, _idle = samples_from_records(records, outcomes)
    profile = ConcurrencyProfile(run_spans(records, outcomes))
    seen = sorted(profile.mean(*s.span) for s in samples if s.span is not None)
    waited = sum(
        1 for o in outcomes.values()
        if o.status_code != 200 or (o.queue_wait_ms or 0.0) > RAMP_QUEUED_MS
    )  # fmt: skip
    spread = (p(seen, 0.1), p(seen, 0.5), p(seen, 0.9)) if seen else (0.0, 0.0, 0.0)
    return RampStep(factor, len(records), len(seen), waited, spread)


def next_factor(steps: Sequence[RampStep], batch: int) -> float | None:
    """The load of the ramp's next step, or None when it is done: down (halving from the
    lowest so far) until a tenth of a step's records ran about alone, up (doubling from the
    highest) until one filled the engine's batch (or the sidecar held the load back); then, for
    more records, the highest load that did not hold any back, until :data:`RAMP_RECORDS`
    were served. Whatever the engine's speed — a quiet machine's engine needs 4-8 times the
    load a loaded one saturates at — the records then span its concurrency."""
    factors = [step.factor for step in steps]
    if not steps:
        return RAMP_START
    if not any(step.low for step in steps) and min(factors) > RAMP_START / 2**RAMP_DOWN_STEPS:
        return min(factors) / 2
    if not any(step.high(batch) for step in steps):
        return max(factors) * 2
    if sum(step.served for step in steps) >= RAMP_RECORDS:
        return None
    unheld = [s.factor for s in steps if s.sent and s.waited < RAMP_HELD_SHARE * s.sent]
    return max(unheld) if unheld else min(factors)


def _log_uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def loadgen(
    target: str, trace: Path, records: Path, model: str | None, keys: Path
) -> dict[str, Any]:
    command = [str(TOKENFAIR), "loadgen", "--target", target, "--trace", str(trace),
               "--keys", str(keys), "--stream", "--records", str(records), "--format", "json",
               "--no-progress", "--request-timeout", "600"]  # fmt: skip
    if model is not None:
        command += ["--model", model]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def interactive_ttfts(client_records: list[dict[str, Any]]) -> list[float]:
    return sorted(
        r["ttft_ms"] for r in client_records
        if r["tenant_id"] in INTERACTIVE and r["status_code"] == 200
    )  # fmt: skip


def p(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in 0..1: ``percentile`` takes percent)."""
    return percentile(sorted(values), 100.0 * q) if values else math.nan


def line(name: str, value: str, target: str, ok: bool | None) -> str:
    verdict = "" if ok is None else ("ok" if ok else "MISSED")
    return f"  {name:<58} {value:>22}   target {target:<14} {verdict}"


@dataclass
class Phase:
    """One run of the flood trace through the sidecar."""

    name: str
    client: list[dict[str, Any]]
    records: list[dict[str, Any]]
    report: dict[str, Any]
    tokens: tuple[float, float]
    samples: list[dict[str, float]]
    records_path: Path
    preemptions: float = 0.0
    """The growth of vLLM's ``vllm:num_preemptions_total`` over the phase."""


def through_sidecar(engine: VllmServer, work: Path, name: str, trace: Path | None, keys: Path,
                    policy: dict[str, Any],
                    drive: Callable[[EngineSidecar, Path], dict[str, Any]] | None = None,
                    sidecar_settings: dict[str, Any] | None = None,
                    ) -> Phase:  # fmt: skip
    """A phase through a sidecar of ``policy`` (and ``sidecar_settings``: ``sidecar:`` keys):
    ``trace`` sent by loadgen, or ``drive`` called with the sidecar and the clients' records
    file (it writes them)."""
    folder = work / name
    folder.mkdir()
    with sidecar_in_front_of(engine, folder, sidecar_settings, **policy) as sidecar:
        before = engine_tokens(engine)
        preempted = engine_preemptions(engine)
        sampler = Sampler(engine, sidecar)
        sampler.start()
        if drive is not None:
            report = drive(sidecar, folder / "client.jsonl")
        else:
            assert trace is not None
            report = loadgen(sidecar.proxy, trace, folder / "client.jsonl", None, keys)
        sampler.stop()
        # The samples beside the records (`--keep` copies them): what the counts were made of.
        (folder / "samples.jsonl").write_text(
            "".join(json.dumps(sample) + "\n" for sample in sampler.samples)
        )
        records = sidecar.records()
        expected = (
            sum(r.get("actual_prefill_tokens") or 0 for r in records if r["status_code"] == 200),
            sum(r.get("actual_decode_tokens") or 0 for r in records if r["status_code"] == 200),
        )
        tokens = wait_counters(engine, before, expected)
        preempted = engine_preemptions(engine) - preempted
    return Phase(name, read_lines(folder / "client.jsonl"), records, report, tokens,
                 sampler.samples, sidecar.records_path, preempted)  # fmt: skip


def capacity_refusals_with_room(
    phase: Phase,
    batch: int,
    policy: PolicyConfig,
    own_blocks: bool = True,
    behind: list[int] | None = None,
    gated: list[int] | None = None,
) -> int:
    """Refusals for capacity decided while the engine, by the sample nearest the decision, had
    a free slot, nothing waiting and KV below the request's watermark with the request's own
    blocks (as the sidecar books them, the KV gates' rule: its prompt at the prompt ratio the
    sample's ``/status`` gave, the engine's count; ``own_blocks=False``: the engine's KV
    alone) — for a batch request, a slot its lane may take: the sidecar's batch lane below
    its ``batch_slots`` (``/status`` ``slots``; the rest is the interactive reserve,
    docs/capacity.md). ``behind`` gets one entry per refusal counted whose sample had
    requests the sidecar had sent and the engine did not count yet (on their way to it);
    ``gated`` one per refusal counted whose sample's KV gates (``/status`` ``kv.gate_blocks``:
    the engine's blocks plus the running requests' growth to their reservations) with the
    request's own blocks were past its watermark."""
    samples = sorted(phase.samples, key=lambda s: s["clock_ms"])
    if not samples:
        return 0
    times = [s["clock_ms"] for s in samples]
    cost = CostModel.from_policy(policy)
    count = 0
    for record in phase.records:
        if record["reason"] not in CAPACITY_REASONS:
            continue
        decided_ms = record["arrival_ms"] + (record.get("queue_wait_ms") or 0.0)
        index = min(bisect.bisect_left(times, decided_ms), len(times) - 1)
        if index and abs(times[index - 1] - decided_ms) < abs(times[index] - decided_ms):
            index -= 1
        sample = samples[index]
        watermark = (
            policy.interactive_kv_watermark
            if record["priority_class"] == "interactive"
            else policy.batch_kv_watermark
        )
        lane_room = (
            record["priority_class"] == "interactive"
            or sample["batch_running"] < sample["batch_slots"]
        )
        kv = sample["engine_kv"]
        if own_blocks:
            ratio = sample.get("gate_prompt_ratio", 1.0)
            prompt = math.ceil(round(record["prefill_tokens"] * ratio, 9))
            blocks = cost.kv_blocks(prompt, record["decode_tokens"])
            kv += blocks / policy.total_kv_blocks
        if (
            sample["engine_running"] < batch
            and sample["engine_waiting"] == 0
            and kv <= watermark
            and lane_room
        ):
            count += 1
            if behind is not None and sample.get("sidecar_running", 0.0) > (
                sample["engine_running"] + sample["engine_waiting"]
            ):
                behind.append(1)
            if (
                gated is not None
                and sample.get("sidecar_gate_kv", 0.0) + kv - sample["engine_kv"] > watermark
            ):
                gated.append(1)
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-ms", type=float, default=60_000.0, help="each phase (60 s)")
    parser.add_argument("--seed", type=int, default=20261206)
    parser.add_argument("--flood", type=float, default=1.5, help="batch load x capacity (1.5)")
    parser.add_argument("--interactive-rps", type=float, default=0.4,
                        help="each interactive tenant's requests per second (0.4)")  # fmt: skip
    parser.add_argument("--keep", metavar="DIR",
                        help="copy the phases' records, clients and samples there")  # fmt: skip
    parser.add_argument("--engine", metavar="URL",
                        help="a vLLM already running with the suite's settings "
                             "(tests/vllm_support.py) instead of starting one")  # fmt: skip
    parser.add_argument("--kv-decode-booking", type=_bookings, default="both",
                        metavar="MODE|A,B|both",
                        help="the calibrated phase's kvDecodeBooking (one of "
                             f"{', '.join(KV_DECODE_BOOKING_MODES)}); A,B: under A, then the "
                             "calibrated policy again under B, compared; both (the default): "
                             "the sidecar's default and engine")  # fmt: skip
    args = parser.parse_args(argv)
    booking, other_booking = args.kv_decode_booking
    settings = VllmSettings()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        work = Path(tmp)
        keys = work / "keys.yaml"
        keys.write_text(yaml.safe_dump(KEYS))
        with _engine(args.engine, work, settings) as engine:
            print(f"engine: vLLM {engine.model}, {engine.kv_blocks} blocks of "
                  f"{engine.block_size_tokens} tokens, max-num-seqs {settings.max_num_seqs}, "
                  f"started in {engine.startup_seconds:.0f} s")  # fmt: skip
            batch = settings.max_num_seqs
            # 1. calibrate: a ramp of load, adapted to the engine, through the sidecar under
            # hand-set coefficients
            steps: list[RampStep] = []
            warm = through_sidecar(
                engine, work, "calibrate", None, keys, HAND_SET,
                drive=lambda sidecar, client: run_ramp(
                    sidecar, work, client, keys, args.duration_ms / 5, args.seed, batch, steps
                ),
            )  # fmt: skip
            calibration = calibrate_phase(warm, batch)
            base = replace_policy(_config_of(engine), **WAITS)
            if isinstance(calibration, str):
                # Unusable: said as a missed target, and the run goes on with the hand-set
                # coefficients the calibration phase ran with.
                overrides = [f"{_FIELD_NAMES[k]}={v:g}" for k, v in HAND_SET.items()
                             if k in _FIELD_NAMES]  # fmt: skip
                print("calibration FAILED; going on with the hand-set coefficients: "
                      + " ".join(overrides))  # fmt: skip
            else:
                overrides = calibration.overrides()
                print("calibrated from records under load: " + " ".join(overrides))
            calibrated = apply_overrides(base, overrides).policy
            capacity = calibrated.service_tokens_per_ms  # service tokens per ms at the full batch
            batch_cost = BATCH_PROMPT + calibrated.decode_weight * BATCH_OUTPUT
            batch_rps = args.flood * capacity * 1000.0 / batch_cost
            flood_trace = work / "flood-trace.jsonl"
            generate_trace(flood_trace, args.duration_ms, args.seed + 1, batch_rps,
                           args.interactive_rps)  # fmt: skip
            print(f"flood: {BATCH} at {batch_rps:.2f} requests/s ({args.flood:g} x "
                  f"{capacity:.2f} service tokens per ms), interactive tenants at "
                  f"{args.interactive_rps:g}/s each")  # fmt: skip
            # 2. direct
            direct_client = work / "direct.jsonl"
            direct_preempted = engine_preemptions(engine)
            loadgen(engine.base_url, flood_trace, direct_client, engine.model, keys)
            direct = read_lines(direct_client)
            direct_preempted = engine_preemptions(engine) - direct_preempted
            # 3. calibrated, 4. hand-set
            calibrated_fields = {
                "service_tokens_per_ms": calibrated.service_tokens_per_ms,
                "max_batch_requests": calibrated.max_batch_requests,
                "batch_throughput_gain": calibrated.batch_throughput_gain,
                "decode_weight": calibrated.decode_weight,
                "prefill_tokens_per_ms": calibrated.prefill_tokens_per_ms,
                **WAITS,
            }
            fitted = through_sidecar(engine, work, "calibrated", flood_trace, keys,
                                     calibrated_fields,
                                     sidecar_settings={"kvDecodeBooking": booking})  # fmt: skip
            other = None
            if other_booking is not None:
                other = through_sidecar(
                    engine, work, f"calibrated-{other_booking}", flood_trace, keys,
                    calibrated_fields, sidecar_settings={"kvDecodeBooking": other_booking},
                )  # fmt: skip
            hand = through_sidecar(engine, work, "hand-set", flood_trace, keys, dict(WAITS))
            replayed = apply_overrides(base, overrides)
            queue = None if isinstance(calibration, str) else calibration.prefill_queue
            speed = None if queue is None else queue.prefill_tokens_per_ms
            overhead_ms = 0.0 if queue is None else queue.prefill_overhead_ms
            floor_ms = replayed.policy.prefill_floor_ms
            comparison = (
                compare(fitted.records_path, replayed, prefill_tokens_per_ms=speed,
                        prefill_overhead_ms=overhead_ms),
                compare(fitted.records_path, replayed, facts=False),
                first_tokens_on_live_dispatch(fitted.records, speed, floor_ms, overhead_ms),
            )  # fmt: skip
            if args.keep:
                _keep(work, Path(args.keep))
        print_calibration(warm, calibration, steps)
        print(f"\ncalibrated phase: kvDecodeBooking {booking}; vLLM preemptions direct "
              f"{direct_preempted:.0f}")  # fmt: skip
        print_report(args, direct, fitted, hand, comparison, calibrated)
        if other is not None:
            print_booking_comparison({booking: fitted, str(other_booking): other}, calibrated)
    return 0


def _bookings(text: str) -> tuple[str, str | None]:
    """``--kv-decode-booking``: the calibrated phase's mode and the one compared with it (None:
    none). ``both``: the sidecar's default and ``engine``."""
    if text == "both":
        return SidecarSettings().kv_decode_booking, "engine"
    modes = text.split(",")
    if (
        len(modes) > 2
        or len(set(modes)) != len(modes)
        or any(mode not in KV_DECODE_BOOKING_MODES for mode in modes)
    ):
        raise argparse.ArgumentTypeError(
            f"one of {', '.join(KV_DECODE_BOOKING_MODES)}, two of them (A,B) or both (got {text!r})"
        )
    return modes[0], modes[1] if len(modes) == 2 else None


def print_booking_comparison(phases: dict[str, Phase], calibrated: PolicyConfig) -> None:
    """The calibrated policy under each ``kvDecodeBooking`` (same engine, same trace, phases
    run one after the other): the figures the choice trades."""
    print()
    print("kvDecodeBooking, the calibrated policy under each (same engine, same trace):")
    rows: list[tuple[str, Callable[[Phase], str]]] = [
        ("capacity refusals while the engine had a slot and KV for it",
         lambda ph: str(capacity_refusals_with_room(ph, calibrated.max_batch_requests,
                                                    calibrated))),
        ("  the same, the engine's KV alone below the watermark",
         lambda ph: str(capacity_refusals_with_room(ph, calibrated.max_batch_requests,
                                                    calibrated, False))),
        ("vLLM preemptions (num_preemptions_total growth)", lambda ph: f"{ph.preemptions:.0f}"),
        ("interactive TTFT p50 / p99 (ms)",
         lambda ph: f"{p(interactive_ttfts(ph.client), 0.5):.0f} / "
                    f"{p(interactive_ttfts(ph.client), 0.99):.0f}"),
        ("service tokens served",
         lambda ph: str(sum(r["service_tokens"] for r in ph.records if r["status_code"] == 200))),
        ("requests served / sent",
         lambda ph: f"{sum(1 for c in ph.client if c['status_code'] == 200)}/{len(ph.client)}"),
        ("admitted then expired", lambda ph: _expired(ph)),
        ("engine KV p50 / max (of the cache)",
         lambda ph: f"{p(sorted(s['engine_kv'] for s in ph.samples), 0.5):.2f} / "
                    f"{max((s['engine_kv'] for s in ph.samples), default=math.nan):.2f}"),
        ("engine running p50 / max",
         lambda ph: f"{p(sorted(s['engine_running'] for s in ph.samples), 0.5):.0f} / "
                    f"{max((s['engine_running'] for s in ph.samples), default=math.nan):.0f}"),
    ]  # fmt: skip
    names = list(phases)
    print(f"  {'':<58} " + " ".join(f"{n:>22}" for n in names))
    for label, figure in rows:
        print(f"  {label:<58} " + " ".join(f"{figure(phases[n]):>22}" for n in names))


def _expired(phase: Phase) -> str:
    admitted = [r for r in phase.records if r["gate"] != "admission"]
    expired = sum(1 for r in admitted if r["reason"] == "shed_queue_timeout")
    return f"{expired}/{len(admitted)}"


# The coefficients the calibration phase runs with, and the calibrated phase falls back to when
# the fit is unusable: this engine's batch, and a guess of its speed.
HAND_SET: Final = {"max_batch_requests": 16, "batch_throughput_gain": 4.0,
                   "service_tokens_per_ms": 6.0, **WAITS}  # fmt: skip
_FIELD_NAMES: Final = {"max_batch_requests": "maxBatchRequests",
                       "batch_throughput_gain": "batchThroughputGain",
                       "service_tokens_per_ms": "serviceTokensPerMs"}  # fmt: skip


@contextlib.contextmanager
def _engine(url: str | None, work: Path, settings: VllmSettings) -> Iterator[VllmServer]:
    """The engine the bench runs against: started here (``make vllm``'s install), or the one
    at ``url`` (its facts read back and checked against ``settings``)."""
    if url is None:
        install = find_install()
        if isinstance(install, str):
            raise SystemExit(install)
        with running_vllm(install, work, settings) as engine:
            yield engine
        return
    engine = VllmServer(base_url=url.rstrip("/"), model=settings.served_model_name,
                        block_size_tokens=0, kv_blocks=0, max_model_len_tokens=0,
                        settings=settings, log_path=work / "vllm.log")  # fmt: skip
    read_facts(engine)
    yield engine


def run_ramp(sidecar: EngineSidecar, work: Path, client: Path, keys: Path, step_ms: float,
             seed: int, batch: int, steps: list[RampStep]) -> dict[str, Any]:  # fmt: skip
    """The calibration ramp (:func:`next_factor`) through ``sidecar``, one loadgen a step;
    every step's clients' records appended to ``client``. Fills ``steps``."""
    report: dict[str, Any] = {}
    client.write_text("")
    while len(steps) < RAMP_MAX_STEPS:
        factor = next_factor(steps, batch)
        if factor is None:
            break
        index = len(steps)
        trace = work / f"calibration-trace-{index}.jsonl"
        step_trace(trace, step_ms, seed, factor, index)
        if not trace.read_text().strip():
            steps.append(RampStep(factor, 0, 0, 0, (0.0, 0.0, 0.0)))
            continue
        step_client = work / f"calibration-client-{index}.jsonl"
        report = loadgen(sidecar.proxy, trace, step_client, None, keys)
        steps.append(ramp_step(step_client, factor))
        with client.open("a") as out:
            out.write(step_client.read_text())
        step_client.unlink()
    return report


def calibrate_phase(warm: Phase, batch: int) -> Calibration | str:
    """``tokenfair calibrate`` on the calibration phase's records, or why it cannot."""
    try:
        return calibrate(read_trace(warm.records_path), read_outcomes(warm.records_path),
                         max_batch_requests=batch)  # fmt: skip
    except CalibrationError as exc:
        return str(exc)


def print_calibration(warm: Phase, calibration: Calibration | str,
                      steps: Sequence[RampStep]) -> None:  # fmt: skip
    """The ramp's steps, what the calibration phase's records show, and the fit (or why
    there is none)."""
    records = read_trace(warm.records_path)
    outcomes = read_outcomes(warm.records_path)
    samples, _skipped, _idle = samples_from_records(records, outcomes)
    profile = ConcurrencyProfile(run_spans(records, outcomes))
    seen = sorted(profile.mean(*s.span) for s in samples if s.span is not None)
    print()
    print("calibration (a ramp of load adapted to the engine, varied lengths, through the "
          "sidecar):")  # fmt: skip
    for index, step in enumerate(steps):
        print(f"    step {index}: load x{step.factor:g}, {step.sent} sent, {step.served} served, "
              f"{step.waited} refused or queued > {RAMP_QUEUED_MS:g} ms; concurrency p10 / p50 "
              f"/ p90 {step.concurrency[0]:.1f} / {step.concurrency[1]:.1f} / "
              f"{step.concurrency[2]:.1f}")  # fmt: skip
    if seen:
        print(line("records used; concurrency min / p10 / p50 / p90 / max",
                   f"{len(samples)}; {seen[0]:.1f} / {p(seen, 0.1):.1f} / {p(seen, 0.5):.1f} / "
                   f"{p(seen, 0.9):.1f} / {seen[-1]:.1f}", "-", None))  # fmt: skip
    if isinstance(calibration, str):
        print(line("a usable fit", "none", "a fit", False))
        print(f"    {calibration}")
        return
    service = calibration.service
    weight_error = service.decode_weight_stderr / service.decode_weight
    rate_error = service.service_tokens_per_ms_stderr / service.service_tokens_per_ms
    print(line("a usable fit", f"R² {service.r_squared:.3f}", "a fit", True))
    print(line("decodeWeight, serviceTokensPerMs (relative standard error)",
               f"{weight_error:.0%}, {rate_error:.0%}", "-", None))  # fmt: skip
    queue = calibration.prefill_queue
    if queue is not None:
        print(line("engine prefill, first come first served (prompt tokens/ms + ms a prompt)",
                   f"{queue.prefill_tokens_per_ms:.3g} + {queue.prefill_overhead_ms:.3g} ms "
                   f"(RMS log {queue.rms_log_error:.2f})", "-", None))  # fmt: skip
    for problem in calibration.problems:
        print(f"    problem: {problem}")


def first_tokens_on_live_dispatch(
    records: list[dict[str, Any]], speed: float | None, floor_ms: float, overhead_ms: float = 0.0
) -> tuple[list[float], list[float]]:
    """The engine's first-token model alone, on the live run's own dispatch times: the served
    interactive requests' TTFTs, and those the prefill queue (``EngineFacts``: prompts at the
    engine's count, first come first served at ``speed``, ``overhead_ms`` a prompt) predicts
    from when the sidecar sent
    each request. What it misses is the first-token model's error; the rest of the replay's is
    the dispatch times' (the engine's run times and the sidecar's decisions, replayed)."""
    if speed is None:
        return [], []
    started = sorted(
        (r for r in records
         if r["status_code"] == 200 and r.get("dispatch_ms") is not None
         and r.get("actual_prefill_tokens") and r.get("ttft_ms")),
        key=lambda r: (r["dispatch_ms"], r["request_id"]),
    )  # fmt: skip
    done = -math.inf
    live, predicted = [], []
    for record in started:
        start = record["dispatch_ms"]
        done = max(done, start) + overhead_ms + record["actual_prefill_tokens"] / speed
        if record["priority_class"] == "interactive":
            live.append(record["ttft_ms"])
            predicted.append(start - record["arrival_ms"] + max(floor_ms, done - start))
    return live, predicted


def _config_of(engine: VllmServer) -> Any:
    from engine_support import engine_document

    from tokenfair.config import parse_documents

    document = engine_document(engine)
    document.pop("sidecar", None)
    return parse_documents([document])


def _keep(work: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in work.rglob("*.jsonl"):
        target = dest / path.relative_to(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())


def print_report(args: argparse.Namespace, direct: list[dict[str, Any]], fitted: Phase,
                 hand: Phase, comparison: Any, calibrated: PolicyConfig) -> None:  # fmt: skip
    print()
    print("records match clients (calibrated phase):")
    # The sidecar's record id is <prefix>-<n>-<the client's x-request-id>.
    by_client: dict[str, list[dict[str, Any]]] = {}
    for record in fitted.records:
        by_client.setdefault(record["request_id"].split("-", 2)[-1], []).append(record)
    mismatched = 0
    for client in fitted.client:
        if client["status_code"] != 200:
            continue
        matches = by_client.get(client["request_id"], [])
        if len(matches) != 1 or matches[0]["status_code"] != 200:
            mismatched += 1
    print(line("streams read to the end recorded as anything but 200", str(mismatched), "0",
               mismatched == 0))  # fmt: skip
    served = [r for r in fitted.records if r["status_code"] == 200]
    recorded = (sum(r.get("actual_prefill_tokens") or 0 for r in served),
                sum(r.get("actual_decode_tokens") or 0 for r in served))  # fmt: skip
    print(line("records' prompt / completion tokens vs vLLM's counters",
               f"{recorded[0]:.0f}/{recorded[1]:.0f} vs {fitted.tokens[0]:.0f}/"
               f"{fitted.tokens[1]:.0f}", "equal", recorded == fitted.tokens))  # fmt: skip
    print()
    print("a batch flood beside interactive tenants:")
    direct_ttft = interactive_ttfts(direct)
    fitted_ttft = interactive_ttfts(fitted.client)
    hand_ttft = interactive_ttfts(hand.client)
    ratio = p(fitted_ttft, 0.99) / p(direct_ttft, 0.99)
    print(line("interactive TTFT p50 / p99, direct (ms)",
               f"{p(direct_ttft, 0.5):.0f} / {p(direct_ttft, 0.99):.0f}", "-", None))  # fmt: skip
    print(line("interactive TTFT p50 / p99, through the sidecar (ms)",
               f"{p(fitted_ttft, 0.5):.0f} / {p(fitted_ttft, 0.99):.0f}", "-", None))  # fmt: skip
    print(line("interactive TTFT p99, sidecar / direct", f"{ratio:.3f}", "<= 0.1",
               ratio <= 0.1))  # fmt: skip
    sent = [c for c in fitted.client if c["tenant_id"] in INTERACTIVE]
    ok = [c for c in sent if c["status_code"] == 200]
    share = len(ok) / len(sent) if sent else math.nan
    print(line("interactive requests served (of those sent)", f"{len(ok)}/{len(sent)} "
               f"= {share:.3f}", ">= 0.97", share >= 0.97))  # fmt: skip
    admitted = [r for r in fitted.records if r["gate"] != "admission"]
    expired = [r for r in admitted if r["reason"] == "shed_queue_timeout"]
    expired_share = len(expired) / len(admitted) if admitted else 0.0
    print(line("admitted then expired", f"{len(expired)}/{len(admitted)} = {expired_share:.3f}",
               "<= 0.02", expired_share <= 0.02))  # fmt: skip
    flood_refused = [
        r for r in fitted.records if r["tenant_id"] == BATCH and r["status_code"] != 200
    ]
    late = [r for r in flood_refused if r["gate"] != "admission"]
    late_share = len(late) / len(flood_refused) if flood_refused else 0.0
    print(line("flood refusals decided after waiting (of its refusals)",
               f"{len(late)}/{len(flood_refused)} = {late_share:.3f}", "<= 0.02",
               late_share <= 0.02))  # fmt: skip
    in_flight: list[int] = []
    gated: list[int] = []
    room = capacity_refusals_with_room(fitted, calibrated.max_batch_requests, calibrated,
                                       behind=in_flight, gated=gated)  # fmt: skip
    print(line("capacity refusals while the engine had a slot and KV for it", str(room), "0",
               room == 0))  # fmt: skip
    print(line("  of which with requests on their way to the engine (not in its counts)",
               str(len(in_flight)), "-", None))  # fmt: skip
    print(line("  of which the KV gates (the running requests' decode to come counted) had no "
               "room", str(len(gated)), "-", None))  # fmt: skip
    loose = capacity_refusals_with_room(fitted, calibrated.max_batch_requests, calibrated, False)
    print(line("  the same, the engine's KV alone below the watermark", str(loose), "-", None))
    print()
    print("calibrated vs hand-set (the lesson's coefficients):")
    served_fitted = sum(r["service_tokens"] for r in fitted.records if r["status_code"] == 200)
    served_hand = sum(r["service_tokens"] for r in hand.records if r["status_code"] == 200)
    print(line("service tokens served, calibrated / hand-set", f"{served_fitted} / "
               f"{served_hand}", ">= 1", served_fitted >= served_hand))  # fmt: skip
    print(line("interactive TTFT p99, calibrated / hand-set (ms)",
               f"{p(fitted_ttft, 0.99):.0f} / {p(hand_ttft, 0.99):.0f}", "<= hand-set +10 %",
               p(fitted_ttft, 0.99) <= p(hand_ttft, 0.99) * 1.1))  # fmt: skip
    print()
    print("the sidecar's KV view against the engine's (calibrated phase):")
    # The view read between two reads of the engine: its gap is its distance to the range the
    # engine's figure moved in meanwhile (0 inside it); the engine read before alone beside it.
    bracketed = sorted(_bracket_gap(s) for s in fitted.samples)
    diffs = sorted(abs(s["sidecar_kv"] - s["engine_kv"]) for s in fitted.samples)
    fresh = statistics.fmean(s["sidecar_kv_source_engine"] for s in fitted.samples)
    print(line("|view - engine| p50 / p95 / max (points), engine read before and after",
               f"{100 * p(bracketed, 0.5):.1f} / {100 * p(bracketed, 0.95):.1f} / "
               f"{100 * max(bracketed):.1f}", "p95 <= 5",
               p(bracketed, 0.95) <= 0.05))  # fmt: skip
    print(line("  the same against the engine read before the view only",
               f"{100 * p(diffs, 0.5):.1f} / {100 * p(diffs, 0.95):.1f} / "
               f"{100 * max(diffs):.1f}", "-", None))  # fmt: skip
    windows = sorted(s.get("window_ms", math.nan) for s in fitted.samples)
    print(line("  the reads' window p50 / p95 (ms)", f"{p(windows, 0.5):.0f} / "
               f"{p(windows, 0.95):.0f}", "-", None))  # fmt: skip
    print(line("samples with a fresh engine report", f"{fresh:.3f} of {len(fitted.samples)}",
               "-", None))  # fmt: skip
    # Where the gap is: samples at which the engine counted fewer requests (running and
    # waiting) than the sidecar had sent and not seen end — requests on their way to the
    # engine (or ended there, their last chunks still relayed).
    behind = [
        s
        for s in fitted.samples
        if s.get("sidecar_running", 0.0) > s["engine_running"] + s["engine_waiting"]
    ]
    level = sorted(
        abs(s["sidecar_kv"] - s["engine_kv"])
        for s in fitted.samples
        if s.get("sidecar_running", 0.0) <= s["engine_running"] + s["engine_waiting"]
    )
    if behind and level:
        above = sum(1 for s in behind if s["sidecar_kv"] > s["engine_kv"] + 0.05)
        print(
            line(
                "  samples with requests the engine did not count yet",
                f"{len(behind)} ({above} with the view > 5 points above)",
                "-",
                None,
            )
        )
        print(line("  |view - engine| p50 / p95 over the other samples",
                   f"{100 * p(level, 0.5):.1f} / {100 * p(level, 0.95):.1f}", "-",
                   None))  # fmt: skip
    print()
    print(format_comparison(comparison[0], "the simulator's replay of the calibrated phase"))
    live, predicted = comparison[2]
    print(line("  first come first served prefill on the live dispatch times: p50 / p99 (ms)",
               f"{p(predicted, 0.5):.0f} / {p(predicted, 0.99):.0f} vs {p(live, 0.5):.0f} / "
               f"{p(live, 0.99):.0f}", "-", None))  # fmt: skip
    print(format_comparison(comparison[1], "  the same on the policy's engine alone (the replay "
                                           "before: estimated prompts, no engine KV)"))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
