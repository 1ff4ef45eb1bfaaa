"""Backends behind one small async interface (:class:`Backend`)."""

from __future__ import annotations

from tokenfair_sidecar.costmodel import CostModel
from tokenfair_sidecar.server.backends.base import (
    BAD_USAGE,
    ROUTES,
    UPSTREAM_ABORTED,
    Backend,
    BackendCall,
    StreamAbortedError,
    UpstreamError,
)
from tokenfair_sidecar.server.backends.costmodel import CostModelBackend
from tokenfair_sidecar.server.backends.openai import OpenAIBackend
from tokenfair_sidecar.server.settings import SidecarSettings


def make_backend(settings: SidecarSettings, cost: CostModel) -> Backend:
    """The backend ``settings.backend`` names."""
    if settings.backend == "openai":
        if not settings.upstream_url:
            raise ValueError("the openai backend needs an upstream URL")
        return OpenAIBackend(
            settings.upstream_url,
            settings.upstream_connect_timeout_s,
            settings.upstream_read_timeout_s,
        )
    if settings.backend == "costmodel":
        return CostModelBackend(cost, settings.time_scale)
    raise ValueError(f"unknown backend {settings.backend!r}")


__all__ = [
    "BAD_USAGE",
    "ROUTES",
    "UPSTREAM_ABORTED",
    "Backend",
    "BackendCall",
    "CostModelBackend",
    "OpenAIBackend",
    "StreamAbortedError",
    "UpstreamError",
    "make_backend",
]
