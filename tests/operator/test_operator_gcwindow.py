"""The start-up garbage collection window (:mod:`tokenfair_operator.gcwindow`).

Behaviours under test, without a cluster:

- while the window is open, every full collection freezes its survivors (the next one then
  traverses only what came after; before, each traversed the whole heap again: 11 full
  collections over a heap growing to ~860,000 objects, 3.0 s of CPU, while 10,000 quotas were
  listed), and young collections freeze nothing;
- closing it unfreezes everything and stops freezing: the collector works as before; opening
  and closing are idempotent;
- it closes once Kopf's listing is over and no pass asked for by an event runs — not while
  the listing goes on, not while a pass runs — when the operator stops, and at its cap;
- the startup hook's ``start`` opens it and ``stop`` closes it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Iterator
from typing import Any, cast

import kopf
import pytest

from tokenfair_operator import passes, runtime, startup
from tokenfair_operator.gcwindow import StartupCollection
from tokenfair_operator.listing import Listing
from tokenfair_operator.passes import PASSES, EventPasses, event_passes

LOG = logging.getLogger("test")
POOL = ("ns", "pool")


@pytest.fixture(autouse=True)
def collector_as_found() -> Iterator[None]:
    """No test leaves the collector frozen or a callback of ours behind."""
    assert gc.get_freeze_count() == 0
    yield
    gc.callbacks[:] = [c for c in gc.callbacks if not _ours(c)]
    gc.unfreeze()


def _ours(callback: Any) -> bool:
    return isinstance(getattr(callback, "__self__", None), StartupCollection)


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


async def test_full_collections_freeze_their_survivors_while_open() -> None:
    window = StartupCollection()
    window.open()
    assert window.is_open
    at_open = gc.get_freeze_count()
    assert at_open > 0  # what existed (the imports) is frozen at once
    kept = [Cycle() for _ in range(1_000)]
    gc.collect(0)
    gc.collect(1)
    assert gc.get_freeze_count() == at_open  # young collections freeze nothing
    gc.collect()  # a full collection: its survivors frozen
    assert gc.get_freeze_count() >= at_open + len(kept)
    assert window.full_collections == 1
    window.open()  # idempotent: nothing more frozen, the counter kept
    assert window.full_collections == 1

    window.close()
    assert not window.is_open
    assert gc.get_freeze_count() == 0
    assert not any(_ours(c) for c in gc.callbacks)
    gc.collect()
    assert gc.get_freeze_count() == 0  # back to the usual collector
    window.close()  # idempotent


async def test_a_frozen_cycle_is_freed_once_the_window_closes() -> None:
    window = StartupCollection()
    window.open()
    cycle = Cycle()
    alive = weakref.ref(cycle)
    gc.collect()  # it survives this full collection: frozen
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: not traversed, not freed
    window.close()
    gc.collect()
    assert alive() is None  # freed by the usual collector


def operator_memo() -> kopf.Memo:
    memo = kopf.Memo()
    memo[runtime.LISTING] = Listing()
    memo[runtime.GC_WINDOW] = StartupCollection()
    memo[PASSES] = EventPasses(memo)
    return memo


async def test_the_window_closes_once_the_listing_and_its_passes_are_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = asyncio.Event()

    async def held_pass(key: tuple[str, str], memo: kopf.Memo, logger: kopf.Logger) -> None:
        await held.wait()

    monkeypatch.setattr(passes, "run_pass", held_pass)
    memo = operator_memo()
    window = cast(StartupCollection, memo[runtime.GC_WINDOW])
    window.open()
    queue = event_passes(memo)

    held.set()
    queue.ask(POOL, LOG)  # a pass ends while Kopf still lists: the view is not complete
    await queue.drain()
    assert window.is_open

    runtime.listing(memo).mark_complete(lambda: 1)
    held.clear()
    queue.ask(POOL, LOG)
    queue.ask(("ns", "other"), LOG)
    await asyncio.sleep(0)
    assert window.is_open  # passes running
    held.set()
    await queue.drain()
    assert not window.is_open
    assert gc.get_freeze_count() == 0
    await queue.close()


async def test_the_window_closes_at_its_cap() -> None:
    window = StartupCollection()
    window.open(max_open_s=0.0)
    for _ in range(100):  # loop iterations, not time: the cap's timer is due at once
        if not window.is_open:
            break
        await asyncio.sleep(0)
    assert not window.is_open
    assert gc.get_freeze_count() == 0


async def test_the_startup_hook_opens_it_and_stop_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bool] = []

    def no_client() -> None:
        window = memo.get(runtime.GC_WINDOW)
        seen.append(isinstance(window, StartupCollection) and window.is_open)
        raise RuntimeError("no cluster in this test")

    monkeypatch.setattr(startup, "api_client", no_client)
    memo = kopf.Memo()
    with pytest.raises(RuntimeError, match="no cluster"):
        await startup.start(
            cast(Any, None), cast(Any, None), kopf.OperatorSettings(), memo, cast(Any, LOG)
        )
    assert seen == [True]  # open before anything else starts
    window = memo[runtime.GC_WINDOW]
    assert isinstance(window, StartupCollection)
    assert not window.is_open  # a failed start stops what it started, the window too
    assert gc.get_freeze_count() == 0
