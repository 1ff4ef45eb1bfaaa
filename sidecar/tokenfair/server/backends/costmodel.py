"""``costmodel`` backend: an embedded, deterministic OpenAI-compatible engine on the cost model.

For ``p`` prompt tokens (the estimate) and ``d`` decode tokens (``max_tokens`` or the default) it
answers after the cost model's times, scaled by ``time_scale`` real seconds per model second.

**Serial** (the policy's ``maxBatchRequests`` 1, the default; as the simulator models it): the
first token after ``prefill_ms(p)``, the whole response after ``execution_ms(p + w*d)``; one
engine, non-preemptive: requests run one at a time in dispatch order. The engine keeps its own
timeline: a request starts at ``max(its dispatch, the previous request's end)`` — not when the
event loop gets round to it — so timer overshoot and event-loop latency do not pile up into
model time. The default in-flight limit is 2 — one running, one staged — so the engine never
idles for the proxy's dispatch latency (at ``time_scale`` 0.25 a 2 ms slip per request would be
8 model ms). KV stays resident ``kv_hold_ms`` after dispatch.

**Batching** (``maxBatchRequests`` ``S > 1``; the simulator's batching engine, in real time):
up to ``S`` requests run at once as one processor-sharing fluid
(:class:`~tokenfair.server.backends.batching.BatchingEngine`), each at ``v(c)`` of the policy's
:class:`~tokenfair.core.batching.BatchingCurve`, so a request's end moves whenever another joins
or leaves. Its first token comes ``prefill_ms(p) * v(1) / v(c)`` after its dispatch (``c`` the
requests running then), its response ends when it has received ``p + w*d`` service tokens, and
its KV is freed then (``kv_hold_ms`` 0). The sidecar's default in-flight limit is ``S``
(:func:`~tokenfair.server.backends.base.default_max_in_flight`).

Text is ``d`` words drawn deterministically from the prompt's CRC-32; ``usage`` reports ``p`` and
``d``.

Streaming (``"stream": true``) sends the text in up to 16 SSE chunks, the first at the first
token's time and the rest spread evenly until the execution time (serial: in time; batching: in
the request's attained service, the last at its end), then a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``.

Embeddings (``/v1/embeddings``) take the engine for ``execution_ms(p)`` (prefill only; batching:
``p`` service tokens in the fluid) and answer
one deterministic fake vector per input (:func:`fake_embedding`: unit length, seeded by the
input's CRC-32), of ``dimensions`` (or ``embedding_dimensions``) values, as floats or, with
``encoding_format: base64``, as little-endian float32 bytes in base64 (what the openai SDK asks
for by default); ``usage`` reports ``p`` prompt tokens. A batch over
:data:`MAX_FAKE_EMBEDDING_VALUES` values in all is answered ``400`` (nothing ran).

``GET /v1/models`` lists ``served_model_names``; a request naming no model is answered as the
first of them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import sys
import time
import zlib
from array import array
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final

from aiohttp import web

from tokenfair.core.batching import BatchingCurve
from tokenfair.core.cost import CostModel
from tokenfair.core.reasons import Reason
from tokenfair.server.backends.base import (
    EMBEDDINGS_ROUTE,
    Backend,
    BackendCall,
    embedding_inputs,
)
from tokenfair.server.backends.batching import BatchingEngine
from tokenfair.server.errors import error_response
from tokenfair.server.runtime_settings import (
    COSTMODEL_BACKEND,
    DEFAULT_EMBEDDING_DIMENSIONS,
    DEFAULT_SERVED_MODEL_NAMES,
)

_WORDS: Final = (
    "fair", "token", "queue", "lane", "batch", "chat", "budget", "tenant",
    "decode", "prefill", "cache", "block", "weight", "round", "robin", "serve",
)  # fmt: skip
MAX_STREAM_CHUNKS: Final = 16
SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def generate_words(seed_text: str, count: int) -> list[str]:
    """``count`` deterministic words seeded by the prompt (one word = one decode token)."""
    seed = zlib.crc32(seed_text.encode("utf-8"))
    return [_WORDS[(seed + 7 * i) % len(_WORDS)] for i in range(count)]


def _seed_text(body: dict[str, Any]) -> str:
    try:
        return json.dumps(body.get("messages", body.get("prompt", "")), sort_keys=True)[:4096]
    except RecursionError:  # nested near the parser's limit: any seed will do
        return ""


MAX_FAKE_EMBEDDING_VALUES: Final = 1 << 18
"""Most values (inputs times dimensions) of one fake embeddings answer: 262,144 floats are ~5 MiB
of JSON, built on the event loop."""


def fake_embedding(item: object, dimensions: int) -> array[float]:
    """A deterministic unit vector of ``dimensions`` float32 values seeded by ``item``'s CRC-32
    (the same input always embeds the same; different ones almost never)."""
    seed = zlib.crc32(json.dumps(item, separators=(",", ":")).encode("utf-8"))
    values = array("f", (((seed * 2654435761 + i * 40503) % 65536) / 32768.0 - 1.0
                         for i in range(dimensions)))  # fmt: skip
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return array("f", (v / norm for v in values))


def sse(data: object) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class CostModelBackend(Backend):
    name: ClassVar[str] = COSTMODEL_BACKEND
    default_max_in_flight: ClassVar[int] = 2

    def __init__(
        self,
        cost: CostModel,
        time_scale: float,
        *,
        served_model_names: tuple[str, ...] = DEFAULT_SERVED_MODEL_NAMES,
        embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
    ) -> None:
        self.cost = cost
        self.time_scale = time_scale
        self.served_model_names = served_model_names
        self.embedding_dimensions = embedding_dimensions
        self._created = int(time.time())
        self._engine = asyncio.Lock()
        self._free_at = 0.0  # loop time when the engine's last request ends (or ended)
        self._batching: BatchingEngine | None = None  # maxBatchRequests > 1
        if cost.max_batch_requests > 1:
            self._batching = BatchingEngine(BatchingCurve.from_cost(cost), time_scale)

    def retune(self, cost: CostModel) -> None:
        """Adopt a reloaded policy's cost model (takes effect for the next request; a batching
        engine's running requests go on at the new speeds from now, and a change between serial
        and batching leaves the requests running where they started)."""
        self.cost = cost
        if cost.max_batch_requests == 1:
            self._batching = None
        elif self._batching is None:
            self._batching = BatchingEngine(BatchingCurve.from_cost(cost), self.time_scale)
        else:
            self._batching.retune(BatchingCurve.from_cost(cost))

    def kv_hold_ms(self, call: BackendCall) -> float:
        if self._batching is not None:
            return 0.0  # a batching engine frees a request's KV when it ends
        return self.cost.kv_hold_ms(self.cost.execution_ms(call.decision.service_tokens))

    def _real_s(self, model_ms: float) -> float:
        return model_ms * self.time_scale / 1000.0

    @staticmethod
    async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
        delay = when - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def models(self, request: web.Request) -> web.StreamResponse:
        created = self._created
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenfair"}
            for name in self.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self.served_model_names[0]

    async def _run(self, call: BackendCall, execution_ms: float, service_tokens: int) -> None:
        """Hold the serial engine for ``execution_ms`` model ms from the request's start (a
        batching engine for ``service_tokens`` of its fluid)."""
        batching = self._batching
        if batching is not None:
            request_id = call.decision.request_id
            batching.start(request_id, service_tokens, call.dispatched_at_s)
            try:
                await batching.ended(request_id)
            finally:
                batching.leave(request_id)
            return
        loop = asyncio.get_running_loop()
        async with self._engine:
            start = max(call.dispatched_at_s, self._free_at)
            end = start + self._real_s(execution_ms)
            self._free_at = end
            try:
                await self._sleep_until(loop, end)
            except BaseException:
                self._free_at = loop.time()  # cut short (client gone): the engine is free now
                raise

    async def _embed(self, call: BackendCall) -> web.StreamResponse:
        body = call.body
        inputs = embedding_inputs(body.get("input"))
        asked = body.get("dimensions")
        dimensions = asked if isinstance(asked, int) else self.embedding_dimensions
        if len(inputs) * dimensions > MAX_FAKE_EMBEDDING_VALUES:
            call.prompt_tokens = call.completion_tokens = 0  # nothing ran
            return error_response(
                400,
                f"dimensions: {len(inputs)} inputs of {dimensions} dimensions are over the "
                f"cost-model engine's {MAX_FAKE_EMBEDDING_VALUES} values per answer",
                Reason.INVALID_VALUE,
                param="dimensions",
                headers=call.response_headers,
            )
        prompt = call.estimate.prefill_tokens
        cost = self.cost
        service_tokens = cost.service_tokens(prompt, 0)
        execution_ms = cost.execution_ms(service_tokens)
        await self._run(call, max(cost.prefill_ms(prompt), execution_ms), service_tokens)
        call.prompt_tokens, call.completion_tokens = prompt, 0
        as_base64 = body.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        for index, item in enumerate(inputs):
            vector = fake_embedding(item, dimensions)
            embedding: object = vector.tolist()
            if as_base64:
                if sys.byteorder == "big":  # OpenAI's base64 embeddings are little-endian
                    vector.byteswap()
                embedding = base64.b64encode(vector.tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        payload = {
            "object": "list",
            "data": data,
            "model": self._model(body),
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }
        call.first_byte()
        return web.json_response(payload, headers=call.response_headers)

    async def respond(self, call: BackendCall) -> web.StreamResponse:
        if call.path == EMBEDDINGS_ROUTE:
            return await self._embed(call)
        prompt = call.estimate.prefill_tokens
        decode = call.estimate.decode_tokens
        cost = self.cost
        prefill_ms = cost.prefill_ms(prompt)
        execution_ms = max(prefill_ms, cost.execution_ms(cost.service_tokens(prompt, decode)))
        words = generate_words(_seed_text(call.body), decode)
        call.prompt_tokens = prompt
        chat = call.path.endswith("/chat/completions")
        model = self._model(call.body)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": decode,
            "total_tokens": prompt + decode,
        }
        loop = asyncio.get_running_loop()
        batching = self._batching
        if batching is not None:
            return await self._respond_batching(
                batching, call, words, usage, cost.service_tokens(prompt, decode), prefill_ms,
                chat, model,
            )  # fmt: skip
        async with self._engine:
            start = max(call.dispatched_at_s, self._free_at)
            first_at = start + self._real_s(prefill_ms)
            end = start + self._real_s(execution_ms)
            self._free_at = end
            gap_s = (end - first_at) / max(1, min(MAX_STREAM_CHUNKS, decode))

            async def first_token() -> None:
                await self._sleep_until(loop, first_at)

            async def chunk(index: int, chunks: int) -> None:
                await self._sleep_until(loop, first_at + index * gap_s)

            async def done(stream: bool) -> None:
                if not stream:  # (a stream ends with its last chunk)
                    await self._sleep_until(loop, end)

            try:
                return await self._answer(call, words, usage, chat, model,
                                          first_token, chunk, done)  # fmt: skip
            except BaseException:
                self._free_at = loop.time()  # cut short (client gone): the engine is free now
                raise

    async def _respond_batching(
        self,
        batching: BatchingEngine,
        call: BackendCall,
        words: list[str],
        usage: dict[str, int],
        service_tokens: int,
        prefill_ms: float,
        chat: bool,
        model: str,
    ) -> web.StreamResponse:
        """Run the request in the batching engine's fluid: the first token at the prefill
        stretched by the slowdown at dispatch, the chunks after it paced by the service the
        request has received, the end when the fluid ends it."""
        loop = asyncio.get_running_loop()
        request_id = call.decision.request_id
        batching.start(request_id, service_tokens, call.dispatched_at_s)
        try:
            first_at = await batching.first_token_s(call.dispatched_at_s, prefill_ms)

            async def first_token() -> None:
                await self._sleep_until(loop, first_at)

            async def chunk(index: int, chunks: int) -> None:
                await batching.until_attained(request_id, service_tokens * index / chunks)

            async def done(stream: bool) -> None:
                await batching.ended(request_id)
                await self._sleep_until(loop, first_at)

            return await self._answer(call, words, usage, chat, model, first_token, chunk, done)
        finally:
            batching.leave(request_id)

    async def _answer(
        self,
        call: BackendCall,
        words: list[str],
        usage: dict[str, int],
        chat: bool,
        model: str,
        first_token: Callable[[], Awaitable[None]],
        chunk: Callable[[int, int], Awaitable[None]],
        done: Callable[[bool], Awaitable[None]],
    ) -> web.StreamResponse:
        """The answer, paced by the engine: ``first_token()`` returns at the first token,
        ``chunk(i, n)`` when chunk ``i > 0`` of ``n`` is due, ``done(stream)`` when the response
        may end (before a whole answer; after a stream's last chunk)."""
        decode = len(words)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{call.decision.request_id}"
        created = int(time.time())
        if not call.stream:
            await done(False)
            call.completion_tokens = decode
            text = " ".join(words)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text, "logprobs": None}
            )
            choice["finish_reason"] = "length"
            body = {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
            call.first_byte()
            return web.json_response(body, headers=call.response_headers)
        response = web.StreamResponse(headers={**SSE_HEADERS, **call.response_headers})
        await first_token()
        await response.prepare(call.request)
        chunks = max(1, min(MAX_STREAM_CHUNKS, decode))
        per_chunk = -(-decode // chunks)
        sent = 0
        for index in range(chunks):
            if index:
                await chunk(index, chunks)
            piece = words[sent : sent + per_chunk]
            if not piece:
                break
            sent += len(piece)
            text = (" " if index else "") + " ".join(piece)
            last = sent >= decode
            chunk_choice: dict[str, Any] = (
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": text}
                    if not index
                    else {"content": text},
                }
                if chat
                else {"index": 0, "text": text, "logprobs": None}
            )
            chunk_choice["finish_reason"] = "length" if last else None
            await call.write(response, sse({
                    "id": ident,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [chunk_choice],
                }))  # fmt: skip
            call.first_byte()
            call.completion_tokens = sent
        await done(True)
        options = call.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            await call.write(response, sse({
                    "id": ident,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }))  # fmt: skip
        await call.write(response, b"data: [DONE]\n\n")
        call.answer_complete = True  # the client has it all; only the transfer's end is left
        await call.write_eof(response)
        return response
