"""The operator under test against a real control plane, for every test module that needs it.

Runs ``kopf run -m tokenfair_operator.handlers`` as a child process with the RBAC it ships
(:func:`start_operator`, :func:`running_operator`; the fixtures :func:`operator_kubeconfig` and
:func:`webhook_operator`), and reads and writes the cluster's objects the way the tests check
them: REST paths of the CRDs, their conditions, the published document parsed by the sidecar's
loader, Warning Events, an admin API client, and polling with a deadline (:func:`wait_for`).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubecluster import KubeCluster, stop_process
from kubernetes import client
from loopback_support import free_ports
from repo_paths import REPO_ROOT, TEST_DATA

from tokenfair.config import (
    Config,
    parse_documents,
)

RBAC = REPO_ROOT / "operator" / "rbac"
LESSON = TEST_DATA / "operator" / "lesson-tenants.yaml"
API = "/apis/tokenfair.io/v1alpha1"
OPERATOR_NAMESPACE = "tokenfair-system"
# Generous for a loaded 2-core machine; a pass takes well under a second (docs/operator.md).
WAIT_S = 30.0
RESYNC_S = "1"
USAGE_S = "1"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = WAIT_S) -> T:
    """Poll ``probe`` every 0.1 s until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def log_shows(log_path: Path, text: str, timeout_s: float = WAIT_S) -> str:
    """The operator's log once it holds ``text`` (its whole text). An operator logs what it
    did after the API server answered, so a test that saw the effect through the API may
    read the log before the line is there: wait for it, never read it once."""

    def holding() -> str | None:
        found = log_path.read_text(errors="replace")
        return found if text in found else None

    return wait_for(f"{text!r} in {log_path.name}", holding, timeout_s)


def shipped_rbac_kubeconfig(cluster: KubeCluster, path: Path) -> Path:
    """The shipped ServiceAccount, ClusterRole and ClusterRoleBinding applied as they are, and a
    kubeconfig at ``path`` holding a token of that ServiceAccount."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    for name in ("serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml"):
        cluster.kubectl("apply", "-f", str(RBAC / name))
    token = cluster.service_account_token(OPERATOR_NAMESPACE, "tokenfair-operator")
    return cluster.write_kubeconfig(path, token, user="tokenfair-operator")


@pytest.fixture(scope="module")
def operator_kubeconfig(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """:func:`shipped_rbac_kubeconfig`, once per test module."""
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    return shipped_rbac_kubeconfig(kube_cluster, path)


def start_operator(
    kubeconfig: Path, namespace: str, log_path: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """``kopf run -m tokenfair_operator.handlers --namespace <ns>`` as a child process in its
    own session, its output in ``log_path``, the test's short resync and usage periods."""
    full_env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "TOKENFAIR_RESYNC_SECONDS": RESYNC_S,
        "TOKENFAIR_USAGE_SECONDS": USAGE_S,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **env,
    }
    cmd = [sys.executable, "-m", "kopf", "run", "-m", "tokenfair_operator.handlers"]
    cmd += ["--namespace", namespace, "--standalone"]
    with log_path.open("wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )


@contextlib.contextmanager
def running_operator(
    kubeconfig: Path, namespace: str, log_path: Path, **env: str
) -> Iterator[Path]:
    """:func:`start_operator`, yielding its log file. On exit: stopped, and its log must show
    no refused API call."""
    proc = start_operator(kubeconfig, namespace, log_path, env)
    try:
        yield log_path
        assert proc.poll() is None, "the operator exited during the test"
    finally:
        stop_process(proc)
        text = log_path.read_text(errors="replace")
        print(f"--- operator log (tail) ---\n{text[-6000:]}")  # shown when the test fails
    assert "Forbidden" not in text, text[-4000:]
    assert " 403" not in text, text[-4000:]


def get(cluster: KubeCluster, path: str) -> dict[str, Any] | None:
    resp = cluster.request("GET", path)
    return resp.body if resp.status == 200 else None


def quota_path(ns: str, name: str = "") -> str:
    return f"{API}/namespaces/{ns}/tenantquotas/{name}".rstrip("/")


def policy_path(ns: str, name: str = "pool") -> str:
    return f"{API}/namespaces/{ns}/schedulingpolicies/{name}"


def condition(obj: dict[str, Any] | None, kind: str = "Ready") -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


def ready_reason(cluster: KubeCluster, path: str, reason: str) -> dict[str, Any] | None:
    """The object once its Ready condition has ``reason``, else None."""
    obj = get(cluster, path)
    return obj if condition(obj).get("reason") == reason else None


def published(cluster: KubeCluster, ns: str, kind: str = "configmaps") -> Config | None:
    """The document in the policy's ConfigMap (or Secret), parsed by the sidecar's loader."""
    name = "tokenfair-pool" if kind == "configmaps" else "tokenfair-pool-keys"
    obj = get(cluster, f"/api/v1/namespaces/{ns}/{kind}/{name}")
    if obj is None:
        return None
    text = obj["data"]["config.yaml"]
    if kind == "secrets":
        text = base64.b64decode(text).decode()
    return parse_documents(yaml.safe_load_all(text), f"{kind}/{name}")


def apply(cluster: KubeCluster, ns: str, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(map(json.dumps, docs)))


def quota(name: str, **spec: Any) -> dict[str, Any]:
    base = {
        "policyName": "pool",
        "weight": 1.0,
        "burstServiceTokens": 1000,
        "sustainedServiceTokensPerSecond": 100.0,
    }
    return {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "TenantQuota",
        "metadata": {"name": name},
        "spec": base | spec,
    }


def with_weight(config: Config | None, tenant: str, weight: float) -> Config | None:
    """``config`` once ``tenant`` has ``weight`` in it, else None (a probe for :func:`wait_for`)."""
    return config if config is not None and config.tenant(tenant).weight == weight else None


def warning_events(cluster: KubeCluster, ns: str, name: str) -> list[dict[str, Any]]:
    events = get(cluster, f"/api/v1/namespaces/{ns}/events") or {"items": []}
    return [
        e
        for e in events["items"]
        if e["involvedObject"].get("name") == name and e.get("type") == "Warning"
    ]


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A P-256 certificate for 127.0.0.1 (CN and IP SAN), valid one day, and its key."""
    cert, key = folder / "webhook.crt", folder / "webhook.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def webhook_operator(
    kube_cluster: KubeCluster, operator_kubeconfig: Path, kube_namespace: str, tmp_path: Path
) -> Iterator[Path]:
    """The operator serving its validating webhook on a loopback port, with Kopf keeping the
    ValidatingWebhookConfiguration ``tokenfair.io`` pointed at it (the shipped RBAC allows
    exactly that name)."""
    cert, key = self_signed_certificate(tmp_path)
    (port,) = free_ports(1)
    with running_operator(
        operator_kubeconfig,
        kube_namespace,
        tmp_path / "operator.log",
        TOKENFAIR_WEBHOOK_PORT=str(port),
        TOKENFAIR_WEBHOOK_ADDR="127.0.0.1",
        TOKENFAIR_WEBHOOK_HOST="127.0.0.1",
        TOKENFAIR_WEBHOOK_CERT=str(cert),
        TOKENFAIR_WEBHOOK_KEY=str(key),
        TOKENFAIR_WEBHOOK_MANAGED="tokenfair.io",
    ) as log:
        # Kopf configures the validating webhook, then the mutating one: wait for both, or a
        # Pod created in between is admitted with no injection webhook at all.
        for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
            path = f"/apis/admissionregistration.k8s.io/v1/{kind}/tokenfair.io"
            wait_for(
                f"the {kind} to point at our port",
                functools.partial(_points_at, kube_cluster, path, port),
            )
        yield log
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        kube_cluster.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/{kind}/tokenfair.io")


def _points_at(cluster: KubeCluster, path: str, port: int) -> bool:
    return f":{port}/" in json.dumps(get(cluster, path) or {})


def sidecar_status(admin_url: str) -> dict[str, Any] | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{admin_url}/status", timeout=5) as resp:
            status = json.loads(resp.read())
    except OSError:
        return None
    return status if isinstance(status, dict) else None


def api_client_for(cluster: KubeCluster, host: str | None = None) -> Any:
    """An admin client of ``cluster``, optionally through ``host`` (the proxy; the API
    server's certificate names 127.0.0.1, whatever the port)."""
    configuration = client.Configuration()
    configuration.host = host or cluster.server
    configuration.ssl_ca_cert = str(cluster.ca_file)
    configuration.api_key = {"authorization": f"Bearer {cluster.admin_token}"}
    return client.ApiClient(configuration)


def create_policy(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    """An empty SchedulingPolicy ``name`` in ``ns``, created as the admin; its stored body."""
    body = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "SchedulingPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {},
    }
    answer = cluster.request(
        "POST", f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/schedulingpolicies", body
    )
    assert answer.status == 201, answer.body
    return answer.body
