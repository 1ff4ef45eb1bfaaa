"""``round(x, 2)`` without the decimal conversion: every decision rounds its times to 0.01 ms.

Python's ``round(x, 2)`` rounds the exact binary value of ``x`` to two decimals (half to even)
by formatting it as a decimal string and parsing it back (``_Py_dg_dtoa``, ``_Py_dg_strtod``):
about 0.25 us, twice per dispatched request, 7 % of a compiled replay. :func:`round_hundredths`
gives the same float from float arithmetic when that is provably the same, and calls ``round``
otherwise:

* ``s = x * 100.0`` is within half an ulp of the exact ``100 x``; for ``|s| < 2^31`` that is at
  most ``2^-22`` (~2.4e-7). The fraction ``f = s - floor(s)`` is exact for ``s >= 0`` (and for
  ``s`` in ``(-1, 0)`` within an ulp of 1, possibly 1.0 itself, which still rounds up to the
  right ``n = 0``). When ``f`` is more than ``1e-6`` from ``0.5``, the exact ``100 x`` rounds to
  the same integer ``n`` as ``s`` (near 0 or 1 the exact value may sit across the integer, and
  rounds to the same ``n``).
* ``n / 100.0`` is then the double nearest ``n / 100`` (a correctly rounded division of two
  exact integers), which is what ``round`` returns: the nearest double to the decimal
  ``n / 100``. A zero result keeps the sign of ``x`` (``round(-0.001, 2)`` is ``-0.0``).
* Near a tie, beyond ``2^31 / 100`` ms (~248 days), and for NaN and infinities: ``round``.

``tests/sidecar/core/test_rounding.py`` checks it against ``round`` on ties, near-ties, powers
of ten and random floats. It always returns a float: an ``int`` time (a caller's, never the
simulator's) comes out as ``5.0`` where ``round(5, 2)`` gives ``5`` — as the compiled core,
whose parameters are floats, always did.
"""

from __future__ import annotations

import math
from typing import Final

_SAFE_SCALED: Final = 2.0**31
"""Bound on ``|100 x|`` below which the error of ``x * 100.0`` is at most ``2^-22``."""
_TIE_MARGIN: Final = 1e-6
"""How far from ``.5`` the computed fraction must be (over 4x the error bound above)."""


def round_hundredths(value: float) -> float:
    """``round(value, 2)``: the same float (module docstring), without formatting it."""
    scaled = value * 100.0
    if -_SAFE_SCALED < scaled < _SAFE_SCALED:
        whole = math.floor(scaled)
        fraction = scaled - whole
        if fraction < 0.5 - _TIE_MARGIN:
            rounded = whole
        elif fraction > 0.5 + _TIE_MARGIN:
            rounded = whole + 1
        else:
            return round(value, 2)
        if rounded == 0:
            return math.copysign(0.0, value)
        return rounded / 100.0
    return round(value, 2)
