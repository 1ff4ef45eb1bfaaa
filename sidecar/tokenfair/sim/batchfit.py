"""Fit a batching engine (:mod:`tokenfair.core.batching`) to records taken under load.

The model. A request of ``p`` prompt and ``d`` output tokens is ``s = p + w d`` service tokens;
while ``c`` requests run, each advances at ``v(c) = 1 / (A + b (c - 1))`` service tokens per ms
(``A = 1 / v(1)``: one request alone; ``b``: what each other request running beside it adds).
Over its run the concurrency changes, and the run takes exactly::

    run_ms = s * (A + b * (c̃ - 1))            c̃ = ∫ c v(c) dt / ∫ v(c) dt over the run

(:mod:`tokenfair.sim.concurrency`: ``c̃`` is the concurrency averaged over the service the
request received). Three coefficients, ``A``, ``b`` and ``w``, fitted by Gauss-Newton on the
relative error (weights ``1 / fitted²``, as the serial fit), starting from the serial fit's
``w`` and a linear fit of ``run_ms`` on ``[s, s (c̄ - 1)]`` with ``c̄`` the time-averaged
concurrency; ``c̃`` is recomputed from the current ``A`` and ``b`` at every step (it moves little:
``c̃ = c̄`` when ``b = 0``). The policy's fields follow, for the ``S`` the user states (default: the
most requests the records show running at once)::

    maxBatchRequests     = S
    serviceTokensPerMs   = X(S) = S / (A + b (S - 1))          (R)
    batchThroughputGain  = X(S) / X(1) = S A / (A + b (S - 1))  (G, in [1, S])
    decodeWeight         = w

Standard errors: the sandwich of the weighted fit, ``M^-1 B M^-1 * n / (n - k)`` (``M = Σ v j
j'``, ``B = Σ (v e)² j j'``, ``j`` a record's row of the Jacobian), and the delta method for ``R``
and ``G``.

What cannot be fitted, said once each (:attr:`BatchingFit.problems`), with what was fitted
instead:

* **no spread of concurrency** — the runs' concurrency hardly varies (the columns ``s`` and ``s (c̃
  - 1)`` nearly collinear, or ``G``'s relative standard error above the limit): ``A`` and ``b``
  cannot be told apart. Fitted: ``w`` and the per-request speed at the concurrency seen, ``c0``
  (the service-weighted mean); ``serviceTokensPerMs = X(c0)`` when ``S`` is ``c0`` rounded (a
  saturated engine), unidentified otherwise; ``batchThroughputGain`` unidentified;
* **a negative slope** (``b < 0``: requests run faster beside others) — refitted with ``b = 0``
  (``G = S``); **throughput falling with concurrency** (``A < b``: ``G < 1``) — refitted with
  ``A = b`` (``G = 1``). Either is a problem only beyond :data:`SIGNIFICANCE` standard errors:
  an engine whose gain *is* 1 or ``S`` fits just past it half the time;
* **a poor fit** — ``R²`` below :data:`MIN_R_SQUARED`.

Refused (:class:`~tokenfair.sim.calibrate.CalibrationError`): fewer records than asked, a
non-positive ``A`` or ``w``, a fit that does not converge, relative standard errors of ``w`` or
``R`` above the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfair.sim.concurrency import ConcurrencyProfile

MIN_R_SQUARED = 0.9
"""Below this ``R²`` the batching model explains too little of the run times to be trusted."""
COLLINEARITY_LIMIT = 1e-6
"""Smallest ``1 - cos²`` between the columns ``s`` and ``s (c̃ - 1)`` that separates ``A`` from
``b`` (the serial fit's limit for its two columns)."""
SIGNIFICANCE = 2.0
"""A coefficient past its bound (``b < 0``, ``A < b``) by more than this many standard errors
is reported as a problem; within them it is the bound itself, fitted quietly."""
MAX_STEPS = 100
"""Gauss-Newton steps before the fit is declared not to converge."""
TOLERANCE = 1e-10
"""A step smaller than this, relative to every coefficient, has converged."""
CONCURRENCY_TOLERANCE = 1e-9
"""A round that moves no run's ``c̃`` by more than this has converged."""
SPEED_FLOOR = 1e-12
"""Floor of ``A + b (c - 1)`` when computing ``c̃`` during the iterations (a slope going negative
on the way must not divide by zero)."""

MODE_FREE = "free"
MODE_CONSTANT = "constant"  # b = 0: every request at v(1), G = S (or: no spread, at v(c0))
MODE_SHARED = "shared"  # A = b: a throughput shared by the batch, G = 1


class BatchingFitError(ValueError):
    """The records cannot support a batching fit (the message says why)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One usable record: its service's parts and its run."""

    prefill_tokens: int
    decode_tokens: int
    run_ms: float
    span: tuple[float, float] | None
    """``(dispatch_ms, end_ms)``; None for a record that ran alone (a probe)."""


@dataclass(frozen=True, slots=True)
class BatchingFit:
    """The fitted engine and how well it fits (module docstring)."""

    max_batch_requests: int
    max_batch_requests_given: bool
    decode_weight: float
    decode_weight_stderr: float
    request_service_tokens_per_ms: float | None
    """``v(1) = 1 / A``, one request alone (None when not identified)."""
    request_service_tokens_per_ms_stderr: float | None
    ms_per_service_token: float
    """``A``, or the per-request ms per service token at ``c0`` without a spread."""
    ms_per_service_token_per_request: float | None
    """``b``: what each other running request adds to a request's ms per service token."""
    ms_per_service_token_per_request_stderr: float | None
    service_tokens_per_ms: float | None
    """``R = X(S)``, None when not identified."""
    service_tokens_per_ms_stderr: float | None
    batch_throughput_gain: float | None
    """``G = X(S) / X(1)``, None when not identified."""
    batch_throughput_gain_stderr: float | None
    throughput_at_seen_concurrency: float
    """``X(c0)``: the engine's throughput at the records' typical concurrency ``c0``."""
    throughput_at_seen_concurrency_stderr: float
    seen_concurrency: float
    """``c0``: the records' concurrency, averaged over their service."""
    concurrency_min: float
    concurrency_max: float
    peak_concurrency: int
    """The most requests a used record ran with, its time-averaged concurrency rounded: the
    default ``S``. (Not the sweep's momentary peak: a record's end is stamped when its last
    bytes are out, a little after the engine freed its slot for the next, and a sweep of live
    records shows one more at every hand-over for a moment.)"""
    runs_swept: int
    """Records whose run counted towards the concurrency."""
    r_squared: float
    residual_rms_ms: float
    residual_rms_relative: float
    records_used: int
    mode: str
    problems: tuple[str, ...]
    unidentified: tuple[str, ...]
    """Policy fields the records do not determine (left out of the ``--set`` flags)."""

    def slowdown(self, running: int) -> float | None:
        """``v(1) / v(c)`` at ``c = running`` (clamped to ``[1, S]``); None if unknown."""
        slope = self.ms_per_service_token_per_request
        if slope is None:
            return None
        c = min(max(running, 1), self.max_batch_requests)
        base = self.ms_per_service_token
        return (base + slope * (c - 1)) / base


def _solve(
    rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]
) -> tuple[list[float], list[list[float]]]:
    """Weighted least squares: ``theta`` solving ``(X' V X) theta = X' V y`` and the inverse of
    ``X' V X`` (Gauss-Jordan with partial pivoting on the columns scaled to unit diagonal)."""
    k = len(rows[0])
    normal = [[0.0] * k for _ in range(k)]
    right = [0.0] * k
    for row, y, v in zip(rows, ys, weights, strict=True):
        for i in range(k):
            vi = v * row[i]
            right[i] += vi * y
            for j in range(i, k):
                normal[i][j] += vi * row[j]
    for i in range(k):
        for j in range(i):
            normal[i][j] = normal[j][i]
    scale = [1.0 / math.sqrt(normal[i][i]) if normal[i][i] > 0 else 1.0 for i in range(k)]
    work = [
        [normal[i][j] * scale[i] * scale[j] for j in range(k)] + [float(i == j) for j in range(k)]
        for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(work[r][col]))
        if abs(work[pivot][col]) < 1e-14:
            raise BatchingFitError("the fit's normal equations are singular")
        work[col], work[pivot] = work[pivot], work[col]
        head = work[col][col]
        work[col] = [x / head for x in work[col]]
        for r in range(k):
            if r != col and work[r][col] != 0.0:
                factor = work[r][col]
                work[r] = [x - factor * y for x, y in zip(work[r], work[col], strict=True)]
    inverse = [[work[i][k + j] * scale[i] * scale[j] for j in range(k)] for i in range(k)]
    theta = [sum(inverse[i][j] * right[j] for j in range(k)) for i in range(k)]
    return theta, inverse


def _independence(xs: Sequence[float], zs: Sequence[float], weights: Sequence[float]) -> float:
    """``1 - cos²`` of two columns under ``weights`` (0: proportional)."""
    sxx = sum(v * x * x for x, v in zip(xs, weights, strict=True))
    szz = sum(v * z * z for z, v in zip(zs, weights, strict=True))
    sxz = sum(v * x * z for x, z, v in zip(xs, zs, weights, strict=True))
    if sxx <= 0 or szz <= 0:
        return 0.0
    return 1.0 - sxz * sxz / (sxx * szz)


@dataclass(slots=True)
class _State:
    """One Gauss-Newton solution: coefficients, the rows it was solved on, its covariance."""

    base: float  # A
    slope: float  # b
    weight: float  # w
    extra: list[float]  # c̃ - 1 per run
    fitted: list[float]
    residuals: list[float]
    weights: list[float]
    jacobian: list[list[float]]
    covariance: list[list[float]]


def _speed(base: float, slope: float) -> Callable[[int], float]:
    def speed(c: int) -> float:
        if c < 1:
            return 0.0  # the engine idle (no run is averaged over it; and 1 / (A - b) may be huge)
        return 1.0 / max(base + slope * (c - 1), SPEED_FLOOR)

    return speed


def _extra_concurrency(
    runs: Sequence[Run],
    profile: ConcurrencyProfile,
    spans: list[tuple[float, float]],
    positions: list[int],
    base: float,
    slope: float,
) -> list[float]:
    """``c̃ - 1`` of each run at the speeds ``base, slope`` (0 for a run alone)."""
    extra = [0.0] * len(runs)
    means = profile.service_means(spans, _speed(base, slope))
    for position, mean in zip(positions, means, strict=True):
        extra[position] = max(0.0, mean - 1.0)
    return extra


def _gauss_newton(
    runs: Sequence[Run],
    profile: ConcurrencyProfile,
    mode: str,
    base: float,
    slope: float,
    weight: float,
) -> _State:
    """Minimise the weighted relative error of ``run_ms = s (A + b u)``, ``u = c̃ - 1``, over
    the coefficients free in ``mode`` (``free``: A, b, w; ``constant``: A, w with b = 0;
    ``shared``: A, w with b = A). Two loops: inside, Gauss-Newton with ``u`` fixed (and the
    weights ``1 / fitted²`` renewed at each step) to convergence; outside, ``u`` recomputed at
    the new speeds, until it stops moving (``c̃`` depends on ``A`` and ``b`` only through the
    ratio of the speeds at different concurrencies: a few rounds)."""
    spans = [run.span for run in runs if run.span is not None]
    positions = [i for i, run in enumerate(runs) if run.span is not None]
    ys = [run.run_ms for run in runs]
    if mode == MODE_CONSTANT:
        slope = 0.0
    elif mode == MODE_SHARED:
        slope = base
    extra = _extra_concurrency(runs, profile, spans, positions, base, slope)
    for _round in range(MAX_STEPS):
        for _step in range(MAX_STEPS):
            fitted: list[float] = []
            jacobian: list[list[float]] = []
            for run, u in zip(runs, extra, strict=True):
                service = run.prefill_tokens + weight * run.decode_tokens
                per_token = base + slope * u
                fitted.append(service * per_token)
                if mode == MODE_FREE:
                    jacobian.append([service, service * u, run.decode_tokens * per_token])
                elif mode == MODE_CONSTANT:
                    jacobian.append([service, run.decode_tokens * per_token])
                else:
                    jacobian.append([service * (1.0 + u), run.decode_tokens * per_token])
            weights = [1.0 / (f * f) if f > 0 else 0.0 for f in fitted]
            residuals = [y - f for y, f in zip(ys, fitted, strict=True)]
            step, inverse = _solve(jacobian, residuals, weights)
            base += step[0]
            if mode == MODE_FREE:
                slope += step[1]
            elif mode == MODE_SHARED:
                slope = base
            weight += step[-1]
            if base <= 0 or weight <= 0:
                raise BatchingFitError(
                    f"degenerate fit: ms per service token alone {base:.4g}, decode weight "
                    f"{weight:.4g}; both must be > 0 (are the times run times, and the token "
                    "counts actual?)"
                )
            changes = [abs(step[0]) / base, abs(step[-1]) / weight]
            if mode == MODE_FREE:
                changes.append(abs(step[1]) / max(abs(slope), base * 1e-6))
            if max(changes) < TOLERANCE:
                break
        else:
            raise BatchingFitError(f"the batching fit did not converge in {MAX_STEPS} steps")
        moved = _extra_concurrency(runs, profile, spans, positions, base, slope)
        shift = max((abs(a - b) for a, b in zip(moved, extra, strict=True)), default=0.0)
        extra = moved
        if shift < CONCURRENCY_TOLERANCE:
            break
    else:
        raise BatchingFitError(
            f"the batching fit did not converge in {MAX_STEPS} rounds of the concurrency"
        )
    if mode == MODE_CONSTANT:
        slope = 0.0
    elif mode == MODE_SHARED:
        slope = base
    # The sandwich at the solution (the last step was below the tolerance).
    k = len(jacobian[0])
    middle = [[0.0] * k for _ in range(k)]
    for row, v, e in zip(jacobian, weights, residuals, strict=True):
        ve_sq = (v * e) ** 2
        for i in range(k):
            for j in range(k):
                middle[i][j] += ve_sq * row[i] * row[j]
    n = len(runs)
    correction = n / (n - k) if n > k else math.inf
    covariance = [
        [
            correction
            * sum(inverse[i][p] * middle[p][q] * inverse[q][j] for p in range(k) for q in range(k))
            for j in range(k)
        ]
        for i in range(k)
    ]
    return _State(base, slope, weight, extra, fitted, residuals, weights, jacobian, covariance)


def _stats(runs: Sequence[Run], state: _State) -> tuple[float, float, float]:
    """``(R², residual RMS ms, relative residual RMS)``."""
    n = len(runs)
    ys = [run.run_ms for run in runs]
    mean_y = sum(ys) / n
    tss = sum((y - mean_y) ** 2 for y in ys)
    rss = sum(e * e for e in state.residuals)
    relative = sum((e / f) ** 2 for e, f in zip(state.residuals, state.fitted, strict=True))
    return (1.0 - rss / tss if tss > 0 else 1.0, math.sqrt(rss / n), math.sqrt(relative / n))


def _initial(runs: Sequence[Run], profile: ConcurrencyProfile) -> tuple[float, float, float, float]:
    """Starting coefficients: ``w`` of the serial fit ``run_ms = x p + y d``, then ``A, b`` of
    ``run_ms`` on ``[s, s (c̄ - 1)]`` with ``c̄`` the time-averaged concurrency; and how
    independent those two columns are (``1 - cos²``; below :data:`COLLINEARITY_LIMIT` the
    concurrency has no spread, and ``A, b`` are those of ``b = 0``)."""
    ys = [run.run_ms for run in runs]
    ones = [1.0] * len(runs)
    serial, _ = _solve([[run.prefill_tokens, run.decode_tokens] for run in runs], ys, ones)
    weight = serial[1] / serial[0] if serial[0] > 0 and serial[1] > 0 else 1.0
    spans = [run.span for run in runs if run.span is not None]
    means = iter(profile.means(spans))
    rows = []
    for run in runs:
        service = run.prefill_tokens + weight * run.decode_tokens
        u = max(0.0, next(means) - 1.0) if run.span is not None else 0.0
        rows.append([service, service * u])
    weights = [1.0 / (y * y) if y > 0 else 0.0 for y in ys]
    spread = _independence([row[0] for row in rows], [row[1] for row in rows], weights)
    base, slope = sum(ys) / sum(row[0] for row in rows), 0.0
    if spread >= COLLINEARITY_LIMIT:
        (fitted_base, fitted_slope), _ = _solve(rows, ys, weights)
        if fitted_base > 0:
            base, slope = fitted_base, fitted_slope
    return base, slope, weight, spread


def _busiest(runs: Sequence[Run], profile: ConcurrencyProfile) -> int:
    """The most requests a run had running at once on average, rounded (at least 1)."""
    spans = [run.span for run in runs if run.span is not None]
    return max([1, *(round(mean) for mean in profile.means(spans))])


def records_needed(records: int, relative_stderr: float, limit: float) -> str:
    """How many records like these would bring a relative standard error under ``limit``: a
    standard error falls as ``1 / sqrt(n)``, so about ``n (error / limit)²``."""
    needed = math.ceil(records * (relative_stderr / limit) ** 2)
    return (
        f"{records} record(s) gave it; about {needed} like them would bring it under the limit "
        "(a standard error falls as 1/sqrt(n))"
    )


def _relative(stderr: float, value: float) -> float:
    return stderr / abs(value) if value else math.inf


def fit_batching(
    runs: Sequence[Run],
    profile: ConcurrencyProfile,
    max_batch_requests: int | None,
    max_relative_stderr: float,
) -> BatchingFit:
    """The batching engine that explains ``runs`` (module docstring). ``max_batch_requests``:
    the ``S`` to price (default: the profile's peak). Raises :class:`BatchingFitError`."""
    given = max_batch_requests is not None
    batch = max_batch_requests if max_batch_requests is not None else _busiest(runs, profile)
    problems: list[str] = []
    unidentified: list[str] = []
    base, slope, weight, spread = _initial(runs, profile)
    mode = MODE_FREE
    gain, gain_stderr = math.nan, math.inf
    if spread >= COLLINEARITY_LIMIT:
        state = _gauss_newton(runs, profile, MODE_FREE, base, slope, weight)
        service = [run.prefill_tokens + state.weight * run.decode_tokens for run in runs]
        spread = _independence(
            service, [s * u for s, u in zip(service, state.extra, strict=True)], state.weights
        )
    else:
        state = _gauss_newton(runs, profile, MODE_CONSTANT, base, 0.0, weight)
    if spread >= COLLINEARITY_LIMIT:
        gain, gain_stderr = _gain(state, batch)
    no_spread = spread < COLLINEARITY_LIMIT or _relative(gain_stderr, gain) > max_relative_stderr
    if not no_spread and state.slope < 0:
        # Past the bound G = S: refitted on it; a problem only if the data insist (beyond
        # SIGNIFICANCE standard errors), not for an engine whose gain is S and a noisy slope.
        slope_stderr = math.sqrt(max(0.0, state.covariance[1][1]))
        if state.slope < -SIGNIFICANCE * slope_stderr:
            problems.append(
                f"negative slope: the fit has requests run faster beside others (b = "
                f"{state.slope:.3g} ± {slope_stderr:.2g} ms per service token per extra "
                f"request); refitted with b = 0, so batchThroughputGain = maxBatchRequests = "
                f"{batch} (every request at its speed alone)"
            )
        state = _gauss_newton(runs, profile, MODE_CONSTANT, state.base, 0.0, state.weight)
        mode = MODE_CONSTANT
    elif not no_spread and state.slope > state.base:
        # Past the bound G = 1 (likewise).
        if gain < 1.0 - SIGNIFICANCE * gain_stderr:
            problems.append(
                "throughput falls as concurrency grows (the fit's slope b "
                f"{state.slope:.3g} is above its base A {state.base:.3g} ms per service token, "
                f"so batchThroughputGain would be {gain:.3g} ± {gain_stderr:.2g} < 1); refitted "
                "with A = b, so batchThroughputGain = 1 (the batch shares one throughput)"
            )
        state = _gauss_newton(runs, profile, MODE_SHARED, state.base, state.base, state.weight)
        mode = MODE_SHARED
    # The records' typical concurrency: c̃ averaged over their service.
    service = [run.prefill_tokens + state.weight * run.decode_tokens for run in runs]
    total = sum(service)
    seen = 1.0 + sum(s * u for s, u in zip(service, state.extra, strict=True)) / total
    extras = [1.0 + u for u in state.extra]
    if no_spread:
        # No spread: the per-request speed at the concurrency seen, nothing about its shape.
        detail = (
            f"its relative standard error {_relative(gain_stderr, gain):.0%} is above "
            f"{max_relative_stderr:.0%}"
            if spread >= COLLINEARITY_LIMIT
            else "the runs' concurrency hardly varies"
        )
        constant = _gauss_newton(runs, profile, MODE_CONSTANT, state.base, 0.0, state.weight)
        unidentified.append("batchThroughputGain")
        saturated = round(seen) == batch
        if not saturated:
            unidentified.append("serviceTokensPerMs")
        problems.append(
            f"no spread of concurrency: the records ran at {min(extras):.2f} to "
            f"{max(extras):.2f} requests at once (mean {seen:.2f}), so the speed alone and the "
            f"slope cannot be told apart ({detail}); batchThroughputGain is not identified"
            + (
                f", serviceTokensPerMs is the throughput at {seen:.2f} requests, right for "
                f"maxBatchRequests {batch} only if the engine ran its full batch"
                if saturated
                else f", nor is serviceTokensPerMs at maxBatchRequests {batch} (the throughput "
                f"at {seen:.2f} requests is {seen / constant.base:.4g} service tokens/ms)"
            )
            + "; collect records at varied load (some at low concurrency, some at full)"
        )
        return _result(
            runs, constant, MODE_CONSTANT, batch, given, seen, extras, profile,
            problems, unidentified, max_relative_stderr, known_shape=False,
        )  # fmt: skip
    return _result(
        runs, state, mode, batch, given, seen, extras, profile,
        problems, unidentified, max_relative_stderr, known_shape=True,
    )  # fmt: skip


def _gain(state: _State, batch: int) -> tuple[float, float]:
    """``G = S A / (A + b (S - 1))`` and its standard error (delta method; free mode)."""
    base, slope = state.base, state.slope
    denominator = base + slope * (batch - 1)
    if denominator <= 0:
        return math.inf, math.inf
    gain = batch * base / denominator
    d_base = batch * slope * (batch - 1) / denominator**2
    d_slope = -batch * base * (batch - 1) / denominator**2
    cov = state.covariance
    variance = d_base**2 * cov[0][0] + 2 * d_base * d_slope * cov[0][1] + d_slope**2 * cov[1][1]
    return gain, math.sqrt(max(0.0, variance))


def _result(
    runs: Sequence[Run],
    state: _State,
    mode: str,
    batch: int,
    given: bool,
    seen: float,
    extras: list[float],
    profile: ConcurrencyProfile,
    problems: list[str],
    unidentified: list[str],
    max_relative_stderr: float,
    *,
    known_shape: bool,
) -> BatchingFit:
    cov = state.covariance
    k = len(cov)
    var_base = cov[0][0]
    var_weight = cov[k - 1][k - 1]
    base, slope, weight = state.base, state.slope, state.weight
    if mode == MODE_FREE:
        var_slope, cov_base_slope = cov[1][1], cov[0][1]
    elif mode == MODE_SHARED:
        var_slope, cov_base_slope = var_base, var_base
    else:
        var_slope = cov_base_slope = 0.0
    denominator = base + slope * (batch - 1)
    rate: float | None = batch / denominator
    # dR/dA = -S / D², dR/dB = -S (S - 1) / D²
    d_base, d_slope = -batch / denominator**2, -batch * (batch - 1) / denominator**2
    rate_var = d_base**2 * var_base + 2 * d_base * d_slope * cov_base_slope + d_slope**2 * var_slope
    rate_stderr: float | None = math.sqrt(max(0.0, rate_var))
    gain: float | None = batch * base / denominator
    gain_stderr: float | None = 0.0
    if mode == MODE_FREE:
        gain, gain_stderr = _gain(state, batch)
    single: float | None = 1.0 / base
    single_stderr: float | None = math.sqrt(max(0.0, var_base)) / base**2
    slope_out: float | None = slope
    slope_stderr: float | None = math.sqrt(max(0.0, var_slope))
    # X(c0) = c0 / (A + b (c0 - 1)): dX/dA = -c0 / D², dX/db = -c0 (c0 - 1) / D².
    seen_denominator = base + slope * (seen - 1.0)
    throughput_seen = seen / seen_denominator
    g_base, g_slope = -seen / seen_denominator**2, -seen * (seen - 1.0) / seen_denominator**2
    throughput_seen_stderr = math.sqrt(
        max(0.0, g_base**2 * var_base + 2 * g_base * g_slope * cov_base_slope
            + g_slope**2 * var_slope)
    )  # fmt: skip
    if not known_shape:
        # base is the ms per service token at the concurrency seen, not alone.
        throughput_seen = seen / base
        throughput_seen_stderr = seen * math.sqrt(max(0.0, var_base)) / base**2
        gain = gain_stderr = single = single_stderr = slope_out = slope_stderr = None
        if "serviceTokensPerMs" in unidentified:
            rate = rate_stderr = None
        else:
            rate, rate_stderr = throughput_seen, throughput_seen_stderr
    rel_weight = _relative(math.sqrt(max(0.0, var_weight)), weight)
    rel_rate = 0.0 if rate is None or rate_stderr is None else _relative(rate_stderr, rate)
    if max(rel_weight, rel_rate) > max_relative_stderr:
        rate_said = (
            f"of serviceTokensPerMs {rel_rate:.1%}"
            if rate is not None
            else "serviceTokensPerMs not identified (no spread of concurrency)"
        )
        raise BatchingFitError(
            f"fit too uncertain: relative standard error of decode_weight {rel_weight:.1%}, "
            f"{rate_said} (limit {max_relative_stderr:.0%}); "
            + records_needed(len(runs), max(rel_weight, rel_rate), max_relative_stderr)
            + "; collect more records or records with more varied prompt/output lengths and load"
        )
    r_squared, rms_ms, rms_relative = _stats(runs, state)
    if r_squared < MIN_R_SQUARED:
        problems.append(
            f"poor fit: R² {r_squared:.3f} is below {MIN_R_SQUARED} (the model explains little "
            f"of the run times; residual RMS {rms_relative:.0%} of the fitted time): check that "
            "the records come from one engine and model, and that their times are complete"
        )
    return BatchingFit(
        max_batch_requests=batch,
        max_batch_requests_given=given,
        decode_weight=weight,
        decode_weight_stderr=weight * rel_weight,
        request_service_tokens_per_ms=single,
        request_service_tokens_per_ms_stderr=single_stderr,
        ms_per_service_token=base,
        ms_per_service_token_per_request=slope_out,
        ms_per_service_token_per_request_stderr=slope_stderr,
        service_tokens_per_ms=rate,
        service_tokens_per_ms_stderr=rate_stderr,
        batch_throughput_gain=gain,
        batch_throughput_gain_stderr=gain_stderr,
        throughput_at_seen_concurrency=throughput_seen,
        throughput_at_seen_concurrency_stderr=throughput_seen_stderr,
        seen_concurrency=seen,
        concurrency_min=min(extras),
        concurrency_max=max(extras),
        peak_concurrency=_busiest(runs, profile),
        runs_swept=profile.runs,
        r_squared=r_squared,
        residual_rms_ms=rms_ms,
        residual_rms_relative=rms_relative,
        records_used=len(runs),
        mode=mode,
        problems=tuple(problems),
        unidentified=tuple(unidentified),
    )
