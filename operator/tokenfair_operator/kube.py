"""Blocking Kubernetes I/O of the operator, with the official client (run in worker threads).

Small on purpose: read a key Secret, publish a ConfigMap or Secret owned by its policy, patch a
status subresource, and (for admission, which must not trust a lagging watch) read a policy and
list quotas as stored now. Writes are conditional on ``resourceVersion``; a lost race raises the
client's ``ApiException`` with status 409, which the handlers turn into a quick retry.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Final, cast

from kubernetes import client, config
from kubernetes.client import ApiException

from .model import (
    GROUP,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    POLICY_LABEL,
    POLICY_PLURAL,
    QUOTA_PLURAL,
    VERSION,
    VERSION_ANNOTATION,
    PolicyView,
    QuotaView,
)
from .render import KeyLookup, KeyProblem, sha256_hex

NOT_FOUND: Final = 404
CONFLICT: Final = 409


def api_client() -> Any:
    """A client for the pod's ServiceAccount in a cluster, else for ``$KUBECONFIG``."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


class KubeApi:
    """The handful of API calls the reconciler makes."""

    def __init__(self, api: Any) -> None:
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)

    def key_hashes(self, namespace: str, name: str) -> KeyLookup:
        """SHA-256 digests of every data value of Secret ``name`` (sorted), or the problem."""
        try:
            secret = self._core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return KeyProblem("KeySecretNotFound", f"Secret {name!r} not found")
            raise
        values = [base64.b64decode(v).decode() for v in (secret.data or {}).values()]
        keys = [v for v in values if v.strip()]
        if not keys:
            return KeyProblem("KeySecretEmpty", f"Secret {name!r} holds no API key")
        return tuple(sorted({sha256_hex(key) for key in keys}))

    def publish(
        self, kind: str, name: str, policy: PolicyView, data: Mapping[str, str], version: str
    ) -> bool:
        """Create or update ConfigMap/Secret ``name`` owned by ``policy``; True if it wrote."""
        read, create, replace = self._verbs(kind)
        stored = dict(data) if kind == "ConfigMap" else _b64(data)
        meta = {
            "name": name,
            "namespace": policy.namespace,
            "labels": {POLICY_LABEL: policy.name, MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": {VERSION_ANNOTATION: version},
            "ownerReferences": [_owner(policy)],
        }
        body: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": meta, "data": stored}
        if kind == "Secret":
            body["type"] = "Opaque"
        try:
            current = read(name, policy.namespace)
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            create(policy.namespace, body)
            return True
        annotations = current.metadata.annotations or {}
        owners = [ref.uid for ref in current.metadata.owner_references or []]
        if (
            (current.data or {}) == stored
            and annotations.get(VERSION_ANNOTATION) == version
            and owners == [policy.uid]
        ):
            return False
        meta["resourceVersion"] = current.metadata.resource_version
        replace(name, policy.namespace, body)
        return True

    def get_policy(self, namespace: str, name: str) -> PolicyView | None:
        """The SchedulingPolicy as stored now, or None."""
        try:
            body = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, POLICY_PLURAL, name
            )
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None
            raise
        return PolicyView.from_body(cast(dict[str, Any], body))

    def list_quotas(self, namespace: str) -> list[QuotaView]:
        """Every TenantQuota of ``namespace`` as stored now."""
        listing = self._custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, QUOTA_PLURAL
        )
        items = cast(dict[str, Any], listing).get("items", [])
        return [QuotaView.from_body(item) for item in items]

    def patch_status(self, plural: str, namespace: str, name: str, status: Any) -> None:
        """Merge-patch ``status`` of a custom object; a vanished object is not an error."""
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, plural, name, {"status": status}
            )
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise

    def _verbs(self, kind: str) -> tuple[Any, Any, Any]:
        core = self._core
        if kind == "ConfigMap":
            return (
                core.read_namespaced_config_map,
                core.create_namespaced_config_map,
                core.replace_namespaced_config_map,
            )
        return (
            core.read_namespaced_secret,
            core.create_namespaced_secret,
            core.replace_namespaced_secret,
        )


def _b64(data: Mapping[str, str]) -> dict[str, str]:
    return {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}


def _owner(policy: PolicyView) -> dict[str, Any]:
    # controller + blockOwnerDeletion: foreground deletion of the policy waits for its documents.
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": policy.KIND,
        "name": policy.name,
        "uid": policy.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_conflict(exc: BaseException) -> bool:
    """True for the API's 409 Conflict (a stale resourceVersion or an existing name)."""
    return isinstance(exc, ApiException) and exc.status == CONFLICT
