"""The Helm chart ``charts/tokenfair``, rendered by Helm 3 and Helm 4 and installed on a real
control plane.

Behaviours under test:

- one canonical copy: the chart's ``crds/`` are byte-identical to the repository's ``crds/``;
- ``helm lint --strict`` passes and ``helm template`` renders for the default values and every
  documented variant (demo on, webhook with cert-manager, webhook with the operator's own
  certificate, watched namespaces), with both Helm majors; every rendered object parses and has
  apiVersion, kind and metadata.name;
- ``values.schema.json`` has ``additionalProperties: false`` on every object with fixed keys and
  refuses unknown keys; every key of ``values.yaml`` is commented;
- ``helm create`` labels on every object, selectors without the version;
- the ``restricted`` Pod Security Standard on every Pod and container;
- the operator's ClusterRole is never wider than the shipped ``tokenfair-operator`` of
  ``operator/rbac/clusterrole.yaml`` and lacks only the rules for Kopf-managed webhook
  configurations (the chart installs static ones), except, with the operator's own certificate,
  get/patch on exactly the chart's two webhook configurations; no ClusterRole of the chart grants
  Leases, and only the ``-secrets`` one (the shipped ``tokenfair-operator-secrets``) grants
  Secrets, bound by RoleBindings only: in ``operator.secretNamespaces``, else the watched
  namespaces, else the release namespace (plus the demo's); the Lease by name, get and update,
  in the release namespace only;
- the operator's Deployment: Kopf's logging flags from ``logLevel``/``logFormat``,
  ``extraArgs``/``extraEnv`` appended (a variable the chart sets is refused), ``image.digest``
  as ``repository@digest`` everywhere (injected sidecars too), and the ``sidecar.*`` values as
  the variables the operator's own ``injection_from_env`` reads back as the same defaults;
- the PodDisruptionBudget, NetworkPolicy (ports the container has; the webhook's only with the
  webhook), ServiceMonitor (a Service port) and PrometheusRule (``files/alerts.yaml`` as is, every
  metric it names exported by the operator or the sidecar) behind their toggles;
- the static webhook paths are the ids Kopf registers for the operator's admission handlers;
- without cert-manager: an empty chart Secret, a Role on exactly that Secret (get, update), the
  operator told the Secret, the Service's DNS names and the configurations, no cert-manager
  annotation or volume;
- the demo's objects are the lesson's tenants as the sidecar's own loader reads them;
- on the real control plane (``kube``): every variant passes ``kubectl apply --dry-run=server``;
  ``helm install`` (Helm 3 and 4) succeeds; the chart's operator container (its command, args and
  environment, run locally with a token of the chart's own ServiceAccount) reconciles the demo
  into a ConfigMap, a Secret and Ready conditions, with no 403; the demo's model-server container
  command serves the published Secret, and the ``helm test`` pod's check passes against both (and
  fails on a wrong tenant count); with the operator stopped, a bare ``helm uninstall`` leaves
  nothing behind but the CRDs (no finalizer holds the policy; the garbage collector removes the
  two documents it owns, waited for within its rediscovery period); the namespace and the
  cluster-scoped kinds are listed before and after and compared; with the operator's own
  certificate (Helm 4), the chart's operator with its own ServiceAccount token fills the chart's
  Secret, sets caBundle on both webhook configurations and serves that certificate for the
  Service's name (a TLS handshake trusting only the stored CA), and the uninstall leaves
  nothing behind.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import json
import os
import re
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from chart_support import (
    CHART,
    REPO,
    VARIANTS,
    Doc,
    assert_never_refused,
    container,
    dry_run,
    local_command,
    of_kind,
    parse,
    process,
    render,
    run_helm,
    set_args,
)
from kubecluster import KubeCluster
from loopback_support import free_ports
from operator_support import wait_for

from tokenfair.config import parse_documents
from tokenfair.sim.scenarios import LESSON_TENANTS
from tokenfair_operator.certs import ServingCerts, due
from tokenfair_operator.handlers import register_webhooks
from tokenfair_operator.inject import InjectionSettings
from tokenfair_operator.metrics import OperatorMetrics
from tokenfair_operator.settings import SIDECAR_ENV, OperatorConfig, injection_from_env

CRDS = REPO / "crds"
SHIPPED_ROLE = REPO / "operator" / "rbac" / "clusterrole.yaml"
HELM_MAJORS = (3, 4)
# Kinds of CRDs the test control plane does not have: checked offline only.
FOREIGN_API_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/", "keda.sh/")
# The public demo keys of examples/sidecar-standalone.yaml, by tenant id.
DEMO_KEYS = {
    "tenant_chat_pro": "sk-local-chat-pro",
    "tenant_ide_assist": "sk-local-ide-assist",
    "tenant_batch_rag": "sk-local-batch-rag",
}
# Maps whose keys are free (labels, annotations): a typed additionalProperties, not false.
FREE_MAPS = {"annotations", "podAnnotations", "podLabels", "nodeSelector", "labels", "matchLabels"}
WAIT_S = 30.0
GC_WAIT_S = 75.0


# --- rendering ---------------------------------------------------------------------------------


def pod_specs(docs: list[Doc]) -> list[Doc]:
    """The Pod specs of Deployments and bare Pods (the helm test pod)."""
    specs = [d["spec"]["template"]["spec"] for d in of_kind(docs, "Deployment")]
    return specs + [d["spec"] for d in of_kind(docs, "Pod")]


# --- offline: files and schema -----------------------------------------------------------------


def test_chart_crds_are_byte_identical_to_the_canonical_ones() -> None:
    canonical = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert canonical, "no CRDs in crds/"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == canonical
    for name in canonical:
        assert (CHART / "crds" / name).read_bytes() == (CRDS / name).read_bytes(), name


def _schema_objects(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield path, node
        for key, child in node.get("properties", {}).items():
            yield from _schema_objects(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _schema_objects(node["items"], f"{path}[]")


def test_values_schema_closes_every_object() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = list(_schema_objects(schema, "$"))
    assert len(objects) > 20  # the walk reached the nested objects, not only the root
    for path, node in objects:
        closed = node.get("additionalProperties")
        if path.rsplit(".", 1)[-1] in FREE_MAPS:
            assert closed == {"type": "string"}, path
        else:
            assert closed is False, path


def _key_paths(lines: list[str]) -> Iterator[tuple[str, bool]]:
    """(dotted path, commented?) for each mapping key in values.yaml: commented when the line
    before it is a comment (``# ...`` or a list item opened by one, ``- # ...``)."""
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        body = stripped.removeprefix("- ")
        if not stripped.startswith("#") and ":" in body and not body.startswith("#"):
            indent = len(line) - len(line.lstrip()) + (len(stripped) - len(body))
            key = body.split(":", 1)[0]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key))
            commented = previous.startswith("#") or previous.startswith("- #")
            yield ".".join(k for _, k in stack), commented
        previous = stripped


def test_every_values_key_is_commented() -> None:
    seen: dict[str, bool] = {}
    for path, commented in _key_paths((CHART / "values.yaml").read_text().splitlines()):
        seen[path] = seen.get(path, False) or commented
    assert "demo.tenants.apiKeySha256" in seen  # the walk reached list items
    assert [path for path, ok in seen.items() if not ok] == []


@pytest.mark.parametrize("major", HELM_MAJORS)
def test_schema_refuses_unknown_keys(major: int) -> None:
    for bad in ("operator.bogus=1", "demo.tenants[0].colour=red", "bogus=1"):
        result = run_helm(major, "template", "t", str(CHART), "--set", bad, check=False)
        assert result.returncode != 0, bad
        assert "bogus" in result.stderr or "colour" in result.stderr, result.stderr


# --- offline: rendered variants ----------------------------------------------------------------


@pytest.mark.parametrize("major", HELM_MAJORS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict_and_render(major: int, variant: str) -> None:
    sets = VARIANTS[variant]
    run_helm(major, "lint", "--strict", str(CHART), *set_args(sets))
    docs = parse(render(major, sets))
    kinds = {doc["kind"] for doc in docs}
    assert {"ServiceAccount", "ClusterRole", "Deployment", "Service", "Pod"} <= kinds
    assert ("SchedulingPolicy" in kinds) == (variant == "demo")
    assert ("Certificate" in kinds) == (variant == "webhook-cert-manager")
    binding = "RoleBinding" if variant == "watch-namespaces" else "ClusterRoleBinding"
    assert binding in kinds
    assert ("PrometheusRule" in kinds) == (variant == "production")


@pytest.mark.parametrize("variant", VARIANTS)
def test_labels_follow_helm_create(variant: str) -> None:
    docs = parse(render(4, VARIANTS[variant], release="rel"))
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "tokenfair", doc["metadata"]
        assert labels.get("app.kubernetes.io/instance") == "rel"
        assert labels.get("app.kubernetes.io/managed-by") == "Helm"
        assert labels.get("helm.sh/chart") == "tokenfair-0.1.0"
        assert labels.get("app.kubernetes.io/version") == "0.1.0"
    selectors = [d["spec"]["selector"]["matchLabels"] for d in of_kind(docs, "Deployment")]
    selectors += [d["spec"]["selector"] for d in of_kind(docs, "Service")]
    for selector in selectors:
        assert "app.kubernetes.io/version" not in selector
        assert "helm.sh/chart" not in selector
        assert selector["app.kubernetes.io/instance"] == "rel"
    for deployment in of_kind(docs, "Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_meets_the_restricted_profile(variant: str) -> None:
    specs = pod_specs(parse(render(4, VARIANTS[variant])))
    assert specs
    for spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not spec.get("hostNetwork")
        assert not spec.get("hostPID")
        for each in spec["containers"]:
            ctx = each["securityContext"]
            assert ctx["runAsNonRoot"] is True, each["name"]
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
            assert "privileged" not in ctx


def grants(role: Mapping[str, Any]) -> set[tuple[str, str, str, str]]:
    """Every (apiGroup, resource, verb, resourceName or '*') a ClusterRole grants."""
    return {
        (group, resource, verb, name)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for name in rule.get("resourceNames", ["*"])
    }


def webhook_configurations(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"].endswith("WebhookConfiguration")]


def ca_bundle_grants(docs: list[Doc]) -> set[tuple[str, str, str, str]]:
    """get and patch on exactly the rendered webhook configurations, by name: what the
    operator needs to set caBundle with its own certificate."""
    return {
        ("admissionregistration.k8s.io", f"{d['kind'].lower()}s", verb, d["metadata"]["name"])
        for d in webhook_configurations(docs)
        for verb in ("get", "patch")
    }


def shipped_roles() -> dict[str, Doc]:
    """The ClusterRoles of ``operator/rbac/clusterrole.yaml`` by name."""
    docs = [d for d in yaml.safe_load_all(SHIPPED_ROLE.read_text()) if d is not None]
    return {d["metadata"]["name"]: d for d in docs}


def cluster_roles(docs: list[Doc]) -> dict[str, Doc]:
    """The chart's ClusterRoles by what they are for: ``operator`` and ``secrets``."""
    roles = {d["metadata"]["name"]: d for d in of_kind(docs, "ClusterRole")}
    (main,) = [r for n, r in roles.items() if n.endswith("-operator")]
    (secrets,) = [r for n, r in roles.items() if n.endswith("-operator-secrets")]
    assert len(roles) == 2, sorted(roles)
    return {"operator": main, "secrets": secrets}


def own_certificate(sets: tuple[str, ...]) -> bool:
    return "webhook.enabled=true" in sets and "certManager.enabled=true" not in sets


@pytest.mark.parametrize("variant", VARIANTS)
def test_cluster_role_is_the_shipped_one_without_webhook_management(variant: str) -> None:
    docs = parse(render(4, VARIANTS[variant]))
    roles = cluster_roles(docs)
    shipped = shipped_roles()
    shipped_main = grants(shipped["tokenfair-operator"])
    chart = grants(roles["operator"])
    if own_certificate(VARIANTS[variant]):
        # One addition, by name: caBundle on the chart's own two configurations.
        own = ca_bundle_grants(docs)
        assert len(own) == 4  # (validating, mutating) x (get, patch)
        assert own <= chart
        chart -= own
    assert chart <= shipped_main, chart - shipped_main
    # What is left out is exactly Kopf's management of its own webhook configurations.
    assert {g[0] for g in shipped_main - chart} == {"admissionregistration.k8s.io"}
    assert grants(roles["secrets"]) == grants(shipped["tokenfair-operator-secrets"])
    # Secrets and Leases are never part of the cluster-wide role, shipped or charted.
    for grant in (*chart, *shipped_main):
        assert grant[1] not in ("secrets", "leases"), grant


def bound_namespaces(docs: list[Doc], role: Doc) -> list[str]:
    """Namespaces in which ``role`` (a ClusterRole) is bound; ``*`` for a ClusterRoleBinding."""
    name = role["metadata"]["name"]
    bindings = [
        d
        for d in of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding")
        if d["roleRef"]
        == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
    ]
    return sorted(d["metadata"].get("namespace", "*") for d in bindings)


@pytest.mark.parametrize(
    ("sets", "namespaces"),
    [
        ((), ["tokenfair-system"]),  # never "*", even when every namespace is watched
        (("operator.watchNamespaces={team-a,team-b}",), ["team-a", "team-b"]),
        (
            ("operator.watchNamespaces={team-a}", "operator.secretNamespaces={team-c,team-d}"),
            ["team-c", "team-d"],
        ),
        (
            ("operator.secretNamespaces={team-c}", "demo.enabled=true"),
            ["team-c", "tokenfair-system"],
        ),
        (
            ("operator.watchNamespaces={tokenfair-system}", "demo.enabled=true"),
            ["tokenfair-system"],
        ),
    ],
)
def test_secrets_are_granted_per_namespace_only(
    sets: tuple[str, ...], namespaces: list[str]
) -> None:
    docs = parse(render(4, sets))
    roles = cluster_roles(docs)
    assert bound_namespaces(docs, roles["secrets"]) == namespaces
    service_account = of_kind(docs, "ServiceAccount")[0]["metadata"]
    for binding in of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding"):
        (subject,) = binding["subjects"]
        assert subject == {
            "kind": "ServiceAccount",
            "name": service_account["name"],
            "namespace": "tokenfair-system",
        }
    # The only other Secret rule anywhere: the webhook certificate's, by name (own certificate).
    for role in of_kind(docs, "Role"):
        for rule in role["rules"]:
            if "secrets" in rule["resources"]:
                assert rule["resourceNames"] == ["tokenfair-webhook-tls"], role["metadata"]


def test_the_lease_is_granted_by_name_in_the_release_namespace() -> None:
    docs = parse(render(4, ()))
    (lease,) = of_kind(docs, "Lease")
    leases = [
        (role, rule)
        for role in of_kind(docs, "Role") + of_kind(docs, "ClusterRole")
        for rule in role["rules"]
        if "leases" in rule["resources"]
    ]
    ((role, rule),) = leases
    assert role["kind"] == "Role"
    assert role["metadata"]["namespace"] == lease["metadata"]["namespace"] == "tokenfair-system"
    assert rule == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": [lease["metadata"]["name"]],
        "verbs": ["get", "update"],
    }
    (binding,) = [d for d in of_kind(docs, "RoleBinding") if d["roleRef"]["kind"] == "Role"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    operator = container(docs, "Deployment", "operator")
    env = env_of(operator)
    assert env["TOKENFAIR_LEASE_NAME"] == lease["metadata"]["name"]
    assert env["TOKENFAIR_LEASE_NAMESPACE"] == "tokenfair-system"


def kopf_webhook_ids() -> set[str]:
    """The ids under which the operator's startup hook registers its admission handlers (here
    in a registry of their own, with a webhook port set)."""
    registry = kopf.OperatorRegistry()
    register_webhooks(registry, OperatorConfig(webhook_port=9443))
    return {h.id for h in registry._webhooks.get_all_handlers()}


def test_static_webhooks_call_the_operators_handlers() -> None:
    docs = parse(render(4, VARIANTS["webhook-cert-manager"]))
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    paths = {h["clientConfig"]["service"]["path"].lstrip("/") for h in hooks}
    assert paths == kopf_webhook_ids()
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("operator")]
    for hook in hooks:
        # Validation fails open (CEL and status still refuse); injection fails closed.
        closed = hook["name"].startswith("inject-sidecar")
        assert hook["failurePolicy"] == ("Fail" if closed else "Ignore")
        ref = hook["clientConfig"]["service"]
        assert ref["name"] == service["metadata"]["name"]
        assert ref["port"] in {p["port"] for p in service["spec"]["ports"]}
    (cert,) = of_kind(docs, "Certificate")
    for doc in docs:
        if doc["kind"].endswith("WebhookConfiguration"):
            injected = doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            assert injected == f"tokenfair-system/{cert['metadata']['name']}"
    # The operator mounts the Secret the Certificate fills.
    (operator,) = [d for d in of_kind(docs, "Deployment") if "operator" in d["metadata"]["name"]]
    secrets = [
        v["secret"]["secretName"]
        for v in operator["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    ]
    assert secrets == [cert["spec"]["secretName"]]


def env_of(container: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_own_certificate_variant_wires_secret_rbac_and_configurations() -> None:
    docs = parse(render(4, VARIANTS["webhook-own-certificate"]))
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    hooks = webhook_configurations(docs)
    assert len(hooks) == 2
    paths = {h["clientConfig"]["service"]["path"].lstrip("/") for d in hooks for h in d["webhooks"]}
    assert paths == kopf_webhook_ids()
    for doc in hooks:  # caBundle is the operator's to set, not cert-manager's
        assert "annotations" not in doc["metadata"]
        assert all("caBundle" not in h["clientConfig"] for h in doc["webhooks"])
    (operator,) = [d for d in of_kind(docs, "Deployment") if "operator" in d["metadata"]["name"]]
    spec = operator["spec"]["template"]["spec"]
    env = env_of(spec["containers"][0])
    # The Secret the operator keeps its certificate in is the chart's (empty, so it goes with
    # the release), and the only Secret it may touch by the Role, by name, get and update.
    (secret,) = of_kind(docs, "Secret")
    assert "data" not in secret
    secret_ref = f"{secret['metadata']['namespace']}/{secret['metadata']['name']}"
    assert env["TOKENFAIR_WEBHOOK_CERT_SECRET"] == secret_ref
    (role,) = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-certs")]
    assert grants(role) == {
        ("", "secrets", verb, secret["metadata"]["name"]) for verb in ("get", "update")
    }
    (binding,) = [
        b for b in of_kind(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    # caBundle on exactly the rendered configurations (both are named alike).
    names = {d["metadata"]["name"] for d in hooks}
    assert set(env["TOKENFAIR_WEBHOOK_CONFIGURATIONS"].split(",")) == names
    # The certificate's names are the ones the API server calls: <service>.<namespace>.svc.
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("operator")]
    dns = env["TOKENFAIR_WEBHOOK_DNS_NAMES"].split(",")
    assert f"{service['metadata']['name']}.tokenfair-system.svc" in dns
    assert env["TOKENFAIR_WEBHOOK_CERT_DIR"].startswith("/tmp/")  # the writable emptyDir
    assert not [v for v in spec["volumes"] if "secret" in v]


def test_demo_is_the_lessons_tenants_as_the_sidecar_reads_them() -> None:
    docs = parse(render(4, VARIANTS["demo"]))
    ours = [d for d in docs if d["apiVersion"].startswith("tokenfair.io/")]
    config = parse_documents(ours, "demo")
    without_keys = tuple(dataclasses.replace(t, api_key_sha256=()) for t in config.tenants)
    assert without_keys == LESSON_TENANTS
    for tenant in config.tenants:
        digest = hashlib.sha256(DEMO_KEYS[tenant.tenant_id].encode()).hexdigest()
        assert tenant.api_key_sha256 == (digest,)
    (policy,) = of_kind(docs, "SchedulingPolicy")
    (server,) = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("demo")]
    template = server["spec"]["template"]
    assert template["metadata"]["labels"]["tokenfair.io/policy"] == policy["metadata"]["name"]
    # Named as the injector names its container, so injection never adds a second sidecar.
    (container,) = template["spec"]["containers"]
    assert container["name"] == "tokenfair-sidecar"
    assert "--backend=costmodel" in container["args"]
    (volume,) = [v for v in template["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == f"tokenfair-{policy['metadata']['name']}-keys"


# --- offline: operator settings, injection defaults, PDB, NetworkPolicy, monitoring ------------

DIGEST = "sha256:" + "0123456789abcdef" * 4


def operator_container(docs: list[Doc]) -> Doc:
    return container(docs, "Deployment", "operator")


def test_logging_extra_args_and_extra_env() -> None:
    default = operator_container(parse(render(4)))
    assert default["args"][-1] == "--log-format=full"
    assert not {"--debug", "--quiet", "--verbose"} & set(default["args"])  # Kopf's INFO
    sets = (
        "operator.logLevel=debug",
        "operator.logFormat=json",
        "operator.extraArgs={--log-refkey=object}",
        "operator.extraEnv[0].name=HTTPS_PROXY",
        "operator.extraEnv[0].value=http://proxy:3128",
    )
    tuned = operator_container(parse(render(4, sets)))
    assert tuned["args"][-3:] == ["--debug", "--log-format=json", "--log-refkey=object"]
    assert tuned["env"][-1] == {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    quiet = operator_container(parse(render(4, ("operator.logLevel=warning",))))
    assert "--quiet" in quiet["args"]
    # A variable the chart sets itself is refused (server-side apply refuses a repeated name).
    for name in ("TOKENFAIR_RESYNC_SECONDS", "TOKENFAIR_SIDECAR_CPU_REQUEST"):
        bad = (f"operator.extraEnv[0].name={name}", "operator.extraEnv[0].value=x")
        result = run_helm(4, "template", "t", str(CHART), *set_args(bad), check=False)
        assert result.returncode != 0
        assert f"operator.extraEnv: {name} is set by the chart itself" in result.stderr


def test_image_digest_replaces_the_tag_everywhere() -> None:
    docs = parse(render(4, (f"image.digest={DIGEST}", "demo.enabled=true", "image.tag=9.9")))
    images = [c["image"] for spec in pod_specs(docs) for c in spec["containers"]]
    assert len(images) == 3  # operator, demo model server, helm test
    assert set(images) == {f"tokenfair/tokenfair@{DIGEST}"}
    assert env_of(operator_container(docs))["TOKENFAIR_SIDECAR_IMAGE"] == images[0]
    # Without a digest: the tag (the chart's appVersion by default).
    plain = operator_container(parse(render(4)))
    assert plain["image"] == "tokenfair/tokenfair:0.1.0"


def test_sidecar_values_are_the_injectors_defaults() -> None:
    """The chart's ``sidecar.*`` values reach injected sidecars through the operator's
    environment, read back by the operator's own parser (one rule, one home)."""
    default = injection_from_env(env_of(operator_container(parse(render(4)))))
    assert default == InjectionSettings(
        image="tokenfair/tokenfair:0.1.0",
        config_url_base=default.config_url_base,
        env_names=SIDECAR_ENV,
    )
    sets = (
        "sidecar.resources.requests.cpu=250m",
        "sidecar.resources.requests.memory=256Mi",
        "sidecar.resources.limits.cpu=2",
        "sidecar.resources.limits.memory=1Gi",
        "sidecar.maxInFlight=32",
        "sidecar.logLevel=warning",
        "sidecar.drainGraceSeconds=20",
        "sidecar.scrapeAnnotations=false",
    )
    tuned = injection_from_env(env_of(operator_container(parse(render(4, sets)))))
    assert (tuned.cpu_request, tuned.memory_request) == ("250m", "256Mi")
    assert (tuned.cpu_limit, tuned.memory_limit) == ("2", "1Gi")
    assert (tuned.max_in_flight, tuned.log_level, tuned.drain_grace_s) == (32, "warning", 20.0)
    assert tuned.scrape_annotations is False


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ("image.digest=latest", "/image/digest"),
        ("operator.logLevel=trace", "/operator/logLevel"),
        ("operator.logFormat=xml", "/operator/logFormat"),
        ("sidecar.resources.requests.cpu=fast", "/sidecar/resources/requests/cpu"),
        ("sidecar.logLevel=verbose", "/sidecar/logLevel"),
        ("sidecar.maxInFlight=-1", "/sidecar/maxInFlight"),
        ("operator.podDisruptionBudget.maxUnavailable=0", "/operator/podDisruptionBudget"),
        ("networkPolicy.httpFrom[0].bogus=1", "bogus"),
    ],
)
def test_schema_refuses_bad_new_values(bad: str, where: str) -> None:
    result = run_helm(4, "template", "t", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0, bad
    assert where in result.stderr, result.stderr


def test_pod_disruption_budget() -> None:
    docs = parse(render(4))
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    (deployment,) = of_kind(docs, "Deployment")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    off = parse(render(4, ("operator.podDisruptionBudget.enabled=false",)))
    assert not of_kind(off, "PodDisruptionBudget")
    percent = parse(render(4, ("operator.podDisruptionBudget.maxUnavailable=50%",)))
    assert of_kind(percent, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == "50%"


def test_network_policy_opens_only_the_operators_ports() -> None:
    assert not of_kind(parse(render(4)), "NetworkPolicy")
    peer = "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/24"
    for webhook in (False, True):
        sets = ("networkPolicy.enabled=true", peer, f"webhook.enabled={str(webhook).lower()}")
        docs = parse(render(4, sets))
        (policy,) = of_kind(docs, "NetworkPolicy")
        (deployment,) = of_kind(docs, "Deployment")
        spec = policy["spec"]
        assert spec["podSelector"] == deployment["spec"]["selector"]
        assert spec["policyTypes"] == ["Ingress"]
        ports = {p["name"] for p in operator_container(docs)["ports"]}
        opened = [p["port"] for rule in spec["ingress"] for p in rule["ports"]]
        assert set(opened) == ports  # every port the container has, nothing else
        assert ("webhook" in opened) == webhook
        if webhook:
            (rule,) = [r for r in spec["ingress"] if r["ports"][0]["port"] == "webhook"]
            assert rule["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
        http = next(r for r in spec["ingress"] if r["ports"][0]["port"] == "http")
        assert "from" not in http  # none listed: from anywhere


def test_service_monitor_scrapes_the_operators_metrics() -> None:
    assert not of_kind(parse(render(4)), "ServiceMonitor")
    docs = parse(render(4, ("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom")))
    (monitor,) = of_kind(docs, "ServiceMonitor")
    (service,) = [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("operator")]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


ALERTS = CHART / "files" / "alerts.yaml"
SIDECAR_METRICS = REPO / "sidecar" / "tokenfair" / "server" / "metrics.py"
SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def exported_metrics() -> set[str]:
    """Metric families the operator exports (its real exposition) and the sidecar declares
    (the names its metrics module registers; counters without ``_total``)."""
    operator = {
        line.split()[2]
        for line in OperatorMetrics().exposition().decode().splitlines()
        if line.startswith("# TYPE ")
    }
    sidecar = set(re.findall(r'"(tokenfair_[a-z0-9_]+)"', SIDECAR_METRICS.read_text()))
    return operator | sidecar


def test_prometheus_rule_is_the_alerts_file_and_names_real_metrics() -> None:
    assert not of_kind(parse(render(4)), "PrometheusRule")
    docs = parse(render(4, ("prometheusRule.enabled=true",)))
    (rule,) = of_kind(docs, "PrometheusRule")
    alerts = yaml.safe_load(ALERTS.read_text())
    assert rule["spec"] == alerts
    exported = exported_metrics()
    assert "tokenfair_operator_pods_without_sidecar" in exported
    assert "tokenfair_backend_errors" in exported
    rules = [r for group in alerts["groups"] for r in group["rules"]]
    assert len(rules) >= 5
    for alert in rules:
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, alert
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        names = re.findall(r"\btokenfair_[a-z0-9_]+", alert["expr"])
        assert names, alert["alert"]
        for name in names:
            family = next((name.removesuffix(s) for s in SERIES_SUFFIXES if name.endswith(s)), name)
            assert name in exported or family in exported, f"{alert['alert']}: {name}"


def test_pod_monitor_scrapes_the_injected_sidecars_admin_port() -> None:
    assert not of_kind(parse(render(4)), "PodMonitor")
    inject = (REPO / "operator" / "tokenfair_operator" / "inject.py").read_text()
    for major in (3, 4):
        sets = ("podMonitor.enabled=true", "podMonitor.labels.release=prom")
        (monitor,) = of_kind(parse(render(major, sets)), "PodMonitor")
        spec = monitor["spec"]
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert spec["selector"] == {
            "matchExpressions": [{"key": "tokenfair.io/policy", "operator": "Exists"}]
        }
        assert spec["namespaceSelector"] == {"any": True}
        (endpoint,) = spec["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("tokenfair-admin", "/metrics")
        # The injector names the admin port so.
        assert '{"name": "tokenfair-admin", "containerPort": ADMIN_PORT' in inject
    sets = ("podMonitor.enabled=true", "operator.watchNamespaces={team-a,team-b}")
    (monitor,) = of_kind(parse(render(4, sets)), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


DASHBOARD = CHART / "files" / "dashboard.json"


def test_grafana_dashboard_configmap_ships_the_dashboard_file() -> None:
    assert not [
        d
        for d in of_kind(parse(render(4)), "ConfigMap")
        if d["metadata"]["name"].endswith("-dashboard")
    ]
    for major in (3, 4):
        folder = "grafanaDashboard.annotations.grafana_folder=tokenfair"
        docs = parse(render(major, ("grafanaDashboard.enabled=true", folder)))
        (configmap,) = [
            d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "tokenfair-dashboard"
        ]
        metadata = configmap["metadata"]
        assert metadata["namespace"] == "tokenfair-system"
        assert metadata["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar selects
        assert metadata["labels"]["app.kubernetes.io/name"] == "tokenfair"
        assert metadata["annotations"] == {"grafana_folder": "tokenfair"}
        assert json.loads(configmap["data"]["tokenfair.json"]) == json.loads(DASHBOARD.read_text())
    sets = (
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.namespace=monitoring",
        "grafanaDashboard.labels.grafana_dashboard=tokenfair",
    )
    docs = parse(render(4, sets))
    (configmap,) = [
        d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "tokenfair-dashboard"
    ]
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "tokenfair"


# --- on the real control plane -----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_passes_server_dry_run(
    kube_cluster: KubeCluster, kube_namespace: str, variant: str
) -> None:
    sets = VARIANTS[variant]
    if variant == "watch-namespaces":  # RoleBindings in namespaces that exist
        sets = (f"operator.watchNamespaces={{{kube_namespace}}}",)
    docs = parse(render(4, sets, namespace=kube_namespace))
    # cert-manager's and the Prometheus Operator's CRDs are not installed on the test control
    # plane: their objects are checked offline only.
    docs = [d for d in docs if not d["apiVersion"].startswith(FOREIGN_API_GROUPS)]
    out = dry_run(kube_cluster, kube_namespace, docs)
    assert out.count("(server dry run)") == len(docs), out


CLUSTER_KINDS = (
    "customresourcedefinitions",
    "clusterroles",
    "clusterrolebindings",
    "validatingwebhookconfigurations",
    "mutatingwebhookconfigurations",
)


def inventory(cluster: KubeCluster, namespace: str) -> set[str]:
    """Every object in ``namespace`` (all listable kinds but Events, which the API server
    expires by itself) and every object of the cluster-scoped kinds the chart creates."""
    kinds = cluster.kubectl("api-resources", "--verbs=list", "--namespaced", "-o", "name")
    namespaced = [k for k in kinds.stdout.split() if k.split(".")[0] != "events"]
    names = cluster.kubectl("get", ",".join(namespaced), "-n", namespace, "-o", "name").stdout
    names += cluster.kubectl("get", ",".join(CLUSTER_KINDS), "-o", "name").stdout
    return set(names.split())


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def get(cluster: KubeCluster, path: str) -> dict[str, Any] | None:
    resp = cluster.request("GET", path)
    return resp.body if resp.status == 200 else None


def all_ready(cluster: KubeCluster, namespace: str) -> list[Doc] | None:
    """The demo's TenantQuotas once every one has Ready=True."""
    body = get(cluster, f"/apis/tokenfair.io/v1alpha1/namespaces/{namespace}/tenantquotas")
    quotas = (body or {}).get("items", [])
    ready = [
        q
        for q in quotas
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in q.get("status", {}).get("conditions", [])
        )
    ]
    return quotas if quotas and len(ready) == len(quotas) else None


@pytest.mark.parametrize("major", HELM_MAJORS)
def test_install_reconcile_uninstall(
    kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path, major: int
) -> None:
    ns, release = kube_namespace, f"tfchart{major}"
    before = inventory(kube_cluster, ns)
    # --skip-crds: the session's control plane already holds the (byte-identical) CRDs, applied
    # by another field manager, which Helm 4's server-side apply would conflict with.
    args = ("install", release, str(CHART), "-n", ns, "--set", "demo.enabled=true", "--skip-crds")
    kube_cluster.helm(*args, major=major)
    docs = parse(render(major, ("demo.enabled=true",), release=release, namespace=ns))
    operator, sidecar = (
        container(docs, "Deployment", "operator"),
        container(docs, "Deployment", "demo"),
    )
    # The chart's ServiceAccount and bindings, exactly as installed, are the operator's identity.
    sa = f"{release}-tokenfair-operator"
    token = kube_cluster.service_account_token(ns, sa)
    kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "kubeconfig", token, user=sa)
    # The chart's operator container, run here: its command, args and environment, with the
    # health endpoint on a loopback port and this test's namespace only (the cluster is shared).
    health_port, proxy_port, admin_port = free_ports(3)
    remap = {"0.0.0.0:8080": f"127.0.0.1:{health_port}", "--all-namespaces": f"--namespace={ns}"}
    env = {**os.environ, **{e["name"]: e["value"] for e in operator["env"]}}
    env["KUBECONFIG"] = str(kubeconfig)
    # The operator's HTTP server (sidecars' long-poll, /metrics) on a free loopback port here.
    env["TOKENFAIR_HTTP_ADDR"], env["TOKENFAIR_HTTP_PORT"] = "127.0.0.1", str(free_ports(1)[0])
    with process(local_command(operator, remap), tmp_path / "operator.log", env) as log:
        quotas = wait_for("the demo quotas to be Ready", lambda: all_ready(kube_cluster, ns))
        assert len(quotas) == len(LESSON_TENANTS)
        configmap = get(kube_cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-demo")
        assert configmap is not None
        published = parse_documents(yaml.safe_load_all(configmap["data"]["config.yaml"]), "cm")
        # Listed in creation order, then name: Helm creates them within one second.
        assert sorted(t.tenant_id for t in published.tenants) == sorted(DEMO_KEYS)
        secret = get(kube_cluster, f"/api/v1/namespaces/{ns}/secrets/tokenfair-demo-keys")
        assert secret is not None
        demo = get(
            kube_cluster, f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/schedulingpolicies/demo"
        )
        assert demo is not None
        # Play the kubelet for the demo's model server: the Secret as its mounted file, its
        # container's command line, the helm test pod's check against both.
        mount = tmp_path / "etc-tokenfair"
        mount.mkdir()
        (mount / "config.yaml").write_bytes(base64.b64decode(secret["data"]["config.yaml"]))
        remap = {
            "/etc/tokenfair": str(mount),
            "0.0.0.0:8080": f"127.0.0.1:{proxy_port}",
            "0.0.0.0:9090": f"127.0.0.1:{admin_port}",
        }
        sidecar_cmd = local_command(sidecar, remap)
        with process(sidecar_cmd, tmp_path / "sidecar.log", os.environ):
            admin = f"http://127.0.0.1:{admin_port}"
            wait_for("the demo's sidecar to be ready", lambda: http_ok(f"{admin}/readyz"))
            check = container(docs, "Pod", "test")
            remap = {
                f"http://{release}-tokenfair-operator:8080": f"http://127.0.0.1:{health_port}",
                f"http://{release}-tokenfair-demo:9090": admin,
            }
            helm_test = local_command(check, remap)
            result = subprocess.run(helm_test, capture_output=True, text=True, check=False)
            assert result.returncode == 0, result.stderr
            # The check can fail: it counts the tenants the sidecar serves.
            wrong = subprocess.run(
                [*helm_test[:-1], "4"], capture_output=True, text=True, check=False
            )
            assert "AssertionError: tenants:" in wrong.stderr
        assert_never_refused(log.read_text(errors="replace"))
    # The operator is gone before the uninstall (the strictest case: nothing could release a
    # finalizer). A bare `helm uninstall` then removes everything but the CRDs: no object
    # carries a finalizer, so the policy goes at once and the garbage collector takes the
    # ConfigMap and Secret it owns.
    kube_cluster.helm("uninstall", release, "-n", ns, major=major)
    after = settled_inventory(kube_cluster, ns, before)
    assert before - after == set()  # it removed nothing that was not the chart's
    assert "schedulingpolicy.tokenfair.io/demo" not in after
    # Whatever is left is owned by the deleted policy: the garbage collector's to remove.
    for leftover in after - before:
        body = json.loads(kube_cluster.kubectl("get", leftover, "-n", ns, "-o", "json").stdout)
        owners = [ref["uid"] for ref in body["metadata"].get("ownerReferences", [])]
        assert owners == [demo["metadata"]["uid"]], leftover
    if kube_cluster.binaries.kube_controller_manager is not None:
        # Bounded by the collector's resource rediscovery period (30 s): on a fresh control
        # plane it may learn of the CRD-based owner kind only then.
        wait_for(
            "the garbage collector to remove the policy's documents",
            lambda: inventory(kube_cluster, ns) == before,
            timeout_s=GC_WAIT_S,
        )


def settled_inventory(
    cluster: KubeCluster, namespace: str, target: set[str], settle_s: float = 3.0
) -> set[str]:
    """:func:`inventory` once it equals ``target`` or has not changed for ``settle_s``."""
    deadline = time.monotonic() + WAIT_S
    last, stable_since = inventory(cluster, namespace), time.monotonic()
    while last != target and time.monotonic() < deadline:
        time.sleep(0.5)
        now = inventory(cluster, namespace)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > settle_s:
            break
    return last


def served_certificate(port: int, ca_pem: bytes, hostname: str) -> bool:
    """A TLS handshake with loopback ``port`` trusting only ``ca_pem`` and checking
    ``hostname`` succeeds."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname=hostname),
        ):
            return True
    except OSError:  # ssl.SSLError included: not up yet, or the wrong certificate
        return False


def test_install_with_the_operators_own_certificate(
    kube_cluster: KubeCluster, kube_namespace: str, tmp_path: Path
) -> None:
    ns, release = kube_namespace, "tfcerts"
    sets = VARIANTS["webhook-own-certificate"]
    before = inventory(kube_cluster, ns)
    kube_cluster.helm(
        "install", release, str(CHART), "-n", ns, *set_args(sets), "--skip-crds", major=4
    )
    docs = parse(render(4, sets, release=release, namespace=ns))
    operator = container(docs, "Deployment", "operator")
    sa = f"{release}-tokenfair-operator"
    token = kube_cluster.service_account_token(ns, sa)
    kubeconfig = kube_cluster.write_kubeconfig(tmp_path / "kubeconfig", token, user=sa)
    health_port, webhook_port = free_ports(2)
    remap = {"0.0.0.0:8080": f"127.0.0.1:{health_port}", "--all-namespaces": f"--namespace={ns}"}
    chart_env = env_of(operator)
    env = {
        **os.environ,
        **chart_env,
        "KUBECONFIG": str(kubeconfig),
        # Loopback only here, and a folder of this test for the files.
        "TOKENFAIR_WEBHOOK_ADDR": "127.0.0.1",
        "TOKENFAIR_WEBHOOK_PORT": str(webhook_port),
        "TOKENFAIR_WEBHOOK_CERT_DIR": str(tmp_path / "certs"),
        "TOKENFAIR_HTTP_ADDR": "127.0.0.1",
        "TOKENFAIR_HTTP_PORT": str(free_ports(1)[0]),
    }
    secret_path = f"/api/v1/namespaces/{ns}/secrets/{release}-tokenfair-webhook-tls"
    dns_names = chart_env["TOKENFAIR_WEBHOOK_DNS_NAMES"].split(",")

    def stored() -> ServingCerts | None:
        data = (get(kube_cluster, secret_path) or {}).get("data") or {}
        return ServingCerts.from_secret_data({k: base64.b64decode(v) for k, v in data.items()})

    with process(local_command(operator, remap), tmp_path / "operator.log", env) as log:
        certs = wait_for("the operator's certificate in the chart's Secret", stored)
        assert due(certs, dns_names, datetime.datetime.now(datetime.UTC)) is None
        bundle = base64.b64encode(certs.ca_pem).decode()
        for doc in webhook_configurations(docs):
            kind, name = f"{doc['kind'].lower()}s", doc["metadata"]["name"]
            path = f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}"

            def bundled(path: str = path) -> bool:
                hooks = (get(kube_cluster, path) or {}).get("webhooks") or [{}]
                return all(h.get("clientConfig", {}).get("caBundle") == bundle for h in hooks)

            wait_for(f"caBundle on {kind}/{name}", bundled)
        # The webhook server presents the certificate for the Service's name, under that CA.
        service_name = f"{release}-tokenfair-operator.{ns}.svc"
        wait_for(
            "the webhook server to serve it",
            lambda: served_certificate(webhook_port, certs.ca_pem, service_name),
        )
        assert_never_refused(log.read_text(errors="replace"))
    kube_cluster.helm("uninstall", release, "-n", ns, major=4)
    # The Secret was the chart's: it goes with the release, like the rest.
    assert settled_inventory(kube_cluster, ns, before) == before
