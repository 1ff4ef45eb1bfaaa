"""Two operator replicas with leader election on a ``coordination.k8s.io`` Lease.

Behaviours under test, on the real control plane with the shipped RBAC (two ``kopf run``
processes, each with its own document server):

- one replica leads (it holds the Lease and writes the documents and statuses); the other only
  watches: its log shows no write, and the documents carry one version;
- the standby relays a sidecar's long-poll to the leader (the address in the Lease, its TLS
  port) over TLS, verifying the leader's certificate with the operator's own CA (the leader
  issued it, the standby serves the same one from the Secret): the same version, generation
  and bytes as the leader serves;
- the leader crashes (SIGKILL, no release): the standby takes the Lease over once it expired,
  says so in its log, runs a full pass, and a quota changed right after the crash reaches the
  ConfigMap at the next generation (the counter lives in the ConfigMap, not in the dead
  leader's memory); the Lease counts one transition more; no storm of 409 retries in its log.

The failover time is measured by ``bench/bench_failover.py``; nothing here asserts a duration
(the waits are generous bounds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster, stop_process
from loopback_support import free_ports
from operator_support import (
    get,
    log_shows,
    published,
    running_operator,
    start_operator,
    wait_for,
    with_weight,
)
from propagation_support import apply_lesson_and_wait, http_get, published_ca, tls_env, token_file

LEASE = "tokenfair-operator"
# Lease duration (10 s) + a retry (2 s) + a pass, with room for a loaded machine.
FAILOVER_WAIT_S = 60.0


def replica_env(ns: str, name: str, port: int, tls_port: int, certs: Path) -> dict[str, str]:
    """Plain ``port`` (health), TLS ``tls_port`` (documents; advertised for the relay)."""
    return {
        **tls_env(ns, tls_port, certs),
        "TOKENFAIR_LEADER_ELECTION": "true",
        "TOKENFAIR_LEASE_NAMESPACE": ns,
        "TOKENFAIR_LEASE_NAME": LEASE,
        "TOKENFAIR_POD_NAME": name,
        "TOKENFAIR_HTTP_PORT": str(port),
        "TOKENFAIR_HTTP_ADVERTISE": f"127.0.0.1:{tls_port}",
    }


def start_replica(
    kubeconfig: Path, ns: str, log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """A replica we may kill: ``running_operator`` insists its operator outlives the test."""
    return start_operator(kubeconfig, ns, log, env)


def lease(cluster: KubeCluster, ns: str) -> dict[str, Any]:
    body = get(cluster, f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{LEASE}")
    spec: dict[str, Any] = (body or {}).get("spec", {})
    return spec


def held_by(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any] | None:
    spec = lease(cluster, ns)
    holder = str(spec.get("holderIdentity", ""))
    return spec if holder.startswith(f"{name}_") else None  # <pod name>_<random>


def published_generation(cluster: KubeCluster, ns: str) -> int:
    configmap = get(cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
    assert configmap is not None
    return int(configmap["metadata"]["annotations"]["tokenfair.io/config-generation"])


def _answers(url: str) -> bool:
    try:
        return http_get(url)[0] == 200
    except OSError:
        return False


@pytest.fixture
def leader_process(
    operator_kubeconfig: Path, kube_namespace: str, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path, int]]:
    port, tls_port = free_ports(2)
    log = tmp_path / "leader.log"
    env = replica_env(kube_namespace, "op-a", port, tls_port, tmp_path / "certs-a")
    proc = start_replica(operator_kubeconfig, kube_namespace, log, env)
    try:
        yield proc, log, tls_port
    finally:
        stop_process(proc)
        print(f"--- leader log (tail) ---\n{log.read_text(errors='replace')[-4000:]}")


def test_one_leader_writes_the_standby_relays_and_takes_over(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    operator_kubeconfig: Path,
    leader_process: tuple[subprocess.Popen[bytes], Path, int],
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    leader, leader_log, leader_port = leader_process
    wait_for("op-a to hold the Lease", lambda: held_by(kube_cluster, ns, "op-a"))
    standby_plain_port, standby_port = free_ports(2)
    standby_env = replica_env(ns, "op-b", standby_plain_port, standby_port, tmp_path / "certs-b")
    with running_operator(
        operator_kubeconfig, ns, tmp_path / "standby.log", **standby_env
    ) as standby_log:
        health = f"http://127.0.0.1:{standby_plain_port}/healthz"
        wait_for("the standby's server", lambda: _answers(health))
        version = apply_lesson_and_wait(kube_cluster, ns)
        assert held_by(kube_cluster, ns, "op-a") is not None
        transitions = lease(kube_cluster, ns).get("leaseTransitions", 0)
        log_shows(leader_log, "published config version")
        assert "published config version" not in standby_log.read_text()

        # A sidecar sent to the standby gets the leader's document, relayed.
        token = token_file(kube_cluster, ns, "model", tmp_path).read_text()
        ca = published_ca(kube_cluster, ns, tmp_path)
        path = f"/v1/config/{ns}/pool?source=configmap&waitSeconds=0"
        direct = http_get(f"https://localhost:{leader_port}{path}", token, ca)
        relayed = http_get(f"https://localhost:{standby_port}{path}", token, ca)
        assert direct[0] == relayed[0] == 200
        assert direct[1]["X-Tokenfair-Config-Version"] == version
        assert relayed[1]["X-Tokenfair-Config-Version"] == version
        assert relayed[2] == direct[2]
        generation = int(direct[1]["X-Tokenfair-Config-Generation"])
        assert relayed[1]["X-Tokenfair-Config-Generation"] == str(generation)
        assert generation == published_generation(kube_cluster, ns)

        # The leader crashes: nothing releases the Lease.
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
        patch = json.dumps({"spec": {"weight": 5}})
        kube_cluster.kubectl("patch", "tq", "chat-pro", "-n", ns, "--type=merge", "-p", patch)

        spec = wait_for(
            "op-b to hold the Lease", lambda: held_by(kube_cluster, ns, "op-b"), FAILOVER_WAIT_S
        )
        assert spec["leaseTransitions"] == transitions + 1
        wait_for(
            "the change published by the new leader",
            lambda: with_weight(published(kube_cluster, ns), "tenant_chat_pro", 5.0),
            FAILOVER_WAIT_S,
        )
        assert published_generation(kube_cluster, ns) > generation  # continued, not restarted
        # Logged once the API server answered: the change may be seen before the line is there.
        text = log_shows(standby_log, "published config version")
        assert "became the leader" in text  # logged before its first pass
        assert text.count("conflict, retrying") <= 3  # no 409 storm
