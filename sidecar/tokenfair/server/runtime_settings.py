"""Runtime settings of the sidecar (everything that is not scheduling policy).

Set from three places, later ones winning: the defaults below, the optional ``sidecar:`` section
of a ``TokenfairConfig`` document (camelCase keys, see :data:`SECTION_FIELDS`), and command-line
flags. The section is read here, not by :mod:`tokenfair.config`: it is stripped from the
documents before they reach :func:`~tokenfair.config.parse_documents`, so the policy
contract stays the operator's and the sidecar's alone.

Only the policy and tenants are hot-reloaded; a changed ``sidecar:`` section needs a restart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokenfair.config import (
    CONFIG_KIND,
    Config,
    ConfigError,
    document_text,
    load_documents,
    parse_documents,
    read_config_file,
    shown,
)
from tokenfair.config.fields import (
    FieldTable,
    Parser,
    boolean,
    in_flight_limit,
    integer_in,
    number_in,
    one_of,
    positive,
    positive_int,
    read_fields,
    string,
)
from tokenfair.config.files import InputFileError, open_regular
from tokenfair.core.cost import MAX_REQUEST_TOKENS as MAX_USAGE_TOKENS
from tokenfair.server import fairness_signal as fairness
from tokenfair.server.accesslog import ACCESS_LOG_FORMATS, DEFAULT_FLUSH_INTERVAL_S
from tokenfair.server.estimate import (
    MAX_EMBEDDING_DIMENSIONS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
)
from tokenfair.server.kv_view import KV_DECODE_BOOKING_MODES
from tokenfair.server.upstream import parse_origin

COSTMODEL_BACKEND: Final = "costmodel"
OPENAI_BACKEND: Final = "openai"
BACKEND_NAMES: Final = (COSTMODEL_BACKEND, OPENAI_BACKEND)
"""The backend names, in the order ``--help`` lists them: the registry
:data:`tokenfair.server.backends.BACKENDS` builds one backend per name. They live here, below the
registry (which builds from :class:`SidecarSettings`), so the settings check ``backend`` without
importing the backends."""
UPSTREAM_BACKENDS: Final = frozenset({OPENAI_BACKEND})
"""The backends that relay to ``upstreamUrl`` (``--upstream``), which must then be set."""

DEFAULT_SERVED_MODEL_NAMES: Final = ("tokenfair-costmodel",)
DEFAULT_MODEL_CONTEXT_TOKENS: Final = 131_072
"""The default of :attr:`SidecarSettings.model_context_tokens`: 128 Ki tokens, the context
window of most served models (Llama 3.1 and later, Qwen 2.5 with YaRN, Mistral Large, DeepSeek
V3)."""
DEFAULT_EMBEDDING_DIMENSIONS: Final = 384


@dataclass(frozen=True, slots=True)
class SidecarSettings:
    """How the sidecar runs; every field has a flag or a ``sidecar:`` key and its default here.
    Grouped by concern, as docs/sidecar.md's table is."""

    # -- Listeners and the process ---------------------------------------------------------
    listen: str = "127.0.0.1:8080"
    """Proxy listener, ``HOST:PORT`` (tenants' traffic)."""
    admin_listen: str = "127.0.0.1:9090"
    """Admin listener, ``HOST:PORT`` (health, metrics, status); never reachable via ``listen``."""
    time_scale: float = 1.0
    """Real seconds per model second: 0.01 runs the cost model and the scheduler's clock 100x
    faster (tests, demos). Keep 1.0 in front of a real model server."""
    drain_grace_s: float = 30.0
    """On SIGTERM, how long in-flight requests may run before the listeners close."""
    reload_interval_s: float = 1.0
    """How often the config file's mtime and hash are checked for a hot reload."""
    records_path: str | None = None
    """Append one JSONL request record per request here (the trace format); None: no records."""

    # -- The backend and its upstream ------------------------------------------------------
    backend: str = COSTMODEL_BACKEND
    """The model server: a name in the registry
    :data:`tokenfair.server.backends.BACKENDS` (the embedded cost-model engine, or an
    OpenAI-compatible upstream)."""
    upstream_url: str | None = None
    """Base URL of the ``openai`` upstream, e.g. ``http://127.0.0.1:8000`` (request paths are
    appended)."""
    upstream_api_key_file: str | None = None
    """A file holding the API key the ``openai`` upstream expects (vLLM's ``--api-key``), e.g. a
    mounted Secret; sent as ``Authorization: Bearer <key>`` on every upstream request (the
    client's own ``Authorization`` carries the tenant's key and is never forwarded). Read once
    at start (surrounding whitespace stripped): an unreadable or empty file stops the start.
    None: ``$TOKENFAIR_UPSTREAM_API_KEY_FILE`` if set, else no key. Never logged or shown."""
    upstream_connect_timeout_s: float = 5.0
    """Connecting to the upstream longer than this is ``504``."""
    upstream_read_timeout_s: float = 120.0
    """Waiting longer than this for the next upstream bytes is ``504`` (or ends the stream)."""
    max_in_flight: int | None = None
    """Requests dispatched to the backend at once; None: the policy's ``maxBatchRequests`` when
    it is above 1, else the backend's default (costmodel 2: one running on its serial engine,
    one staged; openai 64) (:func:`~tokenfair.server.backends.base.default_max_in_flight`)."""
    model_context_tokens: int = DEFAULT_MODEL_CONTEXT_TOKENS
    """The model's context window in tokens (vLLM's ``max_model_len``; default 131,072): the most
    prompt tokens one prompt may report and, for a request that sets no ``max_tokens``, the most
    completion tokens one sequence may. A reported usage over the request's bounds
    (:class:`~tokenfair.server.backends.base.UsageBounds`) is recorded
    ``upstream_bad_usage`` and settled at the bounds. Set it to your model's context."""
    served_model_names: tuple[str, ...] = DEFAULT_SERVED_MODEL_NAMES
    """What ``GET /v1/models`` lists with the ``costmodel`` engine (the ``openai`` backend
    relays the upstream's list). The default is the name the engine answers with when a
    request names no model."""
    embedding_dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS
    """Length of the ``costmodel`` engine's fake embeddings when a request does not set
    ``dimensions`` (384: the common small sentence-embedding models')."""

    # -- A request's intake: who sends it, its body, its estimate --------------------------
    trusted_tenant_header: str | None = None
    """When set (e.g. ``x-tokenfair-tenant``), that header names the tenant instead of an API key:
    only behind a gateway that authenticates callers and strips the header from outside."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (bytes); larger is ``413``."""
    max_json_depth: int = MAX_JSON_DEPTH
    """Deepest nesting of a request body's JSON (the body itself is level 1); deeper is ``400
    body_too_complex`` (see :data:`~tokenfair.server.estimate.MAX_JSON_DEPTH`)."""
    max_json_values: int = MAX_JSON_VALUES
    """Most JSON values in a request body (objects, arrays, strings, numbers, literals); more is
    ``400 body_too_complex``: it bounds the event-loop time a body costs before admission (see
    :data:`~tokenfair.server.estimate.MAX_JSON_VALUES`)."""
    default_decode_tokens: int = 256
    """Decode tokens assumed when a request sets neither ``max_tokens`` nor
    ``max_completion_tokens``."""
    max_decode_tokens: int = 8192
    """Largest ``max_tokens`` accepted; larger is ``400`` (the KV reservation must be honest)."""
    prompt_estimator: str = "chars4"
    """Name of the prompt-token estimator (see :mod:`tokenfair.server.estimate`)."""

    # -- Client connections and their timeouts ---------------------------------------------
    client_idle_timeout_s: float = 75.0
    """A proxy-listener connection with no request under way — idle between requests, or still
    sending a request's head — is closed after this long. Above the time for which common HTTP
    client pools keep an idle connection (httpx and the OpenAI SDK 5 s, aiohttp 15 s), so a
    client does not send a POST on a connection the sidecar is closing (nginx's default too);
    together with ``max_client_connections`` it bounds what idle and slow-header connections
    can hold."""
    client_body_timeout_s: float = 30.0
    """Reading one request's body longer than this is ``408`` (the body is at most
    ``max_body_bytes``: 30 s is ~35 KB/s for the default 1 MiB)."""
    client_write_timeout_s: float = 30.0
    """A write to a streaming client (or the end of its stream) that has waited this long with
    the client taking no bytes aborts the client's connection and settles the request (``499
    client_write_timeout``): a client that stops reading cannot hold an in-flight slot, while
    one that reads slowly is never cut (the clock restarts whenever it takes bytes: see
    :meth:`~tokenfair.server.backends.base.BackendCall.write`)."""
    max_client_connections: int = 4096
    """Open connections on the proxy listener; one more is answered ``503`` and closed at once.
    Every queued request holds one, so keep it above ``maxInFlight`` plus the queue you expect
    (and the process's file limit above it)."""
    max_unauthenticated_connections: int = 1024
    """Of ``max_client_connections``, how many may be held by connections that have not yet
    carried a request with a valid key (new, idle-before-their-first-request, or only refused
    ones). When they are all taken, a new connection takes the place of the oldest of them (which
    is closed), so a flood of anonymous sockets cannot keep a tenant's new connection out; the
    rest of the cap (3,072 by default) is a reserve only authenticated connections reach (see
    :mod:`~tokenfair.server.connections`)."""
    max_unauthenticated_connections_per_peer: int = 256
    """Of ``max_unauthenticated_connections``, how many one peer may hold (an IPv4 address, or an
    IPv6 /64: what one host can take); one more from it is answered ``503`` and closed, evicting
    nobody. A gateway's connections authenticate with their first request, so this bounds only
    the connections it has opened and not yet used."""

    # -- The engine in the loop (backends with an upstream engine) -------------------------
    engine_metrics: str = "auto"
    """Read the upstream engine's own state (:mod:`~tokenfair.server.engine_state`): ``auto``
    (vLLM's metric names, else SGLang's), ``vllm``, ``sglang``, ``custom`` (the
    ``engine*Metric`` names below) or ``off``. Only backends with an upstream engine
    (``openai``); KV gates fall back to the sidecar's books whenever the report is stale."""
    engine_metrics_path: str = "/metrics"
    """The engine's Prometheus page, appended to ``upstream_url``."""
    engine_metrics_interval_s: float = 0.25
    """How often the engine's metrics are read (vLLM updates its gauges every engine step)."""
    engine_metrics_stale_s: float = 2.0
    """A report older than this is dropped and KV gates use the books until the next one."""
    engine_kv_usage_metric: str | None = None
    """``custom``: the gauge of the fraction (0..1) of the engine's KV cache in use."""
    engine_running_metric: str | None = None
    """``custom``: the gauge of the requests the engine runs."""
    engine_waiting_metric: str | None = None
    """``custom``: the gauge of the requests the engine holds waiting."""
    adopt_engine_kv_geometry: bool = True
    """Take the engine's KV block size and block count (vLLM's ``vllm:cache_config_info``)
    over the policy's ``kvBlockTokens`` and ``totalKvBlocks`` while the engine reports them."""
    kv_prompt_ratio: str = "learned"
    """How the KV gates book a request's prompt: ``learned`` (the estimate times the engine's
    prompt tokens per estimated one, learned from the usage it reports, within 0.5-4:
    :mod:`~tokenfair.server.kv_view`) or ``off`` (the estimate). Backends with an upstream
    engine only; service tokens, budgets and records keep the estimate either way."""
    kv_decode_booking: str = "upfront"
    """How the KV gates book a running request's decode: ``upfront`` (its whole
    ``max_tokens`` from dispatch), ``engine`` (while the engine's report is fresh: its prompt,
    the tokens relayed and the growth to the next report, as the engine allocates) or ``peak``
    (while it is fresh: the running streams' decode to the forecast peak of their blocks)
    (:mod:`~tokenfair.server.kv_view`). Backends with an upstream engine only."""

    # -- What clients and operators are told: headers, access log, tracing, live fairness ---
    ietf_ratelimit_headers: bool = False
    """Also send the IETF ``RateLimit-Policy`` and ``RateLimit`` fields
    (draft-ietf-httpapi-ratelimit-headers) in service tokens; off by default (a draft)."""
    access_log: str = "json"
    """The access log's format: ``json`` (one object per line), ``text`` (logfmt) or ``off``
    (see :mod:`~tokenfair.server.accesslog`). On by default: a request that leaves no
    line cannot be found afterwards, and a line costs ~8 % of a request's work
    (``bench_sidecar.py --instructions``)."""
    access_log_flush_s: float = DEFAULT_FLUSH_INTERVAL_S
    """The longest an access line waits in the buffer before it goes to the writer thread
    (0.1 s; sooner once ~64 KiB are buffered, and at exit)."""
    tracing: bool = False
    """Export one OpenTelemetry span per request over OTLP/HTTP (needs the ``tracing`` extra;
    see :mod:`~tokenfair.server.tracing`). Off by default: it needs a collector."""
    tracing_endpoint: str | None = None
    """The OTLP/HTTP traces URL, e.g. ``http://otel-collector:4318/v1/traces``; None: the
    OpenTelemetry SDK's variables (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ...), else its
    default (``http://localhost:4318/v1/traces``)."""
    fairness_window_s: float = fairness.DEFAULT_WINDOW_S
    """The sliding window of the live fairness signal (``tokenfair_fluid_*``,
    :mod:`~tokenfair.server.fairness_signal`), in model seconds, 1 to 86,400. Default 300 (5
    minutes): enough requests of every active tenant that one long generation does not read
    as unfairness, short enough that an unfair split shows within minutes."""
    fairness_top_tenants: int = fairness.DEFAULT_TOP_TENANTS
    """Tenants per lane named in ``tokenfair_fluid_served_ratio`` (those that received the
    most in the window; the rest are summed as ``other``), 0 to 100. Default 10: the series
    stay bounded at any number of tenants."""


def _address(name: str, value: object) -> str:
    parse_address(string(name, value), name)
    return str(value)


def _backend(name: str, value: object) -> str:
    """One of :data:`BACKEND_NAMES`."""
    return str(one_of(BACKEND_NAMES)(name, value))


def _header(name: str, value: object) -> str:
    return string(name, value).lower()


def _mode(options: tuple[str, ...]) -> Parser:
    """One of ``options``, which hold ``off``: YAML 1.1 (the config file's reader) reads an
    unquoted ``off`` (or ``no``, ``false``) as the boolean false, which is taken as ``off``; the
    boolean true is refused (it names no mode)."""
    parse = one_of(options)

    def read(name: str, value: object) -> str:
        if value is False:
            return "off"
        return str(parse(name, value))

    return read


_access_log: Final = _mode(ACCESS_LOG_FORMATS)


def _http_url(name: str, value: object) -> str:
    url = string(name, value)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{name}: must be an http:// or https:// URL (got {shown(value)})")
    return url


ENGINE_METRICS_MODES: Final = ("auto", "vllm", "sglang", "custom", "off")
KV_PROMPT_RATIO_MODES: Final = ("learned", "off")
_METRIC_NAME: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]{0,199}$")


def _metric_name(name: str, value: object) -> str:
    text = string(name, value)
    if not _METRIC_NAME.match(text):
        raise ConfigError(f"{name}: must be a Prometheus metric name (got {shown(value)})")
    return text


def _path(name: str, value: object) -> str:
    text = string(name, value)
    if not text.startswith("/") or any(c in text for c in " \r\n\t?#"):
        raise ConfigError(f"{name}: must be a path starting with / (got {shown(value)})")
    return text


MAX_MODEL_NAMES: Final = 64
MAX_MODEL_NAME_CHARS: Final = 256


def _model_names(name: str, value: object) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= MAX_MODEL_NAMES
        or not all(isinstance(v, str) and 0 < len(v) <= MAX_MODEL_NAME_CHARS for v in value)
    ):
        raise ConfigError(
            f"{name}: must be a list of 1..{MAX_MODEL_NAMES} non-empty strings of at most "
            f"{MAX_MODEL_NAME_CHARS} characters (got {shown(value)})"
        )
    return tuple(value)


SECTION_FIELDS: Final[FieldTable] = {
    "listen": ("listen", _address),
    "adminListen": ("admin_listen", _address),
    "backend": ("backend", _backend),
    "upstreamUrl": ("upstream_url", string),
    "timeScale": ("time_scale", positive),
    "maxBodyBytes": ("max_body_bytes", positive_int),
    "defaultDecodeTokens": ("default_decode_tokens", positive_int),
    "maxDecodeTokens": ("max_decode_tokens", positive_int),
    "maxJsonDepth": ("max_json_depth", positive_int),
    "maxJsonValues": ("max_json_values", positive_int),
    "trustedTenantHeader": ("trusted_tenant_header", _header),
    "recordsPath": ("records_path", string),
    "maxInFlight": ("max_in_flight", in_flight_limit),
    "upstreamConnectTimeoutSeconds": ("upstream_connect_timeout_s", positive),
    "upstreamReadTimeoutSeconds": ("upstream_read_timeout_s", positive),
    "drainGraceSeconds": ("drain_grace_s", positive),
    "reloadIntervalSeconds": ("reload_interval_s", positive),
    "promptEstimator": ("prompt_estimator", string),
    "clientIdleTimeoutSeconds": ("client_idle_timeout_s", positive),
    "clientBodyTimeoutSeconds": ("client_body_timeout_s", positive),
    "clientWriteTimeoutSeconds": ("client_write_timeout_s", positive),
    "maxClientConnections": ("max_client_connections", positive_int),
    "maxUnauthenticatedConnections": ("max_unauthenticated_connections", positive_int),
    "maxUnauthenticatedConnectionsPerPeer": (
        "max_unauthenticated_connections_per_peer",
        positive_int,
    ),
    "upstreamApiKeyFile": ("upstream_api_key_file", string),
    "modelContextTokens": ("model_context_tokens", integer_in(1, MAX_USAGE_TOKENS)),
    "servedModelNames": ("served_model_names", _model_names),
    "embeddingDimensions": ("embedding_dimensions", integer_in(1, MAX_EMBEDDING_DIMENSIONS)),
    "ietfRateLimitHeaders": ("ietf_ratelimit_headers", boolean),
    "accessLog": ("access_log", _access_log),
    "accessLogFlushSeconds": ("access_log_flush_s", number_in(0.001, 60.0)),
    "engineMetrics": ("engine_metrics", _mode(ENGINE_METRICS_MODES)),
    "engineMetricsPath": ("engine_metrics_path", _path),
    "engineMetricsIntervalSeconds": ("engine_metrics_interval_s", number_in(0.01, 60.0)),
    "engineMetricsStaleSeconds": ("engine_metrics_stale_s", number_in(0.05, 3600.0)),
    "engineKvUsageMetric": ("engine_kv_usage_metric", _metric_name),
    "engineRunningMetric": ("engine_running_metric", _metric_name),
    "engineWaitingMetric": ("engine_waiting_metric", _metric_name),
    "adoptEngineKvGeometry": ("adopt_engine_kv_geometry", boolean),
    "kvPromptRatio": ("kv_prompt_ratio", _mode(KV_PROMPT_RATIO_MODES)),
    "kvDecodeBooking": ("kv_decode_booking", one_of(KV_DECODE_BOOKING_MODES)),
    "tracing": ("tracing", boolean),
    "tracingEndpoint": ("tracing_endpoint", _http_url),
    "fairnessWindowSeconds": (
        "fairness_window_s",
        number_in(fairness.MIN_WINDOW_S, fairness.MAX_WINDOW_S),
    ),
    "fairnessTopTenants": ("fairness_top_tenants", integer_in(0, fairness.MAX_TOP_TENANTS)),
}
"""``sidecar:`` key -> (attribute, parser): the parsers are :mod:`tokenfair.config.fields`'
(one rule each; an integer setting takes ``2`` and ``2.0``, never ``2.5`` or ``true``), and
the ``tokenfair sidecar`` flags are checked by the parser of the key they override."""


def parse_address(value: str, name: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; ``[::1]:80`` for IPv6."""
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 <= int(port) <= 65535
    ):
        raise ConfigError(f"{name}: must be HOST:PORT (got {shown(value)})")
    return host.strip("[]"), int(port)


def settings_from_section(
    section: Mapping[str, object], base: SidecarSettings | None = None, *, check: bool = True
) -> SidecarSettings:
    """Apply a ``sidecar:`` section (camelCase) over ``base`` (default: the defaults); each
    field is checked, and with ``check`` the cross-field rules too (:func:`check_settings`).
    A caller that applies more (command-line flags) passes ``check=False`` and checks the
    result: ``backend: openai`` in the file with the upstream from ``--upstream`` is valid."""
    values = read_fields("sidecar", section, SECTION_FIELDS)
    settings = dataclasses.replace(base or SidecarSettings(), **values)
    return check_settings(settings) if check else settings


def check_settings(settings: SidecarSettings) -> SidecarSettings:
    """Cross-field rules."""
    if _backend("backend", settings.backend) in UPSTREAM_BACKENDS and not settings.upstream_url:
        raise ConfigError(
            f"the {settings.backend} backend needs an upstream URL (--upstream / upstreamUrl)"
        )
    if settings.upstream_url is not None:
        try:
            parse_origin(settings.upstream_url)
        except ValueError as exc:
            raise ConfigError(f"upstreamUrl: {exc} (got {shown(settings.upstream_url)})") from None
    if settings.default_decode_tokens > settings.max_decode_tokens:
        raise ConfigError(
            f"defaultDecodeTokens ({settings.default_decode_tokens}) must be <= "
            f"maxDecodeTokens ({settings.max_decode_tokens})"
        )
    if settings.engine_metrics == "custom" and settings.engine_kv_usage_metric is None:
        raise ConfigError(
            "engineMetrics: custom needs engineKvUsageMetric (the gauge of the fraction of the "
            "engine's KV cache in use)"
        )
    parse_address(settings.listen, "listen")
    parse_address(settings.admin_listen, "adminListen")
    return settings


@dataclass(frozen=True, slots=True)
class LoadedFile:
    """A config file as read: the policy contract, the raw ``sidecar:`` section, its digest."""

    config: Config
    section: Mapping[str, object]
    sha256: str


def loads_sidecar_file(data: bytes, source: str) -> LoadedFile:
    """Parse YAML bytes holding TokenfairConfig / TenantQuota / SchedulingPolicy documents."""
    # gzip and JSON (the operator's large documents) are read by the contract's own loader.
    documents = load_documents(document_text(data, source), source)
    section: dict[str, object] = {}
    stripped: list[object] = []
    for document in documents:
        if isinstance(document, dict) and document.get("kind") == CONFIG_KIND:
            document = dict(document)
            raw = document.pop("sidecar", None)
            if raw is not None:
                if not isinstance(raw, dict):
                    raise ConfigError(f"{source}: sidecar: must be a mapping")
                section.update(raw)
        stripped.append(document)
    config = parse_documents(stripped, source)
    return LoadedFile(config, section, hashlib.sha256(data).hexdigest())


UPSTREAM_API_KEY_FILE_ENV: Final = "TOKENFAIR_UPSTREAM_API_KEY_FILE"
"""The environment variable naming the upstream key's file when ``upstreamApiKeyFile`` is
unset (what an injector sets next to a mounted Secret)."""
MAX_API_KEY_BYTES: Final = 4096


def upstream_api_key_path(
    settings: SidecarSettings, environ: Mapping[str, str]
) -> tuple[str, str] | None:
    """The file of the upstream's key and where it was named (for messages): the setting,
    else :data:`UPSTREAM_API_KEY_FILE_ENV`; None for no key."""
    if settings.upstream_api_key_file:
        return settings.upstream_api_key_file, "upstreamApiKeyFile"
    path = environ.get(UPSTREAM_API_KEY_FILE_ENV)
    return (path, f"${UPSTREAM_API_KEY_FILE_ENV}") if path else None


def read_upstream_api_key(path: str, named_by: str = "upstreamApiKeyFile") -> str:
    """The key in ``path``, stripped of surrounding whitespace. :class:`ConfigError` naming the
    file and ``named_by`` (never its content) if it cannot be read, is empty, is over 4 KiB or
    holds anything but visible ASCII (the key goes into a header line)."""
    try:
        with open_regular(path) as file:
            data = file.read(MAX_API_KEY_BYTES + 1)
    except InputFileError as exc:
        raise ConfigError(f"{named_by}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{named_by}: cannot read {path} ({exc.strerror or exc})") from None
    if len(data) > MAX_API_KEY_BYTES:
        raise ConfigError(f"{named_by}: {path} is over {MAX_API_KEY_BYTES} bytes")
    key = data.strip()
    if not key:
        raise ConfigError(f"{named_by}: {path} is empty")
    if not all(0x21 <= byte <= 0x7E for byte in key):
        raise ConfigError(
            f"{named_by}: {path} holds characters other than visible ASCII "
            "(spaces, control characters or non-ASCII bytes inside the key)"
        )
    return key.decode("ascii")


def load_sidecar_file(path: str | Path) -> LoadedFile:
    """The config file at ``path``: a regular file of at most ``MAX_DOCUMENT_BYTES``
    (``read_config_file``: a FIFO, a device or a directory is refused by name, never read)."""
    return loads_sidecar_file(read_config_file(path), str(path))
