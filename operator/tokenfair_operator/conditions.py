"""Status of SchedulingPolicies and TenantQuotas: conditions, observedGeneration, config version.

Three condition types, Kubernetes API conventions (``type/status/reason/message/
lastTransitionTime``, ``observedGeneration`` on each), no ``phase``:

* ``Accepted`` — the object passed every rule. TenantQuota reasons: ``Valid``; refusals
  ``InvalidSpec``, ``PolicyNotFound``, ``PolicyInvalid``, ``DuplicateTenantId``,
  ``KeySecretNotFound``, ``KeySecretEmpty``, ``KeySecretInvalid``, ``KeySecretForbidden``,
  ``ConflictingApiKey``. SchedulingPolicy: ``Valid`` or ``InvalidSpec``.
* ``ConfigPublished`` — the policy's config document holding this object is in the ConfigMap
  (and Secret): ``Published``; otherwise ``NotAccepted`` (the object itself was refused) or, for a
  policy, ``NoAcceptedTenants`` (a document needs at least one tenant; the last published one, if
  any, stays in place).
* ``Ready`` — ``True``/``Ready`` when both are true; otherwise ``False`` with the reason and
  message of the first false one, so ``kubectl get`` shows the cause in one column.

A SchedulingPolicy has a fourth, outside ``Ready`` (which speaks of its document):

* ``SidecarsInjected`` — every Pod labelled ``tokenfair.io/policy: <policy>`` runs the sidecar
  (``AllInjected``); ``False``/``PodsWithoutSidecar`` names the Pods that serve unprotected
  (created while injection failed open), with a Warning Event and the operator's metric
  ``tokenfair_operator_pods_without_sidecar``.

``lastTransitionTime`` changes only when a condition's status does, so recomputing an unchanged
world yields an identical status and the operator writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

READY: Final = "Ready"
ACCEPTED: Final = "Accepted"
CONFIG_PUBLISHED: Final = "ConfigPublished"
SIDECARS_INJECTED: Final = "SidecarsInjected"
PODS_WITHOUT_SIDECAR: Final = "PodsWithoutSidecar"


@dataclass(frozen=True, slots=True)
class Check:
    """One condition before it gets its timestamps."""

    type: str
    ok: bool
    reason: str
    message: str


def conditions_for(
    accepted: Check,
    published: Check,
    *,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> list[dict[str, Any]]:
    """``Ready``, ``Accepted`` and ``ConfigPublished`` for an object at ``generation``.

    ``previous`` is the object's current ``status.conditions``; a condition whose status is
    unchanged keeps its ``lastTransitionTime``, any other gets ``now`` (RFC 3339).
    """
    failing = next((c for c in (accepted, published) if not c.ok), None)
    ready = (
        Check(READY, True, "Ready", published.message)
        if failing is None
        else Check(READY, False, failing.reason, failing.message)
    )
    return [
        condition_for(check, generation=generation, previous=previous, now=now)
        for check in (ready, accepted, published)
    ]


def condition_for(
    check: Check, *, generation: int, previous: Sequence[Mapping[str, Any]], now: str
) -> dict[str, Any]:
    """One condition; it keeps its ``lastTransitionTime`` from ``previous`` if its status is
    unchanged, else gets ``now``."""
    status = "True" if check.ok else "False"
    old = next((c for c in previous if c.get("type") == check.type), {})
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return {
        "type": check.type,
        "status": status,
        "reason": check.reason,
        "message": check.message,
        "observedGeneration": generation,
        "lastTransitionTime": since or now,
    }


def ready_reason(conditions: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """``(reason, message)`` of a false ``Accepted`` condition, or None (for refusal Events)."""
    for condition in conditions:
        if condition.get("type") == ACCEPTED and condition.get("status") == "False":
            return str(condition.get("reason")), str(condition.get("message"))
    return None
