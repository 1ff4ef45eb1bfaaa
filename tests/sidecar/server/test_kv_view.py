"""The sidecar's view of the engine's KV cache, against a fake engine that streams on command.

Behaviours under test:

- without the engine's metrics (``engineMetrics: off``) the view follows the running stream: a
  request holds its prompt's blocks until tokens arrive, then one more block per ``block``
  tokens relayed (``/status`` ``kv.view_blocks``, ``tokenfair_kv_view_ratio``), while the books
  and the gates keep its whole reservation (prompt and ``max_tokens``); the view is empty when
  it ends; the prompt usage the engine reported teaches the view the engine's prompt count
  (``kv.prompt_ratio``), and the gates book the next request's prompt at it
  (``kv.gate_prompt_ratio``);
- the prompt ratio in the books: once the engine has reported prompts twice the estimate, a
  burst of requests that fit under the watermark at the estimate is dispatched only as far as
  they fit at the engine's count, the rest wait in the sidecar's queue (all of them run with
  ``kvPromptRatio: off``); the records keep the estimate;
- with them, the gates count the running requests' decode growth: a request that fits what the
  engine holds now but not once the running one has decoded its ``max_tokens`` waits while
  fresh reports come in, and starts when the running one ends; at a report the view is what the
  engine said; blocks the engine holds for another client count in the gates;
- ``kvDecodeBooking: engine``: the gates count a running stream's decode only to what it may
  decode before the next report (an allowance learned from the streams' rate), and a request
  dispatched meanwhile at its prompt and that allowance: the second request above starts while
  the first runs; its growth to the next report counted, a request ending between reports
  frees what the gates counted for it (never blocks another client holds: a positive
  correction stays); the allowance covers the time until the report is declared stale
  (``engineMetricsStaleSeconds`` and one failed poll), not two intervals only; the lesson's
  policies take no allowance; stale metrics: its reservation in full again;
- stale metrics: the gates fall back to the books and the view to the model, visibly
  (``kv.source: books``, ``engine.fresh``);
- the model on the core's objects: an unstarted stream holds its prompt only if the engine's
  report ran it (its running count less ours that streamed), nothing otherwise or if sent
  since, until its first token; the gates take as held only what streamed, so a report taken
  before the engine sees a burst credits nothing; the ``costmodel`` engine's view is the books
  (its chunks are not tokens).

The engine is a real aiohttp server on loopback whose tokens are released by the test; waits
are on conditions (generous deadlines), never on a duration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestServer
from sidecar_support import (
    CHAT,
    IDE,
    PATIENT_POLICY,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    keyed_config,
    records_of,
    start,
)

from tokenfair.config import Config, PolicyConfig
from tokenfair.core import Request, Scheduler, make_scheduler
from tokenfair.server import kv_view as kv_view_module
from tokenfair.server.kv_view import KvView, StreamProgress, peak_credits
from tokenfair.server.runtime_settings import SidecarSettings

pytestmark = pytest.mark.virtual_time

ServerFactory = Callable[..., Awaitable[TestServer]]

BLOCK = 32
BLOCKS = 200
ENGINE_PROMPT = 40
"""Prompt tokens the fake engine holds per request (its own count; the sidecar's estimate
differs, and the engine's report corrects it)."""


class StreamingEngine:
    """A fake vLLM: each chat stream sends the tokens the test releases; ``/metrics`` reports
    the blocks its streams hold (``ceil((prompt + decoded) / 32)`` each) and ``outside``."""

    def __init__(self) -> None:
        self.decoded: dict[int, int] = {}
        self.queues: dict[int, asyncio.Queue[int | None]] = {}
        self.outside = 0
        """Blocks held for a client other than the sidecar."""
        self.prompt = ENGINE_PROMPT
        """The prompt tokens it holds and reports per request (its tokenizer's count)."""
        self.metrics_status = 200
        self.metrics_served = 0
        self._next = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def used_blocks(self) -> int:
        held = sum(-(-(self.prompt + d) // BLOCK) for d in self.decoded.values())
        return held + self.outside

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="down")
        self.metrics_served += 1
        page = (
            f'vllm:kv_cache_usage_perc{{model_name="tiny"}} {self.used_blocks() / BLOCKS}\n'
            f'vllm:num_requests_running{{model_name="tiny"}} {len(self.decoded)}\n'
            'vllm:num_requests_waiting{model_name="tiny"} 0\n'
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="{BLOCKS}"}} 1.0\n'
        )
        return web.Response(text=page, content_type="text/plain")

    def release(self, tokens: int | None) -> None:
        """Every open stream sends ``tokens`` more (None: its usage and ``[DONE]``)."""
        for queue in self.queues.values():
            queue.put_nowait(tokens)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        number = self._next = self._next + 1
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.queues[number] = queue
        self.decoded[number] = 0
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            while (tokens := await queue.get()) is not None:
                for _ in range(tokens):
                    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
                    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.decoded[number] += 1
            usage = {"prompt_tokens": self.prompt, "completion_tokens": self.decoded[number]}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                 "data: [DONE]\n\n".encode())  # fmt: skip
        finally:
            del self.queues[number], self.decoded[number]
        await response.write_eof()
        return response


async def eventually(condition: Callable[[], Awaitable[bool]], budget_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while not await condition():
        assert loop.time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


async def kv_of(clients: Clients) -> dict[str, Any]:
    return dict((await (await clients.admin.get("/status")).json())["kv"])


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there, " * 6}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def read_events(response: ClientResponse, count: int) -> None:
    """Read ``count`` SSE events of a stream."""
    for _ in range(count):
        line = await response.content.readline()
        assert line.startswith(b"data: "), line
        assert await response.content.readline() == b"\n"


async def start_sidecar(
    aiohttp_client: ClientFactory,
    aiohttp_server: ServerFactory,
    engine: StreamingEngine,
    engine_metrics: str,
    kv_prompt_ratio: str = "learned",
    records_path: str | None = None,
    kv_decode_booking: str = "upfront",
    **policy_changes: Any,
) -> Clients:
    server = await aiohttp_server(engine.app())
    settings = SidecarSettings(
        backend="openai",
        upstream_url=str(server.make_url("")).rstrip("/"),
        engine_metrics=engine_metrics,
        engine_metrics_interval_s=0.02,
        engine_metrics_stale_s=0.2,
        kv_prompt_ratio=kv_prompt_ratio,
        records_path=records_path,
        kv_decode_booking=kv_decode_booking,
    )
    policy = dataclasses.replace(
        PATIENT_POLICY,
        kv_block_tokens=BLOCK,
        total_kv_blocks=BLOCKS,
        max_batch_requests=8,
        max_interactive_wait_ms=600_000,
    )
    policy = dataclasses.replace(policy, **policy_changes)
    return await start(aiohttp_client, keyed_config(policy), settings)


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


async def test_without_the_engines_metrics_the_view_follows_the_stream(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    engine = StreamingEngine()
    clients = await start_sidecar(aiohttp_client, aiohttp_server, engine, "off")
    scheduler = clients.sidecar.scheduler
    sent = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": CHAT}
        )
    )

    async def sent_to_the_engine() -> bool:
        return len(engine.queues) == 1

    await eventually(sent_to_the_engine)
    (job,) = scheduler.jobs.values()
    prompt = job.request.prefill_tokens
    kv = await kv_of(clients)
    # Sent, nothing streamed: it may wait in the engine's queue, and no report says it runs:
    # nothing, where the books and the gates hold prompt + max_tokens.
    assert (kv["source"], kv["view_blocks"]) == ("books", 0)
    assert kv["gate_blocks"] == scheduler.resident_blocks == blocks(prompt + 3000)
    engine.release(100)
    response = await sent
    await read_events(response, 100)
    kv = await kv_of(clients)
    assert kv["view_blocks"] == blocks(prompt + 100)
    assert kv["gate_blocks"] == blocks(prompt + 3000)
    metrics = await (await clients.admin.get("/metrics")).text()
    assert f"tokenfair_kv_view_ratio {blocks(prompt + 100) / BLOCKS}" in metrics
    engine.release(200)
    await read_events(response, 200)
    assert (await kv_of(clients))["view_blocks"] == blocks(prompt + 300)
    engine.release(None)
    await response.read()
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    kv = await kv_of(clients)
    assert kv["view_blocks"] == 0
    # The engine reported 40 prompt tokens for it: the view counts the next one's prompt at
    # the engine's count (the estimate times 40 / estimate), and so do the gates' books.
    ratio = ENGINE_PROMPT / prompt
    assert kv["prompt_ratio"] == kv["gate_prompt_ratio"] == round(ratio, 4)
    sent = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": IDE}
        )
    )
    await eventually(sent_to_the_engine)
    engine.release(50)
    response = await sent
    await read_events(response, 50)
    kv = await kv_of(clients)
    assert kv["view_blocks"] == blocks(math.ceil(prompt * ratio) + 50) == blocks(ENGINE_PROMPT + 50)
    assert kv["gate_blocks"] == blocks(ENGINE_PROMPT + 3000)
    engine.release(None)
    await response.read()
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


@pytest.mark.parametrize("kv_prompt_ratio", ["learned", "off"])
async def test_the_books_count_prompts_at_the_engines_count(
    aiohttp_client: ClientFactory,
    aiohttp_server: ServerFactory,
    tmp_path: Path,
    kv_prompt_ratio: str,
) -> None:
    # The engine's metrics off: the gates are the books alone, so what they book decides.
    engine = StreamingEngine()
    clients = await start_sidecar(
        aiohttp_client, aiohttp_server, engine, "off", kv_prompt_ratio,
        str(tmp_path / "records.jsonl"), max_batch_requests=16,
    )  # fmt: skip
    sidecar = clients.sidecar
    scheduler = sidecar.scheduler
    body = chat_body(32)
    body["messages"][0]["content"] = "hello there, " * 120
    sent = [
        asyncio.create_task(
            clients.proxy.post("/v1/chat/completions", json=body, headers={"Authorization": CHAT})
        )
    ]

    async def in_the_engine(count: int) -> bool:
        return len(engine.queues) == count

    await eventually(lambda: in_the_engine(1))
    (job,) = scheduler.jobs.values()
    estimate = job.request.prefill_tokens
    assert job.kv_prompt_tokens == estimate  # nothing learned yet: the estimate
    engine.prompt = 2 * estimate  # its tokenizer and chat template count twice as many
    engine.release(None)
    await (await sent[0]).read()
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    kv = await kv_of(clients)
    assert kv["prompt_ratio"] == 2.0
    learned = kv_prompt_ratio == "learned"
    assert kv["gate_prompt_ratio"] == (2.0 if learned else 1.0)
    metrics = await (await clients.admin.get("/metrics")).text()
    assert "tokenfair_kv_prompt_ratio 2.0" in metrics
    assert f"tokenfair_kv_gate_prompt_ratio {kv['gate_prompt_ratio']}" in metrics
    # Ten at once: at the estimate all ten fit under the watermark, at the engine's count
    # only `fit` do.
    limit = int(scheduler.policy.interactive_kv_watermark * BLOCKS)
    at_estimate, at_engine = blocks(estimate + 32), blocks(2 * estimate + 32)
    fit = limit // at_engine
    assert fit < 10 <= limit // at_estimate
    sent = [
        asyncio.create_task(
            clients.proxy.post("/v1/chat/completions", json=body, headers={"Authorization": key})
        )
        for key in [CHAT, IDE] * 5
    ]

    async def all_admitted() -> bool:
        return scheduler.running + scheduler.queued_total == 10

    await eventually(all_admitted)
    running = fit if learned else 10
    assert (scheduler.running, scheduler.queued_total) == (running, 10 - running)
    await eventually(lambda: in_the_engine(running))
    booked = at_engine if learned else at_estimate
    assert scheduler.resident_blocks == (await kv_of(clients))["gate_blocks"] == running * booked
    assert {j.kv_prompt_tokens for j in scheduler.jobs.values()} == {
        2 * estimate if learned else estimate
    }
    # The engine holds what the books say (its own count): within the watermark with the
    # ratio, past it at the estimate.
    assert (engine.used_blocks() <= limit) is learned
    while not all(task.done() for task in sent):
        engine.release(None)
        await asyncio.sleep(0.01)
    for task in sent:
        assert (await task).status == 200
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    # The records keep the sidecar's estimate, and the engine's count beside it.
    records = records_of(sidecar)
    assert len(records) == 11
    assert {(r["prefill_tokens"], r["actual_prefill_tokens"]) for r in records} == {
        (estimate, 2 * estimate)
    }


async def test_the_gates_keep_room_for_the_running_requests_decode(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    engine = StreamingEngine()
    clients = await start_sidecar(aiohttp_client, aiohttp_server, engine, "vllm")
    sidecar = clients.sidecar
    scheduler = sidecar.scheduler
    assert scheduler.policy.interactive_kv_watermark == PolicyConfig().interactive_kv_watermark
    limit = int(scheduler.policy.interactive_kv_watermark * BLOCKS)  # 180 blocks
    first = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": CHAT}
        )
    )

    async def running(count: int) -> bool:
        return len(engine.queues) == count and scheduler.running == count

    await eventually(lambda: running(1))
    engine.release(64)
    response = await first
    await read_events(response, 64)
    (job,) = scheduler.jobs.values()
    booked = job.kv_blocks  # prompt + 3000 tokens: ~96 blocks
    assert booked * 2 > limit >= booked + engine.used_blocks()

    async def reported() -> bool:
        kv = await kv_of(clients)
        return bool(kv["source"] == "engine" and kv["view_blocks"] == engine.used_blocks())

    # At a report the view is the engine's (its own prompt count, not the sidecar's estimate).
    await eventually(reported)
    # A second request of the same size fits what the engine holds now (4 blocks), not what it
    # will hold once the first has decoded its max_tokens: it waits, report after report.
    second = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": IDE}
        )
    )

    async def queued() -> bool:
        return scheduler.queued_total == 1

    await eventually(queued)
    polls = engine.metrics_served

    async def reports_went_by() -> bool:
        return engine.metrics_served >= polls + 5

    await eventually(reports_went_by)
    kv = await kv_of(clients)
    assert (scheduler.queued_total, scheduler.running, len(engine.queues)) == (1, 1, 1)
    # The gates: the engine's blocks plus the first's growth to its reservation (booked, less
    # what the model says it holds: its estimated prompt and the 64 tokens relayed).
    prompt = job.request.prefill_tokens
    assert kv["gate_blocks"] == engine.used_blocks() + booked - blocks(prompt + 64)
    # Another client of the engine takes 60 blocks: the gates see them too.
    engine.outside = 60

    async def outside_seen() -> bool:
        kv = await kv_of(clients)
        return bool(kv["gate_blocks"] == engine.used_blocks() + booked - blocks(prompt + 64))

    await eventually(outside_seen)
    engine.outside = 0
    # The first ends: the second starts.
    engine.release(None)
    await response.read()
    await eventually(lambda: running(1))
    assert scheduler.queued_total == 0
    engine.release(None)
    await (await second).read()
    assert await books_when_settled(sidecar) == ZERO_BOOKS


async def test_engine_decode_booking_starts_what_fits_the_engine_now(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    # The previous test's workload with kvDecodeBooking: engine. The second request fits what
    # the engine holds and what the first may decode before the next report: it starts while
    # the first runs (up front, it waited for the first to end).
    engine = StreamingEngine()
    clients = await start_sidecar(
        aiohttp_client, aiohttp_server, engine, "vllm", kv_decode_booking="engine"
    )
    scheduler = clients.sidecar.scheduler
    # The allowance covers the time a report stays fresh: the stale limit (0.2 s) and one
    # failed poll (its 1 s timeout, then the 0.02 s interval).
    assert clients.sidecar.kv_view.stale_after_ms == pytest.approx(1000.0 * (0.2 + 1.0 + 0.02))
    limit = int(scheduler.policy.interactive_kv_watermark * BLOCKS)  # 180 blocks
    first = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": CHAT}
        )
    )

    async def running(count: int) -> bool:
        return len(engine.queues) == count and scheduler.running == count

    await eventually(lambda: running(1))
    engine.release(64)
    response = await first
    await read_events(response, 64)
    (job,) = scheduler.jobs.values()
    assert job.kv_blocks * 2 > limit  # two reservations do not fit the watermark

    polls = engine.metrics_served

    async def reported() -> bool:  # a report taken since the 64 tokens were relayed
        kv = await kv_of(clients)
        return bool(
            engine.metrics_served >= polls + 2
            and kv["source"] == "engine"
            and kv["view_blocks"] == engine.used_blocks()
            and kv["decode_allowance_tokens"] >= BLOCK
        )

    await eventually(reported)
    kv = await kv_of(clients)
    assert kv["decode_booking"] == "engine"
    # The gates: the engine's blocks and the first's allowance, not its max_tokens.
    allowance = kv["decode_allowance_tokens"]
    prompt = job.kv_prompt_tokens
    soon = min(job.kv_blocks, blocks(prompt + 64 + allowance))
    assert kv["gate_blocks"] == engine.used_blocks() + soon - blocks(prompt + 64) < limit
    # /status shows the parts: the books, the correction, the running request's credit.
    assert kv["gate_credit_blocks"] == job.kv_blocks - soon > 0
    credit = kv["gate_credit_blocks"]
    assert kv["gate_blocks"] == scheduler.resident_blocks + kv["correction_blocks"] - credit
    second = asyncio.create_task(
        clients.proxy.post(
            "/v1/chat/completions", json=chat_body(3000), headers={"Authorization": IDE}
        )
    )
    await eventually(lambda: running(2))
    assert scheduler.queued_total == 0
    engine.release(None)
    await response.read()
    await (await second).read()
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_stale_metrics_fall_back_to_the_books_and_the_model(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory
) -> None:
    engine = StreamingEngine()
    engine.outside = 50
    clients = await start_sidecar(aiohttp_client, aiohttp_server, engine, "vllm")

    async def source(name: str, gate: int) -> bool:
        kv = await kv_of(clients)
        return bool(kv["source"] == name and kv["gate_blocks"] == gate)

    await eventually(lambda: source("engine", 50))
    assert (await kv_of(clients))["view_blocks"] == 50
    engine.metrics_status = 503
    await eventually(lambda: source("books", 0))
    status = await (await clients.admin.get("/status")).json()
    assert status["engine"]["fresh"] is False
    assert status["kv"]["view_blocks"] == 0
    metrics = await (await clients.admin.get("/metrics")).text()
    assert "tokenfair_engine_metrics_fresh 0.0" in metrics
    assert "tokenfair_kv_view_ratio 0.0" in metrics


def test_what_the_engine_runs_holds_its_prompt_the_rest_nothing_until_it_streams() -> None:
    # The model alone, on the core's objects: three streams sent (2000-token prompts and 500
    # max_tokens: 79 blocks of 32 booked, 63 of them the prompt), one has streamed 100 tokens.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=8
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    view = KvView()
    progress: dict[str, StreamProgress] = {}

    def send(request_id: str, now_ms: float) -> None:
        request = Request(request_id, "tenant_chat_pro", now_ms, 2000, 500, "interactive")
        assert scheduler.submit(request, now_ms) is None
        assert scheduler.next_dispatch(now_ms) is not None
        tracked = view.track(request_id)
        assert tracked is not None
        progress[request_id] = tracked

    for number in range(3):
        send(f"r{number}", 0.0)
    progress["r0"].relayed(b'data: {"choices":[]}\n\n' * 100)
    prompt = blocks(2000)
    # No report: what has streamed (the others may be waiting in the engine).
    assert view.view_blocks(scheduler) == view.modelled_blocks(scheduler) == blocks(2100)
    # The engine runs 2 and holds 1 waiting: r1 (the older unstarted) is being prefilled.
    view.observe(scheduler, 200, running=2, waiting=1)
    assert view.modelled_blocks(scheduler) == blocks(2100) + prompt
    assert view.view_blocks(scheduler) == 200
    # The gates take as held only what streamed: r1's prompt, which the engine holds, is not
    # a credit (the engine's 200 count it, and r1's reservation counts in full besides).
    assert view.gate_blocks_held(scheduler) == blocks(2100)
    assert scheduler.kv_gate_blocks == 3 * blocks(2500) + 200 - blocks(2100)
    # One sent since: nothing until its first token.
    send("r3", 1.0)
    assert view.view_blocks(scheduler) == 200
    progress["r3"].relayed(b"data: {}\n\n")
    assert view.view_blocks(scheduler) == 200 + blocks(2001)
    # Stale: the books for the gates, the model alone for the view.
    view.observe(scheduler, None)
    assert scheduler.kv_gate_blocks == scheduler.resident_blocks == 4 * blocks(2500)
    assert view.view_blocks(scheduler) == blocks(2100) + blocks(2001)
    # A report with nobody waiting: what is sent next starts at once (its prompt counts
    # before its first token).
    view.observe(scheduler, 300, running=4, waiting=0)
    send("r4", 2.0)
    assert view.view_blocks(scheduler) == 300 + prompt


def test_a_report_before_the_engine_sees_a_request_gives_no_credit() -> None:
    # Six requests dispatched in a burst; the engine reports before it has any of them (0
    # used, 0 running): the gates still see the six reservations in full. (Had their prompts
    # been taken as held, `used - held` would have credited 6 prompts, and the gates let
    # requests in past the watermark while the engine allocated them.)
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    view = KvView()
    for number in range(6):
        request_id = f"r{number}"
        request = Request(request_id, "tenant_chat_pro", 0.0, 2000, 500, "interactive")
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        view.track(request_id)
    view.observe(scheduler, 0, running=0, waiting=0)
    assert scheduler.kv_gate_blocks == scheduler.resident_blocks == 6 * blocks(2500)
    assert view.view_blocks(scheduler) == 0


def test_preempted_streams_hold_nothing_and_held_is_at_most_used() -> None:
    # Four streams sent (2000-token prompts, 500 max_tokens), all have streamed 100 tokens.
    # The engine then reports only 2 running and 2 waiting: it preempted the two newest (vLLM
    # frees their blocks and requeues them, newest first). Counting them as holding their
    # prompt and tokens would make `used - held` undercount and the gates admit past the
    # engine's capacity.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=8
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    view = KvView()
    for number in range(4):
        request_id = f"r{number}"
        request = Request(request_id, "tenant_chat_pro", 0.0, 2000, 500, "interactive")
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        tracked = view.track(request_id)
        assert tracked is not None
        tracked.relayed(b"data: {}\n\n" * 100)
    # r0 and r1 hold their 2100 tokens; r2 and r3 nothing.
    used = 2 * blocks(2100)
    view.observe(scheduler, used, running=2, waiting=2)
    assert scheduler.kv_gate_blocks == 4 * blocks(2500)
    assert view.gate_blocks_held(scheduler, 2, used) == 2 * blocks(2100)
    # Without the running count, all four streamed ones count as held (no preemption seen).
    assert view.gate_blocks_held(scheduler) == 4 * blocks(2100)
    # `held` is at most what the engine reports in use: gates never below the books.
    view.observe(scheduler, blocks(2100), running=4, waiting=0)
    assert scheduler.kv_gate_blocks == scheduler.resident_blocks == 4 * blocks(2500)
    assert view.gate_blocks_held(scheduler, 4, blocks(2100)) == blocks(2100)


def test_the_costmodel_engines_view_is_the_books() -> None:
    # Its stream chunks are no engine's tokens: nothing is followed, the view is the books.
    from tokenfair.core.cost import CostModel
    from tokenfair.server import Sidecar, make_backend

    settings = SidecarSettings()
    sidecar = Sidecar(settings, keyed_config(), make_backend(settings, CostModel()))
    assert sidecar.kv_view.follows_streams is False
    scheduler = sidecar.scheduler
    request = Request("r0", "tenant_chat_pro", 0.0, 2000, 500, "interactive")
    assert scheduler.submit(request, 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    assert sidecar.kv_view.track("r0") is None
    assert sidecar.kv_view.view_blocks(scheduler) == scheduler.resident_blocks > 0


def test_a_stream_holds_its_prompt_as_booked() -> None:
    # The core books a request admitted at a prompt ratio of 2 at twice its estimated prompt;
    # a stream that has shown tokens holds that prompt (not the estimate), so at a report the
    # gates see exactly the engine's blocks plus the growth left to the reservation.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=8
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    scheduler.kv_prompt_ratio = 2.0
    view = KvView()
    request = Request("r0", "tenant_chat_pro", 0.0, 2000, 500, "interactive")
    assert scheduler.submit(request, 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    job = scheduler.jobs["r0"]
    assert (job.kv_prompt_tokens, job.kv_blocks) == (4000, blocks(4500))
    assert request.prefill_tokens == 2000  # the request (and its record) keep the estimate
    tracked = view.track("r0")
    assert tracked is not None
    tracked.relayed(b"data: {}\n\n" * 100)
    assert view.gate_blocks_held(scheduler) == blocks(4100)
    view.observe(scheduler, blocks(4100), running=1, waiting=0)
    assert scheduler.kv_gate_blocks == blocks(4500)


def test_the_400_reads_the_request_and_the_configuration_only() -> None:
    # `request_over_kv_capacity` tells the client never to retry: it must not depend on the
    # learned prompt ratio. A request that fits the watermark at its estimate is never a 400,
    # whatever the ratio, and runs alone on an empty cache: its booking at the ratio is
    # clamped to the watermark (never below the estimate's blocks).
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=8
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    limit = 900  # interactive watermark 0.9 of 1000 blocks
    assert scheduler.policy.interactive_kv_watermark * 1000 == limit
    big = Request("r1", "tenant_chat_pro", 0.0, 16_000, 100, "interactive")
    assert scheduler.cost.kv_blocks(16_000, 100) == blocks(16_100) <= limit < blocks(32_100)
    for ratio in (0.5, 1.0, 2.0, 4.0):
        scheduler.kv_prompt_ratio = ratio
        assert scheduler.never_admissible(big) is None, ratio
    too_big = Request("r2", "tenant_chat_pro", 0.0, 29_000, 100, "interactive")
    for ratio in (0.5, 1.0, 2.0):  # over the watermark at its estimate: a 400 at any ratio
        scheduler.kv_prompt_ratio = ratio
        refusal = scheduler.never_admissible(too_big)
        assert refusal is not None
        assert (refusal.status_code, refusal.reason) == (400, "request_over_kv_capacity")
        assert refusal.observed == {"request_kv_blocks": blocks(29_100), "max_kv_blocks": limit}
    scheduler.kv_prompt_ratio = 2.0
    assert scheduler.submit(big, 0.0) is None  # admitted, not a 429 for ever
    job = scheduler.jobs["r1"]
    assert (job.kv_blocks, job.kv_prompt_tokens) == (limit, limit * BLOCK - 100)
    assert scheduler.next_dispatch(0.0) is not None
    assert scheduler.resident_blocks == limit
    scheduler.complete("r1", 1.0)
    assert scheduler.resident_blocks == scheduler.queued_blocks[0] == 0
    # Under the clamp: the ratio's booking as before. A batch request: its own watermark.
    small = Request("r3", "tenant_chat_pro", 1.0, 2000, 100, "interactive")
    assert scheduler.submit(small, 1.0) is None
    assert (scheduler.jobs["r3"].kv_prompt_tokens, scheduler.jobs["r3"].kv_blocks) == (
        4000, blocks(4100),
    )  # fmt: skip
    batch = Request("r4", "tenant_batch_rag", 1.0, 16_000, 100, "batch")
    assert scheduler.never_admissible(batch) is None
    assert scheduler.submit(batch, 1.0) is None
    batch_limit = math.floor(scheduler.policy.batch_kv_watermark * 1000)
    assert scheduler.jobs["r4"].kv_blocks == batch_limit < blocks(32_100)


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_the_kv_prompt_ratio_is_a_finite_number_above_zero(ratio: float) -> None:
    scheduler = make_scheduler("tokenfair", keyed_config())
    with pytest.raises(ValueError, match=r"Scheduler\.kv_prompt_ratio: must be a finite number"):
        scheduler.kv_prompt_ratio = ratio
    assert scheduler.kv_prompt_ratio == 1.0
    scheduler.kv_prompt_ratio = 1.5
    assert scheduler.kv_prompt_ratio == 1.5


def test_the_gates_prompt_ratio_is_bounded_and_can_be_off() -> None:
    view = KvView()
    view.forget("r0", 100, 1000)  # ten times the estimate: the view believes it
    assert (view.prompt_ratio, view.gate_prompt_ratio) == (10.0, 4.0)
    view.forget("r1", 10_000, 1000)  # decayed sums: (950 + 1000) / (95 + 10000)
    assert view.prompt_ratio == pytest.approx(1950 / 10_095)
    assert view.gate_prompt_ratio == 0.5
    view.forget("r2", 100, None)  # no usage reported: nothing learned
    assert view.prompt_ratio == pytest.approx(1950 / 10_095)
    off = KvView(books_prompt_ratio=False)
    off.forget("r0", 100, 200)
    assert (off.prompt_ratio, off.gate_prompt_ratio) == (2.0, 1.0)
    costmodel = KvView(follows_streams=False)  # no engine behind: the books are the engine
    costmodel.forget("r0", 100, 200)
    assert costmodel.gate_prompt_ratio == 1.0


def test_a_request_on_its_way_to_the_engine_holds_nothing_until_its_intake_delay() -> None:
    # The view's clock is injected (ms). A burst sent to an engine that had room: a report
    # 100 ms later counts none of them (on their way: its HTTP server, tokenizer, next step),
    # so the view learns an intake delay of at least 100 ms and counts a prompt only for a
    # stream on its way longer than that; a report that counts a stream sent 30 ms before
    # pulls the delay down.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    now = [0.0]
    view = KvView(clock=lambda: now[0])
    prompt = blocks(2000)

    def send(request_id: str) -> None:
        request = Request(request_id, "tenant_chat_pro", now[0], 2000, 500, "interactive")
        assert scheduler.submit(request, now[0]) is None
        assert scheduler.next_dispatch(now[0]) is not None
        view.track(request_id)

    view.observe(scheduler, 0, running=0, waiting=0)  # an idle engine: room
    assert view.intake_ms == 0.0
    for number in range(3):
        send(f"r{number}")
    # No delay learned yet: sent to an engine with room, each counts its prompt at once.
    now[0] = 10.0
    assert view.view_blocks(scheduler) == 3 * prompt
    now[0] = 100.0
    view.observe(scheduler, 0, running=0, waiting=0)  # it has none of them yet
    assert view.intake_ms == 100.0
    assert view.view_blocks(scheduler) == 0
    now[0] = 150.0  # on their way longer than the delay: the engine (with room) has them
    assert view.view_blocks(scheduler) == 3 * prompt
    now[0] = 200.0
    view.observe(scheduler, 3 * prompt, running=3, waiting=0)
    assert view.view_blocks(scheduler) == 3 * prompt
    send("r3")
    now[0] = 230.0
    assert view.view_blocks(scheduler) == 3 * prompt  # r3 on its way
    view.observe(scheduler, 4 * prompt, running=4, waiting=0)  # the engine counts r3 already
    assert view.intake_ms == pytest.approx(100.0 + 0.2 * (30.0 - 100.0))
    assert view.view_blocks(scheduler) == 4 * prompt
    # A report with requests waiting in the engine: a stream sent since queues behind them.
    view.observe(scheduler, 4 * prompt, running=3, waiting=1)
    send("r4")
    now[0] = 1000.0
    assert view.view_blocks(scheduler) == 4 * prompt


async def test_a_failure_of_the_view_at_a_requests_end_leaks_nothing(
    aiohttp_client: ClientFactory, aiohttp_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever the KV view raises when a request ends, the request's slot and reservation
    # are released (the view runs before the release, in the proxy's `finally`).
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the view is broken")

    monkeypatch.setattr(KvView, "forget", broken)
    engine = StreamingEngine()
    clients = await start_sidecar(aiohttp_client, aiohttp_server, engine, "off")
    for key in (CHAT, IDE):
        sent = asyncio.create_task(
            clients.proxy.post(
                "/v1/chat/completions", json=chat_body(64), headers={"Authorization": key}
            )
        )

        async def sent_to_the_engine() -> bool:
            return len(engine.queues) == 1

        await eventually(sent_to_the_engine)
        engine.release(3)
        engine.release(None)
        response = await sent
        assert response.status == 200
        assert b"data: [DONE]" in await response.read()
        assert await books_when_settled(clients.sidecar, budget_s=2.0) == ZERO_BOOKS
    assert clients.sidecar.scheduler.running == 0


def test_the_intake_delay_learns_only_from_what_the_report_surely_says() -> None:
    # The engine counts `running + waiting`; a whole answer (maybe still on its way) and a
    # stream whose `[DONE]` was relayed (finished at the engine) may or may not be among them,
    # so neither makes an unstarted stream look "not received" (the old learner jumped to the
    # stream's age at once and came down only 20 % a report).
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    now = [0.0]
    view = KvView(clock=lambda: now[0])

    def send(request_id: str, stream: bool = True) -> None:
        request = Request(request_id, "tenant_chat_pro", now[0], 2000, 500, "interactive")
        assert scheduler.submit(request, now[0]) is None
        assert scheduler.next_dispatch(now[0]) is not None
        view.track(request_id, stream)

    view.observe(scheduler, 0, running=0, waiting=0)
    send("s0")  # prefilling, shows nothing yet
    now[0] = 1000.0
    send("w0", stream=False)
    now[0] = 1100.0
    view.observe(scheduler, blocks(2000), running=1, waiting=0)  # s0 (or w0)
    assert view.intake_ms == 0.0
    view.forget("s0")
    view.forget("w0")
    send("a")
    progress = view._running["a"]
    progress.relayed(b"data: {}\n\n" * 5 + b"data: [DONE]\n\n")  # finished at the engine
    assert progress.done
    send("b")  # prefilling
    now[0] = 1500.0
    view.observe(scheduler, blocks(2000), running=1, waiting=0)  # b
    assert view.intake_ms == 0.0
    # Evidence that holds whatever those are: an engine that counts nothing has neither.
    now[0] = 1600.0
    view.observe(scheduler, 0, running=0, waiting=0)
    assert view.intake_ms == 500.0  # b: on its way for 500 ms


def test_engine_decode_booking_counts_the_growth_to_the_next_report_not_max_tokens() -> None:
    # kvDecodeBooking: engine. Two streams run (2000-token prompts, max_tokens 3000: 157 blocks
    # of 32 booked each, 314 of a 360-block watermark), each has shown 100 tokens (66 blocks).
    # Up front, a third does not fit; booked as the engine books decode, it does.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=400, max_batch_requests=16
    )
    now = [0.0]
    views = {
        mode: KvView(clock=lambda: now[0], decode_booking=mode) for mode in ("upfront", "engine")
    }
    schedulers = {mode: make_scheduler("tokenfair", keyed_config(policy)) for mode in views}
    progress: dict[str, dict[str, StreamProgress]] = {mode: {} for mode in views}

    def send(mode: str, request_id: str) -> None:
        scheduler = schedulers[mode]
        request = Request(request_id, "tenant_chat_pro", now[0], 2000, 3000, "interactive")
        assert scheduler.submit(request, now[0]) is None
        assert scheduler.next_dispatch(now[0]) is not None
        tracked = views[mode].track(request_id)
        assert tracked is not None
        progress[mode][request_id] = tracked

    for mode in views:
        for number in range(2):
            send(mode, f"r{number}")
        for tracked in progress[mode].values():
            tracked.relayed(b"data: {}\n\n" * 100)
    third = Request("r2", "tenant_chat_pro", 0.0, 2000, 3000, "interactive")
    used = 2 * blocks(2100)
    for mode, view in views.items():
        view.observe(schedulers[mode], used, running=2, waiting=0)
    upfront, engine = schedulers["upfront"], schedulers["engine"]
    # Up front: the engine's blocks plus each stream's growth to its max_tokens (as before).
    assert upfront.kv_decode_allowance_tokens == views["upfront"].decode_allowance_tokens == -1
    assert upfront.kv_gate_blocks == used + 2 * (blocks(5000) - blocks(2100)) == 314
    # Engine: no decode rate seen yet (the first report), so one block's allowance: each
    # stream's prompt, its 100 tokens and 32 more.
    assert engine.kv_decode_allowance_tokens == views["engine"].decode_allowance_tokens == BLOCK
    assert engine.kv_gate_blocks == used + 2 * (blocks(2100 + BLOCK) - blocks(2100)) == 134
    assert upfront.resident_blocks == engine.resident_blocks == 2 * blocks(5000)  # the books
    for scheduler in schedulers.values():
        assert scheduler.submit(third, 0.0) is None
    assert upfront.next_dispatch(0.0) is None  # 314 + 157 > 360: it waits
    before = engine.kv_gate_blocks
    assert engine.next_dispatch(0.0) is not None  # booked at its prompt and the allowance
    assert engine.kv_gate_blocks == before + blocks(2000 + BLOCK)
    assert engine.resident_blocks == 3 * blocks(5000)
    views["engine"].track("r2")
    # 250 ms later every stream has shown 100 more: the fastest decodes 0.4 tokens per ms,
    # and the allowance covers two report intervals at that rate: 200 tokens.
    now[0] = 250.0
    for tracked in progress["engine"].values():
        tracked.relayed(b"data: {}\n\n" * 100)
    used = 2 * blocks(2200)  # r2 not started yet: it holds nothing the engine reports
    views["engine"].observe(engine, used, running=2, waiting=1)
    assert views["engine"].decode_rate == pytest.approx(0.4)
    assert engine.kv_decode_allowance_tokens == 200
    growth = 2 * (blocks(2200 + 200) - blocks(2200)) + blocks(2000 + 200)
    assert engine.kv_gate_blocks == used + growth
    # One ends before the next report: the gates stop counting what they counted for it (its
    # prompt, 200 tokens shown, the allowance), no more: never below the report less what it
    # held in it.
    gate = engine.kv_gate_blocks
    engine.complete("r0", 300.0)
    views["engine"].forget("r0")
    assert engine.kv_gate_blocks == gate - blocks(2200 + 200)
    assert engine.kv_gate_blocks >= used - blocks(2200)
    # Stale: the books at once, decode up front (as `upfront` books it).
    views["engine"].observe(engine, None)
    assert engine.kv_decode_allowance_tokens == -1
    assert engine.kv_gate_blocks == engine.resident_blocks == 2 * blocks(5000)
    assert engine.kv_gate_job_blocks(engine.jobs["r1"]) == blocks(5000)


def test_engine_decode_booking_never_books_more_than_the_reservation() -> None:
    # A short answer (max_tokens 10) is booked at most its reservation, whatever the
    # allowance; a whole (non-streamed) answer shows no progress and keeps its reservation.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    view = KvView(decode_booking="engine")
    for request_id, decode, stream in (("short", 10, True), ("whole", 3000, False)):
        request = Request(request_id, "tenant_chat_pro", 0.0, 2000, decode, "interactive")
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        view.track(request_id, stream=stream)
    view.observe(scheduler, 0, running=0, waiting=0)
    assert scheduler.kv_decode_allowance_tokens == BLOCK
    assert scheduler.kv_gate_blocks == blocks(2010) + blocks(5000)
    assert view.gate_blocks_held(scheduler, 0, 0, BLOCK) == 0


def test_engine_decode_booking_keeps_counting_blocks_another_client_holds() -> None:
    # The engine holds 300 blocks for another client; requests of ours start and end between
    # two reports (short answers, errors): each takes back what the gates counted for it, and
    # the 300 blocks stay counted until the next report, as up front.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    now = [0.0]
    for mode in ("upfront", "engine"):
        scheduler = make_scheduler("tokenfair", keyed_config(policy))
        view = KvView(clock=lambda: now[0], decode_booking=mode)
        view.observe(scheduler, 300, running=0, waiting=0)
        assert scheduler.kv_gate_blocks == 300, mode
        for number in range(4):
            request_id = f"r{number}"
            request = Request(request_id, "tenant_chat_pro", now[0], 2000, 3000, "interactive")
            assert scheduler.submit(request, now[0]) is None
            assert scheduler.next_dispatch(now[0]) is not None
            view.track(request_id)
            now[0] += 5000.0
            scheduler.complete(request_id, now[0])
            view.forget(request_id)
            assert (scheduler.resident_blocks, scheduler.kv_gate_blocks) == (0, 300), mode


def test_engine_decode_booking_covers_the_time_until_the_report_is_stale() -> None:
    # Two streams decode 0.4 tokens per ms; reports every 250 ms, declared stale only after
    # `stale_after_ms` (3250: the defaults' 2 s, a failed poll's 1 s timeout and 0.25 s). The
    # allowance covers that long (1300 tokens), not two intervals (200): a stream decoding at
    # the rate seen stays within its booking until the gates book up front again.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=4000, max_batch_requests=16
    )
    settings = SidecarSettings()
    stale_after_ms = 1000.0 * (
        settings.engine_metrics_stale_s
        + max(1.0, settings.engine_metrics_interval_s)
        + settings.engine_metrics_interval_s
    )
    assert stale_after_ms == 3250.0
    now = [0.0]
    scheduler = make_scheduler("tokenfair", keyed_config(policy))
    view = KvView(clock=lambda: now[0], decode_booking="engine", stale_after_ms=stale_after_ms)
    streams = []
    for number in range(2):
        request = Request(f"r{number}", "tenant_chat_pro", 0.0, 1000, 4000, "interactive")
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        tracked = view.track(f"r{number}")
        assert tracked is not None
        tracked.relayed(b"data: {}\n\n")
        streams.append(tracked)
    view.observe(scheduler, 2 * blocks(1001), running=2, waiting=0)
    shown = 1
    for step_ms in (250.0, stale_after_ms):
        now[0] += step_ms
        added = round(0.4 * step_ms)
        shown += added
        for tracked in streams:
            tracked.relayed(b"data: {}\n\n" * added)
        if step_ms == 250.0:
            view.observe(scheduler, 2 * blocks(1000 + shown), running=2, waiting=0)
            assert view.decode_allowance_tokens == round(0.4 * stale_after_ms)
    # No report for `stale_after_ms` since the last: not stale yet, and the gates still count
    # at least what the engine holds.
    assert scheduler.kv_gate_blocks >= 2 * blocks(1000 + shown)
    assert KvView(stale_after_ms=0.0).stale_after_ms == 0.0  # unknown: two intervals only
    with pytest.raises(ValueError, match="stale_after_ms: must be a finite number"):
        KvView(stale_after_ms=math.nan)


def test_the_lesson_policies_take_no_decode_allowance() -> None:
    # kvDecodeBooking: engine is the sidecar's setting; the lesson's policies keep up-front
    # booking (their decisions do not change), tokenfair takes the allowance.
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=1000, max_batch_requests=16
    )
    for name in ("tokenfair", "request_count_no_admission", "service_token_drr_with_admission"):
        scheduler = make_scheduler(name, keyed_config(policy))
        view = KvView(decode_booking="engine")
        request = Request("r0", "tenant_chat_pro", 0.0, 2000, 3000, "interactive")
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        view.track("r0")
        view.observe(scheduler, 0, running=0, waiting=0)
        takes = name == "tokenfair"
        assert (view.decode_allowance_tokens, scheduler.kv_decode_allowance_tokens) == (
            (BLOCK, BLOCK) if takes else (-1, -1)
        ), name
        booked = blocks(2000 + BLOCK) if takes else blocks(5000)
        assert scheduler.kv_gate_blocks == booked, name


def test_the_decode_booking_is_upfront_engine_or_peak() -> None:
    with pytest.raises(
        ValueError, match=r"KvView\.decode_booking: must be one of upfront, engine, peak"
    ):
        KvView(decode_booking="lazy")
    for mode in ("engine", "peak"):
        assert KvView(follows_streams=False, decode_booking=mode).decode_booking == "upfront"
    assert KvView(decode_booking="peak").decode_booking == "peak"
    assert SidecarSettings().kv_decode_booking == "upfront"


FLOOD_PROMPT = 1602
"""A flood request of the live bench's run 6: its 800-token prompt at the learned ratio 2.0,
with 160 tokens of decode: 51 blocks of 32 at its first token, 56 at its end."""
FLOOD_DECODE = 160


def flood_stream(shown: int, request_id: str) -> tuple[int, int, int, int, str]:
    """A flood request that has shown ``shown`` tokens, as :func:`peak_credits` takes it."""
    return (
        FLOOD_DECODE - shown,
        FLOOD_PROMPT + shown,
        blocks(FLOOD_PROMPT + FLOOD_DECODE),
        blocks(FLOOD_PROMPT + shown),
        request_id,
    )


def start_floods(scheduler: Scheduler, view: KvView, shown: dict[str, int]) -> None:
    """Dispatch a flood request per id at 0 ms, each having shown its count of tokens."""
    for request_id, tokens in shown.items():
        request = Request(
            request_id, "tenant_chat_pro", 0.0, FLOOD_PROMPT, FLOOD_DECODE, "interactive"
        )
        assert scheduler.submit(request, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        tracked = view.track(request_id, bounded_end=True)
        assert tracked is not None
        tracked.relayed(b"data: {}\n\n" * tokens)


def unbudgeted_config(total_kv_blocks: int) -> Config:
    """Blocks of 32, the lesson's tenants with budgets that never bind."""
    policy = dataclasses.replace(
        PATIENT_POLICY,
        kv_block_tokens=BLOCK,
        total_kv_blocks=total_kv_blocks,
        max_batch_requests=16,
    )
    return keyed_config(
        policy, burst_service_tokens=10**12, sustained_service_tokens_per_second=10**9
    )


def test_the_peak_forecast_of_staggered_streams_is_below_the_sum() -> None:
    # Five flood requests evenly spread over their 160 tokens: 265 blocks now, 280 at their
    # reservations; one common rate, so the first to end (27 tokens to come) ends after 27
    # more tokens of each: just before it, each has grown by a block: 270, the peak (later,
    # the ends free 55-56 blocks each, more than the survivors grow).
    streams = [flood_stream(shown, f"r{shown}") for shown in (27, 53, 80, 107, 133)]
    assert sum(stream[3] for stream in streams) == 265
    reserved = sum(stream[2] for stream in streams)
    assert reserved == 280
    credits = peak_credits(streams, BLOCK)
    assert reserved - sum(credits.values()) == 270
    # Each credit is its stream's growth beyond the peak's point: at most its growth to come.
    for _, _, booked, held, request_id in streams:
        assert 0 <= credits.get(request_id, 0) <= booked - held
    assert credits == {"r27": 4, "r53": 3, "r80": 2, "r107": 1}


def test_the_peak_forecast_of_streams_at_the_same_progress_is_the_sum() -> None:
    # A burst dispatched together: all end at once, each at its reservation: the sum, as
    # booked up front; no credit.
    streams = [flood_stream(80, f"r{number}") for number in range(5)]
    assert peak_credits(streams, BLOCK) == {}
    assert peak_credits([], BLOCK) == {}


def test_the_peak_forecast_never_credits_what_a_stream_ending_first_holds() -> None:
    # A long answer nearly done (100 blocks held, 10 tokens to come) beside a long decode
    # (1 block held, 3200 tokens to come: 101 blocks at its end). Just before the first ends,
    # the second has grown a block: the peak (after it, the 100 blocks freed outweigh the
    # other's growth). Counted: that block; credited: the rest of the long decode's growth.
    nearly_done = (10, 3190, 100, 100, "nearly_done")
    long = (3200, 32, 101, 1, "long")
    assert peak_credits([nearly_done, long], BLOCK) == {"long": 101 - 2}
    # A short answer (10 blocks) beside the long decode: the net peak is at the long one's
    # end (+100, the short one's 10 freed: 90), after the short one ends. Its 10 blocks are
    # not credited (counted: 100, as up front): were they, and the long one ended first (a
    # stop token), the gates would fall to the report less 11 while the short one still holds
    # its 10.
    short = (10, 310, 10, 10, "short")
    assert peak_credits([short, long], BLOCK) == {}


def test_peak_decode_booking_starts_a_sixth_staggered_request_upfront_does_not() -> None:
    # 369 blocks of 32, the interactive watermark 0.9: 332 blocks. Five flood requests run,
    # staggered over their 160 tokens; a sixth (56 blocks) waits. Up front: 280 + 56 = 336,
    # past 332; to the forecast peak: 270 + 56 = 326, it starts. At the same progress, it waits
    # in both. A request dispatched before the next report is booked at its reservation.
    config = unbudgeted_config(369)

    def run(mode: str, shown: tuple[int, ...]) -> tuple[bool, int, KvView, Scheduler]:
        now = [0.0]
        scheduler = make_scheduler("tokenfair", config)
        view = KvView(clock=lambda: now[0], decode_booking=mode)
        start_floods(scheduler, view, {f"r{number}": n for number, n in enumerate(shown)})
        now[0] = 250.0
        used = sum(blocks(FLOOD_PROMPT + tokens) for tokens in shown)
        view.observe(scheduler, used, running=len(shown), waiting=0)
        sixth = Request("r5", "tenant_chat_pro", 250.0, FLOOD_PROMPT, FLOOD_DECODE, "interactive")
        assert scheduler.submit(sixth, 250.0) is None
        gate = scheduler.kv_gate_blocks
        return scheduler.next_dispatch(250.0) is not None, gate, view, scheduler

    staggered = (27, 53, 80, 107, 133)
    assert run("upfront", staggered)[:2] == (False, 280)
    started, gate, view, scheduler = run("peak", staggered)
    assert (started, gate) == (True, 270)
    assert view.decode_allowance_tokens == scheduler.kv_decode_allowance_tokens == -1
    assert scheduler.kv_gate_blocks == 270 + blocks(FLOOD_PROMPT + FLOOD_DECODE)  # in full
    assert scheduler.resident_blocks == 6 * 56  # the books: unchanged
    for mode in ("upfront", "peak"):
        assert run(mode, (80,) * 5)[:2] == (False, 280), mode


def test_peak_decode_booking_gives_each_credit_back_at_its_end_and_falls_back_when_stale() -> None:
    # The five staggered flood requests under kvDecodeBooking: peak. Each end takes off what
    # the gates counted for that request (its reservation less its credit), in any order, and
    # never leaves them below the report less what the ended requests held in it. A stale
    # report: the books at once (up front).
    config = unbudgeted_config(1000)
    now = [0.0]
    scheduler = make_scheduler("tokenfair", config)
    view = KvView(clock=lambda: now[0], decode_booking="peak")
    shown = {"r27": 27, "r53": 53, "r80": 80, "r107": 107, "r133": 133}
    start_floods(scheduler, view, shown)
    used = 265
    view.observe(scheduler, used, running=5, waiting=0)
    assert (scheduler.kv_gate_blocks, scheduler.kv_gate_credit_blocks) == (270, 10)
    ended_held = 0
    for request_id in ("r27", "r133", "r80"):  # the longest first, then the shortest
        job = scheduler.jobs[request_id]
        counted = job.kv_blocks - job.kv_gate_credit
        before = scheduler.kv_gate_blocks
        scheduler.complete(request_id, 100.0)
        view.forget(request_id)
        ended_held += blocks(FLOOD_PROMPT + shown[request_id])
        assert scheduler.kv_gate_blocks == before - counted
        assert scheduler.kv_gate_blocks >= used - ended_held
    assert scheduler.kv_gate_credit_blocks == 3 + 1  # r53's and r107's
    view.observe(scheduler, None)
    assert scheduler.kv_gate_credit_blocks == 0
    assert scheduler.kv_gate_blocks == scheduler.resident_blocks == 2 * 56
    # Missing from the start: no credit either.
    fresh = make_scheduler("tokenfair", config)
    KvView(decode_booking="peak").observe(fresh, None)
    assert (fresh.kv_gate_credit_blocks, fresh.kv_decode_allowance_tokens) == (0, -1)


def test_peak_decode_booking_keeps_the_reservation_of_what_has_not_streamed() -> None:
    # A stream with nothing shown yet (in the engine's queue, on its way, being prefilled) and
    # a whole answer keep their reservations (no forecast of their ends) beside two streams
    # forecast (2000-token prompts, max_tokens 3000: 157 blocks each): c has shown 60, d 2000.
    # d ends first, after 1000 more tokens of each: c at 3060 tokens (96 blocks), d at its
    # 157: growth 31 + 32, the peak (after it, d's 125 blocks are freed); c's credit 157 - 96.
    # The lesson's policies take no credit at all.
    config = unbudgeted_config(1000)
    for name in ("tokenfair", "service_token_drr_with_admission"):
        scheduler = make_scheduler(name, config)
        view = KvView(decode_booking="peak")
        sent = (("a", True, 0), ("b", False, 0), ("c", True, 60), ("d", True, 2000))
        for request_id, stream, tokens in sent:
            request = Request(request_id, "tenant_chat_pro", 0.0, 2000, 3000, "interactive")
            assert scheduler.submit(request, 0.0) is None
            assert scheduler.next_dispatch(0.0) is not None
            tracked = view.track(request_id, stream=stream, bounded_end=True)
            assert tracked is not None
            tracked.relayed(b"data: {}\n\n" * tokens)
        used = blocks(2000) + blocks(2060) + blocks(4000)  # b, c, d
        view.observe(scheduler, used, running=3, waiting=1)
        takes = name == "tokenfair"
        credits = {request_id: scheduler.jobs[request_id].kv_gate_credit for request_id in "abcd"}
        assert credits == {"a": 0, "b": 0, "c": 157 - 96 if takes else 0, "d": 0}, name
        assert scheduler.kv_gate_credit_blocks == sum(credits.values()), name
        # a and b at their reservations (b's prompt in the report besides: a whole answer
        # holds nothing surely), c and d their growth to come less their credits.
        growth = 2 * 157 + (157 - blocks(2060)) + (157 - blocks(4000))
        assert scheduler.kv_gate_blocks == used + growth - credits["c"], name


def test_peak_decode_booking_forecasts_only_streams_that_end_by_their_own_bound() -> None:
    # A stream of several sequences or prompts decodes several tokens a step, and one without
    # its own max_tokens may decode past the estimate (here 2,000 events against 160): neither
    # is forecast, so neither offsets the growth of the others. Beside r27 (133 tokens to come,
    # 5 blocks of growth), such a stream past its estimate left the gates at the report alone.
    config = unbudgeted_config(1000)
    for bounded in (True, False):
        scheduler = make_scheduler("tokenfair", config)
        view = KvView(decode_booking="peak")
        start_floods(scheduler, view, {"r27": 27})
        unbounded = Request("x", "tenant_chat_pro", 0.0, FLOOD_PROMPT, FLOOD_DECODE, "interactive")
        assert scheduler.submit(unbounded, 0.0) is None
        assert scheduler.next_dispatch(0.0) is not None
        tracked = view.track("x", bounded_end=bounded)
        assert tracked is not None
        tracked.relayed(b"data: {}\n\n" * 2000)
        used = blocks(FLOOD_PROMPT + 27) + blocks(FLOOD_PROMPT + FLOOD_DECODE)
        view.observe(scheduler, used, running=2, waiting=0)
        growth = blocks(FLOOD_PROMPT + FLOOD_DECODE) - blocks(FLOOD_PROMPT + 27)
        expected = used if bounded else used + growth  # x's end "now" offset r27's growth
        assert scheduler.kv_gate_blocks == expected, bounded
        assert scheduler.jobs["x"].kv_gate_credit == 0


def test_peak_decode_booking_forecasts_at_most_its_bound_of_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Above PEAK_FORECAST_MAX_STREAMS running streams (its cost is O(r^2) on the event loop),
    # a report books every running request up front.
    config = unbudgeted_config(1000)
    staggered = {"r27": 27, "r53": 53, "r80": 80, "r107": 107, "r133": 133}
    for bound, credit in ((5, 10), (4, 0)):
        monkeypatch.setattr(kv_view_module, "PEAK_FORECAST_MAX_STREAMS", bound)
        scheduler = make_scheduler("tokenfair", config)
        view = KvView(decode_booking="peak")
        start_floods(scheduler, view, staggered)
        view.observe(scheduler, 265, running=5, waiting=0)
        assert scheduler.kv_gate_credit_blocks == credit, bound
        assert scheduler.kv_gate_blocks == 280 - credit, bound
