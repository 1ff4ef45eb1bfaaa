"""No unprotected Pods: injection fails closed, and a Pod that got through is reported.

Behaviours under test:

- the chart's injection webhook has ``failurePolicy: Fail`` by default and ``Ignore`` only when
  ``webhook.injectionFailurePolicy=Ignore`` is chosen; any other value is refused by the chart's
  schema, naming the field; the validating webhooks stay ``Ignore``;
- on the real control plane, with the chart's own MutatingWebhookConfiguration pointing at an
  operator Service that does not exist (the webhook is unreachable): with ``Fail`` a Pod
  labelled ``tokenfair.io/policy`` is refused, the API server naming the webhook, while an
  unlabelled Pod is created; with ``Ignore`` the labelled Pod is created without the sidecar;
- the operator (shipped RBAC) then reports that Pod: its SchedulingPolicy gets
  ``SidecarsInjected=False``/``PodsWithoutSidecar`` naming it, a Warning Event with that reason,
  and ``tokenfair_operator_pods_without_sidecar`` = 1 on its ``/metrics``; deleting the Pod
  brings back ``AllInjected`` and 0.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chart_support import CHART, VARIANTS, of_kind, parse, render, run_helm, set_args
from kubecluster import KubeCluster
from loopback_support import free_ports
from operator_support import (
    condition,
    get,
    policy_path,
    running_operator,
    wait_for,
    warning_events,
)

WEBHOOK = VARIANTS["webhook-own-certificate"]
MUTATING = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
POLICY = {
    "apiVersion": "tokenfair.io/v1alpha1",
    "kind": "SchedulingPolicy",
    "metadata": {"name": "pool"},
    "spec": {},
}
LABELLED = {
    "metadata": {"name": "model", "labels": {"tokenfair.io/policy": "pool"}},
    "spec": {"containers": [{"name": "model", "image": "vllm/vllm-openai"}]},
}
IGNORE = ("webhook.injectionFailurePolicy=Ignore",)


def chart_docs(*sets: str) -> list[dict[str, Any]]:
    return parse(render(4, (*WEBHOOK, *sets)))


@pytest.mark.parametrize(("sets", "policy"), [((), "Fail"), (IGNORE, "Ignore")])
def test_chart_injection_fails_closed_unless_told(sets: tuple[str, ...], policy: str) -> None:
    docs = chart_docs(*sets)
    (mutating,) = of_kind(docs, "MutatingWebhookConfiguration")
    assert [h["failurePolicy"] for h in mutating["webhooks"]] == [policy]
    (validating,) = of_kind(docs, "ValidatingWebhookConfiguration")
    assert {h["failurePolicy"] for h in validating["webhooks"]} == {"Ignore"}


def test_chart_refuses_another_failure_policy() -> None:
    sets = (*WEBHOOK, "webhook.injectionFailurePolicy=Open")
    result = run_helm(4, "template", "t", str(CHART), *set_args(sets), check=False)
    assert result.returncode != 0
    assert "injectionFailurePolicy" in result.stderr
    assert "Fail" in result.stderr
    assert "Ignore" in result.stderr


@contextlib.contextmanager
def unreachable_injection(cluster: KubeCluster, ns: str, *sets: str) -> Iterator[None]:
    """The chart's MutatingWebhookConfiguration, as rendered, calling a Service that does not
    exist; renamed and narrowed to namespace ``ns`` so no other test's Pods meet it."""
    (config,) = of_kind(chart_docs(*sets), "MutatingWebhookConfiguration")
    name = f"tokenfair-{ns}"
    config["metadata"] = {"name": name}
    for hook in config["webhooks"]:
        hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    cluster.expect(201, "POST", MUTATING, config)
    try:
        yield
    finally:
        cluster.request("DELETE", f"{MUTATING}/{name}")


def test_labelled_pod_is_refused_while_injection_is_unreachable(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    ns = kube_namespace
    pods = f"/api/v1/namespaces/{ns}/pods"
    with unreachable_injection(kube_cluster, ns):
        refused = kube_cluster.request("POST", pods, LABELLED)
        plain = {"metadata": {"name": "plain"}, "spec": LABELLED["spec"]}
        created = kube_cluster.request("POST", pods, plain)

    assert refused.status >= 400, refused.body
    assert "failed calling webhook" in refused.body["message"]
    assert "inject-sidecar.tokenfair.io" in refused.body["message"]
    assert get(kube_cluster, f"{pods}/model") is None
    assert created.status == 201, created.body  # the objectSelector: no label, no webhook


def _metric(url: str, namespace: str) -> float | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    pattern = (
        r'^tokenfair_operator_pods_without_sidecar\{namespace="'
        + re.escape(namespace)
        + r'",policy="pool"\} (\S+)$'
    )
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _injection(cluster: KubeCluster, ns: str, reason: str) -> dict[str, Any] | None:
    found = condition(get(cluster, policy_path(ns)), "SidecarsInjected")
    return found if found.get("reason") == reason else None


def test_labelled_pod_admitted_uninjected_is_reported(
    kube_cluster: KubeCluster,
    kube_namespace: str,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    (port,) = free_ports(1)
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    env = {"TOKENFAIR_HTTP_PORT": str(port), "TOKENFAIR_HTTP_ADDR": "127.0.0.1"}
    with running_operator(operator_kubeconfig, ns, tmp_path / "operator.log", **env):
        kube_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(POLICY))
        wait_for(
            "the policy's injection condition", lambda: _injection(kube_cluster, ns, "AllInjected")
        )
        with unreachable_injection(kube_cluster, ns, *IGNORE):
            created = kube_cluster.expect(
                201, "POST", f"/api/v1/namespaces/{ns}/pods", LABELLED
            ).body
        assert [c["name"] for c in created["spec"]["containers"]] == ["model"]

        reported = wait_for(
            "PodsWithoutSidecar", lambda: _injection(kube_cluster, ns, "PodsWithoutSidecar")
        )
        assert reported["status"] == "False"
        assert "1 Pod(s)" in reported["message"]
        assert "model" in reported["message"]
        events = wait_for(
            "a Warning Event",
            lambda: [
                e
                for e in warning_events(kube_cluster, ns, "pool")
                if e["reason"] == "PodsWithoutSidecar"
            ],
        )
        assert "model" in events[0]["message"]
        wait_for("the metric at 1", lambda: _metric(metrics_url, ns) == 1.0)

        path = f"/api/v1/namespaces/{ns}/pods/model?gracePeriodSeconds=0"
        kube_cluster.expect((200, 202), "DELETE", path)
        wait_for("AllInjected again", lambda: _injection(kube_cluster, ns, "AllInjected"))
        wait_for("the metric at 0", lambda: _metric(metrics_url, ns) == 0.0)
