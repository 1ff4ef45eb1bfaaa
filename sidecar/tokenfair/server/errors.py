"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

A refusal (``429``) is in the shape of OpenAI's own rate-limit errors, so that clients matching
on them match ours: ``code`` is ``rate_limit_exceeded``, ``type`` says which limit (``tokens``
for the tenant's token budget, ``requests`` for the others: OpenAI's two kinds), ``param`` is
null, and the gate's reason (``shed_queue_wait_slo``, ...) is in a field of its own,
``tokenfair_reason`` (:func:`rate_limit_response`). The openai SDK reads ``code``, ``param`` and
``type`` from the ``error`` object and keeps the whole object as ``body``, so the reason is
there too (``exc.body["tokenfair_reason"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from aiohttp import web

from tokenfair.core.jobs import SHED_TENANT_TOKEN_QUOTA
from tokenfair.core.reasons import Reason

INTERNAL_ERROR: Final = Reason.INTERNAL_ERROR
"""The code (and record reason) of a request the sidecar itself failed on (a bug, logged)."""
RATE_LIMIT_EXCEEDED: Final = "rate_limit_exceeded"
"""The ``code`` of every ``429`` the sidecar answers (OpenAI's)."""
REASON_FIELD: Final = "tokenfair_reason"
"""The field of a ``429``'s ``error`` object that holds the gate's reason."""
TOKEN_LIMIT_REASONS: Final = frozenset({SHED_TENANT_TOKEN_QUOTA})
"""Refusal reasons whose ``type`` is ``tokens`` (the tenant's token budget); any other is
``requests`` (queue, wait and KV limits: the number of requests the server can take now)."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    429: "requests",
    499: "client_closed_request",
    500: "server_error",
    501: "not_implemented",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }
    return web.json_response(body, status=status, headers=headers)


def rate_limit_response(
    message: str, reason: str, *, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A ``429`` in OpenAI's rate-limit shape, the gate's ``reason`` in ``tokenfair_reason``."""
    body = {
        "error": {
            "message": message,
            "type": "tokens" if reason in TOKEN_LIMIT_REASONS else "requests",
            "param": None,
            "code": RATE_LIMIT_EXCEEDED,
            REASON_FIELD: reason,
        }
    }
    return web.json_response(body, status=429, headers=headers)
