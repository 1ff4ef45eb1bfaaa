"""The test clocks themselves (tests/clock_support.py).

Behaviours:

- a ``VirtualTimeLoop``'s clock starts at ``VIRTUAL_START_S`` whatever the real monotonic
  clock (the machine's uptime) reads, so no result depends on the machine;
- on a ``VirtualTimeLoop`` an hour's sleep ends at once, with the loop's clock exactly an hour
  on; timers fire in order, each at its own time; work takes no virtual time;
- loopback I/O is served before time jumps: a read under a timeout gets the bytes its peer
  wrote, whatever the timeout's length;
- time stands still while a call runs in the loop's executor (a thread's answer may be what the
  loop waits for);
- ``ManualClock`` runs the timers due in a step in time order, each at its own time, skips
  cancelled ones, and wakes its sleepers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import time

import pytest
from clock_support import VIRTUAL_START_S, ManualClock, VirtualTimeLoop, run_virtual

UPTIMES_S = (7.5, 2.0**16 + 0.123456789, 2.0**24 + 0.987654321)
"""Real monotonic clocks (the machine's uptime) of seconds, ~18 h and ~194 days: one step of a
float is ~1.5e-11 s at the second and ~3.7e-9 s at the third (a start taken from them lost bits
in every sum of loop times, each machine its own)."""


def test_the_virtual_clock_starts_at_its_constant_whatever_the_uptime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def readings() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        for delay_s in (0.1, 0.2, 0.4, 3600.0):
            await asyncio.sleep(delay_s)
            seen.append(loop.time())
        return seen

    runs = []
    for uptime_s in UPTIMES_S:
        monkeypatch.setattr(time, "monotonic", lambda uptime_s=uptime_s: uptime_s)
        runs.append(run_virtual(readings()))
    assert runs[0][0] == VIRTUAL_START_S == float(int(VIRTUAL_START_S))  # whole seconds
    assert runs[1] == runs[0]  # the same floats, bit for bit
    assert runs[2] == runs[0]
    steps_s = [later - earlier for earlier, later in itertools.pairwise(runs[0])]
    # 0.1 s is no float's sum with 1000.0: a difference of two readings is off by at most half
    # a step of the clock there (~5.7e-14 s); the hour, a whole number, is exact.
    assert steps_s == pytest.approx([0.1, 0.2, 0.4, 3600.0], rel=0.0, abs=math.ulp(VIRTUAL_START_S))
    assert steps_s[-1] == 3600.0


def test_an_hours_sleep_takes_no_real_time_and_an_hour_of_loop_time() -> None:
    async def scenario() -> tuple[float, list[tuple[str, float]]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        start = loop.time()
        fired: list[tuple[str, float]] = []
        loop.call_later(2.0, lambda: fired.append(("b", loop.time() - start)))
        loop.call_later(1.0, lambda: fired.append(("a", loop.time() - start)))
        sum(range(200_000))  # work: no virtual time
        assert loop.time() == start
        await asyncio.sleep(3600.0)
        return loop.time() - start, fired

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Bounded by a generous real deadline only so a broken loop fails instead of hanging.
        slept, fired = pool.submit(run_virtual, scenario()).result(timeout=60.0)
    assert slept == 3600.0
    assert fired == [("a", 1.0), ("b", 2.0)]


def test_loopback_bytes_arrive_before_a_timeout_can_fire() -> None:
    async def scenario() -> bytes:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(5))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"hello")
            async with asyncio.timeout(0.001):  # a millisecond of virtual time: never reached
                echoed = await reader.readexactly(5)
            writer.close()
            await writer.wait_closed()
            return echoed
        finally:
            server.close()
            await server.wait_closed()

    assert run_virtual(scenario()) == b"hello"


def test_time_stands_still_while_the_executor_works() -> None:
    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        waited = asyncio.create_task(asyncio.sleep(10.0))
        await loop.run_in_executor(None, time.sleep, 0.05)  # real time, in a thread
        during = loop.time() - start
        await waited
        return during, loop.time() - start

    during, after = run_virtual(scenario())
    assert during == 0.0  # the 10 s timer did not fire while the thread ran
    assert after == 10.0


async def test_a_manual_clock_runs_what_is_due_in_order_at_its_own_time() -> None:
    clock = ManualClock(time_scale=2.0)
    seen: list[tuple[str, float]] = []
    clock.call_later(0.3, lambda: seen.append(("c", clock.monotonic_s())))
    clock.call_later(0.1, lambda: seen.append(("a", clock.monotonic_s())))
    clock.call_later(0.2, lambda: seen.append(("x", clock.monotonic_s()))).cancel()
    clock.call_later(0.5, lambda: seen.append(("later", clock.monotonic_s())))
    sleeper = asyncio.create_task(clock.sleep(0.25))
    await asyncio.sleep(0)
    assert clock.advance(0.3) == 3  # a, the sleeper's wake-up, c
    assert seen == [("a", 0.1), ("c", 0.3)]
    await asyncio.sleep(0)
    assert sleeper.done()
    assert clock.now_ms() == 150.0  # 0.3 real seconds at 2 real seconds per model second
    assert clock.real_seconds(150.0) == 0.3
    assert clock.pending == 1
