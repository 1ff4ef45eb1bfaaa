"""Requests, queued jobs and decision records: the data the scheduling core passes around.

Reasons (``Decision.reason``) and the gate that produces each:

=========================  ===========  ========  ==============================================
reason                     gate         status    meaning
=========================  ===========  ========  ==============================================
``admitted``               dispatch     200       dispatched to the backend
``shed_kv_watermark``      admission    429       KV occupancy would pass the class watermark
                           / dispatch
``shed_queue_wait_slo``    admission    429       predicted queue wait above the class limit
``shed_tenant_token_quota``admission    429       the tenant's token budget cannot cover it in
                                                  time (lesson: bucket below the cost)
``queue_full``             admission    429       a queue bound (all tenants, or this tenant)
``shed_queue_timeout``     queue        429       waited in the queue past the class limit
``shed_tenant_concurrency``queue        429       waited past the class limit, held at the end by
                                                  its tenant's ``maxConcurrentRequests``
``shed_tenant_kv_share``   queue        429       waited past the class limit, held at the end by
                           / admission            its tenant's ``maxKvShare`` (admission: the
                                                  request alone is above that share)
``cancelled``              queue        499       the client went away before dispatch
=========================  ===========  ========  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

from tokenfair.config import PriorityClass
from tokenfair.core.request import Request

__all__ = ["Request"]  # its home is `request.py`; imported from here too

ADMITTED: Final = "admitted"
SHED_KV_WATERMARK: Final = "shed_kv_watermark"
SHED_QUEUE_WAIT_SLO: Final = "shed_queue_wait_slo"
SHED_TENANT_TOKEN_QUOTA: Final = "shed_tenant_token_quota"
QUEUE_FULL: Final = "queue_full"
SHED_QUEUE_TIMEOUT: Final = "shed_queue_timeout"
SHED_TENANT_CONCURRENCY: Final = "shed_tenant_concurrency"
SHED_TENANT_KV_SHARE: Final = "shed_tenant_kv_share"
HELD_CONCURRENCY: Final = 1
"""``Job.held`` bit: passed over at a selection because its tenant ran ``maxConcurrentRequests``."""
HELD_KV_SHARE: Final = 2
"""``Job.held`` bit: passed over because it would take its tenant past ``maxKvShare``."""
DEMAND_AT_DISPATCH: Final = 4
"""``Job.held`` bit, not a hold (no record mark): an interactive request admitted while its
tenant's running and queued requests already filled ``maxConcurrentRequests``; ``tokenfair``
counts it in the interactive demand when it starts, not at admission (the interactive reserve)."""
CANCELLED: Final = "cancelled"

STATUS_OK: Final = 200
STATUS_SHED: Final = 429
STATUS_CLIENT_CLOSED: Final = 499


class Lane(IntEnum):
    """Priority lanes, highest first: the API's names for the core's one representation of a
    lane, the plain ``int`` :data:`LANE_INTERACTIVE` or :data:`LANE_BATCH` that ``Job.lane``
    holds and per-lane state is indexed by (a member equals its ``int``: compare lanes with
    ``==``, not ``is``)."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def of(cls, priority_class: PriorityClass) -> Lane:
        return cls.INTERACTIVE if priority_class == "interactive" else cls.BATCH


class JobState(IntEnum):
    QUEUED = 0
    DISPATCHED = 1
    DONE = 2
    REFUSED = 3
    CANCELLED = 4


@dataclass(slots=True, init=False)
class Decision:
    """The one outcome of a request, with the values the deciding gate saw.

    ``kv_occupancy_ratio`` is the occupancy the request *attempted* (never clamped);
    ``ttft_ms`` and ``queue_wait_ms`` are filled in by whoever ran the request.
    """

    request_id: str
    tenant_id: str
    priority_class: PriorityClass
    status_code: int
    reason: str
    gate: str
    service_tokens: int
    arrival_ms: float
    kv_occupancy_ratio: float = 0.0
    queue_wait_ms: float = 0.0
    ttft_ms: float = 0.0
    dispatch_ms: float | None = None
    retry_after_ms: float | None = None
    actual_service_tokens: int | None = None
    observed: dict[str, float] = field(default_factory=dict)
    would_refuse: bool = False
    """Shadow mode: a gate refused the request (``status_code``, ``reason`` and ``gate`` are
    that refusal's) and it is served anyway, beside the policy's books
    (:meth:`Scheduler.shadowed <tokenfair.core.scheduler.Scheduler.shadowed>`)."""

    def __init__(
        self,
        request_id: str,
        tenant_id: str,
        priority_class: PriorityClass,
        status_code: int,
        reason: str,
        gate: str,
        service_tokens: int,
        arrival_ms: float,
        kv_occupancy_ratio: float = 0.0,
        queue_wait_ms: float = 0.0,
        ttft_ms: float = 0.0,
        dispatch_ms: float | None = None,
        retry_after_ms: float | None = None,
        actual_service_tokens: int | None = None,
        observed: dict[str, float] | None = None,
        would_refuse: bool = False,
    ) -> None:
        # Written out, not generated by `dataclass`: compiled (tokenfair.native), a generated
        # `__init__` stays interpreted, and one decision is made per request (`Job.outcome`
        # 0.79 -> 0.12 us).
        # The fields and their defaults are the dataclass's, in its order.
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.priority_class = priority_class
        self.status_code = status_code
        self.reason = reason
        self.gate = gate
        self.service_tokens = service_tokens
        self.arrival_ms = arrival_ms
        self.kv_occupancy_ratio = kv_occupancy_ratio
        self.queue_wait_ms = queue_wait_ms
        self.ttft_ms = ttft_ms
        self.dispatch_ms = dispatch_ms
        self.retry_after_ms = retry_after_ms
        self.actual_service_tokens = actual_service_tokens
        self.observed = {} if observed is None else observed
        self.would_refuse = would_refuse

    def __reduce__(self) -> tuple[type[Decision], tuple[object, ...]]:
        # `copy`, `deepcopy` and `pickle` rebuild it through `__init__` with every field: a
        # compiled class's default reconstruction would call `__init__` with no argument.
        return (
            Decision,
            (
                self.request_id,
                self.tenant_id,
                self.priority_class,
                self.status_code,
                self.reason,
                self.gate,
                self.service_tokens,
                self.arrival_ms,
                self.kv_occupancy_ratio,
                self.queue_wait_ms,
                self.ttft_ms,
                self.dispatch_ms,
                self.retry_after_ms,
                self.actual_service_tokens,
                self.observed,
                self.would_refuse,
            ),
        )

    @property
    def admitted(self) -> bool:
        return self.status_code == STATUS_OK


LANE_INTERACTIVE: Final = 0
"""``Lane.INTERACTIVE`` as a plain ``int``: the core keeps a job's lane as one (``Job.lane``) and
indexes its per-lane state with it. Compiled, an ``int`` index is a native one, where an
``IntEnum`` member goes through the generic ``PyObject_GetItem`` (~100 instructions, dozens of
times a request); the two compare equal, so a ``Lane`` is accepted wherever a lane is taken."""
LANE_BATCH: Final = 1
"""``Lane.BATCH`` as a plain ``int`` (see :data:`LANE_INTERACTIVE`)."""

# Module constants: enum attribute lookups are measurable on the per-request path.
LANE_OF: Final[dict[str, int]] = {"interactive": LANE_INTERACTIVE, "batch": LANE_BATCH}
"""A priority class's lane, as ``Job.lane`` holds it (a plain ``int``)."""
_QUEUED: Final = JobState.QUEUED
_NEVER: Final = float("inf")

UNITS_PER_TOKEN: Final = 10**9
"""Fixed-point scale of the fairness state (DRR deficits, quanta and credit, bucket levels, the
batch lane's credit): integer nano-tokens, like APF's seat-seconds at 1e9 per seat-second. Sums
and differences of these are exact; the one rounding is where a float enters (a usage ratio, a
weight, a refill over float milliseconds), stated where it happens. A service token count
``n <= 2**40`` is ``n * 10**9`` units exactly, and a unit count converts back to the nearest
float (``units / UNITS_PER_TOKEN``) only for reading and prediction."""


def to_units(tokens: int | float) -> int:
    """``tokens`` in units: exact for an integer count, else the nearest unit to the float's
    ``tokens * 10^9`` (off by at most ``0.5 unit + 2^-53 * tokens * 10^9``; the same value
    always gives the same units). ``int | float``, not ``float``: the compiled core
    (``tokenfair.native``) would turn an ``int`` argument into a float, and an integer count
    above 2^53 / 10^9 tokens would no longer be exact."""
    return tokens * UNITS_PER_TOKEN if type(tokens) is int else round(tokens * UNITS_PER_TOKEN)


class Job:
    """A request inside the scheduler: its costs, its state and its bookkeeping."""

    __slots__ = (
        "arrival_ms",
        "borrowed",
        "deadline_ms",
        "deadline_seq",
        "decision",
        "expected_tokens",
        "expected_units",
        "held",
        "kv_blocks",
        "kv_prompt_tokens",
        "lane",
        "lifted",
        "priority_class",
        "request",
        "request_id",
        "service_tokens",
        "state",
        "tenant_id",
    )

    def __init__(
        self,
        request: Request,
        service_tokens: int,
        kv_blocks: int,
        request_id: str | None = None,
        tenant_id: str | None = None,
        kv_prompt_tokens: int = -1,
    ) -> None:
        """``request_id`` and ``tenant_id``, when given, equal the request's (a caller that has
        read them passes them: one lookup each fewer; ``Scheduler.submit`` passes the tenant's
        own id string, the key of the per-tenant dicts). ``kv_prompt_tokens``: the prompt
        tokens ``kv_blocks`` was booked for (``Scheduler.kv_prompt_ratio``); negative: the
        request's ``prefill_tokens``."""
        self.request = request
        # The request's fields the scheduler reads again and again, copied once: compiled, a
        # job's own field is a load, a Request's (a msgspec struct) a lookup by name.
        self.request_id = request.request_id if request_id is None else request_id
        self.tenant_id = request.tenant_id if tenant_id is None else tenant_id
        self.arrival_ms = request.arrival_ms
        self.priority_class: PriorityClass = request.priority_class
        self.service_tokens = service_tokens
        self.kv_blocks = kv_blocks
        self.kv_prompt_tokens = request.prefill_tokens if kv_prompt_tokens < 0 else kv_prompt_tokens
        """The prompt tokens its KV reservation counts: the estimate, or the estimate times
        the engine's learned prompt ratio at admission (the sidecar; never the records')."""
        self.lane = LANE_OF[self.priority_class]
        self.state = _QUEUED
        self.deadline_ms = _NEVER
        self.deadline_seq = 0  # its place among equal deadlines (`deadlines.DeadlineQueue`)
        self.decision: Decision | None = None
        self.borrowed = False  # dispatched on capacity lent to a tenant over its budget
        self.expected_tokens = float(service_tokens)  # what admission expects it to really use
        self.expected_units = service_tokens * UNITS_PER_TOKEN  # the same, in fixed point: the
        # round robin's charge (`expected_tokens` is always `expected_units / UNITS_PER_TOKEN`)
        self.lifted = False  # its tenant joined the ring ahead with it (drr.push join_ahead)
        self.held = 0  # HELD_* bits: the tenant limits that passed it over at a selection

    def outcome(
        self, status_code: int, reason: str, gate: str, occupancy: float, **observed: float
    ) -> Decision:
        return Decision(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            priority_class=self.priority_class,
            status_code=status_code,
            reason=reason,
            gate=gate,
            service_tokens=self.service_tokens,
            arrival_ms=self.arrival_ms,
            kv_occupancy_ratio=occupancy,
            observed=observed,
        )
