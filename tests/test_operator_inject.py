"""Sidecar injection into labelled Pods (``tokenfair_operator.inject.injected``, pure).

Behaviours under test:

- a Pod labelled ``tokenfair.io/policy: pool`` gets the sidecar first, with its ports, probes on
  the admin port, a read-only config mount, bounded resources and a locked-down security context;
  the policy's Secret as the config volume (the ConfigMap on request); its own containers and
  volumes are kept, in order;
- the upstream port comes from the annotation (default 8000);
- idempotent: injecting an injected Pod changes nothing; an unlabelled Pod is left alone;
- refusals name the field: a bad port annotation, a bad config source, a taken volume name or port.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tokenfair_operator.inject import (
    CONTAINER,
    InjectionError,
    InjectionSettings,
    SecretKey,
    injected,
    store_password_key,
)
from tokenfair_operator.render import PASSWORD_ENV

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
