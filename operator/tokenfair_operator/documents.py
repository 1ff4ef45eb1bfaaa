"""The config documents the operator last published, for sidecars to long-poll (:mod:`.serve`).

One entry per policy: its version, its generation and the two payloads exactly as stored in
the ConfigMap and the Secret (:mod:`.payload`: the document's UTF-8 text, or gzip of it). A
waiter gives the version it runs and is woken when another one is published, or when its wait
ends.

**Generations.** A version is a content hash: it says *which* document, not which is newer.
Each published document also has a generation, a counter that only grows: the next one is
one more than the highest generation stored in the policy's ConfigMap and Secret
(annotation :data:`GENERATION_ANNOTATION`, and data key ``generation``, so that a mounted
volume shows it next to ``config.yaml``), unless one of them already holds this very version
(a pass that wrote the ConfigMap and failed before the Secret: the same document keeps its
number) — and never less than the wall clock in milliseconds. The counter lives in the API
server, not in a replica's memory, so a new leader continues from what the last one published;
the clock's floor keeps it growing when there is nothing to continue from (the policy deleted
and created again, or both objects deleted by hand), where a counter starting again at 1 would
have every running sidecar refuse the new documents (:func:`next_generation`). Sidecars refuse
a document of a lower generation than the one they run, from the long-poll or from the file.

Contract: :meth:`DocumentStore.publish` is called by the reconciler after every pass that
rendered a document (an unchanged version wakes nobody; a lower generation than the stored
one is ignored); :meth:`DocumentStore.withdraw` when the policy is gone;
:meth:`DocumentStore.clear` when this replica stops leading (a re-elected leader serves
nothing until its first pass has published). Memory: two payloads per policy, at most ~2 MiB
each (the object limit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal

from tokenfair.config.wire import GENERATION_FILE, read_generation

GENERATION_ANNOTATION: Final = "tokenfair.io/config-generation"
GENERATION_KEY: Final = GENERATION_FILE
"""Data key of the generation in the ConfigMap and Secret: a file beside ``config.yaml`` in a
mounted volume, which the sidecar reads with it."""

Source = Literal["secret", "configmap"]
SOURCES: Final[tuple[Source, ...]] = ("secret", "configmap")
PolicyKey = tuple[str, str]
"""(namespace, policy name)."""


@dataclass(frozen=True, slots=True)
class Document:
    """One published version of a policy's document."""

    version: str
    secret_payload: bytes
    configmap_payload: bytes
    generation: int = 0
    """Monotonic per policy (module docstring); 0: none known."""

    def payload(self, source: Source) -> bytes:
        return self.secret_payload if source == "secret" else self.configmap_payload


@dataclass
class DocumentStore:
    """The latest document of each policy; waiters are woken on a new version."""

    _documents: dict[PolicyKey, Document] = field(default_factory=dict)
    _changed: dict[PolicyKey, asyncio.Event] = field(default_factory=dict)
    """The Event waiters of a policy wait on; there only while someone waits."""
    _waiters: dict[PolicyKey, int] = field(default_factory=dict)
    """How many wait on the policy's current Event (the last to leave removes it)."""
    _term: int = 0
    """How many times :meth:`clear` ran: a waiter from an earlier term returns at once."""

    def get(self, key: PolicyKey) -> Document | None:
        return self._documents.get(key)

    def publish(self, key: PolicyKey, document: Document) -> bool:
        """Make ``document`` the policy's current one; wakes waiters if the version changed.
        False (nothing changes) when it is of a lower generation than the current one."""
        current = self._documents.get(key)
        if current is not None and document.generation < current.generation:
            return False
        self._documents[key] = document
        if current is None or current.version != document.version:
            self._wake(key)
        return True

    def clear(self) -> None:
        """Forget every document (this replica stopped leading); waiters get their wait's
        end at once and the server tells them where to go."""
        self._term += 1
        self._documents.clear()
        for key in list(self._changed):
            self._wake(key)

    def withdraw(self, key: PolicyKey) -> None:
        """The policy is gone: nothing is served for it (waiters get their wait's end)."""
        if self._documents.pop(key, None) is not None:
            self._wake(key)

    async def newer(self, key: PolicyKey, have: str, wait_s: float) -> Document | None:
        """The policy's document if its version is not ``have``, at once or as soon as one is
        published within ``wait_s`` seconds; None if none came (or the policy has none), or
        at once when the store is cleared meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        term = self._term
        while True:
            current = self._documents.get(key)
            if current is not None and current.version != have:
                return current
            remaining = deadline - loop.time()
            if remaining <= 0 or self._term != term:
                return None
            event = self._changed.get(key)
            if event is None:
                event = self._changed[key] = asyncio.Event()
            self._waiters[key] = self._waiters.get(key, 0) + 1
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return None
            finally:
                self._left(key)

    def _left(self, key: PolicyKey) -> None:
        """A waiter of ``key`` is done (woken, timed out or cancelled). The count spans the
        Events of every generation; when it reaches zero nobody waits on any, and the policy's
        Event goes: polls for names never published hold no memory."""
        count = self._waiters.get(key, 0) - 1
        if count > 0:
            self._waiters[key] = count
            return
        self._waiters.pop(key, None)
        self._changed.pop(key, None)

    def _wake(self, key: PolicyKey) -> None:
        # A fresh Event per generation: the woken re-check, later waiters wait on the new one.
        event = self._changed.pop(key, None)
        if event is not None:
            event.set()


def next_generation(
    version: str, published: Iterable[tuple[str | None, int]], floor: int = 0
) -> int:
    """The generation of document ``version`` given what the policy's objects hold now,
    ``(version, generation)`` each (``(None, 0)`` for a missing object or annotation): the
    generation of an object already holding ``version``, else ``max(highest + 1, floor)``.
    ``floor`` is the wall clock in milliseconds (:func:`clock_floor`): a policy's objects
    deleted and made again start from it, above any generation published before them (so long
    as replicas' clocks agree within the time between the last publication and the new one,
    and no policy publishes over a thousand documents a second)."""
    held = list(published)
    if floor > 0:  # a stored number far ahead of the clock was edited by hand: not followed
        held = [(stored, g) for stored, g in held if g <= floor + MAX_GENERATION_AHEAD_MS]
    same = [generation for stored, generation in held if stored == version and generation > 0]
    if same:
        return max(same)
    return max(max((generation for _, generation in held), default=0) + 1, floor)


MAX_GENERATION_AHEAD_MS: Final = 86_400_000
"""A stored generation more than a day ahead of the clock is not continued from (an annotation
set by hand to 10^18 would otherwise have every later document refused by every sidecar)."""


def clock_floor() -> int:
    """The least generation of a new document: the wall clock in whole milliseconds."""
    return time.time_ns() // 1_000_000


def parse_generation(value: object) -> int:
    """An annotation's generation; 0 when absent or not what the sidecar reads as one
    (:func:`tokenfair.config.wire.read_generation`: a number it would refuse must not be continued
    from)."""
    parsed = read_generation(str(value))
    return 0 if parsed is None else parsed
