"""The operator and the sidecar at 100 / 1,000 / 10,000 TenantQuotas in one policy (issue 13).

Per size, printed as one table (best of ``--repeat`` runs for each timed step, except the
reconcile passes, which run once):

* ``render_s`` — :func:`tokenfair_operator.render_config` (judging every quota, the document,
  its version, the read-back by the sidecar's loader, packing) with one API-key digest per
  tenant from its key Secret, budgets divided across 3 sidecars; target < 1 s at 10,000;
* ``doc_kB`` / ``stored_kB`` — the Secret's document as rendered and as stored (gzip above
  256 KiB); the API server refuses more than 1,048.6 kB (1 MiB) in one object;
* ``reload_s`` — the sidecar taking that stored Secret payload: ``loads_sidecar_file`` (gunzip,
  JSON, validation) + ``Scheduler.reconfigure`` of a ``tokenfair`` scheduler already holding
  the previous document (target < 1 s);
* ``admit_us`` — the sidecar's admission cost per request with that many tenants: ``submit`` +
  ``dispatch`` + ``complete`` of one request, averaged over 2,000 requests spread across tenants
  (it should stay flat from 100 to 10,000);
* with ``--kube`` (a real etcd + kube-apiserver from ``tests/kubecluster.py``; needs
  ``make controlplane``): the quotas and their key Secrets are created through the API, then
  the reconciler (:class:`tokenfair_operator.reconcile.Reconciler`, the code Kopf handlers
  call) runs, in one event loop as under Kopf:

  - ``first_s``: the first pass over the brand-new quotas until it returns, which is when the
    document is published (every key Secret read, rendered, ConfigMap and Secret written,
    served to the long-poll) and the policy's status written; target < 5 s. ``op_cpu_s`` and
    ``api_cpu_s``: the CPU seconds the bench process (the operator's code, every thread) and
    kube-apiserver spent during it, which the machine's other load does not inflate much
    (their sum over the 2 cores is the pass's floor on an idle machine);
  - ``statuses_s``: from the same start until the background writer has written every
    quota's status (paced, :data:`~tokenfair_operator.reconcile.STATUS_WRITES_PER_SECOND`);
  - ``steady_s``: a pass with nothing changed (the cache holds the keys: renders, writes
    nothing); ``change_s``: a pass after one quota's weight changed (a new document and the
    policy's status; that quota's status is queued);
  - ``refresh_s``: the resync's re-read of every key Secret (outside the policy's lock);
  - ``restart_s``: the first pass of a new reconciler (a restarted operator, a new leader)
    over that world, every quota published: its cold key cache is seeded from the stored
    document, so it serves the document without reading the key Secrets first;
  - with ``--first-runs N``, N - 1 more first passes, each by a new reconciler over the same
    quotas shown without their status (so none is seeded: every key Secret is read) after the
    ConfigMap and Secret were deleted (so both are written again): the same work as the first
    pass, printed one line each with the load average.

    .venv/bin/python bench/bench_operator_scale.py                # render + reload (~15 s)
    .venv/bin/python bench/bench_operator_scale.py --kube         # + passes on the API (~5 min)
    .venv/bin/python bench/bench_operator_scale.py --sizes 100,1000 --kube
    .venv/bin/python bench/bench_operator_scale.py --sizes 10000 --kube --first-runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # kubecluster: the control plane the tests build

import compiled_core  # noqa: E402, F401  (the compiled core, before the first tokenfair import)

from tokenfair.config import api_key_digest  # noqa: E402
from tokenfair.core import make_scheduler  # noqa: E402
from tokenfair.core.jobs import Request  # noqa: E402
from tokenfair.core.scheduler import Scheduler  # noqa: E402
from tokenfair.server.runtime_settings import loads_sidecar_file  # noqa: E402
from tokenfair_operator import PolicyView, QuotaView, render_config  # noqa: E402
from tokenfair_operator.reconcile import Reconciler  # noqa: E402
from tokenfair_operator.render import KeyLookup  # noqa: E402

REPLICAS: Final = 3
ADMIT_REQUESTS: Final = 2_000
NAMESPACE: Final = "bench"


def quota_spec(i: int) -> dict[str, Any]:
    return {
        "policyName": "pool",
        "weight": 1.0 + i % 4,
        "burstServiceTokens": 200_000,
        "sustainedServiceTokensPerSecond": 5_000.0,
        "priorityClass": "batch" if i % 2 else "interactive",
        "apiKeySecretRef": {"name": f"key-{i:05d}"},
    }


def world(n: int) -> tuple[PolicyView, list[QuotaView], dict[str, KeyLookup]]:
    policy = PolicyView("pool", NAMESPACE, "uid-pool", 1, "2026-01-01T00:00:00Z", {})
    quotas = [
        QuotaView(f"tenant-{i:05d}", NAMESPACE, f"uid-{i}", 1, _created(i), quota_spec(i))
        for i in range(n)
    ]
    keys: dict[str, KeyLookup] = {q.name: (api_key_digest(f"sk-{q.name}"),) for q in quotas}
    return policy, quotas, keys


def _created(i: int) -> str:
    return f"2026-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z"


def best_s(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def offline(n: int, repeat: int) -> dict[str, float]:
    policy, quotas, keys = world(n)
    render_s = best_s(repeat, lambda: render_config(policy, quotas, keys, REPLICAS))
    rendering = render_config(policy, quotas, keys, REPLICAS)
    payload = rendering.secret_payload
    before = render_config(policy, quotas[:-1], keys, REPLICAS).secret_payload
    scheduler = make_scheduler("tokenfair", loads_sidecar_file(before, "before").config)

    def reload() -> None:
        scheduler.reconfigure(loads_sidecar_file(payload, "secret").config, 0.0)

    reload_s = best_s(repeat, reload)
    return {
        "render_s": render_s,
        "doc_kB": len(rendering.secret_data["config.yaml"].encode()) / 1000,
        "stored_kB": len(payload) / 1000,
        "reload_s": reload_s,
        "admit_us": admission_us(scheduler, n),
    }


def admission_us(scheduler: Scheduler, n: int) -> float:
    """Mean µs of submit + dispatch + complete, one request at a time, tenants spread."""
    tenants = scheduler.config.tenants
    requests = []
    for k in range(ADMIT_REQUESTS):
        tenant = tenants[(k * 7919) % n]
        requests.append(
            Request(f"r{k}", tenant.tenant_id, float(k), 200, 50, tenant.priority_class)
        )
    started = time.perf_counter()
    for request in requests:
        now_ms = request.arrival_ms
        scheduler.submit(request, now_ms)
        while (decision := scheduler.next_dispatch(now_ms)) is not None:
            scheduler.complete(decision.request_id, now_ms)
    return (time.perf_counter() - started) / ADMIT_REQUESTS * 1e6


@contextlib.contextmanager
def cluster() -> Iterator[Any]:
    import kubecluster

    binaries = kubecluster.find_binaries()
    if isinstance(binaries, str):
        raise SystemExit(f"--kube: {binaries}")
    with kubecluster.running_cluster(binaries) as running:
        yield running


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def apiserver_pid(running: Any) -> int:
    """kube-apiserver of ``running`` (its command line names the cluster's folder)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kube-apiserver" in command and str(running.workdir).encode() in command:
            return int(entry.name)
    raise RuntimeError("kube-apiserver of the bench's cluster not found")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def on_kube(running: Any, n: int, first_runs: int = 1) -> dict[str, float]:
    from tokenfair_operator.kube import KubeApi, api_client

    ns = running.create_namespace("bench")
    api_path = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}"
    kind = {"apiVersion": "tokenfair.io/v1alpha1"}
    policy = {**kind, "kind": "SchedulingPolicy", "metadata": {"name": "pool"}, "spec": {}}
    running.expect(201, "POST", f"{api_path}/schedulingpolicies", policy)

    def create(i: int) -> None:  # not timed: the world the passes reconcile
        secret = {"metadata": {"name": f"key-{i:05d}"}, "stringData": {"k": f"sk-{i}"}}
        running.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)
        body = {**kind, "kind": "TenantQuota", "metadata": {"name": f"tenant-{i:05d}"}}
        running.expect(201, "POST", f"{api_path}/tenantquotas", body | {"spec": quota_spec(i)})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(create, range(n)))
    kube = KubeApi(api_client(str(running.kubeconfig)))
    logger = logging.getLogger("bench")
    api_pid = apiserver_pid(running)
    key = (ns, "pool")

    def objects() -> tuple[list[PolicyView], list[QuotaView]]:
        policy = kube.get_policy(ns, "pool")
        assert policy is not None
        return [policy], kube.list_quotas(ns)

    async def again(run: int) -> None:
        """One more first pass: a new reconciler, the quotas without their status (none is
        seeded from the stored document), the ConfigMap and Secret deleted (both written)."""
        policies, quotas = objects()
        fresh = [dataclasses.replace(q, status={}) for q in quotas]
        for kind, name in (("configmaps", "tokenfair-pool"), ("secrets", "tokenfair-pool-keys")):
            running.expect((200, 202), "DELETE", f"/api/v1/namespaces/{ns}/{kind}/{name}")
        cold = Reconciler(kube)
        try:
            cpu_before = time.process_time(), cpu_s(api_pid)
            started = time.perf_counter()
            await cold.reconcile(key, policies, fresh, logger)
            first_s = time.perf_counter() - started
            op_cpu_s = time.process_time() - cpu_before[0]
            api_cpu_s = cpu_s(api_pid) - cpu_before[1]
            assert cold.documents.get(key) is not None, "the pass published"
        finally:
            await cold.close()  # its queued statuses are dropped: the world stays as it is
        print(
            f"  first pass #{run} at {n}: {first_s:.3f} s (op_cpu {op_cpu_s:.2f} s, "
            f"api_cpu {api_cpu_s:.2f} s), {load()}",
            flush=True,
        )

    async def passes() -> dict[str, float]:
        reconciler = Reconciler(kube)

        async def timed_pass() -> float:
            policies, quotas = objects()  # the indexes' job under Kopf: not timed
            started = time.perf_counter()
            await reconciler.reconcile(key, policies, quotas, logger)
            return time.perf_counter() - started

        try:
            started = time.perf_counter()
            cpu_before = time.process_time(), cpu_s(api_pid)
            first_s = await timed_pass()
            op_cpu_s = time.process_time() - cpu_before[0]
            api_cpu_s = cpu_s(api_pid) - cpu_before[1]
            assert reconciler.documents.get(key) is not None, "the first pass published"
            await reconciler.drain()
            statuses_s = time.perf_counter() - started
            steady_s = await timed_pass()
            changed = {"spec": {"weight": 9.0}}
            running.request(
                "PATCH",
                f"{api_path}/tenantquotas/tenant-00000",
                changed,
                content_type="application/merge-patch+json",
            )
            change_s = await timed_pass()
            await reconciler.drain()
            quotas = objects()[1]
            unwritten = [q.name for q in quotas if not q.status.get("configVersion")]
            assert not unwritten, f"{len(unwritten)} quota(s) without a status"
            started = time.perf_counter()
            await reconciler.refresh_keys(quotas)
            refresh_s = time.perf_counter() - started
        finally:
            await reconciler.close()
        restarted = Reconciler(kube)
        try:
            policies, quotas = objects()
            started = time.perf_counter()
            await restarted.reconcile(key, policies, quotas, logger)
            restart_s = time.perf_counter() - started
            served, stored = restarted.documents.get(key), reconciler.documents.get(key)
            assert served is not None
            assert stored is not None
            assert served.version == stored.version, "a new leader serves the same document"
        finally:
            await restarted.close()
        for run in range(2, first_runs + 1):
            await again(run)
        return {
            "first_s": first_s,
            "op_cpu_s": op_cpu_s,
            "api_cpu_s": api_cpu_s,
            "statuses_s": statuses_s,
            "steady_s": steady_s,
            "change_s": change_s,
            "refresh_s": refresh_s,
            "restart_s": restart_s,
        }

    row = asyncio.run(passes())
    running.delete_namespace(ns)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="quota counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="best of N for offline steps")
    parser.add_argument("--kube", action="store_true", help="also time passes on a real API")
    parser.add_argument(
        "--first-runs", type=int, default=1, help="with --kube: first passes per size (>= 1)"
    )
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C: the control plane's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(s) for s in args.sizes.split(",")]
    columns = ["render_s", "doc_kB", "stored_kB", "reload_s", "admit_us"]
    if args.kube:
        columns += ["first_s", "op_cpu_s", "api_cpu_s", "statuses_s", "steady_s", "change_s"]
        columns += ["refresh_s", "restart_s"]
    print(f"{'quotas':>7} " + " ".join(f"{c:>10}" for c in columns))
    with cluster() if args.kube else contextlib.nullcontext() as running:
        rows = {}
        for n in sizes:
            row = offline(n, args.repeat)
            if running is not None:
                row |= on_kube(running, n, args.first_runs)
            rows[n] = row
            print(f"{n:>7} " + " ".join(f"{row[c]:>10.3f}" for c in columns), flush=True)
            print(f"  ({load()} after {n})", flush=True)
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        ratio = rows[large]["render_s"] / rows[small]["render_s"]
        print(
            f"render {large} / {small}: x{ratio:.0f} for x{large // small} quotas "
            "(linear is the ratio of the counts)"
        )


if __name__ == "__main__":
    main()
