"""One owner of a request's lifecycle: admission, waiting, dispatch, settlement, the one outcome.

Every request that reaches admission gets one :class:`Lifecycle`. Its phase moves only forward,
and each move has one place that makes it::

    begin ──► REFUSED ───────────────────────────────────────────────────────────┐
          ├─► BESIDE ──► SETTLED  shadow mode: refused, served beside the books ─────┤
          └─► QUEUED ──► LEFT_QUEUE  expired (429), cancelled (499), drained (503) ─┤
                     ├─► BESIDE ──► SETTLED  shadow mode: expired, served anyway ───┤
                     └─► RUNNING ──► SETTLED  slot released, KV at its hold time ──┴─► complete

* :func:`begin` runs admission (:meth:`Dispatcher.submit
  <tokenfair.server.dispatcher.Dispatcher.submit>`): REFUSED or QUEUED, or BESIDE in shadow
  mode: a refusal the core marked ``would_refuse`` is served at once, beside the core's books
  (no running slot, no KV, no settlement in the core), and recorded with the refusal's reason
  and gate, ``200`` and ``would_refuse``. A queued request the core refuses later (expired,
  or refused at dispatch) moves to BESIDE the same way.
* The dispatcher's pump moves QUEUED to RUNNING (dispatched) or LEFT_QUEUE (expired); a waiter
  whose client leaves moves QUEUED to LEFT_QUEUE (cancelled) or, dispatched in that very
  instant, RUNNING to SETTLED at zero usage; a drain moves QUEUED to LEFT_QUEUE (drained).
* :meth:`Dispatcher.complete <tokenfair.server.dispatcher.Dispatcher.complete>` moves
  RUNNING to SETTLED: it books the usage in the core and releases the running slot and (at
  ``kv_hold_ms`` after dispatch) the KV, and never raises.
* :meth:`Lifecycle.complete` is the one verb for a request's end, called by whoever answered the
  client (the proxy, in a ``finally``). It settles a request still RUNNING, decides the one
  outcome and counts and records it — exactly once (a second call is logged and changes
  nothing) and without raising, whatever the backend, the core or the accounting raise.
  A whole (non-streamed) answer is settled before it is written to the client
  (:meth:`Lifecycle.settle_run`: the backend's work is over, its slot and KV go to the next
  request) and recorded by ``complete`` once the client has it, or has not taken it.

A request's end is ``complete`` at every layer: :meth:`Lifecycle.complete` settles through
:meth:`Dispatcher.complete <tokenfair.server.dispatcher.Dispatcher.complete>`, which calls the
core's contract verb (:meth:`Scheduler.complete <tokenfair.core.scheduler.Scheduler.complete>`),
and has the outcome counted and recorded by the outcome sink (:meth:`Outcomes.completed
<tokenfair.server.outcomes.Outcomes.completed>`).

The lifecycle sees the rest of the sidecar through narrow ports (:class:`RequestPorts`): the
dispatcher's slots, the model clock, the backend's KV hold time, the cost of a usage in service
tokens and the outcome sink; never the sidecar object.

The outcome (:meth:`Lifecycle.outcome_of`): a request that never ran ends with the decision that
ended its wait (the refusal at the door, the expiry, the cancellation ``499``, ``503 draining``);
one that ran ends as its client met it (the proxy's status and reason), except that a usage that
was not booked as reported ends ``upstream_bad_usage`` (settled at the estimate) or
``internal_error`` (the core failed), and a settlement that failed ends ``internal_error``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from tokenfair.core import Decision, Request
from tokenfair.core.cost import CostModel
from tokenfair.core.jobs import ADMITTED, CANCELLED, STATUS_CLIENT_CLOSED
from tokenfair.core.reasons import Reason
from tokenfair.records.live import NO_USAGE, Usage
from tokenfair.server.accesslog import RequestFacts
from tokenfair.server.backends import BAD_USAGE, BackendCall
from tokenfair.server.errors import INTERNAL_ERROR

log = logging.getLogger("tokenfair.sidecar")

DRAINING: Final = Reason.DRAINING
"""Reason (status 503) of a request refused at the door, or taken out of the queue, by a drain."""
DRAIN_ABORTED: Final = Reason.DRAIN_ABORTED
"""Reason (status 503) of a request still running (or still waiting) when the drain grace ran
out: the sidecar cut it (a stream ends incomplete; a request with nothing sent yet is answered
``503 drain_aborted`` with ``Retry-After``)."""


class Phase(enum.Enum):
    """Where a request is in its lifecycle (the module docstring draws the moves)."""

    REFUSED = "refused"
    """Refused at admission; never queued."""
    QUEUED = "queued"
    """Waiting in the core's lanes."""
    LEFT_QUEUE = "left_queue"
    """Taken out of the queue without running: expired, cancelled or drained."""
    RUNNING = "running"
    """Dispatched: it holds a running slot and its KV reservation."""
    BESIDE = "beside"
    """Shadow mode: refused by a gate (``would_refuse``) and served beside the core's books."""
    SETTLED = "settled"
    """Its usage is booked and its running slot released (its KV at its hold time)."""


class Settlement(enum.Enum):
    """How :meth:`Dispatcher.complete <tokenfair.server.dispatcher.Dispatcher.complete>`
    booked a request."""

    AS_REPORTED = "as_reported"
    """The usage given was booked (``None``: the estimate, as asked)."""
    AT_ESTIMATE = "at_estimate"
    """The core refused the usage given (``ValueError``, ``TypeError``, ``ArithmeticError``:
    a value it cannot book): the estimate was booked instead."""
    CORE_FAILED = "core_failed"
    """The core raised something else (a bug, logged): the estimate was booked instead or, if
    even that raised, the slot and KV were released unsettled."""


class LifecycleError(RuntimeError):
    """A move the lifecycle does not allow (a bug in the sidecar: the message names it)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A request's one outcome, as recorded: its status code and reason."""

    status_code: int
    reason: str


class Slots(Protocol):
    """The dispatcher as a lifecycle sees it (:class:`~tokenfair.server.dispatcher.Dispatcher`)."""

    def submit(self, request: Request) -> Lifecycle: ...

    def complete(
        self, lifecycle: Lifecycle, actual_service_tokens: int | None, kv_hold_ms: float
    ) -> Settlement | None: ...

    def release_unsettled(self, request_id: str) -> None: ...

    def pump(self) -> None: ...


class OutcomeSink(Protocol):
    """Where a request's admission, dispatch and one outcome go
    (:class:`~tokenfair.server.outcomes.Outcomes`). Its methods never raise."""

    def admission(self, request: Request, decision: Decision | None) -> None: ...

    def dispatched(self, decision: Decision) -> None: ...

    def completed(
        self,
        request: Request,
        decision: Decision | None,
        *,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None = None,
        usage: Usage | None = None,
        facts: RequestFacts | None = None,
    ) -> None: ...


class Pricing(Protocol):
    """The core's pricing as a lifecycle sees it: the cost model in force (the scheduler's
    ``cost``, replaced by a reload)."""

    @property
    def cost(self) -> CostModel: ...


class KvHold(Protocol):
    """The backend as a lifecycle sees it (:class:`~tokenfair.server.backends.Backend`)."""

    def kv_hold_ms(self, call: BackendCall) -> float: ...


@dataclass(frozen=True, slots=True)
class RequestPorts:
    """What a lifecycle needs of the sidecar, and nothing else (wired by its composition root,
    :class:`~tokenfair.server.sidecar.Sidecar`)."""

    dispatcher: Slots
    now_ms: Callable[[], float]
    """Model time now (the dispatcher's clock)."""
    backend: KvHold
    """How long after dispatch the request's KV stays held."""
    pricing: Pricing
    """The service tokens of ``(prompt, completion)`` tokens, as the core prices them now."""
    outcomes: OutcomeSink


CLIENT_LEFT: Final = Outcome(STATUS_CLIENT_CLOSED, CANCELLED)
"""The outcome of a request whose handler ends without an answer: its client went away."""


@dataclass(slots=True, eq=False)
class Lifecycle:
    """One request from admission to its record; the phase moves only as the module says."""

    request: Request
    phase: Phase
    decision: Decision | None = None
    """The decision that ended its wait: the refusal at the door, the dispatch, or the
    refusal or cancellation that took it out of the queue (``None`` only if the core had
    nothing to say when it left the queue, which cannot happen: logged, and recorded)."""
    future: asyncio.Future[Decision] | None = None
    """Resolves with :attr:`decision` when the request leaves the queue (QUEUED only)."""
    drained: bool = False
    """Taken out of the queue by a drain (the client gets ``503 draining``)."""
    dispatched_at_s: float = 0.0
    """Event-loop time of the dispatch (a backend's engine may start then, before the handler
    gets round to it)."""
    settlement: Settlement | None = None
    """How it was settled (SETTLED only)."""
    booked_service_tokens: int | None = None
    """The usage booked as reported, in service tokens (``None``: the estimate)."""
    outcome: Outcome | None = None
    """Its one outcome, once :meth:`complete` decided it."""
    admission_ms: float | None = None
    """Model time admission decided (set by :func:`begin`; the span's admission event)."""
    run_usage: Usage = NO_USAGE
    """The usage settled for the record (SETTLED by :meth:`settle_run`)."""
    usage_reason: str | None = None
    """Why the run was not booked as its answer reported (``upstream_bad_usage``,
    ``internal_error``): the outcome's reason where the client met an ``admitted`` answer."""

    # -- moves (each from one phase only: anything else is a bug, LifecycleError) -----------

    def _move(self, expected: Phase, to: Phase) -> None:
        if self.phase is not expected:
            raise LifecycleError(
                f"request {self.request.request_id}: cannot move from {self.phase.value} to "
                f"{to.value} (only from {expected.value})"
            )
        self.phase = to

    def dispatched(self, decision: Decision, at_s: float) -> None:
        """QUEUED → RUNNING: the core dispatched it."""
        self._move(Phase.QUEUED, Phase.RUNNING)
        self.decision = decision
        self.dispatched_at_s = at_s

    def served_beside(self, decision: Decision, at_s: float) -> None:
        """QUEUED → BESIDE (shadow mode): the core refused it from the queue, it runs anyway."""
        self._move(Phase.QUEUED, Phase.BESIDE)
        self.decision = decision
        self.dispatched_at_s = at_s

    def left_queue(self, decision: Decision | None, *, drained: bool = False) -> None:
        """QUEUED → LEFT_QUEUE: expired, cancelled or drained (``decision`` says which)."""
        self._move(Phase.QUEUED, Phase.LEFT_QUEUE)
        self.decision = decision
        self.drained = drained

    def settled(self, settlement: Settlement, booked_service_tokens: int | None) -> None:
        """RUNNING → SETTLED: its usage is booked and its running slot released."""
        self._move(Phase.RUNNING, Phase.SETTLED)
        self.settlement = settlement
        self.booked_service_tokens = booked_service_tokens

    @property
    def ran(self) -> bool:
        """It was dispatched (RUNNING or SETTLED), or served beside the books (BESIDE)."""
        phase = self.phase
        return phase is Phase.RUNNING or phase is Phase.SETTLED or phase is Phase.BESIDE

    # -- the end ----------------------------------------------------------------------------

    def outcome_of(self, met: Outcome) -> Outcome:
        """The outcome given ``met``, the answer its client met: that answer if the request ran,
        or if the sidecar itself failed to answer it (``internal_error``) or cut it
        (``drain_aborted``); otherwise the decision that ended its wait."""
        if self.ran or met.reason in (INTERNAL_ERROR, DRAIN_ABORTED):
            return met
        if self.drained:
            return Outcome(503, DRAINING)
        if self.decision is None:
            return CLIENT_LEFT
        return Outcome(self.decision.status_code, self.decision.reason)

    def complete(
        self,
        ports: RequestPorts,
        met: Outcome = CLIENT_LEFT,
        call: BackendCall | None = None,
        first_byte_ms: float | None = None,
    ) -> Outcome:
        """End the request: settle it if it still runs, decide its outcome, count and record it.

        ``met`` is the answer its client met (by default: it went away), ``call`` the backend
        call if one was made (its reported usage is settled), ``first_byte_ms`` the model time
        from arrival to the first byte sent. Exactly once: a later call logs and returns the
        first outcome. Never raises; each step is guarded on its own, so that whatever raises,
        the slot and KV are released and one record is written (by the outcome sink, which
        never raises and counts a record it cannot write as dropped)."""
        if self.outcome is not None:
            log.error("request %s: completed twice; the second completion (%s) changes nothing",
                      self.request.request_id, met)  # fmt: skip
            return self.outcome
        self.settle_run(ports, call, first_byte_ms)
        reason = met.reason
        if reason == ADMITTED and self.usage_reason is not None:
            reason = self.usage_reason
        decision = self.decision
        if reason == ADMITTED and decision is not None and decision.would_refuse:
            reason = decision.reason  # served in shadow mode: the record keeps what was refused
        if reason is not met.reason:  # (the answer met, as is, in the common case)
            met = Outcome(met.status_code, reason)
        outcome = self.outcome = self.outcome_of(met)
        self._record_outcome(ports, outcome, self.run_usage, call)
        return outcome

    def settle_run(
        self, ports: RequestPorts, call: BackendCall | None, first_byte_ms: float | None = None
    ) -> None:
        """RUNNING → SETTLED (nothing otherwise): book the usage ``call`` reports and release
        the running slot and (at its hold time) the KV. :meth:`complete` does it for a request
        still running; the proxy does it first for a whole answer, whose backend work is over
        before the answer is written to the client (the slot is not held while a client reads).
        Keeps the usage and any :attr:`usage_reason` for the record. Never raises."""
        if self.phase is Phase.BESIDE:
            self._settle_beside(ports, call, first_byte_ms)
            return
        if self.phase is not Phase.RUNNING:
            return
        try:
            self.run_usage, self.usage_reason = self._complete_run(ports, call, first_byte_ms)
        except Exception:  # a bug: logged; released at its estimate below
            log.exception("request %s: settlement failed", self.request.request_id)
            self.run_usage, self.usage_reason = NO_USAGE, INTERNAL_ERROR
        if self.phase is Phase.RUNNING:  # the settlement raised before the slot was freed
            self._release_unsettled(ports)
            self.usage_reason = INTERNAL_ERROR

    def _settle_beside(
        self, ports: RequestPorts, call: BackendCall | None, first_byte_ms: float | None
    ) -> None:
        """BESIDE → SETTLED: the usage of a request served beside the books, for its record and
        counters only (the core never held it: nothing to book there). Never raises."""
        self._move(Phase.BESIDE, Phase.SETTLED)
        self.settlement = Settlement.AS_REPORTED
        if call is None:
            self.booked_service_tokens = 0
            if self.decision is not None:
                self.decision.actual_service_tokens = 0
            return
        request = self.request
        prompt, completion = call.prompt_tokens, call.completion_tokens
        try:
            self.booked_service_tokens = ports.pricing.cost.service_tokens(
                request.prefill_tokens if prompt is None else prompt,
                request.decode_tokens if completion is None else completion,
            )
        except Exception:  # the backend's numbers: whatever they are, the estimate stands
            log.exception("request %s: usage not computable; recorded at the estimate",
                          request.request_id)  # fmt: skip
            prompt = completion = None
            self.booked_service_tokens = None
            self.usage_reason = BAD_USAGE
        self.run_usage = Usage(
            prompt, completion, first_byte_ms, ports.now_ms() - request.arrival_ms
        )
        decision = self.decision
        if decision is not None:  # the record's usage, as the core's settlement writes it
            decision.actual_service_tokens = (
                decision.service_tokens
                if self.booked_service_tokens is None
                else self.booked_service_tokens
            )

    def _release_unsettled(self, ports: RequestPorts) -> None:
        """The last resort when settling raised: the slot and KV are taken off the books
        without the core's settlement code (the tenant keeps the estimate charged at dispatch),
        and the request is SETTLED (``CORE_FAILED``) whatever that raises."""
        dispatcher = ports.dispatcher
        try:
            dispatcher.release_unsettled(self.request.request_id)
        except Exception:
            log.exception("request %s: releasing it failed", self.request.request_id)
        self.settled(Settlement.CORE_FAILED, None)
        try:
            dispatcher.pump()  # its slot is free: the next queued request may run
        except Exception:
            log.exception("request %s: dispatching after its release failed",
                          self.request.request_id)  # fmt: skip

    def _complete_run(
        self, ports: RequestPorts, call: BackendCall | None, first_byte_ms: float | None
    ) -> tuple[Usage, str | None]:
        """Settle a RUNNING request: its usage for the record, and why it was not booked as
        reported (None if it was)."""
        dispatcher = ports.dispatcher
        if call is None:  # dispatched but no backend call made (its client left, or a failure)
            dispatcher.complete(self, 0, 0.0)
            return NO_USAGE, None
        request = self.request
        prompt, completion = call.prompt_tokens, call.completion_tokens
        actual: int | None = None
        reason: str | None = None
        if prompt is not None or completion is not None:  # a missing count stands in as estimated
            try:
                actual = ports.pricing.cost.service_tokens(
                    request.prefill_tokens if prompt is None else prompt,
                    request.decode_tokens if completion is None else completion,
                )
            except Exception:  # the backend's numbers: whatever they are, the estimate stands
                log.exception("request %s: usage not computable; settling at the estimate",
                              request.request_id)  # fmt: skip
                prompt = completion = None
                reason = BAD_USAGE
        try:
            kv_hold_ms = ports.backend.kv_hold_ms(call)
        except Exception:
            log.exception("request %s: KV hold time failed; releasing at once", request.request_id)
            kv_hold_ms = 0.0
        settlement = dispatcher.complete(self, actual, kv_hold_ms)
        if settlement is not Settlement.AS_REPORTED:
            # Not booked as reported: settled at the estimate (or released unsettled), recorded so.
            prompt = completion = None
            reason = BAD_USAGE if settlement is Settlement.AT_ESTIMATE else INTERNAL_ERROR
        usage = Usage(prompt, completion, first_byte_ms, ports.now_ms() - request.arrival_ms)
        return usage, reason

    def facts(self, call: BackendCall | None) -> RequestFacts:
        """What the access log and the span need besides the decision and the usage."""
        model = call.body.get("model") if call is not None else None
        settlement = self.settlement
        return RequestFacts(
            route=call.path if call is not None else None,
            model=model if isinstance(model, str) else None,
            admission_ms=self.admission_ms,
            queued=self.phase is not Phase.REFUSED,
            # `_value_`, not `.value` (a descriptor run in Python, on the hot path)
            settlement=settlement._value_ if settlement is not None else None,
        )

    def _record_outcome(
        self, ports: RequestPorts, outcome: Outcome, usage: Usage, call: BackendCall | None = None
    ) -> None:
        """Give the outcome to the sink (which never raises; if it does, a bug, it is logged
        here: the slot and KV were released before, and the handler ends normally)."""
        actual = self.booked_service_tokens if self.settlement is Settlement.AS_REPORTED else None
        try:
            facts = self.facts(call)
        except Exception:  # a bug: the record does not need the facts
            log.exception("request %s: its facts failed", self.request.request_id)
            facts = None
        try:
            ports.outcomes.completed(
                self.request,
                self.decision,
                status_code=outcome.status_code,
                reason=outcome.reason,
                actual_service_tokens=actual,
                usage=usage,
                facts=facts,
            )
        except Exception:  # the sink broke its promise (a bug): the request still ends cleanly
            log.exception("request %s: the outcome sink raised", self.request.request_id)


def begin(ports: RequestPorts, request: Request) -> Lifecycle:
    """Admission: a QUEUED lifecycle, or a REFUSED one (whoever answers its client completes it,
    once the answer is built, so that its record says what the client got). Raises
    :class:`~tokenfair.core.UnknownTenantError` if the tenant is gone (a reload removed
    it while the body was read): nothing is booked then."""
    admission_ms = ports.now_ms()  # before submit: it may dispatch at once
    lifecycle = ports.dispatcher.submit(request)
    lifecycle.admission_ms = admission_ms
    refused = lifecycle.phase is Phase.REFUSED or lifecycle.phase is Phase.BESIDE
    ports.outcomes.admission(request, lifecycle.decision if refused else None)
    return lifecycle
