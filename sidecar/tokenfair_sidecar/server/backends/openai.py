"""``openai`` backend: relay to any OpenAI-compatible upstream (vLLM, ...) over pooled connections.

* One :class:`~tokenfair_sidecar.server.upstream.UpstreamClient` for the process (opened
  and closed by the app's cleanup context): keep-alive HTTP/1.1 connections to the upstream;
  timeouts: connect ``upstream_connect_timeout_s``, between upstream bytes
  ``upstream_read_timeout_s``, no total (a long stream is not an error).
* The body is forwarded as received, except that a streaming request without
  ``stream_options.include_usage`` gets it added, so the upstream reports usage in a final chunk
  (``"choices": []``, which the client also receives — OpenAI clients accept it).
* Streaming passthrough: upstream bytes are written to the client as they arrive, never parsed per
  chunk; only the last :data:`TAIL_BYTES` are kept, and searched for the usage chunk at the end.
* Usage is read from the response (``usage.prompt_tokens`` / ``completion_tokens``) to settle;
  without it the estimate stands; an upstream error status with no usage settles at zero.
* Hop-by-hop headers are dropped both ways, as are the tenant's ``Authorization`` (the upstream
  never sees tenants' keys) and ``x-tokenfair-*`` headers.
* Connection refused/reset or a broken response before the first byte: ``502``; connect or read
  timeout: ``504``. A failure mid-stream ends the stream without ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Final

from aiohttp import web
from multidict import CIMultiDict

from tokenfair_sidecar.server.backends.base import Backend, BackendCall, UpstreamError
from tokenfair_sidecar.server.upstream import (
    UpstreamClient,
    UpstreamClosedError,
    UpstreamResponse,
)

log = logging.getLogger("tokenfair.sidecar")

HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DROP_REQUEST: Final = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "expect",
}
_DROP_RESPONSE: Final = HOP_BY_HOP | {"content-length", "content-encoding"}
TAIL_BYTES: Final = 8192
"""Bytes of a stream's end kept to find the usage chunk (a usage chunk is ~300 bytes)."""
_DECODER: Final = json.JSONDecoder()


def request_headers(headers: Any) -> list[tuple[str, str]]:
    """The client's headers as the upstream gets them (see the module docstring), with
    ``Accept-Encoding: identity`` (usage is read from the body, so it must not be compressed)."""
    out = [
        (name, value)
        for name, value in headers.items()
        if (lower := name.lower()) not in _DROP_REQUEST and not lower.startswith("x-tokenfair-")
    ]
    out.append(("Accept-Encoding", "identity"))
    return out


def response_headers(headers: list[tuple[str, str]], extra: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers:
        if name.lower() not in _DROP_RESPONSE:
            out.add(name, value)
    out.update(extra)
    return out


def usage_from_json(data: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in a JSON body, decoded alone (no full parse)."""
    index = data.rfind(b'"usage"')
    if index < 0:
        return None
    tail = data[index + len(b'"usage"') :]
    try:
        try:
            text = tail.decode().lstrip()
        except UnicodeDecodeError:
            text = tail.decode("utf-8", errors="replace").lstrip()
        if not text.startswith(":"):
            return None
        usage, _ = _DECODER.raw_decode(text[1:].lstrip())
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def usage_from_sse(tail: bytes) -> dict[str, Any] | None:
    """The usage of the last SSE ``data:`` line that carries one, searched from the end (the
    usage chunk is the last before ``[DONE]``; earlier chunks may say ``"usage":null``)."""
    end = len(tail)
    while (index := tail.rfind(b'"usage"', 0, end)) >= 0:
        start = tail.rfind(b"\n", 0, index) + 1
        line = tail[start:index].lstrip()
        if line.startswith(b"data:"):
            stop = tail.find(b"\n", index)
            usage = usage_from_json(tail[index : len(tail) if stop < 0 else stop])
            if usage is not None:
                return usage
        end = start
    return None


_INCLUDE_USAGE: Final = b'{"stream_options":{"include_usage":true}'


def with_include_usage(raw: bytes) -> bytes | None:
    """``raw`` (a JSON object without ``stream_options``) with ``"stream_options":
    {"include_usage":true}`` spliced in as its first member, without decoding and re-encoding the
    body; None when the bytes do not start with ``{`` (e.g. UTF-16, which JSON allows)."""
    body = raw.lstrip()
    if not body.startswith(b"{"):
        return None
    rest = body[1:].lstrip()
    return _INCLUDE_USAGE + (rest if rest.startswith(b"}") else b"," + rest)


def _tokens(usage: dict[str, Any] | None, name: str) -> int | None:
    value = None if usage is None else usage.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class OpenAIBackend(Backend):
    name: ClassVar[str] = "openai"
    default_max_in_flight: ClassVar[int] = 64

    def __init__(self, upstream_url: str, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.upstream_url = upstream_url
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._client: UpstreamClient | None = None

    async def open(self) -> None:
        self._client = UpstreamClient(
            self.upstream_url,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _payload(self, call: BackendCall) -> bytes:
        if not call.stream:
            return call.raw_body
        options = call.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            return call.raw_body
        if options is None and "stream_options" not in call.body:
            spliced = with_include_usage(call.raw_body)
            if spliced is not None:
                return spliced
        body = dict(call.body)
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}  # fmt: skip
        return json.dumps(body, separators=(",", ":")).encode()

    async def respond(self, call: BackendCall) -> web.StreamResponse:
        client = self._client
        if client is None:
            raise UpstreamError(502, "upstream_unavailable", "the upstream client is closed")
        request = call.request
        try:
            upstream = await client.request(
                "POST",
                request.rel_url.raw_path_qs,  # encoded path + query (of absolute-form too)
                request_headers(request.headers),
                self._payload(call),
            )
        except TimeoutError as exc:
            raise UpstreamError(504, "upstream_timeout", f"upstream timed out: {exc}") from None
        except UpstreamClosedError as exc:
            raise UpstreamError(502, "upstream_error", f"upstream failed: {exc}") from None
        try:
            headers = response_headers(upstream.headers, call.response_headers)
            if call.stream and upstream.status == 200:
                return await self._relay_stream(call, upstream, headers)
            try:
                data = await upstream.read()
            except TimeoutError as exc:
                raise UpstreamError(
                    504, "upstream_timeout", f"upstream response timed out: {exc}"
                ) from None
            except UpstreamClosedError as exc:
                raise UpstreamError(502, "upstream_error", f"upstream failed: {exc}") from None
            usage = usage_from_json(data)
            if usage is None and upstream.status >= 400:
                call.prompt_tokens = call.completion_tokens = 0
            else:
                call.prompt_tokens = _tokens(usage, "prompt_tokens")
                call.completion_tokens = _tokens(usage, "completion_tokens")
            call.first_byte()
            return web.Response(body=data, status=upstream.status, headers=headers)
        finally:
            upstream.release()  # closes the connection unless the response was read to the end

    async def _relay_stream(
        self, call: BackendCall, upstream: UpstreamResponse, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        # The last bytes relayed (at least TAIL_BYTES once that many went by), trimmed only when
        # twice that size: an append per chunk, a copy every TAIL_BYTES.
        tail = bytearray()
        started = False
        try:
            while chunk := await upstream.next_chunk():
                if not started:
                    await response.prepare(call.request)
                    started = True
                    await response.write(chunk)
                    call.first_byte()
                else:
                    await response.write(chunk)
                tail += chunk
                if len(tail) > 2 * TAIL_BYTES:
                    del tail[:-TAIL_BYTES]
        except (TimeoutError, UpstreamClosedError) as exc:
            if not started:
                status = 504 if isinstance(exc, TimeoutError) else 502
                code = "upstream_timeout" if status == 504 else "upstream_error"
                raise UpstreamError(status, code, f"upstream stream failed: {exc}") from None
            log.warning("upstream stream of %s broke: %s", call.decision.request_id, exc)
            return response
        if not started:
            await response.prepare(call.request)
        usage = usage_from_sse(bytes(tail))
        call.prompt_tokens = _tokens(usage, "prompt_tokens")
        call.completion_tokens = _tokens(usage, "completion_tokens")
        try:
            await response.write_eof()
        except ConnectionResetError:  # the client left after the last chunk: nothing to tell it
            log.info("client of %s left before the end of its stream", call.decision.request_id)
        return response


__all__ = ["OpenAIBackend"]
