"""Apply-to-enforced latency of a quota change, on the real control plane (issue 13, part 1).

A real etcd + kube-apiserver (``tests/kubecluster.py``, needs ``make controlplane``), the
operator (``kopf run -m tokenfair_operator.handlers``) with the shipped RBAC, the shipped resync
and usage periods and its document server on its TLS port, and ``N`` ``tokenfair sidecar``
processes long-polling it (``tokenfair.server.config_feed``) as the injected Pods of one
policy do: over TLS, verifying the server with the CA bundle the operator publishes into the
namespace (ConfigMap ``tokenfair.io-ca.crt``), showing a TokenRequest token of their
ServiceAccount for the audience ``tokenfair-config``. The wiring is
``tests/operator/test_propagation.py``'s (its helpers are imported). The file each sidecar
started from is never rewritten: the kubelet's volume refresh (~60 s by default, plus the
sidecar's 1 s poll) is what this replaces.

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
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # kubecluster and the operator tests' support modules

POLL_S: Final = 0.01
TIMEOUT_S: Final = 60.0
LOCAL: Final = "127.0.0.1,localhost"
TLS_LOG: Final = "answers (server verified with"
"""What a sidecar logs once its long-poll got an answer over TLS, verified with the CA file."""
T = TypeVar("T")


def version_of(admin: str) -> str | None:
    from operator_support import sidecar_status

    body = sidecar_status(admin)
    return None if body is None else str(body["config"]["version"])


def over_tls(log: Path) -> bool:
    """Whether a sidecar's log shows its long-poll answered over TLS, verified with its CA."""
    return TLS_LOG in log.read_text(errors="replace")


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


@contextlib.contextmanager
def operator(kubeconfig: Path, ns: str, log: Path, env: dict[str, str]) -> Iterator[None]:
    """The operator as the tests start it, with the shipped resync and usage periods (the tests'
    are 1 s); on exit, stopped, and a refused API call in its log fails the run."""
    from kubecluster import stop_process
    from operator_support import start_operator

    from tokenfair_operator.settings import (
        DEFAULT_RESYNC_S,
        DEFAULT_USAGE_S,
        RESYNC_ENV,
        USAGE_ENV,
    )

    shipped = {RESYNC_ENV: str(DEFAULT_RESYNC_S), USAGE_ENV: str(DEFAULT_USAGE_S)}
    proc = start_operator(kubeconfig, ns, log, {**env, **shipped})
    try:
        yield
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    if "Forbidden" in text or " 403" in text:
        raise SystemExit(f"the operator hit a refused API call:\n{text[-4000:]}")


def operator_kubeconfig(cluster: Any, folder: Path) -> Path:
    """The shipped RBAC applied and a kubeconfig of its ServiceAccount (as the tests' fixture)."""
    from operator_support import shipped_rbac_kubeconfig

    return shipped_rbac_kubeconfig(cluster, folder / "kubeconfig")


def wait_until(what: str, probe: Callable[[], T | None], timeout_s: float = TIMEOUT_S) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def run(sidecar_count: int, rounds: int) -> None:
    import kubecluster
    from loopback_support import free_ports
    from operator_support import get
    from propagation_support import (
        TRUST_CONFIGMAP,
        apply_lesson_and_wait,
        long_poll_env,
        published_ca,
        stored_configmap,
        tls_env,
        token_file,
    )

    from tokenfair_operator.settings import DEFAULT_RESYNC_S

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
        kubeconfig = operator_kubeconfig(cluster, folder)
        ns = cluster.create_namespace("bench")
        token = token_file(cluster, ns, "model", folder)  # TokenRequest, "tokenfair-config"
        (https_port,) = free_ports(1)
        env = tls_env(ns, https_port, folder / "operator.certs")
        stack.enter_context(operator(kubeconfig, ns, folder / "operator.log", env))
        apply_lesson_and_wait(cluster, ns)

        # The leader writes the CA bundle on its resync round (30 s): at most one round away.
        def trust() -> bool:
            return get(cluster, f"/api/v1/namespaces/{ns}/configmaps/{TRUST_CONFIGMAP}") is not None

        wait_until("the CA bundle published", trust, 2 * DEFAULT_RESYNC_S + TIMEOUT_S)
        ca = published_ca(cluster, ns, folder)
        config_file = folder / "config.yaml"
        config_file.write_bytes(stored_configmap(cluster, ns))  # the kubelet, once
        base = f"https://localhost:{https_port}"
        sidecar_env = {**long_poll_env(base, ns, token, ca), "NO_PROXY": LOCAL, "no_proxy": LOCAL}
        admins: list[str] = []
        logs: list[Path] = []
        for i in range(sidecar_count):
            proxy_port, admin_port = free_ports(2)
            cmd = [str(bin_dir / "tokenfair"), "sidecar", "--config", str(config_file)]
            cmd += ["--backend", "costmodel", "--listen", f"127.0.0.1:{proxy_port}"]
            cmd += ["--admin-listen", f"127.0.0.1:{admin_port}"]
            logs.append(folder / f"sidecar-{i}.log")
            stack.enter_context(process(cmd, logs[-1], sidecar_env))
            admins.append(f"http://127.0.0.1:{admin_port}")
        for admin in admins:
            wait_until(f"{admin} up", functools.partial(version_of, admin))
        for log in logs:  # every long-poll answered over TLS before the first round
            wait_until(f"{log.name}: the long-poll over TLS", functools.partial(over_tls, log))

        quota = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/tenantquotas/chat-pro"
        samples: list[float] = []
        print(
            f"{sidecar_count} sidecars, {rounds} rounds, long-poll over TLS (the operator's CA, "
            "audience tokens): apply -> every sidecar on the version"
        )
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
