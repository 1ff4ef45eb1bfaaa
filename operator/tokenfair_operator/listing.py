"""The initial listing: no pass before Kopf's indexes hold every object, and a listing that
costs O(n) in Kopf rather than O(n²), in steps that leave the event loop to everything else.

**When the view is complete** (:class:`Listing`). At start Kopf lists every watched resource
and feeds each listed object to its index; a pass made meanwhile reads an index that holds
only part of the objects and would publish a document without the tenants not indexed yet
(the sidecars would refuse those tenants' requests until the next pass). Kopf calls no event
handler of any object before every indexed resource is listed and every listed object is in
its index (its "operator indexed" readiness, ``kopf/_core/reactor/processing.py``), and it
offers no other signal; so the first call of any of our event handlers is the moment the
indexes are complete (:meth:`Listing.mark_complete`, called first thing by each handler).
Until then the resync round and a new leader's first pass do nothing
(:func:`.resync.resync_round`); the handlers' own passes, which follow at once, publish the
complete view. Kopf never empties an index when it lists again (a watch re-established), so
the view stays complete from then on. With no object at all, no handler is called and there is
nothing to publish.

**Kopf's index pre-population, made linear** (:func:`linear_index_prepopulation`). While it
lists, Kopf holds each listed object's handlers until every object is indexed: one ``Toggle``
per object in one ``ToggleSet`` (``kopf/_cogs/aiokits/aiotoggles.py``), each worker dropping
its toggle once its object is indexed and then waiting on the set's condition for the set to be
"on". Kopf 1.45 wakes *every* waiter on every toggle made or dropped (``notify_all``), though
the set's state flips only once, when the last toggle goes: with n objects listed that is ~n²/2
wake-ups (each re-taking the condition's lock and re-checking the set), 8.8 s of the event
loop for 8,000 objects and ~15 s for 10,000 on the 2-core test machine before any handler runs,
and with events arriving meanwhile several minutes (issue 33). The replacement methods notify
only when the set's state (``is_on()``) changes, which is all a waiter of the set waits for
(``ToggleSet.wait_for``'s predicate reads the set's state only; a ``Toggle``'s own ``turn_to``
still notifies as before, and making or dropping a toggle changes no other toggle's state):
the same readiness, about n wake-ups.

**Gentle on the event loop.** Linear is not enough: Kopf's watcher dispatched the whole listing
in one loop step (nothing in it suspends), and the n waiters, woken together, each handled its
object's event in the same loop step (~6 s for 10,000), then ended together at Kopf's idle
timeout 5 s later (~4 s more). Nothing else ran meanwhile: the Lease's renewals starved and the
leader stepped down in the middle of its first pass (webhooks and long-polls waited too). So
``make_toggle`` pauses the watcher every :data:`RELEASE_BATCH` toggles, and a change of the
set's state wakes :data:`RELEASE_BATCH` waiters, then as many every :data:`RELEASE_SPACING_S`
(a task of the set's: ``_notify_if_changed``); a waiter of the other state, woken by a batch,
waits again at the back, after every waiter there was, so each is reached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from kopf._cogs.aiokits import aiotoggles

log = logging.getLogger("tokenfair.operator")

PATCHED: Final = "_tokenfair_notifies_on_change"
"""Marks Kopf's ``ToggleSet`` once :func:`linear_index_prepopulation` replaced its methods."""
STATE: Final = "_tokenfair_waiting"
"""Where a ``ToggleSet`` keeps its :class:`_Waiting` (its instance dictionary)."""
RELEASE_BATCH: Final = 100
"""Waiters woken at once when a set's state changed; the next batch :data:`RELEASE_SPACING_S`
later. Each of Kopf's released workers handles its object's event then (~0.3-0.6 ms on the
2-core test machine), so a batch holds the loop ~50 ms, where 10,000 woken at once held it for
~6 s and starved everything else on it (the Lease's renewals: the leader stepped down;
webhooks; long-polls)."""
RELEASE_SPACING_S: Final = 0.05
"""Between two batches of :data:`RELEASE_BATCH`: 10,000 objects' handlers run over ~5 s (the
first pass starts with the first batch and does not wait for the others). Spread in time, not
only over loop iterations: each released worker ends 5 s after its last event (Kopf's idle
timeout), and 10,000 released within one second ended within one iteration again (4 s)."""


MAX_YIELD_S: Final = 0.1
"""The longest pause of Kopf's watcher per :data:`RELEASE_BATCH` listed objects while
:func:`yield_while` holds."""


def _never() -> bool:
    return False


_yield_while: Callable[[], bool] = _never


def yield_while(predicate: Callable[[], bool]) -> None:
    """While ``predicate()`` holds (the startup view lists and passes, :mod:`.startview`),
    Kopf's watcher pauses after each :data:`RELEASE_BATCH` listed objects as long as the
    batch took (at most :data:`MAX_YIELD_S`): its listing costs the event loop, which holds the
    GIL, while the view's pages, key reads and render run in worker threads that each wait up
    to the interpreter's switch interval (5 ms) for the GIL after every blocking read; the
    pauses leave them about half of the process's time. One predicate per process (the last
    one set)."""
    global _yield_while
    _yield_while = predicate


@dataclass
class Listing:
    """Whether Kopf's initial listing is over: every watched resource listed and every listed
    object in its index (see the module docstring). One per operator process, created by the
    startup hook and shared by every object's copy of the memo (:mod:`.runtime`)."""

    complete: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)
    """When the startup hook made it (the listing starts right after)."""

    def mark_complete(self, indexed: Callable[[], int]) -> None:
        """Called by every event handler before it does anything: the first call is the
        moment the indexes are complete (logged, with ``indexed()`` objects); later calls cost
        a flag check."""
        if self.complete.is_set():
            return
        self.complete.set()
        log.info(
            "initial listing over: %d objects indexed in %.1f s; passes may start",
            indexed(),
            time.monotonic() - self.started,
        )

    @property
    def is_complete(self) -> bool:
        return self.complete.is_set()


def linear_index_prepopulation() -> None:
    """Make Kopf's ``ToggleSet`` notify its waiters only when its state changes, and then in
    batches of :data:`RELEASE_BATCH` a loop iteration (see the module docstring). Idempotent.
    Raises RuntimeError if Kopf's ``ToggleSet`` no longer has the parts this relies on (a Kopf
    upgrade changed it: the pin and ``tests/operator/test_operator_listing.py`` say which
    version this was written for)."""
    toggle_set: Any = aiotoggles.ToggleSet
    if getattr(toggle_set, PATCHED, False):
        return
    probe = aiotoggles.ToggleSet(all)
    parts = ("make_toggle", "drop_toggle", "drop_toggles", "wait_for", "is_on")
    for part in (*parts, "_condition", "_toggles"):
        if not hasattr(probe, part):
            raise RuntimeError(f"kopf's ToggleSet has no {part}: cannot make it linear")

    async def make_toggle(
        self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None
    ) -> aiotoggles.Toggle:
        toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
        async with self._condition:
            before = self.is_on()
            self._toggles.add(toggle)
            _notify_if_changed(self, before)
        state = _state(self)
        state.made += 1
        if state.made % RELEASE_BATCH == 0:
            # Kopf's watcher makes one per listed object, in one loop step for the whole
            # listing if nothing suspends it (10,000 objects: seconds): a pause every batch,
            # as long as the batch took while the startup view's work goes on (.startview).
            now = time.perf_counter()
            took = now - state.paused if state.paused else 0.0
            await asyncio.sleep(min(took, MAX_YIELD_S) if _yield_while() else 0)
            state.paused = time.perf_counter()
        return toggle

    async def drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.discard(toggle)
            _notify_if_changed(self, before)

    async def drop_toggles(self: aiotoggles.ToggleSet, toggles: Any) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.difference_update(toggles)
            _notify_if_changed(self, before)

    async def wait_for(self: aiotoggles.ToggleSet, __state: bool) -> None:
        async with self._condition:
            state = _state(self)
            state.waiting += 1
            try:
                await self._condition.wait_for(lambda: self.is_on() == bool(__state))
            finally:
                state.waiting -= 1

    toggle_set.make_toggle = make_toggle
    toggle_set.drop_toggle = drop_toggle
    toggle_set.drop_toggles = drop_toggles
    toggle_set.wait_for = wait_for
    setattr(toggle_set, PATCHED, True)


@dataclass
class _Waiting:
    """What :func:`linear_index_prepopulation` keeps per ``ToggleSet``."""

    waiting: int = 0
    """Tasks in its ``wait_for``."""
    made: int = 0
    """Toggles it made."""
    paused: float = 0.0
    """``time.perf_counter()`` when the watcher's last pause ended (0: none yet)."""
    releasing: set[asyncio.Task[None]] = field(default_factory=set)
    """The tasks notifying its waiters batch by batch (kept: a task nobody holds may vanish)."""


def _state(toggle_set: aiotoggles.ToggleSet) -> _Waiting:
    found = toggle_set.__dict__.get(STATE)
    if not isinstance(found, _Waiting):
        found = toggle_set.__dict__[STATE] = _Waiting()
    return found


def _notify_if_changed(toggle_set: aiotoggles.ToggleSet, before: bool) -> None:
    """With the set's condition held: if the set's state is no longer ``before``, wake its
    waiters, :data:`RELEASE_BATCH` now and as many every :data:`RELEASE_SPACING_S` after (as
    many in all as there are waiters: one woken for the other state waits again at the back)."""
    if toggle_set.is_on() == before:
        return
    state = _state(toggle_set)
    toggle_set._condition.notify(RELEASE_BATCH)
    left = state.waiting - RELEASE_BATCH
    if left <= 0:
        return

    async def release(left: int) -> None:
        while left > 0:
            await asyncio.sleep(RELEASE_SPACING_S)  # the batch woken last runs meanwhile
            async with toggle_set._condition:
                toggle_set._condition.notify(RELEASE_BATCH)
            left -= RELEASE_BATCH

    task = asyncio.get_running_loop().create_task(release(left), name="kopf-toggles-release")
    state.releasing.add(task)
    task.add_done_callback(state.releasing.discard)
