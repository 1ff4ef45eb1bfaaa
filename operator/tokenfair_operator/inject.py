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
  ``tokenfair.io/config-source: configmap`` (tenants named by a trusted header, no keys).

Idempotent: a Pod that already has the container is returned unchanged (``None``), so
re-applying, re-invocation and dry runs never inject twice.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .model import GROUP, configmap_name, secret_name

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


@dataclass(frozen=True, slots=True)
class InjectionSettings:
    """What every injected sidecar shares."""

    image: str = DEFAULT_IMAGE
    """Container image holding the ``tokenfair`` command (the chart sets its own tag)."""
    cpu_request: str = "100m"
    memory_request: str = "128Mi"
    memory_limit: str = "512Mi"
    """Bounded: the sidecar's queues are bounded, so its memory is too."""


class InjectionError(ValueError):
    """The Pod cannot take the sidecar (the message says why)."""


def injected(
    pod: Mapping[str, Any], settings: InjectionSettings
) -> dict[str, list[dict[str, Any]]] | None:
    """New ``spec.containers`` and ``spec.volumes`` for ``pod``, or None if nothing to do."""
    meta = pod.get("metadata", {})
    policy = (meta.get("labels") or {}).get(POLICY_LABEL)
    spec = pod.get("spec", {})
    containers = [copy.deepcopy(dict(c)) for c in spec.get("containers", [])]
    if not policy or any(c.get("name") == CONTAINER for c in containers):
        return None
    volumes = [copy.deepcopy(dict(v)) for v in spec.get("volumes") or []]
    if any(v.get("name") == VOLUME for v in volumes):
        raise InjectionError(f"spec.volumes: the name {VOLUME!r} is reserved for tokenfair")
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
    return {
        "containers": [_container(settings, upstream), *containers],
        "volumes": [*volumes, volume],
    }


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
