"""Operator failover: kill the leader, time until the standby has published a change.

A real etcd + kube-apiserver (``tests/kubecluster.py``; needs ``make controlplane``) and two
operator replicas (``kopf run -m tokenfair_operator.handlers`` with
``$TOKENFAIR_LEADER_ELECTION=true``) on one Lease. Each round: the leader is stopped, a
TenantQuota's weight is patched at once, and the time from the stop to the new weight in the
policy's ConfigMap is measured (polled every 50 ms); the stopped replica is restarted as the
next standby. ``crash`` rounds SIGKILL the leader (the Lease must expire: the
``LEASE_DURATION_S`` of ``tokenfair_operator.leader``); ``clean`` rounds SIGTERM it (it
releases the Lease). Target: crash failover < 15 s.

    .venv/bin/python bench/bench_failover.py              # 3 crash + 3 clean rounds (~2 min)
    .venv/bin/python bench/bench_failover.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # kubecluster: the control plane the tests build

LESSON: Final = ROOT / "tests" / "data" / "operator" / "lesson-tenants.yaml"
TIMEOUT_S: Final = 90.0


def start(cluster: Any, ns: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "TOKENFAIR_LEADER_ELECTION": "true",
        "TOKENFAIR_LEASE_NAMESPACE": ns,
        "TOKENFAIR_POD_NAME": name,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    cmd = [sys.executable, "-m", "kopf", "run", "-m", "tokenfair_operator.handlers"]
    cmd += ["--namespace", ns, "--standalone"]
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def holder(cluster: Any, ns: str) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/tokenfair-operator"
    identity = cluster.request("GET", path).body.get("spec", {}).get("holderIdentity") or ""
    return str(identity).rpartition("_")[0]  # <name>_<random per process>


def weight(cluster: Any, ns: str) -> float | None:
    body = cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool").body
    text = body.get("data", {}).get("config.yaml")
    if text is None:
        return None
    tenants = json.loads(text)["tenants"]
    return float(next(t["weight"] for t in tenants if t["tenantId"] == "tenant_chat_pro"))


def until(what: str, probe: Any, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(what)


def run(rounds: int) -> None:
    import kubecluster

    binaries = kubecluster.find_binaries()
    if isinstance(binaries, str):
        raise SystemExit(binaries)
    with kubecluster.running_cluster(binaries) as cluster, tempfile.TemporaryDirectory() as tmp:
        ns = cluster.create_namespace("bench")
        folder = Path(tmp)
        replicas = {"op-a": start(cluster, ns, "op-a", folder / "op-a.log")}
        try:
            until("op-a leads", lambda: holder(cluster, ns) == "op-a")
            replicas["op-b"] = start(cluster, ns, "op-b", folder / "op-b.log")
            cluster.kubectl("apply", "-n", ns, "-f", str(LESSON))
            until("published", lambda: weight(cluster, ns))
            time.sleep(3)  # the standby up and watching
            quota = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/tenantquotas/chat-pro"
            results: dict[str, list[float]] = {"crash": [], "clean": []}
            step = 0
            for kind in ("crash", "clean"):
                for _ in range(rounds):
                    step += 1
                    leader = holder(cluster, ns)
                    standby = next(name for name in replicas if name != leader)
                    sig = signal.SIGKILL if kind == "crash" else signal.SIGTERM
                    t0 = time.monotonic()
                    os.killpg(replicas[leader].pid, sig)
                    new_weight = 10.0 + step  # none of the lesson's weights
                    body = {"spec": {"weight": new_weight}}
                    cluster.request(
                        "PATCH", quota, body, content_type="application/merge-patch+json"
                    )
                    until("the change", lambda w=new_weight: weight(cluster, ns) == w)
                    elapsed = time.monotonic() - t0
                    results[kind].append(elapsed)
                    print(f"  {kind:5s} {leader} -> {standby}: {elapsed:6.2f} s", flush=True)
                    replicas[leader].wait()
                    replicas[leader] = start(cluster, ns, leader, folder / f"{leader}.log")
                    until("the new leader", lambda s=standby: holder(cluster, ns) == s)
                    time.sleep(3)  # the restarted standby up and watching
            for kind, times in results.items():
                print(
                    f"{kind}: stop -> change published by the standby: "
                    f"min {min(times):.2f} s, max {max(times):.2f} s over {len(times)} rounds"
                )
        finally:
            for proc in replicas.values():
                kubecluster.stop_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args.rounds)


if __name__ == "__main__":
    main()
