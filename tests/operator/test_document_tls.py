"""The document server's transport: TLS from the operator's own CA, audience-bound tokens.

Behaviours under test:

- real TLS over loopback between the real document server (``serve.create_app`` on its TLS
  listener, a certificate from ``certs.issue``) and the sidecar's real long-poll
  (``RemoteFeed``): with the operator's CA bundle the document arrives; with another CA
  nothing does, the feed reports itself unhealthy (so the mounted file takes over) and the
  version it delivered last stays the one it runs;
- a rotation: the server reloads changed files (``ServingTLS.reload``) and new handshakes get
  the new certificate, which a client trusting only the old CA refuses; the sidecar re-reads
  its CA file and follows the new bundle without a restart; a certificate whose key does not
  match (files caught mid-update) is refused and the served one stays whole;
- the two-phase rotation end to end (``CertKeeper`` over an in-memory Secret, its clock
  injected): a sidecar whose CA file holds only the bundle published in the first phase (its
  kubelet never refreshed it) polls without a single failure before, across and after the
  switch of the served leaf, also on a new handshake with the new leaf; the switch is made by
  a new keeper (a restarted operator) from what the first one stored in the Secret;
- the sidecar reads its CA file through the kubelet's atomic ``..data`` symlink swap: a new
  bundle (of several certificates) builds a new context, an unchanged one does not, one that
  is no PEM is a failed poll;
- on the plain port the config route is ``403`` (TLS only) before any token is looked at,
  unless the unsafe setting allows it; ``/metrics`` stays plain;
- the sidecar refuses an ``http://`` URL unless ``$TOKENFAIR_CONFIG_INSECURE_HTTP=true``;
- on the real control plane (``kube``), with the shipped RBAC's token: the TokenReview asks for
  the audience ``tokenfair-config`` (``spec.audiences``): a TokenRequest token for it
  authenticates, one for the API server's own audience or for another audience does not;
- the CA bundle is published into each policy namespace's ConfigMap ``tokenfair.io-ca.crt``,
  owned by its policies; a second round writes nothing, a new bundle or a new policy replaces
  it, a deleted one comes back at the periodic re-read; a replica that does not lead writes
  nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from certs_support import Clock, FakeCluster
from kubecluster import KubeCluster
from kubernetes import config as kube_config
from loopback_support import free_ports
from operator_support import get
from propagation_support import AUDIENCE, audience_token

from tokenfair.config.wire import VERSION_HEADER
from tokenfair.server.config_feed import RemoteFeed, RemoteSource
from tokenfair_operator.certs import RENEW_BEFORE, TRUST_SETTLE, VALIDITY, ServingCerts, issue
from tokenfair_operator.documents import Document, DocumentStore
from tokenfair_operator.metrics import OperatorMetrics
from tokenfair_operator.serve import (
    TokenAuthenticator,
    audience_reviewer,
    create_app,
    start_server,
)
from tokenfair_operator.serving_tls import ServingTLS, TrustPublisher
from tokenfair_operator.views import PolicyView

NOW = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
KEY = ("ns", "pool")
TRUST_CONFIGMAP = "tokenfair.io-ca.crt"


def write_certs(folder: Path, certs: ServingCerts) -> ServingTLS:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tls.crt").write_bytes(certs.cert_pem)
    (folder / "tls.key").write_bytes(certs.key_pem)
    (folder / "ca.crt").write_bytes(certs.ca_pem)
    return ServingTLS(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")


def issued(dns_name: str = "localhost") -> ServingCerts:
    return issue([dns_name], datetime.datetime.now(datetime.UTC))


class Server:
    """The real document server: plain and TLS listeners on loopback."""

    def __init__(self, store: DocumentStore, tls: ServingTLS, plain_config: bool) -> None:
        auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:model")
        self.app = create_app(store, OperatorMetrics(), auth, plain_config=plain_config, tls=tls)
        self.plain_port, self.tls_port = free_ports(2)
        self.tls = tls
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> Server:
        self._before = asyncio.all_tasks()
        self.runner = await start_server(
            self.app, "127.0.0.1", self.plain_port, self.tls_port, self.tls.server
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        # Held long-polls are cancelled by the cleanup; they end within a few loop turns.
        current = asyncio.current_task()
        handlers = [t for t in asyncio.all_tasks() - self._before if t is not current]
        if handlers:
            await asyncio.wait(handlers, timeout=10)

    def url(self, path: str = "/v1/config/ns/pool?source=secret") -> str:
        return f"https://localhost:{self.tls_port}{path}"


@pytest.fixture
def store() -> DocumentStore:
    store = DocumentStore()
    store.publish(KEY, Document("v1", b"one", b"one"))
    return store


@pytest.fixture
async def server(store: DocumentStore, tmp_path: Path) -> AsyncIterator[Server]:
    async with Server(store, write_certs(tmp_path / "server", issued()), False) as running:
        yield running


def feed_for(url: str, tmp_path: Path, ca: bytes, delivered: list[str]) -> RemoteFeed:
    token = tmp_path / "token"
    token.write_text("t")
    ca_file = tmp_path / "sidecar-ca.crt"
    ca_file.write_bytes(ca)
    source = RemoteSource(url, token, ca_file)
    return RemoteFeed(source, lambda body, version, generation: delivered.append(version))


async def until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Await ``check()`` (a bound on a loaded machine, not a speed assertion)."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


async def test_the_sidecar_verifies_the_server_with_the_operators_ca(
    server: Server, store: DocumentStore, tmp_path: Path
) -> None:
    delivered: list[str] = []
    feed = feed_for(server.url(), tmp_path, server.tls.ca_pem, delivered)
    task = asyncio.create_task(feed.run())
    try:
        await until("v1 delivered over TLS", lambda: delivered == ["v1"] and feed.healthy())
        # The sidecar's bundle turns into another CA's (a wrong one). The poll held on the
        # connection verified before still answers (v2); the next handshake fails, the feed
        # goes unhealthy (the file takes over) and delivers nothing more.
        (tmp_path / "sidecar-ca.crt").write_bytes(issued().ca_pem)
        store.publish(KEY, Document("v2", b"two", b"two"))
        await until("the feed unhealthy", lambda: not feed.healthy())
        store.publish(KEY, Document("v3", b"three", b"three"))
        await until("another failed poll", lambda: feed._failures > 1, 60)
        assert delivered == ["v1", "v2"]
        assert feed.version == "v2"  # the last good one stays what it runs
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_wrong_ca_from_the_start_delivers_nothing(
    server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    delivered: list[str] = []
    feed = feed_for(server.url(), tmp_path, issued().ca_pem, delivered)
    task = asyncio.create_task(feed.run())
    try:
        await until("a failed poll", lambda: "certificate verify failed" in caplog.text)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert delivered == []
    assert not feed.healthy()


async def test_a_rotation_is_served_at_once_and_followed_by_the_sidecar(
    server: Server, store: DocumentStore, tmp_path: Path
) -> None:
    old_ca = server.tls.ca_pem
    rotated = issued()
    folder = server.tls.cert.parent
    (folder / "tls.crt").write_bytes(rotated.cert_pem)
    (folder / "tls.key").write_bytes(rotated.key_pem)
    (folder / "ca.crt").write_bytes(rotated.ca_pem + old_ca)  # the bundle after a rotation
    assert server.tls.reload() is True
    assert server.tls.reload() is False  # unchanged files: nothing reloaded

    async def status_with(ca: bytes) -> int:
        context = ssl.create_default_context(cadata=ca.decode())
        async with (
            aiohttp.ClientSession() as session,
            session.get(server.url("/healthz"), ssl=context) as answer,
        ):
            return answer.status

    assert await status_with(rotated.ca_pem) == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await status_with(old_ca)

    # A sidecar holding the old CA fails, then follows its re-projected bundle.
    delivered: list[str] = []
    feed = feed_for(server.url(), tmp_path, old_ca, delivered)
    task = asyncio.create_task(feed.run())
    try:
        await until("the old CA refused", lambda: feed._failures > 0)
        (tmp_path / "sidecar-ca.crt").write_bytes(rotated.ca_pem + old_ca)  # the kubelet
        await until("v1 delivered with the new bundle", lambda: delivered == ["v1"], 60)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.publish(KEY, Document("v2", b"two", b"two"))  # ends the poll the server holds


async def status_with(url: str, ca: bytes) -> int:
    """A fresh client (a new handshake) trusting only ``ca``: the status it gets."""
    context = ssl.create_default_context(cadata=ca.decode())
    async with aiohttp.ClientSession() as session, session.get(url, ssl=context) as answer:
        return answer.status


async def test_a_sidecar_with_the_first_phases_bundle_polls_across_the_switch(
    store: DocumentStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The stored pair has 29 days left: renewal is due. The keeper's clock starts at the
    # machine's time (the TLS below checks dates by it) and then moves only when told.
    clock = Clock(datetime.datetime.now(datetime.UTC))
    old = issue(["localhost"], clock.now - VALIDITY + RENEW_BEFORE - datetime.timedelta(days=1))
    cluster = FakeCluster(["localhost"])
    cluster.store(old.as_secret_data())
    folder = tmp_path / "certs"
    assert (cluster.keeper(folder, clock).ensure() or "").startswith("published the next CA")
    files = cluster.keeper(folder, clock).files
    tls = ServingTLS(files.cert, files.key, files.ca)
    # What the leader copies into the policies' ConfigMaps (`TrustPublisher.publish(tls.ca_pem)`)
    # and the sidecar's kubelet projects once; never refreshed below.
    published = tls.ca_pem
    handshakes: list[str | None] = []
    tls.server.sni_callback = lambda _sock, name, _ctx: handshakes.append(name)
    async with Server(store, tls, False) as server:
        healthz = server.url("/healthz")
        assert await status_with(healthz, old.ca_pem) == 200  # phase 1: the old leaf served
        delivered: list[str] = []
        feed = feed_for(server.url(), tmp_path, published, delivered)
        task = asyncio.create_task(feed.run())
        try:
            await until("v1 delivered", lambda: delivered == ["v1"] and feed.healthy())
            # A restarted operator: a new keeper, only the Secret shared. A second early:
            # nothing; at `settle`: the next leaf, loaded by the document server.
            keeper = cluster.keeper(folder, clock)
            clock.now += TRUST_SETTLE - datetime.timedelta(seconds=1)
            assert keeper.ensure() is None
            assert tls.reload() is False
            clock.now += datetime.timedelta(seconds=1)
            assert (keeper.ensure() or "").startswith("switched to the next certificate")
            assert tls.reload() is True
            # New handshakes get the new leaf: refused with only the old CA (a sidecar whose
            # kubelet had projected only that would fail now: the window closed here).
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await status_with(healthz, old.ca_pem)
            assert await status_with(healthz, published) == 200
            # The sidecar's connection closed by the server once its held poll is answered:
            # its next poll is a new handshake, with the new leaf.
            seen = len(handshakes)
            runner = server.runner
            assert runner is not None
            assert runner.server is not None
            for connection in runner.server.connections:
                connection.close()
            store.publish(KEY, Document("v2", b"two", b"two"))
            await until("v2 delivered", lambda: delivered == ["v1", "v2"])
            await until("a new handshake", lambda: len(handshakes) > seen)
            store.publish(KEY, Document("v3", b"three", b"three"))
            await until("v3 delivered", lambda: delivered == ["v1", "v2", "v3"] and feed.healthy())
            assert (tmp_path / "sidecar-ca.crt").read_bytes() == published  # never refreshed
            failed = [r for r in caplog.records if "long-poll" in r.getMessage()]
            assert [r.getMessage() for r in failed if "failed" in r.getMessage()] == []
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            store.publish(KEY, Document("v4", b"four", b"four"))  # ends the poll held


def project(volume: Path, version: int, bundle: bytes) -> None:
    """What the kubelet does to a projected volume: the files into a new folder, then one
    atomic rename of the ``..data`` symlink (``ca.crt`` points through it)."""
    folder = volume / f"..{version}"
    folder.mkdir(parents=True)
    (folder / "ca.crt").write_bytes(bundle)
    aside = volume / "..data_tmp"
    aside.symlink_to(folder.name)
    os.replace(aside, volume / "..data")
    if not (volume / "ca.crt").is_symlink():
        (volume / "ca.crt").symlink_to("..data/ca.crt")


def test_the_sidecar_follows_the_kubelets_symlink_swap(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    first, second = issued(), issued()
    project(volume, 1, first.ca_pem)
    source = RemoteSource(
        "https://localhost:1/v1/config/ns/pool", tmp_path / "t", volume / "ca.crt"
    )
    feed = RemoteFeed(source, lambda body, version, generation: None)
    before = feed._ssl()
    assert isinstance(before, ssl.SSLContext)
    assert feed._ssl() is before  # unchanged: the same context (its connections reused)
    project(volume, 2, first.ca_pem + second.ca_pem)  # a bundle of two CAs
    after = feed._ssl()
    assert isinstance(after, ssl.SSLContext)
    assert after is not before
    assert len(after.get_ca_certs()) == 2
    project(volume, 3, b"not a bundle")
    with pytest.raises(RuntimeError, match="not a PEM CA bundle"):
        feed._ssl()


async def test_files_that_do_not_match_leave_the_served_certificate(
    server: Server, tmp_path: Path
) -> None:
    other = issued()
    (server.tls.cert.parent / "tls.crt").write_bytes(other.cert_pem)  # its key not written yet
    with pytest.raises(ssl.SSLError):
        server.tls.reload()
    context = ssl.create_default_context(cadata=server.tls.ca_pem.decode())
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.url("/healthz"), ssl=context) as answer,
    ):
        assert answer.status == 200  # still the old certificate, whole


async def test_the_plain_port_serves_no_document(server: Server, tmp_path: Path) -> None:
    headers = {"Authorization": "Bearer t"}
    plain = f"http://127.0.0.1:{server.plain_port}"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{plain}/v1/config/ns/pool", headers=headers) as answer:
            assert answer.status == 403
            assert "served over TLS only" in await answer.text()
        async with session.get(f"{plain}/metrics") as answer:
            assert answer.status == 200
        context = ssl.create_default_context(cadata=server.tls.ca_pem.decode())
        url = server.url("/v1/config/ns/pool?waitSeconds=0")
        async with session.get(url, headers=headers, ssl=context) as answer:
            assert (answer.status, answer.headers[VERSION_HEADER]) == (200, "v1")


async def test_the_unsafe_setting_serves_plain_http(store: DocumentStore, tmp_path: Path) -> None:
    async with Server(store, write_certs(tmp_path, issued()), True) as unsafe:
        url = f"http://127.0.0.1:{unsafe.plain_port}/v1/config/ns/pool?waitSeconds=0"
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, headers={"Authorization": "Bearer t"}) as answer,
        ):
            assert answer.status == 200


def test_the_sidecar_refuses_plain_http_unless_told(tmp_path: Path) -> None:
    url = "http://op.tf.svc:8081/v1/config/ns/pool"
    with pytest.raises(ValueError, match="must be an https:// URL"):
        RemoteSource.from_env({"TOKENFAIR_CONFIG_URL": url})
    unsafe = RemoteSource.from_env(
        {"TOKENFAIR_CONFIG_URL": url, "TOKENFAIR_CONFIG_INSECURE_HTTP": "true"}
    )
    assert unsafe is not None
    assert unsafe.ca_file is None
    tls = RemoteSource.from_env(
        {
            "TOKENFAIR_CONFIG_URL": "https://op.tf.svc:8443/v1/config/ns/pool",
            "TOKENFAIR_CONFIG_CA_FILE": "/var/run/secrets/tokenfair/ca.crt",
            "TOKENFAIR_CONFIG_TOKEN_FILE": "/var/run/secrets/tokenfair/token",
        }
    )
    assert tls is not None
    assert tls.ca_file == Path("/var/run/secrets/tokenfair/ca.crt")


def operator_api(kubeconfig: Path) -> Any:
    """A client with the shipped RBAC's token (no process-wide default touched)."""
    return kube_config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]


def test_the_token_review_asks_for_the_audience(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path
) -> None:
    ns = kube_namespace
    kube_cluster.create_service_account(ns, "model")
    api = operator_api(operator_kubeconfig)
    review = audience_reviewer(api, AUDIENCE)
    expected = f"system:serviceaccount:{ns}:model"
    assert review(audience_token(kube_cluster, ns, "model")) == expected
    assert review(audience_token(kube_cluster, ns, "model", [])) is None  # the API server's
    assert review(audience_token(kube_cluster, ns, "model", ["vault"])) is None
    both = audience_token(kube_cluster, ns, "model", ["vault", AUDIENCE])
    assert review(both) == expected
    assert review("not-a-token") is None


def policy(cluster: KubeCluster, ns: str, name: str) -> PolicyView:
    body = {
        "apiVersion": "tokenfair.io/v1alpha1",
        "kind": "SchedulingPolicy",
        "metadata": {"name": name},
        "spec": {},
    }
    path = f"/apis/tokenfair.io/v1alpha1/namespaces/{ns}/schedulingpolicies"
    return PolicyView.from_body(cluster.expect(201, "POST", path, body).body)


def test_the_ca_is_published_to_the_policies_namespaces(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path
) -> None:
    ns = kube_namespace
    api = operator_api(operator_kubeconfig)
    first = policy(kube_cluster, ns, "pool")
    publisher = TrustPublisher(api)
    leads = True

    def may_write() -> bool:
        return leads

    bundle = issued().ca_pem
    assert publisher.publish(bundle, {ns: [first]}, may_write) == [ns]
    path = f"/api/v1/namespaces/{ns}/configmaps/{TRUST_CONFIGMAP}"
    stored: dict[str, Any] | None = get(kube_cluster, path)
    assert stored is not None
    assert stored["data"] == {"ca.crt": bundle.decode()}
    assert [o["uid"] for o in stored["metadata"]["ownerReferences"]] == [first.uid]
    assert publisher.publish(bundle, {ns: [first]}, may_write) == []  # remembered: no call
    publisher.forget()
    assert publisher.publish(bundle, {ns: [first]}, may_write) == []  # read, found in line

    rotated = issued().ca_pem + bundle
    second = policy(kube_cluster, ns, "other")
    assert publisher.publish(rotated, {ns: [first, second]}, may_write) == [ns]
    stored = get(kube_cluster, path)
    assert stored is not None
    assert stored["data"]["ca.crt"] == rotated.decode()
    owners = sorted(o["uid"] for o in stored["metadata"]["ownerReferences"])
    assert owners == sorted([first.uid, second.uid])

    # Deleted by someone: back at the next periodic re-read (every `recheck_rounds`).
    kube_cluster.expect(200, "DELETE", path)
    rechecking = TrustPublisher(api, recheck_rounds=2)
    assert rechecking.publish(rotated, {ns: [first, second]}, may_write) == [ns]
    kube_cluster.expect(200, "DELETE", path)
    assert rechecking.publish(rotated, {ns: [first, second]}, may_write) == [ns]  # 2nd: re-read
    assert get(kube_cluster, path) is not None

    leads = False  # a standby (or a leader that stepped down) writes nothing
    assert publisher.publish(issued().ca_pem, {ns: [first, second]}, may_write) == []
    stored = get(kube_cluster, path)
    assert stored is not None
    assert stored["data"]["ca.crt"] == rotated.decode()
