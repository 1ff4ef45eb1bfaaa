"""Blocking Kubernetes I/O of the operator, with the official client (run in worker threads).

Small on purpose: read a key Secret, publish a policy's ConfigMap and Secret (with the document's
generation, :mod:`.documents`), patch a status subresource, and (for admission, which must not trust
a lagging watch) read a policy and list quotas as stored now. GETs go over plain keep-alive HTTP
where the configuration allows (:mod:`.bulk_get`: half the CPU per read), key Secrets in bulk
pipelined (:meth:`KubeApi.key_hashes_many`: a fifth of the operator's CPU per read and two thirds
of the API server's; the resync's at a fresh resourceVersion, :meth:`KubeApi.fresh_version`,
as fresh as a quorum read for the cost of a cached one). Writes are conditional on
``resourceVersion``; a lost race raises the client's ``ApiException`` with status 409, which the
handlers turn into a quick retry. Every write first asks ``may_write`` (with leader election:
whether this replica leads *now*, :class:`.leader.LeaderElector`) and raises :class:`NotLeader`
instead of writing when it does not. Every call carries a request timeout: a hung API server fails a
call, never holds a thread for good.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, cast
from urllib.parse import quote

from kubernetes import client, config
from kubernetes.client import ApiException

from tokenfair.config import ConfigError, api_key_digest, document_text, loads_config

from .bulk_get import LeanGetter
from .documents import (
    GENERATION_ANNOTATION,
    GENERATION_KEY,
    clock_floor,
    next_generation,
    parse_generation,
)
from .payload import is_text
from .render import KeyLookup, KeyProblem
from .views import (
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

NOT_FOUND: Final = 404
FORBIDDEN: Final = 403
TOO_LARGE_VERSION: Final = 504
"""A read at a resourceVersion the watch cache has not reached within its wait (~3 s)."""
MERGE_PATCH: Final = "application/merge-patch+json"
CONFLICT: Final = 409
API_TIMEOUT_S: Final = 30.0
"""Bound on one call of the reconciler (a 2 MiB Secret written on a loaded API server takes
well under a second; a call that takes this long is failed and the pass retried)."""
AUTH_REUSE_S: Final = 10.0
"""Seconds the ``Authorization`` header of one call is reused by the next (:meth:`KubeApi._raw`).
The client's token hook (which re-reads a projected ServiceAccount token when due) also sets
the host again on every call, reading every proxy variable of the environment: ~0.1 ms, a
third of a key Secret read's CPU here. Ten seconds is far inside a token's refresh margin."""
REVIEW_TIMEOUT_S: Final = 5.0
"""Bound on one TokenReview: a sidecar asks again after its backoff."""


class NotLeader(RuntimeError):
    """A write refused here because this replica does not lead (any more)."""


CONNECTIONS: Final = 48
"""HTTP connections the client keeps to the API server: above the reconciler's
``IO_CONCURRENCY`` (16) and ``STATUS_CONCURRENCY`` (16) plus the loops' calls, so concurrent
calls never open and discard extra connections (urllib3's default is 5 per CPU)."""


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
        self._api = api
        self._auth_cache: tuple[float, dict[str, str]] = (0.0, {})
        """Until when (monotonic seconds) the headers of :meth:`_auth_headers` hold."""
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._lean = LeanGetter.from_configuration(
            getattr(api, "configuration", None), API_TIMEOUT_S
        )
        """Plain keep-alive GETs for reads in bulk (:mod:`.bulk_get`); None: the client's."""
        self.may_write = may_write
        """Asked right before every write; the handlers set it to the elector's verdict."""

    def _guard(self, what: str) -> None:
        if not self.may_write():
            raise NotLeader(f"not the leader: {what} not written")

    def key_hashes(self, namespace: str, name: str, fresh: bool = False) -> KeyLookup:
        """SHA-256 digests of every data value of Secret ``name`` (sorted), or the problem.

        Read from the API server's watch cache (``resourceVersion=0``: no etcd round trip, a
        moment behind at most; a 404 there is asked again of etcd, as the Secret may be newer
        than the cache) and without the client's model classes. ``fresh`` reads etcd (a quorum
        read). One Secret (admission's check); the reconciler reads in bulk,
        :meth:`key_hashes_many`."""
        path = _secret_path(namespace, name)
        try:
            secret = None if fresh else self._get_json(path, any_version=True)
            if secret is None:
                secret = self._get_json(path, any_version=False)
        except ApiException as exc:
            if exc.status != FORBIDDEN:
                raise
            return _forbidden(namespace)
        return _lookup(name, secret)

    def key_hashes_many(
        self, secrets: Sequence[tuple[str, str]], resource_version: str = "0"
    ) -> list[KeyLookup]:
        """:meth:`key_hashes` of each ``(namespace, name)`` of ``secrets``, in order, read on
        this thread over one pipelined connection (:meth:`.LeanGetter.get_many`; without a lean
        getter, one by one through the client).

        ``resource_version`` is the read's consistency: ``"0"`` any version the API server's
        watch cache holds (a 404 there is asked again of etcd: the Secret may be newer than the
        cache); ``""`` a quorum read of etcd; a resourceVersion from :meth:`fresh_version`
        ("not older than", served by the watch cache once it has caught up with it: as fresh
        as a quorum read taken when that version was read, for the cost of a cached read; an
        answer that the cache is not there yet, ``504``, is asked again of etcd, and so are
        the rest of ``secrets``, pipelined: the server answers in turn, each 504 after a wait
        of ~3 s). Each answer must be the Secret asked for (``metadata``'s name and
        namespace), else the call raises: never a digest from another tenant's Secret."""
        lean = self._lean
        if lean is None:
            return [self._key_hashes_rv(ns, name, resource_version) for ns, name in secrets]
        query = f"?resourceVersion={quote(resource_version)}" if resource_version else ""
        headers = {"Accept": "application/json", **self._auth_headers()}
        targets = [f"{_secret_path(ns, name)}{query}" for ns, name in secrets]
        at_version = resource_version not in ("", "0")
        try:
            answers = lean.get_many(
                targets,
                headers,
                stop=(lambda code: code == TOO_LARGE_VERSION) if at_version else None,
            )
            asked = [resource_version] * len(answers)
            if len(answers) < len(targets):  # a 504: the watch cache is behind; the rest by quorum
                answers += lean.get_many(
                    [_secret_path(ns, name) for ns, name in secrets[len(answers) :]], headers
                )
                asked += [""] * (len(answers) - len(asked))
        except (OSError, http.client.HTTPException) as exc:
            raise ApiException(status=0, reason=f"GETs of key Secrets failed: {exc}") from exc
        found: list[KeyLookup] = []
        for (namespace, name), (code, raw), version in zip(secrets, answers, asked, strict=True):
            if code == 200:
                found.append(_lookup(name, _secret_answer(namespace, name, raw)))
            elif code == FORBIDDEN:
                found.append(_forbidden(namespace))
            elif code == NOT_FOUND and version != "0":
                found.append(_lookup(name, None))  # as fresh as asked: it does not exist
            elif code in (NOT_FOUND, TOO_LARGE_VERSION):
                found.append(self._key_hashes_rv(namespace, name, ""))  # ask etcd
            else:
                error = ApiException(status=code, reason=f"GET of Secret {namespace}/{name}")
                error.body = raw.decode("utf-8", "replace")
                raise error
        return found

    def _key_hashes_rv(self, namespace: str, name: str, resource_version: str) -> KeyLookup:
        """:meth:`key_hashes` at any ``resource_version`` (see :meth:`key_hashes_many`)."""
        if resource_version in ("", "0"):
            return self.key_hashes(namespace, name, fresh=resource_version == "")
        try:
            secret = self._get_json(
                _secret_path(namespace, name), query=[("resourceVersion", resource_version)]
            )
        except ApiException as exc:
            if exc.status == TOO_LARGE_VERSION:
                return self.key_hashes(namespace, name, fresh=True)
            if exc.status != FORBIDDEN:
                raise
            return _forbidden(namespace)
        return _lookup(name, secret)

    def fresh_version(self, namespace: str, probe: str) -> str:
        """The API server's current resourceVersion, for reads of ``namespace``'s key Secrets
        at least as fresh as a quorum read made now (:meth:`key_hashes_many`); ``""`` (quorum
        reads) when the watch cache of Secrets is not there within its wait.

        The version is etcd's revision now: a quorum read, the one-item LIST of the namespace's
        TenantQuotas (which the operator may list and watch there). Secret ``probe`` is then
        read at it once, so a watch cache that lags costs one wait (~3 s), not one per read
        (the reconciler then reads that namespace by quorum without probing for a while,
        :data:`.reconcile.LAGGING_CACHE_S`); once the cache has reached a version it never
        goes back below it. Assumes Secrets and TenantQuotas share one etcd (the default: no
        ``--etcd-servers-overrides`` for Secrets, whose revisions would not compare)."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{QUOTA_PLURAL}"
        listing = self._get_json(path, query=[("limit", "1")]) or {}
        version = str((listing.get("metadata") or {}).get("resourceVersion") or "")
        if not version.isdigit() or version == "0":
            raise ApiException(status=0, reason=f"no resourceVersion in the LIST of {path}")
        try:
            self._get_json(_secret_path(namespace, probe), query=[("resourceVersion", version)])
        except ApiException as exc:
            if exc.status == TOO_LARGE_VERSION:
                return ""
            if exc.status != FORBIDDEN:
                raise
        return version

    def list_page(
        self, path: str, query: Sequence[tuple[str, str]], continue_token: str = ""
    ) -> tuple[list[dict[str, Any]], str, str]:
        """One page of the LIST at ``path`` (``query``: its ``limit``, selectors): the items
        as plain dicts, the list's resourceVersion and the continue token (``""`` after the
        last page). Every page after the first is served at the first page's resourceVersion
        (the API server's paginated LIST is one consistent snapshot; an expired token raises
        the 410 as an ``ApiException``). A 404 raises too: a LIST of a known resource has no
        such answer."""
        params = [*query, *([("continue", continue_token)] if continue_token else [])]
        listing = self._get_json(path, query=params)
        if listing is None:
            raise ApiException(status=NOT_FOUND, reason=f"LIST {path}: not found")
        meta = listing.get("metadata") or {}
        items = listing.get("items") or []
        return list(items), str(meta.get("resourceVersion") or ""), str(meta.get("continue") or "")

    def published_keys(self, policy: PolicyView) -> dict[str, tuple[str, ...]]:
        """Tenant id -> API-key digests of the document stored in ``policy``'s Secret now (what
        its sidecars enforce); empty when there is none, it belongs to another object of the
        same name (a policy deleted and created again) or it is not a document."""
        name = secret_name(policy.name)
        secret = self._get_json(f"/api/v1/namespaces/{policy.namespace}/secrets/{name}")
        meta = (secret or {}).get("metadata") or {}
        owners = [ref.get("uid") for ref in meta.get("ownerReferences") or []]
        encoded = ((secret or {}).get("data") or {}).get(CONFIG_KEY)
        if owners != [policy.uid] or not encoded:
            return {}
        source = f"Secret {policy.namespace}/{name}"
        try:
            stored = loads_config(document_text(base64.b64decode(encoded), source), source)
        except ConfigError:
            return {}
        return {t.tenant_id: t.api_key_sha256 for t in stored.tenants}

    def _auth_headers(self) -> dict[str, str]:
        """The client's auth headers (a bearer token; none with a client certificate), asked
        of it at most every :data:`AUTH_REUSE_S` (threads racing here both ask: harmless)."""
        until, headers = self._auth_cache
        now = time.monotonic()
        if now >= until:
            settings = self._api.configuration.auth_settings().values()
            headers = {s["key"]: s["value"] for s in settings if s["in"] == "header" and s["value"]}
            self._auth_cache = (now + AUTH_REUSE_S, headers)
        return headers

    def _get_json(
        self,
        path: str,
        *,
        any_version: bool = False,
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any] | None:
        """GET ``path`` as a plain dict (None: 404); any other failure raises ApiException
        (a transport failure too, as the client's own ``ApiException``). Through
        :mod:`.bulk_get` when the configuration allows (half the operator's CPU per read)."""
        query = [*(query or []), *([("resourceVersion", "0")] if any_version else [])]
        lean = self._lean
        if lean is None:
            status, body = self._raw("GET", path, query=query)
            return None if status == NOT_FOUND else body
        headers = {"Accept": "application/json", **self._auth_headers()}
        try:
            code, reason, raw = lean.get(path, query, headers)
        except (OSError, http.client.HTTPException) as exc:
            raise ApiException(status=0, reason=f"GET {path} failed: {exc}") from exc
        if code == NOT_FOUND:
            return None
        if not 200 <= code < 300:
            error = ApiException(status=code, reason=reason)
            error.body = raw.decode("utf-8", "replace")
            raise error
        return cast(dict[str, Any], json.loads(raw) if raw else {})

    def _raw(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """One call without the generated client's validation and models (their CPU is most
        of a call's cost here): the status and the JSON body; a 404 is returned, any other
        failure raises the client's ``ApiException``."""
        headers = {"Accept": "application/json", **self._auth_headers()}
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = self._api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body
        )
        response = self._api.call_api(*request, _request_timeout=API_TIMEOUT_S)
        raw = response.read()
        if response.status == NOT_FOUND:
            return NOT_FOUND, {}
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return response.status, cast(dict[str, Any], json.loads(raw) if raw else {})

    def publish_document(
        self, policy: PolicyView, version: str, configmap_payload: bytes, secret_payload: bytes
    ) -> tuple[int, list[str]]:
        """Create or update the policy's ConfigMap and Secret holding the payloads under
        ``config.yaml`` (a ConfigMap keeps text in ``data``, gzip in ``binaryData``,
        :mod:`.payload`), ``version`` and the document's generation (:mod:`.documents`: one
        more than the highest either holds and at least the clock's milliseconds, unless one
        holds ``version`` already). Returns
        the generation and the kinds written (only what changed)."""
        targets = (
            ("ConfigMap", configmap_name(policy.name), configmap_payload),
            ("Secret", secret_name(policy.name), secret_payload),
        )
        current = [self._read(kind, name, policy.namespace) for kind, name, _ in targets]
        generation = next_generation(
            version, [_published(obj) for obj in current], floor=clock_floor()
        )
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

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> str:
        """Merge-patch ``status`` of a custom object, conditional on ``resource_version`` when
        given (the API server answers 409 if the object changed since); a vanished object is
        not an error. Returns the object's resourceVersion after the write ("" if gone)."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        self._guard(f"status of {plural} {namespace}/{name}")
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}/{name}/status"
        _, answer = self._raw("PATCH", path, body=body, content_type=MERGE_PATCH)  # 404: {}
        return str(answer.get("metadata", {}).get("resourceVersion", ""))

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


def _secret_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/secrets/{quote(name)}"


def _secret_answer(namespace: str, name: str, raw: bytes) -> dict[str, Any]:
    """The Secret of a pipelined answer, checked to be ``namespace``/``name``'s: an answer out
    of step (a parser fault, a confused server) raises, never yields another Secret's keys."""
    try:
        secret = json.loads(raw)
        meta = secret.get("metadata") or {}
        got = (meta.get("namespace"), meta.get("name"))
    except (ValueError, AttributeError) as exc:
        raise ApiException(status=0, reason=f"GET of Secret {namespace}/{name}: {exc}") from exc
    if got != (namespace, name):
        raise ApiException(
            status=0, reason=f"GET of Secret {namespace}/{name} answered with {got[0]}/{got[1]}"
        )
    return cast(dict[str, Any], secret)


def _forbidden(namespace: str) -> KeyProblem:
    # The operator's RBAC does not reach this namespace: said in the policy's status.
    return KeyProblem(
        "KeySecretForbidden",
        f"the operator may not read Secrets in namespace {namespace!r}: list it in the "
        "chart's operator.secretNamespaces (a RoleBinding to tokenfair-operator-secrets)",
    )


def _lookup(name: str, secret: Mapping[str, Any] | None) -> KeyLookup:
    """The digests of every data value of key Secret ``secret`` (sorted), or the problem."""
    if secret is None:
        return KeyProblem("KeySecretNotFound", f"Secret {name!r} not found")
    data = secret.get("data") or {}
    try:
        values = [base64.b64decode(v).decode() for v in data.values()]
    except (ValueError, TypeError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return KeyProblem("KeySecretInvalid", f"Secret {name!r} holds a value that is not "
                          "UTF-8 text")  # fmt: skip
    keys = [v for v in values if v.strip()]
    if not keys:
        return KeyProblem("KeySecretEmpty", f"Secret {name!r} holds no API key")
    return tuple(sorted({api_key_digest(key) for key in keys}))


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
