"""The server's one time line: model milliseconds, real seconds, and timers on the same clock.

Every timer of the server — the dispatcher's wake-up and KV releases, the periodic tasks (engine
scrapes, fairness-signal refreshes, pool passes, record and log flushes) — reads time and waits
through an :class:`EventClock`, never through :func:`time.monotonic` or :func:`asyncio.sleep`
directly. :class:`ModelClock`, the production clock, reads the running event loop's own clock
(``loop.time()``: :func:`time.monotonic` on the standard loops) and schedules on that loop, so
model time, timers and the loop's own waits stay on one line. A test then makes time virtual in
one place: an event loop whose ``time()`` only moves when the loop has nothing left to do
(``tests/clock_support.py``), or a hand-stepped fake of this protocol for a unit.

Model time is ``real_seconds * 1000 / time_scale`` since the clock's origin: ``time_scale``
real seconds per model second (1.0 in production; a demo at 2.0 runs at half speed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    """A scheduled callback; :meth:`cancel` stops it if it has not run (an
    :class:`asyncio.TimerHandle` is one)."""

    def cancel(self) -> None: ...


class EventClock(Protocol):
    """Time in model milliseconds and real seconds, and a way to wait for a time."""

    time_scale: float

    def now_ms(self) -> float:
        """Model milliseconds since the clock's origin (monotonic)."""
        ...

    def real_seconds(self, model_ms: float) -> float:
        """How many real seconds ``model_ms`` model milliseconds last."""
        ...

    def monotonic_s(self) -> float:
        """Real seconds on the clock's monotonic line (the event loop's ``time()``)."""
        ...

    def call_later(self, delay_s: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Run ``callback(*args)`` once ``delay_s`` real seconds have passed."""
        ...

    async def sleep(self, delay_s: float) -> None:
        """Return once ``delay_s`` real seconds have passed."""
        ...


def _loop_time() -> Callable[[], float]:
    """The running loop's clock: :func:`time.monotonic` itself when it is the standard loops'
    (one call less per reading) or the clock is made outside a loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return time.monotonic
    if type(loop).time is asyncio.BaseEventLoop.time:  # `return time.monotonic()`
        return time.monotonic
    return loop.time


class ModelClock:
    """The production :class:`EventClock`: the running event loop's time and timers.

    Made inside the loop that will run the server (as the sidecar is), it follows that loop's
    ``time()`` — a virtual one in tests — and its origin is the moment it was made."""

    __slots__ = ("_origin", "_time", "time_scale")

    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self._time = _loop_time()
        self._origin = self._time()

    def now_ms(self) -> float:
        return (self._time() - self._origin) * 1000.0 / self.time_scale

    def real_seconds(self, model_ms: float) -> float:
        return model_ms * self.time_scale / 1000.0

    def monotonic_s(self) -> float:
        return self._time()

    def call_later(
        self, delay_s: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        """``loop.call_later``, except that a positive delay below the loop clock's
        resolution fires one step of that clock later, not now: the loop's time is seconds since
        some origin (the machine's boot: ~1.5e-11 s a step past 18 h of uptime), and a timer for
        a model instant a few picoseconds ahead (the core's next deadline is one ulp of model ms
        past now) added to it rounds to now, so it would fire without the time moving, and the
        core would ask for the same instant again: a busy loop, forever on a virtual clock."""
        loop = asyncio.get_running_loop()
        if delay_s > 0.0:
            now_s = loop.time()
            when_s = now_s + delay_s
            if when_s <= now_s:
                when_s = math.nextafter(now_s, math.inf)
            return loop.call_at(when_s, callback, *args)
        return loop.call_later(delay_s, callback, *args)

    async def sleep(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
