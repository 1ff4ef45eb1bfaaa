"""Key Secrets read while Kopf is still listing, so that the first pass finds them read.

An operator meeting 10,000 keyed quotas it never published (a first install over existing
quotas, an operator that was down while they were created) reads 10,000 key Secrets before it
can publish (~3-5 s of GETs, nearly all of it the API server's CPU). Kopf's initial listing
takes as long again before the first pass may start (:mod:`.listing`), and meanwhile the
operator's event loop is busy and the API server's core mostly idle. So, on the leader, each
quota indexed during the listing whose status does not show it published at its generation
(a restarted operator or a new leader seeds its cache from the stored document instead,
:meth:`.Reconciler._seed_keys`) has its key Secret read in the background, in the pass's way
(pipelined chunks of :data:`.reconcile.READ_CHUNK`, :data:`.reconcile.READ_CONNECTIONS` at a
time, from the API server's watch cache); the first pass takes what was read and reads only the
rest. Consistency is the pass's own: a pass reads new key Secrets from the watch cache as it is,
and the resync's re-read (at etcd's current revision) bounds how late a change is published.

What was read and no pass took (a quota deleted during the listing) is dropped by the resync's
first round (:meth:`KeyPrefetch.drop_unclaimed`); stepping down drops everything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from .render import KeyLookup

Secret = tuple[str, str]
"""(namespace, name) of a key Secret."""
BATCH: Final = 1_000
"""Secrets one round of the background read takes (4 chunks of 250 at a time: a round keeps
the read connections busy while the listing goes on)."""
GATHER: Final = 250
"""A round starts once this many Secrets are asked for (one read chunk,
:data:`.reconcile.READ_CHUNK`), :data:`GATHER_S` after the last round, or at once when a pass
claims them. Kopf indexes one object at a time: a round started whenever the last one ended took
the few Secrets asked for meanwhile (~7 on average: 1,367 rounds for 10,000 quotas, each a
hand-off to a thread and back, 2.2 s of the loop's wall time in a profile under load)."""
GATHER_S: Final = 0.2
"""The longest a round waits for :data:`GATHER` Secrets to be asked for."""


@dataclass
class KeyPrefetch:
    """Key Secrets asked for during the listing, read by one background task, kept until a
    pass claims them (:meth:`claim`)."""

    read: Callable[[list[Secret]], Awaitable[list[KeyLookup]]]
    """Reads key Secrets in bulk (the reconciler's chunked, pipelined read), in order."""
    _wanted: set[Secret] = field(default_factory=set)
    _read: dict[Secret, KeyLookup] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when :data:`GATHER` Secrets are wanted or a pass claims: the round starts now."""
    _claims: int = 0
    """Passes waiting in :meth:`claim`: no gathering meanwhile."""
    gather_s: float = GATHER_S
    """:data:`GATHER_S` (tests set another)."""

    def ask(self, secrets: Iterable[Secret]) -> None:
        """Read ``secrets`` in the background (those not read or asked for already)."""
        new = {s for s in secrets if s not in self._read and s not in self._wanted}
        if not new:
            return
        self._wanted |= new
        if len(self._wanted) >= GATHER:
            self._hurry.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="tokenfair-key-prefetch")

    async def _run(self) -> None:
        while self._wanted:
            if len(self._wanted) < GATHER and not self._claims:
                # Gather a chunk's worth while Kopf lists (see GATHER), unless a pass waits.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), self.gather_s)
            self._hurry.clear()
            batch = sorted(self._wanted)[:BATCH]
            self._wanted.difference_update(batch)
            try:
                found = await self.read(batch)
            except Exception:  # the pass reads them itself
                continue
            self._read.update(zip(batch, found, strict=True))

    async def claim(self, secrets: Iterable[Secret]) -> dict[Secret, KeyLookup]:
        """What was read of ``secrets`` (taken: not kept here any more), once the background
        read is over (it began before the caller's pass: waiting for it costs less than
        reading again)."""
        task = self._task
        if task is not None and not task.done():
            self._claims += 1
            self._hurry.set()  # no more gathering: a pass waits
            try:
                await asyncio.shield(task)
            finally:
                self._claims -= 1
        return {s: self._read.pop(s) for s in secrets if s in self._read}

    def drop_unclaimed(self) -> None:
        """Forget what no pass took (its quota went during the listing), unless still being
        read."""
        if self._task is None or self._task.done():
            self._read.clear()

    def clear(self) -> asyncio.Task[None] | None:
        """Stop the background read (cancelled; returned, to be awaited by a caller that
        can) and forget everything (stepping down, closing)."""
        task, self._task = self._task, None
        self._wanted.clear()
        self._read.clear()
        if task is None or task.done():
            return None
        task.cancel()
        return task

    def __len__(self) -> int:
        """Secrets asked for or read and not claimed yet."""
        return len(self._wanted) + len(self._read)
