"""The chart's RBAC on the real control plane (``kube``), exercised with a token of the chart's own
ServiceAccount: what the operator may read is what it needs, and no more.

Behaviours under test, after ``helm install`` with ``operator.secretNamespaces`` naming one
tenant namespace:

- Secrets: ``get`` by name in the tenant namespace is allowed; ``get`` in the release namespace
  and in an unrelated namespace, and ``list`` (cluster-wide or in the tenant namespace), are
  refused with 403 (before this change the ClusterRole let it ``get`` any Secret anywhere);
- the Lease: ``get``/``update`` of the chart's Lease by name in the release namespace is
  allowed; another Lease name, the same name in another namespace, ``create`` and a cluster-wide
  ``list`` are refused with 403;
- the chart's operator container, run here with that token and leader election on the chart's
  Lease, reconciles a policy in the tenant namespace whose quota names a key Secret: the key is
  read, the document published to ``tokenfair-pool-keys``, every object Ready, the Lease held,
  and the operator's log shows no 403/Forbidden (a missing right fails the test).
"""

from __future__ import annotations

import base64
import functools
import os
from pathlib import Path
from typing import Any

import yaml
from chart_support import (
    CHART,
    assert_never_refused,
    container,
    local_command,
    parse,
    process,
    render,
    set_args,
)
from kubecluster import KubeCluster
from loopback_support import free_ports
from operator_support import apply, policy_path, quota, quota_path, ready_reason, wait_for

from tokenfair.config import parse_documents

LEASES = "/apis/coordination.k8s.io/v1"
PROBE = "probe"


def secret(name: str, **data: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "stringData": data}


def statuses(
    cluster: KubeCluster, token: str, calls: dict[str, tuple[str, str, dict[str, Any] | None]]
) -> dict[str, int]:
    """The HTTP status of each named call made with ``token``."""
    return {
        what: cluster.request(method, path, body, token=token).status
        for what, (method, path, body) in calls.items()
    }


def test_chart_service_account_reads_only_what_the_operator_needs(
    kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path
) -> None:
    release_ns, release = kube_namespace, "tfrbac"
    tenants = kube_cluster.create_namespace("tenants")
    other = kube_cluster.create_namespace("other")
    sets = (f"operator.secretNamespaces={{{tenants}}}",)
    try:
        for ns in (release_ns, tenants, other):
            kube_cluster.expect(
                201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret(PROBE, k="v")
            )
        kube_cluster.helm(
            "install", release, str(CHART), "-n", release_ns, *set_args(sets), "--skip-crds"
        )
        docs = parse(render(4, sets, release=release, namespace=release_ns))
        operator = container(docs, "Deployment", "operator")
        env = {e["name"]: e["value"] for e in operator["env"]}
        lease = env["TOKENFAIR_LEASE_NAME"]
        sa = f"{release}-tokenfair-operator"
        token = kube_cluster.service_account_token(release_ns, sa)

        lease_path = f"{LEASES}/namespaces/{release_ns}/leases/{lease}"
        new_lease = {"metadata": {"name": "intruder"}, "spec": {}}
        calls: dict[str, tuple[str, str, dict[str, Any] | None]] = {
            "get a Secret of the tenant namespace": (
                "GET",
                f"/api/v1/namespaces/{tenants}/secrets/{PROBE}",
                None,
            ),
            "get a Secret of the release namespace": (
                "GET",
                f"/api/v1/namespaces/{release_ns}/secrets/{PROBE}",
                None,
            ),
            "get a Secret of another namespace": (
                "GET",
                f"/api/v1/namespaces/{other}/secrets/{PROBE}",
                None,
            ),
            "list Secrets cluster-wide": ("GET", "/api/v1/secrets", None),
            "list Secrets of the tenant namespace": (
                "GET",
                f"/api/v1/namespaces/{tenants}/secrets",
                None,
            ),
            "get the chart's Lease": ("GET", lease_path, None),
            "get another Lease": (
                "GET",
                f"{LEASES}/namespaces/{release_ns}/leases/kube-scheduler",
                None,
            ),
            "get the Lease name elsewhere": (
                "GET",
                f"{LEASES}/namespaces/{tenants}/leases/{lease}",
                None,
            ),
            "create a Lease": ("POST", f"{LEASES}/namespaces/{release_ns}/leases", new_lease),
            "list Leases cluster-wide": ("GET", f"{LEASES}/leases", None),
        }
        assert statuses(kube_cluster, token, calls) == {
            "get a Secret of the tenant namespace": 200,
            "get a Secret of the release namespace": 403,
            "get a Secret of another namespace": 403,
            "list Secrets cluster-wide": 403,
            "list Secrets of the tenant namespace": 403,
            "get the chart's Lease": 200,
            "get another Lease": 403,
            "get the Lease name elsewhere": 403,
            "create a Lease": 403,
            "list Leases cluster-wide": 403,
        }
        # update by name: the chart's Lease is the operator's to renew.
        stored = kube_cluster.request("GET", lease_path, token=token).body
        renewed = kube_cluster.request("PUT", lease_path, stored, token=token)
        assert renewed.status == 200, renewed.body

        # The chart's operator, with that token, watching the tenant namespace: every right it
        # uses is there (its log must show no refusal).
        kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "kubeconfig", token, user=sa)
        health_port, http_port = free_ports(2)
        remap = {
            "0.0.0.0:8080": f"127.0.0.1:{health_port}",
            "--all-namespaces": f"--namespace={tenants}",
        }
        run_env = {**os.environ, **env, "KUBECONFIG": str(kubeconfig)}
        run_env["TOKENFAIR_HTTP_ADDR"], run_env["TOKENFAIR_HTTP_PORT"] = "127.0.0.1", str(http_port)
        run_env["TOKENFAIR_RESYNC_SECONDS"] = "1"
        with process(local_command(operator, remap), tmp_path / "operator.log", run_env) as log:
            kube_cluster.expect(
                201,
                "POST",
                f"/api/v1/namespaces/{tenants}/secrets",
                secret("keyed-keys", primary="sk-keyed-1"),
            )
            policy = {
                "apiVersion": "tokenfair.io/v1alpha1",
                "kind": "SchedulingPolicy",
                "metadata": {"name": "pool"},
                "spec": {},
            }
            apply(
                kube_cluster,
                tenants,
                policy,
                quota("plain"),
                quota("keyed", apiKeySecretRef={"name": "keyed-keys"}),
            )
            for path in (policy_path(tenants), quota_path(tenants, "keyed")):
                wait_for(
                    f"{path} Ready", functools.partial(ready_reason, kube_cluster, path, "Ready")
                )

            def keys_published() -> dict[str, Any] | None:
                body = kube_cluster.request(
                    "GET", f"/api/v1/namespaces/{tenants}/secrets/tokenfair-pool-keys"
                )
                return body.body if body.status == 200 else None

            stored_keys = wait_for("the published key Secret", keys_published)
            text = base64.b64decode(stored_keys["data"]["config.yaml"]).decode()
            config = parse_documents(yaml.safe_load_all(text), "tokenfair-pool-keys")
            keyed = next(t for t in config.tenants if t.tenant_id == "keyed")
            assert len(keyed.api_key_sha256) == 1

            def held() -> str | None:
                spec = kube_cluster.request("GET", lease_path).body.get("spec") or {}
                return spec.get("holderIdentity") or None

            wait_for("the operator to hold the chart's Lease", held)
            assert_never_refused(log.read_text(errors="replace"))
    finally:
        kube_cluster.helm("uninstall", release, "-n", release_ns, check=False)
        for ns in (tenants, other):
            kube_cluster.delete_namespace(ns)
