"""Shared pytest configuration: fixture plugins and the guard against leaked asyncio tasks."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
from collections.abc import AsyncIterator

import pytest

from tokenfair import native

# Before any test imports the core, as the `tokenfair` command does: the suite runs on the
# compiled core when a fresh build is there (TOKENFAIR_NATIVE=0: the interpreted one), and
# tests/sidecar/native replays traces on both cores in subprocesses and compares the bytes.
native.activate()

pytest_plugins = [
    "kubecluster",
    "kubenode",
    "operator_support",
    "raw_upstream_support",
    "vllm_support",
]

REQUIRE_PROMTOOL_ENV = "TOKENFAIR_REQUIRE_PROMTOOL"


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of ``promtool`` (Debian's package ``prometheus``; ``.ci/run`` installs it). Without
    it the test is skipped with that hint, unless ``TOKENFAIR_REQUIRE_PROMTOOL=1`` (CI), where
    it fails."""
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: apt-get install prometheus (Debian's package has it)"
        if os.environ.get(REQUIRE_PROMTOOL_ENV) == "1":
            pytest.fail(f"{message}; {REQUIRE_PROMTOOL_ENV}=1 forbids skipping")
        pytest.skip(message)
    return path


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail an async test that leaves tasks running after all its other fixtures closed.

    It is put first in every coroutine test's fixtures, so it is torn down last: servers and
    clients of the test are gone by then, and anything still pending is a leak.
    """
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)  # one turn for tasks that were just cancelled to finish
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test leaked asyncio tasks: {leaked}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            fixturenames: list[str] = getattr(item, "fixturenames", [])
            if "no_leaked_tasks" not in fixturenames:
                fixturenames.insert(0, "no_leaked_tasks")
