"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from aiohttp import web

INTERNAL_ERROR: Final = "internal_error"
"""The code (and record reason) of a request the sidecar itself failed on (a bug, logged)."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    500: "server_error",
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
