"""The initial listing: no pass before Kopf's indexes hold every object, and a listing that
costs O(n) in Kopf rather than O(n²).

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
the same readiness, n + 1 wake-ups.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final

from kopf._cogs.aiokits import aiotoggles

PATCHED: Final = "_tokenfair_notifies_on_change"
"""Marks Kopf's ``ToggleSet`` once :func:`linear_index_prepopulation` replaced its methods."""


@dataclass
class Listing:
    """Whether Kopf's initial listing is over: every watched resource listed and every listed
    object in its index (see the module docstring). One per operator process, created by the
    startup hook and shared by every object's copy of the memo (:mod:`.runtime`)."""

    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_complete(self) -> None:
        """Called by every event handler before it does anything: the first call is the
        moment the indexes are complete; later calls cost a flag check."""
        if not self.complete.is_set():
            self.complete.set()

    @property
    def is_complete(self) -> bool:
        return self.complete.is_set()


def linear_index_prepopulation() -> None:
    """Make Kopf's ``ToggleSet`` notify its waiters only when its state changes (see the
    module docstring). Idempotent. Raises RuntimeError if Kopf's ``ToggleSet`` no longer has
    the parts this relies on (a Kopf upgrade changed it: the pin and
    ``tests/operator/test_operator_listing.py`` say which version this was written for)."""
    toggle_set: Any = aiotoggles.ToggleSet
    if getattr(toggle_set, PATCHED, False):
        return
    probe = aiotoggles.ToggleSet(all)
    for part in ("make_toggle", "drop_toggle", "drop_toggles", "is_on", "_condition", "_toggles"):
        if not hasattr(probe, part):
            raise RuntimeError(f"kopf's ToggleSet has no {part}: cannot make it linear")

    async def make_toggle(
        self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None
    ) -> aiotoggles.Toggle:
        toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
        async with self._condition:
            before = self.is_on()
            self._toggles.add(toggle)
            if self.is_on() != before:
                self._condition.notify_all()
        return toggle

    async def drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.discard(toggle)
            if self.is_on() != before:
                self._condition.notify_all()

    async def drop_toggles(self: aiotoggles.ToggleSet, toggles: Any) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.difference_update(toggles)
            if self.is_on() != before:
                self._condition.notify_all()

    toggle_set.make_toggle = make_toggle
    toggle_set.drop_toggle = drop_toggle
    toggle_set.drop_toggles = drop_toggles
    setattr(toggle_set, PATCHED, True)
