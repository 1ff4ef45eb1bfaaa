"""Blocking Kubernetes I/O of the operator, with the official client (run in worker threads).

Small on purpose: read a key Secret, publish a policy's ConfigMap and Secret (with the
document's generation, :mod:`.documents`), patch a status subresource, review a sidecar's
token (:mod:`.serve`), and (for admission, which must not trust a lagging watch) read a policy
and list quotas as stored now. Writes are conditional on ``resourceVersion``; a lost race
raises the client's ``ApiException`` with status 409, which the handlers turn into a quick
retry. Every write first asks ``may_write`` (with leader election: whether this replica leads
*now*, :class:`.leader.LeaderElector`) and raises :class:`NotLeader` instead of writing when
it does not. Every call carries a request timeout: a hung API server fails a call, never
holds a thread for good.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, Final, cast

from kubernetes import client, config
from kubernetes.client import ApiException

from .documents import GENERATION_ANNOTATION, GENERATION_KEY, next_generation, parse_generation
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
    configmap_name,
    secret_name,
)
from .payload import is_text
from .render import KeyLookup, KeyProblem, sha256_hex

NOT_FOUND: Final = 404
CONFLICT: Final = 409
API_TIMEOUT_S: Final = 30.0
"""Bound on one call of the reconciler (a 2 MiB Secret written on a loaded API server takes
well under a second; a call that takes this long is failed and the pass retried)."""
REVIEW_TIMEOUT_S: Final = 5.0
"""Bound on one TokenReview: a sidecar asks again after its backoff."""


class NotLeader(RuntimeError):
    """A write refused here because this replica does not lead (any more)."""


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

    def __init__(self, api: Any, may_write: Callable[[], bool] = lambda: True) -> None:
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._auth = client.AuthenticationV1Api(api)
        self.may_write = may_write
        """Asked right before every write; the handlers set it to the elector's verdict."""

    def _guard(self, what: str) -> None:
        if not self.may_write():
            raise NotLeader(f"not the leader: {what} not written")

    def key_hashes(self, namespace: str, name: str) -> KeyLookup:
        """SHA-256 digests of every data value of Secret ``name`` (sorted), or the problem."""
        try:
            secret = self._core.read_namespaced_secret(
                name, namespace, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return KeyProblem("KeySecretNotFound", f"Secret {name!r} not found")
            raise
        values = [base64.b64decode(v).decode() for v in (secret.data or {}).values()]
        keys = [v for v in values if v.strip()]
        if not keys:
            return KeyProblem("KeySecretEmpty", f"Secret {name!r} holds no API key")
        return tuple(sorted({sha256_hex(key) for key in keys}))

    def publish_document(
        self, policy: PolicyView, version: str, configmap_payload: bytes, secret_payload: bytes
    ) -> tuple[int, list[str]]:
        """Create or update the policy's ConfigMap and Secret holding the payloads under
        ``config.yaml`` (a ConfigMap keeps text in ``data``, gzip in ``binaryData``,
        :mod:`.payload`), ``version`` and the document's generation (:mod:`.documents`: one
        more than the highest either holds, unless one holds ``version`` already). Returns
        the generation and the kinds written (only what changed)."""
        targets = (
            ("ConfigMap", configmap_name(policy.name), configmap_payload),
            ("Secret", secret_name(policy.name), secret_payload),
        )
        current = [self._read(kind, name, policy.namespace) for kind, name, _ in targets]
        generation = next_generation(version, [_published(obj) for obj in current])
        written = [
            kind
            for (kind, name, payload), stored in zip(targets, current, strict=True)
            if self._store(kind, name, policy, payload, version, generation, stored)
        ]
        return generation, written

    def _read(self, kind: str, name: str, namespace: str) -> Any:
        read, _, _ = self._verbs(kind)
        try:
            return read(name, namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            return None

    def _store(
        self,
        kind: str,
        name: str,
        policy: PolicyView,
        payload: bytes,
        version: str,
        generation: int,
        current: Any,
    ) -> bool:
        """Write ``payload`` into ``current`` (None: create it) unless it holds it already;
        True if it wrote."""
        _, create, replace = self._verbs(kind)
        stored: dict[str, str] = {}
        binary: dict[str, str] = {}
        if kind == "Secret":
            stored[CONFIG_KEY] = base64.b64encode(payload).decode()
            stored[GENERATION_KEY] = base64.b64encode(str(generation).encode()).decode()
        else:
            if is_text(payload):
                stored[CONFIG_KEY] = payload.decode()
            else:
                binary[CONFIG_KEY] = base64.b64encode(payload).decode()
            stored[GENERATION_KEY] = str(generation)
        annotations = {VERSION_ANNOTATION: version, GENERATION_ANNOTATION: str(generation)}
        meta = {
            "name": name,
            "namespace": policy.namespace,
            "labels": {POLICY_LABEL: policy.name, MANAGED_BY_LABEL: MANAGED_BY},
            "annotations": annotations,
            "ownerReferences": [_owner(policy)],
        }
        body: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": meta, "data": stored}
        if kind == "Secret":
            body["type"] = "Opaque"
        else:
            body["binaryData"] = binary
        if current is None:
            self._guard(f"{kind} {policy.namespace}/{name}")
            create(policy.namespace, body, _request_timeout=API_TIMEOUT_S)
            return True
        held = current.metadata.annotations or {}
        owners = [ref.uid for ref in current.metadata.owner_references or []]
        current_binary = getattr(current, "binary_data", None) or {}
        if (
            (current.data or {}) == stored
            and (kind == "Secret" or current_binary == binary)
            and all(held.get(k) == v for k, v in annotations.items())
            and owners == [policy.uid]
        ):
            return False
        meta["resourceVersion"] = current.metadata.resource_version
        self._guard(f"{kind} {policy.namespace}/{name}")
        replace(name, policy.namespace, body, _request_timeout=API_TIMEOUT_S)
        return True

    def get_policy(self, namespace: str, name: str) -> PolicyView | None:
        """The SchedulingPolicy as stored now, or None."""
        try:
            body = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, POLICY_PLURAL, name, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None
            raise
        return PolicyView.from_body(cast(dict[str, Any], body))

    def list_quotas(self, namespace: str) -> list[QuotaView]:
        """Every TenantQuota of ``namespace`` as stored now."""
        listing = self._custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, QUOTA_PLURAL, _request_timeout=API_TIMEOUT_S
        )
        items = cast(dict[str, Any], listing).get("items", [])
        return [QuotaView.from_body(item) for item in items]

    def review_token(self, token: str) -> str | None:
        """The username the API server authenticates bearer ``token`` as (a TokenReview), or
        None when it does not (for :mod:`.serve`)."""
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
        result = self._auth.create_token_review(review, _request_timeout=REVIEW_TIMEOUT_S).status
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
        self._guard(f"status of {plural} {namespace}/{name}")
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, plural, name, body, _request_timeout=API_TIMEOUT_S
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


def _published(obj: Any) -> tuple[str | None, int]:
    """(version, generation) an object holds; (None, 0) for none."""
    if obj is None:
        return None, 0
    annotations = obj.metadata.annotations or {}
    return annotations.get(VERSION_ANNOTATION), parse_generation(
        annotations.get(GENERATION_ANNOTATION)
    )


def is_conflict(exc: BaseException) -> bool:
    """True for the API's 409 Conflict (a stale resourceVersion or an existing name)."""
    return isinstance(exc, ApiException) and exc.status == CONFLICT
