"""A policy whose document no longer fits one Kubernetes object uncompressed.

Behaviours under test:

- on the real control plane, with the shipped RBAC: 1,000 TenantQuotas of 16 inline key
  digests each make a Secret document of over 1 MiB (the API server's limit on a ConfigMap's or
  Secret's data, which the plain-YAML documents of earlier versions hit at ~4,500 tenants of one
  key); the operator publishes it gzip-compressed (the ConfigMap's, over 256 KiB by long
  tenant ids, in ``binaryData``), under the limit, and the sidecar's own file loader reads back
  all 1,000 tenants from the stored bytes of both, the Secret's with their digests; every
  quota's status names that version;
- a document that does not fit even compressed (random digests barely compress) is not
  published: ``DocumentTooLarge`` on the policy and its quotas, naming the size and the limit;
- a small document stays plain text (``kubectl get cm -o yaml`` shows it);
- the sidecar refuses a gzip bomb by its decompressed size, and corrupt gzip, naming the rule;
- on the real control plane, with the shipped RBAC: the reconciler's first pass over brand-new
  quotas with key Secrets publishes the document (stored, holding every tenant's key digest,
  and served) and returns while every quota status write is still held back; the held writes
  then all land, each naming that version. The order is asserted, not a duration. A new
  reconciler (a restarted operator or a new leader) then serves the same document without
  reading a key Secret: its cold cache is seeded from the stored document;
- on the real control plane, with the shipped RBAC: key Secrets read pipelined at each
  consistency (the watch cache, a quorum read, a fresh resourceVersion) give what one-by-one
  reads give, each problem included; a key rotated 20 times is read back at once at a fresh
  resourceVersion (the resync's read) every time.

The 10,000-quota figures (render, reconcile pass, sidecar reload) come from
``bench/bench_operator_scale.py``; nothing here asserts a duration.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster
from operator_support import (
    API,
    condition,
    get,
    policy_path,
    running_operator,
    wait_for,
)

from tokenfair.config import MAX_DOCUMENT_BYTES, ConfigError
from tokenfair.server.runtime_settings import loads_sidecar_file
from tokenfair_operator import PolicyView, QuotaView, render_config
from tokenfair_operator.kube import KubeApi, api_client
from tokenfair_operator.payload import COMPRESS_ABOVE_BYTES, MAX_OBJECT_DATA_BYTES
from tokenfair_operator.reconcile import Reconciler
from tokenfair_operator.status import policy_status, quota_status
from tokenfair_operator.views import QUOTA_PLURAL, VERSION_ANNOTATION

QUOTAS = 1_000
KEYS_PER_QUOTA = 16
# Generous: 1,000 creations and 1,000 status writes on a loaded 2-core machine.
SCALE_WAIT_S = 240.0


def digests(quota_index: int, count: int) -> list[str]:
    return [hashlib.sha256(f"key-{quota_index}-{k}".encode()).hexdigest() for k in range(count)]


def quota_spec(i: int, keys: int = KEYS_PER_QUOTA) -> dict[str, Any]:
    return {
        "policyName": "pool",
        "weight": 1.0 + i % 4,
        "burstServiceTokens": 20_000,
        "sustainedServiceTokensPerSecond": 500.0,
        "priorityClass": "batch" if i % 2 else "interactive",
        "apiKeySha256": digests(i, keys),
        # Long ids take the ConfigMap's document (no digests) past 256 KiB too: gzip there,
        # stored in binaryData.
        "tenantId": tenant_id(i),
    }


def tenant_id(i: int) -> str:
    return f"tenant-{i:04d}-" + "x" * 150


@pytest.fixture
def scale_operator(
    operator_kubeconfig: Path, kube_namespace: str, tmp_path: Path
) -> Iterator[Path]:
    with running_operator(operator_kubeconfig, kube_namespace, tmp_path / "operator.log") as log:
        yield log


def stored_payload(cluster: KubeCluster, ns: str, kind: str, name: str) -> bytes | None:
    obj = get(cluster, f"/api/v1/namespaces/{ns}/{kind}/{name}")
    if obj is None:
        return None
    if kind == "secrets":
        return base64.b64decode(obj["data"]["config.yaml"])
    if "config.yaml" in obj.get("data", {}):
        return str(obj["data"]["config.yaml"]).encode()
    return base64.b64decode(obj["binaryData"]["config.yaml"])


def test_a_document_over_one_mebibyte_is_published_compressed(
    kube_cluster: KubeCluster, kube_namespace: str, scale_operator: Path
) -> None:
    ns = kube_namespace
    policy = {"apiVersion": "tokenfair.io/v1alpha1", "kind": "SchedulingPolicy"}
    kube_cluster.expect(
        201,
        "POST",
        f"{API}/namespaces/{ns}/schedulingpolicies",
        {**policy, "metadata": {"name": "pool"}, "spec": {}},
    )
    for i in range(QUOTAS):
        body = {
            "apiVersion": "tokenfair.io/v1alpha1",
            "kind": "TenantQuota",
            "metadata": {"name": f"tenant-{i:04d}"},
            "spec": quota_spec(i),
        }
        kube_cluster.expect(201, "POST", f"{API}/namespaces/{ns}/tenantquotas", body)

    def all_published() -> dict[str, Any] | None:
        obj = get(kube_cluster, policy_path(ns))
        status = (obj or {}).get("status", {})
        return (
            obj if status.get("tenants") == QUOTAS and condition(obj)["status"] == "True" else None
        )

    pool = wait_for(f"{QUOTAS} tenants published", all_published, SCALE_WAIT_S)
    version = pool["status"]["configVersion"]
    for kind, name in (("secrets", "tokenfair-pool-keys"), ("configmaps", "tokenfair-pool")):
        payload = stored_payload(kube_cluster, ns, kind, name)
        assert payload is not None
        assert payload[:2] == b"\x1f\x8b", f"{kind}: a document this large is stored as gzip"
        assert len(payload) < MAX_OBJECT_DATA_BYTES
        loaded = loads_sidecar_file(payload, f"{kind}/{name}")
        assert loaded.config.version == version
        assert len(loaded.config.tenants) == QUOTAS
    plain = gzip.decompress(
        stored_payload(kube_cluster, ns, "secrets", "tokenfair-pool-keys") or b""
    )
    # The old way (the document stored as it is) would have been refused by the API server.
    assert len(plain) > MAX_OBJECT_DATA_BYTES
    secret_config = loads_sidecar_file(plain, "secret").config
    by_id = {t.tenant_id: t for t in secret_config.tenants}
    assert by_id[tenant_id(999)].api_key_sha256 == tuple(digests(999, KEYS_PER_QUOTA))
    # Every quota's status names the first version that held it (written in bounded-parallel
    # batches as the quotas arrived), each one a 16-hex-digit content hash.
    # The policy's status is written before its quotas': wait for the last of those.
    listing = wait_for("every quota's status", lambda: quotas_with_status(kube_cluster, ns))
    for item in listing:
        assert len(item["status"].get("configVersion", "")) == 16, item["metadata"]["name"]
        assert condition(item, "ConfigPublished")["status"] == "True"


KEYED_QUOTAS = 200


class HeldStatusWrites(KubeApi):
    """The real API, but every TenantQuota status write waits for ``release``; key Secret
    reads are counted."""

    def __init__(self, api: Any, release: threading.Event) -> None:
        super().__init__(api)
        self.release = release
        self.key_reads = 0

    def key_hashes(self, namespace: str, name: str, fresh: bool = False) -> Any:
        self.key_reads += 1
        return super().key_hashes(namespace, name, fresh)

    def key_hashes_many(self, secrets: Any, resource_version: str = "0") -> Any:
        self.key_reads += len(secrets)
        return super().key_hashes_many(secrets, resource_version)

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> str:
        if plural == QUOTA_PLURAL:
            assert self.release.wait(SCALE_WAIT_S), "quota status writes never released"
        return super().patch_status(plural, namespace, name, status, resource_version)


async def test_the_first_pass_publishes_before_the_quota_statuses_are_written(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path
) -> None:
    ns = kube_namespace
    kind = {"apiVersion": "tokenfair.io/v1alpha1"}
    policy = {**kind, "kind": "SchedulingPolicy", "metadata": {"name": "pool"}, "spec": {}}
    kube_cluster.expect(201, "POST", f"{API}/namespaces/{ns}/schedulingpolicies", policy)
    for i in range(KEYED_QUOTAS):
        secret = {"metadata": {"name": f"key-{i:04d}"}, "stringData": {"k": f"sk-{i}"}}
        kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)
        spec = {"policyName": "pool", "weight": 1.0, "burstServiceTokens": 20_000,
                "sustainedServiceTokensPerSecond": 500.0,
                "apiKeySecretRef": {"name": f"key-{i:04d}"}}  # fmt: skip
        quota = {**kind, "kind": "TenantQuota", "metadata": {"name": f"tenant-{i:04d}"}}
        kube_cluster.expect(
            201, "POST", f"{API}/namespaces/{ns}/tenantquotas", quota | {"spec": spec}
        )
    release = threading.Event()
    api = HeldStatusWrites(api_client(str(operator_kubeconfig)), release)
    reconciler = Reconciler(api)
    key = (ns, "pool")
    try:
        stored_policy = api.get_policy(ns, "pool")
        assert stored_policy is not None
        await reconciler.reconcile(key, [stored_policy], api.list_quotas(ns), logging.getLogger())

        # The pass has returned: the document is stored and served, every quota write waits.
        document = reconciler.documents.get(key)
        assert document is not None
        configmap = get(kube_cluster, f"/api/v1/namespaces/{ns}/configmaps/tokenfair-pool")
        assert configmap is not None
        assert configmap["metadata"]["annotations"][VERSION_ANNOTATION] == document.version
        payload = stored_payload(kube_cluster, ns, "secrets", "tokenfair-pool-keys")
        assert payload is not None
        tenants = loads_sidecar_file(payload, "secret").config.tenants
        assert {t.tenant_id: t.api_key_sha256 for t in tenants} == {
            f"tenant-{i:04d}": (hashlib.sha256(f"sk-{i}".encode()).hexdigest(),)
            for i in range(KEYED_QUOTAS)
        }
        pool = get(kube_cluster, policy_path(ns))
        assert pool is not None
        assert pool["status"]["configVersion"] == document.version
        assert not any(q.status for q in api.list_quotas(ns)), "a quota status was written"
        assert len(reconciler.statuses) == KEYED_QUOTAS

        release.set()
        await reconciler.drain()
        written = api.list_quotas(ns)
        assert {q.status.get("configVersion") for q in written} == {document.version}
        assert all(condition({"status": q.status})["status"] == "True" for q in written)
    finally:
        release.set()
        await reconciler.close()
    # A new leader (a cold cache) serves that document from the stored one, reading no key.
    api.key_reads = 0
    restarted = Reconciler(api)
    now_policy = api.get_policy(ns, "pool")  # with the status the first pass wrote
    assert now_policy is not None
    try:
        await restarted.reconcile(key, [now_policy], written, logging.getLogger())
        served = restarted.documents.get(key)
        assert served is not None
        assert served.version == document.version
        assert api.key_reads == 0
    finally:
        await restarted.close()


def test_key_secrets_read_in_bulk_and_as_of_now(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path
) -> None:
    """With the shipped RBAC: key Secrets read pipelined (:meth:`KubeApi.key_hashes_many`) at
    each consistency give what one-by-one reads give, problems included; and a read at
    :meth:`KubeApi.fresh_version` (the resync's: served by the watch cache) sees a change
    made just before, every time. (A local watch cache is never behind, so this cannot tell
    a read at that version from one at ``0``: that the version is sent, and a 504 falls back
    to etcd, is checked on a recording server, ``test_operator_bulk_get.py``.)"""
    ns = kube_namespace
    values = {"good": {"a": "sk-1", "b": " sk-2 "}, "empty": {"k": " "}}
    for name, data in values.items():
        body = {"metadata": {"name": name}, "stringData": data}
        kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", body)
    binary = {"metadata": {"name": "binary"}, "data": {"k": base64.b64encode(b"\xff").decode()}}
    kube_cluster.expect(201, "POST", f"/api/v1/namespaces/{ns}/secrets", binary)
    api = KubeApi(api_client(str(operator_kubeconfig)))
    names = ["good", "empty", "binary", "missing", *(["good"] * 40)]
    secrets = [(ns, name) for name in names]
    one_by_one = [api.key_hashes(ns, name) for name in names]
    digests = tuple(sorted(hashlib.sha256(k.encode()).hexdigest() for k in ("sk-1", "sk-2")))
    assert one_by_one[0] == digests
    assert [getattr(found, "reason", None) for found in one_by_one[:4]] == [
        None, "KeySecretEmpty", "KeySecretInvalid", "KeySecretNotFound",
    ]  # fmt: skip
    version = api.fresh_version(ns, "good")
    assert version.isdigit()
    for consistency in ("0", "", version):
        assert api.key_hashes_many(secrets, consistency) == one_by_one, consistency

    path = f"/api/v1/namespaces/{ns}/secrets/good"
    for round_ in range(20):
        key = f"sk-rotated-{round_}"
        patch = {"stringData": {"a": key, "b": key}}
        kube_cluster.request("PATCH", path, patch, content_type="application/merge-patch+json")
        version = api.fresh_version(ns, "good")
        found = api.key_hashes_many([(ns, "good")], version)
        assert found == [(hashlib.sha256(key.encode()).hexdigest(),)], round_


def quotas_with_status(cluster: KubeCluster, ns: str) -> list[dict[str, Any]] | None:
    items: list[dict[str, Any]] = cluster.expect(
        200, "GET", f"{API}/namespaces/{ns}/tenantquotas"
    ).body["items"]
    done = [item for item in items if item.get("status", {}).get("configVersion")]
    return items if len(done) == QUOTAS else None


def view_policy() -> PolicyView:
    return PolicyView("pool", "ns", "uid-pool", 1, "2026-01-01T00:00:00Z", {})


def view_quota(i: int, keys: int) -> QuotaView:
    spec = quota_spec(i, keys)
    return QuotaView(f"tenant-{i:04d}", "ns", f"uid-{i}", 3, "2026-01-01T00:00:01Z", spec)


def test_a_document_too_large_even_compressed_is_not_published() -> None:
    # 33,000 random digests are ~1.1 MB of entropy: no compression brings them under 1 MiB.
    quotas = [view_quota(i, 64) for i in range(520)]

    rendering = render_config(view_policy(), quotas, {})

    assert rendering.version == ""
    assert rendering.publish_error is not None
    assert str(MAX_OBJECT_DATA_BYTES) in rendering.publish_error
    assert all(v.accepted for v in rendering.verdicts.values())
    status = policy_status(view_policy(), rendering, now="2026-01-01T00:00:02Z")
    published = {c["type"]: c for c in status["conditions"]}["ConfigPublished"]
    assert (published["status"], published["reason"]) == ("False", "DocumentTooLarge")
    one = quota_status(quotas[0], rendering.verdicts[quotas[0].name], rendering, now="t")
    reasons = {c["type"]: c["reason"] for c in one["conditions"]}
    assert reasons["ConfigPublished"] == "DocumentTooLarge"
    assert one["configVersion"] == ""


def test_a_small_document_stays_plain_json() -> None:
    rendering = render_config(view_policy(), [view_quota(i, 1) for i in range(10)], {})

    assert len(rendering.secret_payload) <= COMPRESS_ABOVE_BYTES
    document = json.loads(rendering.secret_payload)
    assert document["version"] == rendering.version
    assert rendering.configmap_payload.decode() == rendering.configmap_data["config.yaml"]


def test_the_sidecar_refuses_a_gzip_bomb_and_corrupt_gzip() -> None:
    bomb = gzip.compress(b"{" + b" " * (MAX_DOCUMENT_BYTES + 1) + b"}")
    with pytest.raises(ConfigError, match=f"at most {MAX_DOCUMENT_BYTES} bytes once decompressed"):
        loads_sidecar_file(bomb, "bomb.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid gzip"):
        loads_sidecar_file(b"\x1f\x8b" + b"\x00" * 20, "bad.yaml")


def test_the_sidecar_refuses_truncated_or_trailing_gzip_and_caps_at_16_mib() -> None:
    assert MAX_DOCUMENT_BYTES == 16 * 1024 * 1024  # the operator publishes <= 1 MiB compressed
    policy = PolicyView("p", "ns", "uid", 1, "2026-01-01T00:00:00Z", {})
    spec = {"policyName": "p", "weight": 1, "burstServiceTokens": 9_000,
            "sustainedServiceTokensPerSecond": 30_000}  # fmt: skip
    quota = QuotaView("a", "ns", "uid-a", 1, "2026-01-01T00:00:01Z", spec)
    rendering = render_config(policy, [quota], {})
    packed = gzip.compress(rendering.secret_payload, mtime=0)
    assert loads_sidecar_file(packed, "whole.json").config.version == rendering.version
    for cut in (len(packed) - 1, len(packed) - 8, 12):  # the trailer, part of it, the data
        with pytest.raises(ConfigError, match=r"cut\.json: invalid gzip: truncated"):
            loads_sidecar_file(packed[:cut], "cut.json")
    for tail in (b"\x00", b"garbage", packed):  # junk, or a second member
        with pytest.raises(ConfigError, match=r"tail\.json: invalid gzip: \d+ byte\(s\) after"):
            loads_sidecar_file(packed + tail, "tail.json")
    at_cap = gzip.compress(b"{" + b" " * (MAX_DOCUMENT_BYTES - 2) + b"}", mtime=0)
    with pytest.raises(ConfigError) as refused:  # exactly the cap: read, then refused as YAML
        loads_sidecar_file(at_cap, "cap.json")
    assert "decompressed" not in str(refused.value)
