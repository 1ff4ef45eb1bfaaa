"""Synthetic mixed workloads: tenants, arrival processes, prompt/output mixes, observed times.

Every tenant is an independent request source with its own random stream
``random.Random(f"{seed}/{tenant_id}")``, so a tenant's requests do not change when another tenant
is added, removed or re-rated. Request ids are ``<tenant_id>-<n>`` (``n`` from 0, 6 digits).

Arrivals (per tenant: mean rate ``r`` requests per second, mean gap ``g = 1000 / r`` ms, window
start ``w`` ms):

* ``poisson`` — exponential gaps of mean ``g``.
* ``constant`` — arrivals at ``w + phase + k * g`` for ``k = 0, 1, ...``: gaps exactly ``g``
  (computed as ``k * g``, not summed, so they do not drift). ``phase`` is uniform in ``[0, g)``,
  drawn from the tenant's own stream, so two constant tenants at the same rate do not arrive in
  lock step (with phase 0 they would tie on every arrival, and the tie break by request id would
  always favour the same tenant). Any span of ``L`` ms holds ``floor(L / g)`` or ``ceil(L / g)``
  arrivals; a window of a whole number ``n`` of gaps holds exactly ``n``.
* ``bursty`` — a random on/off source: on and off periods are exponential with means ``on_ms`` and
  ``off_ms``; during an on period arrivals are Poisson at ``r * (on_ms + off_ms) / on_ms`` and
  there are none while off, so the long-run mean rate is still ``r``. A tenant starts on with
  probability ``on_ms / (on_ms + off_ms)`` (the stationary phase), so sources are not in step.
* ``periodic`` — a deterministic on/off source: on during
  ``[w + k * (on_ms + off_ms), w + k * (on_ms + off_ms) + on_ms)`` for ``k = 0, 1, ...`` (so it
  starts on at ``w``), off in between. While on, arrivals are Poisson at the same
  ``r * (on_ms + off_ms) / on_ms`` as ``bursty``, so a whole cycle holds
  ``r * (on_ms + off_ms) / 1000`` requests on average and the mean over whole cycles is exactly
  ``r``; over a run that stops inside a cycle it is above ``r`` (a cycle sends all its requests
  in its first ``on_ms``). Periodic tenants with equal periods are in step unless their windows
  start apart (deterministic on purpose: ``--window`` sets the phase).
* a **window** ``[start_ms, end_ms)`` switches a tenant on for part of the run only (a tenant that
  joins late or leaves early); a rate of 0 switches it off.

``on_ms`` and ``off_ms`` are per tenant (``--burst-on-ms``, ``--burst-off-ms``): means for
``bursty``, exact lengths for ``periodic``, unused otherwise.

Lengths: each mix draws prompt and output lengths independently from log-normal distributions,
``round(median * exp(N(0, sigma)))`` clamped to ``[min, max]`` tokens (see :data:`MIXES`). A fixed
length ``N`` (``--prompt-tokens``, ``--output-tokens``) is the same distribution with ``sigma = 0``
and ``min = max = N``: always ``N``, and it still draws (and ignores) its normal variate, so fixing
one side changes nothing else in the trace — the same arrivals, the same other-side lengths.
Arrival times are truncated to 1 µs (3 decimals of a ms), so they stay below a window's end (and a
truncated constant gap may read 1 µs off ``g``).

Observed fields (:func:`observe`): each request is timed as if it ran alone on an idle server
(queue wait 0, as a one-at-a-time load test measures) with the cost model::

    e2e_ms  = execution_ms(service_tokens(p, d)) * noise1
    ttft_ms = min(prefill_ms(p) * noise2, e2e_ms)

where ``noise`` is log-normal with mean 1 and standard deviation ``noise_fraction`` (so the model
holds on average and least squares recovers its coefficients). Actual token counts equal the
requested ones. The noise stream ``f"{seed}/observe"`` is separate: ``--observe`` never changes
the requests themselves.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from tokenfair.config import PriorityClass
from tokenfair.core import Request
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import TraceRecord

ArrivalProcess = Literal["poisson", "constant", "bursty", "periodic"]
ARRIVAL_PROCESSES: Final[tuple[ArrivalProcess, ...]] = ("poisson", "constant", "bursty", "periodic")

DEFAULT_DURATION_MS: Final = 60_000.0
DEFAULT_RATE_PER_SECOND: Final = 5.0
DEFAULT_BURST_ON_MS: Final = 1_000.0
DEFAULT_BURST_OFF_MS: Final = 4_000.0
DEFAULT_NOISE_FRACTION: Final = 0.05


class WorkloadError(ValueError):
    """A workload parameter broke a rule; the message names the flag."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A log-normal token length: ``round(median * exp(N(0, sigma)))`` within ``[min, max]``."""

    median_tokens: int
    sigma: float
    min_tokens: int
    max_tokens: int

    @classmethod
    def fixed(cls, tokens: int) -> LengthDist:
        """Always ``tokens``: ``round(tokens * exp(0))`` within ``[tokens, tokens]``."""
        if tokens < 0:
            raise WorkloadError(f"a fixed length must be >= 0 tokens (got {tokens})")
        return cls(tokens, 0.0, tokens, tokens)

    def sample(self, rng: random.Random) -> int:
        # The variate is drawn even when sigma is 0: a fixed length consumes the stream exactly
        # as a distribution does, so it leaves the tenant's other draws where they were.
        value = round(self.median_tokens * math.exp(rng.gauss(0.0, self.sigma)))
        return min(self.max_tokens, max(self.min_tokens, value))


@dataclass(frozen=True, slots=True)
class Mix:
    """A named kind of traffic: how long prompts and outputs are."""

    name: str
    description: str
    prompt: LengthDist
    output: LengthDist

    def with_fixed(self, prompt_tokens: int | None = None, output_tokens: int | None = None) -> Mix:
        """This mix with its prompt and/or output length fixed (``None`` keeps that side's draw)."""
        return Mix(
            self.name,
            self.description,
            self.prompt if prompt_tokens is None else LengthDist.fixed(prompt_tokens),
            self.output if output_tokens is None else LengthDist.fixed(output_tokens),
        )


MIXES: Final[dict[str, Mix]] = {
    mix.name: mix
    for mix in (
        Mix("chat", "short prompt, short answer", LengthDist(300, 0.6, 16, 2048),
            LengthDist(120, 0.6, 8, 1024)),
        Mix("completion", "code completion: medium prompt, very short output",
            LengthDist(600, 0.5, 32, 4096), LengthDist(40, 0.5, 4, 256)),
        Mix("rag", "long retrieved context, short answer", LengthDist(3000, 0.4, 512, 16384),
            LengthDist(250, 0.5, 16, 1024)),
        Mix("summarize", "long document, long summary", LengthDist(4000, 0.4, 1024, 16384),
            LengthDist(800, 0.4, 128, 4096)),
    )
}  # fmt: skip
DEFAULT_MIX_BY_CLASS: Final[dict[PriorityClass, str]] = {"interactive": "chat", "batch": "rag"}


@dataclass(frozen=True, slots=True)
class TenantWorkload:
    """What one tenant sends: its mix, mean rate (requests/s), arrival process and window.

    ``burst_on_ms`` and ``burst_off_ms`` are the on and off periods of ``bursty`` (means) and
    ``periodic`` (exact lengths) arrivals; other processes ignore them.
    """

    tenant_id: str
    priority_class: PriorityClass
    mix: Mix
    rate_per_second: float = DEFAULT_RATE_PER_SECOND
    arrivals: ArrivalProcess = "poisson"
    start_ms: float = 0.0
    end_ms: float = math.inf
    burst_on_ms: float = DEFAULT_BURST_ON_MS
    burst_off_ms: float = DEFAULT_BURST_OFF_MS


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A whole workload; it stops at ``duration_ms`` or after ``max_requests``, whichever first."""

    tenants: tuple[TenantWorkload, ...]
    seed: int = 0
    duration_ms: float | None = DEFAULT_DURATION_MS
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if self.duration_ms is None and self.max_requests is None:
            raise WorkloadError("--duration-ms or --requests: one of them must bound the trace")
        if self.duration_ms is not None and not 0 < self.duration_ms < math.inf:
            raise WorkloadError(f"--duration-ms: must be > 0 (got {self.duration_ms})")
        if self.max_requests is not None and self.max_requests <= 0:
            raise WorkloadError(f"--requests: must be > 0 (got {self.max_requests})")
        if not self.tenants:
            raise WorkloadError("--tenants: at least one tenant is required")
        for tenant in self.tenants:
            if not 0 <= tenant.rate_per_second < math.inf:
                raise WorkloadError(
                    f"--rate {tenant.tenant_id}: must be >= 0 requests per second "
                    f"(got {tenant.rate_per_second})"
                )
            if not 0 <= tenant.start_ms < tenant.end_ms:
                raise WorkloadError(
                    f"--window {tenant.tenant_id}: needs 0 <= START_MS < END_MS "
                    f"(got {tenant.start_ms}:{tenant.end_ms})"
                )
            for flag, value in (
                ("--burst-on-ms", tenant.burst_on_ms),
                ("--burst-off-ms", tenant.burst_off_ms),
            ):
                if not 0 < value < math.inf:
                    raise WorkloadError(f"{flag} {tenant.tenant_id}: must be > 0 ms (got {value})")
        if all(t.rate_per_second == 0 for t in self.tenants):
            raise WorkloadError("--rate: every tenant's rate is 0; nothing to generate")


def arrival_times(
    tenant: TenantWorkload, spec: WorkloadSpec, rng: random.Random
) -> Iterator[float]:
    """Arrival times (ms, increasing) of one tenant inside its window and the duration.

    The formulas of each process are in the module docstring.
    """
    end_ms = tenant.end_ms
    if spec.duration_ms is not None:
        end_ms = min(end_ms, spec.duration_ms)
    if tenant.rate_per_second == 0:
        return
    mean_gap_ms = 1000.0 / tenant.rate_per_second
    clock_ms = tenant.start_ms
    if tenant.arrivals == "poisson":
        while True:
            clock_ms += rng.expovariate(1.0 / mean_gap_ms)
            if clock_ms >= end_ms:
                return
            yield clock_ms
    if tenant.arrivals == "constant":
        phase_ms = rng.random() * mean_gap_ms  # in [0, g): out of step with other constant tenants
        for k in itertools.count():
            clock_ms = tenant.start_ms + phase_ms + k * mean_gap_ms  # k * g: no summed drift
            if clock_ms >= end_ms:
                return
            yield clock_ms
    on_ms, off_ms = tenant.burst_on_ms, tenant.burst_off_ms
    cycle_ms = on_ms + off_ms
    on_gap_ms = mean_gap_ms * on_ms / cycle_ms  # the rate while on, so the mean is r
    if tenant.arrivals == "periodic":
        # A Poisson process on the time spent on (on_clock_ms), laid onto the on periods in
        # order: on-time u falls in cycle floor(u / on_ms) at offset u mod on_ms. Exponential
        # gaps are memoryless, so this is a Poisson process on the union of on periods, and no
        # draw is wasted on a gap that overruns a period.
        on_clock_ms = 0.0
        while True:
            on_clock_ms += rng.expovariate(1.0 / on_gap_ms)
            cycles, into_on_ms = divmod(on_clock_ms, on_ms)
            clock_ms = tenant.start_ms + cycles * cycle_ms + into_on_ms
            if clock_ms >= end_ms:
                return
            yield clock_ms
    is_on = rng.random() < on_ms / cycle_ms
    while clock_ms < end_ms:
        period_end_ms = clock_ms + rng.expovariate(1.0 / (on_ms if is_on else off_ms))
        if is_on:
            # Exponential gaps are memoryless: dropping the gap that overruns the on period
            # leaves a Poisson process on the union of on periods.
            while (clock_ms := clock_ms + rng.expovariate(1.0 / on_gap_ms)) < period_end_ms:
                if clock_ms >= end_ms:
                    return
                yield clock_ms
        clock_ms = period_end_ms
        is_on = not is_on


def tenant_requests(tenant: TenantWorkload, spec: WorkloadSpec) -> Iterator[Request]:
    """One tenant's requests in arrival order (infinite without a duration or window end)."""
    rng = random.Random(f"{spec.seed}/{tenant.tenant_id}")
    for n, arrival_ms in enumerate(arrival_times(tenant, spec, rng)):
        yield Request(
            request_id=f"{tenant.tenant_id}-{n:06d}",
            tenant_id=tenant.tenant_id,
            arrival_ms=math.floor(arrival_ms * 1000) / 1000,
            prefill_tokens=tenant.mix.prompt.sample(rng),
            decode_tokens=tenant.mix.output.sample(rng),
            priority_class=tenant.priority_class,
        )


def generate(
    spec: WorkloadSpec,
    tap: Callable[[Iterable[Request]], Iterable[Request]] | None = None,
) -> list[Request]:
    """All tenants' requests merged in ``(arrival_ms, request_id)`` order, bounded by the spec.
    ``tap`` wraps the stream as it is drawn (the CLI's progress bar counts it there)."""
    streams = [tenant_requests(t, spec) for t in spec.tenants]
    merged: Iterable[Request] = heapq.merge(*streams, key=lambda r: (r.arrival_ms, r.request_id))
    if spec.max_requests is not None:
        merged = itertools.islice(merged, spec.max_requests)
    if tap is not None:
        merged = tap(merged)
    requests = list(merged)
    if not requests:
        raise WorkloadError(
            "--window: no tenant sends within the trace (check --window, --rate, --duration-ms)"
        )
    wanted = spec.max_requests
    if spec.duration_ms is None and wanted is not None and len(requests) < wanted:
        raise WorkloadError(
            f"--requests: the tenants' windows hold only {len(requests)} request(s), "
            f"fewer than {wanted}; widen --window or raise --rate"
        )
    return requests


def noise_factor(rng: random.Random, noise_fraction: float) -> float:
    """A log-normal factor with mean 1 and standard deviation ``noise_fraction``."""
    if noise_fraction == 0:
        return 1.0
    sigma_sq = math.log1p(noise_fraction**2)
    return math.exp(rng.gauss(-sigma_sq / 2, math.sqrt(sigma_sq)))


def observe(
    requests: Sequence[Request], cost: CostModel, noise_fraction: float, seed: int = 0
) -> list[TraceRecord]:
    """Records with idle-server timings from ``cost`` times noise (module docstring)."""
    if not 0 <= noise_fraction < 1:
        raise WorkloadError(f"--noise: must be in [0, 1) (got {noise_fraction})")
    rng = random.Random(f"{seed}/observe")
    records = []
    for request in requests:
        service = cost.service_tokens(request.prefill_tokens, request.decode_tokens)
        e2e_ms = cost.execution_ms(service) * noise_factor(rng, noise_fraction)
        ttft_ms = cost.prefill_ms(request.prefill_tokens) * noise_factor(rng, noise_fraction)
        records.append(
            TraceRecord(
                request,
                actual_prefill_tokens=request.prefill_tokens,
                actual_decode_tokens=request.decode_tokens,
                ttft_ms=round(min(ttft_ms, e2e_ms), 3),
                e2e_ms=round(e2e_ms, 3),
            )
        )
    return records
