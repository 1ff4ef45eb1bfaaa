"""Operator-level periodic loops: one asyncio task per loop for the whole operator.

They are not Kopf timers or daemons on purpose: Kopf puts its finalizer on every object that
has one, to stop them before the object goes. A finalizer needs a live operator with its RBAC
to be released, which a plain ``helm uninstall`` removes in the same breath, so the objects
(and what they own) would stay. One loop per task for the whole operator needs no finalizer:
each round walks the Kopf indexes as they are at that moment.

A round that raises is logged and the loop goes on; the next round repairs what it missed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import kopf

PeriodicRound = Callable[[], Awaitable[None]]
"""One round of a loop: a callable each call of which runs the round once (not an
:class:`asyncio.Task`; :class:`Periodic` makes the task). The rounds are built in
:mod:`.resync`, :mod:`.usage_loop`, :mod:`.tls_loop` and :mod:`.cert_bootstrap`."""


async def run_every(interval_s: float, one_round: PeriodicRound, logger: kopf.Logger) -> None:
    """Run ``one_round`` every ``interval_s`` seconds (first after one interval: the initial
    listing's events have just brought a pass of every policy), until cancelled. Rounds never
    overlap: the next interval starts when a round ends, so a slow API stretches the period
    instead of stacking rounds."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await one_round()
        except Exception:
            logger.exception("periodic round failed; the next round retries")


@dataclass
class Periodic:
    """The running loops, started from the startup hook and stopped from the cleanup hook."""

    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(
        self, name: str, interval_s: float, one_round: PeriodicRound, logger: kopf.Logger
    ) -> None:
        """A loop named ``name`` running ``one_round`` every ``interval_s`` (:func:`run_every`)."""
        task = asyncio.create_task(run_every(interval_s, one_round, logger), name=name)
        self.tasks.append(task)

    async def stop(self) -> None:
        """Cancel every loop and wait for it to finish (idempotent)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
