"""The scheduling core: admission, lanes, fair selection, dispatch, settlement — no I/O, no asyncio.

One contract for every policy (the simulator and the sidecar drive the same objects):

* ``submit(request, now)`` — admission. Returns the refusal :class:`Decision`, or ``None`` when
  the request was queued. Unknown tenants and duplicate ids raise before any state changes.
* ``next_dispatch(now)`` — selection. Returns the :class:`Decision` of the request that starts now
  (``admitted``; its KV is reserved and its estimate charged), a refusal decided at dispatch, or
  ``None`` when nothing may start now. Call it until it returns ``None``.
* ``complete(id, now, actual)`` — settlement in actual service tokens (budgets and fairness
  state alike); must be called exactly once per dispatched request. Returns what it booked
  (:class:`Settled`).
  ``release_kv(id)`` frees its KV (at once by default; the simulator models residency).
* ``cancel(id, now)`` — a queued request leaves (client gone); ``expire(now)`` refuses queued
  requests past their class's wait limit. Both release every reservation.

Shadow mode (``enforcement: Shadow``, of the policy or of a tenant): every gate decides as
under ``Enforce`` and the refusal is returned the same, marked ``would_refuse``
(:meth:`Scheduler.shadowed`); the books are those of the refusal (the request is not queued,
charged or counted), and the caller serves the request beside them. So the policy's state, and
every later decision, is the one ``Enforce`` reaches on the same arrivals and completions.

Every request ends with exactly one decision. Running totals (queued requests, tokens and KV blocks
per lane; resident KV blocks) make every operation O(1) or O(tenants) — never O(queue length).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Final, NamedTuple, final

from tokenfair.config import Config, PriorityClass, TenantConfig
from tokenfair.core.bucket import Bucket, ExactTokenBucket, HasBucket, TokenBucket
from tokenfair.core.cost import CostModel
from tokenfair.core.deadlines import DeadlineQueue
from tokenfair.core.errors import DuplicateRequestError, UnknownTenantError
from tokenfair.core.jobs import (
    ADMITTED,
    CANCELLED,
    HELD_CONCURRENCY,
    HELD_KV_SHARE,
    SHED_KV_WATERMARK,
    SHED_QUEUE_TIMEOUT,
    STATUS_CLIENT_CLOSED,
    STATUS_OK,
    STATUS_SHED,
    Decision,
    Job,
    JobState,
    Lane,
    Request,
)
from tokenfair.core.reasons import Reason
from tokenfair.core.rounding import round_hundredths

_QUEUED: Final = JobState.QUEUED
_DISPATCHED: Final = JobState.DISPATCHED
_DONE: Final = JobState.DONE
_ROUNDED_OCCUPANCY_BOUND: Final = 4096
"""Most occupancy values :class:`Scheduler` keeps rounded (one per resident block count)."""
NO_REQUEST_LIMIT: Final = 1 << 60
"""``TenantState.max_running`` of a tenant without ``maxConcurrentRequests``."""
STATUS_NEVER_ADMISSIBLE: Final = 400
"""Status of a request no state of the running configuration could admit (not retryable)."""
OVER_KV_CAPACITY: Final = Reason.REQUEST_OVER_KV_CAPACITY
"""Reason: the request's own KV blocks pass its class watermark of the whole cache."""
OVER_TENANT_KV_SHARE: Final = Reason.REQUEST_OVER_TENANT_KV_SHARE
"""Reason: the request's own KV blocks pass its tenant's ``maxKvShare`` of the whole cache (a
policy that enforces the tenant limits: ``tokenfair``)."""
OVER_TENANT_BURST: Final = Reason.REQUEST_OVER_TENANT_BURST
"""Reason: the request costs more service tokens than its tenant's bucket can ever hold (and
no capacity is lent to tenants over their budget)."""


class TenantState(HasBucket):
    """Per-tenant runtime state: budget (``bucket``), queue totals and the fairness counter."""

    __slots__ = (
        "config",
        "max_kv_share",
        "max_running",
        "queued",
        "queued_tokens",
        "resident_blocks",
        "running",
        "served_tokens",
        "tenant_id",
        "usage_ratio",
        "weight",
    )

    def __init__(
        self, config: TenantConfig, now_ms: float, bucket_type: type[Bucket] = TokenBucket
    ) -> None:
        super().__init__(
            bucket_type(
                config.burst_service_tokens, config.sustained_service_tokens_per_second, now_ms
            )
        )
        self.config = config
        # `config`'s fields read at every round, as fields (compiled, a load rather than a
        # lookup by name): the id never changes (a reload gives the same tenant a new `config`,
        # and `Scheduler._apply_tenants` copies its weight).
        self.tenant_id = config.tenant_id
        self.weight = config.weight
        self.queued = 0
        self.queued_tokens = 0
        self.served_tokens = 0  # S_i: service tokens dispatched, settled to actual usage
        self.usage_ratio = 1.0
        """Recent actual ÷ estimated usage of the tenant's requests, kept by the policies that
        price work by it (``tokenfair``: an EWMA over settlements); 1 otherwise."""
        # Dispatched and not completed (or released unsettled), and the KV blocks of its
        # requests dispatched and not released: kept while a policy enforces tenant limits
        # (`Scheduler._tenant_limits`), counted again from the jobs when a reload brings them.
        self.running = 0
        self.resident_blocks = 0
        self.max_running = NO_REQUEST_LIMIT
        self.max_kv_share = math.inf
        self.adopt_limits(config)

    def adopt_limits(self, config: TenantConfig) -> None:
        """The entitlements beside the budget (``maxConcurrentRequests``, ``maxKvShare``), as
        fields the dispatcher compares; unset: limits no request reaches."""
        limit = config.max_concurrent_requests
        self.max_running = NO_REQUEST_LIMIT if limit is None else limit
        share = config.max_kv_share
        self.max_kv_share = math.inf if share is None else share

    @property
    def limited(self) -> bool:
        """The tenant has ``maxConcurrentRequests`` or ``maxKvShare``."""
        return self.max_running != NO_REQUEST_LIMIT or self.max_kv_share != math.inf


@dataclass(frozen=True, slots=True)
class Books:
    """What the scheduler holds right now; all zero when idle (the fault tests check this)."""

    queued_requests: int
    queued_service_tokens: int
    queued_kv_blocks: int
    running_requests: int
    resident_kv_blocks: int


class BudgetView(NamedTuple):
    """A tenant's token bucket as read at one instant (:meth:`Scheduler.budget`): its burst,
    its level then (negative: in debt) and its sustained refill, in service tokens (a named
    tuple: read once per answered request, built cheaply)."""

    burst: int
    level: float
    sustained_per_second: float


@final
class Settled:
    """What :meth:`Scheduler.complete` booked; read-only. A plain class, not a frozen dataclass
    or a named tuple: compiled, it is a native class built without calling into Python (one is
    built per settlement; either of the others cost 12-20% of the compiled core's time per
    request in ``bench/bench_core.py``)."""

    __slots__ = ("at_estimate", "service_tokens")

    def __init__(self, service_tokens: int, at_estimate: bool) -> None:
        self.service_tokens: Final = service_tokens
        """The service tokens the request is settled at."""
        self.at_estimate: Final = at_estimate
        """No usage was given: the estimate charged at dispatch stands (``service_tokens`` is
        it)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Settled):
            return NotImplemented
        return (self.service_tokens, self.at_estimate) == (other.service_tokens, other.at_estimate)

    def __hash__(self) -> int:
        return hash((self.service_tokens, self.at_estimate))

    def __repr__(self) -> str:
        return f"Settled({self.service_tokens}, at_estimate={self.at_estimate})"


class TenantView(NamedTuple):
    """A tenant's figures as read at one instant (:meth:`Scheduler.tenant_view`), for reading
    only: its class and weight, its queue, the service it was given (settled to actual usage)
    and its budget then."""

    priority_class: PriorityClass
    weight: float
    queued_requests: int
    queued_service_tokens: int
    served_service_tokens: int
    budget: BudgetView


class Scheduler(ABC):
    """Shared state and bookkeeping; subclasses decide admission and selection."""

    name: ClassVar[str]
    expires_queued: ClassVar[bool] = False
    """Queued requests past their class's wait limit are refused (``expire``)."""
    gates_at_dispatch: ClassVar[bool] = False
    """``_dispatch_gate`` may refuse a selected request (skipped on the hot path otherwise)."""
    charges_at_dispatch: ClassVar[bool] = False
    """``_charge`` debits the budget at dispatch (skipped on the hot path otherwise)."""
    settles_every_request: ClassVar[bool] = False
    """``_settle`` (and the usage ratio) run at every settlement, not only when the actual
    usage differs from the estimate (skipped on the hot path otherwise) — except one at the
    estimate of a job expected at its estimate (``expected_units == service_tokens * 10**9``)
    whose tenant's usage ratio is 1.0: such a ``_settle`` must change nothing, and is not
    called."""
    tracks_kv_releases: ClassVar[bool] = False
    """``_kv_released`` is called when a request's KV is freed."""
    takes_decode_allowance: ClassVar[bool] = False
    """:meth:`observe_engine_kv` takes a decode allowance and per-request credits
    (``kvDecodeBooking: engine``; ``peak``: the credits alone); False (the lesson's
    policies): they are ignored, and the gates book every running request up front whatever
    the sidecar's setting."""
    tracks_completions: ClassVar[bool] = False
    """``_finished`` is called when a dispatched request stops running (settled, or released
    unsettled)."""
    bucket_type: ClassVar[type[TokenBucket] | type[ExactTokenBucket]] = TokenBucket
    """The tenants' budget buckets: the lesson's float :class:`TokenBucket` by default;
    ``tokenfair`` keeps its budgets in integer units (``ExactTokenBucket``)."""

    def __init__(self, config: Config, now_ms: float = 0.0) -> None:
        self.config = config
        self.policy = config.policy
        self._tenant_index = config.tenant_index  # read at every submission
        self._adopt_cost_model()
        self.tenants: dict[str, TenantState] = {}
        self.tenant_order: list[TenantState] = []
        self.jobs: dict[str, Job] = {}
        self.queued_count = [0, 0]
        self.queued_tokens = [0, 0]
        self.queued_blocks = [0, 0]
        self.resident_blocks = 0
        self.kv_correction_blocks = 0
        """The engine's view of the KV cache minus the books (:meth:`observe_engine_kv`); 0
        without a fresh report from the engine. KV gates read ``resident_blocks +
        kv_correction_blocks - kv_gate_credit_blocks``; the books (``resident_blocks``) never
        change by it."""
        self.kv_gate_credit_blocks = 0
        """The blocks of the running requests' reservations the gates do not count
        (``kvDecodeBooking: engine`` or ``peak``, a fresh report): the sum of their
        ``Job.kv_gate_credit`` of the current report epoch. Each request's credit is given back
        exactly when it ends; a report or a stale one replaces them all."""
        self._kv_epoch = 0
        self._kv_prompt_ratio = 1.0  # `kv_prompt_ratio`, validated by its setter
        self.kv_decode_allowance_tokens = -1
        """How the gates book a request dispatched now (:meth:`kv_gate_job_blocks`): negative
        (the default, and always without a fresh report of the engine) its whole reservation,
        prompt and ``max_tokens``; else its prompt and this many tokens of decode (the growth
        the engine may give it before its next report), at most its reservation
        (:meth:`observe_engine_kv`, ``kvDecodeBooking: engine``)."""
        self.running = 0
        self._deadlines = DeadlineQueue()
        self._apply_tenants(config.tenants, now_ms)

    # -- configuration --------------------------------------------------------------------

    def _apply_tenants(self, tenants: Iterable[TenantConfig], now_ms: float) -> None:
        for tenant_config in tenants:
            state = self.tenants.get(tenant_config.tenant_id)
            if state is None:
                state = TenantState(tenant_config, now_ms, self.bucket_type)
                self.tenants[tenant_config.tenant_id] = state
            else:
                state.config = tenant_config
                state.weight = tenant_config.weight
                state.adopt_limits(tenant_config)
                state.bucket.retune(
                    tenant_config.burst_service_tokens,
                    tenant_config.sustained_service_tokens_per_second,
                    now_ms,
                )
            self._tenant_added(state)
        order = [self.tenants[t.tenant_id] for t in tenants]
        # A removed tenant keeps its place at the end while it still has queued work, so every
        # policy's rounds still reach that work (it just cannot submit more).
        kept = {t.config.tenant_id for t in order}
        order += [t for t in self.tenant_order if t.config.tenant_id not in kept and t.queued]
        self.tenant_order = order

    def _tenant_added(self, tenant: TenantState) -> None:
        """Hook: a tenant was added or its quota changed."""

    def reconfigure(self, config: Config, now_ms: float) -> None:
        """Adopt a new configuration without dropping queued or running requests.

        Queued requests keep the cost they were admitted with; a removed tenant's queued work
        is still served (it just cannot submit more).
        """
        self.config = config
        self.policy = config.policy
        self._tenant_index = config.tenant_index
        self._adopt_cost_model()
        self._apply_tenants(config.tenants, now_ms)
        if self._tenant_limits:
            self._recount_tenants()

    def _recount_tenants(self) -> None:
        """Each tenant's running requests and resident KV blocks, counted again from the jobs
        (O(jobs), at a reload): the counts are kept only while a limit reads them
        (``_tenant_limits``), so a reload that brings limits starts from the truth."""
        for tenant in self.tenants.values():
            tenant.running = 0
            tenant.resident_blocks = 0
        for job in self.jobs.values():
            state = job.state
            if state is _DISPATCHED or state is _DONE:  # DONE: settled, KV not yet released
                tenant = self.tenants[job.tenant_id]
                tenant.resident_blocks += job.kv_blocks
                if state is _DISPATCHED:
                    tenant.running += 1

    def _adopt_cost_model(self) -> None:
        self.cost = CostModel.from_policy(self.policy)
        self._total_kv_blocks = self.policy.total_kv_blocks
        # `wait_limit_ms` by lane (interactive, batch): read at every admission.
        # (`tuple[float, ...]`: compiled, a fixed-size tuple is built again at each index by a
        # variable, such as a `Lane`.)
        self._wait_limits: tuple[float, ...] = (
            self.policy.max_interactive_wait_ms,
            self.policy.max_batch_wait_ms,
        )
        # `watermark` by lane, and the service rate: read at every admission of the policies.
        self._watermarks: tuple[float, ...] = (
            self.policy.interactive_kv_watermark,
            self.policy.batch_kv_watermark,
        )
        self._service_rate = self.cost.service_tokens_per_ms
        # Read at every admission or dispatch (a `PolicyConfig`'s field is a lookup by name).
        self._base_quantum_tokens = self.policy.base_quantum_tokens
        self._max_queued_requests = self.policy.max_queued_requests
        self._max_queued_per_tenant = self.policy.max_queued_requests_per_tenant
        self._batch_min_share = self.policy.batch_min_share
        self._tenant_limits = False  # a policy that enforces them sets it (`_held_at_expiry`)
        # `round(blocks / total_kv_blocks, 4)` by resident blocks: every dispatch records its
        # occupancy, and `round` to 4 places costs more than a lookup. Bounded (a cache of
        # 10^9 blocks would not be): a value past the bound is computed each time.
        self._rounded_occupancy: dict[int, float] = {}

    def tenant_quantum(self, tenant: TenantState) -> float:
        return self._base_quantum_tokens * tenant.weight

    # -- the contract -----------------------------------------------------------------------

    def submit(self, request: Request, now_ms: float) -> Decision | None:
        # Each field of `request` (a msgspec struct: compiled, a lookup by name) is read once;
        # the cost model's methods are called on it (a direct C call when compiled). The job
        # keeps the tenant's own id string (`tenant.tenant_id`, the key of every per-tenant
        # dict), not the request's equal copy: each later lookup by it is then an identity hit,
        # with no hash to compute and no characters to compare.
        tenant_id = request.tenant_id
        tenant = self.tenants.get(tenant_id)
        if tenant is None or tenant_id not in self._tenant_index:
            raise UnknownTenantError(tenant_id)
        jobs = self.jobs
        request_id = request.request_id
        if request_id in jobs:
            raise DuplicateRequestError(request_id)
        prefill, decode = request.prefill_tokens, request.decode_tokens
        cost = self.cost
        if self._kv_prompt_ratio == 1.0:
            kv_prompt, kv_blocks = prefill, cost.kv_blocks(prefill, decode)
        else:
            kv_prompt, kv_blocks = self._kv_booking(request, tenant)
        job = Job(
            request,
            cost.service_tokens(prefill, decode),
            kv_blocks,
            request_id,
            tenant.tenant_id,
            kv_prompt,
        )
        refusal = self._admit(job, tenant, now_ms)
        if refusal is not None:
            job.state = JobState.REFUSED
            return self.shadowed(refusal)
        jobs[request_id] = job
        lane = job.lane
        self.queued_count[lane] += 1
        self.queued_tokens[lane] += job.service_tokens
        self.queued_blocks[lane] += job.kv_blocks
        tenant.queued += 1
        tenant.queued_tokens += job.service_tokens
        if self.expires_queued:
            deadlines = self._deadlines
            deadlines.push(job, job.arrival_ms + self._wait_limits[lane])
            if len(deadlines) > 2 * (self.queued_count[0] + self.queued_count[1]) + 64:
                # Mostly requests that left the queue: entries are dropped only from the heads,
                # and a queued request with a distant deadline there would keep every one behind
                # it (and its Request and Decision) alive. Compact: O(n), amortised O(1).
                deadlines.compact()
        self._push(job)
        return None

    def never_admissible(self, request: Request) -> Decision | None:
        """A ``400`` decision if no state of the running configuration could admit
        ``request``, else None. A pure check of the request against the configuration: it reads
        no load, no learned state (not :attr:`kv_prompt_ratio`) and changes nothing, so a
        caller that answers clients (the sidecar) makes it **before** :meth:`submit`, and a
        request that can never pass gets its 400 whatever the load — not a ``queue_full`` or
        ``shed_queue_wait_slo`` 429 that a client would retry — and the same request gets the
        same answer at any time.

        * The policy gates KV at admission (``tokenfair``, ``service_token_drr_with_admission``)
          and ``ceil((prompt + decode) / block) / total_kv_blocks`` is above the class
          watermark (``prompt``: the estimate, whatever :attr:`kv_prompt_ratio` is; a booking
          the ratio would push past the watermark is clamped to it, :meth:`_kv_booking`, so a
          request under it can always run alone): even an empty cache refuses it
          -> ``request_over_kv_capacity``.
        * The policy holds the request's class to its budget at admission (``tokenfair``: both
          classes; ``service_token_drr_with_admission``: batch), its cost is above the tenant's
          ``burst_service_tokens`` (the bucket never holds more), ``lend_idle_capacity`` is off
          and there is no pool-wide budget store (whose budget may hold more than this
          sidecar's bucket) -> ``request_over_tenant_burst``. With lending on (idle capacity
          could admit it later) or a store, it is None: the policy's 429 stands.
        * The policy enforces tenant limits (``tokenfair``) and the request's own blocks are
          above its tenant's ``maxKvShare`` of the cache -> ``request_over_tenant_kv_share``.

        The policy's own decisions (and the simulator's, which never calls this) are unchanged:
        :meth:`submit` of such a request is still refused with the gate's 429. An unknown
        tenant is None (:meth:`submit` raises for it)."""
        # Per policy: does admission gate KV, and which classes does it hold to their budget?
        gates: dict[str, tuple[bool, tuple[str, ...]]] = {
            "tokenfair": (True, ("interactive", "batch")),
            "service_token_drr_with_admission": (True, ("batch",)),
        }
        kv_gated, budget_classes = gates.get(self.name, (False, ()))
        tenant = self.tenants.get(request.tenant_id)
        if tenant is None:
            return None
        policy = self.policy
        prefill, decode = request.prefill_tokens, request.decode_tokens
        blocks = self.cost.kv_blocks(prefill, decode)
        share = blocks / policy.total_kv_blocks
        if kv_gated and share > self.watermark(Lane.of(request.priority_class)):
            reason = OVER_KV_CAPACITY
            observed: dict[str, float] = {
                "request_kv_blocks": blocks,
                "max_kv_blocks": math.floor(
                    self.watermark(Lane.of(request.priority_class)) * policy.total_kv_blocks
                ),
            }
        elif self._tenant_limits and share > tenant.max_kv_share:
            reason = OVER_TENANT_KV_SHARE
            observed = {
                "request_kv_blocks": blocks,
                "max_kv_blocks": math.floor(tenant.max_kv_share * policy.total_kv_blocks),
            }
        else:
            service_tokens = self.cost.service_tokens(prefill, decode)
            if (
                request.priority_class not in budget_classes
                or policy.lend_idle_capacity
                or self.config.budget_store is not None
                or service_tokens <= tenant.bucket.burst
            ):
                return None
            reason = OVER_TENANT_BURST
            observed = {
                "request_service_tokens": service_tokens,
                "burst_service_tokens": tenant.bucket.burst,
            }
        return self.shadowed(
            Decision(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                priority_class=request.priority_class,
                status_code=STATUS_NEVER_ADMISSIBLE,
                reason=reason,
                gate="admission",
                service_tokens=self.cost.service_tokens(prefill, decode),
                arrival_ms=request.arrival_ms,
                kv_occupancy_ratio=round(share, 4),
                observed=observed,
            )
        )

    def shadowed(self, refusal: Decision) -> Decision:
        """``refusal``, marked ``would_refuse`` if its tenant's enforcement is ``Shadow`` (the
        tenant's own ``enforcement``, else the policy's; a tenant a reload removed follows the
        policy). Every refusal of the core passes here: the caller serves a marked one beside
        the books instead of refusing it. Changes nothing else."""
        tenant = self._tenant_index.get(refusal.tenant_id)
        mode = self.policy.enforcement
        if tenant is not None and tenant.enforcement is not None:
            mode = tenant.enforcement
        if mode == "Shadow":
            refusal.would_refuse = True
        return refusal

    def observe_engine_kv(
        self,
        used_blocks: int | None,
        held_blocks: int = 0,
        decode_allowance_tokens: int = -1,
        gate_credits: Mapping[str, int] | None = None,
    ) -> None:
        """The engine reported its KV cache just now: ``used_blocks`` in use, where the
        running requests surely hold ``held_blocks`` (:mod:`tokenfair.server.kv_view`: each
        one that has shown tokens its prompt and the tokens so far, at most its reservation;
        nothing for one that has not — a prompt the engine may not have allocated yet is never
        taken as held — nor for one the engine preempted; at most ``used_blocks``). Until the
        next report the gates see::

            gate = resident + (used - held)           (kv_correction_blocks = used - held)

        that is, the engine's truth plus, for every running request, what its reservation may
        still grow by (prompt and ``max_tokens`` booked, less what it surely holds), and in
        full for every one that has shown nothing or was sent since. Decode growth of the
        running requests is never taken as free: the gates stay at or above what the engine
        holds once every running request reaches its reservation. The correction is what the
        books and the engine disagree on besides that growth (prompt estimates, shared
        prefixes, other clients of the engine). ``None``: no fresh report (stale or missing
        metrics): the books alone.

        ``decode_allowance_tokens`` (``kvDecodeBooking: engine``; negative: the above, the
        default) books decode as the engine does: ``gate_credits`` maps each running request
        to the blocks of its reservation beyond its prompt, the tokens it has shown and this
        allowance (:meth:`~tokenfair.server.kv_view.KvView.gate_blocks_held`), which the gates
        do not count (:attr:`kv_gate_credit_blocks`), and a request dispatched before the next
        report counts its prompt and the allowance (:meth:`kv_gate_job_blocks`), not its
        ``max_tokens``. Each credit is the request's own: given back exactly when it ends
        (:meth:`_free_blocks`), whatever the correction's sign, so the gates never see fewer
        blocks than the report less what the requests ended since surely held in it. Decode
        beyond the allowance is the watermark's headroom's to absorb (the engine preempts past
        it). A policy that does not take the allowance (:attr:`takes_decode_allowance`, the
        lesson's) ignores both.

        ``gate_credits`` without an allowance (``kvDecodeBooking: peak``): the running
        requests' credits are taken the same way (each given back at its end), while a request
        dispatched before the next report is booked at its whole reservation."""
        self._kv_epoch += 1
        self.kv_gate_credit_blocks = 0
        if used_blocks is None:
            self.kv_correction_blocks = 0
            self.kv_decode_allowance_tokens = -1
            return
        self.kv_correction_blocks = used_blocks - held_blocks
        if not self.takes_decode_allowance:
            self.kv_decode_allowance_tokens = -1
            return
        self.kv_decode_allowance_tokens = max(-1, decode_allowance_tokens)
        if not gate_credits:
            return
        epoch = self._kv_epoch
        jobs = self.jobs
        total = 0
        for request_id, credit in gate_credits.items():
            job = jobs.get(request_id)
            if job is None or job.state is not _DISPATCHED or credit <= 0:
                continue
            credit = min(credit, job.kv_blocks)
            job.kv_gate_credit = credit
            job.kv_credit_epoch = epoch
            total += credit
        self.kv_gate_credit_blocks = total

    @property
    def kv_prompt_ratio(self) -> float:
        """The engine's prompt tokens per estimated one, as a request's KV is booked: a
        request admitted now reserves ``ceil((ceil(prefill * ratio) + decode) / block)``
        blocks (``Job.kv_prompt_tokens``, ``Job.kv_blocks``), at most what an empty cache
        admits for it (:meth:`_kv_booking`). 1 (the estimate) unless its caller sets it: the
        sidecar, from the prompt usage its engine reports (:mod:`tokenfair.server.kv_view`);
        the simulator never does. Service tokens, budgets, :meth:`never_admissible` and the
        records' fields are the estimate's whatever it is. Setting it takes a finite number
        above 0 (``ValueError`` otherwise)."""
        return self._kv_prompt_ratio

    @kv_prompt_ratio.setter
    def kv_prompt_ratio(self, ratio: float) -> None:
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(
                f"Scheduler.kv_prompt_ratio: must be a finite number above 0 (got {ratio!r})"
            )
        self._kv_prompt_ratio = float(ratio)

    def kv_prompt_tokens(self, prefill_tokens: int) -> int:
        """The prompt tokens a request of ``prefill_tokens`` (the estimate) books KV for at
        the current ratio, before :meth:`_kv_booking`'s clamp: ``ceil(prefill_tokens *
        kv_prompt_ratio)``."""
        ratio = self._kv_prompt_ratio
        # Rounded first: float noise (10 * (110 / 100) = 11.000000000000002) books no token more.
        return prefill_tokens if ratio == 1.0 else math.ceil(round(prefill_tokens * ratio, 9))

    def _kv_booking(self, request: Request, tenant: TenantState) -> tuple[int, int]:
        """``(prompt tokens, blocks)`` :meth:`submit` books for ``request`` at a ratio other
        than 1: the prompt at :meth:`kv_prompt_tokens`, but never more blocks than the most an
        empty cache admits for it (its class watermark and, under enforced tenant limits, its
        tenant's ``maxKvShare`` of ``total_kv_blocks``) nor fewer than the estimate's. A learned
        ratio thus never makes a request refused whatever the load: one that
        :meth:`never_admissible` lets through (the estimate's blocks) can always run alone."""
        prefill, decode = request.prefill_tokens, request.decode_tokens
        cost = self.cost
        kv_prompt = self.kv_prompt_tokens(prefill)
        blocks = cost.kv_blocks(kv_prompt, decode)
        if kv_prompt <= prefill:
            return kv_prompt, blocks
        total = self.policy.total_kv_blocks
        limit = self.watermark(Lane.of(request.priority_class))
        if self._tenant_limits and tenant.max_kv_share < limit:
            limit = tenant.max_kv_share
        # The most blocks b with b / total <= limit, as the gates compare it (in floats).
        cap = math.floor(limit * total)
        while cap > 0 and cap / total > limit:
            cap -= 1
        while (cap + 1) / total <= limit:
            cap += 1
        cap = max(cap, cost.kv_blocks(prefill, decode))
        if blocks <= cap:
            return kv_prompt, blocks
        # Clamped: the prompt that fills `cap` blocks (at least the estimate's, as cap is).
        return max(prefill, cap * cost.kv_block_tokens - decode), cap

    def kv_gate_job_blocks(self, job: Job) -> int:
        """The blocks the KV gates book ``job`` at: its reservation (``job.kv_blocks``), or,
        while :attr:`kv_decode_allowance_tokens` is set (a fresh report, ``kvDecodeBooking:
        engine``), ``ceil((kv_prompt_tokens + allowance) / block)`` if that is less."""
        allowance = self.kv_decode_allowance_tokens
        blocks = job.kv_blocks
        if allowance < 0:
            return blocks
        block = self.policy.kv_block_tokens
        booked = -(-(job.kv_prompt_tokens + allowance) // block)
        return booked if booked < blocks else blocks

    def kv_gate_freed_blocks(self, job: Job) -> int:
        """The blocks the gates stop counting when running ``job`` ends (:meth:`_free_blocks`):
        its reservation less its gate credit of the current report epoch."""
        if job.kv_credit_epoch == self._kv_epoch:
            return job.kv_blocks - job.kv_gate_credit
        return job.kv_blocks

    @property
    def kv_gate_blocks(self) -> int:
        """KV blocks the gates see in use: the books corrected by the engine's last report,
        less the running requests' decode the gates do not count (engine booking)."""
        return self.resident_blocks + self.kv_correction_blocks - self.kv_gate_credit_blocks

    @property
    def queued_total(self) -> int:
        """Queued requests of both lanes (O(1))."""
        return self.queued_count[0] + self.queued_count[1]

    def next_dispatch(self, now_ms: float) -> Decision | None:
        job = self._select(now_ms)
        if job is None:
            return None
        tenant = self.tenants[job.tenant_id]
        self._unqueue(job, tenant)
        service_tokens = job.service_tokens
        kv_blocks = job.kv_blocks
        if self.gates_at_dispatch:
            refusal = self._dispatch_gate(job, tenant, now_ms)
            if refusal is not None:
                job.state = JobState.REFUSED
                del self.jobs[job.request_id]
                refusal.queue_wait_ms = round_hundredths(max(0.0, now_ms - job.arrival_ms))
                return self.shadowed(refusal)
        blocks = self.resident_blocks + kv_blocks
        if self.kv_decode_allowance_tokens >= 0:
            # Booked at its prompt and the decode allowance until the next report: the rest
            # of its reservation is its credit, given back when it ends (`_free_blocks`).
            credit = kv_blocks - self.kv_gate_job_blocks(job)
            job.kv_gate_credit = credit
            job.kv_credit_epoch = self._kv_epoch
            self.kv_gate_credit_blocks += credit
        # the occupancy it brings the cache to
        seen = blocks + self.kv_correction_blocks - self.kv_gate_credit_blocks
        rounded = self._rounded_occupancy
        occupancy = rounded.get(seen)
        if occupancy is None:
            occupancy = round(seen / self._total_kv_blocks, 4)
            if len(rounded) < _ROUNDED_OCCUPANCY_BOUND:
                rounded[seen] = occupancy
        self.resident_blocks = blocks
        self.running += 1
        if self._tenant_limits:  # the tenant's counts, kept only while a limit reads them
            tenant.running += 1
            tenant.resident_blocks += kv_blocks
        tenant.served_tokens += service_tokens
        if self.charges_at_dispatch:
            self._charge(job, tenant, now_ms)
        arrival_ms = job.arrival_ms
        wait_ms = now_ms - arrival_ms
        decision = Decision(
            job.request_id,
            job.tenant_id,
            job.priority_class,
            STATUS_OK,
            ADMITTED,
            "dispatch",
            service_tokens,
            arrival_ms,
            occupancy,
            round_hundredths(wait_ms if wait_ms > 0.0 else 0.0),  # max(0.0, wait), rounded
            0.0,
            now_ms,
        )
        if job.borrowed:
            decision.observed["borrowed_service_tokens"] = job.service_tokens
        if job.held:  # passed over for its tenant's limits before it started (records)
            note_held(decision, job.held)
        job.state = _DISPATCHED
        job.decision = decision
        return decision

    def complete(
        self,
        request_id: str,
        now_ms: float,
        actual_service_tokens: object = None,
        *,
        actual_kv_blocks: object = None,
        release_kv: bool = True,
    ) -> Settled:
        """Settle a dispatched request against its actual usage (default: the estimate).

        ``actual_kv_blocks`` replaces the KV reservation with what the request really held
        (the simulator's replay of recorded usage), until ``release_kv``. Values that are not
        integers in ``[0, MAX_SETTLED_TOKENS]`` raise ``ValueError`` before anything changes.
        Returns what it booked: the service tokens, and whether they are the estimate."""
        job = self.jobs[request_id]
        decision = job.decision
        if job.state is not _DISPATCHED or decision is None:
            raise ValueError(f"request {request_id!r} is not running")
        if actual_service_tokens is None:
            actual = job.service_tokens  # the estimate: nothing to check, nothing to correct
        else:
            actual = _checked_settled("actual_service_tokens", actual_service_tokens)
        kv_blocks = None
        if actual_kv_blocks is not None:
            kv_blocks = _checked_settled("actual_kv_blocks", actual_kv_blocks)
        refund = job.service_tokens - actual
        if refund or self.settles_every_request:
            tenant = self.tenants[job.tenant_id]
            tenant.served_tokens -= refund
            self._settle(job, tenant, refund, now_ms)
        if self._tenant_limits:
            limited = self.tenants[job.tenant_id]
            limited.running -= 1
            if kv_blocks is not None:
                limited.resident_blocks += kv_blocks - job.kv_blocks
        if kv_blocks is not None:
            self.resident_blocks += kv_blocks - job.kv_blocks
            job.kv_blocks = kv_blocks
            if job.kv_credit_epoch == self._kv_epoch:
                # What it holds is known now: no decode to come, so no credit (the gates count
                # the blocks it holds until its release, as the books do).
                self.kv_gate_credit_blocks -= job.kv_gate_credit
                job.kv_credit_epoch = -1
        job.state = _DONE
        self.running -= 1
        if self.tracks_completions:
            self._finished(job, now_ms)
        decision.actual_service_tokens = actual
        if release_kv:
            self.release_kv(request_id)
        return Settled(actual, actual_service_tokens is None)

    def release_kv(self, request_id: str) -> None:
        """Free the KV blocks of a completed request (exactly once)."""
        job = self.jobs.get(request_id)
        if job is None or job.state is not _DONE:
            raise ValueError(f"request {request_id!r} has no KV to release (not completed)")
        del self.jobs[request_id]
        self._free_blocks(job)
        if self._tenant_limits:
            self.tenants[job.tenant_id].resident_blocks -= job.kv_blocks
        if self.tracks_kv_releases:
            self._kv_released(job)

    def _free_blocks(self, job: Job) -> None:
        """Take ``job``'s reservation off the books, and its gate credit of the current report
        epoch (engine booking) off :attr:`kv_gate_credit_blocks`: exactly the blocks the gates
        did not count for it. A negative correction (the engine holds less than modelled) may
        have been this request's: it gives back up to its whole reservation (``min(0,
        correction + blocks)``), so no credit outlives the requests it came from; a positive
        one (the engine holds more) stays until the next report."""
        blocks = job.kv_blocks
        self.resident_blocks -= blocks
        if job.kv_credit_epoch == self._kv_epoch:
            self.kv_gate_credit_blocks -= job.kv_gate_credit
            job.kv_credit_epoch = -1
        correction = self.kv_correction_blocks
        if correction < 0:
            self.kv_correction_blocks = min(0, correction + blocks)

    def release_unsettled(self, request_id: str) -> bool:
        """Take a dispatched request off the books without settling it: its running slot (if
        still held) and its KV blocks. The last resort of a caller whose ``complete`` or
        ``release_kv`` raised: the tenant keeps the estimate charged at dispatch (no refund, no
        fairness correction), and nothing it held stays held. False if nothing was held."""
        job = self.jobs.get(request_id)
        if job is None or job.state not in (_DISPATCHED, _DONE):
            return False
        del self.jobs[request_id]
        tenant = self.tenants[job.tenant_id]
        if job.state is _DISPATCHED:
            job.state = _DONE
            self.running -= 1
            if self._tenant_limits:
                tenant.running -= 1
            if self.tracks_completions:
                self._finished(job, None)
        self._free_blocks(job)
        if self._tenant_limits:
            tenant.resident_blocks -= job.kv_blocks
        self._kv_released(job)
        return True

    def cancel(self, request_id: str, now_ms: float) -> Decision | None:
        """A queued request leaves; returns its decision, or None if it is not queued."""
        job = self.jobs.get(request_id)
        if job is None or job.state is not JobState.QUEUED:
            return None
        return self._drop(job, STATUS_CLIENT_CLOSED, CANCELLED, "queue", now_ms)

    def expire(self, now_ms: float) -> list[Decision]:
        """Refuse queued requests whose wait passed their class limit (``now > deadline``), the
        earliest deadline first (:class:`~tokenfair.core.deadlines.DeadlineQueue`)."""
        expired: list[Decision] = []
        deadlines = self._deadlines
        while True:
            job = deadlines.earliest()
            if job is None or job.deadline_ms >= now_ms:
                break
            # Out of the index first, as the heap this replaced did: should `_drop` ever raise
            # for a job, the next `expire` goes on with the others instead of failing on it.
            deadlines.remove(job)
            decision = self._drop(job, STATUS_SHED, SHED_QUEUE_TIMEOUT, "queue", now_ms)
            decision.retry_after_ms = 0.0
            decision.observed["max_wait_ms"] = self.wait_limit_ms(job.lane)
            if self._tenant_limits:
                self._held_at_expiry(job, decision)
            expired.append(decision)
        if expired:
            self._expired(expired, now_ms)
            for decision in expired:
                self.shadowed(decision)
        return expired

    def next_wakeup_ms(self, now_ms: float) -> float | None:
        """Earliest time after ``now_ms`` when waiting could end by the passage of time alone
        (a deadline passing, a budget refilling); None if there is none."""
        job = self._deadlines.earliest()
        if job is None:
            return None
        return math.nextafter(job.deadline_ms, math.inf)

    def books(self) -> Books:
        return Books(
            queued_requests=sum(self.queued_count),
            queued_service_tokens=sum(self.queued_tokens),
            queued_kv_blocks=sum(self.queued_blocks),
            running_requests=self.running,
            resident_kv_blocks=self.resident_blocks,
        )

    # -- read-only queries (the request path asks; it never reads ``jobs`` or a bucket; the pool
    # budgets of ``server/pool.py`` are the one port that holds buckets, to lease into them) ---

    def budget(self, tenant_id: str, now_ms: float) -> BudgetView | None:
        """``tenant_id``'s budget at ``now_ms`` (its bucket refilled to then, as admission
        would); None for a tenant the scheduler does not know."""
        state = self.tenants.get(tenant_id)
        if state is None:
            return None
        bucket = state.bucket
        level = bucket.refill(now_ms)
        return BudgetView(bucket.burst, level, bucket.sustained_per_second)

    def tenant_ids(self) -> list[str]:
        """The tenants the scheduler knows, in the order they were first configured (a reload
        adds, never removes)."""
        return list(self.tenants)

    def tenant_view(self, tenant_id: str, now_ms: float) -> TenantView | None:
        """``tenant_id``'s figures at ``now_ms`` (its budget as :meth:`budget` reads it); None
        for a tenant the scheduler does not know."""
        state = self.tenants.get(tenant_id)
        if state is None:
            return None
        config = state.config
        bucket = state.bucket
        level = bucket.refill(now_ms)
        return TenantView(
            config.priority_class,
            config.weight,
            state.queued,
            state.queued_tokens,
            state.served_tokens,
            BudgetView(bucket.burst, level, bucket.sustained_per_second),
        )

    def running_backlog(self) -> list[int]:
        """Per lane, the service tokens of the dispatched requests not yet settled."""
        backlog = [0, 0]
        for job in self.jobs.values():
            if job.state is JobState.DISPATCHED:
                backlog[job.lane] += job.service_tokens
        return backlog

    def is_running(self, request_id: str) -> bool:
        """``request_id`` is dispatched and not yet settled."""
        job = self.jobs.get(request_id)
        return job is not None and job.state is JobState.DISPATCHED

    def held_job(self, request_id: str) -> Job | None:
        """The job of a dispatched request whose KV the books still hold (running, or settled
        with its KV held until its hold time), for reading only; None if queued or gone."""
        job = self.jobs.get(request_id)
        if job is None or job.state is JobState.QUEUED:
            return None
        return job

    # -- helpers ----------------------------------------------------------------------------

    def watermark(self, lane: int) -> float:
        return self._watermarks[lane]

    def wait_limit_ms(self, lane: int) -> float:
        return self._wait_limits[lane]

    def _unqueue(self, job: Job, tenant: TenantState) -> None:
        lane = job.lane
        self.queued_count[lane] -= 1
        self.queued_tokens[lane] -= job.service_tokens
        self.queued_blocks[lane] -= job.kv_blocks
        tenant.queued -= 1
        tenant.queued_tokens -= job.service_tokens

    def _drop(self, job: Job, status: int, reason: str, gate: str, now_ms: float) -> Decision:
        tenant = self.tenants[job.tenant_id]
        # The policy first: one that cannot let a job leave raises before any total changes.
        self._forget(job)
        self._unqueue(job, tenant)
        job.state = JobState.CANCELLED if status == STATUS_CLIENT_CLOSED else JobState.REFUSED
        del self.jobs[job.request_id]
        occupancy = (
            self.kv_gate_blocks + self.kv_gate_job_blocks(job)
        ) / self.policy.total_kv_blocks
        decision = job.outcome(status, reason, gate, round(occupancy, 4))
        decision.queue_wait_ms = round_hundredths(max(0.0, now_ms - job.arrival_ms))
        return decision

    def _refusal(
        self,
        job: Job,
        reason: str,
        gate: str,
        occupancy: float,
        retry_after_ms: float | None = None,
        **observed: float,
    ) -> Decision:
        decision = job.outcome(STATUS_SHED, reason, gate, round(occupancy, 4), **observed)
        decision.retry_after_ms = retry_after_ms
        return decision

    def kv_fits(self, job: Job) -> bool:
        return (
            self.kv_gate_blocks + self.kv_gate_job_blocks(job)
        ) / self._total_kv_blocks <= self._watermarks[job.lane]

    def kv_room_blocks(self, lane: int) -> int:
        """The most blocks a request of ``lane`` may book now: the largest ``n`` with ``(gate +
        n) / totalKvBlocks <= watermark`` (``gate`` the blocks the gates see in use), so that
        ``kv_fits(job)`` is exactly ``kv_gate_job_blocks(job) <= kv_room_blocks(job.lane)``
        (the same float test, stepped from ``floor(watermark * total) - gate``). O(1)."""
        gate = self.kv_gate_blocks
        total = self._total_kv_blocks
        mark = self._watermarks[lane]
        room = math.floor(mark * total) - gate
        while (gate + room + 1) / total <= mark:
            room += 1
        while (gate + room) / total > mark:
            room -= 1
        return room

    # -- policy hooks -----------------------------------------------------------------------

    @abstractmethod
    def _admit(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        """Admission gates; a refusal, or None to queue the job."""

    @abstractmethod
    def _push(self, job: Job) -> None:
        """Put an admitted job in its queue."""

    @abstractmethod
    def _select(self, now_ms: float) -> Job | None:
        """Remove and return the next job to start now, or None."""

    def _forget(self, job: Job) -> None:
        """A queued job left without being selected (cancel, expiry)."""
        raise NotImplementedError(f"{self.name} does not support leaving the queue")

    def _dispatch_gate(self, job: Job, tenant: TenantState, now_ms: float) -> Decision | None:
        """Last check when the job is selected; a refusal sheds it at dispatch."""
        return None

    def _charge(self, job: Job, tenant: TenantState, now_ms: float) -> None:
        """Charge the estimate to the tenant's budget at dispatch."""

    def _kv_released(self, job: Job) -> None:
        """Hook: a request's KV blocks were freed."""

    def _finished(self, job: Job, now_ms: float | None) -> None:
        """Hook (``tracks_completions``): a dispatched request stopped running at ``now_ms``
        (None: taken off the books without settlement, time unknown)."""

    def _held_at_expiry(self, job: Job, decision: Decision) -> None:
        """Hook (while ``_tenant_limits``): ``job`` expired just now; a policy that enforces
        the tenant limits names the one holding it (reason and observed values)."""

    def _expired(self, decisions: list[Decision], now_ms: float) -> None:
        """Hook: :meth:`expire` refused these queued requests (in deadline order) just now;
        the policy may complete their decisions (``tokenfair``: the ``Retry-After``)."""

    def _settle(self, job: Job, tenant: TenantState, refund: int, now_ms: float) -> None:
        """Apply ``estimate - actual`` to the tenant's budget (and fairness state); called when
        they differ, or at every settlement with ``settles_every_request``."""


MAX_SETTLED_TOKENS: Final = 2**40
"""Largest usage settlement accepts (service tokens or KV blocks): a trillion tokens is far
beyond any request, and far below where float budgets lose integer precision (2**53)."""


def _checked_settled(name: str, value: object) -> int:
    """``value`` if it is an integer in ``[0, MAX_SETTLED_TOKENS]``, else ``ValueError`` naming
    ``name``. ``complete`` takes ``object`` for these values so that this check is the one a
    caller meets, compiled or not (a compiled ``int`` parameter would turn ``True`` into 1 and
    refuse a float with a ``TypeError`` first)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer (got {type(value).__name__})")
    if not 0 <= value <= MAX_SETTLED_TOKENS:
        raise ValueError(f"{name} must be in [0, {MAX_SETTLED_TOKENS}] (got {value})")
    return value


def note_held(decision: Decision, held: int) -> None:
    """Record on a dispatch decision the tenant limits that held the request back
    (``Job.held``): ``held_by_max_concurrent_requests`` and/or ``held_by_max_kv_share``, 1."""
    if held & HELD_CONCURRENCY:
        decision.observed["held_by_max_concurrent_requests"] = 1
    if held & HELD_KV_SHARE:
        decision.observed["held_by_max_kv_share"] = 1


def shed_kv(scheduler: Scheduler, job: Job, gate: str, occupancy: float) -> Decision:
    """A KV-watermark refusal recording the *attempted* occupancy, unclamped."""
    return scheduler._refusal(
        job,
        SHED_KV_WATERMARK,
        gate,
        occupancy,
        None,
        attempted_kv_occupancy=occupancy,
        kv_watermark=scheduler.watermark(job.lane),
    )
