"""The operator as users run it, over 1,000 and 10,000 TenantQuotas (issue 33).

The chart's Deployment, run as a local process on a real kube-apiserver and etcd
(``tests/kubecluster.py``; needs ``make controlplane tools``): ``kopf run -m
tokenfair_operator.handlers --standalone --all-namespaces`` with the chart's environment
(leader election, resync 30 s, usage 15 s), the shipped RBAC's token, one policy whose quotas
each name a key Secret. Two shapes, each in a fresh namespace:

* ``present`` — the policy, the key Secrets and the quotas stored first (an install onto a
  cluster that has them, a namespace restored from a backup), then the operator started.
  From the start of its process: ``published_s``, the first document holding every tenant
  stored in the ConfigMap (target < 15 s at 10,000); ``ready_s``, the policy ``Ready`` with
  every tenant (< 60 s); ``statuses_s``, every quota ``Ready`` (written in the background at
  200 a second: 50 s at least for 10,000; no target, shown for what it is);
* ``bulk`` — the operator running over the policy and the key Secrets, then the quotas created
  at once (16 creations in flight, what ``kubectl apply`` of a folder does, faster). From the
  moment the last quota was stored: ``published_s`` (target < 15 s at 10,000), ``ready_s``,
  ``statuses_s``; and ``apply_s``, how long the creations took.

For each: ``documents``, how many documents were stored meanwhile, and whether every one held
at least as many tenants as the one before it (target: never fewer while nothing is deleted;
the ConfigMap is watched, so none is missed), ``op_cpu_s`` (the operator's CPU seconds until
``published_s``), its peak resident memory at the end of the run (the chart's limit is 512 MiB),
and the machine's load average. Then, per shape, the time per quota at the
largest size over the smallest (target <= 2: linear), of the figure from the operator's start
(``present``) or from the first creation (``bulk``) to the document with every tenant.

Baseline, same run (unless ``--no-baseline``): after each ``present`` run, the reconciler's
first pass alone over the same quotas (``Reconciler.reconcile`` called in this process, the
quotas shown without status so every key Secret is read, the ConfigMap and Secret deleted so
both are written), as ``bench_operator_scale.py --kube`` measures it: what ``kopf run`` adds
on top of it is the process's start, Kopf's listing and our handlers.

    .venv/bin/python bench/bench_operator_run.py                         # ~6 min
    .venv/bin/python bench/bench_operator_run.py --sizes 1000 --shapes present
    .venv/bin/python bench/bench_operator_run.py --operator-path /tmp/old/operator  # another tree

``--operator-path DIR`` runs the operator from the package in ``DIR`` (e.g. ``operator/`` of
another commit, exported with ``git archive``): before/after on one machine, one bench.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the control plane and the chart's operator, as tested

import kubecluster  # noqa: E402
from bench_operator_scale import cpu_s, load  # noqa: E402
from operator_run_support import (  # noqa: E402
    API,
    POLICY,
    DocumentRecorder,
    chart_operator_command,
    create_in_parallel,
    create_policy,
    key_secrets,
    never_fewer,
    quotas,
)
from operator_support import shipped_rbac_kubeconfig  # noqa: E402

LEASE_NAMESPACE: Final = "tokenfair-system"
PUBLISHED_TARGET_S: Final = 15.0
READY_TARGET_S: Final = 60.0
RATIO_TARGET: Final = 2.0
POLL_S: Final = 0.2
MILESTONES: Final = ("startup listing", "startup passes over", "initial listing over")
"""Log lines shown per run: the operator's own listing, its passes, Kopf's listing."""
STATUS_POLL_S: Final = 2.0
"""Every quota's status is read in one LIST of up to 10,000 objects: not too often, so the
polling does not load the API server the operator shares."""


@dataclasses.dataclass
class Run:
    shape: str
    quotas: int
    published_s: float | None = None
    ready_s: float | None = None
    statuses_s: float | None = None
    apply_s: float | None = None
    total_s: float | None = None
    """From the operator's start (present) or the first creation (bulk) to ``published_s``."""
    op_cpu_s: float = 0.0
    op_peak_mib: float = 0.0
    """The operator's peak resident memory (``VmHWM``) when the run ended (the chart's limit:
    512 MiB)."""
    baseline_s: float | None = None
    """The reconciler's first pass alone over the same world (:func:`reconciler_alone`)."""
    documents: int = 0
    counts: list[int] = dataclasses.field(default_factory=list)
    load: str = ""


def wait_until(probe: Callable[[], bool], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(POLL_S)
    return probe()


def policy_ready(cluster: Any, ns: str, tenants: int) -> bool:
    body = cluster.request("GET", f"{API}/namespaces/{ns}/schedulingpolicies/{POLICY}").body
    status = body.get("status", {})
    ready = {c.get("type"): c.get("status") for c in status.get("conditions", [])}.get("Ready")
    return bool(status.get("tenants") == tenants and ready == "True")


def quotas_ready(cluster: Any, ns: str, count: int) -> bool:
    try:
        listing = cluster.request("GET", f"{API}/namespaces/{ns}/tenantquotas").body
    except OSError:  # a LIST of 10,000 timing out on a loaded machine: asked again next poll
        return False
    items = listing.get("items", [])
    ready = 0
    for item in items:
        conditions = item.get("status", {}).get("conditions", [])
        ready += any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready == count


def policy_written(cluster: Any, ns: str) -> bool:
    body = cluster.request("GET", f"{API}/namespaces/{ns}/schedulingpolicies/{POLICY}").body
    return bool(body.get("status", {}).get("conditions"))


def measure(
    cluster: Any,
    kubeconfig: Path,
    shape: str,
    n: int,
    timeout_s: float,
    operator_path: str | None,
    folder: Path,
    baseline: bool,
) -> Run:
    ns = cluster.create_namespace(shape)
    run = Run(shape, n)
    try:
        create_policy(cluster, ns)
        create_in_parallel(cluster, key_secrets(ns, n))
        if shape == "present":
            create_in_parallel(cluster, quotas(ns, n))
        command, env = chart_operator_command(kubeconfig, LEASE_NAMESPACE, f"bench-{shape}")
        if operator_path:
            env["PYTHONPATH"] = os.pathsep.join([operator_path, env.get("PYTHONPATH", "")])
        log = folder / f"operator-{shape}-{n}.log"
        with DocumentRecorder(cluster, ns) as recorder, log.open("wb") as out:
            started = time.monotonic()
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                run_shape(cluster, ns, run, recorder, proc, started, timeout_s)
                run.op_peak_mib = peak_mib(proc.pid)
            finally:
                kubecluster.stop_process(proc)
            run.counts = recorder.tenant_counts()
            run.documents = len(run.counts)
        run.load = load()
        if baseline and shape == "present" and run.published_s is not None:
            run.baseline_s = reconciler_alone(cluster, ns)
        return run
    finally:
        delete_and_wait(cluster, ns)


def run_shape(
    cluster: Any,
    ns: str,
    run: Run,
    recorder: DocumentRecorder,
    proc: subprocess.Popen[bytes],
    started: float,
    timeout_s: float,
) -> None:
    n = run.quotas
    if run.shape == "bulk":
        # Running: its first pass wrote the policy's status (no tenant yet).
        if not wait_until(lambda: policy_written(cluster, ns), started + timeout_s):
            raise SystemExit("bulk: the operator never wrote the policy's status")
        first = time.monotonic()
        create_in_parallel(cluster, quotas(ns, n))
        origin = time.monotonic()
        run.apply_s = origin - first
    else:
        first = origin = started
    deadline = origin + timeout_s
    full = recorder.wait(
        lambda docs: bool(docs) and docs[-1].tenants == n, deadline - time.monotonic()
    )
    run.op_cpu_s = cpu_s(proc.pid)
    if not full:
        return
    at = next(d.at_s for d in recorder.documents if d.tenants == n)
    run.published_s, run.total_s = at - origin, at - first
    if wait_until(lambda: policy_ready(cluster, ns, n), deadline):
        run.ready_s = time.monotonic() - origin
    while time.monotonic() < deadline:
        if quotas_ready(cluster, ns, n):
            run.statuses_s = time.monotonic() - origin
            break
        time.sleep(STATUS_POLL_S)


def peak_mib(pid: int) -> float:
    """Peak resident memory of process ``pid`` so far, MiB (Linux ``/proc``: ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def delete_and_wait(cluster: Any, ns: str) -> None:
    """Delete ``ns`` and wait until it is gone (the next operator, watching every namespace,
    must not list this one's objects)."""
    cluster.delete_namespace(ns)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if cluster.request("GET", f"/api/v1/namespaces/{ns}").status == 404:
            return
        time.sleep(1)
    print(f"  (namespace {ns} still there after 300 s)", flush=True)


def reconciler_alone(cluster: Any, ns: str) -> float:
    """The reconciler's first pass alone over ``ns``'s policy and quotas, in this process, as
    ``bench_operator_scale.py`` measures it: a new reconciler, the quotas shown without their
    status (none is seeded from the stored document: every key Secret is read), the ConfigMap
    and Secret deleted (both written again). Seconds until it published."""
    from tokenfair_operator.kube import KubeApi, api_client
    from tokenfair_operator.reconcile import Reconciler

    kube = KubeApi(api_client(str(cluster.kubeconfig)))
    policy = kube.get_policy(ns, POLICY)
    assert policy is not None
    listed = [dataclasses.replace(q, status={}) for q in kube.list_quotas(ns)]
    for kind, name in (
        ("configmaps", f"tokenfair-{POLICY}"),
        ("secrets", f"tokenfair-{POLICY}-keys"),
    ):
        cluster.expect((200, 202), "DELETE", f"/api/v1/namespaces/{ns}/{kind}/{name}")

    async def first_pass() -> float:
        reconciler = Reconciler(kube)
        try:
            began = time.perf_counter()
            await reconciler.reconcile((ns, POLICY), [policy], listed, logging.getLogger())
            elapsed = time.perf_counter() - began
            assert reconciler.documents.get((ns, POLICY)) is not None
            return elapsed
        finally:
            await reconciler.close()  # its queued statuses are dropped

    return asyncio.run(first_pass())


def seconds(value: float | None, timeout_s: float) -> str:
    return f"{value:.2f} s" if value is not None else f"> {timeout_s:.0f} s"


def verdict(value: float | None, target: float) -> str:
    return "PASS" if value is not None and value < target else "FAIL"


def report(run: Run, timeout_s: float) -> None:
    since = "operator start" if run.shape == "present" else "last quota stored"
    head = f"{run.shape:<8} {run.quotas:>6}"
    rows = [
        (
            f"published, all tenants (since {since})",
            run.published_s,
            f"< {PUBLISHED_TARGET_S:.0f} s",
        ),
        ("policy Ready, all tenants", run.ready_s, f"< {READY_TARGET_S:.0f} s"),
        ("every quota Ready (paced 200/s)", run.statuses_s, "(none)"),
    ]
    for what, value, target in rows:
        mark = ""
        if target.startswith("<"):
            mark = verdict(value, PUBLISHED_TARGET_S if "published" in what else READY_TARGET_S)
        print(f"{head}  {what:<46} {seconds(value, timeout_s):>10}  {target:<8} {mark}".rstrip())
    if run.apply_s is not None:
        print(f"{head}  {'creating the quotas took':<46} {run.apply_s:>8.2f} s")
    monotone = never_fewer(run.counts)
    shown = run.counts if len(run.counts) <= 12 else [*run.counts[:6], "...", *run.counts[-5:]]
    print(
        f"{head}  documents stored: {run.documents}, tenants {shown}; never fewer than the one "
        f"before: {'PASS' if monotone else 'FAIL'}"
    )
    print(
        f"{head}  operator CPU until published: {run.op_cpu_s:.1f} s; peak memory "
        f"{run.op_peak_mib:.0f} MiB; {run.load}",
        flush=True,
    )
    if run.baseline_s is not None:
        print(
            f"{head}  baseline, same world: the reconciler's first pass alone "
            f"{run.baseline_s:.2f} s; {load()}",
            flush=True,
        )


def ratios(runs: list[Run]) -> None:
    for shape in ("present", "bulk"):
        done = sorted((r for r in runs if r.shape == shape), key=lambda r: r.quotas)
        if len(done) < 2:
            continue
        small, large = done[0], done[-1]
        if small.total_s is None or large.total_s is None:
            print(f"{shape:<8} time per quota {large.quotas} / {small.quotas}: not published")
            continue
        ratio = (large.total_s / large.quotas) / (small.total_s / small.quotas)
        since = "operator start" if shape == "present" else "first quota created"
        print(
            f"{shape:<8} time per quota (since {since}) at {large.quotas} / at {small.quotas}: "
            f"x{ratio:.2f}  target <= {RATIO_TARGET:.0f}: "
            f"{'PASS' if ratio <= RATIO_TARGET else 'FAIL'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="quota counts, comma-separated")
    parser.add_argument("--shapes", default="present,bulk", help="present, bulk or both")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per wait")
    parser.add_argument("--no-baseline", action="store_true", help="skip the reconciler alone")
    parser.add_argument("--operator-path", help="run the operator package found in this folder")
    parser.add_argument("--logs", help="keep the operators' logs in this folder")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",")]
    if unknown := set(shapes) - {"present", "bulk"}:
        raise SystemExit(f"--shapes: unknown {sorted(unknown)} (present, bulk)")
    binaries = kubecluster.find_binaries()
    if isinstance(binaries, str):
        raise SystemExit(binaries)
    print(
        f"bench_operator_run: sizes {sizes}, shapes {shapes}, operator from "
        f"{args.operator_path or 'this tree'}; {load()}",
        flush=True,
    )
    with kubecluster.running_cluster(binaries) as running, tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.logs or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        kubeconfig = shipped_rbac_kubeconfig(running, folder / "kubeconfig")
        runs: list[Run] = []
        for n in sizes:
            for shape in shapes:
                baseline = not args.no_baseline
                run = measure(
                    running,
                    kubeconfig,
                    shape,
                    n,
                    args.timeout,
                    args.operator_path,
                    folder,
                    baseline,
                )
                report(run, args.timeout)
                runs.append(run)
        ratios(runs)
        logs = sorted(folder.glob("operator-*.log"))
        for path in logs:
            text = path.read_text(errors="replace")
            conflicts = text.count("conflict, retrying")
            print(f"{path.name}: {len(text.splitlines())} log lines, {conflicts} conflict retries")
            for line in text.splitlines():  # where the start's time went, as the log says
                if any(mark in line for mark in MILESTONES):
                    print(f"    {line[-150:]}")


if __name__ == "__main__":
    main()
