"""The operator's plain-HTTP server: config documents for sidecars (long-poll) and metrics.

Routes:

* ``GET /v1/config/{namespace}/{policy}?source=secret|configmap&version=V&waitSeconds=S`` —
  the policy's current document (:mod:`.documents`) as soon as its version is not ``V``:
  ``200`` with the payload exactly as the ConfigMap/Secret store it (text, or gzip: the sidecar
  tells them apart by the magic bytes) and header ``X-Tokenfair-Config-Version``; ``304`` when
  ``S`` seconds (default 30, at most 60) passed with no other version; ``404`` when the policy
  has no document here (not yet rendered since this operator started, or no such policy).
  A sidecar keeps one such request open, so a change reaches it one network round trip after
  the reconciler renders it, instead of the kubelet's volume refresh (~60 s).
* ``GET /metrics`` — :mod:`.metrics`; ``GET /healthz`` — ``ok``.

With two replicas (:mod:`.leader`) a Service sends a sidecar to either; only the leader
reconciles, so a standby relays the config route to the leader's advertised address (from the
Lease) and answers ``503`` while it knows none: a sidecar never gets a standby's stale view.

Authentication: the config route requires ``Authorization: Bearer <token>``, a ServiceAccount
token the API server accepts (a TokenReview, cached :data:`REVIEW_TTL_S` seconds), of the
policy's own namespace: exactly who could mount that namespace's Secret in a Pod. No per-Pod
RBAC: the operator alone needs ``create tokenreviews``. ``401`` without a valid token, ``403``
for another namespace's; each refusal says why.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp
from aiohttp import web

from .documents import SOURCES, DocumentStore, Source
from .metrics import OperatorMetrics

VERSION_HEADER: Final = "X-Tokenfair-Config-Version"
DEFAULT_WAIT_S: Final = 30
"""A long-poll's default wait: well under proxies' and load balancers' idle timeouts (60 s)."""
MAX_WAIT_S: Final = 60
REVIEW_TTL_S: Final = 60.0
"""How long an accepted token's namespace is trusted without asking the API server again: a
sidecar polls every ~30 s, so this halves TokenReviews; a revoked token lasts at most this."""
REJECTED_TTL_S: Final = 5.0
"""How long a refused token stays refused without asking again (bounds a retry storm)."""
REVIEW_CACHE_SIZE: Final = 20_000
"""Tokens remembered at most (one per sidecar); the oldest entry goes first."""
SERVICE_ACCOUNT_PREFIX: Final = "system:serviceaccount:"

STORE: Final = web.AppKey("store", DocumentStore)
METRICS: Final = web.AppKey("metrics", OperatorMetrics)


class Reviewer(Protocol):
    """Blocking TokenReview: the username the API server authenticates ``token`` as, or None."""

    def __call__(self, token: str) -> str | None: ...


@dataclass
class TokenAuthenticator:
    """ServiceAccount tokens -> their namespace, by TokenReview, cached."""

    review: Reviewer
    clock: Callable[[], float] = time.monotonic
    _cache: dict[str, tuple[str | None, float]] = field(default_factory=dict)

    async def namespace_of(self, token: str) -> str | None:
        """The namespace of the ServiceAccount ``token`` belongs to; None if not one."""
        digest = hashlib.sha256(token.encode()).hexdigest()  # no token kept in memory
        now = self.clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        username = await asyncio.to_thread(self.review, token)
        namespace = None
        if username is not None and username.startswith(SERVICE_ACCOUNT_PREFIX):
            namespace = username.removeprefix(SERVICE_ACCOUNT_PREFIX).split(":", 1)[0] or None
        if len(self._cache) >= REVIEW_CACHE_SIZE:
            del self._cache[next(iter(self._cache))]
        ttl = REVIEW_TTL_S if namespace is not None else REJECTED_TTL_S
        self._cache[digest] = (namespace, now + ttl)
        return namespace


AUTH: Final = web.AppKey("auth", TokenAuthenticator)
LeaderAddress = Callable[[], str | None]
LEADER: Final[web.AppKey[LeaderAddress]] = web.AppKey("leader")
RELAY: Final = web.AppKey("relay", aiohttp.ClientSession)
RELAY_GRACE_S: Final = 10
SHUTDOWN_S: Final = 1.0
"""Seconds open requests get to finish when the server stops."""
"""Beyond a long-poll's wait, how long a relayed request may take."""


def create_app(
    store: DocumentStore,
    metrics: OperatorMetrics,
    auth: TokenAuthenticator,
    leader: LeaderAddress = lambda: None,
) -> web.Application:
    """``leader`` says where to relay the config route: None while this replica leads (its
    own store is current), else the leader's ``host:port`` ("" while unknown: 503)."""
    app = web.Application()
    app[STORE] = store
    app[METRICS] = metrics
    app[AUTH] = auth
    app[LEADER] = leader
    app.cleanup_ctx.append(_relay_session)
    app.router.add_get("/v1/config/{namespace}/{policy}", config_document)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_get("/healthz", healthz)
    return app


def _refuse(status: type[web.HTTPException], reason: str) -> web.HTTPException:
    return status(text=reason + "\n", content_type="text/plain")


def _query(request: web.Request) -> tuple[Source, str, float]:
    source = request.query.get("source", "secret")
    if source not in SOURCES:
        raise _refuse(web.HTTPBadRequest, f"source: must be one of {', '.join(SOURCES)}")
    raw_wait = request.query.get("waitSeconds", str(DEFAULT_WAIT_S))
    try:
        wait_s = int(raw_wait)
    except ValueError:
        wait_s = -1
    if not 0 <= wait_s <= MAX_WAIT_S:
        shown = raw_wait[:20]
        message = f"waitSeconds: must be an integer 0..{MAX_WAIT_S} (got {shown!r})"
        raise _refuse(web.HTTPBadRequest, message)
    version = request.query.get("version", "")
    if len(version) > 256:
        raise _refuse(web.HTTPBadRequest, "version: must be at most 256 characters")
    return ("secret" if source == "secret" else "configmap"), version, float(wait_s)


async def config_document(request: web.Request) -> web.StreamResponse:
    namespace, policy = request.match_info["namespace"], request.match_info["policy"]
    source, have, wait_s = _query(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _refuse(web.HTTPUnauthorized, "Authorization: a Bearer ServiceAccount token needed")
    caller = await request.app[AUTH].namespace_of(token.strip())
    if caller is None:
        raise _refuse(web.HTTPUnauthorized, "Authorization: not a valid ServiceAccount token")
    if caller != namespace:
        raise _refuse(
            web.HTTPForbidden,
            f"a ServiceAccount of namespace {caller!r} may not read policy {namespace}/{policy}'s "
            "document (only its own namespace's)",
        )
    leader = request.app[LEADER]()
    if leader is not None:  # a standby: the leader's store is the current one
        return await _relay(request, leader)
    store = request.app[STORE]
    key = (namespace, policy)
    document = await store.newer(key, have, wait_s)
    if document is not None:
        return web.Response(
            body=document.payload(source),
            content_type="application/octet-stream",
            headers={VERSION_HEADER: document.version},
        )
    if store.get(key) is None:
        raise _refuse(
            web.HTTPNotFound,
            f"no document of policy {namespace}/{policy} here (not rendered yet, or no policy)",
        )
    return web.Response(status=304, headers={VERSION_HEADER: have})


async def _relay_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=MAX_WAIT_S + RELAY_GRACE_S, connect=5)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        app[RELAY] = session
        yield


async def _relay(request: web.Request, leader: str) -> web.Response:
    """The same request to the leader (caller already authenticated here; the leader checks
    again), its answer back; 503 when no leader is known or it does not answer."""
    if not leader:
        raise _refuse(web.HTTPServiceUnavailable, "no leader known yet; retry")
    headers = {"Authorization": request.headers["Authorization"]}
    try:
        async with request.app[RELAY].get(
            f"http://{leader}{request.path_qs}", headers=headers
        ) as answer:
            body = await answer.read()
            # Header names are case-insensitive (a proxy or HTTP/2 hop lowercases them):
            # looked up in aiohttp's CIMultiDict, sent on in the canonical spelling.
            version = answer.headers.get(VERSION_HEADER)
            relayed = {VERSION_HEADER: version} if version is not None else {}
            return web.Response(
                status=answer.status,
                body=body,
                headers={**relayed, "Content-Type": answer.headers.get("Content-Type", "")},
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _refuse(
            web.HTTPServiceUnavailable, f"the leader at {leader} did not answer ({exc!r}); retry"
        ) from None


async def metrics_text(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def start_server(app: web.Application, addr: str, port: int) -> web.AppRunner:
    """Listen on ``addr:port``; the caller calls ``runner.cleanup()`` to stop."""
    # Held long-polls are cut at shutdown, not awaited (60 s by default): their sidecars ask
    # again, and find the new leader.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    await web.TCPSite(runner, addr, port).start()
    return runner
