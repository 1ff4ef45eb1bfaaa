"""``costmodel`` backend: an embedded, deterministic OpenAI-compatible engine on the cost model.

For ``p`` prompt tokens (the estimate) and ``d`` decode tokens (``max_tokens`` or the default) it
answers after the cost model's times, scaled by ``time_scale`` real seconds per model second:
the first token after ``prefill_ms(p)``, the whole response after ``execution_ms(p + w*d)``.
One engine, serial and non-preemptive (as the simulator models it): requests run one at a time
in dispatch order. The engine keeps its own timeline: a request starts at
``max(its dispatch, the previous request's end)`` — not when the event loop gets round to it — so
timer overshoot and event-loop latency do not pile up into model time. The default in-flight
limit is 2 — one running, one staged — so the engine never idles for the proxy's dispatch latency
(at ``time_scale`` 0.25 a 2 ms slip per request would be 8 model ms).
KV stays resident ``kv_hold_ms`` after dispatch. Text is
``d`` words drawn deterministically from the prompt's CRC-32; ``usage`` reports ``p`` and ``d``.

Streaming (``"stream": true``) sends the text in up to 16 SSE chunks, the first at the prefill
time and the rest spread evenly until the execution time, then a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``.

Embeddings (``/v1/embeddings``) take the engine for ``execution_ms(p)`` (prefill only) and answer
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
from typing import Any, ClassVar, Final

from aiohttp import web

from tokenfair.core.cost import CostModel
from tokenfair.server.backends.base import (
    EMBEDDINGS_ROUTE,
    Backend,
    BackendCall,
    embedding_inputs,
)
from tokenfair.server.errors import error_response
from tokenfair.server.runtime_settings import (
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
    name: ClassVar[str] = "costmodel"
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

    def retune(self, cost: CostModel) -> None:
        """Adopt a reloaded policy's cost model (takes effect for the next request)."""
        self.cost = cost

    def kv_hold_ms(self, call: BackendCall) -> float:
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

    async def _run(self, call: BackendCall, execution_ms: float) -> None:
        """Hold the serial engine for ``execution_ms`` model ms from the request's start."""
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
                "invalid_value",
                param="dimensions",
                headers=call.response_headers,
            )
        prompt = call.estimate.prefill_tokens
        cost = self.cost
        execution_ms = cost.execution_ms(cost.service_tokens(prompt, 0))
        await self._run(call, max(cost.prefill_ms(prompt), execution_ms))
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
        async with self._engine:
            start = max(call.dispatched_at_s, self._free_at)
            first_at = start + self._real_s(prefill_ms)
            end = start + self._real_s(execution_ms)
            self._free_at = end
            try:
                return await self._answer(call, loop, words, usage, first_at, end, chat, model)
            except BaseException:
                self._free_at = loop.time()  # cut short (client gone): the engine is free now
                raise

    async def _answer(
        self,
        call: BackendCall,
        loop: asyncio.AbstractEventLoop,
        words: list[str],
        usage: dict[str, int],
        first_at: float,
        end: float,
        chat: bool,
        model: str,
    ) -> web.StreamResponse:
        decode = len(words)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{call.decision.request_id}"
        created = int(time.time())
        if not call.stream:
            await self._sleep_until(loop, end)
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
        await self._sleep_until(loop, first_at)
        await response.prepare(call.request)
        chunks = max(1, min(MAX_STREAM_CHUNKS, decode))
        per_chunk = -(-decode // chunks)
        gap_s = (end - first_at) / chunks
        sent = 0
        for index in range(chunks):
            if index:
                await self._sleep_until(loop, first_at + index * gap_s)
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
