"""Measure the time from a TenantQuota change to the new config document in the ConfigMap.

Starts a throwaway control plane (tests/kubecluster.py, needs ``make controlplane tools``), the
operator as ``kopf run -m tokenfair_operator.handlers`` with the shipped RBAC, applies the
lesson's tenants, then changes chat-pro's weight ``--rounds`` times, each time timing:

* ``kubectl``: from starting ``kubectl patch`` to the new weight readable in the ConfigMap;
* ``api``: from sending the PATCH request to the same point.

The ConfigMap is polled every ``--poll-ms``; figures are upper bounds by up to one poll plus one
GET. Usage: ``.venv/bin/python operator/hack/measure_propagation.py [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import kubecluster  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

from tokenfair.config import parse_documents  # noqa: E402


def weight_in_configmap(cluster: kubecluster.KubeCluster, ns: str) -> float | None:
    resp = cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
    if resp.status != 200:
        return None
    config = parse_documents(yaml.safe_load_all(resp.body["data"]["config.yaml"]))
    return config.tenant("tenant_chat_pro").weight


def wait_weight(cluster: kubecluster.KubeCluster, ns: str, weight: float, poll_s: float) -> None:
    deadline = time.monotonic() + 30
    while weight_in_configmap(cluster, ns) != weight:
        if time.monotonic() > deadline:
            raise SystemExit(f"weight {weight} never reached the ConfigMap")
        time.sleep(poll_s)


def summary(name: str, samples_ms: list[float]) -> str:
    ordered = sorted(samples_ms)
    p90 = ordered[max(0, round(0.9 * len(ordered)) - 1)]
    return (
        f"{name:8s} n={len(ordered)} median={statistics.median(ordered):.0f} ms "
        f"p90={p90:.0f} ms max={ordered[-1]:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    args = parser.parse_args()
    binaries = kubecluster.find_binaries()
    if isinstance(binaries, str):
        raise SystemExit(binaries)
    poll_s = args.poll_ms / 1000
    with kubecluster.running_cluster(binaries) as cluster, tempfile.TemporaryDirectory() as tmp:
        ns = cluster.create_namespace("measure")
        namespace = {"apiVersion": "v1", "kind": "Namespace"}
        namespace["metadata"] = {"name": "tokenfair-system"}  # type: ignore[assignment]
        cluster.kubectl("apply", "-f", "-", input=json.dumps(namespace))
        for name in ("serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml"):
            cluster.kubectl("apply", "-f", str(REPO / "operator" / "rbac" / name))
        token = cluster.service_account_token("tokenfair-system", "tokenfair-operator")
        kubeconfig = cluster.write_kubeconfig(Path(tmp) / "kubeconfig", token, user="operator")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "NO_PROXY": "127.0.0.1"}
        cmd = [sys.executable, "-m", "kopf", "run", "-m", "tokenfair_operator.handlers"]
        with (Path(tmp) / "operator.log").open("wb") as log:
            proc = subprocess.Popen(
                [*cmd, "--namespace", ns, "--standalone"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            cluster.kubectl(
                "apply", "-n", ns, "-f", str(REPO / "tests/data/operator/lesson-tenants.yaml")
            )
            wait_weight(cluster, ns, 2.0, poll_s)
            by_kubectl, by_api = [], []
            path = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/tenantquotas/chat-pro"
            for i in range(args.rounds):
                weight = 3.0 + i
                patch = json.dumps({"spec": {"weight": weight}})
                started = time.monotonic()
                if i % 2 == 0:
                    cluster.kubectl(
                        "patch", "tq", "chat-pro", "-n", ns, "--type=merge", "-p", patch
                    )
                    wait_weight(cluster, ns, weight, poll_s)
                    by_kubectl.append((time.monotonic() - started) * 1000)
                else:
                    body = {"spec": {"weight": weight}}
                    resp = cluster.request(
                        "PATCH", path, body, content_type="application/merge-patch+json"
                    )
                    assert resp.status == 200, resp.body
                    wait_weight(cluster, ns, weight, poll_s)
                    by_api.append((time.monotonic() - started) * 1000)
            print(summary("kubectl", by_kubectl))
            print(summary("api", by_api))
        finally:
            proc.terminate()
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
