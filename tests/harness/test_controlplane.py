"""Smoke tests proving that ``kube_cluster`` (tests/kubecluster.py) is a real control plane.

Behaviours, against a throwaway CRD with a CEL rule (tests/data/controlplane/widgets.yaml):

- ``kubectl apply`` of a valid custom object succeeds and the server stores it;
- an invalid object is refused by kube-apiserver with the CRD's own CEL message;
- a spec change bumps ``metadata.generation``; a ``/status`` patch stores status and does not;
- a watch from a resourceVersion sees a later change;
- RBAC is enforced: a TokenRequest token authenticates as its ServiceAccount, is refused (403)
  until a RoleBinding grants access, then allowed;
- with kube-controller-manager built, deleting an owner garbage-collects its dependents;
- Helm 3 and Helm 4 both install a chart through the admin kubeconfig.

Without binaries, the plugin's own skip/fail rule: ``kube`` tests skip with a hint, and fail
instead under ``TOKENFAIR_REQUIRE_KUBE=1``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster
from repo_paths import TEST_DATA, TESTS_DIR

CRD_FILE = TEST_DATA / "controlplane" / "widgets.yaml"
GROUP_VERSION = "smoke.tokenfair.example/v1alpha1"
CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


@pytest.fixture(scope="module")
def widget_crd(kube_cluster: KubeCluster) -> Iterator[str]:
    """The Widget CRD, installed and Established; yields its API path prefix."""
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    kube_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/widgets.smoke.tokenfair.example",
    )
    yield f"/apis/{GROUP_VERSION}"
    kube_cluster.kubectl("delete", "-f", str(CRD_FILE), "--wait=false")


def widget(name: str, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """A Widget manifest."""
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"minReplicas": min_replicas, "maxReplicas": max_replicas},
    }


def apply(cluster: KubeCluster, namespace: str, manifest: dict[str, Any]) -> None:
    """``kubectl apply`` one manifest (JSON is YAML) into ``namespace``."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def get(cluster: KubeCluster, path: str) -> dict[str, Any]:
    """GET an object as the admin, asserting it exists."""
    return cluster.expect(200, "GET", path).body


def test_valid_object_is_accepted(
    kube_cluster: KubeCluster, widget_crd: str, kube_namespace: str
) -> None:
    apply(kube_cluster, kube_namespace, widget("ok", 1, 3))

    stored = get(kube_cluster, f"{widget_crd}/namespaces/{kube_namespace}/widgets/ok")
    assert stored["spec"] == {"minReplicas": 1, "maxReplicas": 3}
    assert stored["metadata"]["generation"] == 1


def test_cel_rule_rejects_invalid_object(
    kube_cluster: KubeCluster, widget_crd: str, kube_namespace: str
) -> None:
    manifest = json.dumps(widget("inverted", 5, 2))
    result = kube_cluster.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=manifest, check=False
    )

    assert result.returncode != 0
    assert CEL_MESSAGE in result.stderr
    path = f"{widget_crd}/namespaces/{kube_namespace}/widgets/inverted"
    assert kube_cluster.request("GET", path).status == 404


def test_generation_follows_spec_not_status(
    kube_cluster: KubeCluster, widget_crd: str, kube_namespace: str
) -> None:
    path = f"{widget_crd}/namespaces/{kube_namespace}/widgets/gen"
    apply(kube_cluster, kube_namespace, widget("gen", 1, 2))
    merge = "application/merge-patch+json"

    spec_patch = {"spec": {"maxReplicas": 4}}
    kube_cluster.request("PATCH", path, spec_patch, content_type=merge)
    assert get(kube_cluster, path)["metadata"]["generation"] == 2

    status_patch = {"status": {"observedGeneration": 2}}
    resp = kube_cluster.request("PATCH", f"{path}/status", status_patch, content_type=merge)
    assert resp.status == 200
    after = get(kube_cluster, path)
    assert after["status"] == {"observedGeneration": 2}
    assert after["metadata"]["generation"] == 2


def test_watch_sees_change(kube_cluster: KubeCluster, widget_crd: str, kube_namespace: str) -> None:
    collection = f"{widget_crd}/namespaces/{kube_namespace}/widgets"
    apply(kube_cluster, kube_namespace, widget("watched", 0, 1))
    version = get(kube_cluster, f"{collection}/watched")["metadata"]["resourceVersion"]
    events = kube_cluster.watch(collection, resource_version=version, timeout_seconds=20)

    kube_cluster.kubectl(
        "patch", "-n", kube_namespace, "widget", "watched", "--type=merge",
        "-p", '{"spec": {"maxReplicas": 7}}',
    )  # fmt: skip

    event = next(events)
    events.close()
    assert event["type"] == "MODIFIED"
    assert event["object"]["spec"]["maxReplicas"] == 7


def test_rbac_governs_service_account_tokens(
    kube_cluster: KubeCluster, widget_crd: str, kube_namespace: str
) -> None:
    kube_cluster.create_service_account(kube_namespace, "reader")
    token = kube_cluster.service_account_token(kube_namespace, "reader")
    collection = f"{widget_crd}/namespaces/{kube_namespace}/widgets"

    review = kube_cluster.request(
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        token=token,
    )
    username = review.body["status"]["userInfo"]["username"]
    assert username == f"system:serviceaccount:{kube_namespace}:reader"
    assert kube_cluster.request("GET", collection, token=token).status == 403

    kube_cluster.kubectl(
        "create", "role", "widget-reader", "-n", kube_namespace,
        "--verb=get,list", "--resource=widgets.smoke.tokenfair.example",
    )  # fmt: skip
    kube_cluster.kubectl(
        "create", "rolebinding", "widget-reader", "-n", kube_namespace,
        "--role=widget-reader", f"--serviceaccount={kube_namespace}:reader",
    )  # fmt: skip
    assert kube_cluster.request("GET", collection, token=token).status == 200


def test_garbage_collector_deletes_dependents(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    if kube_cluster.binaries.kube_controller_manager is None:
        pytest.skip("kube-controller-manager not built (KUBEBUILDER_ASSETS has none)")
    configmaps = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    owner = kube_cluster.expect(201, "POST", configmaps, {"metadata": {"name": "owner"}}).body
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner"}
    reference["uid"] = owner["metadata"]["uid"]
    dependent = {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
    kube_cluster.expect(201, "POST", configmaps, dependent)

    kube_cluster.expect(200, "DELETE", f"{configmaps}/owner")

    deadline = time.monotonic() + 30
    while kube_cluster.request("GET", f"{configmaps}/dependent").status != 404:
        assert time.monotonic() < deadline, "dependent still there after 30 s"
        time.sleep(0.2)


@pytest.mark.parametrize("major", [3, 4])
def test_helm_installs_chart(
    kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path, major: int
) -> None:
    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: smoke\nversion: 0.1.0\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\n"
        "data:\n  helm: {{ .Capabilities.HelmVersion.Version | quote }}\n"
    )

    kube_cluster.helm("install", "smoke", str(chart), "-n", kube_namespace, "--wait", major=major)

    configmap = get(kube_cluster, f"/api/v1/namespaces/{kube_namespace}/configmaps/smoke")
    assert configmap["data"]["helm"].startswith(f"v{major}.")


def test_missing_binaries_skip_or_fail(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without binaries a ``kube`` test is skipped with a hint, or fails under the CI switch."""
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path / "assets"))
    monkeypatch.setenv("TOKENFAIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS_DIR)]))
    monkeypatch.delenv("TOKENFAIR_REQUIRE_KUBE", raising=False)
    pytester.makepyfile(
        test_needs_kube="""
        import pytest

        @pytest.mark.kube
        def test_marked():
            pass

        def test_uses_fixture(kube_cluster):
            pass

        def test_plain():
            pass
        """
    )
    # The loop-scope option only silences pytest-asyncio (installed with pytest-aiohttp).
    args = (
        "-p",
        "kubecluster",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
    )

    skipped = pytester.runpytest_subprocess(*args)
    skipped.assert_outcomes(passed=1, skipped=2)
    skipped.stdout.fnmatch_lines(["*make controlplane tools*"])

    monkeypatch.setenv("TOKENFAIR_REQUIRE_KUBE", "1")
    failed = pytester.runpytest_subprocess(*args)
    failed.assert_outcomes(passed=1, errors=2)
    failed.stdout.fnmatch_lines(["*TOKENFAIR_REQUIRE_KUBE=1 but no*"])
