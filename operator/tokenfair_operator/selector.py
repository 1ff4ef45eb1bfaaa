"""``SchedulingPolicy.spec.selector``: which of a policy's labelled Pods are its sidecars.

Pure. A policy's sidecars are the Pods in its namespace labelled ``tokenfair.io/policy: <name>``
(what injection keys on) AND matching ``spec.selector``, a standard Kubernetes label selector:

* ``matchLabels`` — every ``key: value`` pair must be a label of the Pod;
* ``matchExpressions`` — every requirement must hold: ``In`` (the label is present and its
  value is one of ``values``), ``NotIn`` (the label is absent or its value is none of
  ``values``), ``Exists`` (present), ``DoesNotExist`` (absent). ``In``/``NotIn`` need at least
  one value; ``Exists``/``DoesNotExist`` take none (the API server's own rules);
* all of them together (AND); an absent or empty selector matches every labelled Pod.

A malformed selector raises :class:`SelectorError` (a ``ConfigError``, so the reconciler refuses
the policy with ``InvalidSpec`` and the message naming ``spec.selector``); it selects no Pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tokenfair.config import ConfigError

from .views import PolicyView, SidecarView

IN: Final = "In"
NOT_IN: Final = "NotIn"
EXISTS: Final = "Exists"
DOES_NOT_EXIST: Final = "DoesNotExist"
OPERATORS: Final = (IN, NOT_IN, EXISTS, DOES_NOT_EXIST)
_WITH_VALUES: Final = frozenset({IN, NOT_IN})
_SELECTOR_FIELDS: Final = ("matchExpressions", "matchLabels")
_REQUIREMENT_FIELDS: Final = ("key", "operator", "values")


class SelectorError(ConfigError):
    """A selector broke a rule; the message names the field (``…spec.selector…``) and rule."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` entry (a ``matchLabels`` pair is ``key In [value]``)."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == IN:
            return present and labels[self.key] in self.values
        if self.operator == NOT_IN:
            return not present or labels[self.key] not in self.values
        if self.operator == EXISTS:
            return present
        return not present  # DoesNotExist (parse_selector admits no other operator)


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """The AND of its requirements; no requirement matches everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def parse_selector(raw: object, where: str = "spec.selector") -> LabelSelector:
    """The selector ``raw`` (``None`` or ``{}``: match all); ``where`` prefixes every message.

    Raises :class:`SelectorError` for anything the API server's label-selector rules refuse.
    """
    if raw is None:
        return LabelSelector()
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{where}: must be a mapping (got {type(raw).__name__})")
    unknown = sorted(str(k) for k in raw if k not in _SELECTOR_FIELDS)
    if unknown:
        raise SelectorError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(_SELECTOR_FIELDS)})"
        )
    requirements = [*_match_labels(raw.get("matchLabels"), f"{where}.matchLabels")]
    expressions = raw.get("matchExpressions")
    if expressions is not None:
        if not isinstance(expressions, Sequence) or isinstance(expressions, str):
            raise SelectorError(f"{where}.matchExpressions: must be a list")
        for i, item in enumerate(expressions):
            requirements.append(_requirement(item, f"{where}.matchExpressions[{i}]"))
    return LabelSelector(tuple(requirements))


def _match_labels(raw: object, where: str) -> Iterable[Requirement]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{where}: must be a mapping of label to value")
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise SelectorError(f"{where}: label keys must be non-empty strings (got {key!r})")
        if not isinstance(value, str):
            raise SelectorError(f"{where}.{key}: value must be a string (got {value!r})")
    return [Requirement(key, IN, frozenset({value})) for key, value in raw.items()]


def _requirement(raw: object, where: str) -> Requirement:
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{where}: must be a mapping with key, operator and values")
    unknown = sorted(str(k) for k in raw if k not in _REQUIREMENT_FIELDS)
    if unknown:
        raise SelectorError(f"{where}: unknown field(s) {', '.join(unknown)}")
    key, operator, values = raw.get("key"), raw.get("operator"), raw.get("values")
    if not isinstance(key, str) or not key:
        raise SelectorError(f"{where}.key: must be a non-empty string (got {key!r})")
    if operator not in OPERATORS:
        raise SelectorError(
            f"{where}.operator: must be one of {', '.join(OPERATORS)} (got {operator!r})"
        )
    if values is None:
        values = []
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise SelectorError(f"{where}.values: must be a list of strings")
    if not all(isinstance(v, str) for v in values):
        raise SelectorError(f"{where}.values: must be a list of strings (got {list(values)!r})")
    if operator in _WITH_VALUES and not values:
        raise SelectorError(f"{where}.values: operator {operator} needs at least one value")
    if operator not in _WITH_VALUES and values:
        raise SelectorError(f"{where}.values: operator {operator} takes no values")
    return Requirement(key, str(operator), frozenset(str(v) for v in values))


def policy_selector(policy: PolicyView) -> LabelSelector | None:
    """The policy's selector, or None when it is malformed (then it selects no sidecar; the
    reconciler reports why in the policy's status)."""
    where = f"SchedulingPolicy {policy.name!r}: spec.selector"
    try:
        return parse_selector(policy.spec.get("selector"), where)
    except SelectorError:
        return None


def selected_sidecars(
    policies: Iterable[PolicyView], sidecars: Iterable[SidecarView]
) -> list[SidecarView]:
    """The sidecars (Pods labelled with the policy's name) that the policy's selector matches.

    ``policies`` is what the index holds under the policy's key (the live one counts). With no
    live policy known, every labelled Pod is kept (nothing to narrow by); a malformed selector
    keeps none.
    """
    live = [p for p in policies if not p.deleting]
    if not live:
        return list(sidecars)
    selector = policy_selector(live[0])
    if selector is None:
        return []
    return [s for s in sidecars if selector.matches(s.labels)]


def ready_sidecars(policies: Iterable[PolicyView], sidecars: Iterable[SidecarView]) -> int:
    """How many of the policy's selected sidecars are Ready (the budgets' divisor, before the
    ``max(1, n)`` of :mod:`.budgets`)."""
    return sum(s.ready for s in selected_sidecars(policies, sidecars))
