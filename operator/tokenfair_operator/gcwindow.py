"""Python's cyclic garbage collector while the operator starts: the survivors of each full
collection frozen from the startup hook until Kopf's initial listing and the passes it asked
for are over (:class:`StartupCollection`).

**Why.** CPython (3.11) runs a full, generation-2 collection when more objects have been
promoted into the oldest generation since the last one than a quarter of those that survived it
(``long_lived_pending > long_lived_total / 4``), and a full collection traverses every object
the collector tracks. Listing 10,000 TenantQuotas grows the heap from ~80,000 objects (the
imports) to ~860,000 (the raw bodies, Kopf's per-object workers, loggers and memories, the index
entries, the rendered document): 11 full collections, each over the whole heap so far, 2.6-3.1 s
of the operator's 8.6-10.6 s of CPU until the document was published (against a stand-in API
server, to isolate the operator's CPU), in pauses of up to 0.7 s of CPU that the loaded 2-core
machine stretched to 1.8-4.8 s of wall time, the loop stopped meanwhile (one pause made the
leader miss its Lease renewal and step down in the middle of its first pass). Measured with
``gc.callbacks`` on the operator as ``kopf run`` runs it, issue 33.

**How.** While the window is open, the survivors of every full collection are moved to the
permanent generation (``gc.freeze()``, from a ``gc.callbacks`` entry), the imports' objects
first (:meth:`StartupCollection.open`): the next full collection traverses only the objects
promoted since, so each stays small and their sum is linear in the heap's growth (measured:
16-17 full collections, 0.4-0.6 s of CPU, none over 0.06 s of CPU). Young collections
(generations 0 and 1) run as always: short-lived cycles are still freed at once, and objects
without cycles are freed by their reference counts whatever their generation. The cost: a cycle
that becomes garbage after it was frozen waits until the window closes, when ``gc.unfreeze()``
returns every frozen object to the oldest generation and the collector works as it always did
(its next full collection traverses the whole heap once, after the document is published).

**When it closes** (:meth:`StartupCollection.close`): once the listing is over and no pass asked
for by an event runs any more (:class:`.passes.EventPasses`, which also covers a standby: its
passes end at once), when the operator stops, or :data:`MAX_OPEN_S` after it opened, whichever
comes first (a listing that never ends, such as a resource the operator may not list, does not
keep the collector frozen).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Final

log = logging.getLogger("tokenfair.operator")

MAX_OPEN_S: Final = 300.0
"""The longest the window stays open: Kopf's own advice is a listing done within 5 minutes
(the API server's default watch timeout); a window still open then closes anyway."""


@dataclass
class StartupCollection:
    """The window during which full collections freeze their survivors (see the module
    docstring). One per operator process, made by the startup hook and kept in the memo
    (:data:`.runtime.GC_WINDOW`); :meth:`open` and :meth:`close` are idempotent."""

    is_open: bool = False
    opened: float = 0.0
    """``time.monotonic()`` when it opened."""
    full_collections: int = 0
    """Full collections while open (each froze its survivors)."""
    _cap: asyncio.TimerHandle | None = field(default=None, repr=False)

    def open(self, max_open_s: float = MAX_OPEN_S) -> None:
        """Freeze what exists now (the imports, the settings) and every full collection's
        survivors from now on, until :meth:`close` or ``max_open_s`` (in the running loop)."""
        if self.is_open:
            return
        self.is_open = True
        self.opened = time.monotonic()
        self.full_collections = 0
        gc.freeze()
        gc.callbacks.append(self._on_collection)
        self._cap = asyncio.get_running_loop().call_later(max_open_s, self.close, "timed out")

    def close(self, why: str = "settled") -> None:
        """Back to the collector's usual work: everything frozen returns to the oldest
        generation (``gc.unfreeze()``). Logs how long it was open and how many full
        collections ran meanwhile."""
        if not self.is_open:
            return
        self.is_open = False
        if self._cap is not None:
            self._cap.cancel()
            self._cap = None
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        log.info(
            "start-up garbage collection window closed (%s) after %.1f s: %d full collections, "
            "%d objects unfrozen",
            why,
            time.monotonic() - self.opened,
            self.full_collections,
            frozen,
        )

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` entry: after a full collection, freeze its survivors."""
        if phase == "stop" and info.get("generation") == 2 and self.is_open:
            self.full_collections += 1
            gc.freeze()
