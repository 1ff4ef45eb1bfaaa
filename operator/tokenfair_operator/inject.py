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
* with ``config_url_base`` (the operator's document server): the long-poll URL of the same
  document in ``$TOKENFAIR_CONFIG_URL`` and a projected ServiceAccount token (volume
  ``tokenfair-token``) to show the operator; the mounted file stays the fallback;
* with the policy's ``spec.budgetStore.redis.secretRef``: ``$TOKENFAIR_BUDGET_STORE_PASSWORD``
  from that Secret key (the rendered config names that variable as the store's ``passwordEnv``).
  Optional: a missing Secret leaves the variable unset, the store refuses the sidecar, and the
  sidecar serves on the 1/n split and reports it (``docs/pool.md``) rather than not starting.

Idempotent: a Pod that already has the container is returned unchanged (``None``), so
re-applying, re-invocation and dry runs never inject twice.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .model import GROUP, configmap_name, secret_name
from .render import PASSWORD_ENV

POLICY_LABEL: Final = f"{GROUP}/policy"
UPSTREAM_PORT_ANNOTATION: Final = f"{GROUP}/upstream-port"
CONFIG_SOURCE_ANNOTATION: Final = f"{GROUP}/config-source"
ADMIN_PORT_ANNOTATION: Final = f"{GROUP}/admin-port"
"""Read by the usage scraper: where a sidecar's admin listener is when not on 9090."""
CONTAINER: Final = "tokenfair-sidecar"
VOLUME: Final = "tokenfair-config"
MOUNT_PATH: Final = "/etc/tokenfair"
PROXY_PORT: Final = 8080
ADMIN_PORT: Final = 9090
DEFAULT_UPSTREAM_PORT: Final = 8000
DEFAULT_IMAGE: Final = "tokenfair/tokenfair:0.1.0"
TOKEN_VOLUME: Final = "tokenfair-token"
TOKEN_MOUNT_PATH: Final = "/var/run/secrets/tokenfair"
TOKEN_EXPIRATION_S: Final = 3600
"""Lifetime of the projected token; the kubelet renews it at 80 %, the sidecar rereads it."""


@dataclass(frozen=True, slots=True)
class InjectionSettings:
    """What every injected sidecar shares."""

    image: str = DEFAULT_IMAGE
    """Container image holding the ``tokenfair`` command (the chart sets its own tag)."""
    cpu_request: str = "100m"
    memory_request: str = "128Mi"
    memory_limit: str = "512Mi"
    """Bounded: the sidecar's queues are bounded, so its memory is too."""
    config_url_base: str | None = None
    """``http://<operator Service>:<port>`` of the operator's document server
    (``$TOKENFAIR_CONFIG_URL_BASE``): the sidecar long-polls its policy's document there
    (< 2 s from apply to enforced) and keeps the mounted file as the fallback. None: the file
    alone (the kubelet refreshes it in ~60 s)."""


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


class InjectionError(ValueError):
    """The Pod cannot take the sidecar (the message says why)."""


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
    sidecar = _container(settings, upstream)
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
        added.append(_token_volume())
    if env:
        sidecar["env"] = env
    return {"containers": [sidecar, *containers], "volumes": [*volumes, *added]}


def _long_poll_env(base: str, policy: str, source: str) -> list[dict[str, Any]]:
    """The sidecar's long-poll URL (``tokenfair_sidecar.server.remote``): the Pod's namespace
    comes from the downward API and is expanded by the kubelet (``$(VAR)``), since a Pod being
    created may not carry ``metadata.namespace`` in the admission request."""
    return [
        {
            "name": "TOKENFAIR_POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        {
            "name": "TOKENFAIR_CONFIG_URL",
            "value": f"{base.rstrip('/')}/v1/config/$(TOKENFAIR_POD_NAMESPACE)/{policy}"
            f"?source={source}",
        },
        {"name": "TOKENFAIR_CONFIG_TOKEN_FILE", "value": f"{TOKEN_MOUNT_PATH}/token"},
    ]


def _token_volume() -> dict[str, Any]:
    """The Pod's ServiceAccount token for the operator's TokenReview, projected (rotated by the
    kubelet) so it works whatever ``automountServiceAccountToken`` says."""
    token = {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_S}
    return {"name": TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": token}]}}


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


def _container(settings: InjectionSettings, upstream_port: int) -> dict[str, Any]:
    return {
        "name": CONTAINER,
        "image": settings.image,
        "command": ["tokenfair"],
        "args": [
            "sidecar",
            f"--config={MOUNT_PATH}/config.yaml",
            f"--listen=0.0.0.0:{PROXY_PORT}",
            f"--admin-listen=0.0.0.0:{ADMIN_PORT}",
            "--backend=openai",
            f"--upstream=http://127.0.0.1:{upstream_port}",
        ],
        "ports": [
            {"name": "tokenfair", "containerPort": PROXY_PORT, "protocol": "TCP"},
            {"name": "tokenfair-admin", "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": _probe("/healthz"),
        "readinessProbe": _probe("/readyz"),
        "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}],
        "resources": {
            "requests": {"cpu": settings.cpu_request, "memory": settings.memory_request},
            "limits": {"memory": settings.memory_limit},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
