"""Kopf's initial listing: no pass before it is over, and a listing that costs O(n).

Behaviours under test, without a cluster (Kopf's own ``ToggleSet``, the operator's handlers and
resync round called as Kopf calls them):

- Kopf's index pre-population as the operator runs it (:func:`.listing.linear_index_prepopulation`,
  applied when the handlers are imported): 2,000 objects listed, one toggle each, each worker
  dropping its toggle and waiting for the set as Kopf's workers do; none is released before the
  last toggle goes, then each is woken about once (Kopf 1.45 woke every waiter at every toggle
  made or dropped: 4,000 wake-ups of up to 2,000 waiters here, quadratic in the objects), at
  most ``RELEASE_BATCH`` per loop iteration (Kopf woke all 2,000 in one: with 10,000 objects
  the loop held ~6 s, and the Lease's renewal starved);
- the other waits on such sets behave as before: a set of ``any`` (Kopf's pause) wakes its
  waiters when a toggle of it is turned on or off, or dropped;
- the resync round (also a new leader's first pass) makes no pass and forgets no recorded
  generation while the listing is not over; once an event handler was called (Kopf calls none
  before every index is complete), it passes every policy;
- every event handler marks the listing over before anything else, and asks for its policy's
  pass without waiting for it: 1,000 events during a pass bring one more pass; a failed pass
  does not stop the next.

The process-level proof (``kopf run`` over 2,000 quotas: the first document holds every tenant)
is ``test_operator_run_scale.py``; the figures are ``bench/bench_operator_run.py``'s.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from typing import Any, cast

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.structs import bodies, ephemera, patches, references
from kopf._core.actions import invocation
from kopf._core.intents import causes

from tokenfair_operator import handlers, listing, passes, resync, runtime
from tokenfair_operator.indexes import Indexes
from tokenfair_operator.listing import Listing
from tokenfair_operator.passes import PASSES, EventPasses, event_passes
from tokenfair_operator.reconcile import Reconciler
from tokenfair_operator.views import PolicyView, QuotaView

OBJECTS = 2_000
LOG = logging.getLogger("test")
POOL = ("ns", "pool")
SPEC: dict[str, Any] = {
    "policyName": "pool",
    "weight": 1.0,
    "burstServiceTokens": 1000,
    "sustainedServiceTokensPerSecond": 100.0,
}


def counted(toggle_set: aiotoggles.ToggleSet) -> list[int]:
    """Counts the waiters the set's condition is asked to wake (``notify(n)``: n;
    ``notify_all``: every waiter)."""
    woken = [0]
    condition = toggle_set._condition
    notify, notify_all = condition.notify, condition.notify_all

    def counting(n: int = 1) -> None:
        woken[0] += n
        notify(n)

    def counting_all() -> None:
        woken[0] += len(condition._waiters)
        notify_all()

    condition.notify = counting  # type: ignore[method-assign]
    condition.notify_all = counting_all  # type: ignore[method-assign]
    return woken


async def test_kopf_wakes_the_listing_waiters_once_in_batches_when_the_last_is_indexed() -> None:
    assert getattr(aiotoggles.ToggleSet, listing.PATCHED)  # importing the handlers applied it
    operator_indexed = aiotoggles.ToggleSet(all)  # as Kopf's orchestrator makes it
    resource_listed = await operator_indexed.make_toggle(name="tenantquotas")
    woken = counted(operator_indexed)
    iteration = [0]

    async def ticker() -> None:  # one step per loop iteration: counts them
        while True:
            iteration[0] += 1
            await asyncio.sleep(0)

    released: list[int] = []  # the iteration each worker went on in

    async def worker(toggle: aiotoggles.Toggle) -> None:  # kopf's processing.py
        await operator_indexed.drop_toggle(toggle)  # indexed
        await operator_indexed.wait_for(True)  # every other object and resource too
        released.append(iteration[0])

    workers = []
    for i in range(OBJECTS):  # kopf's queueing.watcher: a toggle per listed object
        toggle = await operator_indexed.make_toggle(name=f"object-{i}")
        workers.append(asyncio.create_task(worker(toggle)))
    ticking = asyncio.create_task(ticker())
    for _ in range(3):
        await asyncio.sleep(0)  # every worker indexed and waiting
    assert released == []
    assert woken == [0]  # Kopf 1.45: every waiter woken at each of 4,000 toggles made, dropped

    await operator_indexed.drop_toggle(resource_listed)  # the listing is over
    await asyncio.gather(*workers)
    ticking.cancel()
    assert len(released) == OBJECTS
    assert woken[0] <= OBJECTS + listing.RELEASE_BATCH  # each waiter about once
    per_iteration = collections.Counter(released)
    assert max(per_iteration.values()) <= listing.RELEASE_BATCH  # never all at once
    assert len(per_iteration) >= OBJECTS // listing.RELEASE_BATCH


async def test_other_waits_on_a_toggle_set_are_woken_as_before() -> None:
    paused = aiotoggles.ToggleSet(any)  # Kopf's operator pause
    blocker = await paused.make_toggle(False, name="peering")
    on = asyncio.create_task(paused.wait_for(True))
    await asyncio.sleep(0)
    assert not on.done()
    await blocker.turn_to(True)
    await asyncio.wait_for(on, 5)
    off = asyncio.create_task(paused.wait_for(False))
    await asyncio.sleep(0)
    assert not off.done()
    await paused.drop_toggle(blocker)  # no toggle on: the set is off
    await asyncio.wait_for(off, 5)
    again = asyncio.create_task(paused.wait_for(True))
    await asyncio.sleep(0)
    await paused.make_toggle(True, name="another")
    await asyncio.wait_for(again, 5)


def policy() -> PolicyView:
    return PolicyView("pool", "ns", "pu", 1, "2026-01-01T00:00:00Z", {})


def quota() -> QuotaView:
    return QuotaView("q", "ns", "uq", 1, "2026-01-01T00:00:01Z", SPEC)


def operator_memo() -> kopf.Memo:
    """The operator's memo as the startup hook fills it (no leader election: it leads)."""
    memo = kopf.Memo()
    memo[runtime.GENERATIONS] = {"gone": (1, False)}
    memo[runtime.LISTING] = Listing()
    memo[runtime.INDEXES] = Indexes(
        cast(Any, {POOL: [policy()]}), cast(Any, {POOL: [quota()]}), cast(Any, {})
    )
    memo[runtime.RECONCILER] = Reconciler(cast(Any, None))  # no key Secret: no API call
    memo[PASSES] = EventPasses(memo)
    return memo


async def test_no_resync_pass_before_the_listing_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, str]] = []

    async def recorded(key: tuple[str, str], memo: kopf.Memo, logger: kopf.Logger) -> None:
        made.append(key)

    monkeypatch.setattr(resync, "run_pass", recorded)
    memo = operator_memo()
    resync_round = resync.resync_round(memo, LOG, runtime.indexes(memo))

    await resync_round()  # Kopf still listing: the indexes may hold part of the objects
    assert made == []
    assert runtime.generations(memo) == {"gone": (1, False)}  # nothing pruned from half a view

    runtime.listing(memo).mark_complete(lambda: 2)  # the first event handler's call
    await resync_round()
    assert made == [POOL]
    assert runtime.generations(memo) == {}
    await runtime.reconciler(memo).close()


@pytest.mark.parametrize("handler", ["quota_event", "policy_event", "sidecar_changed"])
async def test_every_event_handler_marks_the_listing_over(
    handler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, str]] = []

    async def recorded(key: tuple[str, str], memo: kopf.Memo, logger: kopf.Logger) -> None:
        assert runtime.listing(memo).is_complete  # marked before the pass is asked for
        asked.append(key)

    monkeypatch.setattr(passes, "run_pass", recorded)
    monkeypatch.setattr(handlers, "sidecars_moved", lambda key, memo: True)
    memo = operator_memo()
    raw = {"metadata": {"uid": "u", "generation": 1, "name": "pool", "namespace": "ns"}}
    kwargs: dict[str, Any] = {
        "type": None,
        "event": {"type": None, "object": raw},
        "body": kopf.Body(cast(Any, raw)),
        "namespace": "ns",
        "name": "pool",
        "spec": SPEC,
        "labels": {"tokenfair.io/policy": "pool"},
        "memo": copy.copy(memo),  # each object's handlers get a copy (Kopf)
        "logger": LOG,
    }
    await getattr(handlers, handler)(**kwargs)
    assert runtime.listing(memo).is_complete
    await event_passes(memo).drain()
    assert asked == [POOL]
    await runtime.reconciler(memo).close()


async def test_events_ask_for_passes_without_waiting_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler returns at once (Kopf then indexes its object's next events); 1,000 events
    arriving while a pass runs bring one more pass, not 1,000; a failed pass is logged and
    the next event's pass runs."""
    held = asyncio.Event()
    started: list[tuple[str, str]] = []

    async def held_pass(key: tuple[str, str], memo: kopf.Memo, logger: kopf.Logger) -> None:
        started.append(key)
        if len(started) == 1:
            await held.wait()
        if len(started) == 3:
            raise RuntimeError("a pass failed")

    monkeypatch.setattr(passes, "run_pass", held_pass)
    memo = operator_memo()
    queue = event_passes(memo)
    queue.ask(POOL, LOG)
    await asyncio.sleep(0)
    assert started == [POOL]  # running, held
    for _ in range(1_000):
        queue.ask(POOL, LOG)  # returns at once
    assert started == [POOL]
    held.set()
    await queue.drain()
    assert started == [POOL, POOL]
    queue.ask(POOL, LOG)  # this one fails
    await queue.drain()
    queue.ask(POOL, LOG)
    await queue.drain()
    assert started == [POOL] * 4
    await queue.close()
    await runtime.reconciler(memo).close()


async def test_kopf_lists_gently_while_the_startup_view_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the startup view lists and passes (``yield_while``), Kopf's watcher pauses after
    each batch of listed objects as long as the batch took (capped); otherwise it only lets
    the loop turn (a zero sleep), as before."""
    slept: list[float] = []
    real_sleep = asyncio.sleep
    ticks = iter(range(1_000_000))

    async def recorded(delay: float, *args: Any) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 0.0005)
    working = [True]
    listing.yield_while(lambda: working[0])
    try:
        toggles = aiotoggles.ToggleSet(all)
        for i in range(3 * listing.RELEASE_BATCH):
            await toggles.make_toggle(name=f"object-{i}")
        assert len(slept) == 3
        assert slept[0] == 0  # no batch timed before the first pause
        assert all(0 < s <= listing.MAX_YIELD_S for s in slept[1:])
        working[0] = False  # the view's passes are over
        for i in range(listing.RELEASE_BATCH):
            await toggles.make_toggle(name=f"later-{i}")
        assert slept[3:] == [0]
    finally:
        listing.yield_while(lambda: False)


@pytest.mark.parametrize("handler", ["quota_event", "policy_event"])
@pytest.mark.parametrize("event_type", [None, "ADDED", "MODIFIED", "DELETED"])
async def test_the_event_handlers_read_the_type_kopf_gives_them(
    handler: str, event_type: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Called the way Kopf calls them (its own watching cause and invocation: the kwargs a
    # handler gets are Kopf's, not ours), for the initial listing (None) and each event type:
    # `news` must see the type, or a deletion would not count as news.
    seen: list[str | None] = []

    def recorded_news(memo: kopf.Memo, event_type: str | None, body: kopf.Body) -> bool:
        seen.append(event_type)
        return False

    monkeypatch.setattr(handlers, "news", recorded_news)
    raw = {
        "metadata": {"uid": "u", "generation": 1, "name": "pool", "namespace": "ns"},
        "spec": {"policyName": "pool"},
    }
    cause = causes.detect_watching_cause(
        raw_event=cast(bodies.RawEvent, {"type": event_type, "object": raw}),
        body=bodies.Body(cast(Any, raw)),
        resource=references.Resource("tokenfair.io", "v1alpha1", "x"),
        logger=LOG,
        patch=patches.Patch(),
        memo=copy.copy(operator_memo()),
        indices=cast(ephemera.Indices, {}),
    )
    await invocation.invoke(getattr(handlers, handler), kwargsrc=cause)
    assert seen == [event_type]
