"""Leader election when the API server hangs, and TokenReviews that cannot delay it.

Behaviours under test, on the real control plane (the electors in this process, each with a
clock of its own that the test moves: no assertion waits on wall time):

- a leader whose renewal hangs (its API connection frozen by a proxy: the request is sent and
  never answered) stops leading on its own monotonic clock at the renew deadline, while the
  call is still unanswered, and never relays to itself; the standby takes the Lease over only
  after the lease duration on its clock; at no step do both lead; when the frozen call finally
  answers, the old leader sees the new holder and stays a standby;
- every Lease call carries a request timeout under the renew deadline: a frozen connection
  fails the round instead of holding the Lease's thread; a failed round costs no leadership
  before the deadline, and the deadline costs it without any answer;
- writers ask right before writing: a ``KubeApi`` whose elector no longer leads refuses to
  publish or patch a status (``NotLeader``) and writes nothing;
- a flood of junk tokens (every review thread stuck on a hung TokenReview, the rest over the
  rate limit) and a saturated default executor do not delay a renewal: it runs on the
  Lease's own thread.

Without a cluster: the TokenReview limiter on an injected clock — one review per token however
many requests show it at once, refused tokens remembered (bounded, with a TTL) apart from the
accepted ones, a bucket of new reviews (``429`` with ``Retry-After`` over HTTP) that an
accepted token's re-check does not draw on, a failed review a ``503``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubecluster import KubeCluster
from operator_support import api_client_for, create_policy

from tokenfair_operator.documents import DocumentStore
from tokenfair_operator.kube import KubeApi, NotLeader
from tokenfair_operator.leader import (
    LEASE_DURATION_S,
    RENEW_DEADLINE_S,
    REQUEST_TIMEOUT_S,
    LeaderElector,
)
from tokenfair_operator.metrics import OperatorMetrics
from tokenfair_operator.serve import (
    REJECTED_TTL_S,
    REVIEW_THREADS,
    REVIEW_TTL_S,
    ReviewUnavailable,
    TokenAuthenticator,
    create_app,
)
from tokenfair_operator.views import PolicyView

LEASE = "tokenfair-test"


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FreezableProxy:
    """A TCP proxy to the API server that can stop forwarding (bytes are read and held, as
    by a hung server): requests through it are sent and never answered until :meth:`thaw`."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.holding = asyncio.Event()
        """Set once bytes are held while frozen (a request is in flight and stuck)."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"https://127.0.0.1:{port}"

    def freeze(self) -> None:
        self.holding.clear()
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        self.thaw()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            pipes = [
                asyncio.create_task(self._pipe(reader, up_writer)),
                asyncio.create_task(self._pipe(up_reader, writer)),
            ]
            try:
                await asyncio.gather(*pipes, return_exceptions=True)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            writer.close()
            self.tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.flowing.is_set():
                    self.holding.set()
                    await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def frozen_path(cluster: KubeCluster) -> AsyncIterator[tuple[FreezableProxy, Any]]:
    address = urllib.parse.urlsplit(cluster.server)
    assert address.hostname is not None
    assert address.port is not None
    proxy = FreezableProxy(address.hostname, address.port)
    api = api_client_for(cluster, await proxy.start())
    try:
        yield proxy, api
    finally:
        await proxy.close()
        api.close()


def elector(api: Any, ns: str, name: str, clock: FakeClock, **kwargs: Any) -> LeaderElector:
    return LeaderElector(
        api, ns, LEASE, f"{name}_00000000", advertise=f"{name}:8081", clock=clock, **kwargs
    )


def lease_spec(cluster: KubeCluster, ns: str) -> dict[str, Any]:
    answer = cluster.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{LEASE}")
    spec: dict[str, Any] = answer.body.get("spec", {})
    return spec


async def test_a_leader_whose_renewal_hangs_steps_down_before_the_standby_takes_over(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    clock_a, clock_b = FakeClock(), FakeClock()
    lost: list[str] = []
    async with frozen_path(kube_cluster) as (proxy, api_a):
        api_b = api_client_for(kube_cluster)
        # A's calls may hang a minute: only its clock decides when it stops leading.
        a = elector(
            api_a,
            kube_namespace,
            "a",
            clock_a,
            request_timeout_s=60.0,
            on_lose=lambda: lost.append("a"),
        )
        b = elector(api_b, kube_namespace, "b", clock_b)
        try:
            assert await a.attempt()  # creates the Lease
            assert a.is_leader
            assert a.leader_address() is None
            assert not await b.attempt()
            assert not b.is_leader
            assert b.leader_address() == "a:8081"

            proxy.freeze()
            renewal = asyncio.create_task(a.attempt())
            await asyncio.wait_for(proxy.holding.wait(), 30)  # A's GET is sent, unanswered
            clock_a.advance(RENEW_DEADLINE_S - 0.1)
            assert a.is_leader  # still within its deadline
            clock_a.advance(0.1)
            assert not renewal.done()
            assert not a.is_leader  # the deadline alone, no answer needed
            assert a.leader_address() == ""  # it never relays to itself

            clock_b.advance(LEASE_DURATION_S - 0.5)
            assert not await b.attempt()  # not yet: the Lease may still be A's
            assert not (a.is_leader)
            assert not (b.is_leader)
            clock_b.advance(0.5)
            assert await b.attempt()  # unchanged for the lease duration on B's clock
            assert b.is_leader
            assert not a.is_leader

            proxy.thaw()
            assert not await asyncio.wait_for(renewal, 60)  # it reads B's Lease now
            assert not a.is_leader
            assert b.is_leader
            assert a.leader_address() == "b:8081"
            await asyncio.wait_for(_until(lambda: lost == ["a"]), 30)  # on_lose ran once
            spec = lease_spec(kube_cluster, kube_namespace)
            assert spec["holderIdentity"] == "b_00000000"
            assert spec["leaseTransitions"] == 1
        finally:
            await a.stop()
            await b.stop()
            api_b.close()
    assert lease_spec(kube_cluster, kube_namespace)["holderIdentity"] == ""  # B released it


async def test_a_frozen_lease_call_times_out_and_the_deadline_decides(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    assert 2 * REQUEST_TIMEOUT_S < RENEW_DEADLINE_S < LEASE_DURATION_S
    clock = FakeClock()
    async with frozen_path(kube_cluster) as (proxy, api):
        a = elector(api, kube_namespace, "a", clock, request_timeout_s=0.5)
        try:
            assert await a.attempt()
            proxy.freeze()
            # The call fails on its request timeout (no answer ever comes): the round ends.
            assert not await asyncio.wait_for(a.attempt(), 60)
            assert a.is_leader  # one failed round is no step-down before the deadline
            clock.advance(RENEW_DEADLINE_S)
            assert not a.is_leader
            proxy.thaw()
            assert await asyncio.wait_for(a.attempt(), 60)  # still its Lease: renewed
            assert a.is_leader
        finally:
            await a.stop()


async def test_writers_ask_right_before_writing(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    clock = FakeClock()
    api = api_client_for(kube_cluster)
    a = elector(api, kube_namespace, "a", clock)
    try:
        assert await a.attempt()
        kube = KubeApi(api, may_write=lambda: a.is_leader)
        policy = PolicyView.from_body(create_policy(kube_cluster, kube_namespace, "pool"))
        generation, written = await asyncio.to_thread(
            kube.publish_document, policy, "v1", b'{"a": 1}', b'{"a": 1}'
        )
        assert written == ["ConfigMap", "Secret"]
        assert generation > 0
        clock.advance(RENEW_DEADLINE_S)  # its renewal is overdue: no more writes
        with pytest.raises(NotLeader):
            await asyncio.to_thread(kube.publish_document, policy, "v2", b'{"a": 2}', b'{"a": 2}')
        with pytest.raises(NotLeader):
            await asyncio.to_thread(
                kube.patch_status, "schedulingpolicies", kube_namespace, "pool", {"x": 1}
            )
        cm = kube_cluster.request(
            "GET", f"/api/v1/namespaces/{kube_namespace}/configmaps/tokenfair-pool"
        ).body
        assert cm["metadata"]["annotations"]["tokenfair.io/config-version"] == "v1"
    finally:
        await a.stop()
        api.close()


async def test_a_token_review_flood_does_not_delay_the_renewal(
    kube_cluster: KubeCluster, kube_namespace: str
) -> None:
    stuck = threading.Event()
    reviews: list[str] = []

    def hung_review(token: str) -> str | None:  # a TokenReview the API server never answers
        reviews.append(token)
        stuck.wait(60)
        return None

    auth = TokenAuthenticator(hung_review)
    flood = [asyncio.create_task(auth.namespace_of(f"junk-{i}")) for i in range(500)]
    busy = [asyncio.create_task(asyncio.to_thread(stuck.wait, 60)) for _ in range(40)]
    clock = FakeClock()
    api = api_client_for(kube_cluster)
    a = elector(api, kube_namespace, "a", clock)
    try:
        await asyncio.sleep(0)
        assert await asyncio.wait_for(a.attempt(), 30)  # created, while nothing else moves
        assert a.is_leader
        clock.advance(1.0)
        assert await asyncio.wait_for(a.attempt(), 30)  # renewed
        assert len(reviews) <= REVIEW_THREADS  # the rest queue or are refused, not run
    finally:
        stuck.set()
        results = await asyncio.gather(*flood, *busy, return_exceptions=True)
        await a.stop()
        auth.close()
        api.close()
    refused = [r for r in results[: len(flood)] if isinstance(r, ReviewUnavailable)]
    assert refused
    assert all(r.retry_after_s for r in refused)


async def _until(probe: Callable[[], bool]) -> None:
    while not probe():
        await asyncio.sleep(0.05)


# -- the TokenReview limiter, no cluster ----------------------------------------------------


async def test_one_review_per_token_and_refusals_remembered_apart() -> None:
    clock = FakeClock()
    gate = threading.Event()
    asked: list[str] = []

    def review(token: str) -> str | None:
        asked.append(token)
        gate.wait(30)
        return "system:serviceaccount:team:default" if token.startswith("good") else None

    auth = TokenAuthenticator(review, clock=clock)
    try:
        same = [asyncio.create_task(auth.namespace_of("good-1")) for _ in range(50)]
        await asyncio.sleep(0.01)
        gate.set()
        assert await asyncio.gather(*same) == ["team"] * 50
        assert asked == ["good-1"]  # one review for fifty requests
        assert await auth.namespace_of("junk") is None
        assert await auth.namespace_of("junk") is None
        assert asked == ["good-1", "junk"]  # the refusal is remembered
        clock.advance(REJECTED_TTL_S)
        assert await auth.namespace_of("junk") is None
        assert asked == ["good-1", "junk", "junk"]  # ... for its TTL
    finally:
        auth.close()


async def test_junk_fills_only_its_own_bounded_cache() -> None:
    asked: list[str] = []

    def review(token: str) -> str | None:
        asked.append(token)
        return "system:serviceaccount:team:default" if token == "good" else None

    auth = TokenAuthenticator(review, rejected_cache_size=3)
    try:
        assert await auth.namespace_of("good") == "team"
        for i in range(10):
            assert await auth.namespace_of(f"junk-{i}") is None
        assert len(auth._rejected) == 3  # bounded: the oldest refusals went
        assert await auth.namespace_of("junk-9") is None
        assert await auth.namespace_of("good") == "team"
        assert asked.count("good") == 1  # the sidecar's entry survived the junk
        assert asked.count("junk-9") == 1
    finally:
        auth.close()


async def test_new_tokens_are_rate_limited_on_the_clock() -> None:
    clock = FakeClock()
    auth = TokenAuthenticator(lambda token: None, clock=clock, reviews_per_s=10.0, burst=5)
    try:
        for i in range(5):
            assert await auth.namespace_of(f"t{i}") is None
        with pytest.raises(ReviewUnavailable) as refused:
            await auth.namespace_of("t5")
        assert refused.value.retry_after_s == pytest.approx(0.1)
        clock.advance(0.1)
        assert await auth.namespace_of("t5") is None
        assert await auth.namespace_of("t0") is None  # remembered: no review, no token taken
        with pytest.raises(ReviewUnavailable):
            await auth.namespace_of("t6")
    finally:
        auth.close()


async def test_reviews_pending_on_a_slow_api_server_are_bounded() -> None:
    """A slow API server must not grow a queue of new tokens (each holding a token and an open
    request): beyond ``max_pending`` a new token is refused at once, while a token already
    under review is still joined, and the bound frees as reviews end."""
    gate = threading.Event()

    def review(token: str) -> str | None:
        gate.wait(30)
        return None

    auth = TokenAuthenticator(review, burst=100, max_pending=3)
    try:
        pending = [asyncio.create_task(auth.namespace_of(f"t{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        assert len(auth._inflight) == 3
        with pytest.raises(ReviewUnavailable, match="pending"):
            await auth.namespace_of("t3")
        joined = asyncio.create_task(auth.namespace_of("t0"))  # the same token: joined
        gate.set()
        assert await asyncio.gather(*pending, joined) == [None] * 4
        assert await auth.namespace_of("t3") is None  # room again
    finally:
        auth.close()


async def test_an_accepted_token_is_rechecked_outside_the_rate_limit() -> None:
    clock = FakeClock()
    asked: list[str] = []

    def review(token: str) -> str | None:
        asked.append(token)
        return "system:serviceaccount:team:default" if token == "sidecar" else None

    auth = TokenAuthenticator(review, clock=clock, reviews_per_s=1.0, burst=1)
    try:
        assert await auth.namespace_of("sidecar") == "team"  # the bucket's only review
        with pytest.raises(ReviewUnavailable):
            await auth.namespace_of("junk")
        clock.advance(REVIEW_TTL_S)  # its entry expired; the bucket holds ~one review again
        assert await auth.namespace_of("junk") is None  # which junk took
        assert await auth.namespace_of("sidecar") == "team"  # re-checked all the same
        assert asked == ["sidecar", "junk", "sidecar"]
    finally:
        auth.close()


async def test_over_http_a_flood_gets_429_with_retry_after_and_a_failure_503(
    aiohttp_client: Any,
) -> None:
    clock = FakeClock()

    def review(token: str) -> str | None:
        if token == "broken":
            raise TimeoutError("the API server did not answer")
        return "system:serviceaccount:ns:default" if token == "good" else None

    auth = TokenAuthenticator(review, clock=clock, burst=3)
    app = create_app(DocumentStore(), OperatorMetrics(), auth)
    http = await aiohttp_client(app)
    path = "/v1/config/ns/p?waitSeconds=0"

    async def status(token: str) -> tuple[int, str]:
        answer = await http.get(path, headers={"Authorization": f"Bearer {token}"})
        return answer.status, answer.headers.get("Retry-After", "")

    assert await status("good") == (404, "")  # accepted (no document here)
    assert await status("junk-1") == (401, "")
    assert await status("broken") == (503, "")
    assert await status("junk-2") == (429, "1")
    assert await status("good") == (404, "")  # a known token is served during the flood
