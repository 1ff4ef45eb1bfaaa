"""Backends behind one small async interface (:class:`Backend`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from tokenfair.core.cost import CostModel
from tokenfair.server.backends.base import (
    BAD_USAGE,
    EMBEDDINGS_ROUTE,
    MODELS_ROUTE,
    ROUTES,
    UPSTREAM_ABORTED,
    Backend,
    BackendCall,
    StreamAbortedError,
    UpstreamError,
)
from tokenfair.server.backends.costmodel import CostModelBackend
from tokenfair.server.backends.openai import OpenAIBackend
from tokenfair.server.runtime_settings import (
    SidecarSettings,
    read_upstream_api_key,
    upstream_api_key_path,
)


def make_backend(
    settings: SidecarSettings, cost: CostModel, environ: Mapping[str, str] | None = None
) -> Backend:
    """The backend ``settings.backend`` names. The ``openai`` backend's upstream key is read
    here, at start (:func:`~tokenfair.server.runtime_settings.read_upstream_api_key`: a
    ``ConfigError`` naming the file if it is unreadable or empty); ``environ`` (default: the
    process's) may name its file."""
    if settings.backend == "openai":
        if not settings.upstream_url:
            raise ValueError("the openai backend needs an upstream URL")
        key_file = upstream_api_key_path(settings, os.environ if environ is None else environ)
        return OpenAIBackend(
            settings.upstream_url,
            settings.upstream_connect_timeout_s,
            settings.upstream_read_timeout_s,
            api_key=None if key_file is None else read_upstream_api_key(*key_file),
        )
    if settings.backend == "costmodel":
        return CostModelBackend(
            cost,
            settings.time_scale,
            served_model_names=settings.served_model_names,
            embedding_dimensions=settings.embedding_dimensions,
        )
    raise ValueError(f"unknown backend {settings.backend!r}")


__all__ = [
    "BAD_USAGE",
    "EMBEDDINGS_ROUTE",
    "MODELS_ROUTE",
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
