"""The chart's autoscaling objects (``autoscaling.*``, docs/observability.md, "The scaling
signal"), rendered by Helm 3 and Helm 4.

Behaviours under test:

- nothing is rendered unless ``autoscaling.mode`` asks (``none`` by default);
- ``keda``: one KEDA ``ScaledObject`` that validates against a structural schema of the fields
  it uses (``keda.sh/v1alpha1``; trigger metadata values are strings, as KEDA requires) and
  queries the sum of the target Deployment's Pods' ``tokenfair_demand_ratio`` of the lane, with
  the target as its ``AverageValue`` threshold;
- ``hpa``: one ``autoscaling/v2`` ``HorizontalPodAutoscaler`` on the Pods metric
  ``tokenfair_demand_ratio{lane}``, validated by a structural schema here (and by the API
  server's own in ``test_chart.py``'s server dry run of every variant);
- both ``helm lint --strict`` clean (``test_chart.py``'s variants ``autoscaling-keda`` and
  ``autoscaling-hpa``); a mode without ``targetDeployment``, ``minReplicas`` above
  ``maxReplicas``, an unknown mode or a target that is no positive decimal are refused with the
  value's name.

The schemas below are written for these tests from the two APIs' documented shapes (only the
fields the chart sets, unknown fields refused); they are not copies of KEDA's CRD.
"""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import CHART, of_kind, parse, render, run_helm, set_args
from deploy.test_manifests import violations

KEDA = ("autoscaling.mode=keda", "autoscaling.targetDeployment=model-server")
HPA = ("autoscaling.mode=hpa", "autoscaling.targetDeployment=model-server")

NAME = {
    "type": "string",
    "minLength": 1,
    "maxLength": 253,
    "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": NAME,
        "namespace": NAME,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
TARGET_REF = {
    "type": "object",
    "required": ["apiVersion", "kind", "name"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["apps/v1"]},
        "kind": {"type": "string", "enum": ["Deployment"]},
        "name": NAME,
    },
}
SCALE_DOWN = {
    "type": "object",
    "properties": {
        "scaleDown": {
            "type": "object",
            "properties": {
                "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600}
            },
        }
    },
}
SCALED_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["keda.sh/v1alpha1"]},
        "kind": {"type": "string", "enum": ["ScaledObject"]},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": TARGET_REF,
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "properties": {"behavior": SCALE_DOWN},
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string", "enum": ["prometheus"]},
                            "metricType": {"type": "string", "enum": ["AverageValue", "Value"]},
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                # KEDA's trigger metadata is a map of strings.
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}
QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|M|G)?$"}
HPA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"type": "string", "enum": ["autoscaling/v2"]},
        "kind": {"type": "string", "enum": ["HorizontalPodAutoscaler"]},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "maxReplicas"],
            "properties": {
                "scaleTargetRef": TARGET_REF,
                "minReplicas": {"type": "integer", "minimum": 1},
                "maxReplicas": {"type": "integer", "minimum": 1},
                "behavior": SCALE_DOWN,
                "metrics": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "pods"],
                        "properties": {
                            "type": {"type": "string", "enum": ["Pods"]},
                            "pods": {
                                "type": "object",
                                "required": ["metric", "target"],
                                "properties": {
                                    "metric": {
                                        "type": "object",
                                        "required": ["name"],
                                        "properties": {
                                            "name": {"type": "string"},
                                            "selector": {
                                                "type": "object",
                                                "properties": {
                                                    "matchLabels": {
                                                        "type": "object",
                                                        "additionalProperties": {"type": "string"},
                                                    }
                                                },
                                            },
                                        },
                                    },
                                    "target": {
                                        "type": "object",
                                        "required": ["type", "averageValue"],
                                        "properties": {
                                            "type": {"type": "string", "enum": ["AverageValue"]},
                                            "averageValue": QUANTITY,
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
AUTOSCALING_KINDS = ("ScaledObject", "HorizontalPodAutoscaler")


@pytest.mark.parametrize("major", [3, 4])
def test_nothing_is_rendered_unless_asked(major: int) -> None:
    docs = parse(render(major))
    assert not [d for d in docs if d["kind"] in AUTOSCALING_KINDS]
    docs = parse(render(major, ("autoscaling.mode=none", "autoscaling.targetDeployment=m")))
    assert not [d for d in docs if d["kind"] in AUTOSCALING_KINDS]


@pytest.mark.parametrize("major", [3, 4])
def test_keda_scaled_object(major: int) -> None:
    sets = (*KEDA, "autoscaling.lane=batch", "autoscaling.namespace=inference",
            "autoscaling.maxReplicas=12")  # fmt: skip
    # (--set-string: a bare 1.5 would be a number, which the values' schema refuses)
    docs = parse(render(major, sets, extra=("--set-string", "autoscaling.target=1.5")))
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    (scaled,) = of_kind(docs, "ScaledObject")
    assert list(violations(scaled, SCALED_OBJECT)) == []
    spec = scaled["spec"]
    assert scaled["metadata"]["namespace"] == "inference"
    assert spec["scaleTargetRef"]["name"] == "model-server"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 12)
    (trigger,) = spec["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1.5"
    assert trigger["metadata"]["query"] == (
        'sum(tokenfair_demand_ratio{namespace="inference",pod=~"model-server-.*",lane="batch"})'
    )
    # The validator catches what KEDA would refuse: a number where it wants a string.
    broken = {**trigger, "metadata": {**trigger["metadata"], "threshold": 1.5}}
    assert list(violations({**scaled, "spec": {**spec, "triggers": [broken]}}, SCALED_OBJECT))


@pytest.mark.parametrize("major", [3, 4])
def test_hpa_alternative(major: int) -> None:
    docs = parse(render(major, (*HPA, "autoscaling.scaleDownStabilizationSeconds=60")))
    assert not of_kind(docs, "ScaledObject")
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    assert list(violations(hpa, HPA_SCHEMA)) == []
    assert hpa["metadata"]["namespace"] == "tokenfair-system"
    spec = hpa["spec"]
    (metric,) = spec["metrics"]
    assert metric["pods"]["metric"] == {
        "name": "tokenfair_demand_ratio",
        "selector": {"matchLabels": {"lane": "interactive"}},
    }
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "0.8"}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 60
    assert list(violations({**hpa, "spec": {**spec, "minReplicas": 0}}, HPA_SCHEMA))


@pytest.mark.parametrize(
    ("sets", "strings", "message"),
    [
        (("autoscaling.mode=keda",), (), "autoscaling.targetDeployment: required"),
        ((*HPA, "autoscaling.minReplicas=5", "autoscaling.maxReplicas=2"), (),
         "autoscaling.minReplicas: must be <= autoscaling.maxReplicas"),
        (("autoscaling.mode=vpa", "autoscaling.targetDeployment=m"), (), "autoscaling.mode"),
        (KEDA, ("autoscaling.target=0",), "autoscaling.target"),
        (KEDA, ("autoscaling.target=-1",), "autoscaling.target"),
        (KEDA, ("autoscaling.target=0.8x",), "autoscaling.target"),
        (KEDA, (), "autoscaling.target"),  # with the number below, not a string
    ],
)  # fmt: skip
def test_bad_values_are_refused_by_name(
    sets: tuple[str, ...], strings: tuple[str, ...], message: str
) -> None:
    extra = [arg for value in strings for arg in ("--set-string", value)]
    if not strings and message == "autoscaling.target":
        extra = ["--set", "autoscaling.target=1"]  # a number: KEDA's metadata needs a string
    for major in (3, 4):
        args = ("template", "t", str(CHART), *set_args(sets), *extra)
        done = run_helm(major, *args, check=False)
        assert done.returncode != 0
        # The chart's own checks name the value dotted; a schema error as Helm writes it
        # (Helm 3 dotted, Helm 4 as a JSON pointer).
        assert message in done.stderr or message.replace(".", "/") in done.stderr, done.stderr
