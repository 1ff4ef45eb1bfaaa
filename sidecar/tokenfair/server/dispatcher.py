"""The asyncio side of scheduling: admitted requests wait on futures, the core decides who runs.

The core (:mod:`tokenfair.core`) is synchronous and pure; this module moves requests:

* :meth:`Dispatcher.submit` runs admission at once and returns the request's
  :class:`~tokenfair.server.lifecycle.Lifecycle`: REFUSED, or QUEUED in the core's lanes
  with a future that resolves with the decision that ends its wait (dispatched, or shed at
  expiry).
* :meth:`Dispatcher.pump` — ``expire(now)`` then ``next_dispatch(now)`` until the core says no or
  ``max_in_flight`` requests run — is called synchronously whenever something changed (an arrival,
  a completion, a KV release, a cancellation) and from one timer armed at ``next_wakeup_ms`` (a
  deadline passing, a budget refilling). Pumping inline costs no task switch per request.
* :meth:`Dispatcher.complete` books a dispatched request (``complete`` with the actual usage, or
  with the estimate if the core refuses that usage) and never raises: if the core fails (raises
  anything else, even for the estimate), the request's slot and KV are taken off the books by
  :meth:`Dispatcher.release_unsettled`, which touches no settlement code of the core. Its KV is
  released ``kv_hold_ms`` after dispatch (0 for a real server: at once).
* A waiter whose task is cancelled (the client went away) leaves the queue with ``cancel`` and its
  reservation is refunded; if it was dispatched in that instant it is settled with zero usage.

Each request's phase lives in its :class:`~tokenfair.server.lifecycle.Lifecycle`; the
dispatcher makes the moves that belong to the queue and the books, and
:meth:`Lifecycle.complete <tokenfair.server.lifecycle.Lifecycle.complete>` the one outcome.

Time: the scheduler's clock is model milliseconds, ``real_seconds * 1000 / time_scale`` since start;
it, the dispatch instants and the dispatcher's timers all go through the injected
:class:`~tokenfair.server.clock.EventClock` (a test steps a fake one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any, Final

from tokenfair.core import Decision, Request, Scheduler, Settled
from tokenfair.core.jobs import CANCELLED, STATUS_CLIENT_CLOSED
from tokenfair.server.clock import EventClock, Timer
from tokenfair.server.errors import INTERNAL_ERROR
from tokenfair.server.lifecycle import (
    DRAINING,
    Lifecycle,
    LifecycleError,
    Phase,
    Settlement,
)

log = logging.getLogger("tokenfair.sidecar")

PUMP_RETRY_S: Final = 0.01
"""Real seconds until a pump that failed in the core is tried again; doubled at each failure
in a row, up to :data:`PUMP_RETRY_MAX_S`."""
PUMP_RETRY_MAX_S: Final = 1.0
PUMP_FAILURES_TO_GIVE_UP: Final = 10
"""Pumps failing in a row (~4 s of retries) after which every queued request is ended
``500 internal_error`` (its reservation refunded): a core that cannot dispatch would otherwise
hold its waiters until their clients give up."""


class Dispatcher:
    """Drives one :class:`Scheduler` in real time. All methods run on the event loop thread."""

    def __init__(self, scheduler: Scheduler, clock: EventClock, max_in_flight: int) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.draining = False
        self.aborting = False
        """The drain grace is over: handlers still running are being cancelled by the sidecar
        (their requests are recorded ``503 drain_aborted``, not as clients that left)."""
        self.handlers: set[asyncio.Task[Any]] = set()
        """Tasks of the handlers between admission and their record (:meth:`abort_handlers`)."""
        self._queued: dict[str, Lifecycle] = {}
        """Lifecycles of the requests in the core's queue, by request id."""
        self._kv_timers: dict[str, Timer] = {}
        self._timer: Timer | None = None
        self._pumping = False
        self._again = False
        self._pump_failures = 0
        """Pumps that failed in a row (the first is logged with its traceback)."""
        self._idle = asyncio.Event()
        self._idle.set()

    # -- arrival and waiting ---------------------------------------------------------------

    def submit(self, request: Request) -> Lifecycle:
        """Admission: the request's lifecycle, REFUSED (its ``decision`` says why) or QUEUED.
        A request that no state of the running configuration could admit is refused first,
        whatever the load, with the scheduler's ``400`` (:meth:`~tokenfair.core.
        scheduler.Scheduler.never_admissible`, a static check of the request: a client must not
        retry it) and never reaches the scheduler's gates (whose ``queue_full`` or
        ``shed_queue_wait_slo`` 429 would tell it to retry)."""
        scheduler = self.scheduler
        if self.draining:  # its body was still arriving when the drain began
            return Lifecycle(request, Phase.REFUSED, decision=self._refusal(request, 503, DRAINING))
        refusal = scheduler.never_admissible(request)
        if refusal is None:
            refusal = scheduler.submit(request, self.clock.now_ms())
        if refusal is not None:
            if refusal.would_refuse:  # shadow mode: served anyway, beside the core's books
                future = asyncio.get_running_loop().create_future()
                future.set_result(self._beside(refusal))
                return Lifecycle(request, Phase.BESIDE, decision=refusal, future=future,
                                 dispatched_at_s=self.clock.monotonic_s())  # fmt: skip
            return Lifecycle(request, Phase.REFUSED, decision=refusal)
        lifecycle = Lifecycle(
            request, Phase.QUEUED, future=asyncio.get_running_loop().create_future()
        )
        self._queued[request.request_id] = lifecycle
        self.pump()
        return lifecycle

    def _beside(self, refusal: Decision) -> Decision:
        """A refusal the core marked ``would_refuse`` (shadow mode), served now beside the
        books: ``200``, dispatched now; its reason, gate and the values its gate saw stay."""
        refusal.status_code = 200
        refusal.dispatch_ms = self.clock.now_ms()
        return refusal

    def _refusal(self, request: Request, status_code: int, reason: str) -> Decision:
        """A decision of the dispatcher's own (not the core's gates): ``503 draining`` for a
        request that reached admission during a drain, ``500 internal_error`` for one the core
        could not dispatch."""
        return Decision(
            request.request_id,
            request.tenant_id,
            request.priority_class,
            status_code,
            reason,
            "drain" if reason == DRAINING else "dispatch",
            self.scheduler.cost.service_tokens(request.prefill_tokens, request.decode_tokens),
            request.arrival_ms,
        )

    async def wait(self, lifecycle: Lifecycle) -> Decision:
        """The decision that ends the request's wait; cancellation (the client went away) takes
        it out of the queue, or settles it at zero if it was dispatched in that instant."""
        future = lifecycle.future
        if future is None:  # refused at the door: its wait is already over
            raise LifecycleError(f"request {lifecycle.request.request_id} never queued")
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(lifecycle)
            raise

    def _abandon(self, lifecycle: Lifecycle) -> None:
        if lifecycle.phase is Phase.QUEUED:
            request_id = lifecycle.request.request_id
            del self._queued[request_id]
            decision = self.scheduler.cancel(request_id, self.clock.now_ms())
            if decision is None:
                log.error("request %s: cancelled while queued, but the core did not hold it",
                          request_id)  # fmt: skip
            lifecycle.left_queue(decision)
            self.pump()
        elif lifecycle.phase is Phase.RUNNING:  # dispatched in the instant its client left
            self.complete(lifecycle, 0, 0.0)

    # -- dispatch --------------------------------------------------------------------------

    def pump(self) -> None:
        """Expire, then dispatch while the core allows and the in-flight limit holds.

        Never raises (it runs inside admission, settlement and timers): if the core raises
        (a bug), the failure is logged — the first of a streak with its traceback, then at the
        2nd, 4th, 8th, … — and the pump runs again after :data:`PUMP_RETRY_S`, doubled at each
        failure up to :data:`PUMP_RETRY_MAX_S`, so nothing stays queued on a lost wake-up; what
        was resolved before the failure stands. After :data:`PUMP_FAILURES_TO_GIVE_UP` in a
        row, the queued requests are ended ``500 internal_error`` (:meth:`_fail_queued`)."""
        if self._pumping:  # re-entered from a settlement inside the loop below
            self._again = True
            return
        self._pumping = True
        scheduler = self.scheduler
        now_ms = self.clock.now_ms()  # one read per pass: the first pass is at this instant
        failed = False
        try:
            again = True
            while again:
                self._again = False
                for decision in scheduler.expire(now_ms):
                    self._resolve(decision)
                while scheduler.running < self.max_in_flight and scheduler.queued_total:
                    next_decision = scheduler.next_dispatch(now_ms)
                    if next_decision is None:
                        break
                    self._resolve(next_decision)
                again = self._again
                if again:
                    now_ms = self.clock.now_ms()
        except Exception:
            failed = True
            self._pump_failures += 1
            failures = self._pump_failures
            if failures == 1:
                log.exception("dispatching failed in the core; retrying in %g s", PUMP_RETRY_S)
            elif failures & (failures - 1) == 0:  # a power of two: a bounded number of lines
                log.error("dispatching failed again in the core (%d in a row)", failures)
        finally:
            self._pumping = False
        if not failed:
            self._pump_failures = 0
        elif self._pump_failures >= PUMP_FAILURES_TO_GIVE_UP and self._queued:
            self._fail_queued()
        self._arm_timer(now_ms, retry=failed)

    def _fail_queued(self) -> None:
        """End every queued request ``500 internal_error``: taken out of the core (refunded) if
        the core can still do that, out of the dispatcher's books whatever it raises."""
        log.error("dispatching has failed %d times in a row: ending the %d queued requests "
                  "with 500", self._pump_failures, len(self._queued))  # fmt: skip
        now_ms = self.clock.now_ms()
        lifecycles = list(self._queued.values())
        self._queued.clear()
        for lifecycle in lifecycles:
            request = lifecycle.request
            try:
                left = self.scheduler.cancel(request.request_id, now_ms)
            except Exception:
                log.exception("request %s: the core failed to take it out of its queue",
                              request.request_id)  # fmt: skip
                left = None
            failed = (
                dataclasses.replace(left, status_code=500, reason=INTERNAL_ERROR)
                if left is not None
                else self._refusal(request, 500, INTERNAL_ERROR)
            )
            lifecycle.left_queue(failed)
            future = lifecycle.future
            if future is not None and not future.done():
                future.set_result(failed)

    def _resolve(self, decision: Decision) -> None:
        lifecycle = self._queued.pop(decision.request_id)
        future = lifecycle.future
        assert future is not None  # QUEUED lifecycles have one
        if decision.would_refuse and not future.cancelled():
            # Shadow mode: refused from the queue (expired, or at dispatch), served anyway.
            lifecycle.served_beside(self._beside(decision), self.clock.monotonic_s())
            future.set_result(decision)
            return
        if decision.admitted:
            lifecycle.dispatched(decision, self.clock.monotonic_s())
            self._idle.clear()
        elif future.cancelled():  # its client left first: that is its outcome, not the expiry
            lifecycle.left_queue(
                dataclasses.replace(decision, status_code=STATUS_CLIENT_CLOSED, reason=CANCELLED)
            )
        else:
            lifecycle.left_queue(decision)
        if future.cancelled():
            # The client left after its task was cancelled but before its handler ran (its
            # `wait` finds the lifecycle moved on): nothing ran, so it is settled at zero.
            if decision.admitted:
                self.complete(lifecycle, 0, 0.0)
            return
        future.set_result(decision)

    def _arm_timer(self, now_ms: float, retry: bool = False) -> None:
        """Arm the one timer at the core's next wake-up (sooner after a failed pump: the retry
        delay, see :meth:`pump`). Never raises: a core that cannot say when to wake is retried
        too."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            wakeup_ms = self.scheduler.next_wakeup_ms(now_ms)
        except Exception:
            log.exception("the core failed to give its next wake-up; retrying")
            wakeup_ms, retry = None, True
        delay_s = None
        if wakeup_ms is not None:
            delay_s = self.clock.real_seconds(max(0.0, wakeup_ms - now_ms))
        if retry:
            exponent = max(0, min(self._pump_failures - 1, 30))
            backoff_s = min(PUMP_RETRY_MAX_S, PUMP_RETRY_S * 2**exponent)
            delay_s = backoff_s if delay_s is None else min(delay_s, backoff_s)
        if delay_s is not None:
            self._timer = self.clock.call_later(delay_s, self.pump)

    # -- settlement ------------------------------------------------------------------------

    def complete(
        self, lifecycle: Lifecycle, actual_service_tokens: int | None, kv_hold_ms: float
    ) -> Settlement | None:
        """Book a RUNNING request (``actual_service_tokens``; ``None``: the estimate), release
        its running slot, schedule its KV release ``kv_hold_ms`` model milliseconds after its
        dispatch, and move it to SETTLED. Never raises for the core's sake: the slot and the KV
        are released whatever ``complete`` raises (see
        :class:`~tokenfair.server.lifecycle.Settlement`). A request not RUNNING is left
        as it is: its settlement is returned (``None`` if it never ran)."""
        if lifecycle.phase is not Phase.RUNNING or lifecycle.decision is None:
            return lifecycle.settlement
        request_id = lifecycle.request.request_id
        now_ms = self.clock.now_ms()
        settlement = Settlement.AS_REPORTED
        scheduler = self.scheduler
        settled: Settled | None = None
        try:
            settled = scheduler.complete(
                request_id, now_ms, actual_service_tokens, release_kv=False
            )
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
                settled = self._complete_at_estimate(request_id, now_ms)
        if settled is None:  # neither `complete` returned
            settlement = Settlement.CORE_FAILED
        if not math.isfinite(kv_hold_ms):
            kv_hold_ms = 0.0
        # Only a `complete` that raised leaves the question whether the core settled it (it
        # may have raised after): then, and only then, the core is asked.
        if settled is None and scheduler.is_running(request_id):  # it did not
            self.release_unsettled(request_id)
        else:
            dispatch_ms = lifecycle.decision.dispatch_ms
            if dispatch_ms is None:
                dispatch_ms = now_ms
            release_ms = dispatch_ms + kv_hold_ms
            if release_ms <= now_ms:
                self._release(request_id, timer=False)
            else:
                delay_s = self.clock.real_seconds(release_ms - now_ms)
                self._kv_timers[request_id] = self.clock.call_later(
                    delay_s, self._release, request_id
                )
        booked = None  # the estimate, as the outcome sink reads None
        if settlement is Settlement.AS_REPORTED and settled is not None and not settled.at_estimate:
            booked = settled.service_tokens
        lifecycle.settled(settlement, booked)
        if scheduler.running == 0:
            self._idle.set()
        try:
            self._pump_if_queued()
        except Exception:  # the settlement stands; the next event pumps again
            log.exception("request %s: dispatching after its settlement failed", request_id)
        return settlement

    def _complete_at_estimate(self, request_id: str, now_ms: float) -> Settled | None:
        """``complete`` at the estimate; None (logged) if the core raised even for that."""
        try:
            return self.scheduler.complete(request_id, now_ms, None, release_kv=False)
        except Exception:
            log.exception("request %s: the core failed to settle it at the estimate too",
                          request_id)  # fmt: skip
            return None

    def release_unsettled(self, request_id: str) -> None:
        """The last resort when the core raised while settling or releasing a request:
        :meth:`Scheduler.release_unsettled` takes its slot and KV off the books. Logged."""
        scheduler = self.scheduler
        if scheduler.release_unsettled(request_id):
            log.error("request %s: released without settlement; the core's books for its "
                      "tenant may be off by this request", request_id)  # fmt: skip
        if scheduler.running == 0:
            self._idle.set()

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
        lifecycles = list(self._queued.values())
        self._queued.clear()
        for lifecycle in lifecycles:
            decision = self.scheduler.cancel(lifecycle.request.request_id, now_ms)
            lifecycle.left_queue(decision, drained=True)
            future = lifecycle.future
            if future is not None and not future.done():
                if decision is None:  # cannot happen; its waiter still ends (503 draining)
                    future.cancel()
                else:
                    future.set_result(decision)
        return len(lifecycles)

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
        """Wait until nothing runs on the backend and every handler has ended (a whole answer,
        settled before it is written, may still be on its way to its client); False if
        ``timeout_s`` passed first. Both waits are the event loop's, so the deadline is read on
        the loop's clock too (an injected clock that is not the loop's would split it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        tasks = [task for task in self.handlers if not task.done()]
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        return not pending

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
        return len(self._queued)
