"""The operator's own listing at startup (:mod:`tokenfair_operator.startview`), without a cluster.

Behaviours under test, with a fake API that serves paginated LISTs (and, last, the real API
server) and Kopf's indexes as the startup hook receives them (empty, filled by Kopf's listing,
which has not begun):

- on the leader, the startup hook reads the first page of each LIST (policies, quotas, labelled
  Pods) before it returns, and nothing more (Kopf lists after the hook, at a resourceVersion not
  older than these pages'); the other pages follow in the background, then a pass that publishes
  every tenant of every page though Kopf's indexes are still empty and its listing not over, and
  divides the budgets across the Ready sidecars listed; each key Secret is read once;
- a pass that starts once Kopf's listing is over reads Kopf's indexes, not the startup view
  (which may be older than them); when Kopf's listing is over before the startup pages are,
  no startup pass runs at all (the handlers' passes serve);
- each page's key Secrets are asked of the prefetch as the page arrives (read while the other
  pages come), Kopf's index asks for none while the view covers the listing, and each key
  Secret is read once; a LIST that fails (here a 403) turns the view off, logged, and Kopf's
  index feeds the prefetch as before; a later page that fails (an expired continue token's 410)
  cancels the other LISTs, whose pages then ask for no key Secret, and the start-up garbage
  collection window closes once Kopf's listing is over;
- a replica that stepped down since the startup listing publishes nothing of it, even when it
  leads again before Kopf's listing is over (another leader may have published a newer world
  meanwhile): its passes stop, Kopf's passes serve; losing the Lease abandons the view;
- a standby makes no view; the namespaces listed are Kopf's: every namespace, or the plain
  names given to ``kopf run --namespace``; patterns are refused with the reason;
- on the real API server (the shipped RBAC): the pages are one snapshot taken at the first
  page, so a quota created after it is not in the startup document, and the pass over Kopf's
  indexes (listed later) adds it: no document with fewer tenants than the one before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import click
import kopf
import pytest
from kubecluster import KubeCluster
from kubernetes.client import ApiException
from kubernetes.config import new_client_from_config
from operator_run_support import POLICY, create_in_parallel, create_policy, key_secrets, quotas
from operator_support import published

from tokenfair.config import document_text, loads_config
from tokenfair_operator import runtime, startup
from tokenfair_operator.gcwindow import StartupCollection
from tokenfair_operator.indexes import Indexes
from tokenfair_operator.kube import KubeApi
from tokenfair_operator.listing import Listing
from tokenfair_operator.passes import PASSES, EventPasses, prefetch_while_listing, run_pass
from tokenfair_operator.reconcile import Reconciler
from tokenfair_operator.startview import StartupView, watched_scope
from tokenfair_operator.views import PolicyView, QuotaView

LOG = logging.getLogger("test")
NS = "ns"
STORED = 250
"""Quotas stored before the startup listing on the real API server: 3 pages of 100."""
SPEC: dict[str, Any] = {
    "weight": 1.0,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100.0,
}


def meta(name: str, uid: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": NS,
        "uid": uid,
        "generation": 1,
        "resourceVersion": "7",
        "creationTimestamp": f"2026-01-01T00:00:{len(uid) % 60:02d}Z",
        **extra,
    }


def policy_body(name: str) -> dict[str, Any]:
    return {"metadata": meta(name, f"p-{name}"), "spec": {}}


def quota_body(i: int, policy: str = "pool") -> dict[str, Any]:
    spec = {**SPEC, "policyName": policy, "apiKeySecretRef": {"name": f"key-{i}"}}
    return {"metadata": meta(f"q{i}", f"u{i}"), "spec": spec}


def pod_body(name: str, ready: bool) -> dict[str, Any]:
    return {
        "metadata": meta(name, f"pod-{name}", labels={"tokenfair.io/policy": "pool"}),
        "spec": {"containers": [{"name": "tokenfair-sidecar"}]},
        "status": {
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class PagedApi:
    """The calls the startup view and a pass make: LISTs served ``page`` items at a time
    (continue tokens: the next item's index), key reads and publications recorded."""

    def __init__(self, lists: dict[str, list[dict[str, Any]]]) -> None:
        self.lists = lists
        """Path -> the items its LIST holds."""
        self.pages: list[tuple[str, str]] = []
        """(path, continue token) of every page read."""
        self.forbidden: set[str] = set()
        self.expired: set[str] = set()
        """Paths whose pages after the first fail (410: the continue token expired)."""
        self.held: set[str] = set()
        """Paths whose pages after the first wait for ``later_pages``."""
        self.later_pages = threading.Event()
        self.later_pages.set()
        self.key_reads: list[str] = []
        self.documents: list[int] = []
        """Tenants of each document published, in order."""
        self.status_writes = 0
        self.hold_keys = threading.Event()
        self.hold_keys.set()
        self.reading = threading.Event()

    def may_write(self) -> bool:
        return True

    def list_page(
        self, path: str, query: list[tuple[str, str]], continue_token: str = ""
    ) -> tuple[list[dict[str, Any]], str, str]:
        self.pages.append((path, continue_token))
        if path in self.forbidden:
            raise ApiException(status=403, reason="Forbidden")
        if continue_token and path in self.expired:
            raise ApiException(status=410, reason="Expired")
        if continue_token and path in self.held:
            assert self.later_pages.wait(10), "the test never released the pages"
        limit = int(dict(query)["limit"])
        start = int(continue_token or 0)
        items = self.lists.get(path, [])
        end = start + limit
        return items[start:end], "42", str(end) if end < len(items) else ""

    def key_hashes_many(
        self, secrets: list[tuple[str, str]], resource_version: str = "0"
    ) -> list[tuple[str, ...]]:
        self.reading.set()
        assert self.hold_keys.wait(10), "the test never released the key reads"
        self.key_reads += [name for _, name in secrets]
        return [(hashlib.sha256(name.encode()).hexdigest(),) for _, name in secrets]

    def published_keys(self, policy: PolicyView) -> dict[str, tuple[str, ...]]:
        return {}

    def get_policy(self, namespace: str, name: str) -> None:
        return None

    def publish_document(
        self, policy: PolicyView, version: str, configmap: bytes, secret: bytes
    ) -> tuple[int, list[str]]:
        config = loads_config(document_text(configmap, "configmap"), "configmap")
        self.documents.append(len(config.tenants))
        return len(self.documents), ["ConfigMap", "Secret"]

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> str:
        self.status_writes += 1
        return ""


QUOTAS_PATH = "/apis/tokenfair.io/v1alpha1/tenantquotas"
POLICIES_PATH = "/apis/tokenfair.io/v1alpha1/schedulingpolicies"
PODS_PATH = "/api/v1/pods"


def world(quotas: int, policies: tuple[str, ...] = ("pool",)) -> PagedApi:
    return PagedApi(
        {
            POLICIES_PATH: [policy_body(p) for p in policies],
            QUOTAS_PATH: [quota_body(i, policies[i % len(policies)]) for i in range(quotas)],
            PODS_PATH: [pod_body("a", True), pod_body("b", True), pod_body("c", False)],
        }
    )


class FakeSettings:
    class peering:
        clusterwide = True


def operator_memo(api: PagedApi | KubeApi) -> kopf.Memo:
    """The memo as the startup hook fills it; Kopf's indexes empty (its listing not begun)."""
    memo = kopf.Memo()
    memo[runtime.GENERATIONS] = {}
    memo[runtime.LISTING] = Listing()
    memo[runtime.INDEXES] = Indexes(cast(Any, {}), cast(Any, {}), cast(Any, {}))
    memo[runtime.RECONCILER] = Reconciler(cast(Any, api))
    memo[PASSES] = EventPasses(memo)
    return memo


async def started_view(memo: kopf.Memo, page: int = 4) -> StartupView:
    """The startup hook's last step, with pages of ``page`` objects."""
    await startup.list_ourselves(memo, cast(Any, FakeSettings), LOG, page)
    view = runtime.startup_view(memo)
    assert view is not None
    return view


async def until(what: str, probe: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (generously: pages are read in worker threads) until ``probe()``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


async def closed(memo: kopf.Memo) -> None:
    await runtime.reconciler(memo).close()


async def test_the_startup_listing_publishes_every_tenant_before_kopf_has_listed_one() -> None:
    api = world(10)
    memo = operator_memo(api)
    view = await started_view(memo, page=4)
    # The hook returned (Kopf lists from now on): the first page of each LIST, nothing more.
    assert sorted(api.pages) == sorted([(POLICIES_PATH, ""), (QUOTAS_PATH, ""), (PODS_PATH, "")])
    assert view.version == "42"
    await view.settled()
    assert [token for path, token in api.pages if path == QUOTAS_PATH] == ["", "4", "8"]
    assert api.documents == [10]  # every tenant, from every page
    assert not runtime.listing(memo).is_complete
    assert not runtime.indexes(memo).quotas
    assert sorted(api.key_reads) == sorted(f"key-{i}" for i in range(10))  # each once
    assert runtime.reconciler(memo).replicas_changed(("ns", "pool"), 2) is False  # 2 Ready
    assert view.state == "done"
    assert view.world is None
    await closed(memo)


async def test_a_pass_that_starts_after_kopf_listed_reads_kopf_indexes() -> None:
    api = world(6, policies=("a", "b"))
    memo = operator_memo(api)
    api.hold_keys.clear()  # policy a's pass waits in its key reads
    view = await started_view(memo)
    await until("a's pass reads its keys", api.reading.is_set)
    # Kopf's listing ends meanwhile, its index of b holding one more quota than the view.
    newer = [QuotaView.from_body(quota_body(i, "b")) for i in (1, 3, 5, 7)]
    runtime.indexes(memo).quotas[("ns", "b")] = cast(Any, newer)  # type: ignore[index]
    runtime.indexes(memo).policies[("ns", "b")] = cast(  # type: ignore[index]
        Any, [PolicyView.from_body(policy_body("b"))]
    )
    runtime.listing(memo).mark_complete(lambda: 5)
    api.hold_keys.set()
    await view.settled()
    assert api.documents == [3]  # a, from the view; b's pass was left to Kopf's handlers
    await closed(memo)


async def test_a_started_pass_reads_kopf_indexes_once_kopf_listed() -> None:
    api = world(4, policies=("a",))
    memo = operator_memo(api)
    reconciler = runtime.reconciler(memo)
    key = ("ns", "a")
    # Another pass of a holds the policy's lock: the startup pass waits for it.
    lock = reconciler._lock(key)
    await lock.acquire()
    view = await started_view(memo)
    await until("the startup pass waits for the lock", lambda: key in reconciler._waiting)
    newer = [QuotaView.from_body(quota_body(i, "a")) for i in range(5)]  # one more
    runtime.indexes(memo).quotas[key] = cast(Any, newer)  # type: ignore[index]
    runtime.indexes(memo).policies[key] = cast(  # type: ignore[index]
        Any, [PolicyView.from_body(policy_body("a"))]
    )
    runtime.listing(memo).mark_complete(lambda: 6)
    lock.release()
    await view.settled()
    assert api.documents == [5]  # Kopf's view, not the older startup one
    await closed(memo)


async def test_no_startup_pass_when_kopf_listed_first() -> None:
    api = world(3)
    memo = operator_memo(api)
    view = await started_view(memo, page=1)
    runtime.listing(memo).mark_complete(lambda: 0)  # before the other pages came
    await view.settled()
    assert api.documents == []
    assert api.key_reads == []
    await closed(memo)


async def test_the_view_feeds_the_prefetch_and_a_failed_list_hands_it_back_to_kopf(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = world(6)
    memo = operator_memo(api)
    prefetch = runtime.reconciler(memo).prefetch
    view = await started_view(memo)
    assert len(prefetch) == 4  # the first page's key Secrets, asked for as it arrived
    later = QuotaView.from_body(quota_body(7))
    prefetch_while_listing(memo, [later])  # Kopf indexing a quota meanwhile: not asked
    assert len(prefetch) == 4
    await view.settled()
    assert api.documents == [6]
    assert sorted(api.key_reads) == sorted(f"key-{i}" for i in range(6))  # each once
    await closed(memo)

    api = world(2)
    api.forbidden.add(PODS_PATH)
    memo = operator_memo(api)
    prefetch = runtime.reconciler(memo).prefetch
    with caplog.at_level(logging.WARNING, "tokenfair.operator"):
        view = await started_view(memo)
    assert view.state == "failed"
    assert not view.covers
    assert "startup listing failed (ApiException" in caplog.text
    asked = len(prefetch)
    prefetch_while_listing(memo, [later])
    assert len(prefetch) == asked + 1  # Kopf's listing feeds it, as before
    await prefetch.claim([("ns", "key-7")])
    assert api.documents == []
    await closed(memo)


async def test_a_failed_page_stops_the_other_lists_and_lets_the_gc_window_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = world(20)
    api.lists[PODS_PATH] *= 3  # 9 Pods: 3 pages of 4
    api.expired.add(PODS_PATH)  # their second page: 410
    api.held.add(QUOTAS_PATH)  # the quotas' second page waits until the Pods' failed
    api.later_pages.clear()
    memo = operator_memo(api)
    asked: list[str] = []
    reconciler = runtime.reconciler(memo)
    monkeypatch.setattr(reconciler, "prefetch_keys", lambda qs: asked.extend(q.name for q in qs))
    window = memo[runtime.GC_WINDOW] = StartupCollection()
    window.open()
    try:
        view = await started_view(memo)
        runtime.listing(memo).mark_complete(lambda: 0)  # Kopf's listing over, no pass running
        runtime.close_gc_window_if_settled(memo, passes_running=False)
        assert window.is_open  # the view still lists
        await until("the Pods' LIST failed", lambda: view.state == "failed")
        await view.settled()
        paging = [
            t for t in asyncio.all_tasks() if "_rest" in getattr(t.get_coro(), "__name__", "")
        ]
        assert not paging  # the quotas' LIST cancelled, not left waiting for its page
        api.later_pages.set()  # the quotas' second page arrives after the failure
        assert asked == [f"q{i}" for i in range(4)]  # the first page's only
        assert [token for path, token in api.pages if path == QUOTAS_PATH] == ["", "4"]
        assert not window.is_open  # closed when the view failed
        assert api.documents == []
    finally:
        window.close("test over")
        await closed(memo)


async def test_a_replica_that_stepped_down_never_publishes_its_startup_world() -> None:
    api = world(4, policies=("a",))
    memo = operator_memo(api)
    reconciler = runtime.reconciler(memo)
    key = ("ns", "a")
    # Another pass of a holds the policy's lock: the startup pass waits for it.
    lock = reconciler._lock(key)
    await lock.acquire()
    view = await started_view(memo)
    await until("the startup pass waits for the lock", lambda: key in reconciler._waiting)
    # The Lease lost (the view is not told: only the term says it) and taken again before
    # Kopf's listing is over; another leader published a newer world meanwhile.
    reconciler.step_down()
    assert runtime.leads(memo)
    lock.release()
    await view.settled()
    assert api.documents == []  # not the world listed in the earlier term
    # Kopf's listing over: its passes serve, from its indexes.
    newer = [QuotaView.from_body(quota_body(i, "a")) for i in range(5)]
    runtime.indexes(memo).quotas[key] = cast(Any, newer)  # type: ignore[index]
    runtime.indexes(memo).policies[key] = cast(  # type: ignore[index]
        Any, [PolicyView.from_body(policy_body("a"))]
    )
    runtime.listing(memo).mark_complete(lambda: 6)
    await run_pass(key, memo, LOG)
    assert api.documents == [5]
    await closed(memo)


async def test_losing_the_lease_abandons_the_view() -> None:
    api = world(12)
    api.held.add(QUOTAS_PATH)
    api.later_pages.clear()
    memo = operator_memo(api)
    over: list[str] = []
    view = await started_view(memo)
    view.on_over = lambda: over.append(view.state)
    await until("the second page is asked for", lambda: (QUOTAS_PATH, "4") in api.pages)
    runtime.reconciler(memo).step_down()
    view.abandon()  # the elector's on_lose
    assert (view.state, view.world, over) == ("failed", None, ["failed"])
    assert not view.covers  # Kopf's index feeds the prefetch again
    api.later_pages.set()
    await view.settled()
    assert [token for path, token in api.pages if path == QUOTAS_PATH] == ["", "4"]
    assert api.documents == []
    await closed(memo)


async def test_a_standby_makes_no_view(monkeypatch: pytest.MonkeyPatch) -> None:
    api = world(2)
    memo = operator_memo(api)
    monkeypatch.setattr(runtime, "leads", lambda memo: False)
    await startup.list_ourselves(memo, cast(Any, FakeSettings), LOG)
    assert runtime.startup_view(memo) is None
    assert api.pages == []
    await closed(memo)


def test_the_namespaces_listed_are_the_ones_kopf_watches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KOPF_RUN_NAMESPACE", raising=False)
    assert watched_scope(clusterwide=True) is None
    command = click.Command("run")
    with click.Context(command) as context:
        context.params["namespaces"] = ("team-b", "team-a", "team-b")
        assert watched_scope(clusterwide=False) == ("team-a", "team-b")
        monkeypatch.setenv("KOPF_RUN_NAMESPACE", "legacy")
        assert watched_scope(clusterwide=False) == ("legacy", "team-a", "team-b")
        context.params["namespaces"] = ("team-*", "!kube-system")
        with pytest.raises(LookupError, match=r"patterns \['!kube-system', 'team-\*'\]"):
            watched_scope(clusterwide=False)
    monkeypatch.delenv("KOPF_RUN_NAMESPACE")
    with pytest.raises(LookupError, match="not known"):
        watched_scope(clusterwide=False)


# --- On the real API server, with the shipped RBAC ------------------------------------------


async def test_the_startup_listing_is_one_snapshot_of_the_api_server(
    kube_cluster: KubeCluster, kube_namespace: str, operator_kubeconfig: Path
) -> None:
    """The pages of the real API server's LIST (the operator's own ServiceAccount) are one
    snapshot, taken at the first page: a quota created after it is in no page and so not in the
    startup document; the pass over Kopf's indexes, which Kopf lists afterwards, adds it."""
    ns = kube_namespace
    create_policy(kube_cluster, ns)
    create_in_parallel(kube_cluster, key_secrets(ns, STORED + 1))
    every_quota = quotas(ns, STORED + 1)
    create_in_parallel(kube_cluster, every_quota[:STORED])
    client = new_client_from_config(config_file=str(operator_kubeconfig))  # type: ignore[no-untyped-call]
    api = KubeApi(client)
    memo = operator_memo(cast(Any, api))
    try:
        view = StartupView(api, (ns,), page=100)
        assert await view.begin()
        create_in_parallel(kube_cluster, every_quota[STORED:])  # after the first page
        view.start(lambda world: startup.pass_listed(world, memo, LOG, view.term))
        await view.settled()
        assert view.state == "done"
        startup_document = published(kube_cluster, ns)
        assert startup_document is not None
        assert len(startup_document.tenants) == STORED  # from 3 pages of one snapshot

        # Kopf lists now (after the startup hook): its indexes hold the later quota too.
        key = (ns, POLICY)
        policy = api.get_policy(*key)
        assert policy is not None
        indexes = runtime.indexes(memo)
        indexes.policies[key] = cast(Any, [policy])  # type: ignore[index]
        indexes.quotas[key] = cast(Any, api.list_quotas(ns))  # type: ignore[index]
        runtime.listing(memo).mark_complete(lambda: STORED + 2)
        await run_pass(key, memo, LOG)
        later = published(kube_cluster, ns)
        assert later is not None
        assert len(later.tenants) == STORED + 1
    finally:
        await runtime.reconciler(memo).close()
        client.close()
