"""Token bucket in service tokens: a burst capacity refilled at a sustained rate.

``level(t) = min(burst, level(t0) + (t - t0) / 1000 * sustained_per_second)``, refilled lazily
when read. Debits at dispatch may not take the level below zero; settlement may (a tenant that
used more than it was charged carries the debt into its next requests), and it never lifts the
level above ``burst``.

:class:`LeasedBucket` is the same bucket fed by leases from a pool-wide bucket instead of time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Final, Protocol

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
        """Bring the level up to ``now_ms`` (a time before the last refill is a no-op).
        :func:`refill_all` runs this step inline for every bucket at once: change both."""
        elapsed_s = (now_ms - self.refilled_at_ms) / 1000.0
        if elapsed_s > 0.0:
            # min(burst, level + refill), as a conditional: the same comparison, no call
            cap = float(self.burst)
            level = self.level + elapsed_s * self.sustained_per_second
            self.level = level if level < cap else cap
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


def refill_all(tenants: Iterable[_HasBucket], now_ms: float) -> None:
    """``tenant.bucket.refill(now_ms)`` for each of ``tenants``: a plain :class:`TokenBucket`'s
    refill inline (the same operations as :meth:`TokenBucket.refill`, no call per bucket), any
    other bucket's by its own ``refill``. The lesson's policies refill every bucket at every
    event: this is their loop, and the one copy of ``refill``'s step
    (``tests/sidecar/core/test_core_inline_paths.py`` checks it against ``refill``)."""
    for tenant in tenants:
        bucket = tenant.bucket
        if type(bucket) is TokenBucket:
            elapsed_s = (now_ms - bucket.refilled_at_ms) / 1000.0
            if elapsed_s > 0.0:
                cap = float(bucket.burst)
                level = bucket.level + elapsed_s * bucket.sustained_per_second
                bucket.level = level if level < cap else cap
                bucket.refilled_at_ms = now_ms
        else:
            bucket.refill(now_ms)


class _HasBucket(Protocol):
    @property
    def bucket(self) -> TokenBucket: ...


class LeasedBucket(TokenBucket):
    """A tenant's bucket backed by leases from a pool-wide bucket (no I/O here: the sidecar's
    lease client, :mod:`tokenfair.server.pool`, grants and takes back tokens).

    **Shared** (the store answers): ``burst`` and ``sustained_per_second`` are the pool's and
    ``level`` is the local lease balance — service tokens leased from the shared bucket and not
    yet spent. It does not refill with time; :meth:`grant` adds a lease and :meth:`surrender`
    takes back what is returned. Debits and settlement work as on any bucket (a debt below zero
    is paid by the next lease). ``ms_until(tokens)`` is ``(tokens - level) * 1000 / sustained``:
    the wait if this sidecar were the pool's only consumer. Every shortfall it sees is kept in
    ``shortfall_tokens`` (the most asked for, at most ``burst``) and ``on_short`` is called, so
    the lease client tops up before the dispatcher's timer would.

    **Fallen back** (the store is unreachable): a plain :class:`TokenBucket` with the limits
    given to :meth:`fall_back` (the caller's ``1/replicas`` split), refilled with time.
    :meth:`rejoin` returns to shared: credit earned while fallen back is dropped (the pool's
    bucket refilled meanwhile), a debt is kept.
    """

    __slots__ = ("on_short", "shared", "shortfall_tokens")

    def __init__(
        self,
        burst: int,
        sustained_per_second: float,
        now_ms: float = 0.0,
        on_short: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(burst, sustained_per_second, now_ms)
        self.level = 0.0  # nothing leased yet
        self.shared = True
        self.shortfall_tokens = 0.0
        self.on_short = on_short

    def refill(self, now_ms: float) -> float:
        if self.shared:
            return self.level
        return TokenBucket.refill(self, now_ms)

    def ms_until(self, tokens: float, now_ms: float) -> float:
        if not self.shared:
            return TokenBucket.ms_until(self, tokens, now_ms)
        missing = tokens - self.level
        if missing <= _TOLERANCE_TOKENS:
            return 0.0
        if tokens > self.shortfall_tokens:
            self.shortfall_tokens = min(tokens, float(self.burst))
        if self.on_short is not None:
            self.on_short()
        return missing * 1000.0 / self.sustained_per_second

    def grant(self, tokens: int) -> None:
        """A lease arrived: add it to the balance (shared only; ignored when fallen back)."""
        if self.shared:
            self.level += tokens
            if self.level >= self.shortfall_tokens:
                self.shortfall_tokens = 0.0

    def surrender(self, keep_tokens: float) -> int:
        """Take the whole tokens of the balance above ``keep_tokens`` out, to be returned to the
        pool: ``floor(level - keep)`` if positive, else 0 (always 0 when fallen back)."""
        if not self.shared:
            return 0
        give = math.floor(self.level - max(0.0, keep_tokens))
        if give <= 0:
            return 0
        self.level -= give
        return give

    def fall_back(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """The store is unreachable: enforce these (local) limits, refilled with time."""
        self.shared = False
        self.shortfall_tokens = 0.0
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.level = min(self.level, float(burst))
        self.refilled_at_ms = now_ms

    def rejoin(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """The store is back: the pool's limits, a balance of ``min(level, 0)``."""
        TokenBucket.refill(self, now_ms)
        self.shared = True
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.level = min(self.level, 0.0)
        self.refilled_at_ms = now_ms
