"""The long-poll's edges without a cluster: the standby's relay, the sidecar's feed, the store.

* a standby relays the leader's version header whatever its spelling (HTTP/2 and proxies
  lowercase header names), in the canonical one;
* the sidecar's feed treats a ``200`` without a version header as a failed poll (backoff, no
  delivery), not as version ``""`` (asked again at once, forever);
* polls for policies never published leave no ``asyncio.Event`` behind once they end (timed
  out, woken or cancelled), and a wake still reaches every waiter;
* a standby relays more than 100 long-polls at once (aiohttp's default connector limit):
  150 held at the leader together, each answered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tokenfair.config.wire import VERSION_HEADER
from tokenfair.server.config_feed import RemoteFeed, RemoteSource
from tokenfair_operator.documents import Document, DocumentStore
from tokenfair_operator.metrics import OperatorMetrics
from tokenfair_operator.serve import (
    DEFAULT_RELAY_CONNECTIONS,
    TokenAuthenticator,
    create_app,
)

pytestmark = pytest.mark.virtual_time


def leader_app(headers: dict[str, str], hits: list[str]) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        hits.append(request.query.get("version", ""))
        return web.Response(body=b"{}", headers=headers)

    app = web.Application()
    app.router.add_get("/v1/config/{namespace}/{policy}", answer)
    return app


def standby_app(leader: str) -> web.Application:
    auth = TokenAuthenticator(lambda token: "system:serviceaccount:ns:default")
    return create_app(DocumentStore(), OperatorMetrics(), auth, leader=lambda: leader)


async def test_the_standby_relays_a_lowercased_version_header(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    hits: list[str] = []
    leader = await aiohttp_server(leader_app({"x-tokenfair-config-version": "v1"}, hits))
    standby = await aiohttp_client(standby_app(f"{leader.host}:{leader.port}"))
    answer = await standby.get(
        "/v1/config/ns/p?source=secret&waitSeconds=0", headers={"Authorization": "Bearer t"}
    )
    assert answer.status == 200
    assert answer.headers.get(VERSION_HEADER) == "v1"
    assert (VERSION_HEADER.encode(), b"v1") in answer.raw_headers  # the canonical spelling
    assert await answer.read() == b"{}"
    assert hits == [""]


async def test_a_200_without_a_version_is_a_failed_poll_with_backoff(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    hits: list[str] = []
    server = await aiohttp_server(leader_app({}, hits))
    token = tmp_path / "token"
    token.write_text("t")
    delivered: list[str] = []
    source = RemoteSource(f"http://{server.host}:{server.port}/v1/config/ns/p?source=secret", token)
    feed = RemoteFeed(source, lambda body, version, generation: delivered.append(version))
    task = asyncio.create_task(feed.run())
    try:
        await asyncio.sleep(0.5)  # the first backoff is 2 s: one request, no hot loop
    finally:
        task.cancel()
    assert len(hits) == 1, len(hits)
    assert delivered == []
    assert feed.version == ""
    assert not feed.healthy()


async def test_polls_for_unknown_policies_leave_no_event_behind() -> None:
    store = DocumentStore()
    await asyncio.gather(*(store.newer(("ns", f"nope-{i}"), "", 0.01) for i in range(1_000)))
    assert store._changed == {}
    assert store._waiters == {}
    # A cancelled poll leaves nothing either.
    waiter = asyncio.create_task(store.newer(("ns", "gone"), "", 30))
    await asyncio.sleep(0.01)
    assert ("ns", "gone") in store._changed
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert store._changed == {}
    assert store._waiters == {}


async def test_a_publish_still_wakes_every_waiter_and_leaves_no_event() -> None:
    store = DocumentStore()
    key = ("ns", "p")
    store.publish(key, Document("v1", b"a", b"a"))
    waiters = [asyncio.create_task(store.newer(key, "v1", 5)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert store._waiters == {key: 3}
    store.publish(key, Document("v2", b"b", b"b"))
    woken = await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert [document.version for document in woken if document is not None] == ["v2"] * 3
    assert store._changed == {}
    assert store._waiters == {}
    # A waiter of the next generation, arriving while others of the last one leave.
    late = asyncio.create_task(store.newer(key, "v2", 0.05))
    assert await late is None
    assert store._changed == {}
    assert store._waiters == {}


@pytest.mark.wall_time  # 150 connects at once: the kernel retries a dropped SYN in real time
async def test_the_standby_relays_more_than_100_long_polls_at_once(
    aiohttp_server: Any, aiohttp_client: Any
) -> None:
    polls = 150
    assert polls <= DEFAULT_RELAY_CONNECTIONS
    held = 0
    all_held = asyncio.Event()

    async def hold(request: web.Request) -> web.Response:
        # Answers only once every poll is held here at once: with a relay limited to 100
        # connections the 101st never arrives and none is answered.
        nonlocal held
        held += 1
        if held == polls:
            all_held.set()
        await asyncio.wait_for(all_held.wait(), 60)
        return web.Response(body=b"{}", headers={VERSION_HEADER: "v1"})

    app = web.Application()
    app.router.add_get("/v1/config/{namespace}/{policy}", hold)
    leader = await aiohttp_server(app)
    # The sidecars' side: unlimited, so only the relay's own limit is under test.
    unlimited = aiohttp.TCPConnector(limit=0)
    standby = await aiohttp_client(standby_app(f"{leader.host}:{leader.port}"), connector=unlimited)
    answers = await asyncio.gather(
        *(
            standby.get("/v1/config/ns/p?waitSeconds=30", headers={"Authorization": "Bearer t"})
            for _ in range(polls)
        )
    )
    assert [answer.status for answer in answers] == [200] * polls
    assert held == polls
    for answer in answers:
        answer.release()
