"""Sidecar injection into labelled Pods (``tokenfair_operator.inject.injected``, pure).

Behaviours under test:

- a Pod labelled ``tokenfair.io/policy: pool`` gets the sidecar first, with its ports, probes on
  the admin port, a read-only config mount, bounded resources and a locked-down security context;
  the policy's Secret as the config volume (the ConfigMap on request); its own containers and
  volumes are kept, in order;
- the upstream port comes from the annotation (default 8000);
- idempotent: injecting an injected Pod changes nothing; an unlabelled Pod is left alone;
- refusals name the field: a bad port annotation, a bad config source, a taken volume name or port;
- per-Pod annotations (``tokenfair.io/sidecar-cpu``, ``-memory``, ``-cpu-limit``,
  ``-memory-limit``, ``-max-in-flight``, ``-log-level``, ``-drain-grace-seconds``) override the
  operator's defaults, which come from its environment (the chart's ``sidecar.*`` values); each
  bad value, a request above its limit, a drain longer than the Pod's grace period and an unknown
  ``tokenfair.io/sidecar-*`` annotation are refused with the annotation's name and the rule; a
  bad default stops the operator naming its variable;
- an injected Pod gets the Prometheus scrape annotations for the admin port, unless it sets any
  of them itself or they are turned off;
- with a document server (``https://`` base): one projected volume holds a ServiceAccount token
  for the audience ``tokenfair-config`` only, valid 600 s, and the CA bundle from the optional
  ConfigMap ``tokenfair.io-ca.crt``; the sidecar gets the CA file's path and the token file's;
  an ``http://`` base is refused unless the unsafe setting allows it (then the sidecar is told
  so); the real API server accepts the injected Pod (dry run) with that volume;
- the webhook handler with a cold policy index (right after a restart) reads the policy from the
  API server, so the sidecar still gets the budget store's password; a warm index costs no read;
  a failed read refuses the Pod (503) instead of injecting a sidecar without its password, a
  403 (a namespace outside the operator's RBAC) counts as no policy;
- on the real control plane (``kube``): the operator (Kopf-managed webhook, shipped RBAC) whose
  index cannot hold the policy (it lives in a namespace the operator does not watch) injects a
  Pod of that policy with the password variable at the first attempt, and with the per-Pod
  settings and scrape annotations, as stored by the API server.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import kopf
import pytest
from kubecluster import KubeCluster

from tokenfair.config import ConfigError
from tokenfair.config.fields import flag_number
from tokenfair.server.runtime_settings import SECTION_FIELDS
from tokenfair_operator import handlers, runtime
from tokenfair_operator.indexes import Indexes
from tokenfair_operator.inject import (
    CONTAINER,
    InjectionError,
    InjectionSettings,
    SecretKey,
    injected,
    scrape_annotations,
    sidecar_runtime,
    store_password_key,
)
from tokenfair_operator.model import PolicyView
from tokenfair_operator.reconcile import Reconciler
from tokenfair_operator.render import PASSWORD_ENV
from tokenfair_operator.settings import SIDECAR_ENV, OperatorConfig, injection_from_env

SETTINGS = InjectionSettings(image="registry.local/tokenfair:test")


def pod(
    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "model",
            "labels": {"tokenfair.io/policy": "pool"} if labels is None else labels,
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{"name": "vllm", "image": "vllm", "ports": [{"containerPort": 8000}]}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
        },
    }


def apply(target: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(target)
    out["spec"].update(change)
    return out


def test_labelled_pod_gets_the_sidecar() -> None:
    change = injected(pod(), SETTINGS)

    assert change is not None
    sidecar, model = change["containers"]
    assert model == pod()["spec"]["containers"][0]
    assert sidecar["name"] == "tokenfair-sidecar"
    assert sidecar["image"] == "registry.local/tokenfair:test"
    assert "--upstream=http://127.0.0.1:8000" in sidecar["args"]
    assert "--config=/etc/tokenfair/config.yaml" in sidecar["args"]
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {
        "tokenfair": 8080,
        "tokenfair-admin": 9090,
    }
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "tokenfair-admin"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "tokenfair-admin"}
    assert sidecar["volumeMounts"] == [
        {"name": "tokenfair-config", "mountPath": "/etc/tokenfair", "readOnly": True}
    ]
    assert sidecar["resources"]["limits"]["memory"] == SETTINGS.memory_limit
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert change["volumes"] == [
        {"name": "cache", "emptyDir": {}},
        {"name": "tokenfair-config", "secret": {"secretName": "tokenfair-pool-keys"}},
    ]


def test_configmap_source_and_upstream_port() -> None:
    source, port = "tokenfair.io/config-source", "tokenfair.io/upstream-port"
    labelled = pod(annotations={source: "configmap", port: "9000"})
    change = injected(labelled, SETTINGS)

    assert change is not None
    assert change["volumes"][-1] == {
        "name": "tokenfair-config",
        "configMap": {"name": "tokenfair-pool"},
    }
    assert "--upstream=http://127.0.0.1:9000" in change["containers"][0]["args"]


def test_injection_is_idempotent() -> None:
    change = injected(pod(), SETTINGS)
    assert change is not None
    assert injected(apply(pod(), change), SETTINGS) is None


def test_unlabelled_pod_is_left_alone() -> None:
    assert injected(pod(labels={}), SETTINGS) is None
    assert injected(pod(labels={"app": "x"}), SETTINGS) is None


@pytest.mark.parametrize(
    ("target", "field"),
    [
        (pod(annotations={"tokenfair.io/upstream-port": "http"}), "tokenfair.io/upstream-port"),
        (pod(annotations={"tokenfair.io/upstream-port": "70000"}), "tokenfair.io/upstream-port"),
        (pod(annotations={"tokenfair.io/config-source": "vault"}), "tokenfair.io/config-source"),
    ],
)
def test_bad_annotations_are_refused(target: dict[str, Any], field: str) -> None:
    with pytest.raises(InjectionError, match=field):
        injected(target, SETTINGS)


def test_taken_names_are_refused() -> None:
    taken_volume = pod()
    taken_volume["spec"]["volumes"].append({"name": "tokenfair-config", "emptyDir": {}})
    with pytest.raises(InjectionError, match=r"spec\.volumes"):
        injected(taken_volume, SETTINGS)
    taken_port = pod()
    taken_port["spec"]["containers"][0]["ports"].append({"containerPort": 8080})
    with pytest.raises(InjectionError, match="reserved"):
        injected(taken_port, SETTINGS)


def test_a_budget_store_secret_becomes_the_password_variable() -> None:
    """The policy's ``budgetStore.redis.secretRef`` reaches the sidecar as the variable its
    rendered config names (``passwordEnv``), optional so a missing Secret does not stop the Pod."""
    spec = {"budgetStore": {"redis": {"url": "redis://r:6379", "secretRef": {"name": "store"}}}}
    password = store_password_key(spec)
    assert password == SecretKey("store", "password")
    change = injected(pod(), InjectionSettings(), password)
    assert change is not None
    (sidecar,) = [c for c in change["containers"] if c["name"] == CONTAINER]
    assert sidecar["env"] == [
        {
            "name": PASSWORD_ENV,
            "valueFrom": {"secretKeyRef": {"name": "store", "key": "password", "optional": True}},
        }
    ]
    assert store_password_key({}) is None
    assert store_password_key({"budgetStore": {"redis": {"url": "redis://r:6379"}}}) is None
    plain = injected(pod(), InjectionSettings())
    assert plain is not None
    assert all("env" not in c for c in plain["containers"] if c["name"] == CONTAINER)


# --- per-Pod annotations and the operator's defaults ---------------------------------------------


def sidecar_of(target: dict[str, Any], settings: InjectionSettings = SETTINGS) -> dict[str, Any]:
    change = injected(target, settings)
    assert change is not None
    container: dict[str, Any] = change["containers"][0]
    assert container["name"] == CONTAINER
    return container


def test_defaults_are_the_settings() -> None:
    sidecar = sidecar_of(pod())
    assert sidecar["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "512Mi"},  # no CPU limit: throttling adds latency
    }
    assert "--log-level=INFO" in sidecar["args"]
    assert not [a for a in sidecar["args"] if a.startswith("--max-in-flight")]
    # The sidecar's own 30 s drain would not fit the Pod's default 30 s grace with the 3 s it
    # needs to end its handlers and write its records: shortened to fit.
    assert sidecar["args"][-1] == "--drain-grace=27"
    short = pod()
    short["spec"]["terminationGracePeriodSeconds"] = 2
    assert sidecar_of(short)["args"][-1] == "--drain-grace=0.5"  # a quarter of a short grace
    # Set within the Pod's grace but without the 3 s to spare: shortened, not refused (a Pod
    # valid before the margin existed must not stop its rollout).
    tight = pod(annotations={"tokenfair.io/sidecar-drain-grace-seconds": "30"})
    assert sidecar_of(tight)["args"][-1] == "--drain-grace=27"
    long = pod()
    long["spec"]["terminationGracePeriodSeconds"] = 120
    assert sidecar_of(long)["args"][-1] == "--drain-grace=30"  # the sidecar's own default
    tuned = InjectionSettings(
        cpu_request="250m",
        memory_request="256Mi",
        cpu_limit="2",
        memory_limit="1Gi",
        max_in_flight=32,
        log_level="warning",
        drain_grace_s=20.0,
    )
    sidecar = sidecar_of(pod(), tuned)
    assert sidecar["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    }
    assert sidecar["args"][-3:] == ["--log-level=WARNING", "--max-in-flight=32", "--drain-grace=20"]


def test_annotations_override_resources_and_flags() -> None:
    annotations = {
        "tokenfair.io/sidecar-cpu": "500m",
        "tokenfair.io/sidecar-memory": "1Gi",
        "tokenfair.io/sidecar-cpu-limit": "1",
        "tokenfair.io/sidecar-memory-limit": "2Gi",
        "tokenfair.io/sidecar-max-in-flight": "8",
        "tokenfair.io/sidecar-log-level": "DEBUG",
        "tokenfair.io/sidecar-drain-grace-seconds": "45",
    }
    target = pod(annotations=annotations)
    target["spec"]["terminationGracePeriodSeconds"] = 60
    sidecar = sidecar_of(target)
    assert sidecar["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "2Gi"},
    }
    assert sidecar["args"][-3:] == ["--log-level=DEBUG", "--max-in-flight=8", "--drain-grace=45"]
    # Quantities compare by value, not text: 1.5Gi of request under a 2048Mi limit is fine.
    fits = {"tokenfair.io/sidecar-memory": "1.5Gi", "tokenfair.io/sidecar-memory-limit": "2048Mi"}
    assert sidecar_of(pod(annotations=fits))["resources"]["limits"]["memory"] == "2048Mi"


@pytest.mark.parametrize(
    ("annotations", "field", "rule"),
    [
        ({"tokenfair.io/sidecar-cpu": "lots"}, "tokenfair.io/sidecar-cpu", "positive Kubernetes"),
        ({"tokenfair.io/sidecar-memory": "-1Gi"}, "tokenfair.io/sidecar-memory", "quantity"),
        ({"tokenfair.io/sidecar-memory": "0"}, "tokenfair.io/sidecar-memory", "positive"),
        ({"tokenfair.io/sidecar-cpu-limit": "1 core"}, "tokenfair.io/sidecar-cpu-limit", "250m"),
        (
            {"tokenfair.io/sidecar-memory": "1Gi"},  # above the default 512Mi limit
            "tokenfair.io/sidecar-memory",
            r"memory request 1Gi is above the memory limit 512Mi \(InjectionSettings",
        ),
        (
            {"tokenfair.io/sidecar-cpu": "2", "tokenfair.io/sidecar-cpu-limit": "1500m"},
            "tokenfair.io/sidecar-cpu",
            "raise the limit with tokenfair.io/sidecar-cpu-limit",
        ),
        (
            {"tokenfair.io/sidecar-max-in-flight": "0"},
            "tokenfair.io/sidecar-max-in-flight",
            r"must be in \[1, 100000\]",
        ),
        ({"tokenfair.io/sidecar-max-in-flight": "many"}, "max-in-flight", "integer"),
        # Unicode digits that str.isdigit() accepts and int() refuses: still the clear error.
        ({"tokenfair.io/sidecar-max-in-flight": "\u00b2"}, "max-in-flight", "integer"),
        ({"tokenfair.io/sidecar-memory": "1e999999"}, "tokenfair.io/sidecar-memory", "2\\^63-1"),
        ({"tokenfair.io/sidecar-log-level": "verbose"}, "tokenfair.io/sidecar-log-level", "debug"),
        ({"tokenfair.io/sidecar-drain-grace-seconds": "0"}, "drain-grace-seconds", "> 0"),
        ({"tokenfair.io/sidecar-drain-grace-seconds": "nan"}, "drain-grace-seconds", "finite"),
        (
            {"tokenfair.io/sidecar-drain-grace-seconds": "45"},  # the Pod's default grace is 30
            "tokenfair.io/sidecar-drain-grace-seconds",
            r"terminationGracePeriodSeconds \(30\)",
        ),
        ({"tokenfair.io/sidecar-cpus": "1"}, "tokenfair.io/sidecar-cpus", "unknown tokenfair"),
    ],
)
def test_bad_sidecar_annotations_name_the_annotation_and_rule(
    annotations: dict[str, str], field: str, rule: str
) -> None:
    with pytest.raises(InjectionError, match=rule) as caught:
        injected(pod(annotations=annotations), SETTINGS)
    assert f"metadata.annotations[{field}" in str(caught.value) or field in str(caught.value)


@pytest.mark.parametrize(
    "text", ["1", "8", "2.0", "1e3", " 16 ", "100000", "100001", "0", "-1", "2.5", "many", "true"]
)
def test_the_injector_takes_the_max_in_flight_the_sidecar_takes(text: str) -> None:
    # One rule (issue 31): the injector passes the annotation on as --max-in-flight, so it takes
    # exactly the values the sidecar's own flag takes, and refuses the others by name.
    _, parse = SECTION_FIELDS["maxInFlight"]  # what `tokenfair sidecar` checks the flag with
    try:
        sidecar_takes: int | None = parse("--max-in-flight", flag_number(text.strip()))
    except ConfigError:
        sidecar_takes = None
    annotations = {"tokenfair.io/sidecar-max-in-flight": text}
    if sidecar_takes is None:
        with pytest.raises(InjectionError, match=re.escape("tokenfair.io/sidecar-max-in-flight")):
            injected(pod(annotations=annotations), SETTINGS)
    else:
        args = sidecar_of(pod(annotations=annotations), SETTINGS)["args"]
        assert f"--max-in-flight={sidecar_takes}" in args


def test_operator_defaults_come_from_its_environment() -> None:
    env = {
        "TOKENFAIR_SIDECAR_IMAGE": "registry.local/tokenfair@sha256:" + "ab" * 32,
        "TOKENFAIR_SIDECAR_CPU_REQUEST": "200m",
        "TOKENFAIR_SIDECAR_MEMORY_REQUEST": "192Mi",
        "TOKENFAIR_SIDECAR_CPU_LIMIT": "",  # empty: no CPU limit, as unset
        "TOKENFAIR_SIDECAR_MEMORY_LIMIT": "768Mi",
        "TOKENFAIR_SIDECAR_MAX_IN_FLIGHT": "16",
        "TOKENFAIR_SIDECAR_LOG_LEVEL": "warning",
        "TOKENFAIR_SIDECAR_DRAIN_GRACE_SECONDS": "25",
        "TOKENFAIR_SIDECAR_SCRAPE_ANNOTATIONS": "false",
        "TOKENFAIR_CONFIG_URL_BASE": "https://op.tf.svc:8443",
        "TOKENFAIR_CONFIG_AUDIENCE": "tokenfair-test",
    }
    settings = injection_from_env(env)
    assert (settings.cpu_request, settings.memory_request) == ("200m", "192Mi")
    assert (settings.cpu_limit, settings.memory_limit) == (None, "768Mi")
    assert (settings.max_in_flight, settings.log_level, settings.drain_grace_s) == (
        16,
        "warning",
        25,
    )
    assert settings.scrape_annotations is False
    assert settings.config_url_base == "https://op.tf.svc:8443"
    assert settings.config_audience == "tokenfair-test"
    assert sidecar_of(pod(), settings)["image"] == env["TOKENFAIR_SIDECAR_IMAGE"]
    assert injection_from_env({}) == InjectionSettings(env_names=SIDECAR_ENV)


def long_poll_volume(change: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in change["volumes"] if v["name"] == "tokenfair-token"]
    return dict(volume)


def test_the_long_poll_gets_an_audience_bound_token_and_the_ca() -> None:
    settings = InjectionSettings(config_url_base="https://op.tf.svc:8443")
    change = injected(pod(), settings)
    assert change is not None
    sidecar = change["containers"][0]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["TOKENFAIR_CONFIG_URL"].startswith("https://op.tf.svc:8443/v1/config/")
    assert "TOKENFAIR_CONFIG_INSECURE_HTTP" not in env
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "tokenfair-token")
    assert mount["readOnly"] is True
    assert env["TOKENFAIR_CONFIG_TOKEN_FILE"] == f"{mount['mountPath']}/token"
    assert env["TOKENFAIR_CONFIG_CA_FILE"] == f"{mount['mountPath']}/ca.crt"
    token, trust = long_poll_volume(change)["projected"]["sources"]
    assert token == {
        "serviceAccountToken": {
            "path": "token",
            "audience": "tokenfair-config",
            "expirationSeconds": 600,
        }
    }
    assert trust == {
        "configMap": {
            "name": "tokenfair.io-ca.crt",
            "optional": True,
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        }
    }
    # The volume name is reserved, as the config volume's.
    taken = pod()
    taken["spec"]["volumes"].append({"name": "tokenfair-token", "emptyDir": {}})
    with pytest.raises(InjectionError, match="'tokenfair-token' is reserved"):
        injected(taken, settings)


def test_plain_http_needs_the_unsafe_setting() -> None:
    with pytest.raises(ValueError, match=r"must be https://.*CONFIG_INSECURE_HTTP=true") as caught:
        injection_from_env({"TOKENFAIR_CONFIG_URL_BASE": "http://op.tf.svc:8081"})
    assert "$TOKENFAIR_CONFIG_URL_BASE" in str(caught.value)
    with pytest.raises(InjectionError, match="must be https://"):
        InjectionSettings(config_url_base="ftp://op").check()
    unsafe = injection_from_env(
        {
            "TOKENFAIR_CONFIG_URL_BASE": "http://op.tf.svc:8081",
            "TOKENFAIR_CONFIG_INSECURE_HTTP": "true",
        }
    )
    change = injected(pod(), unsafe)
    assert change is not None
    env = {e["name"]: e.get("value") for e in change["containers"][0]["env"]}
    assert env["TOKENFAIR_CONFIG_INSECURE_HTTP"] == "true"
    assert "TOKENFAIR_CONFIG_CA_FILE" not in env


def test_the_api_server_accepts_the_projected_volume(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    """The injected Pod as the real API server validates it (dry run): an audience-bound
    token of 600 s (its minimum) and an optional ConfigMap in one projected volume."""
    settings = InjectionSettings(config_url_base="https://op.tf.svc:8443")
    change = injected(pod(), settings)
    assert change is not None
    path = f"/api/v1/namespaces/{kube_namespace}/pods?dryRun=All"
    body = apply(pod(), change)
    # Set by the ServiceAccount admission plugin on a real cluster (off in this one).
    body["spec"]["serviceAccountName"] = "default"
    created = kube_cluster.expect(201, "POST", path, body).body
    stored = next(v for v in created["spec"]["volumes"] if v["name"] == "tokenfair-token")
    token, trust = stored["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "tokenfair-config"
    assert token["serviceAccountToken"]["expirationSeconds"] == 600
    assert trust["configMap"]["name"] == "tokenfair.io-ca.crt"


@pytest.mark.parametrize(
    ("variable", "value", "rule"),
    [
        ("TOKENFAIR_SIDECAR_CPU_REQUEST", "fast", "positive Kubernetes quantity"),
        ("TOKENFAIR_SIDECAR_MEMORY_REQUEST", "1Gi", "above the memory limit 512Mi"),
        ("TOKENFAIR_SIDECAR_MAX_IN_FLIGHT", "-3", r"must be in \[1, 100000\]"),
        ("TOKENFAIR_SIDECAR_LOG_LEVEL", "trace", "one of debug, info, warning, error"),
        ("TOKENFAIR_SIDECAR_DRAIN_GRACE_SECONDS", "soon", "must be a number"),
        ("TOKENFAIR_SIDECAR_SCRAPE_ANNOTATIONS", "yes", "true or false"),
    ],
)
def test_a_bad_default_names_its_variable(variable: str, value: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule) as caught:
        injection_from_env({variable: value})
    assert f"${variable}" in str(caught.value)


def test_sidecar_runtime_checks_the_defaults_alone() -> None:
    runtime = sidecar_runtime(InjectionSettings(), {}, None)
    assert runtime.args == ("--log-level=INFO",)
    with pytest.raises(InjectionError, match=r"InjectionSettings\.memory_limit"):
        InjectionSettings(memory_limit="lots").check()


def test_scrape_annotations_for_the_admin_port() -> None:
    assert scrape_annotations(pod(), SETTINGS) == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9090",
        "prometheus.io/path": "/metrics",
    }
    # The Pod's owner chose what to scrape (one port per Pod): nothing of ours is added.
    own = pod(annotations={"prometheus.io/port": "8000"})
    assert scrape_annotations(own, SETTINGS) == {}
    assert scrape_annotations(pod(), InjectionSettings(scrape_annotations=False)) == {}


# --- the webhook handler: the policy from the index, or from the API when the index is cold -----


class Forbidden(Exception):
    """What the Kubernetes client raises for a 403 (``ApiException.status``)."""

    status = 403


class FakePolicies:
    """``get_policy`` of :class:`~tokenfair_operator.kube.KubeApi`, counting reads."""

    def __init__(
        self, stored: Mapping[tuple[str, str], PolicyView], fail: Exception | None = None
    ) -> None:
        self.stored = stored
        self.fail = fail
        self.reads: list[tuple[str, str]] = []

    def get_policy(self, namespace: str, name: str) -> PolicyView | None:
        self.reads.append((namespace, name))
        if self.fail is not None:
            raise self.fail
        return self.stored.get((namespace, name))


STORE = {"budgetStore": {"redis": {"url": "redis://r:6379", "secretRef": {"name": "store"}}}}


def policy_view(spec: dict[str, Any]) -> PolicyView:
    body = {"metadata": {"name": "pool", "namespace": "ns", "uid": "u1"}, "spec": spec}
    return PolicyView.from_body(body)


async def run_webhook(
    api: FakePolicies, index: Mapping[tuple[str, str], list[PolicyView]]
) -> kopf.Patch:
    patch = kopf.Patch()
    await handlers.inject_sidecar(
        body=kopf.Body(cast(kopf.RawBody, pod())),
        patch=patch,
        memo=webhook_memo(api, index),
        namespace="ns",
    )
    return patch


def webhook_memo(
    api: FakePolicies, policies: Mapping[tuple[str, str], list[PolicyView]]
) -> kopf.Memo:
    """What the startup hook leaves in the memo, as far as the injection webhook reads it."""
    memo = kopf.Memo()
    memo[runtime.CONFIG] = OperatorConfig.from_env()
    memo[runtime.INDEXES] = Indexes(policies, {}, {})  # type: ignore[arg-type]
    memo[runtime.RECONCILER] = Reconciler(api)  # type: ignore[arg-type]
    return memo


def password_env(patch: kopf.Patch) -> dict[str, Any] | None:
    sidecar = patch["spec"]["containers"][0]
    env = {e["name"]: e for e in sidecar.get("env", [])}
    found = env.get(PASSWORD_ENV)
    return dict(found) if found is not None else None


async def test_cold_index_reads_the_policy_from_the_api() -> None:
    """Right after a restart the index has no entry yet: the live read still finds the
    budget store's Secret (issue 13's review defect)."""
    api = FakePolicies({("ns", "pool"): policy_view(STORE)})
    patch = await run_webhook(api, {})
    assert api.reads == [("ns", "pool")]
    assert password_env(patch) == {
        "name": PASSWORD_ENV,
        "valueFrom": {"secretKeyRef": {"name": "store", "key": "password", "optional": True}},
    }
    assert patch["metadata"]["annotations"]["prometheus.io/port"] == "9090"


async def test_warm_index_costs_no_read_and_a_missing_policy_no_password() -> None:
    api = FakePolicies({})
    patch = await run_webhook(api, {("ns", "pool"): [policy_view(STORE)]})
    assert api.reads == []
    assert password_env(patch) is not None
    patch = await run_webhook(api, {})  # no such policy anywhere: injected, no password
    assert api.reads == [("ns", "pool")]
    assert password_env(patch) is None


async def test_a_failed_read_refuses_the_pod() -> None:
    unreachable = FakePolicies({}, fail=ConnectionError("API server unreachable"))
    with pytest.raises(kopf.AdmissionError, match="could not be read") as caught:
        await run_webhook(unreachable, {})
    assert caught.value.code == 503
    # A namespace outside the operator's RBAC (not watched): injected without a password.
    patch = await run_webhook(FakePolicies({}, fail=Forbidden()), {})
    assert password_env(patch) is None
    assert patch["spec"]["containers"][0]["name"] == CONTAINER


async def test_a_bad_annotation_is_an_admission_refusal() -> None:
    patch = kopf.Patch()
    memo = webhook_memo(FakePolicies({}), {})
    bad = pod(annotations={"tokenfair.io/sidecar-log-level": "loud"})
    with pytest.raises(kopf.AdmissionError, match=r"sidecar-log-level\]: must be one of") as caught:
        await handlers.inject_sidecar(
            body=kopf.Body(cast(kopf.RawBody, bad)),
            patch=patch,
            memo=memo,
            namespace="ns",
        )
    assert caught.value.code == 422
    assert not patch


def test_cold_index_on_the_real_control_plane(
    kube_cluster: KubeCluster, kube_namespace: str, webhook_operator: Path
) -> None:
    """The operator watches ``kube_namespace`` only, so its index never holds a policy of
    another namespace: the webhook (which sees every namespace's labelled Pods) must read it
    from the API server. Without that read the first Pod would miss the password."""
    cold = kube_cluster.create_namespace("cold")
    try:
        policy = {
            "apiVersion": "tokenfair.io/v1alpha1",
            "kind": "SchedulingPolicy",
            "metadata": {"name": "pool"},
            "spec": STORE,
        }
        kube_cluster.expect(
            201, "POST", f"/apis/tokenfair.io/v1alpha1/namespaces/{cold}/schedulingpolicies", policy
        )
        labelled = pod(annotations={"tokenfair.io/sidecar-memory-limit": "1Gi"})
        del labelled["spec"]["volumes"]
        path = f"/api/v1/namespaces/{cold}/pods?dryRun=All"
        created = kube_cluster.expect(201, "POST", path, labelled).body
        sidecar = created["spec"]["containers"][0]
        assert sidecar["name"] == CONTAINER
        env = {e["name"]: e for e in sidecar.get("env", [])}
        assert env[PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == {
            "name": "store",
            "key": "password",
            "optional": True,
        }
        assert sidecar["resources"]["limits"]["memory"] == "1Gi"
        assert created["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        # A bad annotation is refused by the API server with our message.
        bad = pod(annotations={"tokenfair.io/sidecar-cpu": "lots"})
        del bad["spec"]["volumes"]
        refused = kube_cluster.request("POST", path, bad)
        assert refused.status == 422, refused.body
        assert "metadata.annotations[tokenfair.io/sidecar-cpu]" in refused.body["message"]
    finally:
        kube_cluster.delete_namespace(cold)
