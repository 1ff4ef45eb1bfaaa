"""The operator against a real control plane (``kube_cluster``), run as ``kopf run -m`` with the
exact RBAC it ships (``operator/rbac/``) through a ServiceAccount token.

Behaviours under test:

- CEL in the CRDs refuses invalid objects with their human messages (cross-field watermarks,
  bounds, the priority-class enum, a selector expression with values on `Exists`, an immutable
  policyName);
- ``kubectl apply`` of the lesson's three TenantQuotas and a policy -> a ConfigMap (owned by the
  policy) whose document the sidecar's ``parse_documents`` reads as the lesson's tenants, a
  Secret with the same version, and Ready/Accepted/ConfigPublished, observedGeneration and
  configVersion in every status; no finalizer, our annotations only, none of Kopf's defaults;
  the operator (``--namespace``) made its own startup listing of that namespace;
- an update reaches the ConfigMap with a new version; a deleted quota leaves the document;
- refusals: a duplicate tenant id, a missing policy, a missing key Secret -> the documented
  reasons and a Warning Event; creating the Secret later admits the tenant with its key digest,
  and rotating its key has the resync publish the new digest alone;
- deleting the policy marks its quotas PolicyNotFound and garbage-collects the documents;
- replica-aware budgets: with two Ready sidecar Pods of the policy the document holds half of
  each budget; one turning unready restores the whole;
- ``spec.selector`` narrows those Pods: of two labelled Ready Pods only the one matching the
  selector counts (the whole budget again); relabelling the other into it halves it again;
- sidecar injection: a Pod labelled ``tokenfair.io/policy`` comes back from the API server with
  the sidecar and its config volume, exactly once (a dry-run re-create does not add another);
- end to end: a real ``tokenfair sidecar`` fed the published ConfigMap (the test plays the
  kubelet, swapping the file as a ConfigMap volume does) enforces a changed burst after an update;
- its own webhook certificate (no cert-manager): an expiring pair in the Secret is replaced,
  the static webhook configuration's caBundle set to the new CA and the old one, and the API
  server calls the webhook over TLS trusting it (a policy-less quota refused by our handler);
- live usage: the operator scrapes a real sidecar's metrics (found through its Pod) and writes
  each tenant's admitted service tokens into ``status.usage`` (the ``Admitted`` column) and its
  own p99 queue wait (a tenant of the same lane without requests reports 0, not the lane's);
- the operator never hits a 403 (its log is checked after each test): missing RBAC fails;
- (no cluster) the webhook certificate keeper asks for leadership before each of its writes:
  a leader that stepped down between the Secret and a caBundle patch sends no patch.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import hashlib
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubecluster import KubeCluster, stop_process
from kubernetes.client import ApiException
from loopback_support import free_ports
from operator_support import (
    LESSON,
    apply,
    condition,
    get,
    log_shows,
    policy_path,
    published,
    quota,
    quota_path,
    ready_reason,
    running_operator,
    sidecar_status,
    wait_for,
    warning_events,
    with_weight,
)

from tokenfair.config import (
    POLICY_FIELDS,
    Config,
    PolicyConfig,
    parse_policy,
)
from tokenfair.sim.scenarios import LESSON_TENANTS
from tokenfair_operator.certs import Rotation, ServingCerts, due, issue
from tokenfair_operator.kube import NotLeader
from tokenfair_operator.webhook_certs import CertKeeper

MERGE_PATCH = "application/merge-patch+json"


@pytest.fixture
def operator(operator_kubeconfig: Path, kube_namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The operator for ``kube_namespace``, with the shipped RBAC, no webhook."""
    with running_operator(operator_kubeconfig, kube_namespace, tmp_path / "operator.log") as log:
        yield log


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def apply_lesson(cluster: KubeCluster, ns: str) -> Config:
    cluster.kubectl("apply", "-n", ns, "-f", str(LESSON))
    wait_for("the policy to be Ready", lambda: ready_reason(cluster, policy_path(ns), "Ready"))
    return wait_for("3 tenants published", lambda: _with_tenants(published(cluster, ns), 3))


def _at_version(config: Config | None, version: str) -> Config | None:
    return config if config is not None and config.version == version else None


def _with_tenants(config: Config | None, count: int) -> Config | None:
    return config if config is not None and len(config.tenants) == count else None


# --- CEL, no operator needed -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"kind": "SchedulingPolicy", "spec": {"batchKvWatermark": 0.95}},
            "batchKvWatermark must be <= interactiveKvWatermark",
        ),
        (
            {"kind": "SchedulingPolicy", "spec": {"maxQueuedRequests": 10}},
            "maxQueuedRequestsPerTenant must be <= maxQueuedRequests",
        ),
        ({"kind": "SchedulingPolicy", "spec": {"batchMinShare": 0.6}}, "spec.batchMinShare"),
        ({"kind": "TenantQuota", "spec": quota("x", weight=0)["spec"]}, "spec.weight"),
        (
            {"kind": "TenantQuota", "spec": quota("x", priorityClass="bulk")["spec"]},
            'supported values: "interactive", "batch"',
        ),
        (
            {
                "kind": "SchedulingPolicy",
                "spec": {
                    "selector": {
                        "matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]
                    }
                },
            },
            "operators In and NotIn need at least one value; Exists and DoesNotExist take none",
        ),
    ],
    ids=[
        "watermarks",
        "queue-bounds",
        "share-bound",
        "weight-bound",
        "priority-enum",
        "selector-values",
    ],
)
def test_cel_and_schema_refuse_invalid_objects(
    kube_cluster: KubeCluster, kube_namespace: str, doc: dict[str, Any], message: str
) -> None:
    manifest = {"apiVersion": "tokenfair.io/v1alpha1", "metadata": {"name": "bad"}, **doc}
    result = kube_cluster.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_policy_name_is_immutable(kube_cluster: KubeCluster, kube_namespace: str) -> None:
    apply(kube_cluster, kube_namespace, quota("q"))
    moved = quota("q", policyName="other")
    result = kube_cluster.kubectl(
        "apply", "-n", kube_namespace, "-f", "-", input=json.dumps(moved), check=False
    )
    assert result.returncode != 0
    assert "policyName is immutable" in result.stderr


def test_empty_policy_gets_the_lessons_defaults(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    policy = {"apiVersion": "tokenfair.io/v1alpha1", "kind": "SchedulingPolicy"}
    apply(kube_cluster, kube_namespace, {**policy, "metadata": {"name": "pool"}})
    stored = get(kube_cluster, policy_path(kube_namespace))
    assert stored is not None
    # The API server filled in every parameter; read through the sidecar, they are the lesson's.
    assert set(stored["spec"]) == set(POLICY_FIELDS)
    assert parse_policy(stored["spec"]) == PolicyConfig()


# --- the operator ----------------------------------------------------------------------------


def test_lesson_tenants_are_published(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    config = apply_lesson(kube_cluster, ns)
    # Its own startup listing (.startview) of the namespace kopf run was given: not skipped
    # (a namespace kopf watches is known), not failed (the shipped RBAC lists all three).
    started = log_shows(operator, "startup listing: ")
    assert "no startup listing" not in started
    assert "startup listing failed" not in started

    assert sorted(config.tenants, key=lambda t: t.tenant_id) == sorted(
        LESSON_TENANTS, key=lambda t: t.tenant_id
    )
    # The Secret is written right after the ConfigMap: wait for it, never read it once.
    wait_for(
        "the Secret to hold the ConfigMap's version",
        lambda: _at_version(published(kube_cluster, ns, "secrets"), config.version),
    )
    # Statuses are written in the background after the publish, so wait for them to catch up.
    policy = wait_for(
        "the policy's status to name the published version",
        lambda: _status_names(get(kube_cluster, policy_path(ns)), config.version),
    )
    assert policy["status"]["observedGeneration"] == policy["metadata"]["generation"]
    assert (policy["status"]["tenants"], policy["status"]["configVersion"]) == (3, config.version)
    # No finalizer on anything: deletion never waits for the operator (helm uninstall removes
    # it and its RBAC at once, so a finalizer would never be released).
    assert "finalizers" not in policy["metadata"]
    configmap = get(kube_cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
    assert configmap is not None
    (owner,) = configmap["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "SchedulingPolicy",
        policy["metadata"]["uid"],
        True,
    )
    quotas = wait_for(
        "every quota's status to name the published version",
        lambda: _statuses_name(get(kube_cluster, quota_path(ns)), config.version),
    )
    assert len(quotas["items"]) == 3
    for item in quotas["items"]:
        status = item["status"]
        assert status["configVersion"] == config.version
        assert status["observedGeneration"] == item["metadata"]["generation"]
        assert {c["type"]: c["reason"] for c in status["conditions"]} == {
            "Ready": "Ready",
            "Accepted": "Valid",
            "ConfigPublished": "Published",
        }
    for obj in [policy, *quotas["items"]]:  # no Kopf defaults leak into our objects
        keys = [*obj["metadata"].get("annotations", {}), *obj["metadata"].get("finalizers", [])]
        assert not [k for k in keys if "kopf.zalando.org" in k]
        assert "kopf" not in obj["status"]
    # No transient refusal while the watches caught up (policy and quotas in one apply).
    for name in ("chat-pro", "ide-assist", "batch-rag"):
        assert warning_events(kube_cluster, ns, name) == []
    table = kube_cluster.kubectl("get", "tq", "-n", ns).stdout
    assert table.split("\n")[0].split()[:5] == ["NAME", "READY", "POLICY", "WEIGHT", "PRIORITY"]
    assert table.count(" True ") == 3


def test_update_and_delete_reach_the_configmap(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    before = apply_lesson(kube_cluster, ns)

    kube_cluster.kubectl(
        "patch", "tq", "chat-pro", "-n", ns, "--type=merge", "-p", '{"spec":{"weight":3}}'
    )
    after = wait_for(
        "the new weight in the ConfigMap",
        lambda: with_weight(published(kube_cluster, ns), "tenant_chat_pro", 3.0),
    )
    assert after.version != before.version
    chat = wait_for(
        "chat-pro's status at generation 2",
        lambda: _at_generation(get(kube_cluster, quota_path(ns, "chat-pro")), 2),
    )
    assert chat["status"]["configVersion"] == after.version

    kube_cluster.kubectl("delete", "tq", "batch-rag", "-n", ns)
    remaining = wait_for("2 tenants", lambda: _with_tenants(published(kube_cluster, ns), 2))
    assert {t.tenant_id for t in remaining.tenants} == {"tenant_chat_pro", "tenant_ide_assist"}


def _status_names(obj: dict[str, Any] | None, version: str) -> dict[str, Any] | None:
    """``obj`` once its status carries config ``version``, else None."""
    if obj is None or obj.get("status", {}).get("configVersion") != version:
        return None
    return obj


def _statuses_name(listing: dict[str, Any] | None, version: str) -> dict[str, Any] | None:
    """``listing`` once every item's status carries config ``version``, else None."""
    if listing is None or not listing["items"]:
        return None
    if any(_status_names(item, version) is None for item in listing["items"]):
        return None
    return listing


def _at_generation(obj: dict[str, Any] | None, generation: int) -> dict[str, Any] | None:
    ok = obj is not None and obj.get("status", {}).get("observedGeneration") == generation
    return obj if ok else None


def test_refusals_have_reasons_and_events(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)
    apply(
        kube_cluster,
        ns,
        quota("chat-copy", tenantId="tenant_chat_pro"),
        quota("lost", policyName="nowhere"),
        quota("keyed", apiKeySecretRef={"name": "keyed-keys"}),
    )

    copy = wait_for(
        "DuplicateTenantId",
        lambda: ready_reason(kube_cluster, quota_path(ns, "chat-copy"), "DuplicateTenantId"),
    )
    assert "already used by TenantQuota 'chat-pro'" in condition(copy)["message"]
    lost = wait_for(
        "PolicyNotFound",
        lambda: ready_reason(kube_cluster, quota_path(ns, "lost"), "PolicyNotFound"),
    )
    assert "SchedulingPolicy 'nowhere' does not exist" in condition(lost)["message"]
    wait_for(
        "KeySecretNotFound",
        lambda: ready_reason(kube_cluster, quota_path(ns, "keyed"), "KeySecretNotFound"),
    )
    for name, reason in [("chat-copy", "DuplicateTenantId"), ("keyed", "KeySecretNotFound")]:
        events = wait_for(
            f"a Warning Event on {name}", functools.partial(warning_events, kube_cluster, ns, name)
        )
        assert events[0]["reason"] == reason
    # The refused quotas stay out of the document; the lesson's three are untouched.
    current = published(kube_cluster, ns)
    assert current is not None
    assert len(current.tenants) == 3

    # The key Secret appears: the periodic resync admits the tenant with the key's digest.
    secret = {"metadata": {"name": "keyed-keys"}, "stringData": {"primary": "sk-keyed-1\n"}}
    kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)
    wait_for("keyed Ready", lambda: ready_reason(kube_cluster, quota_path(ns, "keyed"), "Ready"))
    with_keys = wait_for(
        "4 tenants", lambda: _with_tenants(published(kube_cluster, ns, "secrets"), 4)
    )
    assert with_keys.tenant("keyed").api_key_sha256 == (hashlib.sha256(b"sk-keyed-1").hexdigest(),)
    without_keys = published(kube_cluster, ns)
    assert without_keys is not None
    assert without_keys.tenant("keyed").api_key_sha256 == ()

    # The key is rotated (the old one revoked): the resync's re-read, from the API server's
    # watch cache at a fresh resourceVersion, publishes the new digest alone.
    rotated = {"stringData": {"primary": "sk-keyed-2"}}
    kube_cluster.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/secrets/keyed-keys",
        rotated,
        content_type="application/merge-patch+json",
    )
    new_digest = (hashlib.sha256(b"sk-keyed-2").hexdigest(),)

    def rotated_key() -> bool:
        document = published(kube_cluster, ns, "secrets")
        return document is not None and document.tenant("keyed").api_key_sha256 == new_digest

    wait_for("the rotated key published", rotated_key)


def test_deleting_the_policy_orphans_its_quotas(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)

    kube_cluster.kubectl("delete", "schedulingpolicy", "pool", "-n", ns, "--wait=true")
    wait_for(
        "PolicyNotFound on chat-pro",
        lambda: ready_reason(kube_cluster, quota_path(ns, "chat-pro"), "PolicyNotFound"),
    )
    if kube_cluster.binaries.kube_controller_manager is not None:  # the garbage collector runs
        path = f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool"
        wait_for("the ConfigMap to be collected", lambda: get(kube_cluster, path) is None)


def sidecar_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"tokenfair.io/policy": "pool"}},
        "spec": {"containers": [{"name": "tokenfair-sidecar", "image": "tokenfair"}]},
    }


def _status_field(cluster: KubeCluster, path: str, field: str) -> Any:
    return ((get(cluster, path) or {}).get("status") or {}).get(field)


def set_ready(cluster: KubeCluster, ns: str, name: str, ready: bool) -> None:
    """Play the kubelet: report the Pod's Ready condition."""
    status = "True" if ready else "False"
    body = {"status": {"conditions": [{"type": "Ready", "status": status}]}}
    path = f"/api/v1/namespaces/{ns}/pods/{name}/status"
    resp = cluster.request("PATCH", path, body, content_type=MERGE_PATCH)
    assert resp.status == 200, resp.body


def test_budgets_follow_the_ready_sidecars(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)
    pods = f"/api/v1/namespaces/{ns}/pods"
    for name in ("sidecar-a", "sidecar-b"):
        kube_cluster.expect(201, "POST", pods, sidecar_pod(name))
        set_ready(kube_cluster, ns, name, ready=True)

    # Two ready sidecars: each enforces half of chat-pro's 48000 burst and 180000/s.
    halved = wait_for(
        "budgets halved", lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 24_000)
    )
    assert halved.tenant("tenant_chat_pro").sustained_service_tokens_per_second == 90_000.0
    # The status follows the ConfigMap within the same pass.
    wait_for(
        "budgetShares 2", lambda: _status_field(kube_cluster, policy_path(ns), "budgetShares") == 2
    )

    set_ready(kube_cluster, ns, "sidecar-b", ready=False)  # one left: the whole quota again
    wait_for(
        "budgets whole", lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 48_000)
    )


def test_selector_narrows_the_sidecars_budgets_are_divided_across(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)
    pods = f"/api/v1/namespaces/{ns}/pods"
    for name, tier in (("sidecar-gpu", "gpu"), ("sidecar-cpu", "cpu")):
        pod = sidecar_pod(name)
        pod["metadata"]["labels"]["tier"] = tier
        kube_cluster.expect(201, "POST", pods, pod)
        set_ready(kube_cluster, ns, name, ready=True)
    # No selector yet: both labelled Ready Pods count, chat-pro's 48000 burst halves to 24000.
    wait_for(
        "budgets halved", lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 24_000)
    )

    selector = {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}]}
    resp = kube_cluster.request(
        "PATCH", policy_path(ns), {"spec": {"selector": selector}}, content_type=MERGE_PATCH
    )
    assert resp.status == 200, resp.body
    # Two labelled Ready Pods, one matching: divided by 1, not 2 -> 48000 and 180000/s.
    whole = wait_for(
        "budgets whole", lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 48_000)
    )
    assert whole.tenant("tenant_chat_pro").sustained_service_tokens_per_second == 180_000.0
    wait_for(
        "budgetShares 1", lambda: _status_field(kube_cluster, policy_path(ns), "budgetShares") == 1
    )

    # Relabelling the other Pod into the selector is a Pod event: halved again.
    relabel = {"metadata": {"labels": {"tier": "gpu"}}}
    resp = kube_cluster.request("PATCH", f"{pods}/sidecar-cpu", relabel, content_type=MERGE_PATCH)
    assert resp.status == 200, resp.body
    wait_for(
        "budgets halved again",
        lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 24_000),
    )


# --- the validating webhook, called by kube-apiserver over TLS ---------------------------------


def refused(cluster: KubeCluster, ns: str, doc: dict[str, Any]) -> str:
    """``kubectl apply`` that must fail; its error output."""
    result = cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc), check=False)
    assert result.returncode != 0, result.stdout
    return result.stderr


def test_webhook_refuses_what_cel_cannot_see(
    kube_cluster: KubeCluster, kube_namespace: str, webhook_operator: Path
) -> None:
    ns = kube_namespace
    # Admitted, and Kopf's own metadata patches pass the webhook: all three become Ready.
    apply_lesson(kube_cluster, ns)

    message = refused(kube_cluster, ns, quota("lost", policyName="nowhere"))
    assert "denied the request: TenantQuota 'lost': spec.policyName: SchedulingPolicy" in message
    assert "'nowhere' does not exist" in message
    message = refused(kube_cluster, ns, quota("chat-copy", tenantId="tenant_chat_pro"))
    assert "spec.tenantId: tenant id 'tenant_chat_pro' is already used by TenantQuota" in message
    message = refused(kube_cluster, ns, quota("keyed", apiKeySecretRef={"name": "keyed-keys"}))
    assert "spec.apiKeySecretRef: Secret 'keyed-keys' not found" in message
    # An update that would create a duplicate is refused as well; the stored object is intact.
    message = refused(kube_cluster, ns, quota("ide-assist", tenantId="tenant_chat_pro"))
    assert "already used by TenantQuota 'chat-pro'" in message
    ide = get(kube_cluster, quota_path(ns, "ide-assist"))
    assert ide is not None
    assert ide["spec"]["tenantId"] == "tenant_ide_assist"

    secret = {"metadata": {"name": "keyed-keys"}, "stringData": {"primary": "sk-keyed-1"}}
    kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)
    apply(kube_cluster, ns, quota("keyed", apiKeySecretRef={"name": "keyed-keys"}))
    wait_for("keyed Ready", lambda: ready_reason(kube_cluster, quota_path(ns, "keyed"), "Ready"))


def test_labelled_pod_comes_back_injected(
    kube_cluster: KubeCluster, kube_namespace: str, webhook_operator: Path
) -> None:
    ns = kube_namespace
    containers = [{"name": "model", "image": "vllm/vllm-openai"}]
    labelled: dict[str, Any] = {
        "metadata": {"name": "model", "labels": {"tokenfair.io/policy": "pool"}},
        "spec": {"containers": containers},
    }
    pods = f"/api/v1/namespaces/{ns}/pods"

    created = kube_cluster.expect(201, "POST", pods, labelled).body

    names = [c["name"] for c in created["spec"]["containers"]]
    assert names == ["tokenfair-sidecar", "model"]
    volume = next(v for v in created["spec"]["volumes"] if v["name"] == "tokenfair-config")
    assert volume["secret"]["secretName"] == "tokenfair-pool-keys"
    # Creating the injected Pod again (server-side dry run): still exactly one sidecar.
    again = {"metadata": {**labelled["metadata"], "name": "again"}, "spec": created["spec"]}
    dry = kube_cluster.expect(201, "POST", f"{pods}?dryRun=All", again).body
    assert [c["name"] for c in dry["spec"]["containers"]] == names
    # Without the label the webhook is not even called (objectSelector).
    plain = {"metadata": {"name": "plain"}, "spec": {"containers": containers}}
    stored = kube_cluster.expect(201, "POST", pods, plain).body
    assert [c["name"] for c in stored["spec"]["containers"]] == ["model"]


def test_injected_sidecar_gets_the_budget_store_password(
    kube_cluster: KubeCluster, kube_namespace: str, webhook_operator: Path
) -> None:
    """A policy whose ``budgetStore.redis.secretRef`` names a Secret: the sidecar injected into
    its Pods reads the password from that Secret key, as the rendered config's passwordEnv."""
    ns = kube_namespace
    store = {"redis": {"url": "redis://store:6379", "secretRef": {"name": "store-pass"}}}
    policy = {"apiVersion": "tokenfair.io/v1alpha1", "kind": "SchedulingPolicy"}
    apply(
        kube_cluster, ns, {**policy, "metadata": {"name": "pool"}, "spec": {"budgetStore": store}}
    )
    labelled = {
        "metadata": {"name": "model", "labels": {"tokenfair.io/policy": "pool"}},
        "spec": {"containers": [{"name": "model", "image": "vllm/vllm-openai"}]},
    }
    pods = f"/api/v1/namespaces/{ns}/pods?dryRun=All"

    def password_env() -> dict[str, Any] | None:  # the operator's index learns the policy first
        created = kube_cluster.expect(201, "POST", pods, labelled).body
        sidecar = created["spec"]["containers"][0]
        env = {e["name"]: e for e in sidecar.get("env", [])}
        found = env.get("TOKENFAIR_BUDGET_STORE_PASSWORD")
        return dict(found) if found is not None else None

    found = wait_for("the password variable in the injected sidecar", password_env)
    assert found["valueFrom"]["secretKeyRef"] == {
        "name": "store-pass",
        "key": "password",
        "optional": True,
    }


# --- end to end: a sidecar fed by the ConfigMap -------------------------------------------------


def project(cluster: KubeCluster, ns: str, target: Path) -> str:
    """Copy the ConfigMap's document to ``target`` as the kubelet would (write aside, rename);
    return its version."""
    configmap = get(cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
    assert configmap is not None
    staged = target.with_suffix(".staged")
    staged.write_text(configmap["data"]["config.yaml"])
    staged.replace(target)
    return str(configmap["metadata"]["annotations"]["tokenfair.io/config-version"])


@contextlib.contextmanager
def running_sidecar(config_file: Path, tmp_path: Path, *flags: str) -> Iterator[tuple[str, str]]:
    """``tokenfair sidecar`` (cost-model backend) on loopback; yields (proxy URL, admin URL)."""
    proxy_port, admin_port = free_ports(2)
    tokenfair = Path(sys.executable).with_name("tokenfair")
    cmd = [str(tokenfair), "sidecar", "--config", str(config_file), "--backend", "costmodel"]
    cmd += ["--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}"]
    with (tmp_path / "sidecar.log").open("wb") as log:
        sidecar = subprocess.Popen(
            [*cmd, *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"
    finally:
        stop_process(sidecar)


def test_sidecar_fed_by_the_configmap_enforces_an_update(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)
    config_file = tmp_path / "config.yaml"
    first = project(kube_cluster, ns, config_file)
    with running_sidecar(config_file, tmp_path) as (_, admin):
        status = wait_for("the sidecar to serve", lambda: sidecar_status(admin))
        assert status["config"]["version"] == first
        assert status["tenants"]["tenant_chat_pro"]["burst_service_tokens"] == 48_000

        kube_cluster.kubectl(
            "patch",
            "tq",
            "chat-pro",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"burstServiceTokens":24000}}',
        )
        wait_for(
            "the new burst in the ConfigMap",
            lambda: _burst(published(kube_cluster, ns), "tenant_chat_pro", 24_000),
        )
        second = project(kube_cluster, ns, config_file)

        def enforced() -> dict[str, Any] | None:
            now = sidecar_status(admin)
            ok = now is not None and now["config"]["version"] == second
            return now if ok else None

        status = wait_for("the sidecar to load the new version", enforced)
        # The running scheduler's bucket for the tenant now holds the new capacity.
        assert status["tenants"]["tenant_chat_pro"]["burst_service_tokens"] == 24_000
        assert status["tenants"]["tenant_ide_assist"]["burst_service_tokens"] == 36_000


def _burst(config: Config | None, tenant: str, burst: int) -> Config | None:
    ok = config is not None and config.tenant(tenant).burst_service_tokens == burst
    return config if ok else None


def complete(proxy: str, tenant: str, prompt: str, max_tokens: int) -> int:
    """One /v1/completions request naming ``tenant`` in the trusted header; the HTTP status."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json", "X-Tenant": tenant}
    req = urllib.request.Request(f"{proxy}/v1/completions", data=body, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        resp.read()
        return int(resp.status)


def test_live_usage_reaches_the_quota_status(
    kube_cluster: KubeCluster, kube_namespace: str, operator: Path, tmp_path: Path
) -> None:
    ns = kube_namespace
    apply_lesson(kube_cluster, ns)
    config_file = tmp_path / "config.yaml"
    project(kube_cluster, ns, config_file)
    flags = ("--trusted-tenant-header", "X-Tenant", "--time-scale", "0.01")
    with running_sidecar(config_file, tmp_path, *flags) as (proxy, admin):
        wait_for("the sidecar to serve", lambda: sidecar_status(admin))
        for _ in range(3):
            # 40 characters -> ceil(40 / 4) = 10 prefill tokens; estimate 10 + 4 * 5 = 30.
            assert complete(proxy, "tenant_chat_pro", "x" * 40, max_tokens=5) == 200
        # A Pod standing for this sidecar (the test plays the kubelet: IP, Ready).
        pod = sidecar_pod("sidecar-a")
        admin_port = admin.rsplit(":", 1)[1]
        pod["metadata"]["annotations"] = {"tokenfair.io/admin-port": admin_port}
        kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/pods", pod)
        body = {
            "status": {
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        path = f"/api/v1/namespaces/{ns}/pods/sidecar-a/status"
        resp = kube_cluster.request(
            "PATCH", path, body, content_type="application/merge-patch+json"
        )
        assert resp.status == 200, resp.body

        def usage_of(name: str) -> dict[str, Any] | None:
            obj = get(kube_cluster, quota_path(ns, name))
            found = (obj or {}).get("status", {}).get("usage")
            return found if isinstance(found, dict) else None

        chat = wait_for("chat-pro's usage", lambda: usage_of("chat-pro"))
        assert chat["admittedServiceTokens"] == 90  # 3 requests x 30 service tokens
        assert chat["sidecars"] == 1
        assert chat["refusals"] == {}
        # 3 dispatched waits: p99 is a bucket's upper bound, at least the first one's (5 ms).
        assert chat["p99QueueWaitMs"] >= 5.0
        ide = wait_for("ide-assist's usage", lambda: usage_of("ide-assist"))
        assert ide["admittedServiceTokens"] == 0
        # ide-assist shares chat-pro's interactive lane but sent nothing: its own p99 is 0.
        assert ide["p99QueueWaitMs"] == 0.0
        table = kube_cluster.kubectl("get", "tq", "chat-pro", "-n", ns).stdout
        assert " 90 " in table  # the Admitted column


# --- the operator's own webhook certificates (no cert-manager) -----------------------------------

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
OWN_CERT_SECRET = "tokenfair-webhook-certs"


def static_webhook(ns: str, port: int) -> dict[str, Any]:
    """A ValidatingWebhookConfiguration as the chart installs one: fixed, no caBundle (the
    operator fills it), but by URL on loopback (the test API server cannot reach a Service), and
    failing closed, so an untrusted certificate shows as a refused request. Named
    ``tokenfair.io``: the shipped RBAC lets the operator patch exactly that name."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "tokenfair.io"},
        "webhooks": [
            {
                "name": "admit-quota.tokenfair.io",
                "clientConfig": {"url": f"https://localhost:{port}/admit-quota"},
                "rules": [
                    {
                        "apiGroups": ["tokenfair.io"],
                        "apiVersions": ["v1alpha1"],
                        "resources": ["tenantquotas"],
                        "operations": ["CREATE", "UPDATE"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "timeoutSeconds": 10,
                "admissionReviewVersions": ["v1"],
            }
        ],
    }


def test_own_certificate_is_issued_rotated_and_trusted_by_the_api_server(
    kube_cluster: KubeCluster, operator_kubeconfig: Path, kube_namespace: str, tmp_path: Path
) -> None:
    ns = kube_namespace
    (port,) = free_ports(1)
    # An expiring pair already stored (10 days left of 90, under the 30-day margin), with the
    # next pair whose CA was published an hour ago (the first phase of the two-phase rotation,
    # `certs.advance`): the operator must switch to the next pair at once, and keep trusting
    # the expiring pair's CA in the bundle for the switch-over.
    now = datetime.datetime.now(datetime.UTC)
    expiring = issue(("localhost",), now - datetime.timedelta(days=80))
    upcoming = issue(("localhost",), now)
    stored = Rotation(expiring, upcoming, now - datetime.timedelta(hours=1))
    data = {k: base64.b64encode(v).decode() for k, v in stored.as_secret_data().items()}
    secret = {"metadata": {"name": OWN_CERT_SECRET}, "data": data}
    kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)
    config_path = f"{ADMISSION}/validatingwebhookconfigurations/tokenfair.io"
    kube_cluster.expect(
        201, "POST", f"{ADMISSION}/validatingwebhookconfigurations", static_webhook(ns, port)
    )
    try:
        with running_operator(
            operator_kubeconfig,
            ns,
            tmp_path / "operator.log",
            TOKENFAIR_WEBHOOK_PORT=str(port),
            TOKENFAIR_WEBHOOK_ADDR="127.0.0.1",
            TOKENFAIR_WEBHOOK_HOST="localhost",
            TOKENFAIR_WEBHOOK_CERT_SECRET=f"{ns}/{OWN_CERT_SECRET}",
            TOKENFAIR_WEBHOOK_DNS_NAMES="localhost",
            TOKENFAIR_WEBHOOK_CONFIGURATIONS="tokenfair.io",
            TOKENFAIR_WEBHOOK_CERT_DIR=str(tmp_path / "certs"),
        ):

            def rotated() -> ServingCerts | None:
                stored = get(kube_cluster, f"/api/v1/namespaces/{ns}/secrets/{OWN_CERT_SECRET}")
                decoded = {
                    k: base64.b64decode(v) for k, v in (stored or {}).get("data", {}).items()
                }
                certs = ServingCerts.from_secret_data(decoded)
                return certs if certs is not None and certs != expiring else None

            fresh = wait_for("a new certificate in the Secret", rotated)
            assert fresh == upcoming
            assert due(fresh, ("localhost",), now) is None
            # The bundle: the new CA first, then the replaced one.
            bundle = base64.b64encode(fresh.ca_pem + expiring.ca_pem).decode()
            wait_for(
                "the caBundle to be set",
                lambda: json.dumps(get(kube_cluster, config_path) or {}).count(bundle) == 1,
            )
            # The caBundle can be written before the webhook server listens (on a loaded
            # machine the apply below then met "connection refused"): wait for the listener.
            wait_for("the webhook to listen", lambda: _listening(port))
            # The API server now calls the webhook over TLS, trusting the generated CA: it
            # admits the lesson and refuses what only our webhook can see (failing closed, any
            # TLS problem would refuse the lesson as well, with another message).
            apply_lesson(kube_cluster, ns)
            message = refused(kube_cluster, ns, quota("lost", policyName="nowhere"))
            assert "denied the request: TenantQuota 'lost': spec.policyName" in message
            # It serves the new certificate, not the expiring one.
            served = (tmp_path / "certs" / "tls.pem").read_bytes()
            assert served == fresh.key_pem + fresh.cert_pem
    finally:
        kube_cluster.request("DELETE", config_path)


def test_the_certificate_keeper_asks_for_leadership_before_each_write(tmp_path: Path) -> None:
    """No cluster: the keeper's API objects are fakes. It leads for the Secret's write, not any
    more for the caBundle patch: that patch is not sent, ``NotLeader`` is raised instead."""
    sent: list[str] = []

    def not_found(*_: Any, **__: Any) -> Any:
        raise ApiException(status=404, reason="Not Found")

    hook = SimpleNamespace(name="admit.tokenfair.io", client_config=SimpleNamespace(ca_bundle=None))
    core = SimpleNamespace(
        read_namespaced_secret=not_found,
        create_namespaced_secret=lambda *_, **__: sent.append("create Secret"),
    )
    admission = SimpleNamespace(
        read_validating_webhook_configuration=lambda *_: SimpleNamespace(webhooks=[hook]),
        patch_validating_webhook_configuration=lambda *_: sent.append("patch caBundle"),
        read_mutating_webhook_configuration=not_found,
    )
    answers = iter([True, False])  # leads when asked first, no longer when asked next
    keeper = CertKeeper(
        None,
        ("ns", "webhook-tls"),
        ["svc.ns.svc"],
        ["tokenfair.io"],
        tmp_path,
        may_write=lambda: next(answers),
    )
    keeper._core, keeper._admission = cast(Any, core), cast(Any, admission)

    with pytest.raises(NotLeader, match="caBundle of validating webhook configuration"):
        keeper.ensure()
    assert sent == ["create Secret"]
