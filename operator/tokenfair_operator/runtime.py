"""What the operator keeps in Kopf's memo while it runs, one key each, and typed access to it.

The startup hook (:mod:`.startup`) puts the settings, the typed indexes, the reconciler and the
running parts (loops, HTTP server, leader elector, certificate keeper, CA publisher) there; the
handlers and the loops read them through the functions below, and the cleanup hook stops what
runs.

Kopf hands the startup and cleanup hooks the operator's memo itself, but each object's handlers
a shallow copy of it (``copy.copy``, once per object): a key set there stays in that object's
copy, while a mutable value set here at startup is shared by all of them. So everything a handler
records for the whole operator lives in a value the startup hook created (the generations,
:func:`generations`), never in a key a handler sets.
"""

from __future__ import annotations

from typing import Final, TypeVar

import kopf

from .gcwindow import StartupCollection
from .indexes import Indexes
from .leader import LeaderElector
from .listing import Listing
from .reconcile import Reconciler
from .settings import OperatorConfig
from .startview import StartupView

CONFIG: Final = "config"
"""The settings as read from the environment, once per process by the startup hook (a retried
hook reuses them: the same Lease identity); not the copy pointing Kopf at the operator's own
certificate files."""
INDEXES: Final = "indexes"
RECONCILER: Final = "reconciler"
PERIODIC: Final = "periodic"
SERVER: Final = "server"
ELECTOR: Final = "elector"
GENERATIONS: Final = "generations"
"""By object uid, the (generation, being deleted) its last event had (:func:`.passes.news`);
one dict, created by the startup hook, shared by every object's copy of the memo."""
LISTING: Final = "listing"
"""Whether Kopf's initial listing is over (:class:`.listing.Listing`); one object, created by
the startup hook, shared by every object's copy of the memo."""
GC_WINDOW: Final = "gc_window"
"""The start-up garbage collection window (:class:`.gcwindow.StartupCollection`): opened by the
startup hook, closed once the listing and the passes it asked for are over."""
START_VIEW: Final = "startup_view"
"""The operator's own listing at startup and its passes (:class:`.startview.StartupView`), on
the replica that led when the startup hook ran; absent elsewhere."""
KEEPER: Final = "cert_keeper"
TRUST: Final = "trust_publisher"


def config(memo: kopf.Memo) -> OperatorConfig:
    """The settings the startup hook read from the environment."""
    found = memo[CONFIG]
    assert isinstance(found, OperatorConfig)
    return found


def indexes(memo: kopf.Memo) -> Indexes:
    found = memo[INDEXES]
    assert isinstance(found, Indexes)
    return found


def reconciler(memo: kopf.Memo) -> Reconciler:
    found = memo[RECONCILER]
    assert isinstance(found, Reconciler)
    return found


S = TypeVar("S")


def shared(memo: kopf.Memo, key: str, kind: type[S]) -> S:
    """The ``kind`` the startup hook put under ``key``, shared by every object's copy of the
    memo. Fails if it is missing: one made here would land in one object's copy of the memo and
    be seen by no one else."""
    found = memo.get(key)
    if not isinstance(found, kind):
        raise RuntimeError(
            f"memo[{key!r}] is missing: the startup hook creates it, shared by every "
            "object's copy of the memo"
        )
    return found


def listing(memo: kopf.Memo) -> Listing:
    """The shared :data:`LISTING` record (:func:`shared`)."""
    return shared(memo, LISTING, Listing)


def leads(memo: kopf.Memo) -> bool:
    """Whether this replica may reconcile and write: always without leader election."""
    elector = memo.get(ELECTOR)
    return not isinstance(elector, LeaderElector) or elector.is_leader


Generations = dict[str, tuple[int, bool]]


def generations(memo: kopf.Memo) -> Generations:
    """The shared record of :data:`GENERATIONS` (:func:`shared`)."""
    found: Generations = shared(memo, GENERATIONS, dict)
    return found


def startup_view(memo: kopf.Memo) -> StartupView | None:
    """The :data:`START_VIEW`, if the startup hook made one."""
    found = memo.get(START_VIEW)
    return found if isinstance(found, StartupView) else None


def close_gc_window_if_settled(memo: kopf.Memo, passes_running: bool) -> None:
    """Close the start-up garbage collection window (:data:`GC_WINDOW`) once Kopf's listing
    is over, no pass asked for by an event runs (``passes_running`` False) and the startup
    view's listing and passes are over (:mod:`.startview`)."""
    window = memo.get(GC_WINDOW)
    if not isinstance(window, StartupCollection) or not window.is_open or passes_running:
        return
    view = startup_view(memo)
    if view is not None and view.running:
        return
    found = memo.get(LISTING)
    if isinstance(found, Listing) and found.is_complete:
        window.close()
