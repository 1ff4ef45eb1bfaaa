"""Proxy handlers: authenticate, estimate, admit, wait for dispatch, run the backend, settle;
and the proxy app's one middleware, :func:`observe_requests`, which counts the requests in
flight and gives each a :class:`~tokenfair.server.accesslog.RequestScope` (its route and trace
context, for its access-log line and span): a request it sees answered before admission gets
its line and span there.

Status codes the client can get from the sidecar itself (OpenAI-style error bodies; ``code``):

=====  ==========================================================================================
400    ``invalid_json`` (body not a JSON object, not UTF-8 — RFC 8259 §8.1: UTF-16 and UTF-32
       bodies are refused — or nested deeper than the parser follows),
       ``body_too_complex`` (JSON nested over ``max_json_depth`` levels or holding over
       ``max_json_values`` values: the message names the rule),
       ``invalid_encoding`` (body not decodable as its ``Content-Encoding`` says:
       :func:`decode_body`),
       ``invalid_value`` (``param`` names the field: ``max_tokens``,
       ``max_completion_tokens``, ``n``, ``best_of``, ``stream``, ``messages`` (and
       ``messages[i].…``), ``prompt``, ``tools``, ``functions``, ``response_format``,
       ``tool_choice``; for ``/v1/embeddings`` ``input``, ``dimensions``,
       ``encoding_format``; or the ``x-tokenfair-priority`` header asking for a class above
       the tenant's);
       ``request_over_kv_capacity`` / ``request_over_tenant_burst`` /
       ``request_over_tenant_kv_share``: a request no state of the
       running configuration could admit — its own KV blocks above its class's watermark of
       the whole cache (or its tenant's ``maxKvShare`` of it), or its cost above the tenant's
       burst with ``lendIdleCapacity`` off
       (:meth:`~tokenfair.core.scheduler.Scheduler.never_admissible`); recorded with
       that reason, counted as refused. With lending on, an over-burst request stays a
       ``429`` (idle capacity may admit it later)
401    ``invalid_api_key`` (no ``Authorization: Bearer`` key, or an unknown one)
404    ``not_found`` (any route but ``POST /v1/completions``, ``/v1/chat/completions``,
       ``/v1/embeddings`` and ``GET /v1/models``; with ``Expect``, answered at once instead of
       ``100 Continue``, and the connection closed)
417    ``expectation_failed`` (an ``Expect`` other than ``100-continue``; see
       :func:`expect_continue`: ``100 Continue`` is sent only after the key and the announced
       size passed)
408    ``request_timeout`` (the body took over ``client_body_timeout_s``; connection closed)
413    ``request_too_large`` (body over ``max_body_bytes``, as sent or decoded)
415    ``unsupported_content_encoding`` (see :data:`DECODED_REQUEST_CODINGS`)
429    ``rate_limit_exceeded`` (OpenAI's shape: :func:`~tokenfair.server.errors.
       rate_limit_response`), the gate's reason in ``tokenfair_reason``: ``shed_kv_watermark``,
       ``shed_queue_wait_slo``, ``shed_tenant_token_quota``, ``queue_full`` (admission) or
       ``shed_queue_timeout`` (waited past the class limit), ``shed_tenant_concurrency`` /
       ``shed_tenant_kv_share`` (waited past the class limit, held by the tenant's
       ``maxConcurrentRequests`` / ``maxKvShare``: :data:`TENANT_LIMIT_HEADERS` say the limit
       and where the tenant stood); with ``Retry-After``,
       ``retry-after-ms`` and the rate-limit headers (:meth:`RateLimits.headers
       <tokenfair.server.ratelimit.RateLimits.headers>`)
500    ``internal_error`` (the sidecar failed on the request: a bug, logged with its traceback)
502    ``upstream_error`` (refused, reset, broken response) — ``openai`` backend; the message
       is generic, the upstream's address and errno go to the log
503    ``draining`` (shutting down; ``Retry-After``); ``drain_aborted`` (still running when the
       drain grace ran out, nothing sent yet: cut by the sidecar; ``Retry-After``);
       ``too_many_connections`` (the listener's cap, answered by
       :mod:`~tokenfair.server.runner` before parsing)
504    ``upstream_timeout``
=====  ==========================================================================================

Headers the sidecar adds to the answers of a request that reached admission (the upstream's
answer, 429, 502, 504):
``x-request-id`` (the sidecar's own id, unique in its records file, ending in the client's
``x-request-id`` when that is valid — :data:`REQUEST_ID_RE`) and
``x-tokenfair-queue-wait-ms`` (wall milliseconds the request waited in the queue: 0 for a
refusal at the door, the wait until expiry for ``shed_queue_timeout``).

Outcomes recorded for a request whose answer started and then ended otherwise: ``502
upstream_aborted`` (the upstream broke a stream: the client's connection is aborted, so it sees
an incomplete transfer), ``499 client_write_timeout`` (the client stopped reading its answer,
streamed or whole: every answer is written under ``client_write_timeout_s``),
``200 upstream_bad_usage`` (the reported usage was not a usage at all: settled at the estimate;
or it was over the request's bounds: settled at the bounds, see
:class:`~tokenfair.server.backends.base.UsageBounds`), ``503 drain_aborted`` (still running
when the drain grace ran out: cut by the sidecar). A stream whose client leaves once it was sent
the stream's end (``[DONE]``, or the usage event it asked for) is a ``200`` settled at the
reported usage, whatever the upstream still had to send. A whole answer is settled before it is
written (:meth:`~tokenfair.server.lifecycle.Lifecycle.settle_run`) and recorded once the client
took it, or was cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import zlib
from typing import Any, Final

from aiohttp import compression_utils, web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from tokenfair.config import PRIORITY_CLASSES, PriorityClass, TenantConfig
from tokenfair.core import Decision, Request, UnknownTenantError
from tokenfair.core.jobs import (
    ADMITTED,
    CANCELLED,
    SHED_TENANT_CONCURRENCY,
    SHED_TENANT_KV_SHARE,
    STATUS_CLIENT_CLOSED,
)
from tokenfair.core.reasons import Reason
from tokenfair.core.scheduler import (
    OVER_KV_CAPACITY,
    OVER_TENANT_KV_SHARE,
    STATUS_NEVER_ADMISSIBLE,
)
from tokenfair.server.accesslog import CURRENT_SCOPE, RequestScope, bounded
from tokenfair.server.backends import BackendCall, StreamAbortedError, UpstreamError
from tokenfair.server.backends.base import CHAT_ROUTE, EMBEDDINGS_ROUTE
from tokenfair.server.connections import mark_authenticated
from tokenfair.server.errors import INTERNAL_ERROR, error_response, rate_limit_response
from tokenfair.server.estimate import (
    BodyShapeError,
    Estimate,
    EstimateError,
    NotUtf8Error,
    check_json_shape,
    check_raw_values,
    ends_at_its_bound,
    estimate,
    estimate_embeddings,
    utf8_text,
)
from tokenfair.server.lifecycle import (
    CLIENT_LEFT,
    DRAIN_ABORTED,
    DRAINING,
    Lifecycle,
    LifecycleError,
    Outcome,
    Phase,
    begin,
)
from tokenfair.server.sidecar import Sidecar

SIDECAR: Final = web.AppKey("sidecar", Sidecar)
PRIORITY_HEADER: Final = "x-tokenfair-priority"
REQUEST_ID_HEADER: Final = "x-request-id"
QUEUE_WAIT_HEADER: Final = "x-tokenfair-queue-wait-ms"
REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
"""A client's request id is honoured when it matches this: 1-128 letters, digits and ``_.:-``
(the trace ids of ``tokenfair trace``, e.g. ``tenant_chat_pro-000001``, and UUIDs)."""
SERVED: Final = Outcome(200, ADMITTED)
"""The outcome of an answer served as the upstream gave it (the common one: made once)."""
BODY_TOO_COMPLEX: Final = Reason.BODY_TOO_COMPLEX
CLIENT_WRITE_TIMEOUT: Final = Reason.CLIENT_WRITE_TIMEOUT
HAS_BROTLI: Final[bool] = getattr(compression_utils, "HAS_BROTLI", False)
HAS_ZSTD: Final[bool] = getattr(compression_utils, "HAS_ZSTD", False)
DECODED_REQUEST_CODINGS: Final = frozenset(
    {"", "identity", "gzip", "deflate"} | ({"br"} if HAS_BROTLI else set())
    | ({"zstd"} if HAS_ZSTD else set())
)  # fmt: skip
"""Request ``Content-Encoding`` values the proxy reads (compared as aiohttp does: ASCII, any
case): ``br`` and ``zstd`` only where aiohttp can decode them (its ``HAS_BROTLI`` /
``HAS_ZSTD``: the Brotli and zstandard libraries are installed). The body is decoded by
:func:`decode_body`, not by aiohttp (whose parser answers a coding it cannot decode with a
plain-text 400 before any handler runs); any other coding would reach the JSON parser, and the
upstream, still encoded: ``415``."""
_PARSE_STACK_FRAMES: Final = 20
"""About how deep the handler's stack is when it parses a body: the JSON parser recurses once
per nesting level within the interpreter's recursion limit, minus these frames."""

log = logging.getLogger("tokenfair.sidecar")


def _invalid(sidecar: Sidecar, status: int, message: str, code: str, param: str | None = None
             ) -> web.Response:  # fmt: skip
    sidecar.metrics.count_invalid(status)
    return error_response(status, message, code, param=param)


def _draining(sidecar: Sidecar) -> web.Response:
    return error_response(
        503,
        "the sidecar is shutting down; retry (another replica will serve you)",
        DRAINING,
        headers={"Retry-After": str(sidecar.ratelimits.retry_after_s(None))},
    )


def _drain_aborted(sidecar: Sidecar, request_id: str) -> web.Response:
    """The answer of a non-streamed request still running when the drain grace ran out."""
    return error_response(
        503,
        "the sidecar is shutting down and cut this request before it finished; retry (another "
        "replica will serve you)",
        DRAIN_ABORTED,
        headers={
            "Retry-After": str(sidecar.ratelimits.retry_after_s(None)),
            REQUEST_ID_HEADER: request_id,
        },
    )


def _refusal(sidecar: Sidecar, decision: Decision, mix: tuple[int, int]) -> web.Response:
    """The ``429`` of a gate (OpenAI's shape: :func:`rate_limit_response`); ``mix`` is the
    request's ``(usage tokens, service tokens)`` for the rate-limit headers."""
    sidecar.ratelimits.stamp_retry_after(decision)  # the record says what the client is told
    observed = ", ".join(f"{k}={v:g}" for k, v in decision.observed.items())
    message = f"refused by the {decision.gate} gate: {decision.reason}"
    if observed:
        message += f" ({observed})"
    headers = sidecar.ratelimits.headers(decision.tenant_id, mix)
    headers["Retry-After"] = str(sidecar.ratelimits.retry_after_s(decision))
    headers[RETRY_AFTER_MS_HEADER] = str(sidecar.ratelimits.retry_after_ms(decision))
    headers[REQUEST_ID_HEADER] = decision.request_id
    headers[QUEUE_WAIT_HEADER] = _queue_wait_header(sidecar, decision)
    headers.update(tenant_limit_headers(decision))
    return rate_limit_response(message, decision.reason, headers=headers)


TENANT_LIMIT_HEADERS: Final[dict[str, tuple[tuple[str, str], ...]]] = {
    # refusal reason -> (header, the decision's observed value it carries)
    SHED_TENANT_CONCURRENCY: (
        ("x-tokenfair-limit-concurrent-requests", "max_concurrent_requests"),
        ("x-tokenfair-running-requests", "tenant_running_requests"),
    ),
    SHED_TENANT_KV_SHARE: (
        ("x-tokenfair-limit-kv-share", "max_kv_share"),
        ("x-tokenfair-kv-share", "tenant_kv_share"),
    ),
}
"""The headers of a ``429`` refused for a tenant limit beside the budget: the limit and where
the tenant stood (its running requests, its share of the pool's KV blocks) when it was held."""


def tenant_limit_headers(decision: Decision) -> dict[str, str]:
    """:data:`TENANT_LIMIT_HEADERS` of a refusal (none for any other reason)."""
    observed = decision.observed
    return {
        header: f"{observed[key]:g}"
        for header, key in TENANT_LIMIT_HEADERS.get(decision.reason, ())
        if key in observed
    }


def _never_admissible(sidecar: Sidecar, decision: Decision) -> web.Response:
    """``400`` for a request no state of the running configuration could admit (SDKs do not
    retry a 400, as they would a 429): the message names the limit and the request's size."""
    # Whole numbers, as integers (`:g` would print 1e+06 for a million).
    shown = {name: round(value) for name, value in decision.observed.items()}
    if decision.reason == OVER_KV_CAPACITY:
        message = (
            f"the request needs {shown['request_kv_blocks']} KV blocks (prompt plus max_tokens "
            f"times n, per prompt) and its class may hold at most {shown['max_kv_blocks']}: "
            "lower max_tokens, n or the prompt"
        )
    elif decision.reason == OVER_TENANT_KV_SHARE:
        message = (
            f"the request needs {shown['request_kv_blocks']} KV blocks (prompt plus max_tokens "
            f"times n, per prompt) and the tenant may hold at most {shown['max_kv_blocks']} "
            "(maxKvShare): lower max_tokens, n or the prompt"
        )
    else:
        message = (
            f"the request costs {shown['request_service_tokens']} service tokens (prompt plus "
            "decode weight times max_tokens times n, per prompt), over the tenant's burst of "
            f"{shown['burst_service_tokens']} (burstServiceTokens): lower max_tokens, n or the "
            "prompt"
        )
    headers = {
        REQUEST_ID_HEADER: decision.request_id,
        QUEUE_WAIT_HEADER: _queue_wait_header(sidecar, decision),
    }
    return error_response(400, message, decision.reason, headers=headers)


class BodyTooLargeError(ValueError):
    """A request body decodes to more than ``max_body_bytes``."""


MAX_CODING_MEMBERS: Final = 1024
"""Most gzip members (or deflate streams) one request body may concatenate (aiohttp's bound)."""


def decode_body(raw: bytes, coding: str, limit: int) -> bytes:
    """``raw`` decoded as ``coding`` (one of :data:`DECODED_REQUEST_CODINGS`, lower case), and at
    most ``limit`` bytes of it: never more is decoded, so a few compressed bytes cannot expand
    into gigabytes. :class:`BodyTooLargeError` past ``limit``; ``ValueError`` if it does not
    decode, including a body cut short (a gzip member without its trailer, a deflate stream
    without its end). ``gzip`` and ``deflate`` take what aiohttp takes — concatenated members
    (at most :data:`MAX_CODING_MEMBERS`), a raw deflate stream recognised by its first byte —
    but are decoded here (:func:`inflate`), since aiohttp does not see a gzip body's end
    missing; ``br`` and ``zstd`` by aiohttp's own decompressors."""
    if coding in ("", "identity"):
        return raw
    if coding in ("gzip", "x-gzip", "deflate"):
        # RFC 1950: a zlib stream's first byte has compression method 8 in its low bits.
        raw_deflate = coding == "deflate" and bool(raw) and raw[0] & 0x0F != 8
        wbits = 31 if coding != "deflate" else -15 if raw_deflate else 15
        return inflate(raw, wbits, coding, limit)
    decompressor: compression_utils.BrotliDecompressor | compression_utils.ZSTDDecompressor
    if coding == "br":
        decompressor = compression_utils.BrotliDecompressor()
    else:
        decompressor = compression_utils.ZSTDDecompressor()
    try:
        body = decompressor.decompress_sync(raw, max_length=limit + 1)
    except Exception as exc:
        raise ValueError(f"not a valid {coding} body: {exc}") from None
    if len(body) > limit:
        raise BodyTooLargeError(f"decodes to over {limit} bytes")
    return body


def inflate(raw: bytes, wbits: int, coding: str, limit: int) -> bytes:
    """``raw`` as one or more concatenated zlib-family streams (``wbits``: 31 gzip, 15 zlib,
    -15 raw deflate), each of which must reach its end (a gzip member its trailer): at most
    ``limit`` bytes out (:class:`BodyTooLargeError` past it), ``ValueError`` for a body that is
    corrupt, cut short or of over :data:`MAX_CODING_MEMBERS` members."""
    out = bytearray()
    data = raw
    for _member in range(MAX_CODING_MEMBERS):
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as exc:
            raise ValueError(f"not a valid {coding} body: {exc}") from None
        if len(out) > limit or inflater.unconsumed_tail:
            raise BodyTooLargeError(f"decodes to over {limit} bytes")
        if not inflater.eof:
            raise ValueError(f"the {coding} body is cut short (its end is missing)")
        data = inflater.unused_data
        if not data:
            return bytes(out)
    raise ValueError(f"the {coding} body has over {MAX_CODING_MEMBERS} members")


async def _answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send ``response`` now and close the connection after it: the request's body is unusable
    (still arriving after its timeout, or undecodable), so nothing more can be read on this
    connection. Closing here also keeps aiohttp from draining (and logging) the broken body."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def _queue_wait_header(sidecar: Sidecar, decision: Decision) -> str:
    """The decision's queue wait (model ms) in wall ms, as the header's value."""
    return f"{decision.queue_wait_ms * sidecar.clock.time_scale:.3f}"


def _request_id(sidecar: Sidecar, asked: str | None) -> str:
    """A new id, unique in the records file; a valid client ``x-request-id`` is appended to it
    (``<prefix>-<n>-<client id>``), so records can be joined with the client's own while a
    client that reuses its ids (retries, a second run) still never duplicates a record id."""
    own = f"{sidecar.id_prefix}-{next(sidecar.id_counter):08d}"
    if asked is not None and REQUEST_ID_RE.fullmatch(asked) is not None:
        return f"{own}-{asked}"
    return own


def _unauthenticated(sidecar: Sidecar) -> web.Response:
    return _invalid(
        sidecar, 401, "missing or unknown API key (Authorization: Bearer <key>)",
        "invalid_api_key",
    )  # fmt: skip


def authenticate_request(sidecar: Sidecar, request: web.Request) -> TenantConfig | None:
    """The request's tenant (its key, or the trusted tenant header), or None (``401``). A
    connection that carried a tenant's request leaves the listener's unauthenticated share
    (:func:`~tokenfair.server.connections.mark_authenticated`)."""
    headers = request.headers
    trusted_header = sidecar.settings.trusted_tenant_header
    tenant = sidecar.auth.authenticate(
        headers.get("Authorization"), headers.get(trusted_header) if trusted_header else None
    )
    if tenant is not None:
        mark_authenticated(request.transport)
    return tenant


async def expect_continue(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue``: the ``100 Continue`` goes out only once the request could be
    read — the sidecar is not draining, the key is valid, the announced ``Content-Length`` is
    within ``max_body_bytes`` — else the refusal is the answer (``503``, ``401``, ``413``) and
    the connection is closed (the body the client held back is never read). Any other
    expectation is ``417``."""
    sidecar = request.app[SIDECAR]
    response: web.Response | None = None
    if request.headers.get("Expect", "").lower() != "100-continue":
        response = _invalid(
            sidecar, 417, "only Expect: 100-continue is supported", "expectation_failed",
            param="Expect",
        )  # fmt: skip
    elif sidecar.dispatcher.draining:
        response = _draining(sidecar)
    elif authenticate_request(sidecar, request) is None:
        response = _unauthenticated(sidecar)
    elif (request.content_length or 0) > sidecar.settings.max_body_bytes:
        response = _invalid(
            sidecar, 413, f"request body over {sidecar.settings.max_body_bytes} bytes",
            "request_too_large",
        )  # fmt: skip
    if response is not None:  # closed at once: the client holds its body back for our answer
        return await _answer_and_close(request, response)
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started
    return None


@web.middleware
async def observe_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count the request in flight and give it its scope; if nothing accounted it by the time
    the handler is done (answered before admission), write its access-log line and span."""
    sidecar = request.app[SIDECAR]
    metrics = sidecar.metrics
    scope = RequestScope(
        bounded(request.method) or "", bounded(request.path) or "", sidecar.clock.now_ms()
    )
    if sidecar.outcomes.tracer is not None:  # tracing off costs nothing here
        headers = request.headers
        scope.traceparent = headers.get("traceparent")
        scope.tracestate = headers.get("tracestate")
    token = CURRENT_SCOPE.set(scope)
    metrics.in_flight += 1
    status: int = 500
    reason: str | None = INTERNAL_ERROR
    try:
        response = await handler(request)
        status = response.status
        reason = _error_code(response) if status >= 400 else None
        return response
    except asyncio.CancelledError:
        status, reason = STATUS_CLIENT_CLOSED, CANCELLED
        raise
    except web.HTTPException as exc:
        status, reason = exc.status, None
        raise
    finally:
        metrics.in_flight -= 1
        CURRENT_SCOPE.reset(token)
        if not scope.accounted:
            sidecar.outcomes.observe_unadmitted(scope, status, reason)


def _error_code(response: web.StreamResponse) -> str | None:
    """The ``error.code`` of one of the sidecar's JSON error bodies (None if it has none)."""
    body = response.body if isinstance(response, web.Response) else None
    if not isinstance(body, bytes | bytearray) or len(body) > 65536:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/embeddings``:
    authenticate → read the body → estimate → admit → wait → run → answer. Each step before
    admission answers a request it refuses (the ``web.Response`` it returns)."""
    sidecar = request.app[SIDECAR]
    arrival_ms = round(sidecar.clock.now_ms(), 3)
    if sidecar.dispatcher.draining:
        return _draining(sidecar)
    tenant = authenticate_request(sidecar, request)
    if tenant is None:
        return _unauthenticated(sidecar)
    priority = _priority(sidecar, tenant, request.headers.get(PRIORITY_HEADER))
    if not isinstance(priority, str):  # (not `web.Response`: an ABC, its check costs more)
        return priority
    intake = await read_body(sidecar, request)
    if not isinstance(intake, tuple):
        return intake
    body, raw = intake
    sized = _estimate_request(sidecar, request.path, body)
    if not isinstance(sized, tuple):
        return sized
    estimated, stream = sized
    core_request = Request(
        _request_id(sidecar, request.headers.get(REQUEST_ID_HEADER)),
        tenant.tenant_id,
        arrival_ms,
        estimated.prefill_tokens,
        estimated.decode_tokens,
        priority,
    )
    lifecycle = _admit(sidecar, core_request)
    if not isinstance(lifecycle, Lifecycle):
        return lifecycle
    if lifecycle.phase is Phase.REFUSED:
        return _answer_refusal(sidecar, lifecycle, estimated)
    return await _serve(sidecar, request, lifecycle, body, raw, stream, estimated)


def _priority(
    sidecar: Sidecar, tenant: TenantConfig, asked: str | None
) -> PriorityClass | web.Response:
    """The request's class: the tenant's, or ``batch`` if the priority header lowers it (a
    header asking for anything else is a ``400``)."""
    priority: PriorityClass = tenant.priority_class
    if asked is None:
        return priority
    wanted = asked.strip().lower()
    if wanted not in PRIORITY_CLASSES or (wanted == "interactive" and priority == "batch"):
        return _invalid(
            sidecar,
            400,
            f"{PRIORITY_HEADER}: may only lower the class to batch "
            f"(tenant class {priority}, asked {asked!r})",
            "invalid_value",
            PRIORITY_HEADER,
        )
    return "batch" if wanted == "batch" else priority


async def read_body(
    sidecar: Sidecar, request: web.Request
) -> tuple[dict[str, Any], bytes] | web.Response:
    """Body intake: the request's JSON object and the bytes it came in (decoded), or the
    answer refusing it: a coding the sidecar does not decode (``415``), a body over
    ``max_body_bytes`` sent or decoded (``413``), one slower than ``client_body_timeout_s``
    (``408``) or whose transfer is broken (``400``; both close the connection), one that does
    not decode as its coding says, is not UTF-8, not a JSON object or nested beyond the
    parser (``400``), or over the JSON shape limits (``400 body_too_complex``)."""
    settings = sidecar.settings
    coding = request.headers.get("Content-Encoding")
    decoded_as = "" if coding is None or not coding.isascii() else coding.lower()
    if coding is not None and decoded_as not in DECODED_REQUEST_CODINGS:
        # Any other coding would reach the JSON parser (and the upstream) still encoded.
        return _invalid(
            sidecar, 415,
            f"Content-Encoding {coding[:40]!r} is not supported "
            f"(use one of: {', '.join(sorted(c for c in DECODED_REQUEST_CODINGS if c))})",
            "unsupported_content_encoding",
        )  # fmt: skip
    try:
        if request.content.is_eof():  # the whole body came with the head: nothing to wait for
            raw = await request.read()
        else:
            async with asyncio.timeout(settings.client_body_timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _invalid(
            sidecar, 413, f"request body over {settings.max_body_bytes} bytes",
            "request_too_large",
        )  # fmt: skip
    except TimeoutError:
        return await _answer_and_close(request, _invalid(
            sidecar, 408, f"the request body took over {settings.client_body_timeout_s:g} s",
            "request_timeout",
        ))  # fmt: skip
    except RequestPayloadError:  # a body whose transfer is broken (e.g. bad chunked framing)
        return await _answer_and_close(request, _invalid(
            sidecar, 400, "the body could not be read (its transfer is malformed)",
            "invalid_encoding",
        ))  # fmt: skip
    try:
        raw = decode_body(raw, decoded_as, settings.max_body_bytes)
    except BodyTooLargeError:
        return _invalid(
            sidecar, 413, f"request body over {settings.max_body_bytes} bytes decoded",
            "request_too_large",
        )  # fmt: skip
    except ValueError:
        return _invalid(
            sidecar, 400,
            f"the body does not decode as its Content-Encoding ({(coding or '')[:40]!r}) says",
            "invalid_encoding",
        )  # fmt: skip
    try:
        text = utf8_text(raw)  # before counting: the count reads the bytes as UTF-8
    except NotUtf8Error as exc:
        return _invalid(sidecar, 400, str(exc), "invalid_json")
    try:
        brackets = check_raw_values(raw, settings.max_json_values)  # before the parse: its time
    except BodyShapeError as exc:
        return _invalid(sidecar, 400, f"{exc} (the sidecar's {exc.rule})", BODY_TOO_COMPLEX)
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    except RecursionError:
        return _invalid(
            sidecar, 400,
            f"the body nests JSON more deeply than the sidecar parses (at most about "
            f"{sys.getrecursionlimit() - _PARSE_STACK_FRAMES} levels)",
            "invalid_json",
        )  # fmt: skip
    if not isinstance(body, dict):
        return _invalid(sidecar, 400, "the body must be a JSON object", "invalid_json")
    if brackets > settings.max_json_depth:  # else it cannot nest deeper (check_raw_values)
        try:
            check_json_shape(body, settings.max_json_depth, settings.max_json_values)
        except BodyShapeError as exc:
            return _invalid(sidecar, 400, f"{exc} (the sidecar's {exc.rule})", BODY_TOO_COMPLEX)
    return body, raw


def _estimate_request(
    sidecar: Sidecar, path: str, body: dict[str, Any]
) -> tuple[Estimate, bool] | web.Response:
    """The request's estimate and whether it streams, or the ``400`` naming a bad field, or
    the answer the engine would give a request it refuses for certain."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _invalid(sidecar, 400, "stream: must be a boolean", "invalid_value", "stream")
    try:
        estimated, stream = _estimate_route(sidecar, path, body, stream)
    except EstimateError as exc:
        return _invalid(sidecar, 400, str(exc), "invalid_value", exc.param)
    refused = sidecar.engine_link.refusal(path, body)  # what the engine would refuse
    if refused is not None:
        return _invalid(sidecar, refused.status, refused.message, refused.code, refused.param)
    return estimated, stream


def _admit(sidecar: Sidecar, core_request: Request) -> Lifecycle | web.Response:
    """Admission (:func:`~tokenfair.server.lifecycle.begin`): the request's lifecycle, or the
    answer when its tenant is gone (``401``) or admission failed (``500``, recorded)."""
    try:
        return begin(sidecar.ports, core_request)
    except UnknownTenantError:  # removed by a reload while its body was being read
        return _invalid(sidecar, 401, "the tenant of this key no longer exists", "invalid_api_key")
    except Exception:  # a bug in admission: nothing was queued; one record says so
        log.exception("request %s: admission failed in the sidecar", core_request.request_id)
        sidecar.outcomes.record(core_request, None, status_code=500, reason=INTERNAL_ERROR)
        return _internal_error(core_request.request_id)


def _answer_refusal(sidecar: Sidecar, lifecycle: Lifecycle, estimated: Estimate) -> web.Response:
    """Answer a request refused at the door, then end it: the answer is built first, so its
    record says what the client got (``500 internal_error`` if building it failed)."""
    met = CLIENT_LEFT  # the decision's outcome stands unless the answer fails
    refusal = lifecycle.decision
    try:
        if refusal is None:  # cannot happen: a refusal at the door has its decision
            raise LifecycleError(f"request {lifecycle.request.request_id} refused without one")
        if refusal.reason == DRAINING:
            return _draining(sidecar)
        if refusal.status_code == STATUS_NEVER_ADMISSIBLE:
            return _never_admissible(sidecar, refusal)
        return _refusal(sidecar, refusal, _usage_mix(sidecar, estimated))
    except Exception:
        log.exception("request %s: its refusal could not be answered", lifecycle.request.request_id)
        met = Outcome(500, INTERNAL_ERROR)
        return _internal_error(lifecycle.request.request_id)
    finally:
        lifecycle.complete(sidecar.ports, met)


def _internal_error(request_id: str) -> web.Response:
    """``500 internal_error``: the sidecar failed on the request (logged with its traceback)."""
    return error_response(
        500, "the sidecar failed on this request; its log has the details under this "
        "request's x-request-id", INTERNAL_ERROR,
        headers={REQUEST_ID_HEADER: request_id},
    )  # fmt: skip


async def _serve(
    sidecar: Sidecar,
    request: web.Request,
    lifecycle: Lifecycle,
    body: dict[str, Any],
    raw: bytes,
    stream: bool,
    estimated: Estimate,
) -> web.StreamResponse:
    """Wait for dispatch, run the backend, answer the client; the lifecycle ends in ``finally``.

    ``met`` is the answer as the client met it; it starts as "the client went away" (the only
    way out of the ``await`` without an answer) and is set on every other path. Whatever the
    backend raises, :meth:`Lifecycle.complete
    <tokenfair.server.lifecycle.Lifecycle.complete>` releases the request's slot and KV and
    writes its one record (it never raises)."""
    core_request = lifecycle.request
    clock = sidecar.clock
    met = CLIENT_LEFT
    call: BackendCall | None = None
    first_byte_ms: list[float] = []
    handler = asyncio.current_task()
    handlers = sidecar.dispatcher.handlers
    if handler is not None:
        handlers.add(handler)
    try:
        decision = await sidecar.dispatcher.wait(lifecycle)
        if lifecycle.drained:
            return _draining(sidecar)
        if decision.status_code == 500:  # the core could not dispatch it (a bug, logged)
            return _internal_error(core_request.request_id)
        if not decision.admitted:
            return _refusal(sidecar, decision, _usage_mix(sidecar, estimated))
        sidecar.outcomes.dispatched(decision)
        headers = sidecar.ratelimits.headers(core_request.tenant_id, _usage_mix(sidecar, estimated))
        headers[REQUEST_ID_HEADER] = core_request.request_id
        headers[QUEUE_WAIT_HEADER] = _queue_wait_header(sidecar, decision)
        path = request.path
        max_prompt_tokens, max_completion_tokens = sidecar.usage_bounds.of_request(path, body)
        call = BackendCall(
            request=request,
            path=path,
            body=body,
            raw_body=raw,
            stream=stream,
            estimate=estimated,
            decision=decision,
            response_headers=headers,
            on_first_byte=lambda: first_byte_ms.append(clock.now_ms() - core_request.arrival_ms),
            dispatched_at_s=lifecycle.dispatched_at_s,
            client_write_timeout_s=sidecar.settings.client_write_timeout_s,
            max_prompt_tokens=max_prompt_tokens,
            max_completion_tokens=max_completion_tokens,
        )
        view = sidecar.kv_view
        bounded_end = (
            view.decode_booking == "peak"
            and stream
            and ends_at_its_bound(body, chat=request.path == CHAT_ROUTE)
        )
        call.progress = view.track(core_request.request_id, stream, bounded_end)
        try:
            response = await sidecar.backend.respond(call)
        except UpstreamError as exc:
            met = Outcome(exc.status, exc.code)
            log.warning("request %s: %s", core_request.request_id, exc.detail)
            if exc.status == 502 and call.prompt_tokens is None and not call.upstream_answered:
                # Refused or reset before any answer: no work to charge. (A timeout may have
                # run on the upstream, and an answer cut after its head did: they settle at
                # the usage seen, else at the estimate.)
                call.prompt_tokens = call.completion_tokens = 0
            return error_response(exc.status, exc.client_message, exc.code, headers=headers)
        except StreamAbortedError as exc:
            # The client has the status line and part of the body: cut its connection so the
            # transfer ends incomplete (a clean end would pass a truncated answer as whole).
            met = Outcome(502, exc.code)
            _abort_client(request)
            return exc.response
        if not response.prepared:
            # A whole answer: the backend's work is over, so the request is settled now (its
            # slot and KV free for the next one), and the answer is written here, bounded by
            # the write timeout like a stream, not left to aiohttp to write unbounded.
            lifecycle.settle_run(sidecar.ports, call, first_byte_ms[0] if first_byte_ms else None)
            await call.send(response)
        status, usage_error = response.status, call.usage_error
        met = SERVED if status == 200 and not usage_error else Outcome(
            status, usage_error or ADMITTED
        )  # fmt: skip
        return response
    except asyncio.CancelledError:
        if call is not None and call.client_write_timed_out:
            met = Outcome(STATUS_CLIENT_CLOSED, CLIENT_WRITE_TIMEOUT)
        elif call is not None and call.answer_complete:  # the client left with the whole answer
            met = Outcome(200, call.usage_error or ADMITTED)
        elif sidecar.dispatcher.aborting:  # cut by the drain, not by its client
            met = Outcome(503, DRAIN_ABORTED)
            writer = request.writer
            # A stream under way (bytes out, or a chunked answer prepared): end it incomplete.
            if writer.output_size > 0 or getattr(writer, "chunked", True):
                _abort_client(request)
            elif handler is not None and not _client_gone(request) and handler.uncancel() == 0:
                # Nothing sent yet: the client gets the 503 its record says (not a reset).
                return _drain_aborted(sidecar, core_request.request_id)
        raise
    except Exception as exc:
        if isinstance(exc, ConnectionError) and _client_gone(request):
            # A write to a client that left (or was cut for not reading) failed before the
            # handler's cancellation arrived: the client's outcome, not the sidecar's failure.
            if call is not None and call.client_write_timed_out:
                met = Outcome(STATUS_CLIENT_CLOSED, CLIENT_WRITE_TIMEOUT)
            elif call is not None and call.answer_complete:
                met = Outcome(200, call.usage_error or ADMITTED)
            return web.Response(status=STATUS_CLIENT_CLOSED)  # never sent: no connection
        log.exception("request %s failed in the sidecar", core_request.request_id)
        met = Outcome(500, INTERNAL_ERROR)
        if request.writer.output_size > 0:  # a response already started: cut it
            _abort_client(request)
            return web.Response(status=500)  # never sent: the connection is gone
        return _internal_error(core_request.request_id)
    finally:
        try:
            if call is not None:
                call.close()
                try:  # the view and the ratio only: never worth the request's slot
                    sidecar.kv_view.request_ended(
                        sidecar.scheduler,
                        core_request.request_id,
                        core_request.prefill_tokens,
                        call.prompt_tokens,
                    )
                except Exception:
                    log.exception(
                        "request %s: the KV view could not learn from it",
                        core_request.request_id,
                    )
        finally:  # whatever raised above: the slot and the KV reservation are released
            lifecycle.complete(
                sidecar.ports, met, call, first_byte_ms[0] if first_byte_ms else None
            )
            if handler is not None:
                handlers.discard(handler)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _abort_client(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def expect_not_found(request: web.Request) -> web.Response:
    """The ``Expect`` handler of every other route: no ``100 Continue`` for a request that has
    nowhere to go — its ``404`` is the answer and the connection closes (the body the client
    holds back is never read)."""
    return await _answer_and_close(request, await not_found(request))


async def not_found(request: web.Request) -> web.Response:
    return error_response(
        404, f"no route {request.method} {request.path} (try POST /v1/chat/completions)",
        "not_found",
    )  # fmt: skip


RETRY_AFTER_MS_HEADER: Final = "retry-after-ms"
"""A refusal's wait in real milliseconds next to ``Retry-After`` (whole seconds): the openai
SDK reads it first (``_parse_retry_after_header``)."""


def _estimate_route(
    sidecar: Sidecar, path: str, body: dict[str, Any], stream: bool
) -> tuple[Estimate, bool]:
    """The request's estimate by route, and whether it streams: an embedding costs prefill only
    and is one JSON answer whatever ``stream`` says (:func:`~tokenfair.server.estimate.
    estimate_embeddings`); completions and chat as :func:`~tokenfair.server.estimate.
    estimate` says. Raises :class:`EstimateError` naming a bad field."""
    if path == EMBEDDINGS_ROUTE:
        return estimate_embeddings(body, sidecar.estimator), False
    settings = sidecar.settings
    estimated = estimate(
        body, sidecar.estimator, settings.default_decode_tokens, settings.max_decode_tokens
    )
    return estimated, stream


def _usage_mix(sidecar: Sidecar, estimated: Estimate) -> tuple[int, int]:
    """The request's ``(usage tokens, service tokens)``: its estimate's ``prompt + max_tokens``
    and their service tokens, the ratio that converts the tenant's service-token bucket into
    the tokens clients count (:meth:`RateLimits.headers
    <tokenfair.server.ratelimit.RateLimits.headers>`)."""
    prefill, decode = estimated.prefill_tokens, estimated.decode_tokens
    return prefill + decode, sidecar.scheduler.cost.service_tokens(prefill, decode)
