"""``GET /v1/models``: the models behind the sidecar, for an authenticated client.

Listing models does no model work, so it is not admitted, queued or charged: with the
``openai`` backend the upstream's answer is relayed (bounded in time and size, the upstream's
own key sent if one is set, see :mod:`~tokenfair.server.backends.openai`); with the
``costmodel`` engine the configured ``served_model_names`` are listed. The key is checked as on
every other route (``401 invalid_api_key``); a failed relay is ``502``/``504`` with the usual
generic message (the details go to the log).
"""

from __future__ import annotations

import logging

from aiohttp import web

from tokenfair.core.reasons import Reason
from tokenfair.server.backends import UpstreamError
from tokenfair.server.errors import error_response
from tokenfair.server.proxy import SIDECAR, authenticate_request

log = logging.getLogger("tokenfair.sidecar")


async def list_models(request: web.Request) -> web.StreamResponse:
    sidecar = request.app[SIDECAR]
    tenant = authenticate_request(sidecar, request)
    if tenant is None:
        sidecar.metrics.count_invalid(401)
        return error_response(
            401, "missing or unknown API key (Authorization: Bearer <key>)", Reason.INVALID_API_KEY
        )
    try:
        return await sidecar.backend.models(request)
    except UpstreamError as exc:
        log.warning("GET %s for tenant %s: %s", request.path, tenant.tenant_id, exc.detail)
        return error_response(exc.status, exc.client_message, exc.code)
