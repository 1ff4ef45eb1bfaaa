"""Apply-to-enforced latency of a quota change, on the real control plane (issue 13, part 1).

A real etcd + kube-apiserver (``tests/kubecluster.py``, needs ``make controlplane``), the
operator (``kopf run -m tokenfair_operator.handlers``) with its document server, and ``N``
``tokenfair sidecar`` processes long-polling it (``tokenfair_sidecar.server.remote``) as the
Pods of one policy do. The file each sidecar started from is never rewritten: the kubelet's
volume refresh (~60 s by default, plus the sidecar's 1 s poll) is what this replaces.

Each round patches one TenantQuota's burst through the API; ``t0`` is when the API server
answered the PATCH. Every sidecar's ``/status`` is polled every :data:`POLL_S` seconds until
it reports a new config version; its latency is that moment minus ``t0`` (so it includes up
to one poll interval). Printed: per-round max over the sidecars, and p50/p99 over every
(round, sidecar) sample; target p99 < 2 s.

    .venv/bin/python bench/bench_propagation.py                 # 5 sidecars, 20 rounds (~1 min)
    .venv/bin/python bench/bench_propagation.py --sidecars 10 --rounds 50
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # kubecluster: the control plane the tests build

POLL_S: Final = 0.01
TIMEOUT_S: Final = 60.0
LESSON: Final = ROOT / "tests" / "data" / "operator" / "lesson-tenants.yaml"


def status(admin: str) -> dict[str, Any] | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{admin}/status", timeout=5) as response:
            body = json.loads(response.read())
    except OSError:
        return None
    return body if isinstance(body, dict) else None


def version_of(admin: str) -> str | None:
    body = status(admin)
    return None if body is None else str(body["config"]["version"])


def wait_change(admin: str, old: str, t0: float) -> float:
    """Seconds from ``t0`` until ``admin`` runs a version other than ``old``."""
    while time.monotonic() - t0 < TIMEOUT_S:
        version = version_of(admin)
        if version is not None and version != old:
            return time.monotonic() - t0
        time.sleep(POLL_S)
    raise TimeoutError(f"{admin} still on {old} after {TIMEOUT_S} s")


@contextlib.contextmanager
def process(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[None]:
    from kubecluster import stop_process

    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
            start_new_session=True,
        )  # fmt: skip
    try:
        yield
    finally:
        stop_process(proc)


def wait_until(what: str, probe: Any, timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def run(sidecar_count: int, rounds: int) -> None:
    import kubecluster

    binaries = kubecluster.find_binaries()
    if isinstance(binaries, str):
        raise SystemExit(binaries)
    bin_dir = Path(sys.executable).parent
    with (
        kubecluster.running_cluster(binaries) as cluster,
        tempfile.TemporaryDirectory() as tmp,
        contextlib.ExitStack() as stack,
    ):
        folder = Path(tmp)
        ns = cluster.create_namespace("bench")
        cluster.create_service_account(ns, "model")
        token = folder / "token"
        token.write_text(cluster.service_account_token(ns, "model"))
        (http_port,) = kubecluster.free_ports(1)
        env = {
            "KUBECONFIG": str(cluster.kubeconfig),
            "TOKENFAIR_HTTP_PORT": str(http_port),
            "TOKENFAIR_HTTP_ADDR": "127.0.0.1",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        kopf = [str(bin_dir / "python"), "-m", "kopf", "run", "-m", "tokenfair_operator.handlers"]
        stack.enter_context(
            process([*kopf, "--namespace", ns, "--standalone"], folder / "operator.log", env)
        )
        cluster.kubectl("apply", "-n", ns, "-f", str(LESSON))
        policy_path = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/schedulingpolicies/pool"

        def published() -> bool:
            body = cluster.request("GET", policy_path).body
            return bool(body.get("status", {}).get("tenants") == 3)

        wait_until("the policy published", published)
        configmap = cluster.request("GET", f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
        config_file = folder / "config.yaml"
        config_file.write_text(configmap.body["data"]["config.yaml"])
        sidecar_env = {
            "TOKENFAIR_CONFIG_URL": f"http://127.0.0.1:{http_port}/v1/config/{ns}/pool"
            "?source=configmap",
            "TOKENFAIR_CONFIG_TOKEN_FILE": str(token),
        }
        admins: list[str] = []
        for i in range(sidecar_count):
            proxy_port, admin_port = kubecluster.free_ports(2)
            cmd = [str(bin_dir / "tokenfair"), "sidecar", "--config", str(config_file)]
            cmd += ["--backend", "costmodel", "--listen", f"127.0.0.1:{proxy_port}"]
            cmd += ["--admin-listen", f"127.0.0.1:{admin_port}"]
            stack.enter_context(process(cmd, folder / f"sidecar-{i}.log", sidecar_env))
            admins.append(f"http://127.0.0.1:{admin_port}")
        for admin in admins:
            wait_until(f"{admin} up", lambda admin=admin: version_of(admin))

        quota = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/tenantquotas/chat-pro"
        samples: list[float] = []
        print(f"{sidecar_count} sidecars, {rounds} rounds: apply -> every sidecar on the version")
        with concurrent.futures.ThreadPoolExecutor(sidecar_count) as pool:
            for n in range(rounds):
                olds = [version_of(admin) or "" for admin in admins]
                body = {"spec": {"burstServiceTokens": 40_000 + n}}
                resp = cluster.request(
                    "PATCH", quota, body, content_type="application/merge-patch+json"
                )
                t0 = time.monotonic()
                assert resp.status == 200, resp.body
                futures = [
                    pool.submit(wait_change, admin, old, t0)
                    for admin, old in zip(admins, olds, strict=True)
                ]
                latencies = [f.result() for f in futures]
                samples += latencies
                print(f"  round {n + 1:2d}: max {max(latencies) * 1000:7.1f} ms")
                time.sleep(0.2)
        samples.sort()
        p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        print(
            f"p50 {statistics.median(samples) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
            f"max {samples[-1] * 1000:.1f} ms over {len(samples)} samples "
            f"(status polled every {POLL_S * 1000:.0f} ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sidecars", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args.sidecars, args.rounds)


if __name__ == "__main__":
    main()
