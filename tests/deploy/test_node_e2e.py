"""The chart on a real node (``kube_node``, docs/node.md): Pods run the image ``make image``
built, Services carry traffic, the webhook is called through its Service.

One Helm release (the demo on, the webhooks on) is shared by the tests of this module, which run
in order, as a user's first session would: install, ``helm test``, sidecar injection into a model
server (whose sidecar long-polls the operator's document server over TLS, verified with the CA
the operator published into the namespace, with a projected token for the audience
``tokenfair-config``), the lesson's workload through the demo Service, a quota change applied
with kubectl, the operator's usage loop, uninstall. Nothing here depends on the machine's
speed: the assertions are about what is served, refused, injected or left behind; the only
waits are bounded polls of states the cluster converges to (upstream's kubelet Secret sync
included: up to ~90 s).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster
from kubenode import POD_CIDR, KubeNode
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.node

REPO = REPO_ROOT
CHART = REPO / "charts" / "tokenfair"
RELEASE = "tokenfair"  # contains the chart's name: objects are `tokenfair-*`, as in the docs
NAMESPACE = "tokenfair-e2e"
DEMO_SERVICE = f"{RELEASE}-demo"
OPERATOR_SERVICE = f"{RELEASE}-operator"
POLICY = "demo"
# The demo's public keys (values.yaml stores only their digests).
KEYS = {
    "tenant_chat_pro": "sk-local-chat-pro",
    "tenant_ide_assist": "sk-local-ide-assist",
    "tenant_batch_rag": "sk-local-batch-rag",
}
# The noisy-neighbor scenario: 18 batch + 24 chat + 18 ide requests (scenarios.noisy_neighbor).
REQUESTS = 18 + 24 + 18
INSTALL_TIMEOUT_S = 300
# Secret volume refresh: the kubelet's sync period (60 s) plus its cache TTL, as shipped.
PROPAGATION_TIMEOUT_S = 150.0
USAGE_TIMEOUT_S = 90.0
COMPLETION = {"prompt": "hello", "max_tokens": 8}
# The injected sidecar authenticates the key and never forwards it; the model server behind it
# (reachable only on the Pod's loopback) trusts this header to name the tenant.
MODEL_TENANT_HEADER = "x-model-tenant"
TRUST_CONFIGMAP = "tokenfair.io-ca.crt"


def poll(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """``check()`` until truthy (returned) or ``timeout_s``; the last falsy value is reported."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")


def post_completion(url: str, key: str, headers: dict[str, str] | None = None) -> int:
    """POST one small completion with ``key``; the HTTP status (no proxy, 30 s bound)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(COMPLETION).encode(),
        headers={
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
            **(headers or {}),
        },
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code)


def http_status(url: str) -> int | None:
    """GET ``url``: its HTTP status, or None when nothing answers (yet)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        with err:
            return int(err.code)
    except OSError:
        return None


def get_json(cluster: KubeCluster, path: str) -> dict[str, Any]:
    return cluster.expect(200, "GET", path).body


def service_url(cluster: KubeCluster, name: str, port: int) -> str:
    svc = get_json(cluster, f"/api/v1/namespaces/{NAMESPACE}/services/{name}")
    return f"http://{svc['spec']['clusterIP']}:{port}"


@pytest.fixture(scope="module")
def release(kube_node: KubeNode) -> Iterator[KubeCluster]:
    """``helm install --wait`` of the chart with the demo and the webhooks; uninstalled after."""
    cluster = kube_node.cluster
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--set",
        "demo.enabled=true",
        "--set",
        "webhook.enabled=true",
        "--wait",
        "--timeout",
        f"{INSTALL_TIMEOUT_S}s",
        timeout=INSTALL_TIMEOUT_S + 60,
    )
    # `--wait` waits for Ready Pods, not for kube-proxy to have programmed the Service: until
    # it has, a ClusterIP refuses connections.
    admin = service_url(cluster, DEMO_SERVICE, 9090)
    poll("demo Service answering", lambda: http_status(admin + "/readyz") == 200, 60)
    yield cluster
    cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)
    cluster.delete_namespace(NAMESPACE)


def test_install_runs_every_pod_on_the_node(release: KubeCluster, kube_node: KubeNode) -> None:
    pods = get_json(release, f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
    components = {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods}
    assert {"operator", "demo"} <= components, components
    for pod in pods:
        assert pod["spec"]["nodeName"] == kube_node.name
        assert pod["status"]["phase"] == "Running", pod["status"]
        ip = ipaddress.ip_address(pod["status"]["podIP"])
        assert ip in ipaddress.ip_network(POD_CIDR), ip
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True", pod["status"]["conditions"]


def test_helm_test_passes(release: KubeCluster) -> None:
    result = release.helm("test", RELEASE, "--namespace", NAMESPACE, "--timeout", "180s")
    assert "Phase:          Succeeded" in result.stdout or "Succeeded" in result.stdout, (
        result.stdout
    )


def model_server_pod(name: str) -> dict[str, Any]:
    """A model server labelled for injection: the cost-model engine behind the OpenAI API on
    127.0.0.1:8000 (``tokenfair sidecar --backend costmodel`` with the demo's tenants, named by
    :data:`MODEL_TENANT_HEADER` because the injected sidecar in front of it authenticates
    clients and drops their keys), which the injected sidecar fronts."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"tokenfair.io/policy": POLICY, "e2e": "model"}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
            "containers": [
                {
                    "name": "model",
                    "image": "tokenfair/tokenfair:0.1.0",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["tokenfair"],
                    "args": [
                        "sidecar",
                        "--config=/etc/model/config.yaml",
                        "--backend=costmodel",
                        "--listen=127.0.0.1:8000",
                        "--admin-listen=127.0.0.1:9191",
                        f"--trusted-tenant-header={MODEL_TENANT_HEADER}",
                    ],
                    "volumeMounts": [{"name": "model-config", "mountPath": "/etc/model"}],
                    # Ready once its admin listener answers, which opens after the proxy
                    # listener: without it the Pod is Ready when the injected sidecar is, and
                    # on a busy node the first request could reach a model not yet listening.
                    # Loopback only, so an exec probe (a kubelet httpGet goes to the Pod IP).
                    "readinessProbe": {
                        "exec": {
                            "command": [
                                "python",
                                "-c",
                                "import urllib.request as u; "
                                "u.urlopen('http://127.0.0.1:9191/readyz', timeout=4)",
                            ]
                        },
                        "periodSeconds": 2,
                        "timeoutSeconds": 5,
                    },
                    "securityContext": {
                        "runAsNonRoot": True,
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [
                {"name": "model-config", "secret": {"secretName": f"tokenfair-{POLICY}-keys"}}
            ],
        },
    }


def test_webhook_injects_the_sidecar_through_its_service(release: KubeCluster) -> None:
    hooks = get_json(
        release, "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    )["items"]
    (hook,) = [h for w in hooks for h in w["webhooks"] if h["name"].startswith("inject-sidecar")]
    # Through the Service (not a URL), and the operator has published its CA there.
    assert hook["clientConfig"]["service"]["name"] == OPERATOR_SERVICE
    poll(
        "caBundle of the injection webhook",
        lambda: any(
            h["clientConfig"].get("caBundle")
            for w in get_json(
                release, "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
            )["items"]
            for h in w["webhooks"]
            if h["name"].startswith("inject-sidecar")
        ),
        60,
    )
    created = release.expect(
        201, "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", model_server_pod("model-e2e")
    ).body
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/model-e2e"
    try:
        check_injected_pod(release, created, pod_path)
    except AssertionError:
        for pod in get_json(release, f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]:
            name = pod["metadata"]["name"]
            for container in pod["spec"]["containers"]:
                tail = container_log(name, container["name"])[-4000:]
                print(f"--- {name}/{container['name']} ---\n{tail}")
        raise
    finally:
        # Gone before the next test, pass or fail: the uninstall test counts what is left in
        # the namespace.
        release.expect((200, 202), "DELETE", pod_path + "?gracePeriodSeconds=1")
        poll("injected Pod deleted", lambda: release.request("GET", pod_path).status == 404, 90, 2)


def check_injected_pod(release: KubeCluster, created: dict[str, Any], pod_path: str) -> None:
    """The injected Pod, once Ready, serves through its sidecar, and the sidecar's long-poll
    reaches the operator over TLS."""
    names = [c["name"] for c in created["spec"]["containers"]]
    # failurePolicy is Ignore: without a working call through the Service, no sidecar.
    assert names == ["tokenfair-sidecar", "model"], names

    def ready_ip() -> str | None:
        status = get_json(release, pod_path)["status"]
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return status.get("podIP") if conditions.get("Ready") == "True" else None

    ip = poll("injected Pod Ready", ready_ip, 180, 2)
    # Host -> Pod IP: the injected sidecar admits the demo tenant and the model server answers;
    # an unknown key is refused by the sidecar before anything reaches the model server.
    tenant = {MODEL_TENANT_HEADER: "tenant_chat_pro"}
    assert post_completion(f"http://{ip}:8080", KEYS["tenant_chat_pro"], tenant) == 200
    assert post_completion(f"http://{ip}:8080", "sk-not-a-tenant", tenant) == 401
    # Its long-poll: TLS to the operator's Service, the server verified with the CA bundle the
    # operator published here, a token for the document server's audience only.
    (volume,) = [v for v in created["spec"]["volumes"] if v["name"] == "tokenfair-token"]
    token, trust = volume["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "tokenfair-config"
    assert trust["configMap"]["name"] == TRUST_CONFIGMAP
    bundle_path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{TRUST_CONFIGMAP}"
    answered = (
        f"config long-poll of https://{OPERATOR_SERVICE}.{NAMESPACE}.svc:8443/v1/config/"
        f"{NAMESPACE}/{POLICY}?source=secret answers (server verified with "
    )
    bundle = poll("the CA bundle published", lambda: get_or_none(release, bundle_path), 60, 2)
    assert bundle["data"]["ca.crt"].startswith("-----BEGIN CERTIFICATE-----")
    poll(
        "the sidecar's long-poll answered over TLS",
        lambda: answered in container_log("model-e2e", "tokenfair-sidecar"),
        120,
        2,
    )


def get_or_none(cluster: KubeCluster, path: str) -> dict[str, Any] | None:
    resp = cluster.request("GET", path)
    return resp.body if resp.status == 200 else None


def container_log(pod: str, container: str) -> str:
    """A container's log as the kubelet writes it on this (the node's) host."""
    found = Path("/var/log/containers").glob(f"{pod}_{NAMESPACE}_{container}-*.log")
    return "".join(path.read_text(errors="replace") for path in found)


def test_loadgen_serves_every_request_through_the_service(
    release: KubeCluster, tmp_path: Path
) -> None:
    target = service_url(release, DEMO_SERVICE, 8080)
    records = tmp_path / "records.jsonl"
    cmd = [str(Path(sys.executable).parent / "tokenfair"), "loadgen", "--target", target]
    cmd += ["--scenario", "noisy-neighbor", "--stream", "--records", str(records)]
    cmd += ["--format", "json"]
    for tenant, key in KEYS.items():
        cmd += ["--key", f"{tenant}={key}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    # Exit 0: every request got an HTTP answer within the run's timeout (no connection failed).
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    assert len(lines) == REQUESTS
    # Every request is accounted for as admitted or shed by the sidecar behind the Service; how
    # many of each is the policy's answer to this machine's speed (bench/ measures that), so
    # only the sum is asserted.
    (summary,) = json.loads(result.stdout)["comparison"].values()
    assert summary["total_requests"] == REQUESTS
    assert summary["admitted_requests"] + summary["shed_429_requests"] == REQUESTS, summary
    assert summary["admitted_requests"] > 0, summary


def quota_manifest(api_key: str) -> str:
    digest = hashlib.sha256(api_key.encode()).hexdigest()
    return f"""apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: batch-rag
  namespace: {NAMESPACE}
spec:
  policyName: {POLICY}
  tenantId: tenant_batch_rag
  weight: 1.0
  burstServiceTokens: 28000
  sustainedServiceTokensPerSecond: 60000
  priorityClass: batch
  apiKeySha256:
    - {digest}
"""


def test_applied_quota_change_is_enforced_by_the_running_pod(release: KubeCluster) -> None:
    """Rotate batch-rag's key with ``kubectl apply``: the running sidecar (not a new Pod) starts
    refusing the old key and admitting the new one once the kubelet refreshes the Secret."""
    target = service_url(release, DEMO_SERVICE, 8080)
    pods_before = sorted(
        p["metadata"]["uid"]
        for p in get_json(
            release,
            f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io/component=demo",
        )["items"]
    )
    new_key = "sk-e2e-rotated-batch"
    assert post_completion(target, new_key) == 401
    # Client-side apply, as a user edits a quota: the list is replaced. (Server-side apply from
    # a second field manager would add to it: apiKeySha256 is a list-type set whose old item
    # Helm owns, so the old key would stay valid.)
    release.kubectl("apply", "-f", "-", input=quota_manifest(new_key))
    poll(
        "new key admitted",
        lambda: post_completion(target, new_key) == 200,
        PROPAGATION_TIMEOUT_S,
        3,
    )
    assert post_completion(target, KEYS["tenant_batch_rag"]) == 401
    pods_after = sorted(
        p["metadata"]["uid"]
        for p in get_json(
            release,
            f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io/component=demo",
        )["items"]
    )
    assert pods_after == pods_before  # enforced live, without a restart


def test_usage_loop_fills_quota_status_from_pod_ips(release: KubeCluster) -> None:
    target = service_url(release, DEMO_SERVICE, 8080)
    for _ in range(3):
        assert post_completion(target, KEYS["tenant_chat_pro"]) == 200
    path = f"/apis/tokenfair.io/v1alpha1/namespaces/{NAMESPACE}/tenantquotas/chat-pro"

    def usage() -> dict[str, Any] | None:
        found = get_json(release, path).get("status", {}).get("usage")
        return found if found and found.get("admittedServiceTokens", 0) > 0 else None

    found = poll("chat-pro status.usage", usage, USAGE_TIMEOUT_S, 2)
    # The operator scraped the policy's Ready sidecars over their Pod IPs (admin port 9090).
    assert found["sidecars"] >= 1, found


def test_uninstall_leaves_only_the_crds(release: KubeCluster) -> None:
    release.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "180s")

    def leftovers() -> list[str]:
        kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,leases"
        kinds += ",tenantquotas,schedulingpolicies"
        out = release.kubectl("get", kinds, "-n", NAMESPACE, "-o", "name").stdout.split()
        # Made by the cluster for every namespace, not by the chart.
        cluster_made = {"configmap/kube-root-ca.crt", "serviceaccount/default"}
        return [name for name in out if name not in cluster_made]

    deadline = time.monotonic() + 120
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(2)
    assert left == [], f"left in {NAMESPACE} after helm uninstall: {left}"
    selector = f"app.kubernetes.io/instance={RELEASE}"
    cluster_kinds = "clusterroles,clusterrolebindings"
    cluster_kinds += ",mutatingwebhookconfigurations,validatingwebhookconfigurations"
    assert release.kubectl("get", cluster_kinds, "-l", selector, "-o", "name").stdout.split() == []
    crds = release.kubectl("get", "crd", "-o", "name").stdout.split()
    assert "customresourcedefinition.apiextensions.k8s.io/tenantquotas.tokenfair.io" in crds
