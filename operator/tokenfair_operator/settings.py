"""Operator settings: ours in :class:`OperatorConfig`, Kopf's applied in :func:`configure_kopf`.

Nothing of Kopf's defaults shows in our API: handler progress and the last-handled spec live in
``tokenfair.io/*`` annotations (never in ``status``, which our CRDs own), and only Warning-level
Events (our refusals, handler failures) are posted. No handler needs a finalizer (see
:mod:`.handlers`); the finalizer name is still ``tokenfair.io/finalizer``, so that Kopf removes
the one older versions put on policies.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from tokenfair.config.fields import flag_number, positive, positive_int

from .inject import (
    CONFIG_AUDIENCE,
    DEFAULT_IMAGE,
    InjectionError,
    InjectionSettings,
    checked_drain_grace_s,
    checked_log_level,
    checked_max_in_flight,
)
from .model import GROUP

FINALIZER: Final = f"{GROUP}/finalizer"
KOPF_OBJECTS_LOGGER: Final = "kopf.objects"
"""The logger of Kopf's per-object messages (the handlers' ``logger`` writes there too)."""
DIFFBASE_KEY: Final = "last-handled-configuration"
RESYNC_ENV: Final = "TOKENFAIR_RESYNC_SECONDS"
IMAGE_ENV: Final = "TOKENFAIR_SIDECAR_IMAGE"
SIDECAR_ENV: Final = {
    "cpu_request": "TOKENFAIR_SIDECAR_CPU_REQUEST",
    "memory_request": "TOKENFAIR_SIDECAR_MEMORY_REQUEST",
    "cpu_limit": "TOKENFAIR_SIDECAR_CPU_LIMIT",
    "memory_limit": "TOKENFAIR_SIDECAR_MEMORY_LIMIT",
    "max_in_flight": "TOKENFAIR_SIDECAR_MAX_IN_FLIGHT",
    "log_level": "TOKENFAIR_SIDECAR_LOG_LEVEL",
    "drain_grace_s": "TOKENFAIR_SIDECAR_DRAIN_GRACE_SECONDS",
    "scrape_annotations": "TOKENFAIR_SIDECAR_SCRAPE_ANNOTATIONS",
}
"""The injected sidecars' defaults (:class:`.inject.InjectionSettings`), by field: the chart's
``sidecar.resources`` and ``sidecar.*`` values. Unset or empty: the dataclass default."""
WEBHOOK_ENV_PREFIX: Final = "TOKENFAIR_WEBHOOK_"
DEFAULT_RESYNC_S: Final = 30.0
USAGE_ENV: Final = "TOKENFAIR_USAGE_SECONDS"
DEFAULT_USAGE_S: Final = 15.0
DEFAULT_WEBHOOK_ADDR: Final = "0.0.0.0"
INJECTION_POLICY_ENV: Final = "TOKENFAIR_INJECTION_FAILURE_POLICY"
FAILURE_POLICIES: Final = ("Fail", "Ignore")
HTTP_PORT_ENV: Final = "TOKENFAIR_HTTP_PORT"
HTTP_ADDR_ENV: Final = "TOKENFAIR_HTTP_ADDR"
CONFIG_URL_BASE_ENV: Final = "TOKENFAIR_CONFIG_URL_BASE"
HTTPS_PORT_ENV: Final = "TOKENFAIR_HTTPS_PORT"
HTTPS_FILES_ENV: Final = {
    "https_cert": "TOKENFAIR_HTTPS_CERT",
    "https_key": "TOKENFAIR_HTTPS_KEY",
    "https_ca": "TOKENFAIR_HTTPS_CA",
}
CONFIG_AUDIENCE_ENV: Final = "TOKENFAIR_CONFIG_AUDIENCE"
INSECURE_HTTP_ENV: Final = "TOKENFAIR_CONFIG_INSECURE_HTTP"
LEADER_ELECTION_ENV: Final = "TOKENFAIR_LEADER_ELECTION"
POD_NAME_ENV: Final = "TOKENFAIR_POD_NAME"
ADVERTISE_ENV: Final = "TOKENFAIR_HTTP_ADVERTISE"
LEASE_NAMESPACE_ENV: Final = "TOKENFAIR_LEASE_NAMESPACE"
LEASE_NAME_ENV: Final = "TOKENFAIR_LEASE_NAME"
RELAY_CONNECTIONS_ENV: Final = "TOKENFAIR_RELAY_CONNECTIONS"
PROCESS_TAG: Final = uuid.uuid4().hex[:8]
"""This process's part of its Lease identity (:attr:`OperatorConfig.identity`): drawn once per
process, so reading the settings again (a retried startup hook) gives the same identity."""


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Tunables of the operator."""

    resync_interval_s: float = DEFAULT_RESYNC_S
    """Seconds between periodic full passes per policy. Watches make changes visible at once;
    the resync only catches what no watch reports (a key Secret's content) and retries failed
    passes, so half a minute bounds that lag at about one pass per policy per 30 s of API load."""
    watch_server_timeout_s: int = 300
    """Seconds a watch request lives on the server before Kopf re-establishes it; below the
    API server's own limit, so reconnects are ours and quiet."""
    watch_client_timeout_s: int = 330
    """Client-side bound on one watch request: a silently dead connection is noticed in time."""
    webhook_port: int | None = None
    """TCP port of the admission webhook server (HTTPS); None serves no webhook (CEL and the
    reconciler's status still refuse bad objects, only later)."""
    webhook_addr: str = DEFAULT_WEBHOOK_ADDR
    """Address the webhook server listens on (all interfaces: the API server calls in)."""
    webhook_host: str | None = None
    """Host name or IP the API server uses in the webhook URL (must be in the certificate)."""
    webhook_cert: str | None = None
    """PEM certificate of the webhook server; also sent as the caBundle (self-signed or a CA's
    leaf: the API server must be able to verify it from this bundle)."""
    webhook_key: str | None = None
    """PEM private key of the webhook server."""
    webhook_ca: str | None = None
    """PEM CA bundle sent as the caBundle; None sends ``webhook_cert``."""
    webhook_cert_secret: tuple[str, str] | None = None
    """(namespace, name) of the Secret in which the operator keeps its own CA and serving
    certificate (``$TOKENFAIR_WEBHOOK_CERT_SECRET=namespace/name``); None when the certificate
    comes from files (cert-manager's, or the ``_CERT``/``_KEY`` given). See
    :mod:`.webhook_certs`."""
    webhook_dns_names: tuple[str, ...] = ()
    """DNS names of the operator's own serving certificate (``$TOKENFAIR_WEBHOOK_DNS_NAMES``,
    comma-separated): the webhook Service's names, as the API server calls it."""
    webhook_configurations: tuple[str, ...] = ()
    """Names of the Validating/MutatingWebhookConfigurations whose caBundle the operator sets
    to its own CA (``$TOKENFAIR_WEBHOOK_CONFIGURATIONS``, comma-separated)."""
    webhook_cert_dir: str = "/tmp/tokenfair-webhook"
    """Where the operator's own certificate files are written for the webhook server (the
    chart's writable ``/tmp``)."""
    cert_check_interval_s: float = 3600.0
    """Seconds between checks of the operator's own certificate: one hour, against a 30-day
    renewal margin (:mod:`.certs`)."""
    webhook_managed: str | None = None
    """Name of the ValidatingWebhookConfiguration Kopf keeps in line with the handlers; None when
    a static one is installed instead (the chart's, with a Service reference)."""

    usage_interval_s: float = DEFAULT_USAGE_S
    """Seconds between scrapes of the sidecars' metrics into ``TenantQuota.status.usage``
    (``$TOKENFAIR_USAGE_SECONDS``). Also the bound on usage writes: at most one per quota per
    interval, and only when a number changed."""
    scrape_timeout_s: float = 2.0
    """Per-round bound on fetching every sidecar's metrics; a slow sidecar is skipped."""
    injection: InjectionSettings = field(default_factory=InjectionSettings)
    """What injected sidecars get unless their Pod's annotations say otherwise: image
    (``$TOKENFAIR_SIDECAR_IMAGE``), resources and runtime flags (:data:`SIDECAR_ENV`), and the
    long-poll base (``$TOKENFAIR_CONFIG_URL_BASE``); checked at startup, so a bad chart value
    stops the operator with the variable's name instead of refusing every Pod later."""
    injection_failure_policy: str = "Fail"
    """``failurePolicy`` of the injection webhook Kopf manages (``$TOKENFAIR_INJECTION_FAILURE_
    POLICY``): ``Fail`` refuses a labelled Pod while we cannot answer, so none ever serves
    without the sidecar; ``Ignore`` (unsafe) starts it uninjected. The chart's static webhook
    takes ``webhook.injectionFailurePolicy`` instead."""
    http_port: int | None = None
    """TCP port of the operator's plain-HTTP server (``$TOKENFAIR_HTTP_PORT``, the chart's
    8081): ``/metrics`` (:mod:`.metrics`) and the config documents' long-poll for sidecars
    (:mod:`.serve`); None serves neither (sidecars then read their mounted file only)."""
    http_addr: str = DEFAULT_WEBHOOK_ADDR
    """Address that server listens on (``$TOKENFAIR_HTTP_ADDR``)."""
    https_port: int | None = None
    """TCP port of the same server over TLS (``$TOKENFAIR_HTTPS_PORT``, the chart's 8443), on
    ``http_addr``: the only one that serves config documents unless ``config_insecure_http``
    (:mod:`.serving_tls`). Needs a certificate: the operator's own (``webhook_cert_secret``) or
    the files below."""
    https_cert: str | None = None
    """PEM serving certificate of the TLS port (``$TOKENFAIR_HTTPS_CERT``); None: the webhook's
    (the same Service's DNS names), the operator's own or cert-manager's."""
    https_key: str | None = None
    """Its PEM private key (``$TOKENFAIR_HTTPS_KEY``); None: the webhook's."""
    https_ca: str | None = None
    """PEM CA bundle that verifies it (``$TOKENFAIR_HTTPS_CA``), published to sidecars and
    trusted by the relay; None: the webhook's CA file."""
    config_audience: str = CONFIG_AUDIENCE
    """Audience the document server's TokenReview asks for (``$TOKENFAIR_CONFIG_AUDIENCE``),
    the injected sidecars' projected token's: a token without it is refused (401)."""
    config_insecure_http: bool = False
    """Serve config documents on the plain port too (``$TOKENFAIR_CONFIG_INSECURE_HTTP=true``):
    unsafe, the token and the document travel in clear; for a local operator in tests."""
    http_advertise: str = ""
    """``host:port`` at which other replicas reach this one's HTTP server
    (``$TOKENFAIR_HTTP_ADVERTISE``, default: this host's IP and ``$TOKENFAIR_HTTPS_PORT``, else
    ``$TOKENFAIR_HTTP_PORT``): written into the Lease by the leader, so a standby relays
    sidecars' long-polls to it (over TLS when the standby serves TLS)."""
    leader_election: bool = False
    """Run with leader election on a Lease (``$TOKENFAIR_LEADER_ELECTION=true``; the chart sets
    it): for two or more replicas, :mod:`.leader`. Off: this replica always leads."""
    lease_namespace: str = "default"
    """Namespace of the Lease (``$TOKENFAIR_LEASE_NAMESPACE``, the chart: its release's)."""
    lease_name: str = "tokenfair-operator"
    """Name of the Lease (``$TOKENFAIR_LEASE_NAME``)."""
    identity: str = ""
    """This process's name in the Lease: ``$TOKENFAIR_POD_NAME`` (else the host name, in a Pod
    the Pod's name), ``_`` and 8 random hex digits drawn once per process
    (:data:`PROCESS_TAG`): a restarted container is a new holder and waits for its predecessor's
    lease to expire like anyone else (as client-go), while a retried startup hook keeps it."""
    relay_connections: int = 1_000
    """Long-polls a standby relays to the leader at once (``$TOKENFAIR_RELAY_CONNECTIONS``):
    one per sidecar, so at least the expected sidecar count (``serve.DEFAULT_RELAY_CONNECTIONS``;
    aiohttp's own default, 100, would hold the 101st sidecar back)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults, overridden by ``$TOKENFAIR_RESYNC_SECONDS``, ``$TOKENFAIR_USAGE_SECONDS``,
        ``$TOKENFAIR_SIDECAR_IMAGE``, ``$TOKENFAIR_INJECTION_FAILURE_POLICY``,
        ``$TOKENFAIR_HTTP_PORT``, ``_ADDR``, ``$TOKENFAIR_HTTPS_PORT``, ``_CERT``, ``_KEY``,
        ``_CA``, ``$TOKENFAIR_CONFIG_URL_BASE``, ``_AUDIENCE``, ``_INSECURE_HTTP``, the sidecar
        defaults (:data:`SIDECAR_ENV`), ``$TOKENFAIR_RELAY_CONNECTIONS``, the Lease's
        ``$TOKENFAIR_LEADER_ELECTION``, ``$TOKENFAIR_LEASE_NAMESPACE``, ``_NAME``,
        ``$TOKENFAIR_POD_NAME``, and ``$TOKENFAIR_WEBHOOK_PORT``, ``_ADDR``, ``_HOST``,
        ``_CERT``, ``_KEY``, ``_MANAGED``, ``_CERT_SECRET``, ``_DNS_NAMES``,
        ``_CONFIGURATIONS``, ``_CERT_DIR`` (``env``: ``os.environ`` unless given). Unset or
        empty: the default. A bad value raises ValueError naming its variable."""
        env = os.environ if env is None else env
        hook = WEBHOOK_ENV_PREFIX
        return cls(
            resync_interval_s=_seconds(env, RESYNC_ENV, DEFAULT_RESYNC_S),
            usage_interval_s=_seconds(env, USAGE_ENV, DEFAULT_USAGE_S),
            webhook_port=_port(env, hook + "PORT"),
            webhook_addr=_text(env, hook + "ADDR") or DEFAULT_WEBHOOK_ADDR,
            webhook_host=_text(env, hook + "HOST"),
            webhook_cert=_text(env, hook + "CERT"),
            webhook_key=_text(env, hook + "KEY"),
            webhook_cert_secret=_namespaced(env, hook + "CERT_SECRET"),
            webhook_dns_names=_listed(env, hook + "DNS_NAMES"),
            webhook_configurations=_listed(env, hook + "CONFIGURATIONS"),
            webhook_cert_dir=_text(env, hook + "CERT_DIR") or "/tmp/tokenfair-webhook",
            webhook_managed=_text(env, hook + "MANAGED"),
            injection=injection_from_env(env),
            injection_failure_policy=_failure_policy(env),
            http_port=_port(env, HTTP_PORT_ENV),
            http_addr=_text(env, HTTP_ADDR_ENV) or DEFAULT_WEBHOOK_ADDR,
            https_port=_port(env, HTTPS_PORT_ENV),
            https_cert=_text(env, HTTPS_FILES_ENV["https_cert"]),
            https_key=_text(env, HTTPS_FILES_ENV["https_key"]),
            https_ca=_text(env, HTTPS_FILES_ENV["https_ca"]),
            config_audience=_text(env, CONFIG_AUDIENCE_ENV) or CONFIG_AUDIENCE,
            config_insecure_http=_flag(env, INSECURE_HTTP_ENV),
            http_advertise=_text(env, ADVERTISE_ENV) or _own_address(env),
            leader_election=_flag(env, LEADER_ELECTION_ENV),
            lease_namespace=_text(env, LEASE_NAMESPACE_ENV) or "default",
            lease_name=_text(env, LEASE_NAME_ENV) or "tokenfair-operator",
            identity=f"{_text(env, POD_NAME_ENV) or socket.gethostname()}_{PROCESS_TAG}",
            relay_connections=_count(env, RELAY_CONNECTIONS_ENV, 1_000),
        )


def injection_from_env(env: Mapping[str, str]) -> InjectionSettings:
    """The injected sidecars' defaults from ``env`` (:data:`SIDECAR_ENV`), each checked by the
    injector's own rules; ValueError naming the variable otherwise."""
    given = {name: env.get(var, "").strip() for name, var in SIDECAR_ENV.items()}
    where = {name: f"${var}" for name, var in SIDECAR_ENV.items()}
    defaults = InjectionSettings()
    try:
        settings = InjectionSettings(
            image=env.get(IMAGE_ENV) or DEFAULT_IMAGE,
            cpu_request=given["cpu_request"] or defaults.cpu_request,
            memory_request=given["memory_request"] or defaults.memory_request,
            cpu_limit=given["cpu_limit"] or defaults.cpu_limit,
            memory_limit=given["memory_limit"] or defaults.memory_limit,
            max_in_flight=(
                checked_max_in_flight(given["max_in_flight"], where["max_in_flight"])
                if given["max_in_flight"]
                else defaults.max_in_flight
            ),
            log_level=(
                checked_log_level(given["log_level"], where["log_level"]).lower()
                if given["log_level"]
                else defaults.log_level
            ),
            drain_grace_s=(
                checked_drain_grace_s(given["drain_grace_s"], where["drain_grace_s"])
                if given["drain_grace_s"]
                else defaults.drain_grace_s
            ),
            scrape_annotations=_flag(env, SIDECAR_ENV["scrape_annotations"], default="true"),
            config_url_base=env.get(CONFIG_URL_BASE_ENV) or None,
            config_audience=env.get(CONFIG_AUDIENCE_ENV) or CONFIG_AUDIENCE,
            config_insecure_http=_flag(env, INSECURE_HTTP_ENV),
            env_names=SIDECAR_ENV,
        )
        settings.check()
    except InjectionError as exc:
        raise ValueError(str(exc)) from None
    return settings


def _own_address(env: Mapping[str, str]) -> str:
    """``<this host's IP>:<$TOKENFAIR_HTTPS_PORT>``, else ``<$TOKENFAIR_HTTP_PORT>`` (in a Pod,
    the host name resolves to the Pod's IP); "" without a port. Standbys relay over TLS to
    the TLS port."""
    port = env.get(HTTPS_PORT_ENV) or env.get(HTTP_PORT_ENV)
    if not port:
        return ""
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return f"{host}:{port}"


def _text(env: Mapping[str, str], name: str) -> str | None:
    """``$name`` without surrounding blanks; None when unset or blank."""
    return (env.get(name) or "").strip() or None


def _invalid(name: str, rule: str, value: str) -> ValueError:
    return ValueError(f"${name}: {rule} (got {value!r})")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A number of seconds > 0: the sidecar's rule for its own (``fields.positive``), read from
    the text as the sidecar reads a flag (``fields.flag_number``); ConfigError (a ValueError)
    naming ``$name``."""
    value = _text(env, name)
    return default if value is None else positive(f"${name}", flag_number(value))


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer > 0 (``fields.positive_int``: ``2`` or ``2.0``, never ``2.5``)."""
    value = _text(env, name)
    return default if value is None else positive_int(f"${name}", flag_number(value))


def _port(env: Mapping[str, str], name: str) -> int | None:
    """A TCP port, 1 to 65535; None when unset."""
    value = _text(env, name)
    if value is None:
        return None
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise _invalid(name, "must be a TCP port, 1 to 65535", value)
    return port


def _flag(env: Mapping[str, str], name: str, default: str = "false") -> bool:
    value = _text(env, name) or default
    if value.lower() not in ("true", "false"):
        raise _invalid(name, "must be true or false", value)
    return value.lower() == "true"


def _failure_policy(env: Mapping[str, str]) -> str:
    value = _text(env, INJECTION_POLICY_ENV) or "Fail"
    if value not in FAILURE_POLICIES:
        raise _invalid(INJECTION_POLICY_ENV, f"must be one of {', '.join(FAILURE_POLICIES)}", value)
    return value


def _namespaced(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """``namespace/name`` -> (namespace, name); None when unset."""
    value = _text(env, name)
    if value is None:
        return None
    namespace, slash, rest = value.partition("/")
    if not (namespace and slash and rest) or "/" in rest:
        raise _invalid(name, "must be namespace/name", value)
    return namespace, rest


def _listed(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated list (blanks dropped)."""
    return tuple(item.strip() for item in (_text(env, name) or "").split(",") if item.strip())


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """The diff-base storage of an operator with event handlers only: no essence built.

    Kopf builds the "essence" of the object (a deep copy of it, metadata and status removed) on
    every event, for the diffs of change handlers (``on.create``/``update``/``field``...), even
    when there are none: ~0.2 ms of the event loop per event, 10,000 quotas' listing and their
    10,000 status writes' events ~4 s here. We register event handlers only (Kopf stores nothing
    on our objects), so the essence is never compared nor stored: an empty one does. A change
    handler added later would see no diff at all, hence
    ``tests/operator/test_operator_startup.py`` fails while one is registered."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()


class QuietSuccesses(logging.Filter):
    """Drops Kopf's ``Handler '<id>' succeeded.`` line of the event handlers ``ids``: Kopf
    logs one per watch event at INFO, 10,000 quotas listed and their 10,000 status writes'
    events 20,000 lines saying nothing (a failure still logs its exception), ~0.3 ms of the
    event loop each on the loaded test machine (most of it the write to the log)."""

    def __init__(self, ids: Iterable[str]) -> None:
        super().__init__()
        self.lines = frozenset(f"Handler {handler!r} succeeded." for handler in ids)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg in self.lines)


def quiet_successes(ids: Iterable[str]) -> None:
    """Install :class:`QuietSuccesses` for ``ids`` on Kopf's per-object logger, once."""
    logger = logging.getLogger(KOPF_OBJECTS_LOGGER)
    if not any(isinstance(f, QuietSuccesses) for f in logger.filters):
        logger.addFilter(QuietSuccesses(ids))


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply our choices to Kopf's settings (called once, from the startup hook)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase(prefix=GROUP, key=DIFFBASE_KEY)
    # No Kopf peering (no KopfPeering CRD to install or grant): one replica, or several with
    # our own Lease-based election (.leader), which needs no handler to pause.
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    # The CRDs are installed before the operator (chart order); not watching CRDs and
    # namespaces keeps list/watch on them out of the ClusterRole.
    settings.scanning.disabled = True
    settings.watching.server_timeout = config.watch_server_timeout_s
    settings.watching.client_timeout = config.watch_client_timeout_s
    if config.webhook_port is not None:
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook_addr,
            port=config.webhook_port,
            host=config.webhook_host,
            certfile=config.webhook_cert,
            pkeyfile=config.webhook_key,
            cafile=config.webhook_ca or config.webhook_cert,
        )
        settings.admission.managed = config.webhook_managed
