"""The first pass from the operator's own listing, before Kopf's is over (issue 33).

**Why.** No pass may publish before Kopf's initial listing is over (:mod:`.listing`): a pass over
a half-filled index would publish a document without the tenants not indexed yet. Kopf's listing
of 10,000 TenantQuotas took 9-14 s of wall time on the loaded 2-core test machine (per listed
object a worker task, its handler arguments, loggers and patches, an index entry: ~0.5 ms of the
event loop each), and the first pass, with its 10,000 key Secret reads, came after it: the
document with every tenant 17-21 s after the operator started, against a target of 15 s. The
same objects are one paginated LIST away, which needs none of that machinery.

**How.** On the replica that leads when the startup hook runs, the hook lists the
SchedulingPolicies, the TenantQuotas and the labelled sidecar Pods itself (:class:`StartupView`),
in the namespaces Kopf watches (:func:`watched_scope`), in pages of :data:`PAGE` (plain JSON over
:meth:`.KubeApi.list_page`, each page parsed into the views a pass reads in a worker thread). The
hook awaits the first page of each LIST (one round trip each, at once); the other pages follow in
the background, each page's key Secrets read in the background as it arrives (:mod:`.prefetch`,
so the reads overlap the LIST), then one pass per policy over the listed world
(:func:`.startup.pass_listed`), through the reconciler's per-policy lock like any other pass.
Kopf goes on listing meanwhile; once it is over, its handlers ask for passes over its indexes as
before, which find the key Secrets read and the document published.

**Why it never publishes fewer tenants.** A paginated LIST is one consistent snapshot, at its first
page's resourceVersion R1. Kopf starts its watchers only once the startup hook has returned (they
wait for its startup activity) and lists without a resourceVersion: a consistent read, at some
R2 >= R1. A pass started from here reads this snapshot while Kopf's listing is not over and Kopf's
indexes once it is (decided when the pass starts, inside the policy's lock): every pass after one
that read the indexes sees the world at R2 or later, where a tenant of this snapshot is missing
only if it was deleted since. A previous leader's last document was made from a view older than
R1: R1 is read after this replica took the Lease. The view holds for that leadership term only
(:attr:`StartupView.term`, the reconciler's :attr:`.Reconciler.term`): a replica that loses the
Lease abandons it (:meth:`StartupView.abandon`), and a pass that would read it in a later term
stops instead (:func:`.startup.pass_listed`), so a replica elected again before Kopf's listing is
over never publishes the world of its earlier term over the documents another leader published
meanwhile; Kopf's passes serve it. A replica that is elected later uses Kopf's indexes only, as
before.

**When it is not used** (Kopf's listing alone, as before, key Secrets prefetched while it lists,
:mod:`.prefetch`): on a replica that does not lead at startup; when the namespaces Kopf watches
are not plain names (patterns: :func:`watched_scope`); when a LIST fails (RBAC, an expired
continue token's 410, a timeout), logged once. While this view covers the listing the prefetch
is fed by this view's pages instead of Kopf's index, so no key Secret is read twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import click

from .indexes import sidecar_entry
from .inject import POLICY_LABEL
from .kube import KubeApi
from .reconcile import PolicyKey, Snapshot
from .views import GROUP, POLICY_PLURAL, QUOTA_PLURAL, VERSION, PolicyView, QuotaView, SidecarView

log = logging.getLogger("tokenfair.operator")

PAGE: Final = 500
"""Objects per LIST page: a page of TenantQuotas is ~0.5 MB of JSON, parsed in a worker thread
in a few tens of ms, so the event loop (Kopf's listing, the Lease) waits for no long parse."""
NAMESPACE_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""An RFC 1123 label: a namespace's name, as opposed to one of Kopf's patterns."""

Scope = tuple[str, ...] | None
"""The namespaces Kopf watches: their names, or None for every namespace."""
State = Literal["idle", "listing", "passing", "done", "failed"]


def watched_scope(clusterwide: bool) -> Scope:
    """The namespaces ``kopf run`` watches: None with ``--all-namespaces`` (``clusterwide``,
    from Kopf's settings), else the names given with ``--namespace`` (read from ``kopf run``'s
    command line, which Kopf does not pass on) and ``$KOPF_RUN_NAMESPACE``. Raises LookupError
    when they are not known or are patterns (globs, negations), which a LIST cannot take."""
    if clusterwide:
        return None
    context = click.get_current_context(silent=True)
    given = context.params.get("namespaces") if context is not None else None
    names = [str(name) for name in given or ()]
    legacy = os.environ.get("KOPF_RUN_NAMESPACE")
    if legacy:
        names.append(legacy)
    if not names:
        raise LookupError("the namespaces kopf watches are not known (no kopf run --namespace)")
    patterns = sorted({name for name in names if not NAMESPACE_NAME.fullmatch(name)})
    if patterns:
        raise LookupError(f"kopf watches namespace patterns {patterns}, which cannot be listed")
    return tuple(sorted(set(names)))


@dataclass
class World:
    """What the startup LISTs found, by policy key, as Kopf's indexes would hold it."""

    policies: dict[PolicyKey, list[PolicyView]] = field(default_factory=dict)
    quotas: dict[PolicyKey, list[QuotaView]] = field(default_factory=dict)
    sidecars: dict[PolicyKey, list[SidecarView]] = field(default_factory=dict)

    def snapshot(self, key: PolicyKey) -> Snapshot:
        """What a pass of policy ``key`` reads (as :meth:`.Indexes.snapshot`)."""
        return (
            tuple(self.policies.get(key, ())),
            tuple(self.quotas.get(key, ())),
            tuple(self.sidecars.get(key, ())),
        )

    def policy_keys(self) -> list[PolicyKey]:
        """Every policy that exists or is named by a quota (as the resync passes them)."""
        return sorted({*self.policies, *self.quotas})

    def size(self) -> tuple[int, int, int]:
        """Policies, quotas and sidecar Pods held."""
        return tuple(  # type: ignore[return-value]
            sum(len(v) for v in held.values())
            for held in (self.policies, self.quotas, self.sidecars)
        )


def _policy(item: Mapping[str, Any]) -> tuple[PolicyKey, PolicyView]:
    view = PolicyView.from_body(item)
    return (view.namespace, view.name), view


def _quota(item: Mapping[str, Any]) -> tuple[PolicyKey, QuotaView]:
    view = QuotaView.from_body(item)
    return (view.namespace, view.policy_name), view


def _sidecar(item: Mapping[str, Any]) -> tuple[PolicyKey, SidecarView]:
    meta = item.get("metadata") or {}
    entry = sidecar_entry(
        name=meta.get("name"),
        namespace=meta.get("namespace"),
        labels=meta.get("labels") or {},
        annotations=meta.get("annotations") or {},
        spec=item.get("spec") or {},
        status=item.get("status") or {},
    )
    ((key, view),) = entry.items()
    return key, view


@dataclass(frozen=True)
class _Kind:
    """One listed resource, as Kopf's index of it selects and keys it."""

    prefix: str
    plural: str
    selector: str
    entry: Callable[[Mapping[str, Any]], tuple[PolicyKey, Any]]
    into: str
    """The :class:`World` attribute its views go to."""

    def path(self, namespace: str | None) -> str:
        where = f"/namespaces/{namespace}" if namespace is not None else ""
        return f"{self.prefix}{where}/{self.plural}"


KINDS: Final = (
    _Kind(f"/apis/{GROUP}/{VERSION}", POLICY_PLURAL, "", _policy, "policies"),
    _Kind(f"/apis/{GROUP}/{VERSION}", QUOTA_PLURAL, "", _quota, "quotas"),
    _Kind("/api/v1", "pods", POLICY_LABEL, _sidecar, "sidecars"),
)
"""The three indexes of :mod:`.handlers`: policies, quotas, and Pods labelled with a policy."""


@dataclass
class _Pages:
    """The LIST of one kind in one namespace (or all): its first page read, the rest to go."""

    kind: _Kind
    path: str
    query: list[tuple[str, str]]
    token: str = ""
    version: str = ""


@dataclass
class StartupView:
    """The operator's own listing at startup, and the passes over it (see the module
    docstring). One per operator process, made by the startup hook on the leader and kept in the
    memo (:data:`.runtime.START_VIEW`)."""

    api: KubeApi
    scope: Scope
    page: int = PAGE
    state: State = "idle"
    world: World | None = None
    """The listed world, until its passes are over (then dropped: Kopf's indexes hold it)."""
    version: str = ""
    """The TenantQuotas' LIST's resourceVersion (R1 in the module docstring)."""
    began: float = 0.0
    """``time.monotonic()`` when :meth:`begin` was called (for the log)."""
    term: int = 0
    """The leadership term the view is listed in (:attr:`.Reconciler.term` before :meth:`begin`):
    its world is published in that term only (:func:`.startup.pass_listed`)."""
    on_quotas: Callable[[list[QuotaView]], None] = lambda quotas: None
    """Called with each page's quotas as it arrives (the startup hook: their key Secrets read
    in the background meanwhile, :meth:`.Reconciler.prefetch_keys`, so the reads overlap the
    other pages instead of following them)."""
    on_over: Callable[[], None] = lambda: None
    """Called once the view stops running (its passes over, failed, abandoned or stopped): the
    start-up garbage collection window may close then
    (:func:`.runtime.close_gc_window_if_settled`)."""
    _pages: list[_Pages] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    @property
    def covers(self) -> bool:
        """Whether this view stands for Kopf's listing on the leader: listing, passing, or
        done (the prefetch stays off; :mod:`.prefetch`)."""
        return self.state in ("listing", "passing", "done")

    @property
    def running(self) -> bool:
        """Listing or passing still (the start-up garbage collection window stays open)."""
        return self.state in ("listing", "passing")

    async def begin(self) -> bool:
        """Read the first page of every LIST (the snapshot's resourceVersion is fixed then: the
        caller returns to Kopf, which lists later). False, logged, if one failed: the view is
        not used (``state`` ``"failed"``)."""
        self.began = time.monotonic()
        self.state = "listing"
        self.world = World()
        namespaces: tuple[str | None, ...] = self.scope if self.scope is not None else (None,)
        for kind in KINDS:
            query = [("limit", str(self.page))]
            if kind.selector:
                query.append(("labelSelector", kind.selector))
            for namespace in namespaces:
                self._pages.append(_Pages(kind, kind.path(namespace), query))
        try:
            await _all(self._next(pages) for pages in self._pages)
        except Exception as exc:
            self._fail(exc)
            return False
        if self.state != "listing":  # abandoned meanwhile (:meth:`abandon`)
            return False
        quotas = next(p for p in self._pages if p.kind.into == "quotas")
        self.version = quotas.version
        return True

    def start(self, publish: Callable[[World], Awaitable[None]]) -> None:
        """After :meth:`begin` succeeded: read the other pages in the background, then
        ``publish(world)`` (the passes, :func:`.startup.pass_listed`)."""
        if self.state != "listing":
            return
        self._task = asyncio.create_task(self._run(publish), name="tokenfair-startup-view")

    async def _run(self, publish: Callable[[World], Awaitable[None]]) -> None:
        try:
            await _all(self._rest(pages) for pages in self._pages)
        except Exception as exc:
            if self.running:
                self._fail(exc)
                self.on_over()
            return
        if self.state != "listing":  # abandoned meanwhile: it called on_over
            return
        world = self.world
        assert world is not None
        self._pages.clear()
        policies, quotas, sidecars = world.size()
        log.info(
            "startup listing: %d policies, %d quotas, %d sidecar Pods at resourceVersion %s in "
            "%.1f s; passing before Kopf's listing is over",
            policies,
            quotas,
            sidecars,
            self.version,
            time.monotonic() - self.began,
        )
        self.state = "passing"
        try:
            await publish(world)
        finally:
            self.world = None  # Kopf's indexes hold it from now on
            if self.state == "passing":
                self.state = "done"
            self.on_over()
        log.info("startup passes over %.1f s after the startup listing began", self.since())

    def since(self) -> float:
        """Seconds since :meth:`begin`."""
        return time.monotonic() - self.began

    async def _rest(self, pages: _Pages) -> None:
        while pages.token and self.state == "listing":
            await self._next(pages)

    async def _next(self, pages: _Pages) -> None:
        """One page of ``pages`` into the world, read and parsed in a worker thread."""
        world = self.world
        assert world is not None
        token = pages.token
        entries, version, pages.token = await asyncio.to_thread(self._page, pages, token)
        if self.state != "listing":  # failed or abandoned meanwhile: nothing more is asked
            return
        if not token:
            pages.version = version
        held: dict[PolicyKey, list[Any]] = getattr(world, pages.kind.into)
        for key, view in entries:
            held.setdefault(key, []).append(view)
        if pages.kind.into == "quotas":
            self.on_quotas([view for _, view in entries])

    def _page(self, pages: _Pages, token: str) -> tuple[list[tuple[PolicyKey, Any]], str, str]:
        items, version, next_token = self.api.list_page(pages.path, pages.query, token)
        return [pages.kind.entry(item) for item in items], version, next_token

    def _fail(self, exc: BaseException) -> None:
        self.state = "failed"
        self.world = None
        self._pages.clear()
        log.warning(
            "startup listing failed (%s: %s): the first pass waits for Kopf's listing",
            exc.__class__.__name__,
            exc,
        )

    def abandon(self) -> None:
        """This replica stepped down (the Lease lost, :func:`.startup._elect`): the listed world
        is dropped and the pages still to come are not read, so nothing of it is published, even
        if this replica leads again before Kopf's listing is over (Kopf's passes serve then)."""
        if not self.running:
            return
        self.state = "failed"
        self.world = None
        self._pages.clear()
        log.info("startup listing abandoned (stepped down): the next pass waits for Kopf's listing")
        self.on_over()

    async def settled(self) -> None:
        """Return once the background pages and passes are over (tests)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel the listing or its passes (the cleanup hook); idempotent."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.running:
            self.state = "failed"
            self.world = None
        self.on_over()


async def _all(calls: Iterable[Awaitable[None]]) -> None:
    """Await ``calls`` together; on the first failure the others are cancelled (no more pages
    read, no more key Secrets asked for) before it is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
