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
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from typing import Any, ClassVar, Final

from aiohttp import web

from tokenfair_sidecar.costmodel import CostModel
from tokenfair_sidecar.server.backends.base import Backend, BackendCall

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


def sse(data: object) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class CostModelBackend(Backend):
    name: ClassVar[str] = "costmodel"
    default_max_in_flight: ClassVar[int] = 2

    def __init__(self, cost: CostModel, time_scale: float) -> None:
        self.cost = cost
        self.time_scale = time_scale
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

    async def respond(self, call: BackendCall) -> web.StreamResponse:
        prompt = call.estimate.prefill_tokens
        decode = call.estimate.decode_tokens
        cost = self.cost
        prefill_ms = cost.prefill_ms(prompt)
        execution_ms = max(prefill_ms, cost.execution_ms(cost.service_tokens(prompt, decode)))
        words = generate_words(_seed_text(call.body), decode)
        call.prompt_tokens = prompt
        chat = call.path.endswith("/chat/completions")
        model = call.body.get("model")
        if not isinstance(model, str) or not model:
            model = "tokenfair-costmodel"
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
        await call.write_eof(response)
        return response
