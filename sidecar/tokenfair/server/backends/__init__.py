"""Backends behind one small async interface (:class:`Backend`), and their registry.

:data:`BACKENDS` is the one list of backend names (each its class's ``name``): the ``sidecar:``
section's ``backend`` key and the ``--backend`` flag are checked against it, the flag's choices
and help come from it, and :func:`make_backend` builds from it. A new backend is one entry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

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
    default_max_in_flight,
)
from tokenfair.server.backends.costmodel import CostModelBackend
from tokenfair.server.backends.openai import OpenAIBackend
from tokenfair.server.runtime_settings import (
    UPSTREAM_BACKENDS,
    SidecarSettings,
    read_upstream_api_key,
    upstream_api_key_path,
)


@dataclass(frozen=True, slots=True)
class BackendKind:
    """A registered backend: how it is built from the settings, and what it needs."""

    summary: str
    """What it is, for ``--help`` and messages."""
    build: Callable[[SidecarSettings, CostModel, Mapping[str, str]], Backend]
    """``(settings, cost model, environment) -> backend``."""
    genai_provider: str
    """Its ``gen_ai.provider.name`` in trace spans (OpenTelemetry's GenAI conventions)."""
    needs_upstream: bool = False
    """It relays to ``upstreamUrl`` (``--upstream``), which must then be set
    (:data:`~tokenfair.server.runtime_settings.UPSTREAM_BACKENDS`)."""


def _costmodel(settings: SidecarSettings, cost: CostModel, environ: Mapping[str, str]) -> Backend:
    return CostModelBackend(
        cost,
        settings.time_scale,
        served_model_names=settings.served_model_names,
        embedding_dimensions=settings.embedding_dimensions,
    )


def _openai(settings: SidecarSettings, cost: CostModel, environ: Mapping[str, str]) -> Backend:
    if not settings.upstream_url:
        raise ValueError(f"the {OpenAIBackend.name} backend needs an upstream URL")
    key_file = upstream_api_key_path(settings, environ)
    return OpenAIBackend(
        settings.upstream_url,
        settings.upstream_connect_timeout_s,
        settings.upstream_read_timeout_s,
        api_key=None if key_file is None else read_upstream_api_key(*key_file),
    )


BACKENDS: Final[Mapping[str, BackendKind]] = MappingProxyType(
    {
        CostModelBackend.name: BackendKind(
            "the embedded cost-model engine",
            _costmodel,
            genai_provider="tokenfair.costmodel",
            needs_upstream=CostModelBackend.name in UPSTREAM_BACKENDS,
        ),
        OpenAIBackend.name: BackendKind(
            "an OpenAI-compatible upstream such as vLLM",
            _openai,
            genai_provider="openai",
            needs_upstream=OpenAIBackend.name in UPSTREAM_BACKENDS,
        ),
    }
)
"""Backend name -> :class:`BackendKind`, one per name of
:data:`~tokenfair.server.runtime_settings.BACKEND_NAMES` (the settings check ``backend`` against
those names without importing the backends)."""


def make_backend(
    settings: SidecarSettings, cost: CostModel, environ: Mapping[str, str] | None = None
) -> Backend:
    """The backend ``settings.backend`` names in :data:`BACKENDS`. The ``openai`` backend's
    upstream key is read here, at start
    (:func:`~tokenfair.server.runtime_settings.read_upstream_api_key`: a ``ConfigError`` naming
    the file if it is unreadable or empty); ``environ`` (default: the process's) may name its
    file."""
    kind = BACKENDS.get(settings.backend)
    if kind is None:
        raise ValueError(f"unknown backend {settings.backend!r} (known: {', '.join(BACKENDS)})")
    return kind.build(settings, cost, os.environ if environ is None else environ)


__all__ = [
    "BACKENDS",
    "BAD_USAGE",
    "EMBEDDINGS_ROUTE",
    "MODELS_ROUTE",
    "ROUTES",
    "UPSTREAM_ABORTED",
    "Backend",
    "BackendCall",
    "BackendKind",
    "CostModelBackend",
    "OpenAIBackend",
    "StreamAbortedError",
    "UpstreamError",
    "default_max_in_flight",
    "make_backend",
]
