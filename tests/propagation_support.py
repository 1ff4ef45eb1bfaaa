"""How the tests reach the operator's document server: the TLS settings it is started with, the
CA bundle it publishes, ServiceAccount tokens for the sidecars' audience, plain HTTP(S) GETs, the
stored ConfigMap and the lesson's objects applied until the document is published."""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kubecluster import KubeCluster
from operator_support import (
    LESSON,
    get,
    policy_path,
    wait_for,
)

AUDIENCE = "tokenfair-config"
TRUST_CONFIGMAP = "tokenfair.io-ca.crt"
CERT_SECRET = "tokenfair-serving"


def tls_env(ns: str, port: int, certs: Path) -> dict[str, str]:
    """The document server over TLS on ``127.0.0.1:port`` with the operator's own CA and a
    certificate for ``localhost`` (kept in Secret ``ns/tokenfair-serving``, as the chart's)."""
    return {
        "TOKENFAIR_HTTPS_PORT": str(port),
        "TOKENFAIR_HTTP_ADDR": "127.0.0.1",
        "TOKENFAIR_WEBHOOK_CERT_SECRET": f"{ns}/{CERT_SECRET}",
        "TOKENFAIR_WEBHOOK_DNS_NAMES": "localhost",
        "TOKENFAIR_WEBHOOK_CERT_DIR": str(certs),
    }


def published_ca(cluster: KubeCluster, ns: str, folder: Path) -> Path:
    """The CA bundle the operator published into ``ns`` (what the kubelet would project), in
    a file."""

    def bundle() -> str | None:
        configmap = get(cluster, f"/api/v1/namespaces/{ns}/configmaps/{TRUST_CONFIGMAP}")
        found = (configmap or {}).get("data", {}).get("ca.crt")
        return str(found) if found else None

    path = folder / f"{ns}-ca.crt"
    path.write_text(wait_for("the CA bundle published", bundle))
    return path


def audience_token(
    cluster: KubeCluster, ns: str, name: str, audiences: list[str] | None = None
) -> str:
    """A TokenRequest token of ServiceAccount ``ns/name`` for ``audiences`` (default: the
    document server's, as the injector projects it; ``[]``: the API server's own)."""
    spec: dict[str, Any] = {"expirationSeconds": 600}
    spec["audiences"] = [AUDIENCE] if audiences is None else audiences
    path = f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token"
    token = cluster.expect(201, "POST", path, {"spec": spec}).body["status"]["token"]
    assert isinstance(token, str)
    return token


def token_file(cluster: KubeCluster, ns: str, name: str, folder: Path) -> Path:
    """A token of a new ServiceAccount ``ns/name`` for the document server's audience, in a
    file (as projected)."""
    cluster.create_service_account(ns, name)
    path = folder / f"{ns}-{name}.token"
    path.write_text(audience_token(cluster, ns, name))
    return path


def http_get(
    url: str, token: str | None = None, ca: Path | None = None
) -> tuple[int, dict[str, str], bytes]:
    """GET ``url`` (over TLS verified with ``ca`` when given)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ca is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca)))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, headers=headers)
    try:
        with opener.open(request, timeout=70) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


def stored_configmap(cluster: KubeCluster, ns: str) -> bytes:
    configmap = get(cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
    assert configmap is not None
    if "config.yaml" in configmap.get("data", {}):
        return str(configmap["data"]["config.yaml"]).encode()
    return base64.b64decode(configmap["binaryData"]["config.yaml"])


def apply_lesson_and_wait(cluster: KubeCluster, ns: str) -> str:
    cluster.kubectl("apply", "-n", ns, "-f", str(LESSON))

    def version() -> str | None:
        policy = get(cluster, policy_path(ns))
        status = (policy or {}).get("status", {})
        return status.get("configVersion") if status.get("tenants") == 3 else None

    return wait_for("3 tenants published", version)


def long_poll_env(base: str, ns: str, token: Path, ca: Path) -> dict[str, str]:
    return {
        "TOKENFAIR_CONFIG_URL": f"{base}/v1/config/{ns}/pool?source=configmap",
        "TOKENFAIR_CONFIG_TOKEN_FILE": str(token),
        "TOKENFAIR_CONFIG_CA_FILE": str(ca),
    }
