"""The tenant limits beside the budget on a real control plane (``kube_cluster``; skipped
without the binaries, as every kube test):

- the API server refuses a TenantQuota whose ``maxConcurrentRequests`` or ``maxKvShare`` is out
  of its bounds (the CRD's schema, the sidecar parser's rules), naming the field;
- ``kubectl get tq`` shows them in the ``MAX-CONCURRENT`` and ``MAX-KV-SHARE`` columns;
- the operator publishes them in the policy's document and writes ``status.limits`` (the
  per-sidecar share too), and takes ``status.limits`` away when the limits are lifted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster
from operator_support import (
    apply,
    get,
    published,
    quota,
    quota_path,
    running_operator,
    wait_for,
)

POLICY = {
    "apiVersion": "tokenfair.io/v1alpha1",
    "kind": "SchedulingPolicy",
    "metadata": {"name": "pool"},
    "spec": {},
}


def columns(table: list[str]) -> list[dict[str, str]]:
    """``kubectl get``'s table by column: each cell is the text under its header (an empty
    cell, e.g. a limit not set or a Ready not written yet, is "")."""
    header = table[0]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    bounds = [*starts[1:], None]
    return [
        {
            name: row[start:end].strip()
            for name, start, end in zip(names, starts, bounds, strict=True)
        }
        for row in table[1:]
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"maxConcurrentRequests": 0}, "spec.maxConcurrentRequests"),
        ({"maxConcurrentRequests": 1_000_001}, "spec.maxConcurrentRequests"),
        ({"maxConcurrentRequests": 2.5}, "spec.maxConcurrentRequests"),
        ({"maxKvShare": 0}, "spec.maxKvShare"),
        ({"maxKvShare": 1.5}, "spec.maxKvShare"),
        ({"maxKvShare": "half"}, "spec.maxKvShare"),
    ],
    ids=[
        "concurrency-0",
        "concurrency-max",
        "concurrency-float",
        "share-0",
        "share-1.5",
        "share-text",
    ],
)
def test_the_api_server_refuses_limits_out_of_bounds(
    kube_cluster: KubeCluster, kube_namespace: str, spec: dict[str, Any], message: str
) -> None:
    result = kube_cluster.kubectl(
        "apply",
        "-n",
        kube_namespace,
        "-f",
        "-",
        input=json.dumps(quota("bad", **spec)),
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_limits_in_columns_document_and_status(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    with running_operator(operator_kubeconfig, ns, tmp_path / "operator.log"):
        apply(
            kube_cluster,
            ns,
            POLICY,
            quota("limited", maxConcurrentRequests=6, maxKvShare=0.25),
            quota("free"),
        )
        table = kube_cluster.kubectl("get", "tq", "-n", ns).stdout.splitlines()
        assert table[0].split()[5:7] == ["MAX-CONCURRENT", "MAX-KV-SHARE"]
        rows = {row["NAME"]: row for row in columns(table)}
        assert (rows["limited"]["MAX-CONCURRENT"], rows["limited"]["MAX-KV-SHARE"]) == ("6", "0.25")
        assert (rows["free"]["MAX-CONCURRENT"], rows["free"]["MAX-KV-SHARE"]) == ("", "")

        def limits_in_force() -> dict[str, Any] | None:
            obj = get(kube_cluster, quota_path(ns, "limited"))
            limits = (obj or {}).get("status", {}).get("limits")
            return limits if isinstance(limits, dict) else None

        assert wait_for("status.limits", limits_in_force) == {
            "maxConcurrentRequests": 6,
            "maxConcurrentRequestsPerSidecar": 6,  # no ready sidecar: one share, the whole
            "maxKvShare": 0.25,
        }
        config = wait_for("the published document", lambda: published(kube_cluster, ns))
        limited = config.tenant("limited")
        assert (limited.max_concurrent_requests, limited.max_kv_share) == (6, 0.25)
        free = get(kube_cluster, quota_path(ns, "free"))
        assert free is not None
        assert "limits" not in free.get("status", {})

        apply(kube_cluster, ns, quota("limited"))  # lifted
        wait_for(
            "status.limits to go",
            lambda: "limits" not in ((get(kube_cluster, quota_path(ns, "limited")) or {})
                                     .get("status", {"limits": 1})) or None,
        )  # fmt: skip
