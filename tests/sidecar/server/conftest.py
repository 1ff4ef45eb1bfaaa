"""The server tests' event loops: a module (or test) marked ``virtual_time`` runs its coroutine
tests on a :class:`clock_support.VirtualTimeLoop` — timers, sleeps and timeouts on virtual time,
which moves only when the loop is idle, so no wait depends on the machine's speed — unless the
test is marked ``wall_time`` (it waits on something outside the loop: a thread, a process); the
others run on the standard loop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from clock_support import VirtualTimeLoop

VIRTUAL_TIME = "virtual_time"
WALL_TIME = "wall_time"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{VIRTUAL_TIME}: run the coroutine tests on virtual time (tests/clock_support.py)",
    )
    config.addinivalue_line(
        "markers",
        f"{WALL_TIME}: run this coroutine test on the standard loop (it waits on a thread or "
        "a process, which virtual time cannot see) despite its module's virtual_time",
    )


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, type[asyncio.AbstractEventLoop]]:
    virtual = item.get_closest_marker(VIRTUAL_TIME) is not None
    if virtual and item.get_closest_marker(WALL_TIME) is None:
        return {"virtual": VirtualTimeLoop}
    return {"standard": asyncio.SelectorEventLoop}
