"""Fast config propagation: the operator serves each policy's document over a long-poll.

Behaviours under test, on the real control plane with the operator's shipped RBAC and real
``tokenfair sidecar`` processes (three, as the Pods of one policy would run them):

- a quota change reaches every sidecar through the long-poll alone: the file each sidecar was
  started from is never rewritten (no kubelet here), yet all three run the new version and its
  new burst; the document server answers a sidecar with exactly the ConfigMap's stored bytes;
- the last good config stays through an operator outage (sidecars keep serving their version,
  still ready), the mounted file takes over while the operator is away (a document written to
  it is applied), and once the operator is back its document wins again; away once more, a
  file of a lower generation than the operator's document (the kubelet's late copy) is
  refused, counted as an invalid reload, and the operator's version stays;
- all of it over TLS, as deployed: the operator issues its own CA and serving certificate
  (kept in a Secret), publishes the CA into the policy's namespace (ConfigMap
  ``tokenfair.io-ca.crt``), and the sidecars verify the server with that bundle and show a
  TokenRequest token for the audience ``tokenfair-config``;
- a sidecar given another CA than the operator's refuses the server (certificate verify
  failed, in its log) and keeps serving the config of its mounted file;
- the document server checks who asks: no token or an invalid one -> 401, a token of the
  right namespace without the audience (a Pod's ordinary one) -> 401, a ServiceAccount of
  another namespace -> 403 (its own namespace's only), the policy's namespace -> 200 with the
  version header, the same version with ``waitSeconds=0`` -> 304, bad parameters -> 400 naming
  the parameter and the rule; an unknown policy -> 404;
- the injector wires it: with ``config_url_base`` the sidecar gets the long-poll URL (the Pod's
  namespace from the downward API), a projected token and the CA; without it, nothing changes;
- the policy's status counts the Ready sidecars on its published version: of three (two on
  the long-poll, one reading a file nobody refreshes), after the budgets are re-split three
  ways ``status.sidecars`` is ``2/3 @ <version>``, and ``kubectl get tsp`` shows it.

Latency figures (p50/p99 over 20 rounds) come from ``bench/bench_propagation.py``; nothing here
asserts a duration.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster, stop_process
from loopback_support import free_ports
from operator_support import (
    get,
    policy_path,
    running_operator,
    sidecar_status,
    wait_for,
)
from propagation_support import (
    AUDIENCE,
    TRUST_CONFIGMAP,
    apply_lesson_and_wait,
    audience_token,
    http_get,
    long_poll_env,
    published_ca,
    stored_configmap,
    tls_env,
    token_file,
)

from tokenfair.config.wire import VERSION_HEADER
from tokenfair_operator.certs import issue
from tokenfair_operator.inject import InjectionSettings, injected

SIDECARS = 3


@contextlib.contextmanager
def serving_operator(kubeconfig: Path, ns: str, log: Path, port: int) -> Iterator[str]:
    """The operator with its document server on ``https://localhost:port``; yields the base."""
    env = tls_env(ns, port, log.with_suffix(".certs"))
    with running_operator(kubeconfig, ns, log, **env):
        yield f"https://localhost:{port}"


@contextlib.contextmanager
def sidecars(
    count: int, config_file: Path, folder: Path, env: dict[str, str]
) -> Iterator[list[str]]:
    """``count`` ``tokenfair sidecar`` processes (cost-model backend) started from
    ``config_file`` with ``env``; yields their admin URLs."""
    tokenfair = Path(sys.executable).with_name("tokenfair")
    folder.mkdir(exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    admins = []
    try:
        for i in range(count):
            proxy_port, admin_port = free_ports(2)
            cmd = [str(tokenfair), "sidecar", "--config", str(config_file)]
            cmd += ["--backend", "costmodel", "--listen", f"127.0.0.1:{proxy_port}"]
            cmd += ["--admin-listen", f"127.0.0.1:{admin_port}"]
            with (folder / f"sidecar-{i}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **env},
                        start_new_session=True,
                    )
                )
            admins.append(f"http://127.0.0.1:{admin_port}")
        yield admins
    finally:
        for proc in procs:
            stop_process(proc)
        for i in range(len(procs)):
            print(f"--- sidecar-{i} log ---\n{(folder / f'sidecar-{i}.log').read_text()[-3000:]}")


def runs(admin: str, version: str) -> dict[str, Any] | None:
    status = sidecar_status(admin)
    return status if status is not None and status["config"]["version"] == version else None


def all_run(admins: list[str], version: str) -> list[dict[str, Any]] | None:
    statuses = [runs(admin, version) for admin in admins]
    return [s for s in statuses if s is not None] if all(statuses) else None


def patch_burst(cluster: KubeCluster, ns: str, burst: int) -> None:
    patch = json.dumps({"spec": {"burstServiceTokens": burst}})
    cluster.kubectl("patch", "tq", "chat-pro", "-n", ns, "--type=merge", "-p", patch)


def new_version(cluster: KubeCluster, ns: str, old: str) -> str:
    def changed() -> str | None:
        status = (get(cluster, policy_path(ns)) or {}).get("status", {})
        version = status.get("configVersion")
        return version if version and version != old else None

    return wait_for("a new config version", changed)


def test_a_change_reaches_every_sidecar_through_the_long_poll(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    token = token_file(kube_cluster, ns, "model", tmp_path)
    (port,) = free_ports(1)
    with serving_operator(operator_kubeconfig, ns, tmp_path / "operator.log", port) as base:
        first = apply_lesson_and_wait(kube_cluster, ns)
        ca = published_ca(kube_cluster, ns, tmp_path)
        config_file = tmp_path / "config.yaml"
        config_file.write_bytes(stored_configmap(kube_cluster, ns))  # the kubelet, once
        started_from = config_file.read_bytes()
        env = long_poll_env(base, ns, token, ca)
        with sidecars(SIDECARS, config_file, tmp_path, env) as admins:
            wait_for("every sidecar on the first version", lambda: all_run(admins, first))

            patch_burst(kube_cluster, ns, 24_000)
            second = new_version(kube_cluster, ns, first)
            statuses = wait_for("every sidecar on the new version", lambda: all_run(admins, second))

        assert len(statuses) == SIDECARS
        for status in statuses:
            assert status["tenants"]["tenant_chat_pro"]["burst_service_tokens"] == 24_000
        assert config_file.read_bytes() == started_from  # the file played no part
        status_code, headers, body = http_get(
            f"{base}/v1/config/{ns}/pool?source=configmap&waitSeconds=0", token.read_text(), ca
        )
        assert (status_code, headers[VERSION_HEADER]) == (200, second)
        assert body == stored_configmap(kube_cluster, ns)


def test_last_good_config_through_an_outage_and_the_file_as_fallback(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    token = token_file(kube_cluster, ns, "model", tmp_path)
    (port,) = free_ports(1)
    config_file = tmp_path / "config.yaml"
    with serving_operator(operator_kubeconfig, ns, tmp_path / "operator.log", port) as base:
        first = apply_lesson_and_wait(kube_cluster, ns)
        document = json.loads(stored_configmap(kube_cluster, ns))
        env = long_poll_env(base, ns, token, published_ca(kube_cluster, ns, tmp_path))
    # The operator is gone: a sidecar starts from the file and keeps it.
    config_file.write_text(json.dumps(document))
    with sidecars(1, config_file, tmp_path, env) as (admin,):
        wait_for("the sidecar on the file's version", lambda: runs(admin, first))
        # While the operator is away the file is the source: a change to it is applied.
        manual = {**document, "version": "written-by-hand"}
        manual["tenants"][0]["burstServiceTokens"] = 1234
        staged = tmp_path / "config.staged"
        staged.write_text(json.dumps(manual))
        staged.replace(config_file)
        status = wait_for("the file's new version", lambda: runs(admin, "written-by-hand"))
        assert status["tenants"][manual["tenants"][0]["tenantId"]]["burst_service_tokens"] == 1234
        ready = http_get(f"{admin}/readyz")
        assert ready[0] == 200

        # The operator is back: its document (the cluster's) wins over the hand-written file.
        with serving_operator(operator_kubeconfig, ns, tmp_path / "operator-2.log", port):
            wait_for("the operator's version again", lambda: runs(admin, first))
        configmap = get(kube_cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
        assert configmap is not None
        generation = int(configmap["metadata"]["annotations"]["tokenfair.io/config-generation"])
        assert configmap["data"]["generation"] == str(generation)

        # Away again, and the file turns into an older document (a lower generation beside
        # it): refused, never going back; the operator's version keeps running.
        refused_before = reloads(admin, "invalid")
        (tmp_path / "generation").write_text(str(generation - 1))
        staged.write_text(json.dumps({**document, "version": "older"}))
        staged.replace(config_file)
        wait_for("the older file refused", lambda: reloads(admin, "invalid") > refused_before)
        assert runs(admin, first)


def test_a_sidecar_with_another_ca_refuses_the_server_and_keeps_its_file(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    token = token_file(kube_cluster, ns, "model", tmp_path)
    (port,) = free_ports(1)
    with serving_operator(operator_kubeconfig, ns, tmp_path / "operator.log", port) as base:
        apply_lesson_and_wait(kube_cluster, ns)
        published_ca(kube_cluster, ns, tmp_path)  # the operator's; the sidecar gets another
        wrong = tmp_path / "wrong-ca.crt"
        wrong.write_bytes(issue(["localhost"], datetime.datetime.now(datetime.UTC)).ca_pem)
        document = json.loads(stored_configmap(kube_cluster, ns))
        config_file = tmp_path / "config.yaml"
        config_file.write_text(json.dumps({**document, "version": "from-file"}))
        env = long_poll_env(base, ns, token, wrong)
        with sidecars(1, config_file, tmp_path, env) as (admin,):
            log = tmp_path / "sidecar-0.log"
            wait_for("the server refused", lambda: "certificate verify failed" in log.read_text())
            assert runs(admin, "from-file") is not None
            assert http_get(f"{admin}/readyz")[0] == 200


def reloads(admin: str, result: str) -> float:
    """``tokenfair_config_reloads_total{result=...}`` of a sidecar (0 before the first)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    prefix = f'tokenfair_config_reloads_total{{result="{result}"}} '
    values = [
        float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)
    ]
    return values[0] if values else 0.0


def test_the_document_server_checks_who_asks(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    own = token_file(kube_cluster, ns, "model", tmp_path).read_text()
    api_audience = audience_token(kube_cluster, ns, "model", [])  # a Pod's ordinary token
    other_ns = kube_cluster.create_namespace("other")
    try:
        other = token_file(kube_cluster, other_ns, "model", tmp_path).read_text()
        (port,) = free_ports(1)
        with serving_operator(operator_kubeconfig, ns, tmp_path / "operator.log", port) as base:
            version = apply_lesson_and_wait(kube_cluster, ns)
            ca = published_ca(kube_cluster, ns, tmp_path)
            url = f"{base}/v1/config/{ns}/pool"

            assert http_get(f"{url}?waitSeconds=0", ca=ca)[0] == 401
            status, _, body = http_get(f"{url}?waitSeconds=0", "not-a-token", ca)
            assert (status, b"not a valid ServiceAccount token" in body) == (401, True)
            status, _, body = http_get(f"{url}?waitSeconds=0", api_audience, ca)
            assert (status, b"not a valid ServiceAccount token" in body) == (401, True)
            status, _, body = http_get(f"{url}?waitSeconds=0", other, ca)
            assert status == 403
            assert f"namespace {other_ns!r} may not read policy {ns}/pool".encode() in body

            status, headers, secret = http_get(f"{url}?source=secret&waitSeconds=0", own, ca)
            assert (status, headers[VERSION_HEADER]) == (200, version)
            tenants = {t["tenantId"] for t in json.loads(secret)["tenants"]}
            assert tenants == {"tenant_chat_pro", "tenant_ide_assist", "tenant_batch_rag"}
            same = http_get(f"{url}?version={version}&waitSeconds=0", own, ca)
            assert same[0] == 304

            status, _, body = http_get(f"{url}?source=vault", own, ca)
            assert (status, body.startswith(b"source: must be one of secret, configmap")) == (
                400,
                True,
            )
            status, _, body = http_get(f"{url}?waitSeconds=600", own, ca)
            assert (status, b"waitSeconds: must be an integer 0..60" in body) == (400, True)
            missing = http_get(f"{base}/v1/config/{ns}/nowhere?waitSeconds=0", own, ca)
            assert missing[0] == 404
    finally:
        kube_cluster.delete_namespace(other_ns)


def pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"tokenfair.io/policy": "pool"}, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "model", "image": "vllm"}]},
    }


@pytest.mark.parametrize("source", ["secret", "configmap"])
def test_the_injector_wires_the_long_poll(source: str) -> None:
    settings = InjectionSettings(config_url_base="https://tokenfair-operator.tf.svc:8443/")
    change = injected(pod({"tokenfair.io/config-source": source}), settings)

    assert change is not None
    sidecar = change["containers"][0]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["TOKENFAIR_POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace"
    )
    assert env["TOKENFAIR_CONFIG_URL"]["value"] == (
        "https://tokenfair-operator.tf.svc:8443/v1/config/$(TOKENFAIR_POD_NAMESPACE)/pool"
        f"?source={source}"
    )
    token = env["TOKENFAIR_CONFIG_TOKEN_FILE"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert token == f"{mounts['tokenfair-token']}/token"
    assert env["TOKENFAIR_CONFIG_CA_FILE"]["value"] == f"{mounts['tokenfair-token']}/ca.crt"
    volume = next(v for v in change["volumes"] if v["name"] == "tokenfair-token")
    projected, trust = volume["projected"]["sources"]
    assert projected["serviceAccountToken"]["path"] == "token"
    assert projected["serviceAccountToken"]["audience"] == AUDIENCE
    assert trust["configMap"]["name"] == TRUST_CONFIGMAP
    # Without a document server: the file alone, as before.
    plain = injected(pod(), InjectionSettings())
    assert plain is not None
    assert "env" not in plain["containers"][0]
    assert [v["name"] for v in plain["volumes"]] == ["tokenfair-config"]


def register_pod(cluster: KubeCluster, ns: str, name: str, admin: str) -> None:
    """A Ready Pod standing for a sidecar process (the test plays the kubelet)."""
    pod = {
        "metadata": {
            "name": name,
            "labels": {"tokenfair.io/policy": "pool"},
            "annotations": {"tokenfair.io/admin-port": admin.rsplit(":", 1)[1]},
        },
        "spec": {"containers": [{"name": "tokenfair-sidecar", "image": "tokenfair"}]},
    }
    cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/pods", pod)
    body = {
        "status": {
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    path = f"/api/v1/namespaces/{ns}/pods/{name}/status"
    resp = cluster.request("PATCH", path, body, content_type="application/merge-patch+json")
    assert resp.status == 200, resp.body


def test_status_shows_how_many_sidecars_run_the_current_version(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    token = token_file(kube_cluster, ns, "model", tmp_path)
    (port,) = free_ports(1)
    with serving_operator(operator_kubeconfig, ns, tmp_path / "operator.log", port) as base:
        apply_lesson_and_wait(kube_cluster, ns)
        env = long_poll_env(base, ns, token, published_ca(kube_cluster, ns, tmp_path))
        config_file = tmp_path / "config.yaml"
        config_file.write_bytes(stored_configmap(kube_cluster, ns))
        with (
            sidecars(2, config_file, tmp_path / "a", env) as polling,
            sidecars(1, config_file, tmp_path / "b", {}) as (file_only,),
        ):
            for i, admin in enumerate([*polling, file_only]):
                register_pod(kube_cluster, ns, f"sidecar-{i}", admin)

            # Three Ready sidecars: budgets split three ways, a new version. The two on the
            # long-poll take it; the third reads a file nobody refreshes: a stuck rollout.
            def stuck() -> dict[str, Any] | None:
                status = (get(kube_cluster, policy_path(ns)) or {}).get("status", {})
                version = status.get("configVersion")
                wanted = f"2/3 @ {version}"
                return (
                    status
                    if status.get("budgetShares") == 3 and status.get("sidecars") == wanted
                    else None
                )

            status = wait_for("2 of 3 sidecars on the version", stuck)
            assert (status["sidecarsReady"], status["sidecarsCurrent"]) == (3, 2)
            version = status["configVersion"]
            for admin in polling:
                assert runs(admin, version) is not None
            assert runs(file_only, version) is None
            table = kube_cluster.kubectl("get", "tsp", "pool", "-n", ns).stdout
            assert f"2/3 @ {version}" in table
