"""``core/rounding.py``: ``round_hundredths(x)`` is ``round(x, 2)``, bit for bit.

Behaviours under test: the same float (compared by ``float.hex``, so the sign of a zero counts)
for decimal ties and their neighbours one ulp away, values across the fast path's bound, signed
zeros, small negatives, NaN and infinities, and random floats of every magnitude (hypothesis).

One test case per distinct behaviour: a tie that rounds up, one that rounds down (binary
``x.xx5`` is below or above the decimal), each sign, the first ties either side of zero (a zero
result keeps the sign), ties at the fast path's bound; the brute-force grid of every
third-decimal tie in [-2, 2) is one case (it was 800), as are the two random searches.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.core.rounding import round_hundredths


def same(value: float) -> None:
    expected, got = round(value, 2), round_hundredths(value)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        assert got.hex() == expected.hex(), (value, got, expected)


TIES = [
    -1.005,  # negative, the binary value below the decimal tie
    -0.015,
    -0.005,  # the first ties either side of zero: a zero result keeps its sign
    0.005,
    0.015,
    0.125,  # exact binary ties: half to even, down then up
    0.375,
    0.625,
    2.675,
    1.005,
    1.015,
    1.025,
    1.045,
    8.345,
    123456.785,
    21474836.475,
]


@pytest.mark.parametrize("tie", TIES)
def test_decimal_ties_and_their_neighbours(tie: float) -> None:
    for value in (tie, math.nextafter(tie, -math.inf), math.nextafter(tie, math.inf)):
        same(value)


def test_every_third_decimal_tie_in_two_units_either_side_of_zero() -> None:
    for n in range(-2000, 2000, 5):
        tie = n / 1000.0
        for value in (tie, math.nextafter(tie, -math.inf), math.nextafter(tie, math.inf)):
            same(value)


@pytest.mark.parametrize(
    "value",
    [
        0.0,
        -0.0,
        -0.001,
        -0.004999,
        -0.005,
        0.004999,
        0.005,
        1e-300,
        -1e-300,
        21474836.47,
        21474836.48,
        21474836.49,
        -21474836.48,
        1e12,
        -1e12,
        2.0**53,
        math.inf,
        -math.inf,
        math.nan,
    ],
)
def test_edges(value: float) -> None:
    same(value)


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e10, max_value=1e10))
def test_random_floats(value: float) -> None:
    same(value)


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, 10**9), st.integers(-3, 3))
def test_near_decimal_hundredths(thousandths: int, ulps: int) -> None:
    value = thousandths / 1000.0
    for _ in range(abs(ulps)):
        value = math.nextafter(value, math.inf if ulps > 0 else -math.inf)
    same(value)
