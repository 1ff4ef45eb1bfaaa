"""``SchedulingPolicy.spec.selector``: which labelled Pods are a policy's sidecars.

Behaviours under test (``tokenfair_operator.selector``, ``render_config`` and ``policy_status``,
called directly):

- every operator with the API server's meaning: ``In`` (present, value listed), ``NotIn``
  (absent, or value not listed), ``Exists``, ``DoesNotExist``; ``matchLabels`` pairs; all of
  them ANDed; ``NotIn``/``DoesNotExist`` are the exact complements of ``In``/``Exists``;
- an absent or empty selector matches every Pod, unlabelled ones included;
- a malformed selector (wrong shapes, unknown operator or field, values on ``Exists``, none on
  ``In``) raises ``SelectorError`` naming the field under ``spec.selector``; ``render_config``
  then refuses the policy (every quota ``PolicyInvalid``) and the policy's ``Accepted``/``Ready``
  conditions carry that message;
- the budget divisor: of a policy's labelled Pods only the Ready ones its selector matches
  count; with no live policy known every labelled Pod counts, with a malformed selector none.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair_operator import PolicyView, QuotaView, policy_status, render_config
from tokenfair_operator.selector import (
    LabelSelector,
    Requirement,
    SelectorError,
    parse_selector,
    ready_sidecars,
    selected_sidecars,
)
from tokenfair_operator.views import SidecarView

POD: dict[str, str] = {"tokenfair.io/policy": "pool", "app": "llm", "tier": "gpu"}
TENANT = {
    "policyName": "pool",
    "weight": 1,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100,
}


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    return parse_selector(selector).matches(labels)


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (expr("tier", "In", "cpu", "gpu"), True),
        (expr("tier", "In", "cpu"), False),
        (expr("zone", "In", "a"), False),  # absent label: In never holds
        (expr("tier", "NotIn", "cpu"), True),
        (expr("tier", "NotIn", "gpu"), False),
        (expr("zone", "NotIn", "a"), True),  # absent label: NotIn holds
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, True),
        ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, False),
        ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist", "values": []}]}, False),
        ({"matchLabels": {"app": "llm", "tier": "gpu"}}, True),
        ({"matchLabels": {"app": "llm", "tier": "cpu"}}, False),
        ({"matchLabels": {"app": "llm"}, **expr("tier", "In", "gpu")}, True),
        ({"matchLabels": {"app": "llm"}, **expr("tier", "NotIn", "gpu")}, False),  # AND
    ],
    ids=[
        "in",
        "in-miss",
        "in-absent",
        "notin",
        "notin-miss",
        "notin-absent",
        "exists",
        "exists-absent",
        "doesnotexist",
        "doesnotexist-present",
        "matchlabels",
        "matchlabels-miss",
        "and",
        "and-one-fails",
    ],
)
def test_every_operator(selector: dict[str, Any], expected: bool) -> None:
    assert matches(selector, POD) is expected


@pytest.mark.parametrize("selector", [None, {}, {"matchLabels": {}, "matchExpressions": []}])
def test_empty_selector_matches_everything(selector: dict[str, Any] | None) -> None:
    assert parse_selector(selector) == LabelSelector()
    assert matches(selector, POD)
    assert matches(selector, {})


labels = st.dictionaries(st.sampled_from("abc"), st.sampled_from("xyz"), max_size=3)
values = st.frozensets(st.sampled_from("xyz"), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(pod=labels, key=st.sampled_from("abc"), listed=values)
def test_negations_are_complements(pod: dict[str, str], key: str, listed: frozenset[str]) -> None:
    assert Requirement(key, "NotIn", listed).matches(pod) != Requirement(key, "In", listed).matches(
        pod
    )
    assert Requirement(key, "DoesNotExist").matches(pod) != Requirement(key, "Exists").matches(pod)


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("app=llm", "spec.selector: must be a mapping (got str)"),
        ({"matchLabel": {"app": "llm"}}, "spec.selector: unknown field(s) matchLabel"),
        ({"matchLabels": ["app"]}, "spec.selector.matchLabels: must be a mapping"),
        ({"matchLabels": {"app": 1}}, "spec.selector.matchLabels.app: value must be a string"),
        ({"matchExpressions": {"key": "a"}}, "spec.selector.matchExpressions: must be a list"),
        (expr("", "Exists"), "spec.selector.matchExpressions[0].key: must be a non-empty"),
        (expr("a", "Equals", "x"), "spec.selector.matchExpressions[0].operator: must be one of"),
        (expr("a", "In"), "spec.selector.matchExpressions[0].values: operator In needs at least"),
        (expr("a", "NotIn"), "values: operator NotIn needs at least one value"),
        (expr("a", "Exists", "x"), "spec.selector.matchExpressions[0].values: operator Exists"),
        (expr("a", "DoesNotExist", "x"), "values: operator DoesNotExist takes no values"),
        (
            {"matchExpressions": [{"key": "a", "operator": "In", "values": [1]}]},
            "spec.selector.matchExpressions[0].values: must be a list of strings",
        ),
    ],
    ids=[
        "not-a-mapping",
        "unknown-field",
        "labels-list",
        "label-value",
        "expressions-mapping",
        "empty-key",
        "unknown-operator",
        "in-no-values",
        "notin-no-values",
        "exists-values",
        "doesnotexist-values",
        "value-type",
    ],
)
def test_malformed_selector_is_refused_naming_the_field(selector: Any, message: str) -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector(selector)
    assert message in str(caught.value)


def policy(selector: Any = None, *, deleting: bool = False) -> PolicyView:
    spec = {} if selector is None else {"selector": selector}
    return PolicyView("pool", "ns", "uid", 3, "2026-01-01T00:00:00Z", spec, deleting=deleting)


def test_malformed_selector_refuses_the_policy_in_its_status() -> None:
    quota = QuotaView("chat", "ns", "uid-q", 1, "2026-01-01T00:00:01Z", TENANT)
    bad = policy(expr("tier", "Exists", "gpu"))
    rendering = render_config(bad, [quota], {})

    assert rendering.version == ""  # nothing published
    assert rendering.verdicts["chat"].reason == "PolicyInvalid"
    status = policy_status(bad, rendering, now="2026-01-01T00:00:02Z")
    by_type = {c["type"]: c for c in status["conditions"]}
    for kind in ("Ready", "Accepted"):
        assert by_type[kind]["status"] == "False"
        assert by_type[kind]["reason"] == "InvalidSpec"
        assert by_type[kind]["message"] == (
            "SchedulingPolicy 'pool': spec.selector.matchExpressions[0].values: "
            "operator Exists takes no values"
        )
    # A well-formed selector renders as before: the selector is not part of the document.
    assert render_config(policy(expr("tier", "Exists")), [quota], {}).version == (
        render_config(policy(), [quota], {}).version
    )


def sidecar(ready: bool, **extra: str) -> SidecarView:
    return SidecarView(ready, "10.0.0.1:9090", {"tokenfair.io/policy": "pool", **extra})


def test_only_matching_ready_sidecars_divide_the_budgets() -> None:
    pods = [
        sidecar(True, tier="gpu"),
        sidecar(True, tier="cpu"),
        sidecar(False, tier="gpu"),
        sidecar(True),
    ]
    gpu = policy({"matchLabels": {"tier": "gpu"}})
    assert selected_sidecars([gpu], pods) == [pods[0], pods[2]]
    assert ready_sidecars([gpu], pods) == 1  # pods[2] matches but is not Ready
    not_cpu = policy(expr("tier", "NotIn", "cpu"))
    assert ready_sidecars([not_cpu], pods) == 2  # pods[0], and pods[3] (no tier label)
    assert ready_sidecars([policy()], pods) == 3  # no selector: every Ready labelled Pod
    assert ready_sidecars([policy(expr("tier", "In"))], pods) == 0  # malformed: none
    # No live policy (unknown yet, or being deleted): nothing narrows the labelled Pods.
    assert ready_sidecars([], pods) == 3
    assert ready_sidecars([policy({"matchLabels": {"tier": "x"}}, deleting=True)], pods) == 3
