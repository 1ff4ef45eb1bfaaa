"""Proxy handlers: authenticate, estimate, admit, wait for dispatch, run the backend, settle.

Status codes the client can get from the sidecar itself (OpenAI-style error bodies; ``code``):

=====  ==========================================================================================
400    ``invalid_json`` (body not a JSON object), ``invalid_value`` (``param`` names the field:
       ``max_tokens``, ``max_completion_tokens``, ``stream``, ``messages``, ``prompt``, or the
       ``x-tokenfair-priority`` header asking for a class above the tenant's)
401    ``invalid_api_key`` (no ``Authorization: Bearer`` key, or an unknown one)
404    ``not_found`` (any route but the two below)
413    ``request_too_large`` (body over ``max_body_bytes``)
429    the gate's reason: ``shed_kv_watermark``, ``shed_queue_wait_slo``,
       ``shed_tenant_token_quota``, ``queue_full`` (admission) or ``shed_queue_timeout`` (waited
       past the class limit); with ``Retry-After`` and ``x-ratelimit-*-tokens``
502    ``upstream_error`` (refused, reset, broken response) — ``openai`` backend
503    ``draining`` (shutting down; ``Retry-After``)
504    ``upstream_timeout``
=====  ==========================================================================================

Headers the sidecar adds to the answers of a request that reached admission (the upstream's
answer, 429, 502, 504):
``x-request-id`` (the sidecar's own id, unique in its records file, ending in the client's
``x-request-id`` when that is valid — :data:`REQUEST_ID_RE`) and
``x-tokenfair-queue-wait-ms`` (wall milliseconds the request waited in the queue: 0 for a
refusal at the door, the wait until expiry for ``shed_queue_timeout``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from aiohttp import web

from tokenfair_sidecar.config import PRIORITY_CLASSES, PriorityClass
from tokenfair_sidecar.core import Decision, Request, UnknownTenantError
from tokenfair_sidecar.core.jobs import CANCELLED, STATUS_CLIENT_CLOSED
from tokenfair_sidecar.server.backends import BackendCall, UpstreamError
from tokenfair_sidecar.server.dispatcher import Ticket
from tokenfair_sidecar.server.errors import error_response
from tokenfair_sidecar.server.estimate import Estimate, EstimateError, estimate
from tokenfair_sidecar.server.recorder import Usage
from tokenfair_sidecar.server.state import Sidecar

SIDECAR: Final = web.AppKey("sidecar", Sidecar)
PRIORITY_HEADER: Final = "x-tokenfair-priority"
REQUEST_ID_HEADER: Final = "x-request-id"
QUEUE_WAIT_HEADER: Final = "x-tokenfair-queue-wait-ms"
REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
"""A client's request id is honoured when it matches this: 1-128 letters, digits and ``_.:-``
(the trace ids of ``tokenfair trace``, e.g. ``tenant_chat_pro-000001``, and UUIDs)."""
DRAINING: Final = "draining"


def _invalid(sidecar: Sidecar, status: int, message: str, code: str, param: str | None = None
             ) -> web.Response:  # fmt: skip
    sidecar.metrics.invalid.labels(str(status)).inc()
    return error_response(status, message, code, param=param)


def _draining(sidecar: Sidecar) -> web.Response:
    return error_response(
        503,
        "the sidecar is shutting down; retry (another replica will serve you)",
        DRAINING,
        headers={"Retry-After": str(sidecar.retry_after_s(None))},
    )


def _refusal(sidecar: Sidecar, decision: Decision) -> web.Response:
    observed = ", ".join(f"{k}={v:g}" for k, v in decision.observed.items())
    message = f"refused by the {decision.gate} gate: {decision.reason}"
    if observed:
        message += f" ({observed})"
    headers = sidecar.ratelimit_headers(decision.tenant_id)
    headers["Retry-After"] = str(sidecar.retry_after_s(decision))
    headers[REQUEST_ID_HEADER] = decision.request_id
    headers[QUEUE_WAIT_HEADER] = _queue_wait_header(sidecar, decision)
    return error_response(429, message, decision.reason, headers=headers)


def _queue_wait_header(sidecar: Sidecar, decision: Decision) -> str:
    """The decision's queue wait (model ms) in wall ms, as the header's value."""
    return f"{decision.queue_wait_ms * sidecar.clock.time_scale:.3f}"


def _request_id(sidecar: Sidecar, asked: str | None) -> str:
    """A new id, unique in the records file; a valid client ``x-request-id`` is appended to it
    (``<prefix>-<n>-<client id>``), so records can be joined with the client's own while a
    client that reuses its ids (retries, a second run) still never duplicates a record id."""
    if asked is not None and REQUEST_ID_RE.fullmatch(asked) is not None:
        return f"{sidecar.next_request_id()}-{asked}"
    return sidecar.next_request_id()


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``."""
    sidecar = request.app[SIDECAR]
    arrival_ms = round(sidecar.clock.now_ms(), 3)
    if sidecar.dispatcher.draining:
        return _draining(sidecar)
    headers = request.headers
    trusted_header = sidecar.settings.trusted_tenant_header
    tenant = sidecar.auth.authenticate(
        headers.get("Authorization"), headers.get(trusted_header) if trusted_header else None
    )
    if tenant is None:
        return _invalid(
            sidecar, 401, "missing or unknown API key (Authorization: Bearer <key>)",
            "invalid_api_key",
        )  # fmt: skip
    priority: PriorityClass = tenant.priority_class
    asked = headers.get(PRIORITY_HEADER)
    if asked is not None:
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
        priority = "batch" if wanted == "batch" else priority
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _invalid(
            sidecar, 413, f"request body over {sidecar.settings.max_body_bytes} bytes",
            "request_too_large",
        )  # fmt: skip
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return _invalid(sidecar, 400, "the body must be a JSON object", "invalid_json")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _invalid(sidecar, 400, "stream: must be a boolean", "invalid_value", "stream")
    settings = sidecar.settings
    try:
        cost = estimate(
            body, sidecar.estimator, settings.default_decode_tokens, settings.max_decode_tokens
        )
    except EstimateError as exc:
        return _invalid(sidecar, 400, str(exc), "invalid_value", exc.param)
    job = Request(
        _request_id(sidecar, headers.get(REQUEST_ID_HEADER)),
        tenant.tenant_id,
        arrival_ms,
        cost.prefill_tokens,
        cost.decode_tokens,
        priority,
    )
    try:
        admission = sidecar.dispatcher.submit(job)
    except UnknownTenantError:  # removed by a reload while its body was being read
        return _invalid(sidecar, 401, "the tenant of this key no longer exists", "invalid_api_key")
    if isinstance(admission, Decision):
        sidecar.account(job, admission, status_code=429, reason=admission.reason)
        return _refusal(sidecar, admission)
    return await _serve(sidecar, request, admission, body, raw, stream, cost)


async def _serve(
    sidecar: Sidecar,
    request: web.Request,
    ticket: Ticket,
    body: dict[str, Any],
    raw: bytes,
    stream: bool,
    cost: Estimate,
) -> web.StreamResponse:
    """Wait for dispatch, run the backend, and account the outcome whatever happens."""
    job = ticket.request
    clock = sidecar.clock
    status_code = STATUS_CLIENT_CLOSED
    reason = CANCELLED
    call: BackendCall | None = None
    ttft_ms: list[float] = []
    try:
        decision = await sidecar.dispatcher.wait(ticket)
        if ticket.drained:
            status_code, reason = 503, DRAINING
            return _draining(sidecar)
        if not decision.admitted:
            status_code, reason = decision.status_code, decision.reason
            return _refusal(sidecar, decision)
        sidecar.dispatched(decision)
        headers = sidecar.ratelimit_headers(job.tenant_id)
        headers[REQUEST_ID_HEADER] = job.request_id
        headers[QUEUE_WAIT_HEADER] = _queue_wait_header(sidecar, decision)
        call = BackendCall(
            request=request,
            path=request.path,
            body=body,
            raw_body=raw,
            stream=stream,
            estimate=cost,
            decision=decision,
            response_headers=headers,
            on_first_byte=lambda: ttft_ms.append(clock.now_ms() - job.arrival_ms),
            dispatched_at_s=ticket.dispatched_at_s,
        )
        try:
            response = await sidecar.backend.respond(call)
        except UpstreamError as exc:
            status_code, reason = exc.status, exc.code
            if exc.status == 502 and call.prompt_tokens is None:
                # Refused or reset before any answer: no work to charge. (A timeout may have
                # run on the upstream, so it settles at the estimate.)
                call.prompt_tokens = call.completion_tokens = 0
            return error_response(exc.status, str(exc), exc.code, headers=headers)
        status_code, reason = response.status, "admitted"
        return response
    finally:
        _settle(sidecar, ticket, call, status_code, reason, ttft_ms)


def _settle(
    sidecar: Sidecar,
    ticket: Ticket,
    call: BackendCall | None,
    status_code: int,
    reason: str,
    ttft_ms: list[float],
) -> None:
    job = ticket.request
    actual: int | None = None
    usage = Usage()
    if call is not None:
        prompt, completion = call.prompt_tokens, call.completion_tokens
        if prompt is not None or completion is not None:
            actual = sidecar.scheduler.cost.service_tokens(
                job.prefill_tokens if prompt is None else prompt,
                job.decode_tokens if completion is None else completion,
            )
        sidecar.dispatcher.finish(ticket, actual, sidecar.backend.kv_hold_ms(call))
        usage = Usage(
            prompt, completion, ttft_ms[0] if ttft_ms else None,
            sidecar.clock.now_ms() - job.arrival_ms,
        )  # fmt: skip
    elif ticket.decision is not None:
        # Dispatched but no backend call made (its client left, or the handler failed before the
        # call): settled at zero. `finish` is a no-op if the dispatcher already settled it.
        actual = 0
        sidecar.dispatcher.finish(ticket, 0, 0.0)
    decision = ticket.decision or ticket.outcome
    if decision is None:  # cannot happen: a ticket ends dispatched, refused or cancelled
        return
    if ticket.outcome is not None and ticket.decision is None:
        status_code, reason = (
            (503, DRAINING) if ticket.drained else (ticket.outcome.status_code,
                                                    ticket.outcome.reason)
        )  # fmt: skip
    sidecar.account(
        job,
        decision,
        status_code=status_code,
        reason=reason,
        actual_service_tokens=actual,
        usage=usage,
    )


async def not_found(request: web.Request) -> web.Response:
    return error_response(
        404, f"no route {request.method} {request.path} (try POST /v1/chat/completions)",
        "not_found",
    )  # fmt: skip
