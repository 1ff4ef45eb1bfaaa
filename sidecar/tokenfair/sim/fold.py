"""One pass over a replay's decisions into its report: the lesson's summary, the fairness
tallies and, when asked, a writer and a keeper of each decision.

A module of its own so that it is compiled with the core (``tokenfair.native``): it runs once
per request, and its callees (the tallies, the replay generator) are compiled too.
``commands.simulate.fold`` wraps it with the records file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenfair.core import Decision
from tokenfair.sim.fairness import FairnessTally, decision_size
from tokenfair.sim.report import SummaryTally


def fold_decisions(
    decisions: Iterable[tuple[Decision, int | None]],
    summary: SummaryTally,
    fairness: FairnessTally,
    write: Callable[[Decision], object] | None = None,
    keep: Callable[[Decision], object] | None = None,
) -> None:
    """``summary.add(decision)`` and ``fairness.add(decision, decision_size(...))`` of each
    ``(decision, recorded usage)`` of a replay, in order; then ``write(decision)`` and
    ``keep(decision)`` when given. The tallies' rules stay theirs (one home per rule)."""
    for decision, actual in decisions:
        summary.add(decision)
        fairness.add(decision, decision_size(decision, actual))
        if write is not None:
            write(decision)
        if keep is not None:
            keep(decision)
