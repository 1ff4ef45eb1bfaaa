"""``openai`` backend: relay to any OpenAI-compatible upstream (vLLM, ...) over pooled connections.

* One :class:`~tokenfair.server.upstream.UpstreamClient` for the process (opened
  and closed by the app's cleanup context): keep-alive HTTP/1.1 connections to the upstream;
  timeouts: connect ``upstream_connect_timeout_s``, between upstream bytes
  ``upstream_read_timeout_s``, no total (a long stream is not an error).
* The body is forwarded as received (decoded, if the client compressed it: the proxy has read it
  through its ``Content-Encoding``, so that header is not forwarded), except that a streaming
  request without ``stream_options.include_usage`` gets it added, so the upstream reports usage
  in a final chunk (``"choices": []``). That chunk was not asked for: it is read for settlement
  and cut out of what the client receives (OpenAI SDK loops over ``chunk.choices[0]``).
* Streaming passthrough: upstream bytes are written to the client as they arrive, never parsed per
  chunk (only an SSE event holding ``"choices": []`` is decoded, to cut the injected usage
  event, see :class:`UsageEventFilter`); only the last :data:`TAIL_BYTES` are kept, and searched
  for the usage chunk at the end.
* Usage is read from the response (``usage.prompt_tokens`` / ``completion_tokens``) to settle;
  without it the estimate stands; an upstream error status with no usage settles at zero; a usage
  that is not believable (not an integer in ``[0, MAX_USAGE_TOKENS]``, nested too deeply) settles
  at the estimate and is recorded as ``upstream_bad_usage``.
* Encodings: the upstream is asked for ``Accept-Encoding: identity`` (usage is read from the
  body). If it answers ``gzip`` or ``deflate`` anyway, the body is decoded (in bounded pieces)
  and relayed without ``Content-Encoding``; any other coding is relayed as it came, with its
  header, and settled at the estimate (the usage cannot be read). Never encoded bytes without
  their label.
* Hop-by-hop headers, and every header the ``Connection`` header names, are dropped both ways, as
  are the tenant's ``Authorization`` (the upstream never sees tenants' keys) and ``x-tokenfair-*``
  headers. With an upstream API key (``upstream_api_key_file``), ``Authorization: Bearer <key>``
  is sent instead; the key is never logged.
* ``GET /v1/models`` is relayed as the upstream answers it (no admission: it does no model
  work), bounded: :data:`MODELS_TIMEOUT_S` for the whole exchange, the client's 8 MiB for the
  body, one relay at a time shared by every client asking, a good answer reused for
  :data:`MODELS_FRESH_S`; the upstream refusing the sidecar's own key (``401``/``403``) is a
  ``502`` (the client's key is not the one refused).
* Connection refused/reset or a broken response before the first byte: ``502``; connect or read
  timeout: ``504`` (generic messages; the details go to the log). A failure after the stream
  started raises :class:`StreamAbortedError`: the client's connection is cut without a clean end,
  and the request is recorded as ``upstream_aborted``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Final

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict

from tokenfair.core.reasons import Reason
from tokenfair.server.backends.base import (
    FRAMING_BYTES,
    HEAD_ALLOWANCE_BYTES,
    UPSTREAM_TOO_LARGE,
    Backend,
    BackendCall,
    StreamAbortedError,
    UpstreamError,
    UsageError,
    buffered_head_bytes,
)
from tokenfair.server.runtime_settings import OPENAI_BACKEND
from tokenfair.server.upstream import (
    MAX_BUFFERED_BODY_BYTES,
    UpstreamClient,
    UpstreamClosedError,
    UpstreamResponse,
    UpstreamTooLargeError,
)

log = logging.getLogger("tokenfair.sidecar")

HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
"""RFC 9110 §7.6.1's connection-specific headers (plus the non-standard ``Proxy-Connection``):
they describe one hop and must not be forwarded; nor must any header ``Connection`` names."""
_DROP_REQUEST: Final = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",  # the body forwarded is the decoded one
    "authorization",
    "accept-encoding",
    "expect",
}
_DROP_RESPONSE: Final = HOP_BY_HOP | {"content-length"}
TAIL_BYTES: Final = 8192
"""Bytes of a stream's end kept to find the usage chunk (a usage chunk is ~300 bytes)."""
DECODE_PIECE_BYTES: Final = 1 << 16
"""A compressed upstream body is decoded in pieces of at most this many bytes (64 KiB): a few
compressed bytes may expand to gigabytes, so nothing is decoded whole."""
_DECODED_CODINGS: Final = {"gzip": 31, "x-gzip": 31, "deflate": 15}
"""Content codings decoded here, with their zlib ``wbits`` (31: gzip framing, 15: zlib)."""
_DECODER: Final = json.JSONDecoder()
MODELS_TIMEOUT_S: Final = 10.0
MODELS_FRESH_S: Final = 5.0
"""Seconds a good ``/v1/models`` answer of the upstream is reused for every client."""
"""Longest a ``GET /v1/models`` relay may take in all (at most ``upstream_read_timeout_s``): a
model list is small and at hand, and SDK-based UIs list models while they start."""


def connection_tokens(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The lower-case header names listed in ``Connection`` headers (hop-by-hop by name)."""
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            named.update(token.strip().lower() for token in value.split(","))
    return frozenset(named)


def request_headers(headers: Any, api_key: str | None = None) -> list[tuple[str, str]]:
    """The client's headers as the upstream gets them (see the module docstring), with
    ``Accept-Encoding: identity`` (usage is read from the body, so it must not be compressed)
    and, with ``api_key``, the upstream's own ``Authorization``."""
    drop = _DROP_REQUEST
    if "Connection" in headers:
        drop = drop | connection_tokens(headers.items())
    out = [
        (name, value)
        for name, value in headers.items()
        if (lower := name.lower()) not in drop and not lower.startswith("x-tokenfair-")
    ]
    out.append(("Accept-Encoding", "identity"))
    if api_key is not None:
        out.append(("Authorization", f"Bearer {api_key}"))
    return out


def response_headers(
    headers: list[tuple[str, str]], extra: Any, *, drop_encoding: bool = False
) -> CIMultiDict[str]:
    """The upstream's headers as the client gets them, plus ``extra`` (the proxy's own);
    ``drop_encoding`` when the body is relayed decoded."""
    drop = _DROP_RESPONSE
    if drop_encoding:
        drop = drop | {"content-encoding"}
    kept: list[tuple[str, str]] = []
    connection: list[str] = []  # the Connection headers' values: they name more hop-by-hop ones
    for name, value in headers:
        lower = name.lower()
        if lower not in drop:
            kept.append((name, value))
        elif lower == "connection":
            connection.append(value)
    if connection:
        named = {token.strip().lower() for value in connection for token in value.split(",")}
        if not named <= drop:  # (``Connection: keep-alive`` names one dropped anyway)
            drop = drop | named
            kept = [(name, value) for name, value in kept if name.lower() not in drop]
    out: CIMultiDict[str] = CIMultiDict(kept)
    out.update(extra)
    return out


def content_coding(headers: list[tuple[str, str]]) -> str | None:
    """The response's content coding, lower case; None for none (absent or ``identity``)."""
    codings = [value.strip().lower() for name, value in headers
               if name.lower() == "content-encoding"]  # fmt: skip
    if not codings or codings == ["identity"]:
        return None
    return ", ".join(codings)


class BodyDecoder:
    """Decodes a gzip or deflate body fed in chunks, yielding pieces of at most
    :data:`DECODE_PIECE_BYTES`. ``deflate`` is the zlib format (RFC 9110); a raw deflate stream,
    which some servers send instead, is recognised by its first bytes failing as zlib.
    A corrupt body raises ``zlib.error``."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._decompressor = zlib.decompressobj(_DECODED_CODINGS[coding])
        self._started = False

    @property
    def complete(self) -> bool:
        """The compressed stream's end was seen (otherwise the body was cut short)."""
        return self._decompressor.eof

    def feed(self, data: bytes) -> Iterator[bytes]:
        decompressor = self._decompressor
        if not self._started and data:
            self._started = True
            if self.coding == "deflate":
                try:
                    zlib.decompressobj().decompress(data[:2])
                except zlib.error:
                    self._decompressor = decompressor = zlib.decompressobj(-15)
        while not decompressor.eof:
            piece = decompressor.decompress(data, DECODE_PIECE_BYTES)
            if piece:
                yield piece
            data = decompressor.unconsumed_tail
            # A full piece may leave output pending inside zlib even with no input left.
            if not data and len(piece) < DECODE_PIECE_BYTES:
                break

    def decode_all(self, data: bytes, limit: int) -> bytes:
        """The whole body decoded; :class:`UpstreamTooLargeError` past ``limit`` bytes (a
        ``502 upstream_too_large``, as a body that large before decoding), ``ValueError`` if it
        is cut short."""
        out = bytearray()
        for piece in self.feed(data):
            out += piece
            if len(out) > limit:
                raise UpstreamTooLargeError(f"the {self.coding} body decodes to over {limit} bytes")
        if not self.complete:
            raise ValueError(f"{self.coding} body cut short")
        return bytes(out)


def usage_from_json(data: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in a JSON body, decoded alone (no full parse). None
    when there is none or it does not decode; :class:`UsageError` when it nests deeper than the
    decoder can follow (a protocol error, not a missing usage)."""
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
    except RecursionError:
        raise UsageError("usage: nested too deeply to decode") from None
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


def usage_from_sse(tail: bytes) -> dict[str, Any] | None:
    """The usage of the last SSE ``data:`` line that carries one, searched from the end (the
    usage chunk is the last before ``[DONE]``; earlier chunks may say ``"usage":null``). Lines
    end with LF, CRLF or CR: a CR is looked for only between the line's LF and its
    ``"usage"`` (not over the whole tail, which servers' LF streams hold none of)."""
    end = len(tail)
    while (index := tail.rfind(b'"usage"', 0, end)) >= 0:
        lf = tail.rfind(b"\n", 0, index)
        start = max(lf, tail.rfind(b"\r", lf + 1, index)) + 1
        line = tail[start:index].lstrip()
        if line.startswith(b"data:"):
            lf = tail.find(b"\n", index)
            cr = tail.find(b"\r", index, None if lf < 0 else lf)
            stop = cr if cr >= 0 else lf if lf >= 0 else len(tail)
            usage = usage_from_json(tail[index:stop])
            if usage is not None:
                return usage
        end = start
    return None


_LINE_END: Final = rb"(?:\r\n|\n|\r(?!\n))"
_EVENT_END: Final = re.compile(_LINE_END + _LINE_END)
"""Two line ends in a row: the blank line that ends an SSE event. A line ends with CRLF, LF or a
lone CR (SSE allows all three); a CR at the end of the bytes so far counts as a lone one (an LF
that starts the next chunk is then part of that line end)."""
_LINE_SPLIT: Final = re.compile(rb"\r\n|\n|\r")
_EMPTY_CHOICES: Final = re.compile(rb'"choices"\s*:\s*\[\s*\]')
"""What an event's data must hold to be the usage event (:func:`_empty_choices` finds it)."""
_EMPTY_LIST: Final = re.compile(rb"\[\s*\]")
_SPACE: Final = b" \t\n\r\x0b\x0c"
"""The bytes ``\\s`` matches in a bytes pattern."""
_CHOICES: Final = b'"choices"'
_LOOKBACK_BYTES: Final = 64
"""How far before an empty list :func:`_empty_choices` looks for its ``"choices":``."""


def _empty_choices(data: bytes, pos: int = 0) -> tuple[int, int] | None:
    """``(start, end)`` of ``_EMPTY_CHOICES.search(data, pos)``, found from the empty list
    instead: that regex's literal prefix starts with a quote, which JSON has every few bytes
    (~12 instructions a byte scanned), while the ``[`` of ``\\[\\s*\\]`` is rarer (~6) and an
    empty list rare. Each empty list is checked backward within :data:`_LOOKBACK_BYTES` before
    its ``[`` (``"choices"``, ``\\s*:\\s*``); a check that the window cuts short (all
    whitespace) runs the regex itself from there. Matches come in the regex's order: the bytes
    between a ``"choices"`` and its ``[`` hold no ``]`` of an earlier list."""
    while (found := _EMPTY_LIST.search(data, pos)) is not None:
        at = found.start()
        window = max(pos, at - _LOOKBACK_BYTES)
        head = data[window:at].rstrip(_SPACE)
        if head.endswith(b":"):
            head = head[:-1].rstrip(_SPACE)
            if head.endswith(_CHOICES):
                return window + len(head) - len(_CHOICES), found.end()
        if window > pos and len(head) < len(_CHOICES):  # the window may hide a match's start
            match = _EMPTY_CHOICES.search(data, pos)
            return None if match is None else match.span()
        pos = found.end()
    return None


MAX_HELD_EVENT_BYTES: Final = 1 << 16
"""An SSE event longer than this (64 KiB) is passed through unexamined rather than held."""


def _event_data(event: bytes) -> bytes | None:
    """An SSE event's data: its ``data:`` lines' values joined with LF, as a client reads them
    (None: the event has no data line). An event of one ``data:`` line ended by LFs (what
    servers write) is sliced, not split line by line."""
    line = event.rstrip(b"\n")
    if line.startswith(b"data:") and b"\n" not in line and b"\r" not in line:
        value = line[5:]
        return value[1:] if value.startswith(b" ") else value
    values: list[bytes] = []
    for line in _LINE_SPLIT.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            values.append(b"")
    return b"\n".join(values) if values else None


def _is_usage_event(event: bytes) -> bool:
    """Whether an SSE event's data is a JSON object with ``"choices": []`` and a ``"usage"``
    object: the event that ``include_usage`` adds."""
    data = _event_data(event)
    if data is None:
        return False
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return (
        isinstance(payload, dict)
        and payload.get("choices") == []
        and isinstance(payload.get("usage"), dict)
    )


END_PROBE_BYTES: Final = 64
"""The last bytes written to a streaming client that are kept to see whether they end with the
stream's last event (``data: [DONE]`` is 14 bytes and its line ends)."""


def _last_event(data: bytes) -> bytes | None:
    """The last whole SSE event in ``data`` (ended by a blank line), without its line ends;
    None if ``data`` does not end with a whole event."""
    body = data.rstrip(b"\r\n")
    if _EVENT_END.search(data, len(body)) is None:
        return None  # the last event has not ended (no blank line after it yet)
    start = 0
    for match in _EVENT_END.finditer(body):
        start = match.end()
    return body[start:]


def client_has_end(sent_end: bytes, sent_tail: bytes | bytearray, *, asked_usage: bool) -> bool:
    """Whether a streaming client has its stream's end: the last event it was sent
    (``sent_end``: its last bytes) is ``data: [DONE]``, or, for a client that asked for usage
    (``sent_tail`` is then the last bytes it was sent), the usage event ``include_usage``
    adds, which servers send last before ``[DONE]``."""
    event = _last_event(sent_end)
    if event is not None and _event_data(event) == b"[DONE]":
        return True
    if not asked_usage:
        return False
    event = _last_event(bytes(sent_tail))
    return event is not None and _is_usage_event(event)


def _last_event_end(buffer: bytes, start: int) -> int:
    """Where the last blank line in ``buffer[start:]`` ends, as ``_EVENT_END.finditer(buffer,
    start)`` finds it (0: none). Without a CR there, found by ``rfind`` instead of a regex scan
    of every byte: a run of LFs pairs into line ends from its first, so an odd last one is
    left to the next event (as the regex leaves it)."""
    if buffer.find(b"\r", start) >= 0:
        end = 0
        for match in _EVENT_END.finditer(buffer, start):
            end = match.end()
        return end
    index = buffer.rfind(b"\n\n", start)
    if index < 0:
        return 0
    run = index  # where the run of LFs holding the last pair starts
    while run > start and buffer[run - 1] == 0x0A:
        run -= 1
    return index + 2 - (index + 2 - run) % 2


def _cut_usage_events_lf(events: bytes) -> bytes:
    """:meth:`UsageEventFilter._filter` of whole events whose lines all end with LF: the usage
    event cut, found from its ``"choices": []`` (not by splitting every event); the bytes
    around it unchanged. A candidate whose pattern spans an event's end (its ``\\s`` can match
    the blank line) goes to the general per-event split."""
    out: list[bytes] = []
    kept_from = search_at = 0
    while (match := _empty_choices(events, search_at)) is not None:
        at, match_end = match
        end = events.find(b"\n\n", at)  # the blank line ending its event (pairs from here)
        if end < 0 or match_end > end:
            return _cut_usage_events_split(events)
        end += 2
        # Its event's first byte: after the last blank line before it, past the line ends
        # that start the event (kept, as the per-event split keeps them).
        start = events.rfind(b"\n\n", 0, at)
        start = 0 if start < 0 else start + 2
        while start < at and events[start] == 0x0A:
            start += 1
        if _is_usage_event(events[start:end]):
            out.append(events[kept_from:start])
            kept_from = end
        search_at = end
    if not out:
        return events
    out.append(events[kept_from:])
    return b"".join(out)


def _cut_usage_events_split(events: bytes) -> bytes:
    """``events`` (whole events, LF line ends) without the usage event, split event by event."""
    out: list[bytes] = []
    start = kept_from = 0
    for match in _EVENT_END.finditer(events):
        end = match.end()
        event = events[start:end]
        if _empty_choices(event) is not None and _is_usage_event(event):
            out.append(events[kept_from : start + _leading_line_ends(event)])
            kept_from = end
        start = end
    if not out:
        return events
    out.append(events[kept_from:])
    return b"".join(out)


def _leading_line_ends(event: bytes) -> int:
    """How many bytes of line ends (extra blank lines) start ``event``."""
    return len(event) - len(event.lstrip(b"\r\n"))


class UsageEventFilter:
    """Cuts the usage-only event out of an SSE stream (for a client that did not ask for it).

    The stream is read as SSE is specified: lines end with LF, CRLF or CR, an event is the lines
    up to a blank line, and its data is its ``data:`` lines' values joined with LF. The event cut
    is one whose data is a JSON object with ``"choices": []`` and a ``"usage"`` object: all of
    it goes (its ``event:``, ``id:`` and comment lines, its data and the blank line ending it);
    every other byte passes through unchanged.

    Bytes pass through as whole events: an event is held until the blank line that ends it
    arrives (a client acts on an event only then, and servers write whole events, so in practice
    nothing waits). An event that grows past :data:`MAX_HELD_EVENT_BYTES` without ending is
    not examined: what was held goes out, and the rest of that event passes through as it comes.
    Only an event holding ``"choices"`` with an empty list is decoded to check it, so an
    ordinary chunk costs a scan for the blank line and one for that pattern."""

    def __init__(self) -> None:
        self._held = b""
        """The start of the current event (no blank line yet)."""
        self._passing = False
        """The current event grew past the bound: its bytes pass through until it ends."""
        self._tail = b""
        """While passing: the last two bytes passed (a blank line may span two chunks)."""
        self._after_cr: bytes | None = None
        """The bytes so far ended an event with a lone CR: an LF starting the next chunk is
        part of that line end, and goes as the event went (``b"\\n"`` passed, ``b""`` cut)."""

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        if self._after_cr is not None and data:
            if data.startswith(b"\n"):
                out.append(self._after_cr)
                data = data[1:]
            self._after_cr = None
        if self._passing:
            data = self._pass(data, out)
        if not data:
            return b"".join(out)
        held = self._held
        buffer = held + data if held else data
        # A blank line completed by `data` starts at most 3 bytes before it (CRLF CR).
        end = _last_event_end(buffer, max(0, len(held) - 3))
        if end:
            out.append(self._filter(buffer[:end], at_end=end == len(buffer)))
        rest = buffer[end:] if end else buffer
        if len(rest) > MAX_HELD_EVENT_BYTES:  # too long to hold: pass it on unexamined
            out.append(rest)
            self._passing = True
            self._tail = rest[-2:]
            rest = b""
        self._held = rest
        return b"".join(out)

    @property
    def holding(self) -> bool:
        """Bytes of an event no blank line has ended yet are held (:meth:`flush` has them)."""
        return bool(self._held)

    def flush(self) -> bytes:
        """The held bytes at the end of the stream (an event no blank line ended: cut if it is
        the usage event)."""
        held, self._held = self._held, b""
        if held and _empty_choices(held) is not None and _is_usage_event(held):
            return held[: _leading_line_ends(held)]
        return held

    def _pass(self, data: bytes, out: list[bytes]) -> bytes:
        """Pass ``data`` on as part of an oversized event; returns what follows its end."""
        tail = self._tail
        # The last bytes passed hold no blank line (the event would have ended there), but one
        # may start in them and end in `data`.
        match = _EVENT_END.search(tail + data)
        if match is None:
            out.append(data)
            self._tail = (tail + data[-2:])[-2:]
            return b""
        split = max(0, match.end() - len(tail))
        out.append(data[:split])
        self._passing = False
        self._tail = b""
        if split == len(data) and data.endswith(b"\r"):
            self._after_cr = b"\n"
        return data[split:]

    def _filter(self, events: bytes, *, at_end: bool) -> bytes:
        """``events`` (whole events) without the usage event; ``at_end``: nothing follows them
        yet (a final lone CR may be continued by an LF)."""
        if b"\r" not in events:  # LF line ends only (as servers write): no per-event work
            return _cut_usage_events_lf(events)
        ends_with_cr = at_end and events.endswith(b"\r")
        kept = True  # the last event's fate
        if _empty_choices(events) is not None:
            out: list[bytes] = []
            start = kept_from = 0
            for match in _EVENT_END.finditer(events):
                end = match.end()
                event = events[start:end]
                kept = _empty_choices(event) is None or not _is_usage_event(event)
                if not kept:
                    out.append(events[kept_from : start + _leading_line_ends(event)])
                    kept_from = end
                start = end
            if out:
                out.append(events[kept_from:])
                events = b"".join(out)
        if ends_with_cr:
            self._after_cr = b"\n" if kept else b""
        return events


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


def _upstream_failure(exc: Exception, where: str) -> UpstreamError:
    """The 502/504 for an upstream failure before the response started (details: the log)."""
    if isinstance(exc, TimeoutError):
        return UpstreamError(504, Reason.UPSTREAM_TIMEOUT, f"upstream {where} timed out: {exc}")
    if isinstance(exc, UpstreamTooLargeError):
        return UpstreamError(502, UPSTREAM_TOO_LARGE, f"upstream {where} refused: {exc}")
    return UpstreamError(502, Reason.UPSTREAM_ERROR, f"upstream {where} failed: {exc}")


def _decoded(decoder: BodyDecoder, data: bytes, coding: str | None, what: str) -> bytes:
    """A whole buffered body decoded (at most :data:`MAX_BUFFERED_BODY_BYTES`); a body too
    large or not decodable is an :class:`UpstreamError` (``502``) naming ``what``."""
    try:
        return decoder.decode_all(data, MAX_BUFFERED_BODY_BYTES)
    except UpstreamTooLargeError as exc:
        raise _upstream_failure(exc, what) from None
    except (zlib.error, ValueError) as exc:
        raise UpstreamError(
            502, Reason.UPSTREAM_ERROR, f"upstream {coding} {what} body undecodable: {exc}"
        ) from None


async def _start_stream(call: BackendCall, response: web.StreamResponse, first_bytes: int) -> None:
    """Prepare a streamed answer whose first write is ``first_bytes`` long: its head waits in
    aiohttp's buffer to go out with those bytes (:class:`_SSEResponse`) when that one write
    cannot wait — head and bytes under the transport's high-water mark, the head counted at its
    real size (an upstream's headers may fill up to 64 KiB), not at
    :data:`~tokenfair.server.backends.base.HEAD_ALLOWANCE_BYTES` — else it goes first, on its
    own: a write that may wait is timed from the bytes the client holds, and a head that rode
    with it would go out under a drain no timer watches (a client that stopped reading would
    hold its slot)."""
    writer = await response.prepare(call.request)
    if not isinstance(writer, StreamWriter):
        return
    head = buffered_head_bytes(writer)
    # `cannot_wait` keeps the allowance for a head: count what the real one has beyond it, and
    # the framing. A head that rides goes in a send that cannot wait, never in a timed one.
    beyond = max(head, HEAD_ALLOWANCE_BYTES) - HEAD_ALLOWANCE_BYTES + FRAMING_BYTES
    if head and not call.cannot_wait(first_bytes + beyond):
        writer.send_headers()


class _SSEResponse(web.StreamResponse):
    """A streamed answer whose status line and headers go out with its first bytes, in one
    send (``prepare`` only buffers them; aiohttp's ``web.Response`` does the same), not in a
    send of their own: the client gets the same bytes, with one system call fewer. Prepared
    only when its first bytes are at hand (or at its end), so nothing waits behind it. When
    that first write may wait (:meth:`BackendCall.cannot_wait` false), the head is sent first
    on its own, so the write timer's baseline holds it as before."""

    _send_headers_immediately = False


class OpenAIBackend(Backend):
    name: ClassVar[str] = OPENAI_BACKEND
    default_max_in_flight: ClassVar[int] = 64

    def __init__(
        self,
        upstream_url: str,
        connect_timeout_s: float,
        read_timeout_s: float,
        *,
        api_key: str | None = None,
    ) -> None:
        self.upstream_url = upstream_url
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._api_key = api_key
        """The upstream's own key (``Authorization: Bearer``); never logged or shown."""
        self._client: UpstreamClient | None = None
        self._models: asyncio.Task[web.Response] | None = None
        """The one ``/v1/models`` relay in flight, or the last good one while it is fresh."""
        self._models_at_s = 0.0

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

    def _payload(self, call: BackendCall) -> tuple[bytes, bool]:
        """The body to send, and whether the sidecar added ``include_usage`` to it."""
        if not call.stream:
            return call.raw_body, False
        options = call.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            return call.raw_body, False
        if options is None and "stream_options" not in call.body:
            spliced = with_include_usage(call.raw_body)
            if spliced is not None:
                return spliced, True
        body = dict(call.body)
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}  # fmt: skip
        try:
            return json.dumps(body, separators=(",", ":")).encode(), True
        except RecursionError:  # nested near the parser's limit: forwarded as is (the usage is
            return call.raw_body, False  # then unknown, and the request settles at its estimate)

    async def respond(self, call: BackendCall) -> web.StreamResponse:
        client = self._client
        if client is None:
            raise UpstreamError(502, Reason.UPSTREAM_UNAVAILABLE, "the upstream client is closed")
        request = call.request
        payload, injected = self._payload(call)
        try:
            upstream = await client.request(
                "POST",
                request.rel_url.raw_path_qs,  # encoded path + query (of absolute-form too)
                request_headers(request.headers, self._api_key),
                payload,
            )
        except (TimeoutError, UpstreamClosedError) as exc:
            raise _upstream_failure(exc, "request") from None
        call.upstream_answered = True
        try:
            coding = content_coding(upstream.headers)
            decoder = BodyDecoder(coding) if coding in _DECODED_CODINGS else None
            opaque = coding is not None and decoder is None  # relayed as is, with its header
            headers = response_headers(
                upstream.headers, call.response_headers, drop_encoding=decoder is not None
            )
            if call.stream and upstream.status == 200:
                return await self._relay_stream(call, upstream, headers, decoder, injected, opaque)
            try:
                data = await upstream.read()
            except (TimeoutError, UpstreamClosedError) as exc:
                self._report_cut_usage(call, upstream, readable=coding is None)
                raise _upstream_failure(exc, "response") from None
            if decoder is not None:
                data = _decoded(decoder, data, coding, "response")
            self._report_json_usage(call, None if opaque else data, upstream.status)
            call.first_byte()
            return web.Response(body=data, status=upstream.status, headers=headers)
        finally:
            upstream.release()  # closes the connection unless the response was read to the end

    async def models(self, request: web.Request) -> web.StreamResponse:
        """Relay ``GET /v1/models`` (see the module docstring); only ``Accept`` and the
        upstream's own key go upstream, none of the client's headers. One relay at a time,
        whatever the number of clients asking (they share it), and a good answer is reused
        for :data:`MODELS_FRESH_S`: the list is the same for every tenant, so a tenant cannot
        turn it into upstream load."""
        loop = asyncio.get_running_loop()
        task = self._models
        stale = task is not None and task.done() and (
            task.cancelled() or task.exception() is not None
            or loop.time() - self._models_at_s > MODELS_FRESH_S
        )  # fmt: skip
        if task is None or stale:
            task = self._models = asyncio.ensure_future(self._relay_models(request))
            self._models_at_s = loop.time()
        answer = await asyncio.shield(task)  # a client leaving does not cancel the others'
        return web.Response(body=answer.body, status=answer.status, headers=answer.headers)

    async def _relay_models(self, request: web.Request) -> web.Response:
        client = self._client
        if client is None:
            raise UpstreamError(502, Reason.UPSTREAM_UNAVAILABLE, "the upstream client is closed")
        headers = [("Accept", "application/json"), ("Accept-Encoding", "identity")]
        if self._api_key is not None:
            headers.append(("Authorization", f"Bearer {self._api_key}"))
        try:
            async with asyncio.timeout(min(MODELS_TIMEOUT_S, self.read_timeout_s)):
                upstream = await client.request("GET", "/v1/models", headers, b"")
                try:
                    data = await upstream.read()
                finally:
                    upstream.release()
        except (TimeoutError, UpstreamClosedError) as exc:
            raise _upstream_failure(exc, "models request") from None
        coding = content_coding(upstream.headers)
        decoder = BodyDecoder(coding) if coding in _DECODED_CODINGS else None
        if decoder is not None:
            data = _decoded(decoder, data, coding, "models response")
        if upstream.status in (401, 403):
            # The sidecar's own key (or its absence) was refused: not the client's key.
            raise UpstreamError(
                502, Reason.UPSTREAM_ERROR,
                f"upstream refused the sidecar's models request (HTTP {upstream.status}): "
                "check the upstream API key setting",
            )  # fmt: skip
        out = response_headers(upstream.headers, {}, drop_encoding=decoder is not None)
        if upstream.status != 200:  # not kept: the next client asks again
            self._models_at_s = -MODELS_FRESH_S
        return web.Response(body=data, status=upstream.status, headers=out)

    async def engine_get(
        self, path: str, timeout_s: float, limit_bytes: int
    ) -> tuple[int, bytes] | None:
        """``GET path`` from the upstream (its metrics, model list, routes): only ``Accept`` and
        the upstream's own key are sent; a compressed answer is decoded within
        ``limit_bytes``."""
        client = self._client
        if client is None:
            raise UpstreamError(502, Reason.UPSTREAM_UNAVAILABLE, "the upstream client is closed")
        headers = [("Accept", "*/*"), ("Accept-Encoding", "identity")]
        if self._api_key is not None:
            headers.append(("Authorization", f"Bearer {self._api_key}"))
        async with asyncio.timeout(timeout_s):
            upstream = await client.request("GET", path, headers, b"")
            try:
                data = await upstream.read()
            finally:
                upstream.release()
        if len(data) > limit_bytes:
            raise UpstreamTooLargeError(f"GET {path}: {len(data)} bytes (at most {limit_bytes})")
        coding = content_coding(upstream.headers)
        if coding in _DECODED_CODINGS:
            data = _decoded(BodyDecoder(coding), data, coding, f"GET {path}")
        return upstream.status, data

    @staticmethod
    def _report_cut_usage(call: BackendCall, upstream: UpstreamResponse, *, readable: bool) -> None:
        """A whole answer cut after its head (closed, timed out, too large): the upstream ran
        the request, so it settles at the usage in the part received (a whole ``usage`` object
        in it, read only from an unencoded body), else at the estimate; an error status at
        zero, as a whole error answer without usage."""
        if upstream.status >= 400:
            call.prompt_tokens = call.completion_tokens = 0
            return
        if not readable:
            return
        try:
            usage = usage_from_json(upstream.received())
        except UsageError as exc:
            call.bad_usage(str(exc))
            return
        if usage is not None:
            call.report_usage(usage)

    @staticmethod
    def _report_json_usage(call: BackendCall, data: bytes | None, status: int) -> None:
        try:
            usage = None if data is None else usage_from_json(data)
        except UsageError as exc:
            call.bad_usage(str(exc))
            return
        if usage is None and status >= 400:
            call.prompt_tokens = call.completion_tokens = 0
        else:
            call.report_usage(usage)

    async def _relay_stream(
        self,
        call: BackendCall,
        upstream: UpstreamResponse,
        headers: CIMultiDict[str],
        decoder: BodyDecoder | None,
        injected: bool,
        opaque: bool,
    ) -> web.StreamResponse:
        """Relay an SSE stream. ``injected``: the sidecar added ``include_usage`` (its usage
        event is cut out); ``opaque``: the body is in a coding not decoded here (relayed as
        is, its usage unread)."""
        response = _SSEResponse(status=upstream.status, headers=headers)
        # The last bytes relayed (at least TAIL_BYTES once that many went by), trimmed only when
        # twice that size: an append per chunk, a copy every TAIL_BYTES. A piece is added once
        # the client has been sent what it became, so without the usage filter the tail is what
        # the client has.
        tail = bytearray()
        usage_filter = UsageEventFilter() if injected and not opaque else None
        started = ended = False
        sent_end = b""  # the last bytes the client was sent: is its stream's end among them?
        try:
            while chunk := await upstream.next_chunk():
                # The upstream's end came with this chunk: its bytes and the client's end can go
                # in one send (unless the filter holds an unended event: flushed on its own).
                last = decoder is None and upstream.complete
                for piece in decoder.feed(chunk) if decoder is not None else (chunk,):
                    out = piece if usage_filter is None else usage_filter.feed(piece)
                    if out:
                        last = last and (usage_filter is None or not usage_filter.holding)
                        if not started:
                            await _start_stream(call, response, len(out))
                            started = True
                            ended = last and await call.end_at_once(response, out)
                            if not ended:
                                await call.write(response, out)
                            call.first_byte()
                        elif not (ended := last and await call.end_at_once(response, out)):
                            await call.write(response, out)
                        sent_end = (sent_end + out[-END_PROBE_BYTES:])[-END_PROBE_BYTES:]
                    if call.progress is not None:
                        call.progress.relayed(piece)
                    if not opaque:
                        tail += piece
                        if len(tail) > 2 * TAIL_BYTES:
                            del tail[:-TAIL_BYTES]
            if decoder is not None and not decoder.complete:
                raise UpstreamClosedError(f"the upstream's {decoder.coding} stream was cut short")
        except asyncio.CancelledError:
            # The client left. If it had its stream's end, it met a whole answer: a 200,
            # settled at the usage (the upstream's own end, awaited here, changes nothing).
            if not opaque and client_has_end(sent_end, tail, asked_usage=usage_filter is None):
                call.answer_complete = True
                self._report_stream_usage(call, tail)
            raise
        except (TimeoutError, UpstreamClosedError, zlib.error) as exc:
            if not started:
                raise _upstream_failure(exc, "stream") from None
            self._report_stream_usage(call, tail)
            if not opaque and client_has_end(sent_end, tail, asked_usage=usage_filter is None):
                # The client has its stream's end: the answer is whole, and ends cleanly.
                log.info("upstream stream of %s broke after its end was relayed (%s); ending "
                         "the client's stream", call.decision.request_id, exc)  # fmt: skip
                call.answer_complete = True
                await self._end_stream(call, response)
                return response
            log.warning("upstream stream of %s broke after it started: %s",
                        call.decision.request_id, exc)  # fmt: skip
            raise StreamAbortedError(response, str(exc)) from None
        rest = usage_filter.flush() if usage_filter is not None else b""
        if not started:
            await _start_stream(call, response, len(rest))
        if rest:
            await call.write(response, rest)
        self._report_stream_usage(call, tail)
        if not ended:
            await self._end_stream(call, response)
        return response

    @staticmethod
    async def _end_stream(call: BackendCall, response: web.StreamResponse) -> None:
        """End the client's stream (its last chunk), bounded by the write timeout."""
        try:
            await call.write_eof(response)
        except ConnectionResetError:
            if call.client_write_timed_out:  # cut for not reading: the proxy records it so
                raise
            # The client left after the last chunk: nothing to tell it.
            log.info("client of %s left before the end of its stream", call.decision.request_id)

    @staticmethod
    def _report_stream_usage(call: BackendCall, tail: bytearray) -> None:
        try:
            usage = usage_from_sse(bytes(tail))
        except UsageError as exc:
            call.bad_usage(str(exc))
            return
        call.report_usage(usage)


__all__ = ["OpenAIBackend"]
