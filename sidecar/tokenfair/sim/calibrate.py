"""Fit the cost model's ``decode_weight`` and service rate to observed request times.

What is fitted. The cost model says a request of ``p`` prefill and ``d`` decode tokens keeps the
server busy for ``execution_ms = (p + w * d) / rate``. That is linear in ``p`` and ``d``::

    execution_ms = a * p + b * d        rate = 1 / a   (service tokens per ms)
                                        w    = b / a   (decode weight)

with no intercept (the model has none). Least squares over the usable records solves the 2x2
normal equations in closed form (weights ``v``)::

    [Spp Spd] [a]   [Spy]          Spp = sum v p^2, Spd = sum v p d, Spy = sum v p y, ...
    [Spd Sdd] [b] = [Sdy]          det = Spp*Sdd - Spd^2

first unweighted (``v = 1``), then twice with ``v = 1 / fitted^2``: latency noise is roughly
proportional to the time, and these weights minimise the *relative* error, which spreads the
influence over short and long requests instead of letting the longest decide (on the generator's
5 % noise this cuts the error of ``w`` by ~2.5x against plain least squares).

What time is execution time. ``execution_ms = e2e_ms - queue_wait_ms - send_lag_ms``: the time
from dispatch to the last token. ``e2e_ms`` and ``ttft_ms`` count from the request's arrival (its
``arrival_ms``); ``queue_wait_ms`` (an outcome field of a sidecar record) is the time it waited
for dispatch, and ``observed.send_lag_ms`` (``tokenfair loadgen``'s) the time the client sent it
late. A record without ``queue_wait_ms`` is taken to have waited 0 ms (an idle-server probe, as
``tokenfair trace generate --observe`` writes); the result counts these records, because on a
loaded server their queue wait would inflate the fitted costs. Token counts are the backend's
``actual_prefill_tokens`` / ``actual_decode_tokens``: requested lengths are upper bounds, not
what ran. Records with a ``status_code`` other than 200 (shed, cancelled, failed) are skipped,
as are records without ``e2e_ms`` or actual token counts; the result counts each reason.

Fit quality. ``r_squared`` is the centered R^2, ``1 - RSS / sum (y - mean y)^2`` (the uncentered
R^2 of a no-intercept fit flatters it); ``residual_rms_ms = sqrt(RSS / n)``; the relative RMS is
that of ``(y - fit) / fit``, the right yardstick for multiplicative noise. Standard errors are
the heteroscedasticity-robust sandwich ``M^-1 B M^-1 * n / (n - 2)`` (``M`` the weighted normal
matrix, ``B = sum (v e)^2 x x'``), honest whatever the noise's shape (the textbook
``sigma^2 (X'X)^-1`` understates them when big requests are noisier), with the delta method for
``w = b / a`` and ``rate = 1 / a``.

Refusals (:class:`CalibrationError`): fewer than ``min_records`` usable records; prompt and output
lengths (nearly) proportional across records (``1 - Spd^2 / (Spp * Sdd) < 1e-6``: ``a`` and ``b``
cannot be told apart); ``a <= 0`` or ``b <= 0`` (no positive rate or weight explains the data);
a relative standard error of ``w`` or ``rate`` above ``max_relative_stderr`` (default 0.2).

Prefill speed (optional, from TTFT). ``prefill_ms = ttft_ms - queue_wait_ms - send_lag_ms``
follows ``max(floor, p / prefill_tokens_per_ms)``. A TTFT within 1 % of ``e2e_ms`` is the time of
a whole non-streamed response, not of a first token, and is left out. The fit of
``prefill_ms = c * p`` (``speed = 1 / c``) is again the relative-error one, ``c = mean(prefill_ms
/ p)`` (weights ``1 / p^2``), with standard error ``sd(prefill_ms / p) / sqrt(n)``. The floor hides
the speed for short prompts, so it uses only records whose prompt is long enough that
``p / speed >= 1.5 * floor`` at the current estimate, iterated to a fixed point. Selecting on
``p`` (the regressor), never on the observed time, keeps the estimate unbiased.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Final

from tokenfair.config import PolicyConfig
from tokenfair.core.jobs import STATUS_OK
from tokenfair.records.codec import TraceRecord, open_lines
from tokenfair.sim.batchfit import BatchingFit, BatchingFitError, Run, fit_batching, records_needed
from tokenfair.sim.concurrency import ConcurrencyProfile

DEFAULT_MIN_RECORDS: Final = 20
DEFAULT_PREFILL_FLOOR_MS: Final = PolicyConfig().prefill_floor_ms
DEFAULT_MAX_RELATIVE_STDERR: Final = 0.2
COLLINEARITY_LIMIT: Final = 1e-6
"""Smallest ``1 - cos^2`` between the prompt and output length vectors that still separates them."""
NOT_STREAMED_RATIO: Final = 0.99
"""A TTFT at or above this fraction of e2e_ms timed a whole response, not a first token."""
REWEIGHT_STEPS: Final = 2
"""Weighted passes after the unweighted one; the second changes the estimate by far less than
its standard error."""
PREFILL_FLOOR_MARGIN: Final = 1.5
"""Prompts must predict ``margin * floor`` of prefill to be clear of the floor's reach."""

# Skip reasons, as counted in :attr:`Calibration.skipped`.
NOT_ADMITTED: Final = "not admitted (status_code != 200)"
NO_E2E: Final = "no e2e_ms"
NO_ACTUAL_TOKENS: Final = "no actual token counts"
NO_TOKENS: Final = "no tokens"
NOT_POSITIVE: Final = "e2e_ms not above the queue wait"


class CalibrationError(ValueError):
    """The records cannot support a fit; the message says why and what was counted."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One usable record: actual token counts and the times the server spent on it."""

    prefill_tokens: int
    decode_tokens: int
    execution_ms: float
    prefill_ms: float | None = None
    """TTFT minus queue wait, when the record has a TTFT of a first token."""
    span: tuple[float, float] | None = None
    """``(dispatch_ms, end_ms)`` of a live record (one with a ``status_code``: the sidecar's,
    loadgen's); None for a probe, which ran alone."""


@dataclass(frozen=True, slots=True)
class ServiceFit:
    """The fitted ``decode_weight`` and ``service_tokens_per_ms`` and how well they fit."""

    decode_weight: float
    decode_weight_stderr: float
    service_tokens_per_ms: float
    service_tokens_per_ms_stderr: float
    ms_per_prefill_token: float
    ms_per_decode_token: float
    r_squared: float
    residual_rms_ms: float
    residual_rms_relative: float
    records_used: int


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """The fitted prefill speed (prompt tokens per ms) above ``prefill_floor_ms``."""

    prefill_tokens_per_ms: float
    prefill_tokens_per_ms_stderr: float
    prefill_floor_ms: float
    r_squared: float
    residual_rms_ms: float
    records_used: int


@dataclass(frozen=True, slots=True)
class PrefillQueueFit:
    """The engine's prefill throughput when it prefills the prompts it starts first come first
    served (:func:`fit_prefill_queue`): an engine fact for the replay of a live run
    (``sim.simulator.EngineFacts``), not a policy field."""

    prefill_tokens_per_ms: float
    rms_log_error: float
    """RMS of ``ln(observed / predicted)`` of the times to the first token."""
    records_used: int
    prefill_overhead_ms: float = 0.0
    """What each prompt costs the queue beyond ``prompt / prefill_tokens_per_ms`` (ms)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """The result of :func:`calibrate`."""

    service: ServiceFit
    prefill: PrefillFit | None
    prefill_note: str
    """Why the prefill speed was not fitted ('' when it was)."""
    records_read: int
    assumed_idle_records: int
    """Usable records without ``queue_wait_ms`` (their wait taken as 0)."""
    skipped: Mapping[str, int] = field(default_factory=dict)
    batching: BatchingFit | None = None
    """The batching engine's fit, for records taken under load (None: every record ran
    alone, the serial fit above)."""
    problems: tuple[str, ...] = ()
    """What the records could not determine or fit well, one message per problem."""
    prefill_queue: PrefillQueueFit | None = None
    """Records under load: the engine's prefill throughput, first come first served."""

    def overrides(self) -> list[str]:
        """``--set`` assignments that apply the fit (4 significant digits); a field the records
        do not identify is left out."""
        batching = self.batching
        out = [f"decodeWeight={_sig(self.service.decode_weight)}"]
        if batching is None:
            out.append(f"serviceTokensPerMs={_sig(self.service.service_tokens_per_ms)}")
        else:
            if batching.service_tokens_per_ms is not None:
                out.append(f"serviceTokensPerMs={_sig(batching.service_tokens_per_ms)}")
            out.append(f"maxBatchRequests={batching.max_batch_requests}")
            if batching.batch_throughput_gain is not None:
                out.append(f"batchThroughputGain={_sig(batching.batch_throughput_gain)}")
        if self.prefill is not None:
            out.append(f"prefillTokensPerMs={_sig(self.prefill.prefill_tokens_per_ms)}")
        return out

    def to_json(self) -> dict[str, object]:
        return {
            "records_read": self.records_read,
            "records_used": self.service.records_used,
            "skipped": dict(self.skipped),
            "assumed_idle_records": self.assumed_idle_records,
            "service": asdict(self.service),
            "batching": None if self.batching is None else asdict(self.batching),
            "prefill": None if self.prefill is None else asdict(self.prefill),
            "prefill_note": self.prefill_note,
            "prefill_queue": None if self.prefill_queue is None else asdict(self.prefill_queue),
            "problems": list(self.problems),
            "set": self.overrides(),
        }


def _sig(value: float) -> str:
    return repr(float(f"{value:.4g}"))


@dataclass(frozen=True, slots=True)
class Outcome:
    """The outcome fields of a record that calibration uses (``None`` where absent)."""

    queue_wait_ms: float | None = None
    status_code: int | None = None
    send_lag_ms: float | None = None
    dispatch_ms: float | None = None
    """When the sidecar dispatched it (a record of a request that ran)."""


def read_outcomes(
    path: str | Path, tap: Callable[[Iterable[bytes]], Iterable[bytes]] | None = None
) -> dict[str, Outcome]:
    """``queue_wait_ms``, ``status_code``, ``observed.send_lag_ms`` and ``dispatch_ms`` by
    request id, for the records that carry any, from a trace already validated by
    ``read_trace`` (which drops outcome fields; the lines are read as it reads them:
    ``records.open_lines``). ``tap`` wraps the file's lines as they are read (the CLI's
    progress bar counts them there)."""
    outcomes: dict[str, Outcome] = {}
    with open_lines(path) as handle:
        lines: Iterable[bytes] = handle if tap is None else tap(handle)
        for line in lines:
            if not line.strip():
                continue
            data = json.loads(line)
            wait, status = data.get("queue_wait_ms"), data.get("status_code")
            observed = data.get("observed")
            lag = observed.get("send_lag_ms") if isinstance(observed, dict) else None
            outcome = Outcome(
                _number(wait),
                status if isinstance(status, int) and not isinstance(status, bool) else None,
                _number(lag),
                _number(data.get("dispatch_ms")),
            )
            if outcome != Outcome():
                outcomes[data["request_id"]] = outcome
    return outcomes


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def samples_from_records(
    records: Sequence[TraceRecord], outcomes: Mapping[str, Outcome]
) -> tuple[list[Sample], Counter[str], int]:
    """Usable samples, skip counts by reason, and how many samples assumed no queue wait."""
    samples: list[Sample] = []
    skipped: Counter[str] = Counter()
    assumed_idle = 0
    for record in records:
        outcome = outcomes.get(record.request.request_id, Outcome())
        if outcome.status_code is not None and outcome.status_code != STATUS_OK:
            skipped[NOT_ADMITTED] += 1
            continue
        if record.e2e_ms is None:
            skipped[NO_E2E] += 1
            continue
        prefill, decode = record.actual_prefill_tokens, record.actual_decode_tokens
        if prefill is None or decode is None:
            skipped[NO_ACTUAL_TOKENS] += 1
            continue
        if prefill + decode == 0:
            skipped[NO_TOKENS] += 1
            continue
        wait_ms = 0.0 if outcome.queue_wait_ms is None else outcome.queue_wait_ms
        wait_ms += outcome.send_lag_ms or 0.0
        execution_ms = record.e2e_ms - wait_ms
        if execution_ms <= 0:
            skipped[NOT_POSITIVE] += 1
            continue
        assumed_idle += outcome.queue_wait_ms is None
        prefill_ms = None
        if record.ttft_ms is not None and record.ttft_ms < NOT_STREAMED_RATIO * record.e2e_ms:
            prefill_ms = record.ttft_ms - wait_ms
        span = _span(record, outcome)
        samples.append(Sample(prefill, decode, execution_ms, prefill_ms, span))
    return samples, skipped, assumed_idle


def _span(record: TraceRecord, outcome: Outcome) -> tuple[float, float] | None:
    """The run ``(arrival + send lag + queue wait, arrival + e2e)`` of a live record that ran
    (status 200, or dispatched and then cut), None otherwise."""
    e2e_ms = record.e2e_ms
    if outcome.status_code is None or e2e_ms is None:
        return None
    if outcome.status_code != STATUS_OK and outcome.dispatch_ms is None:
        return None
    arrival_ms = record.request.arrival_ms
    start_ms = arrival_ms + (outcome.send_lag_ms or 0.0) + (outcome.queue_wait_ms or 0.0)
    end_ms = arrival_ms + e2e_ms
    return (start_ms, end_ms) if end_ms >= start_ms else None


def run_spans(
    records: Sequence[TraceRecord], outcomes: Mapping[str, Outcome]
) -> list[tuple[float, float]]:
    """The runs of every live record that ran, usable for the fit or not (a request without
    reported usage, or cut short, held the engine all the same): the concurrency's sweep."""
    spans = []
    for record in records:
        span = _span(record, outcomes.get(record.request.request_id, Outcome()))
        if span is not None:
            spans.append(span)
    return spans


@dataclass(frozen=True, slots=True)
class _Normal:
    """Weighted sums of the normal equations, and their solution ``(a, b)``."""

    spp: float
    spd: float
    sdd: float
    a: float
    b: float

    @property
    def det(self) -> float:
        return self.spp * self.sdd - self.spd * self.spd


def _solve(samples: Sequence[Sample], weights: Sequence[float]) -> _Normal:
    spp = spd = sdd = spy = sdy = 0.0
    for s, w in zip(samples, weights, strict=True):
        p, d, y = float(s.prefill_tokens), float(s.decode_tokens), s.execution_ms
        spp += w * p * p
        spd += w * p * d
        sdd += w * d * d
        spy += w * p * y
        sdy += w * d * y
    if spp == 0 or sdd == 0:
        which = "prompt" if spp == 0 else "output"
        raise CalibrationError(f"every usable record has an empty {which}; w cannot be fitted")
    independence = 1.0 - spd * spd / (spp * sdd)
    if independence < COLLINEARITY_LIMIT:
        raise CalibrationError(
            "prompt and output lengths are (nearly) proportional across the records "
            f"(1 - cos^2 = {independence:.2e}); prefill and decode cost cannot be told apart - "
            "collect records with varied prompt/output ratios"
        )
    det = spp * sdd - spd * spd
    a = (spy * sdd - sdy * spd) / det
    b = (sdy * spp - spy * spd) / det
    if a <= 0 or b <= 0:
        raise CalibrationError(
            f"degenerate fit: ms per prefill token {a:.4g}, ms per decode token {b:.4g}; both "
            "must be > 0 (are the times execution times, and the token counts actual?)"
        )
    return _Normal(spp, spd, sdd, a, b)


def fit_service(
    samples: Sequence[Sample],
    min_records: int = DEFAULT_MIN_RECORDS,
    max_relative_stderr: float = DEFAULT_MAX_RELATIVE_STDERR,
) -> ServiceFit:
    """Weighted least squares ``execution_ms = a*p + b*d`` (module docstring); refuses
    degenerate data."""
    n = len(samples)
    if n < max(min_records, 3):
        raise CalibrationError(
            f"only {n} usable record(s); at least {max(min_records, 3)} are needed"
        )
    weights = [1.0] * n
    fit = _solve(samples, weights)
    for _ in range(REWEIGHT_STEPS):
        weights = [(fit.a * s.prefill_tokens + fit.b * s.decode_tokens) ** -2 for s in samples]
        fit = _solve(samples, weights)
    a, b = fit.a, fit.b
    fitted = [a * s.prefill_tokens + b * s.decode_tokens for s in samples]
    residuals = [s.execution_ms - f for s, f in zip(samples, fitted, strict=True)]
    # Sandwich covariance M^-1 B M^-1 (HC1): M the weighted normal matrix, B = sum of
    # (w e)^2 x x'; honest whatever the noise's true shape.
    b_pp = b_pd = b_dd = 0.0
    for s, w, e in zip(samples, weights, residuals, strict=True):
        we_sq = (w * e) ** 2
        b_pp += we_sq * s.prefill_tokens**2
        b_pd += we_sq * s.prefill_tokens * s.decode_tokens
        b_dd += we_sq * s.decode_tokens**2
    i_pp, i_pd, i_dd = fit.sdd / fit.det, -fit.spd / fit.det, fit.spp / fit.det  # M^-1
    scale = n / (n - 2)
    var_a = scale * (i_pp * (i_pp * b_pp + i_pd * b_pd) + i_pd * (i_pp * b_pd + i_pd * b_dd))
    var_b = scale * (i_pd * (i_pd * b_pp + i_dd * b_pd) + i_dd * (i_pd * b_pd + i_dd * b_dd))
    cov_ab = scale * (i_pp * (i_pd * b_pp + i_dd * b_pd) + i_pd * (i_pd * b_pd + i_dd * b_dd))
    rel_rate = math.sqrt(var_a) / a  # rate = 1/a: relative errors of a and rate agree
    weight = b / a
    rel_weight = math.sqrt(max(0.0, var_b / b**2 + var_a / a**2 - 2 * cov_ab / (a * b)))
    if max(rel_rate, rel_weight) > max_relative_stderr:
        raise CalibrationError(
            f"fit too uncertain: relative standard error of decode_weight {rel_weight:.1%}, "
            f"of the service rate {rel_rate:.1%} (limit {max_relative_stderr:.0%}); "
            + records_needed(n, max(rel_rate, rel_weight), max_relative_stderr)
            + "; collect more records or records with more varied prompt/output lengths"
        )
    rss = sum(r * r for r in residuals)
    mean_y = sum(s.execution_ms for s in samples) / n
    tss = sum((s.execution_ms - mean_y) ** 2 for s in samples)
    relative_sq = sum((r / f) ** 2 for r, f in zip(residuals, fitted, strict=True))
    return ServiceFit(
        decode_weight=weight,
        decode_weight_stderr=weight * rel_weight,
        service_tokens_per_ms=1.0 / a,
        service_tokens_per_ms_stderr=rel_rate / a,
        ms_per_prefill_token=a,
        ms_per_decode_token=b,
        r_squared=1.0 - rss / tss if tss > 0 else 1.0,
        residual_rms_ms=math.sqrt(rss / n),
        residual_rms_relative=math.sqrt(relative_sq / n),
        records_used=n,
    )


def fit_prefill(
    samples: Sequence[Sample], floor_ms: float, min_records: int = DEFAULT_MIN_RECORDS
) -> PrefillFit | str:
    """Prefill speed from TTFTs above the floor (module docstring), or why it cannot be fitted."""
    timed = [s for s in samples if s.prefill_ms is not None and s.prefill_tokens > 0]
    if len(timed) < max(min_records, 3):
        return f"only {len(timed)} usable record(s) with a first-token ttft_ms"
    # Start from the records whose TTFT clears the floor, then select on prompt length only.
    selected = [s for s in timed if (s.prefill_ms or 0.0) > PREFILL_FLOOR_MARGIN * floor_ms]
    for _ in range(50):
        if len(selected) < max(min_records, 3):
            return (
                f"only {len(selected)} record(s) with prompts long enough to clear the "
                f"{floor_ms:g} ms prefill floor"
            )
        ratios = [(s.prefill_ms or 0.0) / s.prefill_tokens for s in selected]
        ms_per_token = statistics.fmean(ratios)
        if ms_per_token <= 0:
            return "the TTFTs do not grow with the prompt length"
        threshold_tokens = PREFILL_FLOOR_MARGIN * floor_ms / ms_per_token
        again = [s for s in timed if s.prefill_tokens >= threshold_tokens]
        if again == selected:
            break
        selected = again
    n = len(selected)
    ys = [s.prefill_ms or 0.0 for s in selected]
    residuals = [y - ms_per_token * s.prefill_tokens for y, s in zip(ys, selected, strict=True)]
    rss = sum(r * r for r in residuals)
    mean_y = sum(ys) / n
    tss = sum((y - mean_y) ** 2 for y in ys)
    relative_stderr = statistics.stdev(ratios) / math.sqrt(n) / ms_per_token
    return PrefillFit(
        prefill_tokens_per_ms=1.0 / ms_per_token,
        prefill_tokens_per_ms_stderr=relative_stderr / ms_per_token,
        prefill_floor_ms=floor_ms,
        r_squared=1.0 - rss / tss if tss > 0 else 1.0,
        residual_rms_ms=math.sqrt(rss / n),
        records_used=n,
    )


def calibrate(
    records: Sequence[TraceRecord],
    outcomes: Mapping[str, Outcome] | None = None,
    *,
    min_records: int = DEFAULT_MIN_RECORDS,
    max_relative_stderr: float = DEFAULT_MAX_RELATIVE_STDERR,
    prefill_floor_ms: float = DEFAULT_PREFILL_FLOOR_MS,
    max_batch_requests: int | None = None,
) -> Calibration:
    """Fit the service model (and the prefill speed when TTFTs allow) to ``records``: the
    serial server's when every record ran alone or ``max_batch_requests`` is 1 (a serial
    engine that the sidecar keeps one request staged for shows two at once), else a batching
    engine's (:mod:`tokenfair.sim.batchfit`) priced at ``max_batch_requests`` requests at once
    (default: the most the records show)."""
    outcomes = outcomes or {}
    samples, skipped, assumed_idle = samples_from_records(records, outcomes)
    profile = ConcurrencyProfile(run_spans(records, outcomes))
    loaded = any(
        sample.span is not None and profile.mean(*sample.span) > 1.0 + LOADED_MARGIN
        for sample in samples
    )
    problems: list[str] = []
    batching: BatchingFit | None = None
    try:
        if not loaded or max_batch_requests == 1:
            service = fit_service(samples, min_records, max_relative_stderr)
            if max_batch_requests is not None and max_batch_requests > 1:
                problems.append(
                    f"every record ran alone: the throughput of {max_batch_requests} requests "
                    "at once is not identified (serviceTokensPerMs is one request's speed "
                    "alone); collect records taken under load"
                )
        else:
            batching, service = _fit_loaded(
                samples, profile, min_records, max_relative_stderr, max_batch_requests
            )
            problems.extend(batching.problems)
    except CalibrationError as exc:
        counts = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        raise CalibrationError(
            f"{exc} ({len(records)} record(s) read, {len(samples)} usable"
            + (f"; skipped: {counts})" if counts else ")")
            + (_records_show(samples, profile) if loaded and max_batch_requests != 1 else "")
        ) from None
    note = ""
    queue: PrefillQueueFit | None = None
    if batching is not None:
        fitted = fit_prefill_queue(samples, prefill_floor_ms, min_records)
        if isinstance(fitted, str):
            problems.append(fitted)
        else:
            queue = fitted
        samples, note = _prefill_alone(samples, profile, batching)
    prefill = fit_prefill(samples, prefill_floor_ms, min_records)
    if note and isinstance(prefill, PrefillFit):
        problems.append(note)
    return Calibration(
        service=service,
        prefill=prefill if isinstance(prefill, PrefillFit) else None,
        prefill_note=prefill if isinstance(prefill, str) else "",
        records_read=len(records),
        assumed_idle_records=assumed_idle,
        skipped=dict(sorted(skipped.items())),
        batching=batching,
        problems=tuple(problems),
        prefill_queue=queue,
    )


QUEUE_SPEEDS: Final = (0.01, 100_000.0)
"""The prompt tokens per ms :func:`fit_prefill_queue` searches between."""
QUEUE_STEPS: Final = 80
"""Golden-section steps of the search of ``ln P`` (each narrows the range by 0.618: to ~1e-16)."""
OVERHEAD_STEPS: Final = 30
"""Golden-section steps of the search of the overhead (to ~5e-7 of its range), each searching
``ln P`` in :data:`OVERHEAD_SPEED_STEPS` (the best overhead's ``P`` then in :data:`QUEUE_STEPS`)."""
OVERHEAD_SPEED_STEPS: Final = 40
"""The steps of ``ln P``'s search within the overhead's (to ~4e-9 of its range)."""
QUEUE_FLAT: Final = 1e-9
"""A loss within this (relative) of an instant prefill's is no better than it: ``P`` is not
identified."""
QUEUE_BOUND_MARGIN: Final = 1e-6
"""A best ``ln P`` this close to the search's lower bound is that bound, not a fit."""


def _golden(loss: Callable[[float], float], low: float, high: float, steps: int) -> float:
    """The minimum of ``loss`` over ``[low, high]`` by golden-section search (one minimum
    assumed), each step one evaluation."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    left, right = high - ratio * (high - low), low + ratio * (high - low)
    at_left, at_right = loss(left), loss(right)
    for _ in range(steps):
        if at_left < at_right:
            high, right, at_right = right, left, at_left
            left = high - ratio * (high - low)
            at_left = loss(left)
        else:
            low, left, at_left = left, right, at_right
            right = low + ratio * (high - low)
            at_right = loss(right)
    return (low + high) / 2.0


def fit_prefill_queue(
    samples: Sequence[Sample], floor_ms: float, min_records: int = DEFAULT_MIN_RECORDS
) -> PrefillQueueFit | str | None:
    """The prefill throughput ``P`` and per-prompt overhead ``o`` of an engine that prefills
    the prompts it starts first come first served: a record started (dispatched) at ``t`` with
    a prompt of ``p`` tokens (the engine's count) has its first token at ``max(t + floor,
    done)``, ``done = max(t, done of the one started before it) + o + p / P``; ``P`` and ``o``
    minimise the squared ``ln(observed / predicted)`` of the times to the first token
    (``ttft_ms - queue wait``) over the records under load that have one: ``o`` by a
    golden-section search between 0 and the quickest first token observed (no prompt alone
    comes sooner than its overhead), ``P`` at each ``o`` by one over :data:`QUEUE_SPEEDS` (the
    loss being smooth in ``ln P`` away from the floor), and ``o = 0`` kept where it fits as well
    (the queue of the tokens alone). A wave of long prompts started together delays a first
    token behind them by all of their prefill, which a slowdown by the concurrency alone does
    not (docs/capacity.md); the overhead is each prompt's engine step (its fixed cost and the
    running batch's decode in it), which a throughput alone reads as a slower ``P`` from the
    short prompts, and then replays a wave of long ones too slowly. None: fewer than
    ``min_records`` such records. A string: why ``P`` is not identified: the fit of the tokens
    alone (``o = 0``) sits on the search's lower bound (or that bound's loss is less than the
    search's best: it assumes one minimum), or an instant prefill explains the first tokens as
    well as the best ``P`` (every prediction at the floor, or at the overhead, from some ``P``
    on: the loss is flat up to the upper bound, where the search would end)."""
    rows = sorted(
        (s.span[0], s.prefill_tokens, s.prefill_ms)
        for s in samples
        if s.span is not None and s.prefill_ms is not None and s.prefill_ms > 0.0
    )
    if len(rows) < max(min_records, 3):
        return None

    def loss(log_speed: float, overhead_ms: float) -> float:
        speed = math.exp(log_speed)
        done = -math.inf
        total = 0.0
        for start, prompt, observed in rows:
            done = (done if done > start else start) + overhead_ms + prompt / speed
            predicted = max(floor_ms, done - start, 1e-9)
            total += math.log(observed / predicted) ** 2
        return total

    low, high = math.log(QUEUE_SPEEDS[0]), math.log(QUEUE_SPEEDS[1])

    def speed_at(overhead_ms: float, steps: int = QUEUE_STEPS) -> tuple[float, float]:
        best = _golden(lambda x: loss(x, overhead_ms), low, high, steps)
        return best, loss(best, overhead_ms)

    plain, plain_loss = speed_at(0.0)
    # (The search assumes one minimum: where the loss is flat over the fast speeds, it walks
    # to the upper bound even when the lower bound's loss is less.) Checked on the queue of
    # the tokens alone: an overhead refines a throughput the first tokens show, it does not
    # stand in for one (a constant of seconds would "fit" first tokens no queue explains).
    if plain - low < QUEUE_BOUND_MARGIN or loss(low, 0.0) < plain_loss:
        return (
            f"engine prefill not identified: the best fit of {len(rows)} first tokens is the "
            f"search's lower bound, {QUEUE_SPEEDS[0]:g} prompt tokens/ms (first tokens slower "
            "than any first-come-first-served prefill of these prompts explains)"
        )
    quickest = min(observed for _, _, observed in rows)
    overhead = _golden(
        lambda o: speed_at(o, OVERHEAD_SPEED_STEPS)[1], 0.0, quickest, OVERHEAD_STEPS
    )
    best, best_loss = speed_at(overhead)
    if plain_loss <= best_loss:
        overhead, best, best_loss = 0.0, plain, plain_loss
    instant = loss(high, overhead)
    if best_loss >= instant - QUEUE_FLAT * max(1.0, instant):
        return (
            f"engine prefill not identified: {len(rows)} first tokens are explained as well by "
            f"an instant prefill (each at the {floor_ms:g} ms prefill floor, or no closer to "
            "the queue's prediction at any speed): no prompt's prefill delayed a first token "
            "measurably; the records give no speed to replay"
        )
    return PrefillQueueFit(math.exp(best), math.sqrt(best_loss / len(rows)), len(rows), overhead)


def _records_show(samples: Sequence[Sample], profile: ConcurrencyProfile) -> str:
    """What the usable records of a refused batching fit show, so that the user can tell what
    to collect: the spread of their concurrency and of their prompt/output ratios."""
    seen = sorted(profile.mean(*s.span) for s in samples if s.span is not None)
    ratios = sorted(s.prefill_tokens / s.decode_tokens for s in samples if s.decode_tokens)
    if not seen or not ratios:
        return ""
    low, high = seen[0], seen[-1]
    p10, p90 = seen[len(seen) // 10], seen[(9 * len(seen)) // 10]
    return (
        f"; the usable records ran at {low:.2f} to {high:.2f} requests at once (p10 {p10:.2f}, "
        f"p90 {p90:.2f}) with prompt/output ratios {ratios[0]:.3g} to {ratios[-1]:.3g}: the fit "
        "needs both spread (a ramp of load from one request at a time to the full batch, "
        "varied lengths) and run times steady enough to separate them"
    )


LOADED_MARGIN: Final = 1e-6
"""A record whose time-averaged concurrency passes 1 by more than this ran beside others."""


def _fit_loaded(
    samples: Sequence[Sample],
    profile: ConcurrencyProfile,
    min_records: int,
    max_relative_stderr: float,
    max_batch_requests: int | None,
) -> tuple[BatchingFit, ServiceFit]:
    """The batching fit of records taken under load, and its :class:`ServiceFit` view (the
    decode weight, the throughput at the full batch — or at the concurrency seen, when the
    full batch's is not identified — and the fit's quality)."""
    n = len(samples)
    if n < max(min_records, 4):
        raise CalibrationError(
            f"only {n} usable record(s); at least {max(min_records, 4)} are needed"
        )
    for which, total in (
        ("prompt", sum(s.prefill_tokens for s in samples)),
        ("output", sum(s.decode_tokens for s in samples)),
    ):
        if total == 0:
            raise CalibrationError(f"every usable record has an empty {which}; w cannot be fitted")
    runs = [Run(s.prefill_tokens, s.decode_tokens, s.execution_ms, s.span) for s in samples]
    try:
        fit = fit_batching(runs, profile, max_batch_requests, max_relative_stderr)
    except BatchingFitError as exc:
        raise CalibrationError(str(exc)) from None
    if fit.service_tokens_per_ms is not None and fit.service_tokens_per_ms_stderr is not None:
        rate, rate_stderr = fit.service_tokens_per_ms, fit.service_tokens_per_ms_stderr
    else:
        rate = fit.throughput_at_seen_concurrency
        rate_stderr = fit.throughput_at_seen_concurrency_stderr
    service = ServiceFit(
        decode_weight=fit.decode_weight,
        decode_weight_stderr=fit.decode_weight_stderr,
        service_tokens_per_ms=rate,
        service_tokens_per_ms_stderr=rate_stderr,
        ms_per_prefill_token=fit.ms_per_service_token,
        ms_per_decode_token=fit.ms_per_service_token * fit.decode_weight,
        r_squared=fit.r_squared,
        residual_rms_ms=fit.residual_rms_ms,
        residual_rms_relative=fit.residual_rms_relative,
        records_used=fit.records_used,
    )
    return fit, service


def _prefill_alone(
    samples: Sequence[Sample], profile: ConcurrencyProfile, fit: BatchingFit
) -> tuple[list[Sample], str]:
    """The samples with their prefill times as if alone: each divided by the fitted slowdown
    at its dispatch, ``v(1) / v(c)`` with ``c`` the requests running once it started (the
    simulator's rule for the first token, inverted). Unchanged, with a note, when the
    slowdown is not identified."""
    if fit.slowdown(1) is None:
        note = (
            "prefillTokensPerMs is fitted from TTFTs taken under load without removing the "
            "slowdown of the requests running beside (not identified without a spread of "
            "concurrency): it underestimates the prefill speed alone"
        )
        return list(samples), note
    out = []
    for sample in samples:
        if sample.prefill_ms is not None and sample.span is not None:
            slowdown = fit.slowdown(profile.at(sample.span[0])) or 1.0
            sample = replace(sample, prefill_ms=sample.prefill_ms / slowdown)
        out.append(sample)
    return out, ""
