"""What the operator keeps in Kopf's memo while it runs, one key each, and typed access to it.

The startup hook (:mod:`.startup`) puts the settings, the typed indexes, the reconciler and the
running parts (loops, HTTP server, leader elector, certificate keeper, CA publisher) there; the
handlers and the loops read them through the functions below, and the cleanup hook stops what
runs. Kopf hands the same memo to every handler of the operator.
"""

from __future__ import annotations

from typing import Final

import kopf

from .indexes import Indexes
from .leader import LeaderElector
from .reconcile import Reconciler
from .settings import OperatorConfig

CONFIG: Final = "config"
INDEXES: Final = "indexes"
RECONCILER: Final = "reconciler"
PERIODIC: Final = "periodic"
SERVER: Final = "server"
ELECTOR: Final = "elector"
GENERATIONS: Final = "generations"
KEEPER: Final = "cert_keeper"
TRUST: Final = "trust_publisher"
WEBHOOKS: Final = "webhooks_registered"


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


def leads(memo: kopf.Memo) -> bool:
    """Whether this replica may reconcile and write: always without leader election."""
    elector = memo.get(ELECTOR)
    return not isinstance(elector, LeaderElector) or elector.is_leader
