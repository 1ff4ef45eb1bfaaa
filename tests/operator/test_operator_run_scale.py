"""The operator run as the chart's Deployment runs it, over thousands of TenantQuotas.

Behaviours under test, on the real control plane with the shipped RBAC, the operator a
``kopf run -m tokenfair_operator.handlers --standalone --all-namespaces`` process with the
chart's environment (``helm template`` of the default values: leader election on the Lease,
its sidecar defaults), except a resync every second (the chart's is 30 s), so that resync rounds
fall inside Kopf's initial listing, where they would publish a half-listed view:

- quotas present before the start (an install onto a cluster that has them): the leader lists
  them itself at startup (``startview``: its log says so), the first document the operator
  stores holds every tenant (none from a half-filled index, however many resync rounds came
  meanwhile), no later one holds fewer, the policy becomes ``Ready`` with all of them and so
  does every quota;
- a bulk apply into the running operator: no document ever holds fewer tenants than the one
  before it (nothing is deleted), the last holds every tenant, the policy is ``Ready`` with all
  of them;
- the operator's log shows no API call refused.

The figures (10,000 quotas, the time per quota from 1,000) are ``bench/bench_operator_run.py``'s;
nothing here asserts a duration: every wait is a generous bound for a loaded 2-core machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from chart_support import assert_never_refused
from kubecluster import KubeCluster
from operator_run_support import (
    API,
    POLICY,
    DocumentRecorder,
    chart_operator,
    create_in_parallel,
    create_policy,
    key_secrets,
    never_fewer,
    quotas,
)
from operator_support import condition, get, wait_for

QUOTAS = 2_000
"""Enough that Kopf's listing spans several resync rounds on the test machine."""
RESYNC_S = "1"
# Generous: thousands of creations, key reads and statuses on a loaded 2-core machine.
PUBLISH_WAIT_S = 300.0
STATUS_WAIT_S = 300.0


@pytest.fixture
def operator_log(tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "operator.log"
    yield log
    text = log.read_text(errors="replace") if log.exists() else ""
    print(f"--- operator log (tail) ---\n{text[-6000:]}")  # shown when the test fails


def policy_ready(cluster: KubeCluster, ns: str, tenants: int) -> bool:
    policy = get(cluster, f"{API}/namespaces/{ns}/schedulingpolicies/{POLICY}")
    status = (policy or {}).get("status", {})
    return bool(status.get("tenants") == tenants and condition(policy)["status"] == "True")


def every_quota_ready(cluster: KubeCluster, ns: str) -> bool:
    items = cluster.expect(200, "GET", f"{API}/namespaces/{ns}/tenantquotas").body["items"]
    return len(items) == QUOTAS and all(condition(q).get("status") == "True" for q in items)


def published_whole(cluster: KubeCluster, ns: str, recorder: DocumentRecorder) -> list[int]:
    """Wait for a document holding every tenant and the policy ``Ready`` with all of them; the
    tenant counts of the documents stored so far."""
    published = recorder.wait(
        lambda docs: bool(docs) and docs[-1].tenants == QUOTAS, PUBLISH_WAIT_S
    )
    assert published, f"documents stored: {recorder.tenant_counts()}"
    wait_for("the policy Ready", lambda: policy_ready(cluster, ns, QUOTAS), STATUS_WAIT_S)
    return recorder.tenant_counts()


def test_quotas_present_before_the_start_are_published_whole(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    operator_kubeconfig: Path,
    operator_log: Path,
) -> None:
    ns = kube_namespace
    create_policy(kube_cluster, ns)
    create_in_parallel(kube_cluster, key_secrets(ns, QUOTAS))
    create_in_parallel(kube_cluster, quotas(ns, QUOTAS))
    with (
        DocumentRecorder(kube_cluster, ns) as recorder,
        chart_operator(operator_kubeconfig, ns, operator_log, TOKENFAIR_RESYNC_SECONDS=RESYNC_S),
    ):
        published_whole(kube_cluster, ns, recorder)
        wait_for("every quota Ready", lambda: every_quota_ready(kube_cluster, ns), STATUS_WAIT_S)
        counts = recorder.tenant_counts()  # every document stored until now
    assert recorder.errors == []
    assert counts[0] == QUOTAS, f"a document from a half-listed view: {counts}"
    assert never_fewer(counts), counts
    text = operator_log.read_text(errors="replace")
    assert_never_refused(text)
    # The leader listed them itself (.startview), every namespace as kopf run was told (other
    # tests' namespaces may hold quotas too): the first pass need not wait for Kopf's listing.
    listed = re.search(r"startup listing: \d+ policies, (\d+) quotas", text)
    assert listed is not None, "no startup listing"
    assert int(listed.group(1)) >= QUOTAS


def test_a_bulk_apply_into_the_running_operator_never_publishes_fewer_tenants(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    operator_kubeconfig: Path,
    operator_log: Path,
) -> None:
    ns = kube_namespace
    create_policy(kube_cluster, ns)
    create_in_parallel(kube_cluster, key_secrets(ns, QUOTAS))
    with (
        DocumentRecorder(kube_cluster, ns) as recorder,
        chart_operator(operator_kubeconfig, ns, operator_log, TOKENFAIR_RESYNC_SECONDS=RESYNC_S),
    ):

        def policy_seen() -> bool:  # the operator runs: its pass wrote the policy's status
            policy = get(kube_cluster, f"{API}/namespaces/{ns}/schedulingpolicies/{POLICY}")
            return bool((policy or {}).get("status", {}).get("conditions"))

        wait_for("the operator's first pass", policy_seen, PUBLISH_WAIT_S)
        create_in_parallel(kube_cluster, quotas(ns, QUOTAS))
        counts = published_whole(kube_cluster, ns, recorder)
    assert recorder.errors == []
    assert never_fewer(counts), counts
    assert counts[-1] == QUOTAS
    assert_never_refused(operator_log.read_text(errors="replace"))
