"""The access log: one structured line per proxy request, on the ``tokenfair.access`` logger.

A request that reached admission is logged by the outcome sink (:meth:`Outcomes.completed
<tokenfair.server.outcomes.Outcomes.completed>`), the one place its completion is counted (called
once by :meth:`Lifecycle.complete <tokenfair.server.lifecycle.Lifecycle.complete>`); a request
answered before admission (``401``, ``400`` invalid, ``413``, ``404``, ``503 draining`` at the
door, ``GET /v1/models``) by the proxy app's middleware, which sees that nothing accounted it.
Either way exactly one line, and logging never raises into the request: a failure is logged
on ``tokenfair.sidecar`` and the request's record, metrics and slot are untouched.

Fields (``None`` where unknown; times in wall milliseconds, i.e. model ms times ``timeScale``):

=============================  ==============================================================
``time``                       when the line was written (UTC, RFC 3339, milliseconds)
``request_id``                 the sidecar's id (``x-request-id``; None before admission)
``tenant``, ``priority_class`` the tenant and the class (lane) the request ran in
``method``, ``route``          HTTP method and path (``/v1/chat/completions``, ...)
``model``                      the body's ``model``, for requests that ran
``status``, ``reason``         the outcome as recorded (``200 admitted``, ``429
                               shed_queue_wait_slo``, ``499 cancelled``, ``401
                               invalid_api_key``, ...)
``gate``                       the admission gate that decided
``prompt_tokens_estimated``,   the estimate admission charged (tokens, and service tokens)
``completion_tokens_estimated``,
``service_tokens_estimated``
``prompt_tokens``,             the usage the backend reported (None: not reported, or not
``completion_tokens``          believed)
``service_tokens_settled``     what the tenant was charged in the end (0: never ran)
``queue_wait_ms``, ``ttft_ms``, arrival to dispatch, to the first byte, to the end
``e2e_ms``
=============================  ==============================================================

Formats (``accessLog`` / ``--access-log``): ``json`` (default; one JSON object per line),
``text`` (logfmt: ``key=value``, strings quoted when needed) or ``off``. Each line is formatted
by this module alone: :func:`served_json_line` for a request that reached admission (the fields
above, in that order), :func:`json_line` for any other set of fields; either equals
``json.dumps(fields, separators=(",", ":"))`` (ASCII, ``NaN``/``Infinity`` as ``json`` writes
them) without going through a JSON encoder.

Where the lines go:

* ``tokenfair sidecar`` writes them to stdout, bare, through a :class:`LineWriter` handed to
  the app (``create_app(access_writer=...)``), with no ``logging`` on the way: the event loop
  appends each line to a buffer, which goes to the writer's own thread once it holds
  :data:`FLUSH_CHARS` characters or ``flush_interval_s`` after its first line
  (``accessLogFlushSeconds``, default :data:`DEFAULT_FLUSH_INTERVAL_S`); that thread does the
  writes, so a reader that falls behind (a full pipe) never stalls the loop. Past
  :data:`MAX_PENDING_LINES` lines waiting for the thread, a new batch is dropped and counted
  (logged on ``tokenfair.sidecar``). The app's teardown hands the last buffer over, and the
  command waits up to :data:`FLUSH_AT_EXIT_S` for it to be written: nothing is lost at exit
  (``SIGTERM``'s drain included) unless the reader is stuck.
* Embedded in another program (``create_app`` without a writer), each line is a record of the
  ``tokenfair.access`` logger, configured like any other (it inherits the root's level); the
  fields are also on the record as ``record.access`` (a dict), so a handler of your own can
  format them as it likes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

ACCESS_LOGGER: Final = "tokenfair.access"
ACCESS_LOG_FORMATS: Final = ("json", "text", "off")
MAX_PENDING_LINES: Final = 10_000
"""Lines waiting for the writer thread before new ones are dropped (~500 bytes each, at most
~2 KiB since every text a client chooses is cut to :data:`MAX_FIELD_CHARS`: ~5 to ~20 MiB)."""
MAX_FIELD_CHARS: Final = 128
"""Longest text a client chooses (the route of an unknown path, the ``model``) written to a
line or a span; longer is cut, ending in ``…``."""
FLUSH_CHARS: Final = 65_536
"""Buffered characters (~130 lines) that send the buffer to the writer thread at once."""
DEFAULT_FLUSH_INTERVAL_S: Final = 0.1
"""The longest a line waits in the buffer (``accessLogFlushSeconds``): one hand-over to the
writer thread per interval or per :data:`FLUSH_CHARS`, where a thread woken per line cost the
loop more than the line itself."""

SERVED_FIELDS: Final = (
    "time", "request_id", "tenant", "priority_class", "method", "route", "model", "status",
    "reason", "gate", "prompt_tokens_estimated", "completion_tokens_estimated",
    "service_tokens_estimated", "prompt_tokens", "completion_tokens", "service_tokens_settled",
    "queue_wait_ms", "ttft_ms", "e2e_ms",
)  # fmt: skip
"""The fields of a request that reached admission, in the order of its line."""
UNADMITTED_FIELDS: Final = (
    "time", "request_id", "tenant", "priority_class", "method", "route", "model", "status",
    "reason", "e2e_ms",
)  # fmt: skip
"""The fields of a request answered before admission, in the order of its line."""


def bounded(text: str | None) -> str | None:
    """``text`` cut to :data:`MAX_FIELD_CHARS` characters (None stays None)."""
    if text is None or len(text) <= MAX_FIELD_CHARS:
        return text
    return text[: MAX_FIELD_CHARS - 1] + "…"


FLUSH_AT_EXIT_S: Final = 1.0
"""How long ``tokenfair sidecar`` waits at exit for the lines still waiting to be written."""

_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))
_string: Final = json.encoder.encode_basestring_ascii

log = logging.getLogger("tokenfair.sidecar")


@dataclass(slots=True)
class RequestScope:
    """What the proxy app's middleware knows of one HTTP request, for whoever completes it."""

    method: str
    route: str
    arrival_ms: float
    """Model time the middleware saw the request (before its body was read)."""
    traceparent: str | None = None
    """The client's W3C ``traceparent`` (the request's span joins the client's trace)."""
    tracestate: str | None = None
    accounted: bool = False
    """Set once the request's outcome is accounted (logged, traced): the middleware then
    writes nothing more."""


CURRENT_SCOPE: Final[contextvars.ContextVar[RequestScope | None]] = contextvars.ContextVar(
    "tokenfair_request_scope", default=None
)
"""The scope of the request the running handler serves (set by the middleware; None outside a
proxy request, e.g. in tests that drive a lifecycle directly)."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the lifecycle knows at the end besides the decision and usage (for the log and the
    span)."""

    route: str | None = None
    model: str | None = None
    admission_ms: float | None = None
    """Model time admission decided (None: unknown)."""
    queued: bool = False
    """It entered the queue (not refused at the door)."""
    settlement: str | None = None
    """How it was settled (:class:`~tokenfair.server.lifecycle.Settlement` value), if
    it ran."""


NO_FACTS: Final = RequestFacts()
"""Nothing known besides the decision and usage."""


def utc_timestamp(now_s: float) -> str:
    """``2026-12-01T21:45:07.123Z``."""
    whole = int(now_s)
    millis = min(999, int((now_s - whole) * 1000))
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(whole))}.{millis:03d}Z"


class UtcTimestamps:
    """:func:`utc_timestamp`, keeping the date and time of the last whole second (formatted
    once a second, not once a line)."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second: int | None = None
        self._prefix = ""

    def __call__(self, now_s: float) -> str:
        whole = int(now_s)
        if whole != self._second:
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            self._second = whole
        millis = min(999, int((now_s - whole) * 1000))
        return f"{self._prefix}.{millis:03d}Z"


# -- the JSON line ------------------------------------------------------------------------------


def _json_float(value: float) -> str:
    """A float as ``json`` writes it: ``repr``, or ``NaN`` / ``Infinity`` / ``-Infinity``."""
    if math.isfinite(value):
        return float.__repr__(value)
    return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"


def _json_value(value: Any) -> str:
    """One value as ``json.dumps`` writes it (the few types a line holds; anything else through
    the encoder, which no line of the sidecar's needs)."""
    if value is None:
        return "null"
    kind = type(value)
    if kind is str:
        return _string(value)
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        return _json_float(value)
    if kind is bool:
        return "true" if value else "false"
    return _ENCODER.encode(value)


def _json_text(value: str | None) -> str:
    return "null" if value is None else _string(value)


def json_line(fields: Mapping[str, Any]) -> str:
    """``fields`` as one JSON object: ``json.dumps(fields, separators=(",", ":"))``."""
    return "{" + ",".join([f"{_string(k)}:{_json_value(v)}" for k, v in fields.items()]) + "}"


def served_json_line(
    time: str,
    request_id: str,
    tenant: str,
    priority_class: str,
    method: str,
    route: str | None,
    model: str | None,
    status: int,
    reason: str,
    gate: str,
    prompt_tokens_estimated: int,
    completion_tokens_estimated: int,
    service_tokens_estimated: int,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    service_tokens_settled: int,
    queue_wait_ms: float,
    ttft_ms: float | None,
    e2e_ms: float,
) -> str:
    """The line of a request that reached admission (its :data:`SERVED_FIELDS`, in order):
    :func:`json_line` of those fields, written out in one f-string (the hot path: one a
    request; each field formatted by the one rule its type needs)."""
    return (
        f'{{"time":{_string(time)},"request_id":{_string(request_id)},'
        f'"tenant":{_string(tenant)},"priority_class":{_string(priority_class)},'
        f'"method":{_string(method)},"route":{_json_text(route)},'
        f'"model":{_json_text(model)},"status":{status:d},'
        f'"reason":{_string(reason)},"gate":{_string(gate)},'
        f'"prompt_tokens_estimated":{prompt_tokens_estimated:d},'
        f'"completion_tokens_estimated":{completion_tokens_estimated:d},'
        f'"service_tokens_estimated":{service_tokens_estimated:d},'
        f'"prompt_tokens":{_json_value(prompt_tokens)},'
        f'"completion_tokens":{_json_value(completion_tokens)},'
        f'"service_tokens_settled":{service_tokens_settled:d},'
        f'"queue_wait_ms":{_json_float(queue_wait_ms)},"ttft_ms":{_json_value(ttft_ms)},'
        f'"e2e_ms":{_json_float(e2e_ms)}}}'
    )


def _logfmt_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        plain = value and all(c.isascii() and c.isprintable() and c not in ' "=\\' for c in value)
        return value if plain else _string(value)
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) or abs(value) >= 1e15 else str(int(value))
    return str(value)


def format_line(fields: Mapping[str, Any], line_format: str) -> str:
    """The line: JSON (:func:`json_line`), or logfmt (``key=value`` pairs, strings quoted when
    they need it)."""
    if line_format == "text":
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())
    return json_line(fields)


class AccessLog:
    """Writes access lines in one format: to ``writer`` when given (``tokenfair sidecar``),
    else on the ``tokenfair.access`` logger."""

    __slots__ = ("_fast", "format", "logger", "writer")

    def __init__(self, line_format: str, writer: LineWriter | None = None) -> None:
        if line_format not in ("json", "text"):
            raise ValueError(f"access log format must be json or text (got {line_format!r})")
        self.format = line_format
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self.writer = writer
        self._fast = writer is not None and line_format == "json"

    def enabled(self) -> bool:
        return self.writer is not None or self.logger.isEnabledFor(logging.INFO)

    def emit_served(self, values: tuple[Any, ...]) -> None:
        """Write the line of a request that reached admission: ``values`` are its
        :data:`SERVED_FIELDS` in order. Never raises (as :meth:`emit`)."""
        if self._fast:
            try:
                self.writer.write(served_json_line(*values))  # type: ignore[union-attr]
            except Exception:
                with contextlib.suppress(Exception):
                    log.exception("request %s: its access log line failed", values[1])
            return
        self.emit(dict(zip(SERVED_FIELDS, values, strict=True)))

    def emit(self, fields: dict[str, Any]) -> None:
        """Write one line. Never raises (a failure is logged on ``tokenfair.sidecar``)."""
        try:
            writer = self.writer
            if writer is not None:
                writer.write(format_line(fields, self.format))
                return
            logger = self.logger
            if not logger.isEnabledFor(logging.INFO):
                return
            line = format_line(fields, self.format)
            # The record made here rather than by `logger.info`, which would also walk the
            # stack for the caller's file and line (a few µs per request, and always this one).
            record = logger.makeRecord(
                logger.name, logging.INFO, __file__, 0, line, (), None, extra={"access": fields}
            )
            logger.handle(record)
        except Exception:
            with contextlib.suppress(Exception):  # the logging itself may be what fails
                log.exception("request %s: its access log line failed", fields.get("request_id"))


class LineWriter:
    """Access lines to a file descriptor, buffered on the event loop and written by a thread.

    :meth:`write` (event-loop thread) appends a line to the buffer; the buffer goes to the
    thread when it holds :data:`FLUSH_CHARS` characters, or ``flush_interval_s`` after its first
    line (a timer on the running loop; with no loop running, at once), or on :meth:`flush`.
    The thread writes each batch with ``os.write`` on the descriptor, not through a Python file:
    a thread blocked on a full pipe holds no lock that the interpreter needs at exit. A batch
    that would take the lines waiting for the thread past ``max_pending`` is dropped and
    counted in :attr:`dropped`, as are the lines of a write that fails (the output is gone).
    """

    def __init__(
        self,
        fd: int,
        *,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        max_pending: int = MAX_PENDING_LINES,
    ) -> None:
        self.fd = fd
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.dropped = 0
        """Lines dropped so far (the thread behind by ``max_pending``, or the output gone)."""
        self._buffer: list[str] = []
        self._buffered_chars = 0
        self._timer: asyncio.TimerHandle | None = None
        self._changed = threading.Condition(threading.Lock())
        """Guards :attr:`_batches`, :attr:`_pending` and :attr:`dropped`; notified when they
        change."""
        self._batches: collections.deque[list[str]] = collections.deque()
        self._pending = 0
        """Lines handed to the thread and not yet written."""
        self._thread = threading.Thread(
            target=self._write_batches, name="tokenfair-access-log", daemon=True
        )
        self._thread.start()

    def write(self, line: str) -> None:
        """Buffer one line (without its newline); event-loop thread only."""
        self._buffer.append(line)
        self._buffered_chars += len(line)
        if self._buffered_chars >= FLUSH_CHARS:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a tool, a test): nothing would flush it later
                self.flush()
                return
            self._timer = loop.call_later(self.flush_interval_s, self.flush)

    def flush(self) -> None:
        """Hand the buffer to the writer thread (or drop it, counted, if the thread is
        ``max_pending`` lines behind). On the event-loop thread, or once the loop is gone."""
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()
        batch = self._buffer
        if not batch:
            return
        self._buffer = []
        self._buffered_chars = 0
        dropped = 0
        with self._changed:
            if self._pending + len(batch) > self.max_pending:
                self.dropped += len(batch)
                dropped = self.dropped
            else:
                self._pending += len(batch)
                self._batches.append(batch)
                self._changed.notify_all()
        if dropped:
            log.warning("access log: %d line(s) dropped so far (the reader of its output is not "
                        "keeping up)", dropped)  # fmt: skip

    def _write_batches(self) -> None:
        batches, changed = self._batches, self._changed
        while True:
            with changed:
                while not batches:
                    changed.wait()
                batch = batches.popleft()
            lines = len(batch)
            batch.append("")  # the last line's newline
            data = memoryview("\n".join(batch).encode("utf-8", "replace"))
            lost = 0
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:  # the output is gone (EPIPE, EBADF) or would block: counted, dropped
                lost = lines
            with changed:
                self._pending -= lines
                self.dropped += lost
                changed.notify_all()

    def wait_written(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the lines handed to the thread so far to be
        written; False if they were not by then."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """:meth:`flush`, then :meth:`wait_written` (at exit, once the event loop is gone)."""
        self.flush()
        return self.wait_written(timeout_s)


def configure_access_logger(
    line_format: str, fd: int = 1, *, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
) -> LineWriter | None:
    """For ``tokenfair sidecar``: the :class:`LineWriter` of bare lines on ``fd`` (stdout) to
    give to ``create_app`` (None for ``off``). Nothing goes through the ``tokenfair.access``
    logger: it is silenced, and not repeated by the root's handler."""
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(logging.CRITICAL + 1)
    logger.addHandler(logging.NullHandler())
    if line_format == "off":
        return None
    return LineWriter(fd, flush_interval_s=flush_interval_s)
