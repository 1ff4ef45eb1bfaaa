"""The fixed-point scale of the fairness state, and every conversion across it.

DRR deficits, quanta and credit, bucket levels, the batch lane's credit and the pool-wide
counters are integers of :data:`UNITS_PER_TOKEN` units per service token (nano-tokens, like
APF's seat-seconds at 10^9 per seat-second). Sums and differences of units are exact; the one
rounding is where a float enters (a usage ratio, a weight, a refill over float milliseconds),
stated where it happens. This module is the one place the scale appears: code elsewhere converts
through these functions, never multiplies or divides by the scale itself.

* tokens -> units: :func:`units_of` (a whole count, exact), :func:`nearest_units` (a float
  count: the nearest unit), :func:`to_units` (either, by the value's type);
* units -> tokens: :func:`tokens_of` (integer units, for reading and prediction: converted to a
  float first, so both cores agree past 2^53 units), :func:`tokens_of_float` (a float already
  in units: a product with a float), :func:`whole_tokens` (the whole tokens, rounded toward
  zero).
"""

from __future__ import annotations

from typing import Final

UNITS_PER_TOKEN: Final = 10**9
"""Units per service token. A count ``n <= 2**40`` tokens is ``n * 10**9`` units exactly, and
units convert back to the nearest float only for reading and prediction."""
UNITS_PER_MS_PER_TOKEN_PER_S: Final = UNITS_PER_TOKEN // 1000
"""A rate of one token per second in units per millisecond (a bucket's refill rate)."""


def units_of(tokens: int) -> int:
    """A whole count of ``tokens`` in units: ``tokens * 10^9``, exact."""
    return tokens * UNITS_PER_TOKEN


def nearest_units(tokens: float) -> int:
    """A float count of ``tokens`` in units: the nearest unit to ``tokens * 10^9`` (off by at most
    ``0.5 unit + 2^-53 * tokens * 10^9``)."""
    return round(tokens * UNITS_PER_TOKEN)


def to_units(tokens: int | float) -> int:
    """``tokens`` in units: exact for an integer count, else the nearest unit to the float's
    ``tokens * 10^9`` (off by at most ``0.5 unit + 2^-53 * tokens * 10^9``; the same value
    always gives the same units). ``int | float``, not ``float``: the compiled core
    (``tokenfair.native``) would turn an ``int`` argument into a float, and an integer count
    above 2^53 / 10^9 tokens would no longer be exact."""
    return tokens * UNITS_PER_TOKEN if type(tokens) is int else round(tokens * UNITS_PER_TOKEN)


def tokens_of(units: int) -> float:
    """Integer ``units`` in tokens: ``float(units) / 10^9``. Up to 2^53 units (~9 million
    tokens) the conversion is exact and the result the nearest float to ``units / 10^9``; above,
    ``units`` is rounded to a float first. Why not ``units / 10^9``: CPython divides integers
    with one rounding, the compiled core (mypyc's ``CPyTagged_TrueDivide``) converts both to
    doubles first, so the two cores read a larger count differently in the last bit; the
    explicit conversion makes them agree at any size."""
    return float(units) / UNITS_PER_TOKEN


def tokens_of_float(units: float) -> float:
    """A float amount of units in tokens: ``units / 10^9``."""
    return units / UNITS_PER_TOKEN


def whole_tokens(units: int) -> int:
    """The whole tokens in ``units``, rounded toward zero (a remainder of either sign stays in
    units): ``units // 10^9`` for ``units >= 0``, ``-(-units // 10^9)`` below."""
    return units // UNITS_PER_TOKEN if units >= 0 else -(-units // UNITS_PER_TOKEN)
