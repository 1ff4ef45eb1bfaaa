"""Token bucket in service tokens: a burst capacity refilled at a sustained rate.

``level(t) = min(burst, level(t0) + (t - t0) / 1000 * sustained_per_second)``, refilled lazily
when read. Debits at dispatch may not take the level below zero; settlement may (a tenant that
used more than it was charged carries the debt into its next requests), and it never lifts the
level above ``burst``.
"""

from __future__ import annotations

from typing import Final

_TOLERANCE_TOKENS: Final = 1e-6


class TokenBucket:
    """Lazily refilled token bucket; times are milliseconds on the scheduler's clock."""

    __slots__ = ("burst", "level", "refilled_at_ms", "sustained_per_second")

    def __init__(self, burst: int, sustained_per_second: float, now_ms: float = 0.0) -> None:
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.level = float(burst)
        self.refilled_at_ms = now_ms

    def refill(self, now_ms: float) -> float:
        """Bring the level up to ``now_ms`` (a time before the last refill is a no-op)."""
        elapsed_s = (now_ms - self.refilled_at_ms) / 1000.0
        if elapsed_s > 0.0:
            self.level = min(float(self.burst), self.level + elapsed_s * self.sustained_per_second)
            self.refilled_at_ms = now_ms
        return self.level

    def ms_until(self, tokens: float, now_ms: float) -> float:
        """Milliseconds from ``now_ms`` until the level reaches ``tokens`` (0 if it has)."""
        missing = tokens - self.refill(now_ms)
        # Tokens are coarse units: a shortfall of float rounding noise is no shortfall.
        return 0.0 if missing <= _TOLERANCE_TOKENS else missing * 1000.0 / self.sustained_per_second

    def settle(self, refund_tokens: float) -> None:
        """Return (positive) or take (negative) the difference between estimate and actual."""
        self.level = min(float(self.burst), self.level + refund_tokens)

    def retune(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """Adopt new limits (hot reload) without forgiving or inventing spent tokens."""
        self.refill(now_ms)
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.level = min(self.level, float(burst))
