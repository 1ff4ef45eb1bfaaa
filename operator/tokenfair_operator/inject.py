"""Sidecar injection: the containers and volumes a labelled Pod gets (pure; the mutating webhook
in :mod:`.handlers` applies them).

A Pod labelled ``tokenfair.io/policy: <name>`` gets, once:

* container ``tokenfair-sidecar`` (first in the list, so it is up before the model server takes
  traffic) running ``tokenfair sidecar`` with the ``openai`` backend against the model server on
  ``127.0.0.1:<upstream port>`` (annotation ``tokenfair.io/upstream-port``, default 8000, vLLM's),
  proxy port 8080 (``tokenfair``), admin port 9090 (``tokenfair-admin``), liveness ``/healthz`` and
  readiness ``/readyz`` on the admin port, a locked-down security context;
* volume ``tokenfair-config``: the policy's Secret ``tokenfair-<policy>-keys`` (the document with
  API-key digests), or its ConfigMap ``tokenfair-<policy>`` with annotation
  ``tokenfair.io/config-source: configmap`` (tenants named by a trusted header, no keys);
* with ``config_url_base`` (the operator's document server, ``https://``): the long-poll URL
  of the same document in ``$TOKENFAIR_CONFIG_URL``, and one projected volume
  ``tokenfair-token`` at :data:`TOKEN_MOUNT_PATH` holding a ServiceAccount token for audience
  ``config_audience`` only (``tokenfair-config``; valid :data:`TOKEN_EXPIRATION_S`, the
  kubelet renews it) and the operator's CA bundle from ConfigMap :data:`TRUST_CONFIGMAP` of
  the Pod's namespace (``ca.crt``, optional: the operator writes it, :mod:`.serving_tls`), which
  the sidecar verifies the server with; the mounted file stays the fallback. A plain
  ``http://`` base only with ``config_insecure_http`` (unsafe: the token and the document
  travel in clear; the sidecar is told so with ``$TOKENFAIR_CONFIG_INSECURE_HTTP``);
* with the policy's ``spec.budgetStore.redis.secretRef``: ``$TOKENFAIR_BUDGET_STORE_PASSWORD``
  from that Secret key (the rendered config names that variable as the store's ``passwordEnv``).
  Optional: a missing Secret leaves the variable unset, the store refuses the sidecar, and the
  sidecar serves on the 1/n split and reports it (``docs/pool.md``) rather than not starting.

Per-Pod overrides (annotations, as Istio's ``sidecar.istio.io/proxyCPU`` & co.), each checked
with an error naming the annotation and the rule (the webhook then refuses the Pod with it):

=====================================================  ==========================================
``tokenfair.io/sidecar-cpu`` / ``-memory``             requests (a positive Kubernetes quantity)
``tokenfair.io/sidecar-cpu-limit`` / ``-memory-limit``  limits (a quantity, never below the request)
``tokenfair.io/sidecar-max-in-flight``                 ``--max-in-flight`` (integer 1..100000)
``tokenfair.io/sidecar-log-level``                     ``--log-level`` (debug, info, warning, error)
``tokenfair.io/sidecar-drain-grace-seconds``           ``--drain-grace`` (> 0, at most the Pod's
                                                       ``terminationGracePeriodSeconds``, 30)
=====================================================  ==========================================

Any other ``tokenfair.io/sidecar-*`` annotation is refused (a typo would otherwise be silently
ignored). Unset ones take :class:`InjectionSettings` (the operator's environment, i.e. the chart's
``sidecar.*`` values). An injected Pod also gets the Prometheus scrape annotations for the
sidecar's admin port (:func:`scrape_annotations`) unless it sets any of them itself.

Idempotent: a Pod that already has the container is returned unchanged (``None``), so
re-applying, re-invocation and dry runs never inject twice.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from tokenfair.config import ConfigError
from tokenfair.config.fields import Parser, flag_number, in_flight_limit, positive
from tokenfair.config.wire import (
    CA_FILE_ENV,
    CONFIG_FILE,
    INSECURE_HTTP_ENV,
    SOURCE_PARAM,
    TOKEN_FILE_ENV,
    URL_ENV,
)

from .render import PASSWORD_ENV
from .views import GROUP, configmap_name, secret_name

POLICY_LABEL: Final = f"{GROUP}/policy"
UPSTREAM_PORT_ANNOTATION: Final = f"{GROUP}/upstream-port"
CONFIG_SOURCE_ANNOTATION: Final = f"{GROUP}/config-source"
ADMIN_PORT_ANNOTATION: Final = f"{GROUP}/admin-port"
"""Read by the usage scraper: where a sidecar's admin listener is when not on 9090."""
SIDECAR_ANNOTATION_PREFIX: Final = f"{GROUP}/sidecar-"
CPU_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}cpu"
MEMORY_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}memory"
CPU_LIMIT_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}cpu-limit"
MEMORY_LIMIT_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}memory-limit"
MAX_IN_FLIGHT_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}max-in-flight"
LOG_LEVEL_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}log-level"
DRAIN_GRACE_ANNOTATION: Final = f"{SIDECAR_ANNOTATION_PREFIX}drain-grace-seconds"
SIDECAR_ANNOTATIONS: Final = (
    CPU_ANNOTATION,
    MEMORY_ANNOTATION,
    CPU_LIMIT_ANNOTATION,
    MEMORY_LIMIT_ANNOTATION,
    MAX_IN_FLIGHT_ANNOTATION,
    LOG_LEVEL_ANNOTATION,
    DRAIN_GRACE_ANNOTATION,
)
SCRAPE_ANNOTATIONS: Final = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
"""The de-facto Pod scrape convention (Prometheus' ``kubernetes_sd`` example relabelling, the
community chart's ``kubernetes-pods`` job): one port per Pod, so a Pod that names any of them
keeps its own choice."""
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
DEFAULT_TERMINATION_GRACE_S: Final = 30
CONTAINER: Final = "tokenfair-sidecar"
VOLUME: Final = "tokenfair-config"
MOUNT_PATH: Final = "/etc/tokenfair"
PROXY_PORT: Final = 8080
ADMIN_PORT: Final = 9090
METRICS_PATH: Final = "/metrics"
DEFAULT_UPSTREAM_PORT: Final = 8000
DEFAULT_IMAGE: Final = "tokenfair/tokenfair:0.1.0"
TOKEN_VOLUME: Final = "tokenfair-token"
TOKEN_MOUNT_PATH: Final = "/var/run/secrets/tokenfair"
TOKEN_EXPIRATION_S: Final = 600
"""Lifetime of the projected token, the API server's minimum: a token that leaks is good for
10 minutes and only to the document server (its audience). The kubelet renews it at 80 % and
the sidecar rereads it for each request."""
CONFIG_AUDIENCE: Final = "tokenfair-config"
"""The projected token's audience; the document server's TokenReview asks for exactly it, so
the token is refused by the API server and by anything else that checks audiences."""
TRUST_CONFIGMAP: Final = "tokenfair.io-ca.crt"
"""ConfigMap (key ``ca.crt``) with the operator's CA bundle in each namespace with a policy. Its
name has a dot where the policies' ConfigMaps (``tokenfair-<policy>``) have a dash: no policy
name can produce it."""
CA_FILE: Final = "ca.crt"

# A Kubernetes resource quantity (k8s.io/apimachinery resource.Quantity): a decimal number
# with a binary (Ki..Ei) or decimal (m, k, M..E) suffix, or an exponent.
_QUANTITY = re.compile(
    r"^(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
_SCALE: Final = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


class InjectionError(ValueError):
    """The Pod cannot take the sidecar (the message says why)."""


MAX_QUANTITY: Final = Decimal(2**63 - 1)
"""The largest quantity taken (the API server stores quantities in an int64 of their unit)."""


def quantity(value: object, where: str) -> Decimal:
    """The value of a positive Kubernetes quantity (``250m``, ``1``, ``256Mi``, ``1e9``);
    InjectionError naming ``where`` otherwise."""
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is not None:
        suffix = match["suffix"] or ""
        try:
            number = Decimal(match["number"])
            scaled = number * _SCALE[suffix] if suffix in _SCALE else Decimal(text)
        except InvalidOperation:
            scaled = Decimal(0)
        if 0 < scaled <= MAX_QUANTITY:
            return scaled
    raise InjectionError(
        f"{where}: must be a positive Kubernetes quantity of at most 2^63-1 such as 250m or 1 "
        f"(CPU), 256Mi or 1Gi (memory) (got {value!r})"
    )


@dataclass(frozen=True, slots=True)
class InjectionSettings:
    """What every injected sidecar gets unless its Pod's annotations say otherwise; the
    operator reads them from its environment (:meth:`.settings.OperatorConfig.from_env`, the
    chart's ``sidecar.*`` values)."""

    image: str = DEFAULT_IMAGE
    """Container image holding the ``tokenfair`` command (the chart sets its own tag)."""
    cpu_request: str = "100m"
    """CPU the scheduler reserves: admission and proxying cost little next to a model server."""
    memory_request: str = "128Mi"
    """Memory the scheduler reserves: the sidecar's steady state with a few thousand tenants."""
    cpu_limit: str | None = None
    """No CPU limit by default: throttling would add latency to every proxied request."""
    memory_limit: str = "512Mi"
    """Bounded: the sidecar's queues are bounded, so its memory is too."""
    max_in_flight: int | None = None
    """``--max-in-flight``, requests the backend runs at once; None: the backend's default (64
    for an OpenAI-compatible upstream)."""
    log_level: str = "info"
    """``--log-level`` of the sidecar (debug, info, warning, error)."""
    drain_grace_s: float | None = None
    """``--drain-grace`` seconds for in-flight requests on SIGTERM; None: the sidecar's 30 s,
    the Pod's default ``terminationGracePeriodSeconds``."""
    scrape_annotations: bool = True
    """Add ``prometheus.io/scrape|port|path`` for the admin port's ``/metrics`` to injected Pods
    that set none of them."""
    config_url_base: str | None = None
    """``http://<operator Service>:<port>`` of the operator's document server
    (``$TOKENFAIR_CONFIG_URL_BASE``): the sidecar long-polls its policy's document there
    (< 2 s from apply to enforced) and keeps the mounted file as the fallback. None: the file
    alone (the kubelet refreshes it in ~60 s). ``https://`` unless ``config_insecure_http``."""
    config_audience: str = CONFIG_AUDIENCE
    """Audience of the projected token (``$TOKENFAIR_CONFIG_AUDIENCE``): the document server's
    TokenReview asks for the same one."""
    config_insecure_http: bool = False
    """Allow an ``http://`` ``config_url_base`` (``$TOKENFAIR_CONFIG_INSECURE_HTTP=true``):
    unsafe, for a local operator in tests only; the token and the document go in clear."""
    env_names: Mapping[str, str] = field(default_factory=dict)
    """Where each field came from (field name -> environment variable), for error messages:
    a bad default is reported under its variable, not under an annotation the Pod lacks."""

    def check(self) -> None:
        """Raise InjectionError (naming the variable) if a default breaks its rule."""
        sidecar_runtime(self, {}, None)
        base = self.config_url_base
        plain_allowed = (
            base is not None and base.startswith("http://") and self.config_insecure_http
        )
        if base is not None and not base.startswith("https://") and not plain_allowed:
            raise InjectionError(
                "$TOKENFAIR_CONFIG_URL_BASE: the document server's URL must be https:// "
                f"(got {base[:80]!r}); "
                "http:// only with $TOKENFAIR_CONFIG_INSECURE_HTTP=true (unsafe)"
            )


@dataclass(frozen=True, slots=True)
class SidecarRuntime:
    """The resolved resources and flags of one injected sidecar."""

    resources: dict[str, dict[str, str]]
    args: tuple[str, ...]


def _source(settings: InjectionSettings, field_name: str, annotation: str, pod: bool) -> str:
    if pod:
        return f"metadata.annotations[{annotation}]"
    variable = settings.env_names.get(field_name)
    return f"${variable}" if variable else f"InjectionSettings.{field_name}"


def sidecar_runtime(
    settings: InjectionSettings, annotations: Mapping[str, str], pod_spec: Mapping[str, Any] | None
) -> SidecarRuntime:
    """Resources and runtime flags: each annotation if the Pod sets it, else the setting;
    checked, with errors naming the annotation (or the variable of a bad default)."""
    unknown = sorted(
        k
        for k in annotations
        if k.startswith(SIDECAR_ANNOTATION_PREFIX) and k not in SIDECAR_ANNOTATIONS
    )
    if unknown:
        raise InjectionError(
            f"metadata.annotations[{unknown[0]}]: unknown tokenfair sidecar annotation (known: "
            f"{', '.join(SIDECAR_ANNOTATIONS)})"
        )

    def pick(field_name: str, annotation: str) -> tuple[Any, str]:
        if annotation in annotations:
            return annotations[annotation], _source(settings, field_name, annotation, True)
        return getattr(settings, field_name), _source(settings, field_name, annotation, False)

    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    for kind, request_field, limit_field, request_key, limit_key in (
        ("cpu", "cpu_request", "cpu_limit", CPU_ANNOTATION, CPU_LIMIT_ANNOTATION),
        ("memory", "memory_request", "memory_limit", MEMORY_ANNOTATION, MEMORY_LIMIT_ANNOTATION),
    ):
        request, request_where = pick(request_field, request_key)
        limit, limit_where = pick(limit_field, limit_key)
        low = _set_quantity(resources["requests"], kind, request, request_where)
        high = _set_quantity(resources["limits"], kind, limit, limit_where)
        if low is not None and high is not None and low > high:
            raise InjectionError(
                f"{request_where}: the {kind} request {request!s} is above the {kind} limit "
                f"{limit!s} ({limit_where}); raise the limit with {limit_key} or lower the request"
            )
    resources = {k: v for k, v in resources.items() if v}
    args = [f"--log-level={checked_log_level(*pick('log_level', LOG_LEVEL_ANNOTATION))}"]
    max_in_flight, where = pick("max_in_flight", MAX_IN_FLIGHT_ANNOTATION)
    if max_in_flight is not None:
        args.append(f"--max-in-flight={checked_max_in_flight(max_in_flight, where)}")
    grace, where = pick("drain_grace_s", DRAIN_GRACE_ANNOTATION)
    if grace is not None:
        args.append(f"--drain-grace={checked_drain_grace_s(grace, where, pod_spec):g}")
    elif pod_spec is not None:  # the sidecar's own 30 s may not fit in the Pod's grace
        args.append(f"--drain-grace={fitting_drain_grace_s(pod_spec):g}")
    return SidecarRuntime(resources, tuple(args))


def _set_quantity(target: dict[str, str], kind: str, value: object, where: str) -> Decimal | None:
    """Check ``value`` (None or empty: unset) and put it in ``target[kind]``; its amount."""
    if value is None or str(value).strip() == "":
        return None
    amount = quantity(value, where)
    target[kind] = str(value).strip()
    return amount


def checked_log_level(value: object, where: str) -> str:
    """``value`` as the sidecar's ``--log-level`` (upper case); InjectionError naming ``where``."""
    level = str(value).strip().lower()
    if level not in LOG_LEVELS:
        raise InjectionError(f"{where}: must be one of {', '.join(LOG_LEVELS)} (got {value!r})")
    return level.upper()


def _sidecar_value(parse: Parser, value: object, where: str) -> Any:
    """``value`` (an annotation's or a setting's text) read as the sidecar reads the flag it
    becomes (:func:`tokenfair.config.fields.flag_number`, then the key's parser: one rule on
    both sides); InjectionError naming ``where``."""
    try:
        return parse(where, flag_number(str(value).strip()))
    except ConfigError as exc:
        raise InjectionError(str(exc)) from None


def checked_max_in_flight(value: object, where: str) -> int:
    """``value`` as ``--max-in-flight`` (the sidecar's ``maxInFlight`` rule,
    :data:`tokenfair.config.fields.in_flight_limit`: the requests the backend runs at once);
    InjectionError naming ``where``."""
    return int(_sidecar_value(in_flight_limit, value, where))


DRAIN_EXIT_MARGIN_S: Final = 3.0
"""Seconds a draining sidecar needs after its grace: 1 s for the handlers it cancels to end
(the sidecar's ``SHUTDOWN_AFTER_GRACE_S``), then its records flushed and its exit."""
SIDECAR_DRAIN_GRACE_S: Final = 30.0
"""The sidecar's own default drain grace (``--drain-grace``)."""


def checked_drain_grace_s(
    value: object, where: str, pod_spec: Mapping[str, Any] | None = None
) -> float:
    """``value`` as ``--drain-grace`` seconds (InjectionError naming ``where``): longer than the
    Pod's grace period (when given) is refused; within it but without
    :data:`DRAIN_EXIT_MARGIN_S` to spare, it is shortened to leave them (a Pod valid before the
    margin existed is still admitted: refusing it would stop its rollout)."""
    seconds = float(_sidecar_value(positive, value, where))  # the sidecar's drainGraceSeconds
    if pod_spec is not None:
        period = _termination_grace_s(pod_spec)
        if seconds > period:
            raise InjectionError(
                f"{where}: {seconds:g} s is longer than the Pod's "
                f"spec.terminationGracePeriodSeconds ({period}): the kubelet would kill the "
                "sidecar before its drain ends"
            )
        seconds = min(seconds, _leaving_margin(period))
    return seconds


def fitting_drain_grace_s(pod_spec: Mapping[str, Any]) -> float:
    """The drain grace given when nothing sets one: the sidecar's own default
    (:data:`SIDECAR_DRAIN_GRACE_S`), shortened to fit the Pod's grace period with
    :data:`DRAIN_EXIT_MARGIN_S` to spare."""
    return min(SIDECAR_DRAIN_GRACE_S, _leaving_margin(_termination_grace_s(pod_spec)))


def _leaving_margin(period: int) -> float:
    """The longest drain that leaves :data:`DRAIN_EXIT_MARGIN_S` of a ``period`` s grace for the
    sidecar's exit; a grace too short for that gets a quarter of it (at least 0.1 s)."""
    if period - DRAIN_EXIT_MARGIN_S >= 1.0:
        return period - DRAIN_EXIT_MARGIN_S
    return max(0.1, period / 4)


def _termination_grace_s(pod_spec: Mapping[str, Any]) -> int:
    grace = pod_spec.get("terminationGracePeriodSeconds")
    return DEFAULT_TERMINATION_GRACE_S if grace is None else int(grace)


@dataclass(frozen=True, slots=True)
class SecretKey:
    """One key of a Secret in the Pod's namespace."""

    name: str
    key: str


def store_password_key(policy_spec: Mapping[str, Any]) -> SecretKey | None:
    """``spec.budgetStore.redis.secretRef`` of a SchedulingPolicy (key ``password`` by
    default, as the CRD defaults it), or None."""
    store = policy_spec.get("budgetStore")
    redis = store.get("redis") if isinstance(store, Mapping) else None
    ref = redis.get("secretRef") if isinstance(redis, Mapping) else None
    if not isinstance(ref, Mapping) or not ref.get("name"):
        return None
    return SecretKey(str(ref["name"]), str(ref.get("key") or "password"))


def scrape_annotations(pod: Mapping[str, Any], settings: InjectionSettings) -> dict[str, str]:
    """The Prometheus scrape annotations for the injected sidecar's admin port, or ``{}`` when
    turned off or when the Pod names any of them itself (its owner chose what to scrape)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if not settings.scrape_annotations or any(k in annotations for k in SCRAPE_ANNOTATIONS):
        return {}
    return dict(zip(SCRAPE_ANNOTATIONS, ("true", str(ADMIN_PORT), METRICS_PATH), strict=True))


def injected(
    pod: Mapping[str, Any],
    settings: InjectionSettings,
    store_password: SecretKey | None = None,
) -> dict[str, list[dict[str, Any]]] | None:
    """New ``spec.containers`` and ``spec.volumes`` for ``pod``, or None if nothing to do.
    ``store_password``: the Secret key of the policy's budget-store password, if it names one."""
    meta = pod.get("metadata", {})
    policy = (meta.get("labels") or {}).get(POLICY_LABEL)
    spec = pod.get("spec", {})
    containers = [copy.deepcopy(dict(c)) for c in spec.get("containers", [])]
    if not policy or any(c.get("name") == CONTAINER for c in containers):
        return None
    volumes = [copy.deepcopy(dict(v)) for v in spec.get("volumes") or []]
    for reserved in (VOLUME, TOKEN_VOLUME):
        if any(v.get("name") == reserved for v in volumes):
            raise InjectionError(f"spec.volumes: the name {reserved!r} is reserved for tokenfair")
    annotations = meta.get("annotations") or {}
    upstream = _port(annotations.get(UPSTREAM_PORT_ANNOTATION, DEFAULT_UPSTREAM_PORT))
    taken = {p.get("containerPort") for c in containers for p in c.get("ports") or []}
    if taken & {PROXY_PORT, ADMIN_PORT}:
        raise InjectionError(f"ports {PROXY_PORT} and {ADMIN_PORT} are reserved for tokenfair")
    source = annotations.get(CONFIG_SOURCE_ANNOTATION, "secret")
    if source == "configmap":
        volume = {"name": VOLUME, "configMap": {"name": configmap_name(policy)}}
    elif source == "secret":
        volume = {"name": VOLUME, "secret": {"secretName": secret_name(policy)}}
    else:
        raise InjectionError(
            f"metadata.annotations[{CONFIG_SOURCE_ANNOTATION}]: must be secret or configmap "
            f"(got {source!r})"
        )
    runtime = sidecar_runtime(settings, annotations, spec)
    sidecar = _container(settings, upstream, runtime)
    added = [volume]
    env: list[dict[str, Any]] = []
    if store_password is not None:
        secret_ref = {"name": store_password.name, "key": store_password.key, "optional": True}
        env.append({"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": secret_ref}})
    if settings.config_url_base is not None:
        env += _long_poll_env(settings.config_url_base, policy, source)
        sidecar["volumeMounts"].append(
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT_PATH, "readOnly": True}
        )
        added.append(_token_volume(settings.config_audience))
    if env:
        sidecar["env"] = env
    return {"containers": [sidecar, *containers], "volumes": [*volumes, *added]}


def _long_poll_env(base: str, policy: str, source: str) -> list[dict[str, Any]]:
    """The sidecar's long-poll URL (``tokenfair.server.config_feed``; the names both sides use are
    ``tokenfair.config.wire``'s): the Pod's namespace comes from the downward API and is
    expanded by the kubelet (``$(VAR)``), since a Pod being created may not carry
    ``metadata.namespace`` in the admission request. Over TLS, the CA bundle to verify the
    server with; over plain HTTP (unsafe), the sidecar's consent."""
    transport = (
        {"name": CA_FILE_ENV, "value": f"{TOKEN_MOUNT_PATH}/{CA_FILE}"}
        if base.startswith("https://")
        else {"name": INSECURE_HTTP_ENV, "value": "true"}
    )
    return [
        {
            "name": "TOKENFAIR_POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        {
            "name": URL_ENV,
            "value": f"{base.rstrip('/')}/v1/config/$(TOKENFAIR_POD_NAMESPACE)/{policy}"
            f"?{SOURCE_PARAM}={source}",
        },
        {"name": TOKEN_FILE_ENV, "value": f"{TOKEN_MOUNT_PATH}/token"},
        transport,
    ]


def _token_volume(audience: str) -> dict[str, Any]:
    """The Pod's ServiceAccount token for the operator's TokenReview, for ``audience`` only,
    projected (rotated by the kubelet) so it works whatever ``automountServiceAccountToken``
    says; beside it the operator's CA bundle (as ``kube-api-access-*`` carries the API
    server's), optional so a Pod created before the operator wrote it still starts (the file
    alone serves it until the kubelet's next refresh)."""
    token = {"path": "token", "audience": audience, "expirationSeconds": TOKEN_EXPIRATION_S}
    items = [{"key": CA_FILE, "path": CA_FILE}]
    trust = {"name": TRUST_CONFIGMAP, "optional": True, "items": items}
    sources = [{"serviceAccountToken": token}, {"configMap": trust}]
    return {"name": TOKEN_VOLUME, "projected": {"sources": sources}}


def _port(value: object) -> int:
    try:
        port = int(str(value))
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise InjectionError(
            f"metadata.annotations[{UPSTREAM_PORT_ANNOTATION}]: must be a port 1..65535 "
            f"(got {value!r})"
        )
    return port


def _probe(path: str) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "tokenfair-admin"},
        "periodSeconds": 5,
        "timeoutSeconds": 2,
    }


def _container(
    settings: InjectionSettings, upstream_port: int, runtime: SidecarRuntime
) -> dict[str, Any]:
    return {
        "name": CONTAINER,
        "image": settings.image,
        "command": ["tokenfair"],
        "args": [
            "sidecar",
            f"--config={MOUNT_PATH}/{CONFIG_FILE}",
            f"--listen=0.0.0.0:{PROXY_PORT}",
            f"--admin-listen=0.0.0.0:{ADMIN_PORT}",
            "--backend=openai",
            f"--upstream=http://127.0.0.1:{upstream_port}",
            *runtime.args,
        ],
        "ports": [
            {"name": "tokenfair", "containerPort": PROXY_PORT, "protocol": "TCP"},
            {"name": "tokenfair-admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": _probe("/healthz"),
        "readinessProbe": _probe("/readyz"),
        "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}],
        "resources": runtime.resources,
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},  # the restricted Pod Security Standard
        },
    }
