"""``tokenfair sidecar``: run the proxy standalone from a config file (see docs/sidecar.md)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenfair.config.fields import flag_number
from tokenfair.core.cost import CostModel
from tokenfair.server import create_app, load_sidecar_file, make_backend
from tokenfair.server.accesslog import (
    ACCESS_LOG_FORMATS,
    FLUSH_AT_EXIT_S,
    configure_access_logger,
)
from tokenfair.server.backends import BACKENDS
from tokenfair.server.runner import serve
from tokenfair.server.runtime_settings import (
    ENGINE_METRICS_MODES,
    SECTION_FIELDS,
    SidecarSettings,
    check_settings,
    settings_from_section,
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sidecar",
        help="run the admission and fair-scheduling proxy in front of one model server",
        description=(
            "Serve the OpenAI-compatible POST /v1/chat/completions, /v1/completions and "
            "/v1/embeddings, admitting and scheduling every request per tenant in service "
            "tokens, and GET /v1/models; health, Prometheus metrics and status on the admin "
            "listener; a structured access log line per request on stdout. Flags override the "
            "config file's optional sidecar: section (docs/sidecar.md, docs/observability.md)."
        ),
    )
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help="YAML: a TokenfairConfig document and/or TenantQuota + SchedulingPolicy manifests "
        "(watched; valid changes apply live)",
    )
    parser.add_argument("--listen", metavar="HOST:PORT", help="proxy listener (127.0.0.1:8080)")
    parser.add_argument(
        "--admin-listen", metavar="HOST:PORT", help="admin listener (127.0.0.1:9090)"
    )
    parser.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        help="model server: "
        + " or ".join(
            f"{name} ({kind.summary}{', needs --upstream' if kind.needs_upstream else ''})"
            for name, kind in BACKENDS.items()
        )
        + f"; default {SidecarSettings().backend}",
    )
    parser.add_argument("--upstream", metavar="URL", help="OpenAI-compatible upstream (openai)")
    parser.add_argument(
        "--time-scale",
        type=flag_number,
        metavar="X",
        help="real seconds per model second (1.0; 0.01 runs 100x faster)",
    )
    parser.add_argument("--records", metavar="FILE", help="append request records (JSONL)")
    parser.add_argument(
        "--max-in-flight", type=flag_number, metavar="N", help="backend concurrency"
    )
    parser.add_argument(
        "--trusted-tenant-header",
        metavar="NAME",
        help="trust this header to name the tenant (only behind an authenticating gateway)",
    )
    parser.add_argument(
        "--drain-grace", type=flag_number, metavar="SECONDS", help="in-flight grace on SIGTERM (30)"
    )
    parser.add_argument(
        "--upstream-api-key-file",
        metavar="FILE",
        help="the API key the openai upstream expects (vLLM's --api-key), read once at start",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="a model GET /v1/models lists with the costmodel engine (repeat for more; "
        "tokenfair-costmodel)",
    )
    parser.add_argument(
        "--embedding-dimensions",
        type=flag_number,
        metavar="N",
        help="length of the costmodel engine's embeddings when a request sets none (384)",
    )
    parser.add_argument(
        "--ietf-ratelimit-headers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also send the IETF RateLimit-Policy and RateLimit fields (off)",
    )
    parser.add_argument(
        "--access-log",
        choices=ACCESS_LOG_FORMATS,
        help="the access log line per request on stdout: json, text (logfmt) or off (json)",
    )
    parser.add_argument(
        "--engine-metrics",
        choices=ENGINE_METRICS_MODES,
        help="read the upstream engine's KV cache and queue from its /metrics: auto (vLLM's, "
        "else SGLang's names), vllm, sglang, custom or off (auto; openai backend only)",
    )
    parser.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="export an OpenTelemetry span per request over OTLP/HTTP (off; needs the tracing "
        "extra)",
    )
    parser.add_argument(
        "--tracing-endpoint",
        metavar="URL",
        help="the OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces (default: "
        "the OTEL_EXPORTER_OTLP_* variables)",
    )
    parser.add_argument(
        "--fairness-window",
        type=flag_number,
        metavar="SECONDS",
        help="sliding window of the live fairness signal, tokenfair_fluid_* metrics (300)",
    )
    parser.add_argument(
        "--fairness-top-tenants",
        type=flag_number,
        metavar="N",
        help="tenants per lane named in tokenfair_fluid_served_ratio, the rest as other (10)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    parser.set_defaults(func=run)


_FLAGS = {
    "listen": "listen",
    "admin_listen": "adminListen",
    "backend": "backend",
    "upstream": "upstreamUrl",
    "time_scale": "timeScale",
    "records": "recordsPath",
    "max_in_flight": "maxInFlight",
    "trusted_tenant_header": "trustedTenantHeader",
    "drain_grace": "drainGraceSeconds",
    "upstream_api_key_file": "upstreamApiKeyFile",
    "served_model_name": "servedModelNames",
    "embedding_dimensions": "embeddingDimensions",
    "ietf_ratelimit_headers": "ietfRateLimitHeaders",
    "access_log": "accessLog",
    "tracing": "tracing",
    "tracing_endpoint": "tracingEndpoint",
    "engine_metrics": "engineMetrics",
    "fairness_window": "fairnessWindowSeconds",
    "fairness_top_tenants": "fairnessTopTenants",
}
"""Flag (its ``argparse`` dest) -> the ``sidecar:`` key it overrides. A flag's value is checked
by the parser of that key (:data:`~tokenfair.server.runtime_settings.SECTION_FIELDS`), under
the flag's name: one rule per setting, wherever it is set. Number flags reach it as numbers
(:func:`~tokenfair.config.fields.flag_number`), so ``--max-in-flight 2.5`` is refused as
``sidecar: {maxInFlight: 2.5}`` is."""


def flag_name(dest: str) -> str:
    """``max_in_flight`` -> ``--max-in-flight``."""
    return "--" + dest.replace("_", "-")


def settings_for(args: argparse.Namespace, section: Mapping[str, object]) -> SidecarSettings:
    """The defaults, then the file's ``sidecar:`` section, then the flags; the cross-field rules
    are checked once all three are applied (a file's ``backend: openai`` may get its upstream
    from ``--upstream``)."""
    settings = settings_from_section(section, check=False)
    changes: dict[str, Any] = {}
    for dest, key in _FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            attr, parse = SECTION_FIELDS[key]
            changes[attr] = parse(flag_name(dest), value)
    return check_settings(dataclasses.replace(settings, **changes))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    loaded = load_sidecar_file(args.config)
    settings = settings_for(args, loaded.section)
    writer = configure_access_logger(
        settings.access_log, flush_interval_s=settings.access_log_flush_s
    )
    backend = make_backend(settings, CostModel.from_policy(loaded.config.policy))
    app = create_app(
        settings,
        loaded.config,
        backend,
        config_path=args.config,
        config_sha256=loaded.sha256,
        section=loaded.section,
        access_writer=writer,
    )
    try:
        asyncio.run(serve(settings, app))
    finally:
        if writer is not None:
            # The loop's SIGHUP handler (reopen the logs) went with the loop: a logrotate's
            # SIGHUP now would end the process before the last access lines are out.
            if hasattr(signal, "SIGHUP"):
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            sys.stdout.flush()  # the ready line first, then the last access lines
            writer.close(FLUSH_AT_EXIT_S)
    return 0
