"""Blocking Kubernetes I/O of the operator, with the official client (run in worker threads).

Small on purpose: read a key Secret, publish a ConfigMap or Secret owned by its policy, patch a
status subresource, review a sidecar's token (:mod:`.serve`), and (for admission, which must
not trust a lagging watch) read a policy and list quotas as stored now. Writes are conditional
on ``resourceVersion``; a lost race raises the client's ``ApiException`` with status 409, which
the handlers turn into a quick retry.
"""

from __future__ import annotations

import base64
from typing import Any, Final, cast

from kubernetes import client, config
from kubernetes.client import ApiException

from .model import (
    CONFIG_KEY,
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
from .payload import is_text
from .render import KeyLookup, KeyProblem, sha256_hex

NOT_FOUND: Final = 404
CONFLICT: Final = 409


CONNECTIONS: Final = 32
"""HTTP connections the client keeps to the API server: above the reconciler's
``IO_CONCURRENCY`` (16) plus the loops' calls, so concurrent calls never open and discard extra
connections (urllib3's default is 5 per CPU)."""


def api_client(kubeconfig: str | None = None) -> Any:
    """A client for ``kubeconfig`` if given, else the pod's ServiceAccount in a cluster, else
    ``$KUBECONFIG``."""
    if kubeconfig is not None:
        config.load_kube_config(kubeconfig)  # type: ignore[no-untyped-call]
    else:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(configuration)


class KubeApi:
    """The handful of API calls the reconciler makes."""

    def __init__(self, api: Any) -> None:
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._auth = client.AuthenticationV1Api(api)

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
        self, kind: str, name: str, policy: PolicyView, payload: bytes, version: str
    ) -> bool:
        """Create or update ConfigMap/Secret ``name`` owned by ``policy`` holding ``payload``
        under ``config.yaml`` (a ConfigMap keeps text in ``data``, gzip in ``binaryData``,
        :mod:`.payload`); True if it wrote."""
        read, create, replace = self._verbs(kind)
        encoded = base64.b64encode(payload).decode()
        stored: dict[str, str] = {}
        binary: dict[str, str] = {}
        if kind == "Secret":
            stored[CONFIG_KEY] = encoded
        elif is_text(payload):
            stored[CONFIG_KEY] = payload.decode()
        else:
            binary[CONFIG_KEY] = encoded
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
        else:
            body["binaryData"] = binary
        try:
            current = read(name, policy.namespace)
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            create(policy.namespace, body)
            return True
        annotations = current.metadata.annotations or {}
        owners = [ref.uid for ref in current.metadata.owner_references or []]
        current_binary = getattr(current, "binary_data", None) or {}
        if (
            (current.data or {}) == stored
            and (kind == "Secret" or current_binary == binary)
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

    def review_token(self, token: str) -> str | None:
        """The username the API server authenticates bearer ``token`` as (a TokenReview), or
        None when it does not (for :mod:`.serve`)."""
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
        result = self._auth.create_token_review(review).status
        if result is None or not result.authenticated or result.user is None:
            return None
        return str(result.user.username)

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> None:
        """Merge-patch ``status`` of a custom object, conditional on ``resource_version`` when
        given (the API server answers 409 if the object changed since); a vanished object is
        not an error."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, plural, name, body
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
