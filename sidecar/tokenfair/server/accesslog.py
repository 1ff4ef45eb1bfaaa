"""The access log: one structured line per proxy request, on the ``tokenfair.access`` logger.

A request that reached admission is logged by :meth:`Sidecar.completed
<tokenfair.server.state.Sidecar.completed>`, the one place its completion is counted (called
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
``text`` (logfmt: ``key=value``, strings quoted when needed) or ``off``. The line is the log
record's message and the fields are also on the record as ``record.access`` (a dict), so a
handler of your own can format them as it likes. ``tokenfair sidecar`` writes the lines to
stdout, bare (no level or logger prefix), whatever ``--log-level`` says, through
:class:`LineWriter`: a thread of its own does the writes, so a reader that falls behind (a full
pipe) never stalls the event loop; past :data:`MAX_PENDING_LINES` waiting lines, new ones are
dropped and counted (logged on ``tokenfair.sidecar``). Embedded in another program, the logger
is configured like any other (it inherits the root's level).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import queue
import threading
import time
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


def utc_timestamp(now_s: float) -> str:
    """``2026-12-01T21:45:07.123Z``."""
    whole = int(now_s)
    millis = min(999, int((now_s - whole) * 1000))
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(whole))}.{millis:03d}Z"


def _logfmt_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        plain = value and all(c.isascii() and c.isprintable() and c not in ' "=\\' for c in value)
        return value if plain else _string(value)
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) or abs(value) >= 1e15 else str(int(value))
    return str(value)


def format_line(fields: dict[str, Any], line_format: str) -> str:
    """The line: JSON, or logfmt (``key=value`` pairs, strings quoted when they need it)."""
    if line_format == "text":
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())
    return _ENCODER.encode(fields)


class AccessLog:
    """Writes access lines in one format on the ``tokenfair.access`` logger."""

    __slots__ = ("format", "logger")

    def __init__(self, line_format: str) -> None:
        if line_format not in ("json", "text"):
            raise ValueError(f"access log format must be json or text (got {line_format!r})")
        self.format = line_format
        self.logger = logging.getLogger(ACCESS_LOGGER)

    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def emit(self, fields: dict[str, Any]) -> None:
        """Log one line. Never raises (a failure is logged on ``tokenfair.sidecar``)."""
        try:
            if not self.logger.isEnabledFor(logging.INFO):
                return
            logger = self.logger
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


class LineWriter(logging.Handler):
    """Writes each record's formatted line to a file descriptor from a daemon thread: ``emit``
    only queues (at most :data:`MAX_PENDING_LINES`; more are dropped and counted in
    :attr:`dropped`). ``os.write`` on the descriptor, not a Python file: a thread blocked on a
    full pipe holds no lock that the interpreter needs at exit."""

    def __init__(self, fd: int, max_pending: int = MAX_PENDING_LINES) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = 0
        self._lines: queue.Queue[bytes] = queue.Queue(max_pending)
        self._thread = threading.Thread(
            target=self._write_lines, name="tokenfair-access-log", daemon=True
        )
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.put_nowait((self.format(record) + "\n").encode("utf-8", "replace"))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % MAX_PENDING_LINES == 0:
                log.warning("access log: %d line(s) dropped so far (the reader of its output "
                            "is not keeping up)", self.dropped)  # fmt: skip
        except Exception:
            self.handleError(record)

    def _write_lines(self) -> None:
        lines = self._lines
        while True:
            batch = [lines.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 256:
                    batch.append(lines.get_nowait())
            data = memoryview(b"".join(batch))
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:  # the output is gone (EPIPE, EBADF) or would block: counted, dropped
                self.dropped += len(batch)
            for _ in batch:
                lines.task_done()

    def wait_written(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the lines queued so far to be written."""
        deadline = time.monotonic() + timeout_s
        while self._lines.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True


def configure_access_logger(line_format: str, fd: int = 1) -> LineWriter | None:
    """For ``tokenfair sidecar``: bare lines (the message only) on ``fd`` (stdout) through a
    :class:`LineWriter`, at INFO whatever the root logger's level, not repeated by the root's
    handler; ``off`` silences the logger (None)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    if line_format == "off":
        logger.setLevel(logging.CRITICAL + 1)
        logger.addHandler(logging.NullHandler())
        return None
    writer = LineWriter(fd)
    writer.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(writer)
    logger.setLevel(logging.INFO)
    return writer
