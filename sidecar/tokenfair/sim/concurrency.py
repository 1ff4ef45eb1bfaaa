"""How many requests an engine ran at once, from the records of what it served.

Each record of a request that ran gives its run, ``[dispatch, end)``. A sweep over the runs'
starts and ends (sorted once, O(n log n)) makes the concurrency a step function ``c(t)`` — the
runs covering ``t``, an end at ``t`` counted before a start at ``t``, so a request that starts
as another ends does not overlap it — and a prefix integral of it. Then, for any span, O(log n):

* :meth:`ConcurrencyProfile.mean`: the time-average ``(1 / T) ∫ c dt`` over the span;
* :meth:`ConcurrencyProfile.at`: ``c`` just after an instant (the requests running once every
  run that starts then has started: a request's concurrency at its dispatch, itself included);
* :meth:`ConcurrencyProfile.service_means`: the average of ``c`` over the *service* a request
  received rather than over time, for engine speeds ``v(c)`` that differ with ``c``:
  ``∫ c v(c) dt / ∫ v(c) dt`` over its run. A request of ``s`` service tokens served at
  ``v(c) = 1 / (A + b (c - 1))`` runs ``T = ∫ (A + b (c - 1)) ds = s (A + b (c̃ - 1))`` with
  ``c̃`` this average, exactly: the fit of :mod:`tokenfair.sim.batchfit` is linear in it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence


class ConcurrencyProfile:
    """The step function ``c(t)`` of the runs given (module docstring)."""

    __slots__ = ("_counts", "_cumulative", "_levels", "_times", "peak", "runs")

    def __init__(self, runs: Iterable[tuple[float, float]]) -> None:
        # (time, +1 start | -1 end): at one instant the ends sort before the starts.
        spans = [(start, end) for start, end in runs if end >= start]
        self.runs = len(spans)
        """The runs swept."""
        events = sorted(
            itertools.chain.from_iterable(((start, 1), (end, -1)) for start, end in spans)
        )
        times: list[float] = []
        counts: list[int] = []  # counts[k]: runs covering [times[k], times[k + 1])
        running = 0
        for time_ms, step in events:
            running += step
            if times and times[-1] == time_ms:
                counts[-1] = running
            else:
                times.append(time_ms)
                counts.append(running)
        self._times = times
        self._counts = counts
        self._levels = [float(c) for c in counts]
        self._cumulative = self._integral(float)
        self.peak = max(counts, default=0)
        """The most runs at once."""

    def _integral(self, weight: Callable[[int], float]) -> list[float]:
        """Prefix integrals ``∫ weight(c) dt`` from the first instant to each ``times[k]``."""
        times, counts = self._times, self._counts
        total = 0.0
        out = [0.0]
        for k in range(1, len(times)):
            total += weight(counts[k - 1]) * (times[k] - times[k - 1])
            out.append(total)
        return out

    def _index(self, time_ms: float) -> int:
        """The step holding ``time_ms`` (the last instant at or before it); -1 before any."""
        return bisect.bisect_right(self._times, time_ms) - 1

    def _value(self, prefix: list[float], rates: Sequence[float], time_ms: float) -> float:
        k = self._index(time_ms)
        if k < 0:
            return 0.0
        return prefix[k] + rates[k] * (time_ms - self._times[k])

    def at(self, time_ms: float) -> int:
        """``c`` just after ``time_ms``: the runs covering it, those starting then included and
        those ending then not."""
        k = self._index(time_ms)
        return self._counts[k] if k >= 0 else 0

    def mean(self, start_ms: float, end_ms: float) -> float:
        """The time-average of ``c`` over ``[start_ms, end_ms)`` (``c`` at ``start_ms`` for an
        empty span)."""
        if end_ms <= start_ms:
            return float(self.at(start_ms))
        cumulative, levels = self._cumulative, self._levels
        area = self._value(cumulative, levels, end_ms) - self._value(cumulative, levels, start_ms)
        return area / (end_ms - start_ms)

    def means(self, spans: Sequence[tuple[float, float]]) -> list[float]:
        """:meth:`mean` of each span."""
        return self._weighted(spans, float, lambda c: 1.0)

    def service_means(
        self, spans: Sequence[tuple[float, float]], speed: Callable[[int], float]
    ) -> list[float]:
        """For each span, ``∫ c v(c) dt / ∫ v(c) dt`` with ``v = speed`` (positive): the average
        concurrency over the service a request received at those speeds (module docstring)."""
        return self._weighted(spans, lambda c: c * speed(c), speed)

    def _weighted(
        self,
        spans: Sequence[tuple[float, float]],
        numerator: Callable[[int], float],
        denominator: Callable[[int], float],
    ) -> list[float]:
        top_rates = [numerator(c) for c in self._counts]
        bottom_rates = [denominator(c) for c in self._counts]
        top = self._integral(numerator)
        bottom = self._integral(denominator)
        out: list[float] = []
        for start_ms, end_ms in spans:
            if end_ms > start_ms:
                upper = self._value(top, top_rates, end_ms) - self._value(top, top_rates, start_ms)
                lower = self._value(bottom, bottom_rates, end_ms) - self._value(
                    bottom, bottom_rates, start_ms
                )
                if lower > 0.0:
                    out.append(upper / lower)
                    continue
            out.append(float(self.at(start_ms)))
        return out
