"""Does the batch lane's wait prediction keep to a KV-bound lane? Admitted-then-expired in a replay.

Not part of the test suite (issue 27). The simulator's batching replay of a flood on an engine
shaped like the suite's vLLM (``maxBatchRequests`` 16, ``totalKvBlocks`` 512 of 32 tokens, the
batch watermark 0.65, ``maxBatchWaitMs`` 15 s): a batch tenant sends requests of 1,600 prompt
and 160 output tokens (55 blocks: the watermark's 332.8 blocks hold 6 of them, not 16) at
``--flood`` times the engine's throughput, two interactive tenants short chats at 0.2/s each.
Printed per variant: the batch requests admitted, those of them that then expired in the queue
(``shed_queue_timeout``; issue 27's target <= 2 %), the flood's refusals and how many of them
came after waiting (target: at the door), the batch queue wait p50 / p90.

    .venv/bin/python bench/bench_batch_kv_wait.py
    git archive main sidecar | tar -x -C DIR   # the tree before, in the same run:
    .venv/bin/python bench/bench_batch_kv_wait.py --before DIR/sidecar

``--before DIR`` runs the same replay again in a subprocess on the sources in ``DIR``, so both
variants come from one invocation. Both run on the interpreted core (``TOKENFAIR_NATIVE=0``,
set by the script: the wait correction is instrumented by replacing the method, which the
compiled core calls directly; the decisions are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import compiled_core  # noqa: F401  (the compiled core, before the first tokenfair import)

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request
from tokenfair.core.jobs import LANE_BATCH, SHED_QUEUE_TIMEOUT, STATUS_OK
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.sim.report import percentile
from tokenfair.sim.simulator import Arrival, EngineFacts, replay

REPO = Path(__file__).resolve().parent.parent


def arrivals(
    seed: int, duration_ms: float, flood: float, rate: float, decode_weight: float
) -> list[Arrival]:
    """A Poisson flood of batch requests at ``flood`` times the engine's throughput ``rate``
    (service tokens per ms), and two interactive tenants' chats (200 + 32) at 0.2/s each."""
    rng = random.Random(seed)
    batch_tokens = 1600 + decode_weight * 160
    events: list[tuple[float, str, str, int, int]] = []
    clock_ms = 0.0
    batch_gap_ms = batch_tokens / (flood * rate)
    while True:
        clock_ms += rng.expovariate(1.0 / batch_gap_ms)
        if clock_ms >= duration_ms:
            break
        events.append((clock_ms, "rag", "batch", 1600, 160))
    for tenant in ("chat", "ide"):
        clock_ms = 0.0
        while True:
            clock_ms += rng.expovariate(0.2 / 1000.0)
            if clock_ms >= duration_ms:
                break
            events.append((clock_ms, tenant, "interactive", 200, 32))
    events.sort(key=lambda e: e[0])
    out: list[Arrival] = []
    for i, (at_ms, tenant, lane, prefill, decode) in enumerate(events):
        request = Request(f"r{i:05d}", tenant, at_ms, prefill, decode, lane)  # type: ignore[arg-type]
        out.append((request, None, None))
    return out


def run(args: argparse.Namespace) -> dict[str, object]:
    policy = PolicyConfig(
        max_batch_requests=16,
        batch_throughput_gain=args.gain,
        service_tokens_per_ms=args.rate,
        total_kv_blocks=512,
        kv_block_tokens=32,
        batch_kv_watermark=0.65,
        max_batch_wait_ms=15_000.0,
        decode_weight=args.decode_weight,
    )
    big = 10**12
    tenants = [
        TenantConfig("rag", 1.0, big, big, "batch"),
        TenantConfig("chat", 1.0, big, big, "interactive"),
        TenantConfig("ide", 1.0, big, big, "interactive"),
    ]
    config = build_config(policy, tenants)
    # The batch lane's wait correction at each of its reads (its mean: how far the model's
    # waits were from the waits that came); `--model-alone` holds it at 1 (the model alone,
    # as at the start of a live phase, before the correction has seen a wait).
    corrections: list[float] = []
    measured = TokenfairScheduler.wait_correction

    def correction(self: TokenfairScheduler, lane: int, now_ms: float) -> float:
        value = 1.0 if args.model_alone else measured(self, lane, now_ms)
        if lane == LANE_BATCH:
            corrections.append(value if not args.model_alone else measured(self, lane, now_ms))
        return value

    TokenfairScheduler.wait_correction = correction  # type: ignore[method-assign]
    trace = arrivals(args.seed, args.duration_ms, args.flood, args.rate, args.decode_weight)
    admitted = expired = refused = 0
    waits: list[float] = []
    interactive_ok = interactive = 0
    facts = None
    if args.engine_facts:
        prompts = {request.request_id: request.prefill_tokens for request, _, _ in trace}
        facts = EngineFacts(prompts, 512, 250.0, args.engine_prefill_tokens_per_ms)
    for decision, _used in replay(config, trace, "tokenfair", facts):
        if decision.priority_class == "interactive":
            interactive += 1
            interactive_ok += decision.status_code == STATUS_OK
            continue
        if decision.gate == "admission":
            refused += 1
            continue
        admitted += 1
        if decision.reason == SHED_QUEUE_TIMEOUT:
            expired += 1
        else:
            waits.append(decision.queue_wait_ms)
    waits.sort()
    return {
        "batch_admitted": admitted,
        "admitted_then_expired": expired,
        "flood_refusals": refused + expired,
        "batch_wait_p50_ms": percentile(waits, 50) if waits else 0.0,
        "batch_wait_p90_ms": percentile(waits, 90) if waits else 0.0,
        "interactive_served": f"{interactive_ok}/{interactive}",
        "mean_wait_correction": sum(corrections) / max(1, len(corrections)),
    }


def show(name: str, result: dict[str, object]) -> None:
    admitted = int(str(result["batch_admitted"]))
    expired = int(str(result["admitted_then_expired"]))
    refusals = int(str(result["flood_refusals"]))
    print(
        f"{name:>7}: batch admitted {admitted}, then expired {expired} "
        f"({expired / max(1, admitted):.3f}), flood refusals after waiting "
        f"{expired}/{refusals}, batch queue wait p50/p90 "
        f"{float(str(result['batch_wait_p50_ms'])):.0f}/{float(str(result['batch_wait_p90_ms'])):.0f}"
        f" ms, interactive served {result['interactive_served']}, batch wait correction "
        f"mean {float(str(result['mean_wait_correction'])):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--duration-ms", type=float, default=600_000.0)
    parser.add_argument("--flood", type=float, default=1.5, help="times the engine's throughput")
    parser.add_argument("--rate", type=float, default=18.15, help="serviceTokensPerMs")
    parser.add_argument("--gain", type=float, default=2.5, help="batchThroughputGain")
    parser.add_argument("--decode-weight", type=float, default=33.0, help="decodeWeight")
    parser.add_argument(
        "--engine-facts", action="store_true", help="the engine's KV and prefill queue too"
    )
    parser.add_argument("--engine-prefill-tokens-per-ms", type=float, default=8.5)
    parser.add_argument(
        "--model-alone", action="store_true", help="the batch lane's wait correction held at 1"
    )
    parser.add_argument("--before", type=Path, help="a tree's sidecar/ to replay beside this")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.environ.get("TOKENFAIR_NATIVE") != "0":
        # The wait correction is instrumented by replacing the method: the compiled core calls
        # it directly, so the replay runs on the interpreted core (the same decisions).
        env = {**os.environ, "TOKENFAIR_NATIVE": "0"}
        os.execve(
            sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env
        )
    if args.json:
        print(json.dumps(run(args)))
        return
    if args.before is not None:
        argv = [a for a in sys.argv[1:] if not a.startswith("--before")]
        if "--before" in sys.argv:
            index = sys.argv.index("--before")
            argv = sys.argv[1:index] + sys.argv[index + 2 :]
        env = {**os.environ, "PYTHONPATH": str(args.before), "TOKENFAIR_NATIVE": "0"}
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *argv, "--json"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            cwd=str(args.before),
        ).stdout
        show("before", json.loads(out))
    show("this", run(args))


if __name__ == "__main__":
    main()
