"""The names both sides of the config feed use: the operator publishes and serves a policy's
document, the sidecar reads it (the mounted file and the long-poll, ``server/config_feed.py``).

One home for each name, so that the writer and the reader cannot drift apart: the operator
(``tokenfair_operator``) imports them from here, never from the sidecar's server package.
"""

from __future__ import annotations

from typing import Final

CONFIG_FILE: Final = "config.yaml"
"""The document's data key in the ConfigMap and Secret the operator publishes: the file the
sidecar reads in the mounted volume."""
GENERATION_FILE: Final = "generation"
"""The generation's file beside the mounted ``config.yaml`` (a data key of the ConfigMap and
Secret the operator publishes; the kubelet swaps both files at once)."""

VERSION_HEADER: Final = "X-Tokenfair-Config-Version"
"""The document's version in an answer of the operator's document server (``200`` and ``304``)."""
GENERATION_HEADER: Final = "X-Tokenfair-Config-Generation"
"""The document's generation (a counter that only grows per policy) in a ``200`` answer."""
SOURCE_PARAM: Final = "source"
"""Query parameter of a document request: ``secret`` (with the API-key hashes) or
``configmap``."""
VERSION_PARAM: Final = "version"
"""Query parameter of a document request: the version the sidecar runs (answer ``304`` while
it is still the current one)."""
WAIT_PARAM: Final = "waitSeconds"
"""Query parameter of a document request: how long the server may hold it without news."""

URL_ENV: Final = "TOKENFAIR_CONFIG_URL"
"""The document's URL, set in the sidecar's container by the operator's injector."""
TOKEN_FILE_ENV: Final = "TOKENFAIR_CONFIG_TOKEN_FILE"
"""The projected ServiceAccount token the sidecar sends as ``Bearer`` (set by the injector)."""
CA_FILE_ENV: Final = "TOKENFAIR_CONFIG_CA_FILE"
"""The CA bundle the document server's certificate must chain to (set by the injector)."""
INSECURE_HTTP_ENV: Final = "TOKENFAIR_CONFIG_INSECURE_HTTP"
"""``true``: an ``http://`` URL is allowed (unsafe; local tests only; set by the injector)."""

METRICS_PATH: Final = "/metrics"
"""The sidecar's Prometheus metrics on its admin port: the operator scrapes them for the
quotas' live usage and the policies' rollout."""
ADMITTED_TOKENS_METRIC: Final = "tokenfair_estimated_service_tokens"
"""Counter (``_total``) of service tokens charged at dispatch, by ``tenant`` and ``lane``."""
REFUSED_METRIC: Final = "tokenfair_refused_requests"
"""Counter (``_total``) of requests refused, by ``tenant``, ``lane`` and ``reason``."""
QUEUE_WAIT_METRIC: Final = "tokenfair_queue_wait_seconds"
"""Histogram of arrival to dispatch, by ``tenant`` and ``lane``."""
CONFIG_INFO_METRIC: Final = "tokenfair_config_info"
"""Gauge (value 1) of the config in force, labels ``version`` and ``sha256``. The sidecar's
``server/metrics.py`` writes these families under these names; a test reads a real sidecar's
metrics text with the operator's readers (tests/operator/test_operator_usage.py)."""

MAX_GENERATION_DIGITS: Final = 18
"""A generation is 1 to 18 ASCII digits (milliseconds of the wall clock fit in 13)."""


def read_generation(text: str) -> int | None:
    """A generation as the header, the file and the operator's annotation carry it: 1 to
    :data:`MAX_GENERATION_DIGITS` ASCII digits (blanks around them ignored), else None. The one
    rule both sides read it by: the sidecar refuses what this refuses, and the operator never
    continues from a number the sidecar would refuse."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > MAX_GENERATION_DIGITS:
        return None
    return int(text)
