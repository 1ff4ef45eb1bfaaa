"""The operator run as the chart's Deployment runs it, over thousands of TenantQuotas: for the
process test (``tests/operator/test_operator_run_scale.py``) and the bench
(``bench/bench_operator_run.py``).

- :func:`chart_operator`: the chart's operator container (``helm template`` of the default
  values: ``kopf run -m tokenfair_operator.handlers --standalone --all-namespaces``, leader
  election on the Lease ``tokenfair-operator``, resync 30 s, usage 15 s, its sidecar defaults)
  as a local child process, with the given kubeconfig, its HTTP and health ports on loopback;
- :func:`create_world`: a policy, key Secrets and quotas created through the API, in parallel
  (what ``kubectl apply`` of a folder does, faster);
- :class:`DocumentRecorder`: every document the API server stores in the policy's ConfigMap, as
  its watch delivers them (none is missed, however short-lived), with its tenant count.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import gzip
import http.client
import itertools
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chart_support import container, local_command, parse, render
from kubecluster import KubeCluster, stop_process
from loopback_support import free_ports

API = "/apis/tokenfair.io/v1alpha1"
POLICY = "pool"
CONFIGMAP = f"tokenfair-{POLICY}"
CREATE_THREADS = 16
"""Parallel creations: ~300-500 objects a second on the 2-core test machine."""


def chart_operator_command(
    kubeconfig: Path, lease_namespace: str, pod_name: str, **env: str
) -> tuple[list[str], dict[str, str]]:
    """The chart's operator container (default values, release ``tokenfair`` in
    ``lease_namespace``) as a local command and environment: its liveness and HTTP ports on
    free loopback ports, ``kubeconfig``'s credentials, ``pod_name`` as the Pod's name (the Lease
    identity); ``env`` overrides the chart's variables."""
    docs = parse(render(4, (), namespace=lease_namespace))
    spec = container(docs, "Deployment", "operator")
    health_port, http_port = free_ports(2)
    command = local_command(spec, {"0.0.0.0:8080": f"127.0.0.1:{health_port}"})
    chart_env = {item["name"]: str(item["value"]) for item in spec["env"]}
    full_env = {
        **os.environ,
        **chart_env,
        "KUBECONFIG": str(kubeconfig),
        "TOKENFAIR_POD_NAME": pod_name,
        "TOKENFAIR_HTTP_ADDR": "127.0.0.1",
        "TOKENFAIR_HTTP_PORT": str(http_port),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        **env,
    }
    return command, full_env


@contextlib.contextmanager
def chart_operator(
    kubeconfig: Path, lease_namespace: str, log_path: Path, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`chart_operator_command` running (its own process group, output in
    ``log_path``) until the block ends; then stopped (SIGTERM: it releases the Lease)."""
    command, full_env = chart_operator_command(kubeconfig, lease_namespace, "op-0", **env)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop_process(proc)


def quota_spec(i: int, keyed: bool) -> dict[str, Any]:
    """Quota ``i`` of policy :data:`POLICY`: its key in Secret ``key-<i>`` when ``keyed``."""
    spec: dict[str, Any] = {
        "policyName": POLICY,
        "weight": 1.0 + i % 4,
        "burstServiceTokens": 200_000,
        "sustainedServiceTokensPerSecond": 5_000.0,
        "priorityClass": "batch" if i % 2 else "interactive",
    }
    if keyed:
        spec["apiKeySecretRef"] = {"name": f"key-{i:05d}"}
    return spec


def create_policy(cluster: KubeCluster, ns: str) -> None:
    body: dict[str, Any] = {"apiVersion": "tokenfair.io/v1alpha1", "kind": "SchedulingPolicy"}
    body |= {"metadata": {"name": POLICY}, "spec": {}}
    cluster.expect(201, "POST", f"{API}/namespaces/{ns}/schedulingpolicies", body)


def create_in_parallel(cluster: KubeCluster, calls: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """POST each ``(path, body)`` of ``calls`` (201 expected) as the admin,
    :data:`CREATE_THREADS` at once, each thread over one keep-alive connection (as kubectl: a
    TLS handshake per object would cost the machine more than the API server's work)."""
    local = threading.local()
    opened: list[http.client.HTTPSConnection] = []
    url = urllib.parse.urlsplit(cluster.server)
    context = ssl.create_default_context(cafile=str(cluster.ca_file))
    headers = {
        "Authorization": f"Bearer {cluster.admin_token}",
        "Content-Type": "application/json",
        "Accept": "application/json",
    }

    def create(call: tuple[str, dict[str, Any]]) -> None:
        path, body = call
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = local.connection = http.client.HTTPSConnection(
                    url.hostname or "127.0.0.1", url.port, context=context, timeout=60
                )
                opened.append(connection)
            try:
                connection.request("POST", path, data, headers)
                answer = connection.getresponse()
                raw = answer.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                local.connection = None
                if attempt == 2:
                    raise
                continue
            assert answer.status == 201, f"POST {path}: {answer.status} {raw[:300]!r}"
            return

    pool = concurrent.futures.ThreadPoolExecutor(CREATE_THREADS)
    try:
        list(pool.map(create, calls))
    finally:  # interrupted: the calls not started yet are dropped, not made
        pool.shutdown(wait=True, cancel_futures=True)
        for connection in opened:
            connection.close()


def key_secrets(ns: str, count: int) -> list[tuple[str, dict[str, Any]]]:
    """Creations of Secrets ``key-<i>`` holding one API key each."""
    return [
        (
            f"/api/v1/namespaces/{ns}/secrets",
            {"metadata": {"name": f"key-{i:05d}"}, "stringData": {"k": f"sk-{ns}-{i}"}},
        )
        for i in range(count)
    ]


def quotas(ns: str, count: int, keyed: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """Creations of TenantQuotas ``tenant-<i>`` of policy :data:`POLICY`."""
    kind = {"apiVersion": "tokenfair.io/v1alpha1", "kind": "TenantQuota"}
    return [
        (
            f"{API}/namespaces/{ns}/tenantquotas",
            kind | {"metadata": {"name": f"tenant-{i:05d}"}, "spec": quota_spec(i, keyed)},
        )
        for i in range(count)
    ]


@dataclass(frozen=True)
class Published:
    """One document the API server stored in the ConfigMap."""

    at_s: float
    """When the watch delivered it (``time.monotonic()``)."""
    version: str
    tenants: int


def document_of(configmap: Mapping[str, Any]) -> dict[str, Any]:
    """The config document of a policy's ConfigMap (plain in ``data``, or gzip in
    ``binaryData``), parsed."""
    if "config.yaml" in configmap.get("data", {}):
        raw = str(configmap["data"]["config.yaml"]).encode()
    else:
        raw = gzip.decompress(base64.b64decode(configmap["binaryData"]["config.yaml"]))
    document: dict[str, Any] = json.loads(raw)
    return document


class DocumentRecorder:
    """Records every document stored in ConfigMap ``ns/tokenfair-pool`` from now on (and the
    one stored already), as delivered by a watch of the API server in a thread of its own; a
    watch that ends is resumed from the last resourceVersion, so no version is missed."""

    WATCH_S = 5
    """Each watch call's server-side timeout: how long :meth:`stop` may take."""

    def __init__(self, cluster: KubeCluster, ns: str) -> None:
        self._cluster = cluster
        self._path = f"/api/v1/namespaces/{ns}/configmaps?fieldSelector=metadata.name%3D{CONFIGMAP}"
        self.documents: list[Published] = []
        self.errors: list[str] = []
        """ERROR events (e.g. 410 Gone): the watch stopped there, a document may be missed."""
        self.reconnects = 0
        """Watches that broke off (resumed from the last resourceVersion: nothing missed)."""
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="document-recorder", daemon=True)

    def __enter__(self) -> DocumentRecorder:
        listing = self._cluster.expect(200, "GET", self._path).body
        for item in listing.get("items", []):
            self._record(item)
        self._version = str(listing["metadata"]["resourceVersion"])
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(self.WATCH_S + 15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self._cluster.watch(
                    self._path, resource_version=self._version, timeout_seconds=self.WATCH_S
                ):
                    obj = event.get("object", {})
                    if event.get("type") == "ERROR":
                        self.errors.append(json.dumps(obj)[:500])
                        self._stop.set()
                        break
                    self._version = str(obj.get("metadata", {}).get("resourceVersion", ""))
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._record(obj)
            except OSError:  # a dropped watch: resume from the last version
                self.reconnects += 1
                time.sleep(0.5)

    def _record(self, configmap: Mapping[str, Any]) -> None:
        document = document_of(configmap)
        version = str(document.get("version", ""))
        if version in self._seen:  # an owners-only rewrite, not a new document
            return
        self._seen.add(version)
        found = Published(time.monotonic(), version, len(document.get("tenants", [])))
        with self._changed:
            self.documents.append(found)
            self._changed.notify_all()

    def wait(self, predicate: Callable[[list[Published]], bool], timeout_s: float) -> bool:
        """Block until ``predicate(documents)`` holds (True) or ``timeout_s`` passed (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self.documents), timeout_s)

    def tenant_counts(self) -> list[int]:
        with self._changed:
            return [d.tenants for d in self.documents]


def never_fewer(counts: Sequence[int]) -> bool:
    """No document held fewer tenants than the one before it."""
    return all(later >= earlier for earlier, later in itertools.pairwise(counts))
