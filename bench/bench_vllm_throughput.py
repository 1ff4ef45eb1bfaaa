"""What the suite's engine sustains: vLLM's CPU build serving the tiny model (``make vllm``),
driven directly (no sidecar) at concurrency 1, 4 and 16.

Each request is a ``/v1/completions`` call with a prompt of exactly ``--prompt-tokens`` token IDs
(200) and exactly ``--output-tokens`` generated tokens (100: ``max_tokens`` with ``ignore_eos``),
streamed, so its time to first token is seen too. At each concurrency ``c`` the bench keeps ``c``
requests in flight until ``--requests-per-slot x c`` have completed (after one warm-up request),
and reports requests/s, tokens/s and **service tokens per ms** (``prompt + decodeWeight x
output`` per wall-clock ms, ``decodeWeight`` 4 as the policy's default) over the whole level,
with the median TTFT and latency of its requests. Concurrency 1 is the baseline measured in the
same run: the serial server the sidecar's cost model describes (``serviceTokensPerMs``); the
column ``x serial`` is how much more a batching engine serves at that concurrency. There is no
target: these are the figures a capacity model of the engine must reproduce (issue 27).

    .venv/bin/python bench/bench_vllm_throughput.py              # starts its own engine (~2 min)
    .venv/bin/python bench/bench_vllm_throughput.py --url http://127.0.0.1:8000 --model tiny

Token counts are checked against each response's usage; the engine's own counters
(``vllm:prompt_tokens_total``/``vllm:generation_tokens_total``) are compared with the sum.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_support import (
    VllmServer,
    VllmSettings,
    find_install,
    read_facts,
    running_vllm,
    sample,
)

DECODE_WEIGHT: Final = 4.0
"""The policy's default ``decodeWeight``: service tokens = prompt + 4 x output."""
CONCURRENCIES: Final = (1, 4, 16)


@dataclass(frozen=True)
class Outcome:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      prompt_ids: list[int], output_tokens: int) -> Outcome:  # fmt: skip
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft_s = 0.0
    usage: dict[str, int] = {}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not ttft_s and event.get("choices"):
                ttft_s = time.perf_counter() - started
            if event.get("usage"):
                usage = event["usage"]
    return Outcome(
        ttft_s, time.perf_counter() - started, usage["prompt_tokens"], usage["completion_tokens"]
    )


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int
    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    ttft_p50_ms: float
    latency_p50_ms: float

    @property
    def service_tokens_per_ms(self) -> float:
        service = self.prompt_tokens + DECODE_WEIGHT * self.completion_tokens
        return service / (self.wall_s * 1000)


async def run_level(url: str, model: str, concurrency: int, total: int, prompt_tokens: int,
                    output_tokens: int, seed: int) -> Level:  # fmt: skip
    """``total`` requests, ``concurrency`` in flight at a time."""
    outcomes: list[Outcome] = []
    # Distinct prompts (prefix caching is off anyway): IDs 3..1999 of the tiny model's vocabulary.
    prompts = [
        [3 + (seed * 7919 + i * 104729 + j * 31) % 1997 for j in range(prompt_tokens)]
        for i in range(total)
    ]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                outcomes.append(await one_request(session, url, model, prompt, output_tokens))

        await one_request(session, url, model, prompts[0], output_tokens)  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    assert all(o.prompt_tokens == prompt_tokens for o in outcomes)
    assert all(o.completion_tokens == output_tokens for o in outcomes)
    return Level(
        concurrency=concurrency,
        requests=len(outcomes),
        wall_s=wall_s,
        prompt_tokens=sum(o.prompt_tokens for o in outcomes),
        completion_tokens=sum(o.completion_tokens for o in outcomes),
        ttft_p50_ms=statistics.median(o.ttft_s for o in outcomes) * 1000,
        latency_p50_ms=statistics.median(o.latency_s for o in outcomes) * 1000,
    )


def engine_counters(server: VllmServer) -> tuple[float, float]:
    samples = server.metrics()
    return (
        sample(samples, "vllm:prompt_tokens_total", model_name=server.model),
        sample(samples, "vllm:generation_tokens_total", model_name=server.model),
    )


def report(levels: list[Level]) -> None:
    serial = levels[0].service_tokens_per_ms
    print(
        f"{'concurrency':>11} {'requests':>8} {'req/s':>7} {'prompt tok/s':>12} "
        f"{'output tok/s':>12} {'service tok/ms':>14} {'x serial':>8} "
        f"{'TTFT p50 ms':>11} {'latency p50 ms':>14}"
    )
    for level in levels:
        print(
            f"{level.concurrency:>11} {level.requests:>8} {level.requests / level.wall_s:>7.2f} "
            f"{level.prompt_tokens / level.wall_s:>12.0f} "
            f"{level.completion_tokens / level.wall_s:>12.0f} "
            f"{level.service_tokens_per_ms:>14.2f} {level.service_tokens_per_ms / serial:>8.2f} "
            f"{level.ttft_p50_ms:>11.0f} {level.latency_p50_ms:>14.0f}"
        )


async def measure(server: VllmServer, args: argparse.Namespace) -> None:
    before = engine_counters(server)
    levels = []
    for seed, concurrency in enumerate(CONCURRENCIES):
        total = max(args.requests_per_slot * concurrency, args.min_requests)
        levels.append(
            await run_level(server.base_url, server.model, concurrency, total,
                            args.prompt_tokens, args.output_tokens, seed)
        )  # fmt: skip
    after = engine_counters(server)
    print(
        f"vLLM at {server.base_url}, model {server.model}: block size {server.block_size_tokens}, "
        f"{server.kv_blocks} blocks, max model len {server.max_model_len_tokens}, "
        f"max-num-seqs {server.settings.max_num_seqs}; "
        f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens per request"
    )
    report(levels)
    # Each level's warm-up request counts in the engine's counters too.
    sent_prompt = sum(lv.prompt_tokens for lv in levels) + len(levels) * args.prompt_tokens
    sent_output = sum(lv.completion_tokens for lv in levels) + len(levels) * args.output_tokens
    print(
        f"engine counters: prompt +{after[0] - before[0]:.0f} (usage sum {sent_prompt}), "
        f"generation +{after[1] - before[1]:.0f} (usage sum {sent_output})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running vLLM (default: start the suite's engine)")
    parser.add_argument("--model", default="tiny", help="its served model name (with --url)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=12)
    args = parser.parse_args()
    if args.url:
        server = VllmServer(args.url, args.model, 0, 0, 0, VllmSettings(), Path(os.devnull))
        with contextlib.suppress(RuntimeError):  # an engine started otherwise: facts as they are
            read_facts(server)
        asyncio.run(measure(server, args))
        return 0
    install = find_install()
    if isinstance(install, str):
        print(f"bench_vllm_throughput: {install}", file=sys.stderr)
        return 2
    with (
        tempfile.TemporaryDirectory(prefix="tokenfair-vllm-") as workdir,
        running_vllm(install, Path(workdir)) as server,
    ):
        print(f"vLLM healthy in {server.startup_seconds:.1f} s")
        asyncio.run(measure(server, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
