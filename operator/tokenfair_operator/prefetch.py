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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from .render import KeyLookup

Secret = tuple[str, str]
"""(namespace, name) of a key Secret."""
BATCH: Final = 1_000
"""Secrets one round of the background read takes (4 chunks of 250 at a time: a round keeps
the read connections busy while the listing goes on)."""


@dataclass
class KeyPrefetch:
    """Key Secrets asked for during the listing, read by one background task, kept until a
    pass claims them (:meth:`claim`)."""

    read: Callable[[list[Secret]], Awaitable[list[KeyLookup]]]
    """Reads key Secrets in bulk (the reconciler's chunked, pipelined read), in order."""
    _wanted: set[Secret] = field(default_factory=set)
    _read: dict[Secret, KeyLookup] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def ask(self, secrets: Iterable[Secret]) -> None:
        """Read ``secrets`` in the background (those not read or asked for already)."""
        new = {s for s in secrets if s not in self._read and s not in self._wanted}
        if not new:
            return
        self._wanted |= new
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="tokenfair-key-prefetch")

    async def _run(self) -> None:
        while self._wanted:
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
            await asyncio.shield(task)
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
