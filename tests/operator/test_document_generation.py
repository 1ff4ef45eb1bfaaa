"""Config documents carry a monotonic generation; nothing takes a sidecar back to a lower one.

Behaviours under test:

- the next generation is one more than the highest the policy's objects hold, unless one
  already holds this very version (a pass that failed half-way keeps its number);
- the operator's store ignores a document of a lower generation than the one it holds, and
  ``clear()`` (this replica stepped down) ends every held long-poll at once; the document
  server sends the generation header and a standby relays it; a replica that stepped down
  while a long-poll waited does not answer it from its store (leadership is asked again right
  before answering);
- over real HTTP on loopback, the operator's own document server feeding a sidecar's real
  long-poll and file watcher: a newer generation applies; a replica serving its previous
  term's document (lower generation) is refused through ``refuse`` (the sidecar's
  ``refuse_config``: a log line and ``tokenfair_config_reloads_total{result="invalid"}``), and
  the config stays; when the long-poll fails, an older mounted file
  (generation file beside ``config.yaml``) is refused too, a newer one applies; a file whose
  generation changes while it is read (the kubelet swapping the volume) waits for the next
  tick; a standalone file without a generation applies as before;
- on the real control plane: ``KubeApi.publish_document`` numbers documents 1, 2, … in the
  ConfigMap's and Secret's annotation and ``generation`` key, keeps the number of an
  unchanged document, and a second ``KubeApi`` (a new leader, nothing in memory) continues
  from the published number.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubecluster import KubeCluster
from operator_support import api_client_for, create_policy
from sidecar_support import keyed_config

from tokenfair.config import config_to_document
from tokenfair.config.wire import GENERATION_HEADER
from tokenfair.server.config_feed import RemoteFeed, RemoteSource
from tokenfair.server.reload import ConfigWatcher
from tokenfair.server.runtime_settings import LoadedFile
from tokenfair_operator.documents import (
    Document,
    DocumentStore,
    next_generation,
    parse_generation,
)
from tokenfair_operator.kube import KubeApi
from tokenfair_operator.metrics import OperatorMetrics
from tokenfair_operator.serve import TokenAuthenticator, create_app
from tokenfair_operator.views import PolicyView

KEY = ("ns", "pool")


def document(version: str) -> bytes:
    return json.dumps({**config_to_document(keyed_config()), "version": version}).encode()


def test_next_generation() -> None:
    assert next_generation("v1", [(None, 0), (None, 0)]) == 1  # nothing published yet
    assert next_generation("v2", [("v1", 1), ("v1", 1)]) == 2
    assert next_generation("v2", [("v2", 4), ("v1", 3)]) == 4  # the ConfigMap has it already
    assert next_generation("v1", [("v2", 4), ("v2", 4)]) == 5  # back to old content: newer
    assert next_generation("v3", [("v2", 4), (None, 0)]) == 5  # a Secret deleted by hand
    # The clock's floor: objects made again (nothing to continue from) start above any
    # generation published before them; with something to continue from it changes nothing.
    now_ms = 1_767_225_600_000
    assert next_generation("v9", [(None, 0), (None, 0)], floor=now_ms) == now_ms
    assert next_generation("v9", [("v8", now_ms), ("v8", now_ms)], floor=now_ms) == now_ms + 1
    assert next_generation("v8", [("v8", 7), (None, 0)], floor=now_ms) == 7  # the same document
    # A number edited far ahead of the clock is not continued from; nor one the sidecar refuses.
    forged = now_ms + 2 * 86_400_000
    assert next_generation("v9", [("v8", forged), (None, 0)], floor=now_ms) == now_ms
    assert parse_generation("1" * 19) == 0
    assert parse_generation("\u00b2") == 0
    assert parse_generation(" 42 ") == 42


async def test_the_store_never_goes_back_and_clear_ends_waits_at_once() -> None:
    store = DocumentStore()
    assert store.publish(KEY, Document("v2", b"2", b"2", 2))
    assert not store.publish(KEY, Document("v1", b"1", b"1", 1))
    current = store.get(KEY)
    assert current is not None
    assert current.version == "v2"
    waiter = asyncio.create_task(store.newer(KEY, "v2", 60))
    await asyncio.sleep(0)
    store.clear()
    assert await asyncio.wait_for(waiter, 5) is None  # not after its 60 s
    assert store.get(KEY) is None
    assert store.publish(KEY, Document("v1", b"1", b"1", 1))  # a new term starts afresh


async def test_the_server_sends_the_generation_and_a_standby_relays_it(
    aiohttp_client: Any,
) -> None:
    store = DocumentStore()
    store.publish(KEY, Document("v3", b"three", b"three", 3))
    auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:default")
    leader = await aiohttp_client(create_app(store, OperatorMetrics(), auth))
    standby_auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:default")
    address = f"{leader.host}:{leader.port}"
    standby = await aiohttp_client(
        create_app(DocumentStore(), OperatorMetrics(), standby_auth, lambda: address)
    )
    for http in (leader, standby):
        answer = await http.get(
            "/v1/config/ns/pool?waitSeconds=0", headers={"Authorization": "Bearer t"}
        )
        assert answer.status == 200
        assert answer.headers[GENERATION_HEADER] == "3"
        assert await answer.read() == b"three"


async def test_a_replica_that_stepped_down_while_a_poll_waited_does_not_answer_it(
    aiohttp_client: Any,
) -> None:
    store = DocumentStore()
    store.publish(KEY, Document("v1", b"one", b"one", 1))
    leader: list[str | None] = [None]  # None: this replica leads
    auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:default")
    http = await aiohttp_client(create_app(store, OperatorMetrics(), auth, lambda: leader[0]))
    headers = {"Authorization": "Bearer t"}
    poll = asyncio.create_task(
        http.get("/v1/config/ns/pool?version=v1&waitSeconds=60", headers=headers)
    )
    await _until("the poll to wait", lambda: store._waiters.get(KEY) == 1)
    leader[0] = ""  # stepped down, no new leader known yet ...
    store.publish(KEY, Document("v2", b"two", b"two", 2))  # ... and a late pass publishes
    answer = await asyncio.wait_for(poll, 30)
    assert answer.status == 503  # asked again right before answering: not this replica's
    assert b"no leader known" in await answer.read()


async def _until(what: str, probe: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async def poll() -> None:
        while not probe():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


def write_mounted(folder: Path, version: str, generation: int | None) -> Path:
    """``config.yaml`` (and ``generation`` beside it) as a mounted volume shows them."""
    path = folder / "config.yaml"
    path.write_bytes(document(version))
    if generation is not None:
        (folder / "generation").write_text(str(generation))
    return path


async def test_the_sidecar_refuses_an_older_generation_from_the_long_poll_and_the_file(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    store = DocumentStore()
    store.publish(KEY, Document("v7", document("v7"), document("v7"), 7))
    auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:default")
    server = await aiohttp_server(create_app(store, OperatorMetrics(), auth))
    path = write_mounted(tmp_path, "v5", 5)  # what the Pod started from
    token = tmp_path / "token"
    token.write_text("t")
    applied: list[str] = []
    refused: list[str] = []

    def apply(loaded: LoadedFile) -> None:
        applied.append(loaded.config.version)

    started_sha = hashlib.sha256(path.read_bytes()).hexdigest()
    watcher = ConfigWatcher(path, started_sha, apply, refused.append, lambda m: None)
    assert watcher.generation == 5
    url = f"http://{server.host}:{server.port}/v1/config/ns/pool?source=secret"
    feed = RemoteFeed(RemoteSource(url, token), lambda data, v, g: watcher.offer(data, url, g))
    watcher.defer = feed.healthy
    task = asyncio.create_task(feed.run())
    try:
        await _until("generation 7 from the long-poll", lambda: applied == ["v7"])
        assert watcher.generation == 7
        # The kubelet refreshes the volume to generation 6 meanwhile (its ~60 s lag); the
        # file waits while the long-poll answers.
        write_mounted(tmp_path, "v6", 6)
        watcher.tick()
        assert applied == ["v7"]

        # A replica elected again serving its previous term's document: never applied.
        store.clear()
        store.publish(KEY, Document("v5", document("v5"), document("v5"), 5))
        await _until("the stale document refused", lambda: bool(refused))
        assert "generation 5 is older than the running generation 7" in refused[-1]
        assert applied == ["v7"]

        # The operator stops answering (404): the feed fails, the file is the fallback, and
        # the file is older (generation 6): refused as well.
        store.clear()
        await _until("the long-poll to fail", lambda: not feed.healthy())
        watcher.tick()
        assert applied == ["v7"]
        assert refused[-1].startswith(f"{path}: generation 6 is older")
        watcher.tick()  # refused once, not on every tick
        assert len([r for r in refused if r.startswith(str(path))]) == 1

        # The kubelet brings a newer document: applied from the file.
        write_mounted(tmp_path, "v8", 8)
        watcher.tick()
        assert applied == ["v7", "v8"]
        assert watcher.generation == 8
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_file_swapped_while_read_waits_for_the_next_tick(tmp_path: Path) -> None:
    path = write_mounted(tmp_path, "v1", 1)
    applied: list[str] = []
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    watcher = ConfigWatcher(path, sha, lambda f: applied.append(f.config.version), print, print)
    write_mounted(tmp_path, "v2", 2)
    real = watcher._file_generation
    reads = iter([1, 2])  # before and after the config: the volume was swapped in between
    watcher._file_generation = lambda: next(reads)  # type: ignore[method-assign]
    watcher.tick()
    assert applied == []
    watcher._file_generation = real  # type: ignore[method-assign]
    watcher.tick()
    assert applied == ["v2"]


def test_a_standalone_file_without_a_generation_reloads_as_before(tmp_path: Path) -> None:
    path = write_mounted(tmp_path, "v1", None)
    applied: list[str] = []
    refused: list[str] = []
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    watcher = ConfigWatcher(
        path, sha, lambda f: applied.append(f.config.version), refused.append, print
    )
    assert watcher.generation == 0
    write_mounted(tmp_path, "v2", None)
    watcher.tick()
    assert applied == ["v2"]
    assert refused == []


async def test_generations_are_kept_in_the_api_and_a_new_leader_continues(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    api = api_client_for(kube_cluster)
    try:
        policy = PolicyView.from_body(create_policy(kube_cluster, kube_namespace, "pool"))
        first = KubeApi(api)
        publish = first.publish_document
        before_ms = time.time_ns() // 1_000_000
        g1, written = await asyncio.to_thread(publish, policy, "v1", b"one", b"one")
        assert written == ["ConfigMap", "Secret"]
        assert g1 >= before_ms  # the clock's floor: nothing to continue from yet
        assert await asyncio.to_thread(publish, policy, "v1", b"one", b"one") == (g1, [])
        g2 = (await asyncio.to_thread(publish, policy, "v2", b"two", b"two"))[0]
        assert g2 > g1
        # A new leader: a fresh KubeApi, nothing remembered, continues from the API's number.
        second = KubeApi(api)
        g3, written = await asyncio.to_thread(second.publish_document, policy, "v1", b"one", b"one")
        assert written == ["ConfigMap", "Secret"]
        assert g3 > g2
        base = f"/api/v1/namespaces/{kube_namespace}"
        cm = kube_cluster.request("GET", f"{base}/configmaps/tokenfair-pool").body
        secret = kube_cluster.request("GET", f"{base}/secrets/tokenfair-pool-keys").body
        assert cm["metadata"]["annotations"]["tokenfair.io/config-generation"] == str(g3)
        assert cm["data"]["generation"] == str(g3)
        assert base64.b64decode(secret["data"]["generation"]) == str(g3).encode()
        assert secret["metadata"]["annotations"]["tokenfair.io/config-generation"] == str(g3)
        # Both objects deleted (as when the policy is deleted and created again): the next
        # document still goes above every generation its sidecars may run, not back to 1.
        kube_cluster.request("DELETE", f"{base}/configmaps/tokenfair-pool")
        kube_cluster.request("DELETE", f"{base}/secrets/tokenfair-pool-keys")
        g4, written = await asyncio.to_thread(publish, policy, "v4", b"four", b"four")
        assert written == ["ConfigMap", "Secret"]
        assert g4 > g3
    finally:
        api.close()
