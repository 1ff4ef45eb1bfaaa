"""Conditions and status the operator writes, and the replica-aware budget split.

Behaviours under test (pure functions, called directly):

- ``conditions_for``: ``Ready`` is true only when ``Accepted`` and ``ConfigPublished`` are, and
  otherwise carries the first false condition's reason and message; ``lastTransitionTime``
  changes only when a condition's status changes; each condition carries observedGeneration;
- ``quota_status``/``policy_status``: observedGeneration, configVersion, tenant id, counts and
  the documented reasons (Published, NotAccepted, PolicyNotFound, NoAcceptedTenants,
  InvalidSpec); an unchanged world yields an identical status (so nothing is written);
- ``split_budgets``: per-replica burst ``max(1, burst // n)`` and sustained ``sustained / n``;
- a cold key cache (a new leader) takes the digests of the quotas published at their
  generation from the stored document and reads only the others' key Secrets, rendering the
  same document;
- the reconciler's background status writes (a fake API): a pass publishes the document and
  returns with its quotas' statuses still queued; queued writes are coalesced per object (the
  newest pass's, over its resourceVersion) and a quota deleted meanwhile is never written; a
  snapshot older than our own write (a lagging watch) makes no second write; ``NotLeader``
  drops every queued write; a 409 drops the write and brings one more pass, which writes over
  the newer resourceVersion; ``drain()`` also waits for a write queued as the last one finishes;
- what the reconciler keeps per object and per policy is pruned on churn: policies and quotas
  coming and going for 12 rounds leave exactly what exists in every table (nothing once all is
  gone), a resync read racing a deletion and a status write landing after its quota left are
  not kept; the handlers' recorded generations go with objects no index holds;
- a pass reads new key Secrets from the watch cache as it is, the resync's re-read at the
  resourceVersion of etcd now (quorum reads when that cannot be had).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import logging
import threading
from typing import Any, cast

import kopf
import pytest
from kubernetes.client import ApiException

from tokenfair.config import TenantConfig, document_text, loads_config
from tokenfair_operator import (
    Check,
    PolicyView,
    QuotaView,
    conditions_for,
    policy_status,
    prefetch,
    quota_status,
    reconcile,
    render_config,
    runtime,
    split_budgets,
)
from tokenfair_operator.kube import NotLeader
from tokenfair_operator.passes import news
from tokenfair_operator.reconcile import Reconciler, Written
from tokenfair_operator.render import KeyLookup
from tokenfair_operator.resync import prune_generations
from tokenfair_operator.status import differs, orphan_verdict
from tokenfair_operator.views import SidecarView

T1, T2 = "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"
OK_A = Check("Accepted", True, "Valid", "accepted")
OK_P = Check("ConfigPublished", True, "Published", "in version v1")
SPEC: dict[str, Any] = {
    "policyName": "pool",
    "weight": 1.0,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100.0,
}


def by_type(conditions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conditions}


def test_ready_when_both_true() -> None:
    got = by_type(conditions_for(OK_A, OK_P, generation=3, previous=[], now=T1))
    assert got["Ready"]["status"] == "True"
    assert got["Ready"]["reason"] == "Ready"
    assert got["Ready"]["message"] == "in version v1"
    assert {c["observedGeneration"] for c in got.values()} == {3}
    assert {c["lastTransitionTime"] for c in got.values()} == {T1}


def test_ready_false_carries_the_first_failure() -> None:
    refused = Check("Accepted", False, "DuplicateTenantId", "id taken")
    unpublished = Check("ConfigPublished", False, "NotAccepted", "id taken")
    got = by_type(conditions_for(refused, unpublished, generation=1, previous=[], now=T1))
    assert (got["Ready"]["status"], got["Ready"]["reason"]) == ("False", "DuplicateTenantId")
    got = by_type(conditions_for(OK_A, unpublished, generation=1, previous=[], now=T1))
    assert (got["Ready"]["status"], got["Ready"]["reason"]) == ("False", "NotAccepted")


def test_transition_time_moves_only_on_status_change() -> None:
    first = conditions_for(OK_A, OK_P, generation=1, previous=[], now=T1)
    # Same statuses (a new message even): times stay.
    again = conditions_for(
        OK_A,
        Check("ConfigPublished", True, "Published", "v2"),
        generation=2,
        previous=first,
        now=T2,
    )
    assert {c["lastTransitionTime"] for c in again} == {T1}
    refused = Check("Accepted", False, "InvalidSpec", "bad")
    flipped = by_type(
        conditions_for(
            refused,
            Check("ConfigPublished", False, "NotAccepted", "bad"),
            generation=3,
            previous=again,
            now=T2,
        )
    )
    assert {c["lastTransitionTime"] for c in flipped.values()} == {T2}


def quota(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> QuotaView:
    return QuotaView("q", "ns", "u", 4, T1, spec or SPEC, status or {})


def policy(status: dict[str, Any] | None = None) -> PolicyView:
    return PolicyView("pool", "ns", "pu", 2, T1, {}, status or {})


def test_quota_status_published_and_stable() -> None:
    rendering = render_config(policy(), [quota()], {})
    status = quota_status(quota(), rendering.verdicts["q"], rendering, now=T1)

    assert status["observedGeneration"] == 4
    assert status["tenantId"] == "q"  # no spec.tenantId: the object's name
    assert status["configVersion"] == rendering.version
    assert by_type(status["conditions"])["ConfigPublished"]["reason"] == "Published"
    # Recomputed later over the stored status: identical, so the reconciler writes nothing.
    later = quota_status(quota(status=status), rendering.verdicts["q"], rendering, now=T2)
    assert later == status
    assert not differs(status, later)


def test_orphan_quota_status() -> None:
    status = quota_status(quota(), orphan_verdict(quota()), None, now=T1)
    ready = by_type(status["conditions"])["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "PolicyNotFound")
    assert "SchedulingPolicy 'pool' does not exist" in ready["message"]
    assert status["configVersion"] == ""


def test_policy_status_counts_and_reasons() -> None:
    bad = QuotaView("bad", "ns", "b", 1, T2, {**SPEC, "weight": 0})
    rendering = render_config(policy(), [quota(), bad], {})
    status = policy_status(policy(), rendering, now=T1)

    assert status["tenants"] == 1
    assert status["configVersion"] == rendering.version
    assert status["configMapName"] == "tokenfair-pool"
    assert status["secretName"] == "tokenfair-pool-keys"
    assert status["budgetShares"] == 1
    assert "1 TenantQuota(s) refused" in by_type(status["conditions"])["Ready"]["message"]

    empty = policy_status(policy(status), render_config(policy(), [bad], {}), now=T2)
    ready = by_type(empty["conditions"])["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "NoAcceptedTenants")
    assert empty["configVersion"] == rendering.version  # the last published one stays


def test_policy_status_invalid_spec() -> None:
    bad_policy = PolicyView("pool", "ns", "pu", 5, T1, {"batchKvWatermark": 0.99})
    status = policy_status(bad_policy, render_config(bad_policy, [quota()], {}), now=T1)
    accepted = by_type(status["conditions"])["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "batchKvWatermark" in accepted["message"]


LESSON_CHAT = TenantConfig("tenant_chat_pro", 2.0, 48_000, 180_000.0, "interactive", ("c" * 64,))


@pytest.mark.parametrize(
    ("replicas", "burst", "sustained"),
    [
        (1, 48_000, 180_000.0),
        (0, 48_000, 180_000.0),  # no ready pod yet: the first gets the whole quota
        (3, 16_000, 60_000.0),  # 48000 / 3, 180000 / 3
        (7, 6_857, 180_000.0 / 7),  # floor(48000 / 7) = 6857; 7 * 6857 = 47999 <= 48000
        (100_000, 1, 1.8),  # burst < n: each replica still holds 1 token
    ],
)
def test_split_budgets(replicas: int, burst: int, sustained: float) -> None:
    share = split_budgets(LESSON_CHAT, replicas)
    assert share.burst_service_tokens == burst
    assert share.sustained_service_tokens_per_second == pytest.approx(sustained)
    assert (share.weight, share.api_key_sha256) == (LESSON_CHAT.weight, LESSON_CHAT.api_key_sha256)


# --- The background status writer (reconcile.Reconciler + StatusWriter), with a fake API. ---


class FakeApi:
    """The calls a pass makes; quota status writes wait for ``gate`` (a test holds them)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.leading = True
        self.conflicts: set[str] = set()
        """Names whose next quota status write is a 409."""
        self.published: list[str] = []
        self.key_reads: list[str] = []
        self.read_versions: list[str] = []
        """The resourceVersion of each bulk key read: "0" the watch cache, "" quorum."""
        self.version: str | None = "100"
        """What ``fresh_version`` answers (None: it fails; "": the watch cache lags)."""
        self.probes = 0
        self.stored_keys: dict[str, tuple[str, ...]] = {}
        """What ``published_keys`` answers: the document stored in the policy's Secret."""
        self.writes: list[tuple[str, str, str, dict[str, Any]]] = []
        """(plural, name, resourceVersion, status) of each status written."""

    def may_write(self) -> bool:
        return self.leading

    def key_hashes(self, namespace: str, name: str, fresh: bool = False) -> tuple[str, ...]:
        self.key_reads.append(name)
        return (hashlib.sha256(name.encode()).hexdigest(),)

    def key_hashes_many(
        self, secrets: list[tuple[str, str]], resource_version: str = "0"
    ) -> list[tuple[str, ...]]:
        self.read_versions.append(resource_version)
        return [self.key_hashes(ns, name) for ns, name in secrets]

    def fresh_version(self, namespace: str, probe: str) -> str:
        self.probes += 1
        if self.version is None:
            raise ApiException(status=403, reason="Forbidden")
        return self.version

    def published_keys(self, policy: PolicyView) -> dict[str, tuple[str, ...]]:
        return self.stored_keys

    def get_policy(self, namespace: str, name: str) -> None:
        return None

    def publish_document(
        self, policy: PolicyView, version: str, configmap: bytes, secret: bytes
    ) -> tuple[int, list[str]]:
        self.published.append(version)
        return len(self.published), ["ConfigMap", "Secret"]

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> str:
        """Records the write; returns "" (no resourceVersion: see :class:`VersionedApi`)."""
        if plural == "tenantquotas":
            assert self.gate.wait(10), "the test never opened the gate"
        if not self.leading:
            raise NotLeader(f"not the leader: status of {name} not written")
        if plural == "tenantquotas" and name in self.conflicts:
            self.conflicts.discard(name)
            raise ApiException(status=409, reason="Conflict")
        self.writes.append((plural, name, resource_version, status))
        return ""

    def quota_writes(self) -> list[tuple[str, str]]:
        return [(name, rv) for plural, name, rv, _ in self.writes if plural == "tenantquotas"]


LOG = logging.getLogger("test")
POOL = ("ns", "pool")


def keyed_quota(i: int, generation: int = 1, rv: str = "1") -> QuotaView:
    spec = {**SPEC, "weight": float(generation), "apiKeySecretRef": {"name": f"key-{i}"}}
    created = f"2026-01-01T00:00:{i:02d}Z"
    return QuotaView(f"q{i}", "ns", f"uid-{i}", generation, created, spec, resource_version=rv)


def stored(reconciler: Reconciler, quota: QuotaView, api: FakeApi) -> QuotaView:
    """``quota`` as the watch brings it back after our write (resourceVersion + 1)."""
    status = next(s for p, n, _, s in reversed(api.writes) if n == quota.name)
    rv = str(int(quota.resource_version) + 1)
    return dataclasses.replace(quota, status=status, resource_version=rv)


async def test_a_pass_publishes_before_its_quota_statuses_are_written() -> None:
    api = FakeApi()
    api.gate.clear()  # every quota status write waits
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    quotas = [keyed_quota(i) for i in range(20)]
    try:
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)

        document = reconciler.documents.get(POOL)
        assert document is not None
        assert api.published == [document.version]
        assert [p for p, *_ in api.writes] == ["schedulingpolicies"]  # no quota's yet
        assert len(reconciler.statuses) == 20
        api.gate.set()
        await reconciler.drain()
        assert sorted(api.quota_writes()) == sorted((q.name, "1") for q in quotas)
        assert len(reconciler.statuses) == 0
    finally:
        await reconciler.close()


async def test_queued_writes_are_coalesced_and_a_deleted_quota_is_skipped() -> None:
    api = FakeApi()
    api.gate.clear()
    reconciler = Reconciler(api, status_concurrency=1)  # type: ignore[arg-type]
    quotas = [keyed_quota(i) for i in range(6)]
    try:
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)
        await asyncio.sleep(0)  # the one worker takes q0 and waits at the gate
        # q5 deleted, q3's spec changed (generation 2, a new resourceVersion): a new pass.
        changed = keyed_quota(3, generation=2, rv="7")
        await reconciler.reconcile(POOL, [policy()], [*quotas[:3], changed, quotas[4]], LOG)
        api.gate.set()
        await reconciler.drain()

        assert api.quota_writes() == [("q0", "1"), ("q1", "1"), ("q2", "1"), ("q3", "7"),
                                      ("q4", "1")]  # fmt: skip
        q3 = next(s for _, n, _, s in api.writes if n == "q3")
        assert q3["observedGeneration"] == 2
    finally:
        await reconciler.close()


async def test_a_lagging_watch_makes_no_second_write() -> None:
    api = FakeApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    first = [keyed_quota(i) for i in range(3)]
    try:
        await reconciler.reconcile(POOL, [policy()], first, LOG)
        await reconciler.drain()
        written = len(api.quota_writes())
        # A fourth quota: a new document. The watch has not brought our writes back (the same
        # snapshots): their statuses keep their first configVersion, nothing is rewritten (each
        # rewrite over the old resourceVersion would be a 409).
        await reconciler.reconcile(POOL, [policy()], [*first, keyed_quota(3)], LOG)
        await reconciler.drain()

        assert api.published[0] != api.published[1]
        assert api.quota_writes()[written:] == [("q3", "1")]
        # Once the watch brought them back, still nothing to write.
        caught_up = [stored(reconciler, q, api) for q in [*first, keyed_quota(3)]]
        before = len(api.quota_writes())
        await reconciler.reconcile(POOL, [policy()], caught_up, LOG)
        await reconciler.drain()
        assert api.quota_writes()[before:] == []
    finally:
        await reconciler.close()


class VersionedApi(FakeApi):
    """:class:`FakeApi` whose status writes are conditional as the API server's: every object
    has a resourceVersion (1 at first), a write over any other is a 409, a write returns the
    new one."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: dict[str, int] = {}

    def patch_status(
        self, plural: str, namespace: str, name: str, status: Any, resource_version: str = ""
    ) -> str:
        current = self.versions.setdefault(name, 1)
        if resource_version and resource_version != str(current):
            raise ApiException(status=409, reason="Conflict")
        super().patch_status(plural, namespace, name, status, resource_version)
        self.versions[name] = current + 1
        return str(current + 1)


async def test_back_to_back_passes_write_over_their_own_last_write() -> None:
    """Quotas arriving one after another (a bulk apply), each pass over a snapshot in which
    the watch has not brought the policy's status back yet (the policy as listed, version 1):
    each pass writes its new tenant count over the version the previous pass's write got, so
    none loses a race (a 409, a retried pass) against our own last write."""
    api = VersionedApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    listed = dataclasses.replace(policy(), resource_version="1")
    arrived: list[QuotaView] = []
    try:
        for i in range(1, 4):
            arrived.append(keyed_quota(i))
            await reconciler.reconcile(POOL, [listed], list(arrived), LOG)
        writes = [(rv, s["tenants"]) for p, _, rv, s in api.writes if p == "schedulingpolicies"]
        assert writes == [("1", 1), ("2", 2), ("3", 3)]
        # The watch catches up with the first write only: the chain still holds.
        caught_up = dataclasses.replace(listed, resource_version="2", status=api.writes[0][3])
        arrived.append(keyed_quota(4))
        await reconciler.reconcile(POOL, [caught_up], list(arrived), LOG)
        last = [(rv, s["tenants"]) for p, _, rv, s in api.writes if p == "schedulingpolicies"]
        assert last[-1] == ("4", 4)
    finally:
        await reconciler.close()


async def test_key_secrets_read_during_the_listing_serve_the_first_pass() -> None:
    """Key Secrets of quotas indexed during Kopf's listing are read in the background
    (:mod:`.prefetch`); the first pass takes them and reads only the others; a quota already
    published at its generation is not read (its digests come from the stored document); what
    no pass took is dropped at the resync; stepping down forgets it all."""
    api = FakeApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    published = dataclasses.replace(
        keyed_quota(9),
        status={
            "configVersion": "v",
            "conditions": [{"type": "ConfigPublished", "status": "True", "observedGeneration": 1}],
        },
    )
    listed = [keyed_quota(i) for i in range(1, 6)]
    try:
        reconciler.prefetch_keys([*listed, published, keyed_quota(8)])
        await reconciler.prefetch.claim(())  # the background read is over
        assert sorted(api.key_reads) == ["key-1", "key-2", "key-3", "key-4", "key-5", "key-8"]
        api.key_reads.clear()

        await reconciler.reconcile(POOL, [policy()], [*listed, keyed_quota(6)], LOG)

        assert api.key_reads == ["key-6"]  # the rest came from the listing's reads
        document = reconciler.documents.get(POOL)
        assert document is not None
        assert len(reconciler.prefetch) == 1  # key-8: its quota went before any pass
        reconciler.prefetch.drop_unclaimed()
        assert len(reconciler.prefetch) == 0
        reconciler.prefetch_keys([keyed_quota(7)])
        reconciler.step_down()
        assert len(reconciler.prefetch) == 0
    finally:
        await reconciler.close()


async def test_the_rollout_is_not_written_while_a_pass_of_its_policy_runs() -> None:
    """The usage loop's rollout write would move the policy's resourceVersion under a running
    pass, whose own status write would then lose (409, a retried pass): it waits for the next
    round instead."""
    api = FakeApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    try:
        async with reconciler._lock(POOL):  # a pass of the policy runs
            await reconciler.write_rollout(POOL, policy(), 0, [])
        assert api.writes == []
        await reconciler.write_rollout(POOL, policy(), 0, [])
        assert [(p, s["sidecars"]) for p, _, _, s in api.writes] == [
            ("schedulingpolicies", "0/0 @ -")
        ]
    finally:
        await reconciler.close()


async def test_not_leader_drops_every_queued_write() -> None:
    api = FakeApi()
    api.gate.clear()
    reconciler = Reconciler(api, status_concurrency=1)  # type: ignore[arg-type]
    try:
        await reconciler.reconcile(POOL, [policy()], [keyed_quota(i) for i in range(5)], LOG)
        api.leading = False  # stepped down while the writes were queued
        api.gate.set()
        await reconciler.drain()

        assert api.quota_writes() == []
        assert len(reconciler.statuses) == 0
    finally:
        await reconciler.close()


async def test_a_conflict_drops_the_write_and_asks_for_one_more_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reconcile, "CONFLICT_DELAY_S", 0.0)
    api = FakeApi()
    api.conflicts = {"q1"}  # someone else wrote q1 since our snapshot
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    world = [keyed_quota(i) for i in range(3)]
    passes = 0

    def snapshot() -> tuple[list[PolicyView], list[QuotaView], list[Any]]:
        nonlocal passes
        passes += 1
        if passes == 1:
            return [policy()], world, []
        # The retry pass: the watch has brought q1 as the other writer left it.
        return [policy()], [world[0], keyed_quota(1, rv="5"), world[2]], []

    try:
        await reconciler.request(POOL, snapshot, LOG)
        await reconciler.drain()
        while reconciler._retries:  # the pass after the conflict, and its writes
            await asyncio.gather(*reconciler._retries.values())
            await reconciler.drain()

        assert passes == 2
        assert sorted(api.quota_writes()) == [("q0", "1"), ("q1", "5"), ("q2", "1")]
    finally:
        await reconciler.close()


async def test_drain_waits_for_writes_queued_as_the_last_one_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interleaving that once made the test above miss q1's second write: the pass after
    q1's conflict runs while q2 is being written and resumes from its last call in the same
    loop step as q2's write finishes. It queues q1's write and ends (leaving ``_retries``)
    after the queue's count of unfinished writes reached zero (which woke ``drain()``) but
    before ``drain()`` resumed: ``drain()`` must still wait for that write. Forced on the
    loop (the API calls run inline, two events order them), with no timing involved."""
    monkeypatch.setattr(reconcile, "CONFLICT_DELAY_S", 0.0)
    api = FakeApi()
    api.conflicts = {"q1"}
    # One writer, unpaced: q0, then q1 (the 409), then q2, in order.
    reconciler = Reconciler(
        api,  # type: ignore[arg-type]
        clock=lambda: T1,
        status_concurrency=1,
        status_writes_per_second=float("inf"),
    )
    world = [keyed_quota(i) for i in range(3)]
    passes = 0
    retry_publishing = asyncio.Event()
    publish_may_finish = asyncio.Event()

    async def call(fn: Any, *args: Any) -> Any:
        """The API call inline (on the loop); the retry pass's publish waits until q2's write
        lets it finish, and q2's write waits until the retry pass is publishing."""
        if fn == api.publish_document and passes == 2:
            retry_publishing.set()
            await publish_may_finish.wait()
        if fn == api.patch_status and args[2] == "q2":
            await retry_publishing.wait()
            publish_may_finish.set()  # both resume in the step of q2's last task_done()
        return fn(*args)

    monkeypatch.setattr(reconciler, "_call", call)

    def snapshot() -> tuple[list[PolicyView], list[QuotaView], list[Any]]:
        nonlocal passes
        passes += 1
        if passes == 1:
            return [policy()], world, []
        return [policy()], [world[0], keyed_quota(1, rv="5"), world[2]], []

    try:
        await reconciler.request(POOL, snapshot, LOG)
        await reconciler.drain()

        assert passes == 2
        assert not reconciler._retries  # the pass after the conflict is over...
        assert len(reconciler.statuses) == 0  # ...and drain() waited for its write
        assert api.quota_writes() == [("q0", "1"), ("q2", "1"), ("q1", "5")]
    finally:
        await reconciler.close()


async def test_a_cold_cache_starts_from_the_stored_document() -> None:
    api = FakeApi()
    quotas = [keyed_quota(i) for i in range(4)]
    first = Reconciler(api)  # type: ignore[arg-type]
    try:
        await first.reconcile(POOL, [policy()], quotas, LOG)
        await first.drain()
    finally:
        await first.close()
    document = first.documents.get(POOL)
    assert document is not None
    stored_doc = loads_config(document_text(document.secret_payload))
    api.stored_keys = {t.tenant_id: t.api_key_sha256 for t in stored_doc.tenants}
    api.key_reads.clear()
    # A new leader: q0-q2 as the watch shows them (published at their generation), q3 without
    # its status yet (it could be new or changed): only q3's key Secret is read.
    world = [stored(first, q, api) for q in quotas[:3]] + [quotas[3]]
    second = Reconciler(api)  # type: ignore[arg-type]
    try:
        await second.reconcile(POOL, [policy()], world, LOG)
        await second.drain()
    finally:
        await second.close()

    assert api.key_reads == ["key-3"]
    again = second.documents.get(POOL)
    assert again is not None
    assert again.version == document.version  # the same digests: the same document


# --- What the reconciler keeps per object and per policy: pruned on churn. ---


def policy_named(name: str) -> PolicyView:
    return PolicyView(name, "ns", f"pu-{name}", 1, T1, {})


def member(i: int, policy_name: str, secret: str | None = None) -> QuotaView:
    """Quota ``q<i>`` of ``policy_name`` (a uid of its own) with key Secret ``secret``."""
    spec = {**SPEC, "policyName": policy_name, "apiKeySecretRef": {"name": secret or f"key-{i}"}}
    return QuotaView(f"q{i}", "ns", f"uid-{i}", 1, T1, spec, resource_version="1")


def kept(reconciler: Reconciler) -> dict[str, int]:
    """How many entries each of the reconciler's per-object and per-policy tables holds."""
    tables = ("_locks", "_replicas", "_requested", "_served", "_written", "_keys", "_seeded",
              "_unprotected", "_snapshots", "_conflicts", "_retries", "_members", "_key_refs",
              "_key_users", "_waiting", "_gone")  # fmt: skip
    return {name: len(getattr(reconciler, name)) for name in tables}


async def test_churned_objects_leave_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Policies and quotas come and go (with key Secrets, statuses, an unprotected Pod, rollout
    gauges): the reconciler's tables hold what exists now, and nothing once it is all gone."""
    monkeypatch.setattr(kopf, "warn", lambda *_, **__: None)  # the unprotected Pod's Event
    api = FakeApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    stay = ("ns", "stay")
    uninjected = SidecarView(ready=True, address=None, name="pod-0", injected=False)
    try:
        for round_ in range(12):
            # One policy that stays, its quotas replaced every round (new uids and Secrets)...
            stay_quotas = [member(1000 * round_ + i, "stay") for i in range(5)]
            await reconciler.reconcile(stay, [policy_named("stay")], stay_quotas, LOG)
            # ...and one that lives for this round only, through request() (tickets, lock).
            key = ("ns", f"short-{round_}")
            short = policy_named(key[1])
            quotas = [member(1000 * round_ + 100 + i, key[1]) for i in range(5)]
            world: list[Any] = [[short], quotas, [uninjected]]

            def snapshot(w: list[Any] = world) -> Any:
                return tuple(w)

            await reconciler.request(key, snapshot, LOG)
            await reconciler.write_rollout(key, short, 1, [])
            await reconciler.drain()
            await reconciler.refresh_keys([*stay_quotas, *quotas])
            assert len(reconciler._written) == 2 + 5 + 5  # two policies and their quotas

            world[1] = quotas[:2]  # three quotas deleted
            await reconciler.request(key, snapshot, LOG)
            await reconciler.drain()
            world[:] = [[], [], []]  # the policy, its quotas and the Pod gone
            await reconciler.request(key, snapshot, LOG)
            # The resync's re-read runs outside the lock: a Secret read for a quota deleted
            # meanwhile is not kept.
            await reconciler.refresh_keys(quotas)
            await reconciler.drain()

            assert kept(reconciler) == {
                "_locks": 1, "_replicas": 1, "_requested": 0, "_served": 0, "_written": 6,
                "_keys": 5, "_seeded": 1, "_unprotected": 1, "_snapshots": 0, "_conflicts": 0,
                "_retries": 0, "_members": 1, "_key_refs": 1, "_key_users": 5, "_waiting": 0,
                "_gone": 0,
            }  # fmt: skip
            assert set(reconciler._keys) == {("ns", str(q.key_secret)) for q in stay_quotas}
            assert set(reconciler._written) == {"pu-stay", *(q.uid for q in stay_quotas)}
            assert f'policy="{key[1]}"' not in reconciler.metrics.exposition().decode()

        await reconciler.reconcile(stay, [], [], LOG)  # the last policy gone too
        assert kept(reconciler) == dict.fromkeys(kept(reconciler), 0)
    finally:
        await reconciler.close()


async def test_a_status_written_after_its_quota_left_is_not_kept() -> None:
    api = FakeApi()
    api.gate.clear()
    reconciler = Reconciler(api, status_concurrency=1)  # type: ignore[arg-type]
    quotas = [keyed_quota(i) for i in range(2)]
    try:
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)
        await asyncio.sleep(0)  # the one worker takes q0 and waits at the gate
        await reconciler.reconcile(POOL, [policy()], quotas[1:], LOG)  # q0 deleted
        api.gate.set()
        await reconciler.drain()

        assert ("q0", "1") in api.quota_writes()  # it was on its way
        assert set(reconciler._written) == {"pu", "uid-1"}
    finally:
        await reconciler.close()


async def test_the_resync_reads_key_secrets_as_of_now_the_pass_from_the_cache() -> None:
    """A pass reads new key Secrets from the watch cache as it is ("0"); the resync's re-read
    at the resourceVersion of etcd now (or by quorum reads, "", when that cannot be had)."""
    api = FakeApi()
    reconciler = Reconciler(api)  # type: ignore[arg-type]
    quotas = [keyed_quota(i) for i in range(3)]
    try:
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)  # all cached: no read
        assert api.read_versions == ["0"]
        assert not await reconciler.refresh_keys(quotas)
        api.version = None
        assert not await reconciler.refresh_keys(quotas)
        assert api.read_versions == ["0", "100", ""]
        assert api.key_reads == [f"key-{i}" for i in range(3)] * 3
    finally:
        await reconciler.close()


async def test_a_lagging_watch_cache_is_read_by_quorum_without_probing_for_ten_minutes() -> None:
    """A probe that meets a lagging Secret watch cache (its 504: ``""``) makes that namespace's
    re-reads quorum reads for ``LAGGING_CACHE_S`` without asking again (one wait per
    namespace, not one per policy and round); after that the cache is probed again."""
    api = FakeApi()
    now = [1000.0]
    reconciler = Reconciler(api, monotonic=lambda: now[0])  # type: ignore[arg-type]
    quotas = [keyed_quota(i) for i in range(2)]
    try:
        await reconciler.reconcile(POOL, [policy()], quotas, LOG)
        api.version = ""
        await reconciler.refresh_keys(quotas)
        await reconciler.refresh_keys(quotas)
        now[0] += reconcile.LAGGING_CACHE_S - 0.001
        await reconciler.refresh_keys(quotas)
        assert (api.probes, api.read_versions) == (1, ["0", "", "", ""])

        api.version = "100"  # caught up meanwhile
        now[0] += 0.001
        await reconciler.refresh_keys(quotas)
        await reconciler.refresh_keys(quotas)
        assert (api.probes, api.read_versions[4:]) == (3, ["100", "100"])
        assert reconciler._lagging == {}
    finally:
        await reconciler.close()


def test_a_quota_moved_to_another_policy_keeps_what_that_policy_wrote() -> None:
    """A quota that moved from policy A to B: A's next pass (without it) must not forget the
    status B wrote over it (that would make B write it again over a 409)."""
    reconciler = Reconciler(FakeApi())  # type: ignore[arg-type]
    other = ("ns", "other")
    reconciler._remember(POOL, frozenset({"u1", "u2"}))
    reconciler._remember(other, frozenset({"u1"}))  # u1 moved to `other`, which wrote it
    reconciler._written.update(
        {"u1": Written(frozenset({"7"}), {}, "8"), "u2": Written(frozenset({"3"}), {}, "4")}
    )
    reconciler._remember(POOL, frozenset())
    assert set(reconciler._written) == {"u1"}
    reconciler._remember(other, frozenset())
    assert reconciler._written == {}


def test_generations_of_objects_no_index_holds_are_forgotten() -> None:
    """The generations the event handlers record (to skip our own status writes' events) go
    with the DELETED event and, for a deletion whose event never came, at the next resync
    round: only objects an index still holds keep theirs. Kopf gives each object's handlers a
    shallow copy of the operator's memo (``copy.copy``, once per object); the record is the
    one dict the startup hook put in it, so the resync round, on the operator's memo, sees
    what every copy recorded."""

    def body(uid: str) -> kopf.Body:
        raw: dict[str, Any] = {"metadata": {"uid": uid, "generation": 1}}
        return kopf.Body(cast(Any, raw))

    memo = kopf.Memo()
    memo[runtime.GENERATIONS] = {}  # as startup.start does
    copies = {uid: copy.copy(memo) for uid in ("pu", "uid-1", "uid-2", "uid-3")}  # as Kopf
    for uid, objects_memo in copies.items():
        assert news(objects_memo, "ADDED", body(uid))
    assert not news(copies["uid-1"], "MODIFIED", body("uid-1"))  # our own status write's event
    assert news(copies["uid-3"], "DELETED", body("uid-3"))
    assert set(memo[runtime.GENERATIONS]) == {"pu", "uid-1", "uid-2"}
    policies = {("ns", "pool"): [policy()]}
    quotas = {("ns", "pool"): [keyed_quota(1)]}  # uid-2 deleted, its DELETED event missed

    prune_generations(memo, policies, quotas)  # type: ignore[arg-type]

    assert set(memo[runtime.GENERATIONS]) == {"pu", "uid-1"}
    assert all(c[runtime.GENERATIONS] is memo[runtime.GENERATIONS] for c in copies.values())


async def test_the_listing_s_key_reads_gather_a_chunk_per_round() -> None:
    """Kopf indexes one quota at a time: the background read waits for a chunk's worth of
    Secrets (``prefetch.GATHER``) before a round, rather than a round (a hand-off to a thread and
    back) per few Secrets; a pass claiming them reads the rest at once."""
    rounds: list[int] = []

    async def read(secrets: list[tuple[str, str]]) -> list[KeyLookup]:
        rounds.append(len(secrets))
        await asyncio.sleep(0)
        return [("digest",) for _ in secrets]

    # No gathering wait ends by time here (a loaded machine may stall the loop past GATHER_S).
    gathering = prefetch.KeyPrefetch(read, gather_s=3600.0)
    wanted = [("ns", f"key-{i}") for i in range(prefetch.GATHER + 50)]
    for secret in wanted:  # as Kopf indexes them, the loop turning between two
        gathering.ask([secret])
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(rounds) == 1  # one round, once GATHER were asked for (a few more came meanwhile)
    assert rounds[0] >= prefetch.GATHER
    claimed = await gathering.claim(wanted)  # the rest waited for more, or for a pass
    assert len(rounds) == 2
    assert sum(rounds) == len(wanted) == len(claimed)
