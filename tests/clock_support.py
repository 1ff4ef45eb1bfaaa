"""Time for tests that does not depend on the machine's speed.

Two fakes of the server's time line (:mod:`tokenfair.server.clock`):

* :class:`VirtualTimeLoop` — an event loop whose ``time()`` is virtual and moves only when the
  loop has nothing else to do: no callback ready, no I/O readable or writable, no work in its
  executor threads. It then jumps straight to its next timer. Everything that waits on the
  loop's clock (``asyncio.sleep``, ``call_later``, ``asyncio.timeout``, the sidecar's
  :class:`~tokenfair.server.clock.ModelClock` made inside the loop, the ``costmodel`` backend)
  sees the same virtual time, and a busy or slow machine cannot make any of it late: work
  takes no virtual time at all. Real sockets still work (bytes written on loopback are readable
  when the write returns; the loop looks before it jumps). Run a coroutine on one with
  :func:`run_virtual`, or ask for the ``virtual_loop`` fixture in an async test.
* :class:`ManualClock` — an :class:`~tokenfair.server.clock.EventClock` stepped by hand
  (:meth:`ManualClock.advance`), for a unit whose timers should fire exactly when the test says.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from concurrent.futures import Future as ThreadFuture
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

VIRTUAL_START_S = 1_000.0
"""Where every :class:`VirtualTimeLoop`'s clock starts, whatever the machine's uptime.

A constant, so that no result depends on the machine: the clock used to start at the real
``time.monotonic()`` (seconds since boot), and past ~18 h of uptime (2**16 s) one step of a
float there is ~1.5e-11 s, so arithmetic on loop times lost bits, differently on each machine
(a test read 0.4 s as 0.39999999999; a sub-resolution timer re-armed the same instant forever).
Whole seconds, so sums of whole or binary-fraction durations are exact (``start + 3600.0 -
start`` is ``3600.0``); small, so a step of the clock here is ~1.1e-13 s (a decimal duration is
still no exact difference of two readings: 1000.65 - 1000.25 is 0.39999999999997726, on every
machine). Not zero, so that a timestamp of ``0.0`` meaning "never" stays far in the past.

It is far from the real monotonic clock on most machines, so nothing under test may compare a
loop time with ``time.monotonic()``. Nothing does: the server's clocks read ``loop.time()``
(a :class:`~tokenfair.server.clock.ModelClock` made inside the loop, as the sidecar and the
tests make it), and what reads the real or wall clock (access-log and span timestamps, the
budget pool's store clock, the config feed's health, the access log's flush wait) compares it
only with itself. The virtual-loop tests pass started at 3.0 s and at 2**17 s as well."""

THREAD_POLL_S = 0.001
"""Real seconds the virtual loop waits for I/O, at a time, while a thread of its executor works
(time does not move then: the thread's result may be what the loop is waiting for)."""


class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector, but a wait for a timer is a jump of the virtual clock."""

    def __init__(self, loop_time: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop_time

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout == 0:
            self._loop.step_past_a_due_timer()
            return ready
        if self._loop.threads_working:
            return self._real.select(
                THREAD_POLL_S if timeout is None else min(timeout, THREAD_POLL_S)
            )
        if timeout is None:  # no timer at all: only the outside world can wake the loop
            return self._real.select(None)
        self._loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (see the module's docstring)."""

    def __init__(self) -> None:
        self._virtual_now = VIRTUAL_START_S  # read here, not bound at import (a test may set it)
        self.threads_working = 0
        """Calls running in the executor (time stands still until they are done)."""
        self.jumps = 0
        """How many times the clock jumped to the next timer."""
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds
        self.jumps += 1

    def step_past_a_due_timer(self) -> None:
        """Nothing to run now but a timer due at this very time: move the clock one float step.
        asyncio runs a timer when it is due before ``time() + clock resolution`` (1e-9 s); past
        ~2**22 s one step of a float is longer than that, so the sum rounds to ``time()``, and a
        timer due exactly now (every sleep, once the clock has jumped to it) is never run on a
        clock that moves only when the loop waits: the loop span for ever (review rev1207f, at
        a start of 2**24 s). Never taken at :data:`VIRTUAL_START_S`, where a step is ~1e-13 s.
        Reads the loop's ``_ready`` and ``_scheduled`` (asyncio's own, not public)."""
        loop: Any = self
        if loop._ready:
            return  # callbacks to run: the loop is not waiting
        scheduled = loop._scheduled
        if scheduled and scheduled[0].when() <= self._virtual_now:
            self._virtual_now = math.nextafter(self._virtual_now, math.inf)

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.threads_working += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any] | ThreadFuture[Any]) -> None:
        self.threads_working -= 1


def run_virtual(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coroutine)


class _ManualTimer:
    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """An :class:`~tokenfair.server.clock.EventClock` that moves only in :meth:`advance`."""

    def __init__(self, time_scale: float = 1.0, start_s: float = 0.0) -> None:
        self.time_scale = time_scale
        self._now_s = start_s
        self._origin_s = start_s
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()

    def now_ms(self) -> float:
        return (self._now_s - self._origin_s) * 1000.0 / self.time_scale

    def real_seconds(self, model_ms: float) -> float:
        return model_ms * self.time_scale / 1000.0

    def monotonic_s(self) -> float:
        return self._now_s

    def call_later(
        self, delay_s: float, callback: Callable[..., object], *args: Any
    ) -> _ManualTimer:
        timer = _ManualTimer(self._now_s + max(0.0, delay_s), callback, args)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    async def sleep(self, delay_s: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not future.done():
                future.set_result(None)

        timer = self.call_later(delay_s, wake)
        try:
            await future
        finally:
            timer.cancel()

    @property
    def pending(self) -> int:
        """Timers not yet run nor cancelled."""
        return sum(not timer.cancelled for _, _, timer in self._timers)

    def advance(self, seconds: float) -> int:
        """Move time ``seconds`` forward, running each timer due on the way at its own time,
        in order (a timer a callback sets within the step runs too if it is due). Returns how
        many ran. A sleeper woken here resumes when the event loop next turns: ``await
        asyncio.sleep(0)`` after a step lets it."""
        end = self._now_s + seconds
        ran = 0
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now_s = max(self._now_s, when)
            timer.callback(*timer.args)
            ran += 1
        self._now_s = end
        return ran
