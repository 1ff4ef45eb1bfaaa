"""Research, issue 27: would a KV gate that forecasts the peak of the running requests' blocks
remove `bench_engine.py`'s "capacity refusals with room"? Offline, over a kept run
(`bench_engine.py --keep DIR`: `DIR/<phase>/records.jsonl` and `samples.jsonl`).

    .venv/bin/python bench/kv_peak_forecast.py --keep DIR [--phase calibrated] [--list]

For each refusal `bench_engine.capacity_refusals_with_room` counts (its rule, restated here on
the engine's settings: 512 blocks of 32 tokens, 16 sequences, watermarks 0.90 / 0.65), at its
decision time ``t`` (arrival + queue wait) and the sample nearest it:

* **(a) today's gate**: ``/status`` ``kv.gate_blocks`` (``upfront``: the engine's blocks at its
  last report plus every running request's growth to its full reservation, prompt + max
  decode) with the request's own reservation;
* **the running requests** at ``t`` from the records (served, ``dispatch_ms <= t < arrival +
  e2e``), each with its booked reservation ``ceil((ceil(prefill * ratio) + decode) / block)``
  and its blocks resident at ``t``, ``ceil((prompt + shown) / block)`` (the engine's prompt
  count; ``shown``: the tokens its stream had relayed by ``t``, linear from its first token to
  its end — what the sidecar sees relayed);
* **(c) the peak forecast**: the engine's blocks now plus the largest net growth of the running
  requests before they end, each decoding from ``shown`` to its ``max_tokens`` at one common
  per-request rate (a continuous-batching engine gives every running sequence one token a
  step), freeing its reservation at its end::

      peak = engine_now + max over tau of sum over r alive at tau (blocks_r(tau) - blocks_r(t))

  The maximum is at ``t`` or just before one of the forecast ends, so it is computed at those
  points only: O(r^2) in the running requests with each point's blocks exact (O(r log r) with
  one block of slack a request). With one rate the ends come
  in the order of ``max_tokens - shown`` and the peak does not depend on the rate; a request
  not yet past its prefill starts decoding after the others' lead (its TTFT so far is unknown
  to the gate: ``--prefill-ms``, default the phase's median time from dispatch to first token).
  The new request counts its full reservation from ``t`` (as the gates book their own);
* **(b) the engine's actual KV** at ``t`` and at its most over the new request's would-be
  lifetime (the median dispatch-to-end time of the batch requests served within 10 s of ``t``),
  with the new request's blocks added (its full reservation: an upper bound), against the
  batch watermark and against the whole cache (past it vLLM preempts).

The forecast keeps its peak under the watermark by construction; what the engine would have
reached is that peak's error: the hindsight peak (each running request growing as it did and
ending when it did) with the request's reservation, printed for the refusals the forecast
passes. Also printed: the batch requests queued in the sidecar ahead of each refusal (a gate
with room starts the queue's head, not the refused arrival). What the records cannot show: the
engine's slowdown with one request more running (compute-bound: each request's decode takes
longer), the sidecar's later dispatches a fuller cache would have held back, and the wait
gate's verdict with the lane running faster: a replay (the simulator) or a live run says.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOTAL_BLOCKS = 512  # the suite's engine (tests/vllm_support.py): 512 blocks of 32 tokens
BLOCK_TOKENS = 32
MAX_SEQS = 16
WATERMARKS = {"interactive": 0.90, "batch": 0.65}  # the config's defaults (config/document.py)
CAPACITY_REASONS = {"shed_queue_wait_slo", "shed_queue_timeout", "shed_kv_watermark", "queue_full"}
LIFETIME_WINDOW_MS = 10_000.0


def blocks(tokens: float) -> int:
    """The blocks ``tokens`` of one sequence occupy: ``ceil(tokens / BLOCK_TOKENS)``."""
    return math.ceil(round(tokens, 9) / BLOCK_TOKENS)


@dataclass
class Running:
    """A request running at the decision time, as the gate could see it."""

    prompt_tokens: int  # the engine's count (its blocks now)
    booked_prompt_tokens: int  # the estimate at the gate's prompt ratio (its reservation)
    decode_tokens: int  # max_tokens, as the sidecar booked it
    shown_tokens: float  # relayed by the decision time
    started: bool  # past its first token
    end_ms: float  # its actual end (hindsight: the oracle only)
    first_token_ms: float
    dispatch_ms: float

    @property
    def reservation(self) -> int:
        return blocks(self.booked_prompt_tokens + self.decode_tokens)

    def resident(self, shown: float) -> int:
        return blocks(self.prompt_tokens + min(shown, self.decode_tokens))


def read_lines(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def nearest(times: Sequence[float], at_ms: float) -> int:
    index = min(bisect.bisect_left(times, at_ms), len(times) - 1)
    if index and abs(times[index - 1] - at_ms) < abs(times[index] - at_ms):
        index -= 1
    return index


def own_blocks(record: dict[str, Any], ratio: float) -> int:
    """The request's reservation as the gates book it (``Scheduler._kv_booking``, unclamped)."""
    prompt = math.ceil(round(record["prefill_tokens"] * ratio, 9))
    return blocks(prompt + record["decode_tokens"])


def with_room(record: dict[str, Any], sample: dict[str, float], ratio: float) -> bool:
    """``bench_engine.capacity_refusals_with_room``'s rule for one refusal."""
    klass = record["priority_class"]
    lane_room = klass == "interactive" or sample["batch_running"] < sample["batch_slots"]
    kv = sample["engine_kv"] + own_blocks(record, ratio) / TOTAL_BLOCKS
    return (
        sample["engine_running"] < MAX_SEQS
        and sample["engine_waiting"] == 0
        and kv <= WATERMARKS[klass]
        and lane_room
    )


def running_at(served: list[dict[str, Any]], at_ms: float, ratio: float) -> list[Running]:
    out = []
    for r in served:
        end_ms = r["arrival_ms"] + r["e2e_ms"]
        if not (r["dispatch_ms"] <= at_ms < end_ms):
            continue
        first_ms = r["arrival_ms"] + r["ttft_ms"]
        decoded = r["actual_decode_tokens"]
        if at_ms < first_ms:
            shown = 0.0
        else:
            # linear from the first token (1 shown) to the end (all shown)
            span = max(end_ms - first_ms, 1e-9)
            shown = 1.0 + (decoded - 1) * (at_ms - first_ms) / span
        out.append(
            Running(
                r["actual_prefill_tokens"],
                math.ceil(round(r["prefill_tokens"] * ratio, 9)),
                r["decode_tokens"],
                shown,
                at_ms >= first_ms,
                end_ms,
                first_ms,
                r["dispatch_ms"],
            )
        )
    return out


def peak_growth_blocks(running: Sequence[Running], lag_tokens: float) -> int:
    """The forecast's largest net growth over ``t``: each running request decodes from its
    ``shown`` tokens to ``max_tokens`` at one common rate (in tokens: ``x`` is the tokens every
    started request has added since ``t``; one not yet started adds ``x - lag_tokens``) and
    frees its blocks at its end. Evaluated at ``x = 0`` and just before each end."""
    remaining = []
    for r in running:
        lag = 0.0 if r.started else lag_tokens
        remaining.append(r.decode_tokens - r.shown_tokens + lag)
    now = [r.resident(r.shown_tokens) for r in running]
    best = 0
    for x in sorted({0.0, *remaining}):
        total = 0
        for r, left, held in zip(running, remaining, now, strict=True):
            if left < x:  # ended before (at `left`): its blocks are free
                total -= held
                continue
            lag = 0.0 if r.started else lag_tokens
            total += r.resident(r.shown_tokens + max(0.0, x - lag)) - held
        best = max(best, total)
    return best


def oracle_peak_blocks(running: Sequence[Running], at_ms: float) -> int:
    """Hindsight: the running requests' net growth at its most, each growing as it did (linear
    from its first token to its actual end) and freeing its blocks at its actual end."""
    points = sorted({at_ms, *(r.end_ms - 1e-6 for r in running)})
    now = [r.resident(r.shown_tokens) for r in running]
    best = 0
    for tau in points:
        total = 0
        for r, held in zip(running, now, strict=True):
            if tau >= r.end_ms:
                total -= held
                continue
            if tau < r.first_token_ms:
                shown = 0.0
            else:
                span = max(r.end_ms - r.first_token_ms, 1e-9)
                shown = 1.0 + (r.decode_tokens - 1) * (tau - r.first_token_ms) / span
            total += r.resident(shown) - held
        best = max(best, total)
    return best


def engine_max(
    samples: Sequence[dict[str, float]], times: Sequence[float], start: float, end: float
) -> float:
    lo = bisect.bisect_left(times, start)
    hi = bisect.bisect_right(times, end)
    window = [max(s["engine_kv"], s.get("engine_kv_after", 0.0)) for s in samples[lo:hi]]
    return max(window) if window else samples[nearest(times, start)]["engine_kv"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, required=True, help="a bench_engine.py --keep DIR")
    parser.add_argument("--phase", default="calibrated")
    parser.add_argument(
        "--prefill-ms",
        type=float,
        default=None,
        help="a request not yet past its first token starts decoding this long "
        "after the decision (default: the phase's median dispatch-to-first-"
        "token time)",
    )
    parser.add_argument("--list", action="store_true", help="one line per refusal")
    args = parser.parse_args(argv)
    folder = args.keep / args.phase
    records = read_lines(folder / "records.jsonl")
    samples = sorted(read_lines(folder / "samples.jsonl"), key=lambda s: s["clock_ms"])
    times = [s["clock_ms"] for s in samples]
    served = [r for r in records if r["status_code"] == 200 and r.get("dispatch_ms") is not None]
    batch_served = [r for r in served if r["priority_class"] == "batch"]
    prefill_ms = args.prefill_ms
    if prefill_ms is None:
        prefill_ms = statistics.median(
            r["arrival_ms"] + r["ttft_ms"] - r["dispatch_ms"] for r in batch_served
        )
    # The lag of an unstarted request, in tokens: its prefill at the running requests'
    # median per-request decode rate (tokens per ms from first token to end).
    rate = statistics.median(
        (r["actual_decode_tokens"] - 1) / (r["e2e_ms"] - r["ttft_ms"])
        for r in batch_served
        if r["e2e_ms"] > r["ttft_ms"] and r["actual_decode_tokens"] > 1
    )
    lag_tokens = prefill_ms * rate
    print(
        f"phase {args.phase}: {len(records)} records, {len(samples)} samples; "
        f"per-request decode rate p50 {rate * 1000:.1f} tokens/s, dispatch to first token "
        f"p50 {prefill_ms:.0f} ms (an unstarted request lags {lag_tokens:.0f} tokens)"
    )

    refusals = []
    for record in records:
        if record["reason"] not in CAPACITY_REASONS:
            continue
        at_ms = record["arrival_ms"] + (record.get("queue_wait_ms") or 0.0)
        sample = samples[nearest(times, at_ms)]
        ratio = sample.get("gate_prompt_ratio", 1.0)
        if with_room(record, sample, ratio):
            refusals.append((at_ms, record, sample, ratio))
    refusals.sort(key=lambda item: item[0])
    print(f"capacity refusals with room (bench_engine.py's rule): {len(refusals)}")

    rows = []
    for at_ms, record, sample, ratio in refusals:
        klass = record["priority_class"]
        mark = math.floor(WATERMARKS[klass] * TOTAL_BLOCKS)
        own = own_blocks(record, ratio)
        engine_now = round(sample["engine_kv"] * TOTAL_BLOCKS)
        gate_now = round(sample["sidecar_gate_kv"] * TOTAL_BLOCKS)
        running = running_at(served, at_ms, ratio)
        reservations = sum(r.reservation for r in running)
        resident = sum(r.resident(r.shown_tokens) for r in running)
        upfront = (
            engine_now
            + reservations
            - sum(blocks(r.prompt_tokens + r.shown_tokens) for r in running)
        )
        forecast = engine_now + peak_growth_blocks(running, lag_tokens)
        oracle = engine_now + oracle_peak_blocks(running, at_ms)
        near = [
            r["arrival_ms"] + r["e2e_ms"] - r["dispatch_ms"]
            for r in batch_served
            if abs(r["dispatch_ms"] - at_ms) <= LIFETIME_WINDOW_MS
        ]
        lifetime_ms = (
            statistics.median(near)
            if near
            else statistics.median(
                r["arrival_ms"] + r["e2e_ms"] - r["dispatch_ms"] for r in batch_served
            )
        )
        engine_peak = engine_max(samples, times, at_ms, at_ms + lifetime_ms)
        rows.append(
            {
                "at_ms": at_ms,
                "reason": record["reason"],
                "n": len(running),
                "sidecar_running": sample["sidecar_running"],
                "engine_now": engine_now,
                "resident": resident,
                "gate_now": gate_now,
                "upfront": upfront,
                "reservations": reservations,
                "forecast": forecast,
                "oracle": oracle,
                "own": own,
                "mark": mark,
                "engine_peak": engine_peak,
                "lifetime_ms": lifetime_ms,
                # engine booking's allowance is the fastest stream's rate x its horizon
                "fastest": max(
                    (
                        (r.decode_tokens - 1) / max(r.end_ms - r.first_token_ms, 1e-9)
                        for r in running
                        if r.started
                    ),
                    default=0.0,
                ),
                "queued": sum(
                    1 for r in batch_served if r["arrival_ms"] <= at_ms < r["dispatch_ms"]
                ),
            }
        )

    def frac(b: float) -> str:
        return f"{b / TOTAL_BLOCKS:.3f}"

    if args.list:
        print(
            "t_ms reason n sidecar_n | engine resident gate(upfront) recomputed sum_res | "
            "forecast oracle +own | engine_max_life(+own) life_ms | queued"
        )
        for w in rows:
            print(
                f"{w['at_ms']:9.0f} {w['reason'][:14]:14} {w['n']:2d} {w['sidecar_running']:2.0f}"
                f" | {frac(w['engine_now'])} {frac(w['resident'])} {frac(w['gate_now'])} "
                f"{frac(w['upfront'])} {frac(w['reservations'])}"
                f" | {frac(w['forecast'])} {frac(w['oracle'])} +{frac(w['own'])}"
                f" | {w['engine_peak']:.3f} ({w['engine_peak'] + w['own'] / TOTAL_BLOCKS:.3f})"
                f" {w['lifetime_ms']:5.0f} | "
                f"{w['queued']}"
            )

    def dist(key: str) -> str:
        values = sorted(w[key] / TOTAL_BLOCKS for w in rows)
        if not values:
            return "-"
        return f"{values[0]:.3f} / {statistics.median(values):.3f} / {values[-1]:.3f}"

    n = len(rows)
    if not n:
        return 0
    print("of the cache, min / p50 / max over the refusals:")
    for key, name in [
        ("engine_now", "engine's KV at the decision (sample)"),
        ("gate_now", "(a) today's gates, /status kv.gate_blocks"),
        ("upfront", "(a') the same recomputed: engine + running reservations - resident"),
        ("forecast", "(c) peak forecast: engine + largest net growth"),
        ("oracle", "(c') hindsight peak: actual ends"),
    ]:
        print(f"  {name:70} {dist(key)}")
    growth_upfront = [w["upfront"] - w["engine_now"] for w in rows]
    growth_forecast = [w["forecast"] - w["engine_now"] for w in rows]
    growth_oracle = [w["oracle"] - w["engine_now"] for w in rows]
    print(
        "  decode to come the gates count, blocks p50: upfront "
        f"{statistics.median(growth_upfront):.0f}, forecast peak "
        f"{statistics.median(growth_forecast):.0f}, hindsight "
        f"{statistics.median(growth_oracle):.0f}"
    )
    gate_refused = sum(1 for w in rows if w["gate_now"] + w["own"] > w["mark"])
    passed = [w for w in rows if w["forecast"] + w["own"] <= w["mark"]]
    passed_oracle = sum(1 for w in rows if w["oracle"] + w["own"] <= w["mark"])
    under = sum(1 for w in rows if w["forecast"] < w["oracle"])
    gated_passed = sum(1 for w in passed if w["gate_now"] + w["own"] > w["mark"])
    errors = sorted(w["oracle"] - w["forecast"] for w in rows)
    print(
        f"hindsight - forecast, blocks: min {errors[0]}, p50 {statistics.median(errors):.0f}, "
        f"max {errors[-1]}"
    )
    fastest = sorted(w["fastest"] * 1000.0 for w in rows)
    print(
        "the fastest running stream at the refusal (its tokens/s, first token to end): min "
        f"{fastest[0]:.1f}, p50 {statistics.median(fastest):.1f}; under 49 tokens/s "
        f"(engine booking's 3.25 s allowance under 160 tokens) in "
        f"{sum(1 for f in fastest if f < 160 / 3.25)}"
    )
    queued = sorted(w["queued"] for w in rows)
    print(
        f"batch requests queued in the sidecar ahead of the refusal: min {queued[0]}, p50 "
        f"{statistics.median(queued):.0f}, max {queued[-1]}; none queued in "
        f"{sum(1 for q in queued if q == 0)}"
    )
    for w in rows:
        if w["forecast"] + w["own"] > w["mark"]:
            print(
                f"  no room by the forecast at {w['at_ms']:.0f} ms: engine "
                f"{frac(w['engine_now'])}"
                f", forecast {frac(w['forecast'])} + {frac(w['own'])}, {w['n']} running"
            )
    print(f"today's gates past the watermark with the request: {gate_refused} of {n}")
    print(
        f"a peak-forecast gate has room (alone, each refusal on its own): {len(passed)} of {n}"
        f" (hindsight peak: {passed_oracle}); of today's {gate_refused} "
        f"gated, {gated_passed}; forecast below the hindsight peak in {under}"
    )
    over_mark = sum(
        1 for w in passed if w["engine_peak"] + w["own"] / TOTAL_BLOCKS > WATERMARKS["batch"]
    )
    over_cache = sum(1 for w in passed if w["engine_peak"] + w["own"] / TOTAL_BLOCKS > 1.0)
    worst = max((w["engine_peak"] + w["own"] / TOTAL_BLOCKS for w in passed), default=0.0)
    print(
        f"  of those, the engine's KV at its most over the lifetime + the request's reservation:"
        f" past the batch watermark {over_mark}, past the cache {over_cache}, at most {worst:.3f}"
    )
    hind = [(w["oracle"] + w["own"]) / TOTAL_BLOCKS for w in passed]
    print(
        f"  of those, the hindsight peak with the request (the engine's KV at its most had the "
        f"gate started it): at most {max(hind, default=0.0):.3f}, past the batch watermark in "
        f"{sum(1 for h in hind if h > WATERMARKS['batch'])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
