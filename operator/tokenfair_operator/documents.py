"""The config documents the operator last published, for sidecars to long-poll (:mod:`.serve`).

One entry per policy: its version and the two payloads exactly as stored in the ConfigMap and
the Secret (:mod:`.payload`: the document's UTF-8 text, or gzip of it). A waiter gives the
version it runs and is woken when another one is published, or when its wait ends.

Contract: :meth:`DocumentStore.publish` is called by the reconciler after every pass that
rendered a document (an unchanged version wakes nobody); :meth:`DocumentStore.withdraw` when
the policy is gone. Memory: two payloads per policy, at most ~2 MiB each (the object limit).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final, Literal

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

    def get(self, key: PolicyKey) -> Document | None:
        return self._documents.get(key)

    def publish(self, key: PolicyKey, document: Document) -> None:
        """Make ``document`` the policy's current one; wakes waiters if the version changed."""
        current = self._documents.get(key)
        if current is not None and current.version == document.version:
            return
        self._documents[key] = document
        self._wake(key)

    def withdraw(self, key: PolicyKey) -> None:
        """The policy is gone: nothing is served for it (waiters get their wait's end)."""
        if self._documents.pop(key, None) is not None:
            self._wake(key)

    async def newer(self, key: PolicyKey, have: str, wait_s: float) -> Document | None:
        """The policy's document if its version is not ``have``, at once or as soon as one is
        published within ``wait_s`` seconds; None if none came (or the policy has none)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            current = self._documents.get(key)
            if current is not None and current.version != have:
                return current
            remaining = deadline - loop.time()
            if remaining <= 0:
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
