"""The dispatcher between asyncio and the scheduling core, on virtual time (no wall clock).

Behaviours: the in-flight limit holds requests in the core's queue; a completion dispatches the
next one at once; a waiter cancelled while queued leaves the queue (refunded); a waiter cancelled
in the very instant its request is dispatched is settled at zero usage; KV is held ``kv_hold_ms``
after dispatch and released by a timer; a drain answers every queued waiter; the books balance
after each.
"""

from __future__ import annotations

import asyncio

import pytest
from clock_support import run_virtual
from sidecar_support import ZERO_BOOKS, keyed_config

from tokenfair.core import Decision, Request, make_scheduler
from tokenfair.server.clock import ModelClock
from tokenfair.server.dispatcher import Dispatcher
from tokenfair.server.lifecycle import Lifecycle, Phase

pytestmark = pytest.mark.virtual_time


class FakeClock(ModelClock):
    """Model time that moves only when the test says so; ``time_scale`` maps it to timers."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.001)
        self.model_ms = 0.0

    def now_ms(self) -> float:
        return self.model_ms


def make_dispatcher(max_in_flight: int = 1) -> tuple[Dispatcher, FakeClock]:
    clock = FakeClock()
    scheduler = make_scheduler("tokenfair", keyed_config(), clock.now_ms())
    return Dispatcher(scheduler, clock, max_in_flight), clock


def chat(request_id: str, at_ms: float = 0.0) -> Request:
    # 280 + 4 * 90 = 640 service tokens, ceil(370 / 16) = 24 KV blocks.
    return Request(request_id, "tenant_chat_pro", at_ms, 280, 90, "interactive")


def waiter(lifecycle: Lifecycle) -> asyncio.Future[Decision]:
    assert lifecycle.future is not None
    return lifecycle.future


def queued(lifecycle: Lifecycle) -> Lifecycle:
    assert lifecycle.phase is not Phase.REFUSED, lifecycle.decision
    assert lifecycle.future is not None
    return lifecycle


async def test_in_flight_limit_and_dispatch_on_completion() -> None:
    dispatcher, clock = make_dispatcher()
    first, second = queued(dispatcher.submit(chat("a"))), queued(dispatcher.submit(chat("b")))
    assert waiter(first).done()
    assert waiter(first).result().admitted
    assert not waiter(second).done()
    assert dispatcher.scheduler.books().queued_requests == 1
    clock.model_ms = 14.0
    dispatcher.complete(first, 640, kv_hold_ms=0.0)
    assert waiter(second).done()
    assert waiter(second).result().admitted
    assert waiter(second).result().queue_wait_ms == 14.0
    dispatcher.complete(second, 600, kv_hold_ms=0.0)
    assert dispatcher.scheduler.books() == ZERO_BOOKS
    # Settled to actual usage: 640 + 600.
    assert dispatcher.scheduler.tenants["tenant_chat_pro"].served_tokens == 1240


async def test_cancel_while_queued_refunds() -> None:
    dispatcher, _ = make_dispatcher()
    running = queued(dispatcher.submit(chat("a")))
    waiting = queued(dispatcher.submit(chat("b")))
    task = asyncio.create_task(dispatcher.wait(waiting))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert waiting.phase is Phase.LEFT_QUEUE
    assert waiting.decision is not None
    assert waiting.decision.reason == "cancelled"
    assert dispatcher.scheduler.books().queued_requests == 0
    dispatcher.complete(running, None, kv_hold_ms=0.0)
    assert dispatcher.scheduler.books() == ZERO_BOOKS


async def test_cancelled_in_the_instant_of_dispatch_settles_at_zero() -> None:
    dispatcher, _ = make_dispatcher()
    running = queued(dispatcher.submit(chat("a")))
    waiting = queued(dispatcher.submit(chat("b")))
    task = asyncio.create_task(dispatcher.wait(waiting))
    await asyncio.sleep(0)
    task.cancel()  # its future is cancelled now; its handler has not run yet
    dispatcher.complete(running, 640, kv_hold_ms=0.0)  # ... and the pump dispatches it
    await asyncio.gather(task, return_exceptions=True)
    assert waiting.phase is Phase.SETTLED  # dispatched, then settled at zero
    assert waiting.booked_service_tokens == 0
    assert dispatcher.scheduler.books() == ZERO_BOOKS
    # Only the first request's 640 tokens were served; the second settled at zero.
    assert dispatcher.scheduler.tenants["tenant_chat_pro"].served_tokens == 640


async def test_kv_is_held_after_completion_then_released() -> None:
    dispatcher, clock = make_dispatcher()
    lifecycle = queued(dispatcher.submit(chat("a")))
    # Held 100 model ms after dispatch = 0.1 real ms at time_scale 0.001, on virtual time.
    dispatcher.complete(lifecycle, None, kv_hold_ms=100.0)
    assert dispatcher.scheduler.books().resident_kv_blocks == 24
    assert dispatcher.scheduler.books().running_requests == 0
    assert await dispatcher.wait_idle(1.0)
    await asyncio.sleep(clock.real_seconds(99.0))
    assert dispatcher.scheduler.books().resident_kv_blocks == 24  # not a moment early
    await asyncio.sleep(clock.real_seconds(2.0))
    assert dispatcher.scheduler.books() == ZERO_BOOKS


async def test_drain_answers_queued_waiters_and_close_releases_kv() -> None:
    dispatcher, _ = make_dispatcher()
    running = queued(dispatcher.submit(chat("a")))
    waiters = [queued(dispatcher.submit(chat(f"q{i}"))) for i in range(3)]
    assert dispatcher.drain() == 3
    assert all(w.drained and w.future is not None and waiter(w).done() for w in waiters)
    assert dispatcher.scheduler.books().queued_requests == 0
    dispatcher.complete(running, None, kv_hold_ms=1e9)  # would hold KV for ages
    dispatcher.close()
    assert dispatcher.scheduler.books() == ZERO_BOOKS


async def test_served_requests_leave_no_bookkeeping_behind() -> None:
    # A regression: skipping the core's wake-up computation on an empty queue also skipped the
    # pruning of its deadline heap, which then kept every served request (RSS grew ~30 MiB in
    # bench/bench_sidecar.py). Serve many requests one at a time, each completing before the
    # next arrives (the queue is empty between them): nothing may accumulate.
    clock = FakeClock()
    config = keyed_config(burst_service_tokens=10**9)  # no budget waits: dispatched at once
    scheduler = make_scheduler("tokenfair", config, clock.now_ms())
    dispatcher = Dispatcher(scheduler, clock, max_in_flight=4)
    for n in range(500):
        clock.model_ms = float(n)
        lifecycle = queued(dispatcher.submit(chat(f"r{n}", at_ms=clock.model_ms)))
        assert waiter(lifecycle).result().admitted
        dispatcher.complete(lifecycle, 600, kv_hold_ms=0.0)
    assert scheduler.books() == ZERO_BOOKS
    assert not scheduler.jobs
    # The deadline index is the core's private one; it must stay O(requests in flight).
    assert len(scheduler._deadlines) <= 1


class CountingClock(FakeClock):
    """A :class:`FakeClock` that counts its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def now_ms(self) -> float:
        self.reads += 1
        return self.model_ms


async def test_a_pump_pass_reads_the_clock_once() -> None:
    # The hot path (issue 34): a pass of the pump reads the model time once, and a request
    # admitted into an empty queue is dispatched on two reads (the core's submit, one pass).
    clock = CountingClock()
    scheduler = make_scheduler("tokenfair", keyed_config(), clock.now_ms())
    dispatcher = Dispatcher(scheduler, clock, max_in_flight=4)
    clock.reads = 0
    dispatcher.pump()
    assert clock.reads == 1
    clock.reads = 0
    lifecycle = queued(dispatcher.submit(chat("a")))
    assert waiter(lifecycle).result().admitted
    assert clock.reads == 2


def test_a_timer_below_the_loop_clocks_resolution_still_moves_the_clock() -> None:
    # The loop's time counts seconds from the machine's boot: past 2**17 s (36 h of uptime) a
    # step of it is 2**-35 s. The core asks to wake one ulp of model ms past a deadline, a few
    # picoseconds ahead: added to the loop's time, that delay rounded to now, the timer fired
    # with the time unmoved, and the dispatcher asked for the same instant again, forever on
    # a virtual clock (the tenant-limit tests hung once the machine had been up 18 h).
    async def fire_below_resolution() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        loop.advance(2.0**17 - loop.time())  # type: ignore[attr-defined]
        clock = ModelClock()
        start_ms = clock.now_ms()
        fired = asyncio.Event()
        clock.call_later(1e-12, fired.set)
        await fired.wait()
        return start_ms, clock.now_ms()

    start_ms, fired_ms = run_virtual(fire_below_resolution())
    assert fired_ms > start_ms
