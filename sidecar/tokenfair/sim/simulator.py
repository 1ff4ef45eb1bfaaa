"""Replay a trace through a policy on a virtual clock: one model server, serial and
non-preemptive (the lesson's), or a batching engine (the policy's ``maxBatchRequests`` above 1).

Event rules of the serial server (the lesson's, so its policies decide exactly as its lab did):

* the clock only moves forward; KV blocks whose residency ended at or before the clock are freed
  first, then every arrival at or before the clock is submitted (in ``(arrival_ms, request_id)``
  order), then queued requests past their deadline expire, then one request is dispatched;
* a dispatched request runs for ``execution_ms`` of its *actual* service tokens when the trace
  records them (else its estimate; the server is busy and the clock jumps to its end), its first
  token comes ``prefill_ms`` after it starts (``ttft = queue_wait + prefill_ms``), it is settled
  with its actual usage when it ends (its actual KV blocks replace the reservation then), and its
  KV stays resident for ``kv_residency_factor * execution_ms`` after it started;
* when nothing can start, the clock jumps to the next event: an arrival, a KV release, or the
  scheduler's own wake-up (a deadline, a budget refill).

The times (``prefill_ms``, ``execution_ms``, the KV hold) are the scheduler's own cost model's
(:class:`~tokenfair.core.cost.CostModel`, built from the policy): the formulas live there only.

Event rules of a batching engine (``maxBatchRequests`` ``S > 1``; :mod:`tokenfair.core.batching`
is the model, and the sidecar's ``costmodel`` engine runs the same one in real time):

* the clock moves from event to event: an arrival, the end the engine forecasts next, the
  scheduler's wake-up. At each, the requests that end then are settled first (in the order the
  forecast ends them), then arrivals at or before the clock are submitted, then queued requests
  past their deadline expire, then ``next_dispatch`` is called while fewer than ``S`` requests
  run (the sidecar's dispatcher caps the requests in flight the same way);
* the requests running share the engine as a processor-sharing fluid
  (:class:`~tokenfair.core.batching.RunningWork`): each of ``c`` running advances at
  ``v(c) = 1 / (a + b c)`` service tokens per ms, and a request ends when it has received its
  *actual* service tokens when the trace records them (else its estimate); it is settled then,
  with its actual usage and KV, and its KV is freed at once (an engine that batches frees a
  sequence's blocks when it finishes: ``kvResidencyFactor``'s hold is the serial model's);
* its first token comes ``prefill_ms(p) * v(1) / v(c)`` after its dispatch, ``c`` the requests
  running once every dispatch of that instant has started (itself included): the prefill
  slowed as much as the engine's per-request speed is then (``BatchingCurve.slowdown``), not
  revised by later starts or ends. Its end is the fluid's (a first token forecast past it is
  not moved: the two are separate estimates);
* given the facts of a live run's engine (:class:`EngineFacts`: its prompt counts, its KV
  cache and own queue, the gates reading its KV, its prefill queue), the replay of that engine
  (``bench/bench_engine_model.py``); without them, the rules above alone;
* ``S = 1`` is the serial server above, replayed by the same loop as before, decision for
  decision.

Shadow mode (``enforcement: Shadow``): a refusal the core marks ``would_refuse`` is served
beside the modeled server, at once and alone (``ttft = queue_wait + prefill_ms``, running for
``execution_ms`` of its usage), and recorded ``200`` with the refusal's reason, gate and
``would_refuse``. The modeled server carries only what the policy admitted, so the decisions
are those of ``Enforce`` on the same trace, request for request: the replay shows what
enforcement would have refused, not how the extra load would have slowed the rest.

Each event costs O(log n) (the engine's heap of forecast ends, the scheduler's own).

:func:`replay` streams: it reads each arrival when the clock reaches it and yields each
decision once final, holding only the requests queued or running (``tokenfair simulate`` feeds
it straight from the trace file and folds the decisions into its report as they come).
:func:`simulate` is the same over a list, returning the list of decisions.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Final, TypeAlias

from tokenfair.config import Config
from tokenfair.core import Decision, Request, make_scheduler
from tokenfair.core.batching import BatchingCurve, RunningWork
from tokenfair.core.cost import CostModel
from tokenfair.core.errors import SimulationStuckError
from tokenfair.core.jobs import STATUS_OK
from tokenfair.core.rounding import round_hundredths
from tokenfair.core.scheduler import Scheduler

Arrival: TypeAlias = tuple[Request, int | None, int | None]
"""A request of the trace and what it really used: ``(request, actual_service_tokens,
actual_kv_blocks)``, ``None`` where the estimate was exact. A plain tuple: built once per
request, a ``NamedTuple`` cost ~1 µs more each (its ``__new__`` is a Python function)."""


KV_PROMPT_RATIO_MODES: Final = ("learned", "off")
"""The sidecar's ``kvPromptRatio`` modes (``server/runtime_settings.py``), for
:class:`EngineFacts`."""
PROMPT_RATIO_BOUNDS: Final = (0.1, 10.0)
PROMPT_RATIO_DECAY: Final = 0.95
GATE_PROMPT_RATIO_BOUNDS: Final = (0.5, 4.0)
"""The sidecar's prompt-ratio learner (``server/kv_view.py``'s constants of the same names,
which a compiled module cannot import; a test checks they are equal): the engine's prompt count
over the estimate in decayed sums (the past weighs ``PROMPT_RATIO_DECAY`` per request ended),
within ``PROMPT_RATIO_BOUNDS``, booked within ``GATE_PROMPT_RATIO_BOUNDS``."""


class EngineFacts:
    """What the records of a live run tell the replay of a batching engine about the engine
    behind the sidecar, beyond the policy (``bench/bench_engine_model.py`` gives them):

    * ``prompt_tokens``: each request's prompt as the *engine* counted it (the records'
      ``actual_prefill_tokens``; its tokenizer and chat template count about twice the
      sidecar's estimate for the suite's model): its first token comes after
      ``prefill_ms`` of that prompt, not of the estimate;
    * ``kv_blocks``: the engine's KV cache, in blocks. A request holds its actual blocks (its
      ``actual_kv_blocks``, else its estimate's) from its start on the engine to its end, and a
      request sent to the engine that does not fit waits in the engine's own queue, first come
      first served, holding nothing and running nothing until the requests ending before it
      free its room (vLLM's scheduler, whose waiting queue the sidecar's dispatch does not
      see). None: the engine's KV never holds a request back (the replay as before);
    * ``report_interval_ms``: the sidecar read the engine's KV from its metrics every so many ms
      (``engineMetrics``, on by default with an OpenAI-compatible upstream, every
      ``engineMetricsIntervalSeconds``): at the first event of each interval the gates are told
      what the engine holds beyond its running requests' booked blocks
      (:meth:`Scheduler.observe_engine_kv`), and see the books plus that until the next report.
      None: the books alone;
    * ``prefill_tokens_per_ms``: the engine's prefill throughput, first come first served
      (``tokenfair calibrate``'s ``prefill_queue``, fitted by this very rule); None: the policy's
      ``prefillTokensPerMs``;
    * ``prefill_overhead_ms``: what each prompt costs the queue beyond its tokens (the
      ``prefill_queue``'s ``prefill_overhead_ms``: the engine step a prompt's last chunk rides
      in, whose decode of the running batch and fixed cost a prompt pays whatever its length);
      0: a prompt costs its tokens alone (the queue before this field);
    * ``kv_prompt_ratio``: how the sidecar booked the prompts' KV (its ``kvPromptRatio``):
      ``"learned"`` (its default), at the engine's prompt count over the estimate as the sidecar
      learns it (``server/kv_view.py``: decayed sums over the requests ended, with their
      ``prompt_tokens`` above, within :data:`PROMPT_RATIO_BOUNDS`, booked within
      :data:`GATE_PROMPT_RATIO_BOUNDS`; 1 until a request has ended), set on the scheduler
      (``Scheduler.kv_prompt_ratio``) as each request ends; ``"off"``: at the estimate. The
      engine's report is then corrected against what the scheduler booked (``Job.kv_blocks``),
      never a booking recomputed at the estimate.

    Every field is checked (``ValueError`` naming it): the prompts are integers of at least 0
    by request id, ``kv_blocks`` an integer of at least 1, ``report_interval_ms`` finite and at
    least 0, ``prefill_tokens_per_ms`` finite and above 0, ``prefill_overhead_ms`` finite and
    at least 0 (the compiled core and the interpreted one take the same values and refuse the
    same ones).

    The first token, with facts: the engine prefills the prompts of the requests it starts
    first come first served, each taking ``prefill_overhead_ms + prompt / prefill_tokens_per_ms``
    of the queue (chunked prefill: each step's token budget goes to the waiting prompts in
    order, the running requests' decode riding in the same steps), so a request's first token
    comes once the prompts started before it and its own are done (at least
    ``prefillFloorMs`` after its start), not at a slowdown of its prompt alone: a wave of long
    batch prompts started together delays an interactive request sent just after them by all
    of their prefill. The overhead is what makes one throughput fit short and long prompts
    alike: fitted without it, the short prompts' step cost is read as a slower throughput, and
    a long prompt's wave is then replayed longer than the engine takes
    (``bench/HISTORY.md#bench_engine_model``).
    """

    __slots__ = (
        "kv_blocks",
        "kv_prompt_ratio",
        "prefill_overhead_ms",
        "prefill_tokens_per_ms",
        "prompt_tokens",
        "report_interval_ms",
    )

    def __init__(
        self,
        prompt_tokens: object,
        kv_blocks: object,
        report_interval_ms: object,
        prefill_tokens_per_ms: object = None,
        kv_prompt_ratio: object = "learned",
        prefill_overhead_ms: object = 0.0,
    ) -> None:
        # Typed `object` and checked here: a compiled `int` parameter would refuse a float
        # with a TypeError naming no field, and the interpreted core would take it.
        if not isinstance(prompt_tokens, Mapping):
            raise ValueError(
                "EngineFacts.prompt_tokens: must be a mapping of request id to prompt tokens; "
                f"got {type(prompt_tokens).__name__}"
            )
        prompts: dict[str, int] = {}
        for request_id, tokens in prompt_tokens.items():
            if not isinstance(request_id, str):
                raise ValueError(
                    f"EngineFacts.prompt_tokens: keys must be request ids (strings); "
                    f"got {request_id!r}"
                )
            prompts[request_id] = _whole(f"prompt_tokens[{request_id!r}]", tokens, 0)
        self.prompt_tokens: Mapping[str, int] = prompts
        self.kv_blocks: int | None = (
            None if kv_blocks is None else _whole("kv_blocks", kv_blocks, 1)
        )
        self.report_interval_ms: float | None = (
            None
            if report_interval_ms is None
            else _finite("report_interval_ms", report_interval_ms, "at least 0", False)
        )
        self.prefill_tokens_per_ms: float | None = (
            None
            if prefill_tokens_per_ms is None
            else _finite("prefill_tokens_per_ms", prefill_tokens_per_ms, "above 0", True)
        )
        if kv_prompt_ratio not in KV_PROMPT_RATIO_MODES:
            raise ValueError(
                f"EngineFacts.kv_prompt_ratio: must be one of "
                f"{', '.join(KV_PROMPT_RATIO_MODES)} (got {kv_prompt_ratio!r})"
            )
        self.kv_prompt_ratio: str = str(kv_prompt_ratio)
        self.prefill_overhead_ms: float = _finite(
            "prefill_overhead_ms", prefill_overhead_ms, "at least 0", False
        )


def _whole(field: str, value: object, least: int) -> int:
    """``value`` of :class:`EngineFacts`'s ``field``: an integer (not a bool) of at least
    ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EngineFacts.{field}: must be an integer; got {value!r}")
    if value < least:
        raise ValueError(f"EngineFacts.{field}: must be at least {least}; got {value}")
    return value


def _finite(field: str, value: object, rule: str, positive: bool) -> float:
    """``value`` of :class:`EngineFacts`'s ``field``: a finite number, above 0 (``positive``)
    or at least 0 (``rule`` says which)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"EngineFacts.{field}: must be a number; got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0.0 or (positive and number == 0.0):
        raise ValueError(f"EngineFacts.{field}: must be finite and {rule}; got {value!r}")
    return number


def served_beside(
    decision: Decision, prefill_tokens: int, used: int | None, clock_ms: float, cost: CostModel
) -> Decision:
    """A ``would_refuse`` decision (shadow mode), served beside the modeled server at
    ``clock_ms``: status 200, dispatched then, its first token ``prefill_ms`` later, settled at
    its usage (``used``, else the estimate). Its reason and gate stay the refusal's."""
    decision.status_code = STATUS_OK
    decision.dispatch_ms = clock_ms
    wait_ms = clock_ms - decision.arrival_ms
    decision.ttft_ms = round_hundredths(
        (wait_ms if wait_ms > 0.0 else 0.0) + cost.prefill_ms(prefill_tokens)
    )
    decision.actual_service_tokens = decision.service_tokens if used is None else used
    return decision


def simulate(
    config: Config,
    requests: Sequence[Request],
    policy: str,
    actual_service_tokens: Mapping[str, int] | None = None,
    actual_kv_blocks: Mapping[str, int] | None = None,
) -> list[Decision]:
    """Run ``requests`` under ``policy``; returns one decision per request, in decision order.

    ``actual_service_tokens`` (by request id) is what a request really used: it runs for that
    long and is settled with it. ``actual_kv_blocks`` likewise replaces its KV reservation when it
    ends. Without them, the estimate is exact. ``requests`` may be in any order (they are
    sorted here); for a trace too large to hold, stream it through :func:`replay`.
    """
    ordered = sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))
    if len({r.request_id for r in ordered}) != len(ordered):
        raise ValueError("request ids must be unique within a trace")
    actual = actual_service_tokens or {}
    actual_kv = actual_kv_blocks or {}
    arrivals: list[Arrival] = [
        (r, actual.get(r.request_id), actual_kv.get(r.request_id)) for r in ordered
    ]
    return [decision for decision, _ in replay(config, arrivals, policy)]


def replay(
    config: Config,
    arrivals: Iterable[Arrival],
    policy: str,
    engine: EngineFacts | None = None,
) -> Iterator[tuple[Decision, int | None]]:
    """Stream ``arrivals`` through ``policy``: yields each request's decision, in decision order,
    with the request's ``actual_service_tokens`` from its arrival (what sizes it, refused or not).

    ``arrivals`` must come in ``(arrival_ms, request_id)`` order (``ValueError`` names the first
    that does not) with unique ids. Each is read when the clock reaches it, and the replay keeps
    only the requests queued or running: memory follows the backlog, not the trace. A decision
    is yielded once final (a dispatched request after it has been settled).

    The cyclic garbage collector is paused while the generator runs (between its yields too):
    the replay creates no reference cycles (everything it allocates is freed by reference
    counting), so the collector would only rescan the live backlog. It is enabled again when the
    generator finishes or is closed.

    ``engine``: what a live run's records tell of the engine behind it (:class:`EngineFacts`;
    used by a batching engine's replay only).
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield from _replay(config, iter(arrivals), policy, None, engine)
    finally:
        if collecting:
            gc.enable()


def replay_timed(
    config: Config,
    arrivals: Iterable[Arrival],
    policy: str,
    scheduler: Scheduler | None = None,
    engine: EngineFacts | None = None,
) -> Iterator[tuple[Decision, int | None, float | None]]:
    """:func:`replay`, with each admitted request's end (the model ms its last token came)
    as a third item; None for a request that did not run. For what a live run would have
    recorded of the same trace (``e2e_ms = end - arrival``): the records ``tokenfair
    calibrate`` fits. A serial server's request ends ``execution_ms`` of its actual service
    tokens after its dispatch. ``scheduler`` (default: a new one of ``policy`` on
    ``config``) is the one driven, for a caller that inspects it afterwards (its books);
    ``engine`` as :func:`replay`'s."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        if scheduler is None:
            scheduler = make_scheduler(policy, config)
        if scheduler.cost.max_batch_requests > 1:
            yield from _replay_batching(scheduler, iter(arrivals), policy, engine)
            return
        cost = scheduler.cost
        for decision, used in _replay(config, iter(arrivals), policy, scheduler):
            dispatch_ms = decision.dispatch_ms
            if dispatch_ms is None or decision.status_code != STATUS_OK:
                yield decision, used, None
                continue
            served = decision.service_tokens if used is None else used
            yield decision, used, dispatch_ms + cost.execution_ms(served)
    finally:
        if collecting:
            gc.enable()


def _replay(
    config: Config,
    arrivals: Iterator[Arrival],
    policy: str,
    scheduler: Scheduler | None = None,
    engine: EngineFacts | None = None,
) -> Iterator[tuple[Decision, int | None]]:
    if scheduler is None:
        scheduler = make_scheduler(policy, config)
    if scheduler.cost.max_batch_requests > 1:
        for outcome, usage, _ in _replay_batching(scheduler, arrivals, policy, engine):
            yield outcome, usage
        return
    # The loop runs once per event. The scheduler's methods are called on it, not through
    # bound methods kept in locals: compiled, such a call is a direct C call with unboxed
    # arguments, where a bound method goes through Python's calling convention (the locals
    # saved an attribute lookup only to the interpreted core).
    cost = scheduler.cost
    deadlines = scheduler._deadlines  # compacted in place (`Scheduler.submit`)
    expires = scheduler.expires_queued
    own_expiry = type(scheduler).expire is Scheduler.expire
    releases: list[tuple[float, int, str]] = []  # (release_ms, tie-break, request_id)
    pending: dict[str, Arrival] = {}  # queued or running, by request id
    pop_pending = pending.pop
    heappush, heappop = heapq.heappush, heapq.heappop
    clock_ms = 0.0
    sequence = 0
    # The next arrival and its time, read once: a `Request`'s field is a lookup by name (a
    # msgspec struct), and the loop compares the time at every event until it arrives.
    upcoming = next(arrivals, None)
    upcoming_ms = 0.0 if upcoming is None else upcoming[0].arrival_ms
    last_ms, last_id = float("-inf"), ""
    while True:
        while releases and releases[0][0] <= clock_ms:
            scheduler.release_kv(heappop(releases)[2])
        while upcoming is not None:
            arrival_ms = upcoming_ms
            if arrival_ms > clock_ms:
                break
            request = upcoming[0]
            request_id = request.request_id
            if arrival_ms < last_ms or (arrival_ms == last_ms and request_id <= last_id):
                raise ValueError(
                    f"arrivals out of (arrival_ms, request_id) order at {request_id!r} "
                    f"({arrival_ms} ms, after {last_id!r} at {last_ms} ms)"
                )
            last_ms, last_id = arrival_ms, request_id
            refusal = scheduler.submit(request, clock_ms)
            if refusal is None:
                pending[request_id] = upcoming
            else:
                if refusal.would_refuse:
                    served_beside(refusal, request.prefill_tokens, upcoming[1], clock_ms, cost)
                yield refusal, upcoming[1]
            upcoming = next(arrivals, None)
            if upcoming is not None:
                upcoming_ms = upcoming[0].arrival_ms
        if expires:
            if own_expiry:
                # `expire`'s first step inline (the policy keeps the base's): call it only if
                # the earliest deadline is past.
                first = deadlines.earliest()
                if first is not None and not first.deadline_ms >= clock_ms:
                    for expired in scheduler.expire(clock_ms):
                        yield _ended(expired, pop_pending(expired.request_id), clock_ms, cost)
            else:
                for expired in scheduler.expire(clock_ms):
                    yield _ended(expired, pop_pending(expired.request_id), clock_ms, cost)
        decision = scheduler.next_dispatch(clock_ms)
        if decision is None:
            queued = scheduler.queued_total
            events = []
            if upcoming is not None:
                events.append(upcoming_ms)
            if queued:
                if releases:
                    events.append(releases[0][0])
                wakeup = scheduler.next_wakeup_ms(clock_ms)
                if wakeup is not None:
                    events.append(wakeup)
            if not events:
                if queued:
                    raise SimulationStuckError(
                        f"{policy}: {queued} request(s) queued at {clock_ms} ms with no event left"
                    )
                break
            clock_ms = max(clock_ms, min(events))
            continue
        request_id = decision.request_id
        request, used, used_kv = pop_pending(request_id)
        if decision.status_code != STATUS_OK:
            if decision.would_refuse:
                served_beside(decision, request.prefill_tokens, used, clock_ms, cost)
            yield decision, used
            continue
        prefill_ms, execution_ms, kv_hold_ms = cost.run_ms(
            request.prefill_tokens, decision.service_tokens if used is None else used
        )
        wait_ms = clock_ms - decision.arrival_ms  # (the request's); max(0, wait) as a
        # conditional: the same value
        decision.ttft_ms = round_hundredths((wait_ms if wait_ms > 0.0 else 0.0) + prefill_ms)
        sequence += 1
        heappush(releases, (clock_ms + kv_hold_ms, sequence, request_id))
        clock_ms += execution_ms
        scheduler.complete(request_id, clock_ms, used, actual_kv_blocks=used_kv, release_kv=False)
        yield decision, used


def _ended(
    decision: Decision, arrival: Arrival, clock_ms: float, cost: CostModel
) -> tuple[Decision, int | None]:
    """A refusal from the queue with its usage, served beside the server if it is shadowed."""
    if decision.would_refuse:
        served_beside(decision, arrival[0].prefill_tokens, arrival[1], clock_ms, cost)
    return decision, arrival[1]


def _beside_end(decision: Decision, used: int | None, cost: CostModel) -> float | None:
    """The end of a request served beside the server (shadow mode): ``execution_ms`` of its
    usage after its dispatch; None for a request that did not run."""
    if not decision.would_refuse or decision.dispatch_ms is None:
        return None
    return decision.dispatch_ms + cost.execution_ms(
        decision.service_tokens if used is None else used
    )


PACE: Final = Decision("", "", "interactive", 0, "", "", 0, 0.0)
"""What a paced replay (:func:`replay_batching`) yields, as ``(PACE, None, clock_ms)``, before
it acts at ``clock_ms``: not a decision, the point where a pool of replicas
(:mod:`tokenfair.sim.pool_replay`) holds it until every other replica has acted up to then."""


def replay_batching(
    scheduler: Scheduler,
    arrivals: Iterator[Arrival],
    policy: str,
    before_dispatch: Callable[[float], object] | None = None,
) -> Iterator[tuple[Decision, int | None, float | None]]:
    """The batching engine's replay of ``scheduler`` (the module docstring's second set of
    rules), **paced** for a pool of replicas: before each event it yields ``(PACE, None,
    clock_ms)`` (the consumer resumes it when it may act at ``clock_ms``), and it calls
    ``before_dispatch(clock_ms)`` once per event, after the expiries and before the dispatches
    (the pool's batch to its store). The decisions are those of the unpaced replay."""
    return _replay_batching(scheduler, arrivals, policy, None, True, before_dispatch)


def _replay_batching(
    scheduler: Scheduler,
    arrivals: Iterator[Arrival],
    policy: str,
    facts: EngineFacts | None = None,
    paced: bool = False,
    before_dispatch: Callable[[float], object] | None = None,
) -> Iterator[tuple[Decision, int | None, float | None]]:
    """The replay of a batching engine (the module docstring's second set of rules): yields
    each decision once final, with the request's recorded usage and, if it ran, its end.
    ``facts``: :class:`EngineFacts` (None: the policy's engine alone); ``paced`` and
    ``before_dispatch``: :func:`replay_batching`'s."""
    cost = scheduler.cost
    engine = RunningWork(BatchingCurve.from_cost(cost))
    curve = engine.curve
    batch = curve.max_batch_requests
    expires = scheduler.expires_queued
    pending: dict[str, Arrival] = {}  # queued or running, by request id
    pop_pending = pending.pop
    running: dict[str, tuple[Decision, int | None, int | None]] = {}  # id -> what settles it
    prompts: Mapping[str, int] = {} if facts is None else facts.prompt_tokens
    engine_kv = None if facts is None else facts.kv_blocks
    report_ms = None if facts is None else facts.report_interval_ms
    report_due_ms = 0.0
    prefill_speed = cost.prefill_tokens_per_ms
    if facts is not None and facts.prefill_tokens_per_ms is not None:
        prefill_speed = facts.prefill_tokens_per_ms
    prefill_overhead_ms = 0.0 if facts is None else facts.prefill_overhead_ms
    # The sidecar's prompt ratio, learned as requests end (EngineFacts.kv_prompt_ratio).
    learns = facts is not None and facts.kv_prompt_ratio == "learned"
    estimated_sum = 0.0
    reported_sum = 0.0
    # The engine's own queue (a request sent that its KV cannot hold yet), the blocks each
    # request on the engine holds, and what the books booked for it.
    engine_queue: deque[tuple[Decision, int, int, int, int]] = deque()  # (decision, prompt
    # tokens, service, engine blocks, booked blocks)
    held: dict[str, tuple[int, int]] = {}  # running on the engine: (engine blocks, booked)
    engine_used = 0
    booked_running = 0
    prefilled_ms = 0.0  # when the engine's prefill of the prompts started so far is done
    clock_ms = 0.0
    due_ms = math.inf  # when the forecast's next end is due (the clock it was computed at)
    upcoming = next(arrivals, None)
    upcoming_ms = 0.0 if upcoming is None else upcoming[0].arrival_ms
    last_ms, last_id = float("-inf"), ""
    while True:
        if paced:
            yield PACE, None, clock_ms
        started: list[tuple[Decision, int]] = []  # (decision, prompt tokens)
        if due_ms <= clock_ms:
            # The forecast's next end, and any tied with it (its tag was reached exactly).
            while True:
                request_id = engine.finish_first(clock_ms)
                ended, used, used_kv = running.pop(request_id)
                if held:
                    blocks, booked = held.pop(request_id)
                    engine_used -= blocks
                    booked_running -= booked
                if learns:
                    reported = prompts.get(request_id)
                    estimate = scheduler.jobs[request_id].request.prefill_tokens
                    if reported is not None and reported > 0 and estimate > 0:
                        # KvView.request_ended (forget, then the gates' ratio): the next admissions
                        # book at the ratio it gives the gates.
                        estimated_sum = PROMPT_RATIO_DECAY * estimated_sum + estimate
                        reported_sum = PROMPT_RATIO_DECAY * reported_sum + reported
                        low, high = PROMPT_RATIO_BOUNDS
                        learned = min(high, max(low, reported_sum / estimated_sum))
                        low, high = GATE_PROMPT_RATIO_BOUNDS
                        scheduler.kv_prompt_ratio = min(high, max(low, learned))
                scheduler.complete(request_id, clock_ms, used, actual_kv_blocks=used_kv)
                yield ended, used, clock_ms
                if not running or engine.next_departure_ms(clock_ms) > 0.0:
                    break
            due_ms = math.inf
        while engine_queue and engine_kv is not None:
            # The engine starts what its KV now holds, first come first served.
            sent, prompt, service, blocks, booked = engine_queue[0]
            if held and engine_used + blocks > engine_kv:
                break
            engine_queue.popleft()
            engine.start(sent.request_id, service, clock_ms)
            held[sent.request_id] = (blocks, booked)
            engine_used += blocks
            booked_running += booked
            started.append((sent, prompt))
        if report_ms is not None and clock_ms >= report_due_ms:
            # The engine's report of this interval (the sidecar's poll of its metrics).
            scheduler.observe_engine_kv(engine_used, booked_running)
            report_due_ms = clock_ms + report_ms
        while upcoming is not None:
            arrival_ms = upcoming_ms
            if arrival_ms > clock_ms:
                break
            request = upcoming[0]
            request_id = request.request_id
            if arrival_ms < last_ms or (arrival_ms == last_ms and request_id <= last_id):
                raise ValueError(
                    f"arrivals out of (arrival_ms, request_id) order at {request_id!r} "
                    f"({arrival_ms} ms, after {last_id!r} at {last_ms} ms)"
                )
            last_ms, last_id = arrival_ms, request_id
            refusal = scheduler.submit(request, clock_ms)
            if refusal is None:
                pending[request_id] = upcoming
            else:
                if refusal.would_refuse:
                    served_beside(refusal, request.prefill_tokens, upcoming[1], clock_ms, cost)
                yield refusal, upcoming[1], _beside_end(refusal, upcoming[1], cost)
            upcoming = next(arrivals, None)
            if upcoming is not None:
                upcoming_ms = upcoming[0].arrival_ms
        if expires:
            for expired in scheduler.expire(clock_ms):
                shed, used = _ended(expired, pop_pending(expired.request_id), clock_ms, cost)
                yield shed, used, _beside_end(shed, used, cost)
        if before_dispatch is not None:
            before_dispatch(clock_ms)
        while scheduler.running < batch:
            decision = scheduler.next_dispatch(clock_ms)
            if decision is None:
                break
            request_id = decision.request_id
            request, used, used_kv = pop_pending(request_id)
            if decision.status_code != STATUS_OK:
                if decision.would_refuse:
                    served_beside(decision, request.prefill_tokens, used, clock_ms, cost)
                yield decision, used, _beside_end(decision, used, cost)
                continue
            service = decision.service_tokens if used is None else used
            running[request_id] = (decision, used, used_kv)
            prompt = prompts.get(request_id, request.prefill_tokens)
            if engine_kv is None:
                engine.start(request_id, service, clock_ms)
                started.append((decision, prompt))
                continue
            # What the scheduler booked (at the prompt ratio of its admission), not the
            # estimate's blocks: the engine's report corrects the gates against it.
            booked = scheduler.jobs[request_id].kv_blocks
            blocks = (
                cost.kv_blocks(request.prefill_tokens, request.decode_tokens)
                if used_kv is None
                else used_kv
            )
            if engine_queue or (held and engine_used + blocks > engine_kv):
                engine_queue.append((decision, prompt, service, blocks, booked))
                continue
            engine.start(request_id, service, clock_ms)
            held[request_id] = (blocks, booked)
            engine_used += blocks
            booked_running += booked
            started.append((decision, prompt))
        if started and facts is not None:
            # The engine prefills the prompts first come first served, each its overhead and
            # its tokens at the prefill speed (EngineFacts): a first token after the prompts
            # started before it.
            for admitted, prompt in started:
                wait_ms = clock_ms - admitted.arrival_ms
                begin_ms = prefilled_ms if prefilled_ms > clock_ms else clock_ms
                prefilled_ms = begin_ms + prefill_overhead_ms + prompt / prefill_speed
                first_ms = prefilled_ms - clock_ms
                floor_ms = cost.prefill_floor_ms
                admitted.ttft_ms = round_hundredths(
                    (wait_ms if wait_ms > 0.0 else 0.0)
                    + (first_ms if first_ms > floor_ms else floor_ms)
                )
        elif started:
            # The prefill is slowed by the concurrency once every start of this instant has
            # happened (the same for each of them, whatever the order they were picked in).
            slowdown = curve.slowdown(engine.running)
            for admitted, prompt in started:
                wait_ms = clock_ms - admitted.arrival_ms
                admitted.ttft_ms = round_hundredths(
                    (wait_ms if wait_ms > 0.0 else 0.0) + cost.prefill_ms(prompt) * slowdown
                )
        if started or (running and due_ms == math.inf):
            # The forecast ends move whenever a request joins: read the next one again.
            due_ms = clock_ms + engine.next_departure_ms(clock_ms) if engine.running else math.inf
        next_ms = due_ms
        if upcoming is not None and upcoming_ms < next_ms:
            next_ms = upcoming_ms
        queued = scheduler.queued_total
        if queued:
            wakeup = scheduler.next_wakeup_ms(clock_ms)
            if wakeup is not None and wakeup < next_ms:
                next_ms = wakeup
        if next_ms == math.inf:
            if queued or engine_queue:
                raise SimulationStuckError(
                    f"{policy}: {queued} request(s) queued at {clock_ms} ms with no event left"
                )
            break
        if next_ms > clock_ms:
            clock_ms = next_ms
