"""The operator's HTTP server: config documents for sidecars (long-poll) and metrics.

Two listeners, one app: the plain port (``/metrics``, ``/healthz``) and the TLS port
(everything; :mod:`.serving_tls`). The config route answers only over TLS: on the plain port
it is ``403`` before any token is looked at, unless the server was made with
``plain_config`` (``$TOKENFAIR_CONFIG_INSECURE_HTTP=true``: unsafe, for local tests).

Routes:

* ``GET /v1/config/{namespace}/{policy}?source=secret|configmap&version=V&waitSeconds=S`` —
  the policy's current document (:mod:`.documents`) as soon as its version is not ``V``:
  ``200`` with the payload exactly as the ConfigMap/Secret store it (text, or gzip: the sidecar
  tells them apart by the magic bytes) and headers ``X-Tokenfair-Config-Version`` and
  ``X-Tokenfair-Config-Generation`` (monotonic, :mod:`.documents`); ``304`` when
  ``S`` seconds (default 30, at most 60) passed with no other version; ``404`` when the policy
  has no document here (not yet rendered since this operator started, or no such policy).
  A sidecar keeps one such request open, so a change reaches it one network round trip after
  the reconciler renders it, instead of the kubelet's volume refresh (~60 s).
* ``GET /metrics`` — :mod:`.metrics`; ``GET /healthz`` — ``ok``.

With two replicas (:mod:`.leader`) a Service sends a sidecar to either; only the leader
reconciles, so a standby relays the config route to the leader's advertised address (from the
Lease) and answers ``503`` while it knows none: a sidecar never gets a standby's stale view.
Leadership is asked right before answering (after a long-poll's wait too): a replica that
stepped down while a request waited relays it instead. The relay holds up to
``relay_connections`` requests to the leader at once (:data:`DEFAULT_RELAY_CONNECTIONS`, one
per sidecar: each keeps one long-poll open; aiohttp's default would be 100).

A standby that serves TLS relays over TLS to the leader's advertised address (then its TLS
port, ``$TOKENFAIR_HTTP_ADVERTISE``), verifying the leader's certificate against the
operator's CA for the certificate's own first DNS name (every replica serves the same one; the
relay calls a Pod IP): the token never crosses the network in clear.

Authentication: the config route requires ``Authorization: Bearer <token>``, a ServiceAccount
token the API server accepts *for the audience* ``tokenfair-config`` (:func:`audience_reviewer`:
a TokenReview with ``spec.audiences``, the answer's ``status.audiences`` checked; the injected
sidecars' projected token, valid 10 minutes; a Pod's ordinary token, whose audience is the API
server, is refused), cached :data:`REVIEW_TTL_S` seconds, of the policy's own namespace: any
ServiceAccount of that namespace, as anyone who could create a Pod there could mount its
Secret. No per-Pod RBAC: the operator alone needs ``create tokenreviews``. ``401`` without a
valid token (or one of another audience), ``403`` for another namespace's; each refusal says
why. TokenReviews are bounded so that a flood of junk tokens costs the API server and this process a
fixed rate and never delays the Lease's renewal (which has its own thread, :mod:`.leader`): they run
on their own :data:`REVIEW_THREADS` threads, at most :data:`REVIEWS_PER_S` new tokens a second (a
bucket of :data:`REVIEW_BURST`: a restarted operator's sidecars all come back at once), one review
per token however many requests show it at once, at most :data:`MAX_PENDING_REVIEWS` new tokens
under review at once (a slow API server costs refusals, not a growing queue); a refused token is
remembered :data:`REJECTED_TTL_S` seconds (at most :data:`REJECTED_CACHE_SIZE`, apart from the
accepted ones, so junk never evicts a sidecar's entry). Over the rate or the pending bound: ``429``
with ``Retry-After``; a review that fails: ``503``. Tokens already accepted are served from the
cache, flood or not, and re-reviewed when their entry expires without drawing on the rate (1,000
sidecars re-check ~17 tokens a second).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import aiohttp
from aiohttp import web
from kubernetes import client

from tokenfair.config.wire import (
    GENERATION_HEADER,
    SOURCE_PARAM,
    VERSION_HEADER,
    VERSION_PARAM,
    WAIT_PARAM,
)

from .documents import SOURCES, DocumentStore, Source
from .kube import REVIEW_TIMEOUT_S
from .metrics import OperatorMetrics
from .serving_tls import ServingTLS

DEFAULT_WAIT_S: Final = 30
"""A long-poll's default wait: well under proxies' and load balancers' idle timeouts (60 s)."""
MAX_WAIT_S: Final = 60
REVIEW_TTL_S: Final = 60.0
"""How long an accepted token's namespace is trusted without asking the API server again: a
sidecar polls every ~30 s, so this halves TokenReviews; a revoked token lasts at most this."""
REJECTED_TTL_S: Final = 60.0
"""How long a refused token stays refused without asking again: a junk token repeated costs
one review a minute."""
REVIEW_CACHE_SIZE: Final = 20_000
"""Accepted tokens remembered at most (one per sidecar); the oldest entry goes first."""
REJECTED_CACHE_SIZE: Final = 10_000
"""Refused tokens remembered at most (their own cache); the oldest entry goes first."""
REVIEW_THREADS: Final = 4
"""TokenReviews in flight at once, on threads of their own."""
MAX_PENDING_REVIEWS: Final = 4 * REVIEW_THREADS
"""New tokens whose review may wait or run at once (:attr:`TokenAuthenticator.max_pending`)."""
REVIEWS_PER_S: Final = 20.0
"""New tokens reviewed per second, sustained: 1,000 sidecars' projected tokens (rotated about
hourly by the kubelet) bring well under one a second; a restarted operator's fleet comes back
through the burst and then this rate (1,000 sidecars within ~40 s)."""
REVIEW_BURST: Final = 200
"""New tokens reviewed at once before the rate applies."""
DEFAULT_RELAY_CONNECTIONS: Final = 1_000
"""Long-polls a standby relays to the leader at once: one per sidecar (the expected fleet of
one operator); more wait for a free connection. ``$TOKENFAIR_RELAY_CONNECTIONS``."""
SERVICE_ACCOUNT_PREFIX: Final = "system:serviceaccount:"
V = TypeVar("V")

STORE: Final = web.AppKey("store", DocumentStore)
METRICS: Final = web.AppKey("metrics", OperatorMetrics)


class Reviewer(Protocol):
    """Blocking TokenReview: the username the API server authenticates ``token`` as, or None."""

    def __call__(self, token: str) -> str | None: ...


def audience_reviewer(api: Any, audience: str) -> Reviewer:
    """A :class:`Reviewer` for tokens of ``audience`` only: the TokenReview names it in
    ``spec.audiences`` (the API server then authenticates a token only if one of its audiences
    is it) and the answer must name it in ``status.audiences`` (an authenticator that ignores
    audiences answers without; refused)."""
    authentication = client.AuthenticationV1Api(api)

    def review(token: str) -> str | None:
        spec = client.V1TokenReviewSpec(token=token, audiences=[audience])
        result = authentication.create_token_review(
            client.V1TokenReview(spec=spec), _request_timeout=REVIEW_TIMEOUT_S
        ).status
        if result is None or not result.authenticated or result.user is None:
            return None
        if audience not in (result.audiences or []):
            return None
        return str(result.user.username)

    return review


class ReviewUnavailable(Exception):
    """No answer for this token now: over the review rate (``retry_after_s``) or the review
    failed; the caller asks again later."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TokenAuthenticator:
    """ServiceAccount tokens -> their namespace, by TokenReview: cached, rate-limited, on
    threads of its own (module docstring)."""

    review: Reviewer
    clock: Callable[[], float] = time.monotonic
    reviews_per_s: float = REVIEWS_PER_S
    burst: int = REVIEW_BURST
    threads: int = REVIEW_THREADS
    max_pending: int = MAX_PENDING_REVIEWS
    """Reviews of new tokens waiting or running at most (beyond: ``429``); a slow API server
    then costs refusals, not a queue of tokens and open requests that grows without bound.
    Re-checks of tokens accepted before are not counted against it (their number is bounded
    by the accepted cache)."""
    accepted_cache_size: int = REVIEW_CACHE_SIZE
    rejected_cache_size: int = REJECTED_CACHE_SIZE
    _accepted: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)
    """sha256(token) -> (namespace, expiry)."""
    _rejected: OrderedDict[str, float] = field(default_factory=OrderedDict)
    """sha256(token) -> expiry."""
    _inflight: dict[str, asyncio.Task[str | None]] = field(default_factory=dict)
    _allowance: float = -1.0
    """Reviews the bucket allows now (-1: full, set on first use)."""
    _refilled_at: float = 0.0
    _executor: ThreadPoolExecutor | None = None

    async def namespace_of(self, token: str) -> str | None:
        """The namespace of the ServiceAccount ``token`` belongs to; None if not one. Raises
        :class:`ReviewUnavailable` when it cannot be told now."""
        digest = hashlib.sha256(token.encode()).hexdigest()  # no token kept in memory
        now = self.clock()
        accepted = self._accepted.get(digest)
        if accepted is not None and accepted[1] > now:
            return accepted[0]
        rejected = self._rejected.get(digest)
        if rejected is not None and rejected > now:
            return None
        task = self._inflight.get(digest)
        if task is None:
            if accepted is None:  # a token accepted before is re-checked outside the bucket:
                if len(self._inflight) >= self.max_pending:  # a slow API server: no backlog
                    raise ReviewUnavailable("too many token reviews pending; retry", 1.0)
                self._take(now)  # junk never gets there, and a fleet's refreshes always do
            task = asyncio.ensure_future(self._review(digest, token))
            task.add_done_callback(_retrieve)
            self._inflight[digest] = task
        return await asyncio.shield(task)  # a caller leaving does not cancel others' review

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _take(self, now: float) -> None:
        """One review from the bucket, or :class:`ReviewUnavailable` with the wait."""
        if self._allowance < 0:
            self._allowance, self._refilled_at = float(self.burst), now
        refill = (now - self._refilled_at) * self.reviews_per_s
        self._allowance = min(float(self.burst), self._allowance + refill)
        self._refilled_at = now
        if self._allowance < 1:
            wait_s = (1 - self._allowance) / self.reviews_per_s
            raise ReviewUnavailable("too many new tokens to review; retry", wait_s)
        self._allowance -= 1

    async def _review(self, digest: str, token: str) -> str | None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, "tokenfair-review")
        loop = asyncio.get_running_loop()
        try:
            username = await loop.run_in_executor(self._executor, self.review, token)
        except Exception as exc:
            raise ReviewUnavailable(f"token review failed ({type(exc).__name__}); retry") from exc
        finally:
            self._inflight.pop(digest, None)
        namespace = None
        if username is not None and username.startswith(SERVICE_ACCOUNT_PREFIX):
            namespace = username.removeprefix(SERVICE_ACCOUNT_PREFIX).split(":", 1)[0] or None
        now = self.clock()
        if namespace is not None:
            entry = (namespace, now + REVIEW_TTL_S)
            _remember(self._accepted, digest, entry, self.accepted_cache_size)
            self._rejected.pop(digest, None)
        else:
            _remember(self._rejected, digest, now + REJECTED_TTL_S, self.rejected_cache_size)
        return namespace


def _remember(cache: OrderedDict[str, V], digest: str, value: V, size: int) -> None:
    cache.pop(digest, None)
    while len(cache) >= size:
        cache.popitem(last=False)
    cache[digest] = value


def _retrieve(task: asyncio.Task[str | None]) -> None:
    """Mark a review's failure as seen even when every caller has left."""
    if not task.cancelled():
        task.exception()


AUTH: Final = web.AppKey("auth", TokenAuthenticator)
LeaderAddress = Callable[[], str | None]
LEADER: Final[web.AppKey[LeaderAddress]] = web.AppKey("leader")
RELAY: Final = web.AppKey("relay", aiohttp.ClientSession)
RELAY_CONNECTIONS: Final = web.AppKey("relay_connections", int)
PLAIN_CONFIG: Final = web.AppKey("plain_config", bool)
TLS: Final[web.AppKey[ServingTLS | None]] = web.AppKey("tls")
RELAY_GRACE_S: Final = 10
"""Beyond a long-poll's wait, how long a relayed request may take."""
SHUTDOWN_S: Final = 1.0
"""Seconds open requests get to finish when the server stops."""


def create_app(
    store: DocumentStore,
    metrics: OperatorMetrics,
    auth: TokenAuthenticator,
    leader: LeaderAddress = lambda: None,
    relay_connections: int = DEFAULT_RELAY_CONNECTIONS,
    *,
    plain_config: bool = True,
    tls: ServingTLS | None = None,
) -> web.Application:
    """``leader`` says where to relay the config route: None while this replica leads (its
    own store is current), else the leader's ``host:port`` ("" while unknown: 503);
    ``relay_connections`` bounds the relayed requests open at once. ``plain_config``: the
    config route answers without TLS too (the operator passes False unless told otherwise;
    True here for a bare app in tests). ``tls``: relay over TLS, verified with its CA."""
    app = web.Application()
    app[PLAIN_CONFIG] = plain_config
    app[TLS] = tls
    app[STORE] = store
    app[METRICS] = metrics
    app[AUTH] = auth
    app[LEADER] = leader
    app[RELAY_CONNECTIONS] = relay_connections
    app.cleanup_ctx.append(_relay_session)
    app.router.add_get("/v1/config/{namespace}/{policy}", config_document)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_get("/healthz", healthz)
    return app


def _refuse(status: type[web.HTTPException], reason: str) -> web.HTTPException:
    return status(text=reason + "\n", content_type="text/plain")


def _query(request: web.Request) -> tuple[Source, str, float]:
    source = request.query.get(SOURCE_PARAM, "secret")
    if source not in SOURCES:
        raise _refuse(web.HTTPBadRequest, f"source: must be one of {', '.join(SOURCES)}")
    raw_wait = request.query.get(WAIT_PARAM, str(DEFAULT_WAIT_S))
    try:
        wait_s = int(raw_wait)
    except ValueError:
        wait_s = -1
    if not 0 <= wait_s <= MAX_WAIT_S:
        shown = raw_wait[:20]
        message = f"waitSeconds: must be an integer 0..{MAX_WAIT_S} (got {shown!r})"
        raise _refuse(web.HTTPBadRequest, message)
    version = request.query.get(VERSION_PARAM, "")
    if len(version) > 256:
        raise _refuse(web.HTTPBadRequest, "version: must be at most 256 characters")
    return ("secret" if source == "secret" else "configmap"), version, float(wait_s)


async def config_document(request: web.Request) -> web.StreamResponse:
    namespace, policy = request.match_info["namespace"], request.match_info["policy"]
    if not request.secure and not request.app[PLAIN_CONFIG]:
        raise _refuse(
            web.HTTPForbidden,
            "config documents are served over TLS only (the HTTPS port); plain HTTP would "
            "carry the token and the document in clear",
        )
    source, have, wait_s = _query(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _refuse(web.HTTPUnauthorized, "Authorization: a Bearer ServiceAccount token needed")
    try:
        caller = await request.app[AUTH].namespace_of(token.strip())
    except ReviewUnavailable as exc:
        if exc.retry_after_s is None:
            raise _refuse(web.HTTPServiceUnavailable, str(exc)) from None
        refusal = _refuse(web.HTTPTooManyRequests, str(exc))
        refusal.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        raise refusal from None
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
    leader = request.app[LEADER]()
    if leader is not None:  # stepped down while the request waited: the new leader answers
        return await _relay(request, leader)
    if document is not None:
        headers = {VERSION_HEADER: document.version}
        if document.generation:
            headers[GENERATION_HEADER] = str(document.generation)
        return web.Response(
            body=document.payload(source),
            content_type="application/octet-stream",
            headers=headers,
        )
    if store.get(key) is None:
        raise _refuse(
            web.HTTPNotFound,
            f"no document of policy {namespace}/{policy} here (not rendered yet, or no policy)",
        )
    return web.Response(status=304, headers={VERSION_HEADER: have})


async def _relay_session(app: web.Application) -> AsyncIterator[None]:
    timeout = aiohttp.ClientTimeout(total=MAX_WAIT_S + RELAY_GRACE_S, connect=5)
    connector = aiohttp.TCPConnector(limit=app[RELAY_CONNECTIONS], limit_per_host=0)
    async with aiohttp.ClientSession(
        timeout=timeout, trust_env=False, connector=connector
    ) as session:
        app[RELAY] = session
        yield
    app[AUTH].close()


async def _relay(request: web.Request, leader: str) -> web.Response:
    """The same request to the leader (caller already authenticated here; the leader checks
    again), its answer back; 503 when no leader is known or it does not answer."""
    if not leader:
        raise _refuse(web.HTTPServiceUnavailable, "no leader known yet; retry")
    headers = {"Authorization": request.headers["Authorization"]}
    tls = request.app[TLS]
    url, context, server_name = f"http://{leader}{request.path_qs}", None, None
    if tls is not None:
        url = f"https://{leader}{request.path_qs}"
        context, server_name = tls.client, tls.server_name or None
    try:
        async with request.app[RELAY].get(
            url, headers=headers, ssl=context or True, server_hostname=server_name
        ) as answer:
            body = await answer.read()
            # Header names are case-insensitive (a proxy or HTTP/2 hop lowercases them):
            # looked up in aiohttp's CIMultiDict, sent on in the canonical spelling.
            relayed = {
                name: value
                for name in (VERSION_HEADER, GENERATION_HEADER)
                if (value := answer.headers.get(name)) is not None
            }
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


async def start_server(
    app: web.Application,
    addr: str,
    port: int | None,
    tls_port: int | None = None,
    tls: ssl.SSLContext | None = None,
) -> web.AppRunner:
    """Listen on ``addr:port`` (plain, when given) and ``addr:tls_port`` (with ``tls``, when
    given); the caller calls ``runner.cleanup()`` to stop. A port that cannot be bound raises
    with neither port left bound (a retried startup binds both again)."""
    # Held long-polls are cut at shutdown, not awaited (60 s by default): their sidecars ask
    # again, and find the new leader.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    try:
        if port is not None:
            await web.TCPSite(runner, addr, port).start()
        if tls_port is not None and tls is not None:
            await web.TCPSite(runner, addr, tls_port, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
