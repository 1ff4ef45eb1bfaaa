"""The asyncio side of scheduling: admitted requests wait on futures, the core decides who runs.

The core (:mod:`tokenfair_sidecar.core`) is synchronous and pure; this module moves requests:

* :meth:`Dispatcher.submit` runs admission at once: a refusal comes back as a ``Decision``;
  otherwise the request waits in the core's lanes and the caller gets a :class:`Ticket` whose
  future resolves with the request's dispatch decision (admitted, or shed at expiry).
* :meth:`Dispatcher.pump` — ``expire(now)`` then ``next_dispatch(now)`` until the core says no or
  ``max_in_flight`` requests run — is called synchronously whenever something changed (an arrival,
  a completion, a KV release, a cancellation) and from one timer armed at ``next_wakeup_ms`` (a
  deadline passing, a budget refilling). Pumping inline costs no task switch per request.
* :meth:`Dispatcher.finish` settles a dispatched request exactly once (``complete`` with the actual
  usage, or with the estimate if the core refuses that usage) and never raises: if the core fails
  (raises anything else, even for the estimate), the request's slot and KV are taken off the books
  by :meth:`Dispatcher.release_unsettled`, which touches no settlement code of the core. Its KV is
  released ``kv_hold_ms`` after dispatch (0 for a real server: at once).
* A waiter whose task is cancelled (the client went away) leaves the queue with ``cancel`` and its
  reservation is refunded; if it was dispatched in that instant it is settled with zero usage.

Time: the scheduler's clock is model milliseconds, ``real_seconds * 1000 / time_scale`` since start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from tokenfair_sidecar.core import Decision, Request, Scheduler
from tokenfair_sidecar.core.jobs import CANCELLED, STATUS_CLIENT_CLOSED, JobState

log = logging.getLogger("tokenfair.sidecar")


class ModelClock:
    """Monotonic model time in milliseconds; ``time_scale`` real seconds per model second."""

    __slots__ = ("_origin", "time_scale")

    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self._origin = time.monotonic()

    def now_ms(self) -> float:
        return (time.monotonic() - self._origin) * 1000.0 / self.time_scale

    def real_seconds(self, model_ms: float) -> float:
        return model_ms * self.time_scale / 1000.0


class Settlement(enum.Enum):
    """How :meth:`Dispatcher.finish` settled a request."""

    AS_REPORTED = "as_reported"
    """The usage given was booked (or the request was already settled)."""
    AT_ESTIMATE = "at_estimate"
    """The core refused the usage given (``ValueError``, ``TypeError``, ``ArithmeticError``:
    a value it cannot book): the estimate was booked instead."""
    CORE_FAILED = "core_failed"
    """The core raised something else (a bug, logged): the estimate was booked instead or, if
    even that raised, the slot and KV were released unsettled."""


@dataclass(slots=True, eq=False)
class Ticket:
    """One queued request's handle. ``outcome`` is its final decision once known."""

    request: Request
    future: asyncio.Future[Decision]
    decision: Decision | None = None
    """The dispatch decision, once admitted."""
    outcome: Decision | None = None
    drained: bool = False
    """Removed from the queue by a drain (the client gets 503)."""
    dispatched_at_s: float = 0.0
    """Event-loop time of the dispatch (a backend's engine may start then, before the handler
    gets round to it)."""
    finished: bool = field(default=False)
    """Settled: its running slot is released (set only once that is done)."""


class Dispatcher:
    """Drives one :class:`Scheduler` in real time. All methods run on the event loop thread."""

    def __init__(self, scheduler: Scheduler, clock: ModelClock, max_in_flight: int) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.draining = False
        self.aborting = False
        """The drain grace is over: handlers still running are being cancelled by the sidecar
        (their requests are recorded ``503 drain_aborted``, not as clients that left)."""
        self.handlers: set[asyncio.Task[Any]] = set()
        """Tasks of the handlers between admission and their record (:meth:`abort_handlers`)."""
        self._tickets: dict[str, Ticket] = {}
        self._kv_timers: dict[str, asyncio.TimerHandle] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._pumping = False
        self._again = False
        self._idle = asyncio.Event()
        self._idle.set()

    # -- arrival and waiting ---------------------------------------------------------------

    def submit(self, request: Request) -> Decision | Ticket:
        """Admission; a refusal ``Decision`` or a queued :class:`Ticket`. A request that no
        state of the running configuration could admit is answered first, whatever the load,
        with the scheduler's ``400`` (:meth:`~tokenfair_sidecar.core.scheduler.Scheduler.
        never_admissible`, a static check of the request: a client must not retry it) and never
        reaches the scheduler's gates (whose ``queue_full`` or ``shed_queue_wait_slo`` 429 would
        tell it to retry)."""
        scheduler = self.scheduler
        never = scheduler.never_admissible(request)
        if never is not None:
            return never
        refusal = scheduler.submit(request, self.clock.now_ms())
        if refusal is not None:
            return refusal
        ticket = Ticket(request, asyncio.get_running_loop().create_future())
        self._tickets[request.request_id] = ticket
        self.pump()
        return ticket

    async def wait(self, ticket: Ticket) -> Decision:
        """The ticket's dispatch decision; cancellation (client gone) leaves the queue."""
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise

    def _abandon(self, ticket: Ticket) -> None:
        future = ticket.future
        if future.done() and not future.cancelled():
            decision = future.result()
            if decision.admitted and not ticket.finished:
                self.finish(ticket, 0, 0.0)
                ticket.outcome = _cancelled(decision)
            return
        if ticket.outcome is not None:  # the pump already saw the cancelled future
            return
        self._tickets.pop(ticket.request.request_id, None)
        ticket.outcome = self.scheduler.cancel(ticket.request.request_id, self.clock.now_ms())
        self.pump()

    # -- dispatch --------------------------------------------------------------------------

    def pump(self) -> None:
        """Expire, then dispatch while the core allows and the in-flight limit holds."""
        if self._pumping:  # re-entered from a settlement inside the loop below
            self._again = True
            return
        self._pumping = True
        scheduler = self.scheduler
        try:
            again = True
            while again:
                self._again = False
                now_ms = self.clock.now_ms()
                for decision in scheduler.expire(now_ms):
                    self._resolve(decision)
                while scheduler.running < self.max_in_flight and scheduler.queued_total:
                    next_decision = scheduler.next_dispatch(now_ms)
                    if next_decision is None:
                        break
                    self._resolve(next_decision)
                again = self._again
            self._arm_timer(now_ms)
        finally:
            self._pumping = False

    def _resolve(self, decision: Decision) -> None:
        ticket = self._tickets.pop(decision.request_id)
        if decision.admitted:
            ticket.decision = decision
            ticket.dispatched_at_s = asyncio.get_running_loop().time()
            self._idle.clear()
        if ticket.future.cancelled():
            # The client left after its task was cancelled but before its handler ran.
            if decision.admitted:
                self.finish(ticket, 0, 0.0)
                ticket.outcome = _cancelled(decision)
            else:
                ticket.outcome = decision
            return
        if not decision.admitted:
            ticket.outcome = decision
        ticket.future.set_result(decision)

    def _arm_timer(self, now_ms: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        wakeup_ms = self.scheduler.next_wakeup_ms(now_ms)
        if wakeup_ms is not None:
            delay_s = self.clock.real_seconds(max(0.0, wakeup_ms - now_ms))
            self._timer = asyncio.get_running_loop().call_later(delay_s, self.pump)

    # -- settlement ------------------------------------------------------------------------

    def finish(
        self, ticket: Ticket, actual_service_tokens: int | None, kv_hold_ms: float
    ) -> Settlement:
        """Settle a dispatched request (once; later calls do nothing) and schedule its KV release
        ``kv_hold_ms`` model milliseconds after its dispatch. Never raises for the core's sake:
        the running slot and the KV are released whatever ``complete`` raises (see
        :class:`Settlement`); ``ticket.finished`` is set once the slot is released."""
        if ticket.finished or ticket.decision is None:
            return Settlement.AS_REPORTED
        request_id = ticket.request.request_id
        now_ms = self.clock.now_ms()
        settlement = Settlement.AS_REPORTED
        scheduler = self.scheduler
        try:
            scheduler.complete(request_id, now_ms, actual_service_tokens, release_kv=False)
        except Exception as exc:
            if actual_service_tokens is None:  # the estimate itself: nothing else to try
                settlement = Settlement.CORE_FAILED
                log.exception("request %s: the core failed to settle it at the estimate",
                              request_id)  # fmt: skip
            else:
                if isinstance(exc, ValueError | TypeError | ArithmeticError):
                    settlement = Settlement.AT_ESTIMATE
                    log.warning("request %s: the core refused the reported usage (%s); "
                                "settling at the estimate", request_id, exc)  # fmt: skip
                else:
                    settlement = Settlement.CORE_FAILED
                    log.exception("request %s: the core failed to settle it; settling at the "
                                  "estimate", request_id)  # fmt: skip
                if not self._complete_at_estimate(request_id, now_ms):
                    settlement = Settlement.CORE_FAILED
        if not math.isfinite(kv_hold_ms):
            kv_hold_ms = 0.0
        job = scheduler.jobs.get(request_id)
        if job is not None and job.state is not JobState.DONE:  # still running: not settled
            settlement = Settlement.CORE_FAILED
            self.release_unsettled(request_id)
        else:
            dispatch_ms = ticket.decision.dispatch_ms or now_ms
            release_ms = dispatch_ms + kv_hold_ms
            if release_ms <= now_ms:
                self._release(request_id, timer=False)
            else:
                delay_s = self.clock.real_seconds(release_ms - now_ms)
                loop = asyncio.get_running_loop()
                self._kv_timers[request_id] = loop.call_later(delay_s, self._release, request_id)
        ticket.finished = True
        if scheduler.running == 0:
            self._idle.set()
        try:
            self._pump_if_queued()
        except Exception:  # the settlement stands; the next event pumps again
            log.exception("request %s: dispatching after its settlement failed", request_id)
        return settlement

    def _complete_at_estimate(self, request_id: str, now_ms: float) -> bool:
        """``complete`` at the estimate; False (logged) if the core raised even for that."""
        try:
            self.scheduler.complete(request_id, now_ms, None, release_kv=False)
        except Exception:
            log.exception("request %s: the core failed to settle it at the estimate too",
                          request_id)  # fmt: skip
            return False
        return True

    def release_unsettled(self, request_id: str) -> None:
        """The last resort when the core raised while settling or releasing a request:
        :meth:`Scheduler.release_unsettled` takes its slot and KV off the books. Logged."""
        if self.scheduler.release_unsettled(request_id):
            log.error("request %s: released without settlement; the core's books for its "
                      "tenant may be off by this request", request_id)  # fmt: skip

    def _release(self, request_id: str, timer: bool = True) -> None:
        """Free the request's KV (from its timer, or at once); if the core raises, the blocks
        are taken off the books by :meth:`release_unsettled`."""
        if timer:
            del self._kv_timers[request_id]
        try:
            self.scheduler.release_kv(request_id)
        except Exception:
            log.exception("request %s: the core failed to release its KV", request_id)
            self.release_unsettled(request_id)
        if timer:
            self._pump_if_queued()

    def _pump_if_queued(self) -> None:
        """Freed capacity matters only to queued requests: with none, there is nothing to
        dispatch or expire, and a timer still armed finds nothing when it fires."""
        if self.scheduler.queued_total:
            self.pump()

    # -- drain and shutdown ----------------------------------------------------------------

    def drain(self) -> int:
        """Refuse new work and take every queued request out (their callers answer 503).
        Returns how many were queued."""
        self.draining = True
        now_ms = self.clock.now_ms()
        tickets = list(self._tickets.values())
        self._tickets.clear()
        for ticket in tickets:
            decision = self.scheduler.cancel(ticket.request.request_id, now_ms)
            ticket.drained = True
            ticket.outcome = decision
            if decision is not None and not ticket.future.done():
                ticket.future.set_result(decision)
        return len(tickets)

    async def abort_handlers(self, timeout_s: float) -> int:
        """Cancel every handler still running after the drain grace and wait at most
        ``timeout_s`` for them to settle and record their requests. Returns how many were
        cancelled. Done here, not by aiohttp's shutdown (which first waits its whole timeout
        for handlers to end on their own, then as long again after cancelling them), so the
        drain ends within the grace plus ``timeout_s``."""
        self.aborting = True
        tasks = [task for task in self.handlers if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return len(tasks)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs on the backend; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop the timers and release every KV reservation still held (shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for request_id, handle in list(self._kv_timers.items()):
            handle.cancel()
            del self._kv_timers[request_id]
            self._release(request_id, timer=False)

    @property
    def queued(self) -> int:
        return len(self._tickets)


def _cancelled(decision: Decision) -> Decision:
    return dataclasses.replace(decision, status_code=STATUS_CLIENT_CLOSED, reason=CANCELLED)
