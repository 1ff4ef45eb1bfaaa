"""The ``costmodel`` backend's batching engine (``maxBatchRequests`` ``S > 1``), in real time.

The simulator's engine (``sim/simulator.py``) on the event loop's clock: the requests running
share one :class:`~tokenfair.core.batching.RunningWork`, a processor-sharing fluid over model
milliseconds (``loop.time() * 1000 / time_scale``), each at ``v(c)`` of the policy's
:class:`~tokenfair.core.batching.BatchingCurve`. Whenever a request joins or leaves, every other
request's forecast end moves; one timer is armed for the next end, and at it the request (and
any ended with it) is woken, its future resolved, and the timer armed for the one after.

A request joins the fluid when its handler runs, within a loop iteration of its dispatch (the
fluid never runs backwards: a start stamped earlier counts from the fluid's present).

Its first token comes at ``dispatch + prefill_ms(p) * v(1) / v(c)``, ``c`` the requests running
once the dispatches of that moment have started (the handlers dispatched by one pump start
before any of them reads ``c``: :meth:`BatchingEngine.first_token_s` yields once first), the
simulator's rule. Streamed chunks after the first are paced by the request's *attained*
service (:meth:`BatchingEngine.until_attained`): chunk ``i`` of ``n`` when it has received
``i / n`` of its work, whatever the others do meanwhile.
"""

from __future__ import annotations

import asyncio
import math
from typing import Final

from tokenfair.core.batching import BatchingCurve, RunningWork

DUE_S: Final = 1e-6
"""A forecast end this close (real seconds) is due now: the timer fires at its time, and the
fluid's float arithmetic may leave a microsecond to run."""


class BatchingEngine:
    """Requests running at once in real time, as a processor-sharing fluid (module docstring).
    All methods run on the event loop's thread."""

    def __init__(self, curve: BatchingCurve, time_scale: float) -> None:
        self._work = RunningWork(curve)
        self._time_scale = time_scale
        self._ends: dict[str, asyncio.Future[None]] = {}
        self._sizes: dict[str, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def curve(self) -> BatchingCurve:
        return self._work.curve

    @property
    def running(self) -> int:
        return self._work.running

    def retune(self, curve: BatchingCurve) -> None:
        """New speeds from now on (a reload); progress so far stands."""
        self._work.retune(curve, self._now_ms())
        self._arm()

    def _now_ms(self) -> float:
        return asyncio.get_running_loop().time() * 1000.0 / self._time_scale

    def _loop_s(self, model_ms: float) -> float:
        return model_ms * self._time_scale / 1000.0

    def start(self, request_id: str, service_tokens: float, dispatched_at_s: float) -> None:
        """The request joins the batch (its run counted from ``dispatched_at_s``, loop time, or
        from the fluid's present if that is later)."""
        loop = asyncio.get_running_loop()
        start_ms = max(dispatched_at_s * 1000.0 / self._time_scale, 0.0)
        self._ends[request_id] = loop.create_future()
        self._sizes[request_id] = service_tokens
        self._work.start(request_id, service_tokens, start_ms)
        self._arm()

    def leave(self, request_id: str) -> None:
        """The request is over (ended, or its client left): off the fluid if still on it; the
        others speed up. Idempotent."""
        size = self._sizes.pop(request_id, None)
        end = self._ends.pop(request_id, None)
        if size is None:
            return
        if end is not None and not end.done():
            end.cancel()
        self._work.finish(request_id, self._now_ms(), size)
        self._arm()

    async def ended(self, request_id: str) -> None:
        """Wait until the fluid ends the request."""
        end = self._ends.get(request_id)
        if end is not None:
            await asyncio.shield(end)

    def is_running(self, request_id: str) -> bool:
        end = self._ends.get(request_id)
        return end is not None and not end.done()

    async def first_token_s(self, dispatched_at_s: float, prefill_ms: float) -> float:
        """Loop time of the request's first token: ``prefill_ms`` stretched by the slowdown at
        its dispatch (the module docstring's rule). Yields once first, so that the other
        requests dispatched with it have joined."""
        await asyncio.sleep(0)
        slowdown = self._work.curve.slowdown(self._work.running)
        return dispatched_at_s + self._loop_s(prefill_ms * slowdown)

    async def until_attained(self, request_id: str, tokens: float) -> None:
        """Wait until the request has received ``tokens`` service tokens (or has ended): sleep
        for what it needs at the speed of the moment, look again (the speed changes when
        others join or leave; the end wakes it at once)."""
        end = self._ends.get(request_id)
        while end is not None and not end.done():
            now_ms = self._now_ms()
            missing = tokens - self._work.attained_tokens(request_id, now_ms)
            if missing <= 0.0:
                return
            speed = self._work.curve.request_speed(self._work.running)
            await asyncio.wait((end,), timeout=max(self._loop_s(missing / speed), DUE_S))

    def _arm(self) -> None:
        """One timer, at the forecast's next end."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._work.running:
            return
        in_ms = self._work.next_departure_ms(self._now_ms())
        if math.isinf(in_ms):
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._loop_s(in_ms), self._departures)

    def _departures(self) -> None:
        """The timer: end every request the forecast ends by now, then arm for the next."""
        self._timer = None
        work = self._work
        now_ms = self._now_ms()
        while work.running and self._loop_s(work.next_departure_ms(now_ms)) <= DUE_S:
            request_id = work.finish_first(now_ms)
            self._sizes.pop(request_id, None)
            end = self._ends.pop(request_id, None)
            if end is not None and not end.done():
                end.set_result(None)
        self._arm()
