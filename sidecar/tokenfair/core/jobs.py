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
CANCELLED: Final = "cancelled"

STATUS_OK: Final = 200
STATUS_SHED: Final = 429
STATUS_CLIENT_CLOSED: Final = 499


class Lane(IntEnum):
    """Priority lanes, highest first."""

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


@dataclass(slots=True)
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

    @property
    def admitted(self) -> bool:
        return self.status_code == STATUS_OK


# Module constants: enum attribute lookups are measurable on the per-request path.
_LANE_OF: Final[dict[str, Lane]] = {"interactive": Lane.INTERACTIVE, "batch": Lane.BATCH}
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
        "borrowed",
        "deadline_ms",
        "deadline_seq",
        "decision",
        "expected_tokens",
        "expected_units",
        "kv_blocks",
        "lane",
        "lifted",
        "request",
        "service_tokens",
        "state",
    )

    def __init__(self, request: Request, service_tokens: int, kv_blocks: int) -> None:
        self.request = request
        self.service_tokens = service_tokens
        self.kv_blocks = kv_blocks
        self.lane = _LANE_OF[request.priority_class]
        self.state = _QUEUED
        self.deadline_ms = _NEVER
        self.deadline_seq = 0  # its place among equal deadlines (`deadlines.DeadlineQueue`)
        self.decision: Decision | None = None
        self.borrowed = False  # dispatched on capacity lent to a tenant over its budget
        self.expected_tokens = float(service_tokens)  # what admission expects it to really use
        self.expected_units = service_tokens * UNITS_PER_TOKEN  # the same, in fixed point: the
        # round robin's charge (`expected_tokens` is always `expected_units / UNITS_PER_TOKEN`)
        self.lifted = False  # its tenant joined the ring ahead with it (drr.push join_ahead)

    def outcome(
        self, status_code: int, reason: str, gate: str, occupancy: float, **observed: float
    ) -> Decision:
        request = self.request
        return Decision(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            priority_class=request.priority_class,
            status_code=status_code,
            reason=reason,
            gate=gate,
            service_tokens=self.service_tokens,
            arrival_ms=request.arrival_ms,
            kv_occupancy_ratio=occupancy,
            observed=observed,
        )
