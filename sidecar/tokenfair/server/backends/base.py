"""The backend contract: run one dispatched request and answer the client.

``respond(call)`` must either raise :class:`UpstreamError` before anything was sent to the client
(the proxy then answers with its status: 502 refused/reset, 504 timeout), or answer the client
itself (a ``web.Response``, or a prepared ``web.StreamResponse`` for SSE). A stream whose source
breaks after it started raises :class:`StreamAbortedError` carrying the started response: the
proxy then cuts the client's connection, so the client sees an incomplete transfer rather than a
clean end. While it runs it fills in ``call.prompt_tokens`` / ``call.completion_tokens`` (the
usage to settle; :meth:`BackendCall.report_usage` checks reported values against the request's
bounds, :class:`UsageBounds`) and calls ``call.first_byte()`` when the first body bytes go out
(TTFT). Stream bytes go out through :meth:`BackendCall.write` and a stream ends with
:meth:`BackendCall.write_eof`, or its last bytes and its end go together through
:meth:`BackendCall.end_at_once` when that cannot wait (never a bare ``response.write``/
``write_eof``: both wait for the client to take the bytes), which cut a client that takes
nothing for ``client_write_timeout_s`` while they wait; a whole answer (a ``web.Response``)
is returned unsent, and the proxy writes it under the same bound (:meth:`BackendCall.send`).
It may be cancelled at any await (the client went away); it must then free what it holds (an
upstream connection) and re-raise, having set ``call.answer_complete`` if the client already
had the whole answer (a stream's ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from aiohttp import web

from tokenfair.config import PolicyConfig
from tokenfair.core import Decision
from tokenfair.core.cost import MAX_REQUEST_TOKENS
from tokenfair.core.reasons import Reason
from tokenfair.server.connections import reset, unacknowledged_bytes
from tokenfair.server.estimate import Estimate, prompts, sequences
from tokenfair.server.kv_view import StreamProgress

log = logging.getLogger("tokenfair.sidecar")

EMBEDDINGS_ROUTE: Final = "/v1/embeddings"
MODELS_ROUTE: Final = "/v1/models"
"""``GET``: listed without admission (it does no model work) by :meth:`Backend.models`."""
CHAT_ROUTE: Final = "/v1/chat/completions"
ROUTES: Final = ("/v1/completions", CHAT_ROUTE, EMBEDDINGS_ROUTE)
"""The ``POST`` routes that are admitted, scheduled and settled (``/v1/embeddings`` at a
prefill-only cost: :func:`~tokenfair.server.estimate.estimate_embeddings`)."""

MAX_USAGE_TOKENS: Final = MAX_REQUEST_TOKENS
"""Largest ``usage.prompt_tokens`` / ``usage.completion_tokens`` that is a usage at all (a signed
32-bit int: no server counts further). A reported value that is not an integer in
``[0, MAX_USAGE_TOKENS]`` is a protocol error: the request settles at its estimate and its record
says ``upstream_bad_usage``. An integer in that range but over the request's own bound
(:class:`UsageBounds`) settles at the bound, also recorded ``upstream_bad_usage``."""
BAD_USAGE: Final = Reason.UPSTREAM_BAD_USAGE
UPSTREAM_ABORTED: Final = Reason.UPSTREAM_ABORTED
UPSTREAM_TOO_LARGE: Final = Reason.UPSTREAM_TOO_LARGE
"""502 code and record reason: the upstream's response head (over 64 KiB) or non-streamed body
(over 8 MiB) passed the client's bounds (:class:`~tokenfair.server.upstream.
UpstreamTooLargeError`); the connection was dropped."""

CLIENT_MESSAGES: Final[dict[str, str]] = {
    Reason.UPSTREAM_ERROR: "the model server failed to answer (refused, reset or a malformed "
    "response); the sidecar's log has the details under this request's x-request-id",
    Reason.UPSTREAM_TIMEOUT: "the model server did not answer in time; the sidecar's log has the "
    "details under this request's x-request-id",
    Reason.UPSTREAM_UNAVAILABLE: "the model server is not available",
    Reason.UPSTREAM_TOO_LARGE: "the model server's answer was larger than the sidecar relays; the "
    "sidecar's log has the details under this request's x-request-id",
}
"""What a tenant reads in a 502/504: no upstream host, port or errno (those go to the log)."""
HEAD_ALLOWANCE_BYTES: Final = 8192
"""Room kept for a whole answer's status line and headers when :meth:`BackendCall.send` tells
whether the answer fits under the transport's high-water mark."""
FRAMING_BYTES: Final = 32
"""Bytes aiohttp adds around a body beside its head (a chunk's size line and CRLFs, the last
chunk), counted when telling whether a write fits under the transport's high-water mark."""
HEAD_UNKNOWN_BYTES: Final = 1 << 16
"""A buffered head's size when aiohttp does not say (the most an upstream's head may be)."""
_NO_HEAD_BUFFER: Final = object()


def buffered_head_bytes(writer: object) -> int:
    """The bytes of the status line and headers aiohttp holds back to send with the first body
    bytes (its ``StreamWriter._headers_buf``, aiohttp 3.12 and later; 0 once sent):
    :data:`HEAD_UNKNOWN_BYTES` when the writer has no such buffer (an aiohttp that renamed it:
    counted as the largest head rather than none)."""
    head = getattr(writer, "_headers_buf", _NO_HEAD_BUFFER)
    if head is _NO_HEAD_BUFFER:
        return HEAD_UNKNOWN_BYTES
    return len(head) if isinstance(head, bytes | bytearray) else 0


WRITE_CHECKS_PER_TIMEOUT: Final = 4
"""While a write to the client waits, the client's progress is looked at this many times per
``client_write_timeout_s`` (the bytes it has not acknowledged shrinking: it took some)."""


class UpstreamError(Exception):
    """The backend failed before the response started; ``status`` is 502 or 504.

    ``detail`` says what happened (host, port, errno) for the sidecar's log; the client gets
    :attr:`client_message`, which shows nothing of the upstream's address."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail

    @property
    def client_message(self) -> str:
        return CLIENT_MESSAGES.get(self.code, CLIENT_MESSAGES[Reason.UPSTREAM_ERROR])


class StreamAbortedError(Exception):
    """The upstream broke after the client's response started (its status and some bytes are
    out). ``response`` is that started response; the proxy aborts the client's connection so the
    transfer ends incomplete (no terminating chunk), never as a clean, truncated success."""

    def __init__(self, response: web.StreamResponse, detail: str) -> None:
        super().__init__(detail)
        self.response = response
        self.code = UPSTREAM_ABORTED
        self.detail = detail


class UsageError(ValueError):
    """The backend's reported usage is not believable (see :data:`MAX_USAGE_TOKENS`)."""


def embedding_inputs(value: object) -> list[object]:
    """The inputs of an embeddings ``input`` (checked by the estimate): a string or a list of
    token IDs is one input, a list of strings or of lists one input each."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return value
    return [value]


def _given_tokens(body: Mapping[str, Any], name: str) -> int | None:
    """``body[name]`` if it is an integer (not a boolean), else None (absent; the estimate has
    refused a bad value of the field it read, but not of the other one)."""
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(slots=True)
class UsageBounds:
    """The most usage a request's answer may report, from the request itself and the model's
    context window. The sidecar holds one (``Sidecar.usage_bounds``) and reads it for every
    request, so a later source of the context (the engine's ``max_model_len``) changes
    :attr:`context_tokens` in one place.

    For ``c`` = :attr:`context_tokens`, ``p`` prompts (a legacy completions batch; an embeddings
    batch's inputs; 1 otherwise) and ``s`` = ``max(n, best_of)`` sequences per prompt:

    * prompt tokens <= ``c * p`` (no prompt holds more than the context);
    * completion tokens <= ``m * s * p``, ``m`` being the larger of ``max_tokens`` and
      ``max_completion_tokens`` where either is given (the larger: a server that honours the
      other one still generates at most that many), else ``c`` (a server's default runs to the
      end of the context); for ``/v1/embeddings`` 0.

    Both are at most :data:`MAX_USAGE_TOKENS`. A count over its bound is settled at the bound
    (:meth:`BackendCall.report_usage`): the tenant did use at least that much, and no more can
    be believed."""

    context_tokens: int
    """The model's context window in tokens (``SidecarSettings.model_context_tokens``)."""

    def of_request(self, path: str, body: Mapping[str, Any]) -> tuple[int, int]:
        """``(prompt bound, completion bound)`` of a request on ``path`` whose ``body`` passed
        the estimate (its ``n``, ``best_of`` and batch are valid)."""
        context = self.context_tokens
        if path == EMBEDDINGS_ROUTE:
            inputs = len(embedding_inputs(body.get("input")))
            return min(MAX_USAGE_TOKENS, context * inputs), 0
        batch = prompts(body)
        max_tokens = _given_tokens(body, "max_tokens")
        max_completion_tokens = _given_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            per_sequence = context if max_completion_tokens is None else max_completion_tokens
        elif max_completion_tokens is None:
            per_sequence = max_tokens
        else:
            per_sequence = max(max_tokens, max_completion_tokens)
        completion = per_sequence * sequences(body) * batch
        return min(MAX_USAGE_TOKENS, context * batch), min(MAX_USAGE_TOKENS, completion)


def _describe(value: object) -> str:
    """A short description of a bad value: never its full text (a 5,000-digit integer cannot
    even be printed, and a nested list may be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of {value.bit_length()} bits" if value >= 0 else "a negative integer"
    return f"a value of type {type(value).__name__}"


def usage_tokens(usage: Mapping[str, Any], name: str) -> int | None:
    """``usage[name]`` as a token count: None if absent or null (not reported); an integer in
    ``[0, MAX_USAGE_TOKENS]``; anything else raises :class:`UsageError`."""
    value = usage.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_USAGE_TOKENS:
        raise UsageError(
            f"usage.{name}: must be an integer in [0, {MAX_USAGE_TOKENS}] (got {_describe(value)})"
        )
    return value


@dataclass(slots=True, eq=False)
class BackendCall:
    """One dispatched request as a backend sees it, plus what the backend reports back."""

    request: web.Request
    path: str
    body: dict[str, Any]
    raw_body: bytes
    stream: bool
    estimate: Estimate
    decision: Decision
    response_headers: Mapping[str, str]
    """Headers the proxy adds to the response (rate-limit headers, request id)."""
    on_first_byte: Callable[[], None]
    dispatched_at_s: float
    """Event-loop time when the scheduler dispatched the request."""
    client_write_timeout_s: float | None = None
    """How long a write to the client may wait while the client takes nothing (see
    :meth:`write`); None: unbounded."""
    max_prompt_tokens: int = MAX_USAGE_TOKENS
    """The most prompt tokens the answer may report (:meth:`UsageBounds.of_request`)."""
    max_completion_tokens: int = MAX_USAGE_TOKENS
    """The most completion tokens the answer may report (:meth:`UsageBounds.of_request`)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_error: str | None = None
    """Why the reported usage was not believed as reported (then the request settles at its
    estimate, or at its bounds: :meth:`report_usage`)."""
    upstream_answered: bool = False
    """The upstream's response head arrived: it ran the request, so a failure after this point
    settles at what ran (the usage seen, else the estimate), never at zero."""
    answer_complete: bool = False
    """The client was sent the whole answer (a stream's ``[DONE]``, or the usage event it asked
    for): if it leaves now, it met a complete ``200`` (recorded so, and settled at the usage) —
    unless it was cut for not reading (:attr:`client_write_timed_out`): then it never took the
    end."""
    first_byte_sent: bool = field(default=False)
    progress: StreamProgress | None = None
    """Where a streaming backend counts the events it relays (the KV view's model of the
    engine's decode: :mod:`tokenfair.server.kv_view`); None: not tracked."""
    client_write_timed_out: bool = field(default=False)
    """Set when a write waited ``client_write_timeout_s`` without the client taking a byte and
    the client's connection was aborted (the request is then recorded as
    ``client_write_timeout``)."""
    _writing_since: float | None = field(default=None, init=False, repr=False)
    """Loop time the write under way began (None: no write under way)."""
    _progress_at: float = field(default=0.0, init=False, repr=False)
    """Loop time of the last look that saw the client take bytes."""
    _buffered: int = field(default=0, init=False, repr=False)
    """The bytes the client had not acknowledged at the last look."""
    _appended: int = field(default=0, init=False, repr=False)
    """Bytes handed to writes since the last look."""
    _watchdog: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)

    def first_byte(self) -> None:
        if not self.first_byte_sent:
            self.first_byte_sent = True
            self.on_first_byte()

    def report_usage(self, usage: Mapping[str, Any] | None) -> None:
        """Take the backend's reported usage (a ``usage`` object, or None: not reported). A value
        that is not a usage at all (:func:`usage_tokens`) leaves both counts unknown (settled at
        the estimate); a count over the request's bound (:attr:`max_prompt_tokens`,
        :attr:`max_completion_tokens`) is taken at the bound. Either sets :attr:`usage_error`
        (``upstream_bad_usage``) and logs the tenant and the request."""
        if usage is None:
            self.prompt_tokens = self.completion_tokens = None
            return
        try:
            prompt = usage_tokens(usage, "prompt_tokens")
            completion = usage_tokens(usage, "completion_tokens")
        except UsageError as exc:
            self.bad_usage(str(exc))
            return
        over: list[str] = []
        if prompt is not None and prompt > self.max_prompt_tokens:
            over.append(f"usage.prompt_tokens {prompt} > the request's bound "
                        f"{self.max_prompt_tokens}")  # fmt: skip
            prompt = self.max_prompt_tokens
        if completion is not None and completion > self.max_completion_tokens:
            over.append(f"usage.completion_tokens {completion} > the request's bound "
                        f"{self.max_completion_tokens}")  # fmt: skip
            completion = self.max_completion_tokens
        self.prompt_tokens, self.completion_tokens = prompt, completion
        if over:
            decision = self.decision
            log.warning("request %s of tenant %s: the backend reported more usage than the "
                        "request allows, settling at the bound: %s", decision.request_id,
                        decision.tenant_id, "; ".join(over))  # fmt: skip
            self.usage_error = BAD_USAGE

    def bad_usage(self, detail: str) -> None:
        """The backend reported usage that cannot be believed: settle at the estimate."""
        decision = self.decision
        log.warning("request %s of tenant %s: the backend's usage is a protocol error, settling "
                    "at the estimate: %s", decision.request_id, decision.tenant_id,
                    detail)  # fmt: skip
        self.prompt_tokens = self.completion_tokens = None
        self.usage_error = BAD_USAGE

    # -- writing to the client ------------------------------------------------------------------

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        """``response.write(data)``, bounded: see :meth:`_bounded` (a write that cannot wait,
        :meth:`cannot_wait`, needs no timer and goes straight out)."""
        if self.cannot_wait(len(data)):
            await response.write(data)
            return
        await self._bounded(response.write(data), len(data))

    async def send(self, response: web.StreamResponse) -> None:
        """Send a whole answer the backend returned unsent (a ``web.Response``), bounded like
        :meth:`write`: its status, headers and body go out now, in the handler, and a client
        that takes none of it for ``client_write_timeout_s`` is cut (the answer is not left to
        aiohttp to write, unbounded, after the handler)."""
        writer = await response.prepare(self.request)
        # The head goes out with the body: counted at its real size (an upstream's headers,
        # relayed, may fill 64 KiB), at least the allowance, and the framing beside it.
        head = max(HEAD_ALLOWANCE_BYTES, buffered_head_bytes(writer)) + FRAMING_BYTES
        body = None
        # (`type() is` first: aiohttp's responses are ABCs, whose `isinstance` runs in Python)
        if type(response) is web.Response or isinstance(response, web.Response):
            body = response.body
        size = len(body) if isinstance(body, bytes | bytearray) else 0
        transport = self.request.transport
        if transport is not None and (
            transport.get_write_buffer_size() + size + head
            <= transport.get_write_buffer_limits()[1]
        ):
            # Head and body fit under the transport's high-water mark: the write cannot wait
            # (nothing to time, no timer to arm); what the kernel holds is the sweep's.
            await response.write_eof()
            return
        await self._bounded(response.write_eof(), size)

    async def write_eof(self, response: web.StreamResponse) -> None:
        """``response.write_eof()``, bounded like :meth:`write`: it too waits until the client
        has taken what is buffered (the last bytes of a stream may be up to 64 KiB that no
        ``write`` waited for), so a client that stops reading near the end is cut as well."""
        if self.cannot_wait(0):
            await response.write_eof()
            return
        await self._bounded(response.write_eof(), 0)

    async def end_at_once(self, response: web.StreamResponse, data: bytes) -> bool:
        """Send a stream's last bytes and its end (``response.write_eof(data)``: one send) if
        that cannot wait (:meth:`cannot_wait`), and say whether it did; False: nothing was
        sent (the caller writes ``data`` with :meth:`write` and ends with :meth:`write_eof`).
        Never a write that waits, so it fails only as :meth:`write` would, before any byte
        (the connection already closing), never while draining as :meth:`write_eof` may."""
        if not self.cannot_wait(len(data)):
            return False
        await response.write_eof(data)
        return True

    def cannot_wait(self, size: int) -> bool:
        """Whether a write of ``size`` bytes to the client cannot wait, so no timer need watch
        it: no timer watches an earlier write (its accounting goes on), the transport holds
        nothing (so it is not paused: aiohttp's drain returns at once) and the bytes fit under
        its high-water mark (the write cannot pause it). Most writes of a stream are so (the
        kernel takes them); once the client falls behind, a write waits, and that one is timed
        (:meth:`_bounded`, its baseline taken then)."""
        transport = self.request.transport
        return (
            self._watchdog is None
            and transport is not None
            and transport.get_write_buffer_size() == 0
            and size + HEAD_ALLOWANCE_BYTES <= transport.get_write_buffer_limits()[1]
        )

    async def _bounded(self, operation: Awaitable[None], size: int) -> None:
        """Await ``operation`` (a write of ``size`` bytes to the client). While it waits, a
        timer looks at the client's connection :data:`WRITE_CHECKS_PER_TIMEOUT` times per
        ``client_write_timeout_s``: the client made progress if the bytes it has not
        acknowledged (the transport's buffer and the kernel's send queue:
        :func:`~tokenfair.server.connections.unacknowledged_bytes`) are fewer than at the last
        look plus what was written since. A write that has waited ``client_write_timeout_s``
        since it began, or since progress was last seen, resets the client's connection (the
        write then raises), so a client that stops reading cannot hold its in-flight slot,
        while one that reads slowly is never cut. One timer per call, armed by a write that
        may wait and re-armed only while a write waits (not per write)."""
        timeout_s = self.client_write_timeout_s
        if timeout_s is None:
            await operation
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._watchdog is None:
            transport = self.request.transport
            self._buffered = 0 if transport is None else unacknowledged_bytes(transport)
            self._appended = 0
            interval_s = timeout_s / WRITE_CHECKS_PER_TIMEOUT
            self._watchdog = loop.call_at(now + interval_s, self._check_write, timeout_s)
        self._appended += size
        self._writing_since = now
        try:
            await operation
        finally:
            self._writing_since = None

    def _check_write(self, timeout_s: float) -> None:
        self._watchdog = None
        since = self._writing_since
        transport = self.request.transport
        if since is None or transport is None:
            # No write under way (the next one arms the timer again, with a new baseline), or
            # the connection is gone (the write fails by itself).
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        buffered = unacknowledged_bytes(transport)
        if buffered < self._buffered + self._appended:
            self._progress_at = now  # the client took bytes since the last look
        self._buffered, self._appended = buffered, 0
        deadline = max(since, self._progress_at) + timeout_s
        if now < deadline:
            interval_s = timeout_s / WRITE_CHECKS_PER_TIMEOUT
            self._watchdog = loop.call_at(
                min(deadline, now + interval_s), self._check_write, timeout_s
            )
            return
        self.client_write_timed_out = True
        log.warning("request %s: the client took nothing for %g s; resetting its connection",
                    self.decision.request_id, timeout_s)  # fmt: skip
        reset(transport)

    def close(self) -> None:
        """Stop the write timer (the proxy calls this once the request is over)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None


class Backend(ABC):
    """One model server behind the sidecar."""

    name: ClassVar[str]
    default_max_in_flight: ClassVar[int]

    async def open(self) -> None:
        """Acquire long-lived resources (called from the app's cleanup context)."""

    async def close(self) -> None:
        """Release them."""

    @abstractmethod
    async def respond(self, call: BackendCall) -> web.StreamResponse:
        """Run ``call`` and answer the client (see the module docstring)."""

    @abstractmethod
    async def models(self, request: web.Request) -> web.StreamResponse:
        """Answer ``GET /v1/models`` for an authenticated client (no admission: listing models
        does no model work). May raise :class:`UpstreamError` (the proxy answers 502/504)."""

    async def engine_get(
        self, path: str, timeout_s: float, limit_bytes: int
    ) -> tuple[int, bytes] | None:
        """``GET path`` from the engine behind this backend, with the backend's own connection
        and credentials: ``(status, body)``, the body at most ``limit_bytes`` (more raises), the
        whole exchange within ``timeout_s`` (``TimeoutError``). None: no engine to ask (the
        default; :mod:`~tokenfair.server.engine_state` then never polls)."""
        return None

    def kv_hold_ms(self, call: BackendCall) -> float:
        """Model ms after dispatch until the request's KV blocks are free (0: at completion)."""
        return 0.0


def default_max_in_flight(backend: Backend, policy: PolicyConfig) -> int:
    """The requests the sidecar sends the backend at once when ``maxInFlight`` is not set: the
    policy's ``maxBatchRequests`` when it models a batching engine (``S > 1``: the engine runs
    ``S`` at once, and the rest wait in the sidecar's queue, where the fair share decides who
    goes next — as the simulator replays it), else the backend's own default (the serial
    ``costmodel`` engine's 2, the ``openai`` upstream's 64)."""
    batch = policy.max_batch_requests
    return batch if batch > 1 else backend.default_max_in_flight
