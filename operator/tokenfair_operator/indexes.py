"""The three Kopf indexes the reconciler and the loops read, and a typed view over them.

Kopf names each index after the function that fills it and passes it to every handler as a
keyword argument of that name; :class:`Indexes` takes the three from those arguments once (in
the startup hook), so nothing else looks them up by name. The mappings are live: Kopf fills them
in place as the watches list and change objects, so a view built at startup always reads the
current entries.

What each index holds per (namespace, policy name): the TenantQuotas naming the policy
(:func:`quota_entry`), the SchedulingPolicy itself (:func:`policy_entry`), and the sidecar Pods
labelled ``tokenfair.io/policy`` (:func:`sidecar_entry`). The policy's selector is applied when
they are read, so a changed selector needs no re-indexing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import kopf

from .inject import ADMIN_PORT, ADMIN_PORT_ANNOTATION, CONTAINER, POLICY_LABEL
from .reconcile import PolicyKey, Snapshot
from .selector import ready_sidecars
from .views import PolicyView, QuotaView, SidecarView

POLICIES: Final = "policies_by_name"
QUOTAS: Final = "quotas_by_policy"
SIDECARS: Final = "sidecars_by_policy"
"""The indexes' names: those of the functions in :mod:`.handlers` that Kopf registers."""

PolicyIndex = kopf.Index[PolicyKey, PolicyView]
QuotaIndex = kopf.Index[PolicyKey, QuotaView]
SidecarIndex = kopf.Index[PolicyKey, SidecarView]


@dataclass(frozen=True, slots=True)
class Indexes:
    """The live indexes, typed: policies, quotas and sidecar Pods by policy key."""

    policies: PolicyIndex
    quotas: QuotaIndex
    sidecars: SidecarIndex

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> Indexes:
        """The indexes among a handler's keyword arguments (a KeyError names a missing one)."""
        return cls(kwargs[POLICIES], kwargs[QUOTAS], kwargs[SIDECARS])

    def snapshot(self, key: PolicyKey) -> Snapshot:
        """What one pass of policy ``key`` reads, as the indexes hold it now."""
        return self.policies.get(key, ()), self.quotas.get(key, ()), self.sidecars.get(key, ())

    def size(self) -> int:
        """Objects the three indexes hold (O(policies): each entry's store knows its size)."""
        return sum(
            len(index[key])
            for index in (self.policies, self.quotas, self.sidecars)
            for key in index
        )

    def ready_sidecars(self, key: PolicyKey) -> int:
        """Ready sidecars of policy ``key`` that its ``spec.selector`` matches."""
        return ready_sidecars(self.policies.get(key, ()), self.sidecars.get(key, ()))


def quota_entry(body: kopf.Body) -> dict[PolicyKey, QuotaView]:
    view = QuotaView.from_body(body)
    return {(view.namespace, view.policy_name): view}


def policy_entry(body: kopf.Body) -> dict[PolicyKey, PolicyView]:
    view = PolicyView.from_body(body)
    return {(view.namespace, view.name): view}


def sidecar_entry(
    *,
    name: str | None,
    namespace: str | None,
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
) -> dict[PolicyKey, SidecarView]:
    """Each sidecar Pod (labelled ``tokenfair.io/policy``): Ready or not, where its admin
    port answers (``status.podIP``, port 9090 or annotation ``tokenfair.io/admin-port``), its
    labels (for the policy's ``spec.selector``), and whether it runs the sidecar at all."""
    ip = status.get("podIP")
    port = annotations.get(ADMIN_PORT_ANNOTATION, str(ADMIN_PORT))
    address = f"{ip}:{port}" if ip else None
    containers = spec.get("containers") or []
    view = SidecarView(
        pod_is_ready(status),
        address,
        {str(k): str(v) for k, v in labels.items()},
        name=name or "",
        injected=any(c.get("name") == CONTAINER for c in containers),
    )
    return {(namespace or "", labels[POLICY_LABEL]): view}


def pod_is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
