"""Token bucket in service tokens: a burst capacity refilled at a sustained rate.

``level(t) = min(burst, level(t0) + (t - t0) / 1000 * sustained_per_second)``, refilled lazily
when read. Debits at dispatch may not take the level below zero; settlement may (a tenant that
used more than it was charged carries the debt into its next requests), and it never lifts the
level above ``burst``.

Two implementations of that rule:

* :class:`ExactTokenBucket` (the ``tokenfair`` policy's, and :class:`LeasedBucket`'s) keeps the
  level in integer fixed-point units (``UNITS_PER_TOKEN`` = 10^9 per service token, as in the
  DRR state): debits, refunds and leases are exact, and the refill has one rounding that never
  accumulates (see the class);
* :class:`TokenBucket` keeps the lesson's float arithmetic: the reference lesson's policies
  (:mod:`.baselines`) must decide exactly as the lab's float oracle does, rounding included.

:class:`LeasedBucket` is the exact bucket fed by leases from a pool-wide bucket instead of time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, TypeAlias

from tokenfair.core.units import UNITS_PER_MS_PER_TOKEN_PER_S as _UNITS_PER_MS_PER_TOKEN_PER_S
from tokenfair.core.units import to_units as _units
from tokenfair.core.units import tokens_of, units_of, whole_tokens

_NOISE_TOKENS: Final = 1e-6
"""The float bucket's tolerance (the lesson's arithmetic only)."""


class TokenBucket:
    """Lazily refilled token bucket in float tokens (the lesson's arithmetic); times are
    milliseconds on the scheduler's clock."""

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
            # min(burst, level + refill), as a conditional: the same comparison, no call
            cap = float(self.burst)
            level = self.level + elapsed_s * self.sustained_per_second
            self.level = level if level < cap else cap
            self.refilled_at_ms = now_ms
        return self.level

    def debit(self, tokens: int, now_ms: float) -> None:
        """Refill to ``now_ms``, then take ``tokens`` (a charge at dispatch)."""
        self.refill(now_ms)
        self.level -= tokens

    def covers(self, tokens: int, now_ms: float) -> bool:
        """The level at ``now_ms`` covers ``tokens`` (``ms_until`` is 0)."""
        return self.ms_until(tokens, now_ms) == 0.0

    def ms_until(self, tokens: float, now_ms: float) -> float:
        """Milliseconds from ``now_ms`` until the level reaches ``tokens`` (0 if it has)."""
        missing = tokens - self.refill(now_ms)
        # The lesson's float sums: a shortfall of float rounding noise is no shortfall (the
        # lesson's policies keep this behaviour; the exact bucket below needs no tolerance).
        return 0.0 if missing <= _NOISE_TOKENS else missing * 1000.0 / self.sustained_per_second

    def settle(self, refund_tokens: float) -> None:
        """Return (positive) or take (negative) the difference between estimate and actual."""
        self.level = min(float(self.burst), self.level + refund_tokens)

    def retune(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """Adopt new limits (hot reload) without forgiving or inventing spent tokens."""
        self.refill(now_ms)
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.level = min(self.level, float(burst))


class ExactTokenBucket:
    """The token bucket in integer units: ``level_units`` (``level`` reads and writes it in
    tokens), ``burst_units``; times are float milliseconds on the scheduler's clock. The same
    rule and methods as :class:`TokenBucket`, not a subclass of it: ``level`` is a view here,
    a slot there (a compiled core, ``tokenfair.native``, reads a base's slot directly).

    **Refill rule.** The refill since the *anchor* ``a`` (the last time the level was capped at
    the burst, or the rate changed) is ``round((t - a) * r)`` units, ``r`` the rate in units per
    ms; each refill adds what that total grew by since the previous one. The increments
    telescope, so however many refills a run has, the level at ``t`` is exactly
    ``level(a) + round((t - a) * r) - (debits - refunds since a)``: the error against the exact
    real-valued refill is one rounding, ``|e| <= 0.5 unit + 2^-52 * (t - a) * r`` (the one
    float product; ``2^-52 * r * (t - a)`` is below one unit until ``(t - a) * r`` passes
    ``2^52`` units, 4.5 million tokens, of uncapped refill), never accumulated over refills.
    It is monotone in ``t`` (a later read never refills less). Debits, refunds and leases are
    integer tokens, exact.

    **Covering.** ``ms_until(tokens)`` is 0 exactly when ``level_units >= units(tokens)``, no
    tolerance; otherwise the wait ``missing / r``, and a refill at ``now + wait`` covers it but
    for the float rounding of that time (then the next wake-up is one ulp later, see
    :meth:`tokenfair.core.tokenfair.TokenfairScheduler.next_wakeup_ms`)."""

    __slots__ = (
        "_anchor_ms",
        "_rate_units_per_ms",
        "_refilled_units",
        "burst",
        "burst_units",
        "level_units",
        "refilled_at_ms",
        "sustained_per_second",
    )

    def __init__(self, burst: int, sustained_per_second: float, now_ms: float = 0.0) -> None:
        self.burst = burst
        self.sustained_per_second = sustained_per_second
        self.burst_units = units_of(int(burst))
        self.level_units = self.burst_units
        self.refilled_at_ms = now_ms
        self._set_rate(sustained_per_second)

    def _set_rate(self, sustained_per_second: float) -> None:
        """A new rate: a new refill run, counted from the last refill (``refilled_at_ms``, the
        time of the level there is now; never from an earlier time, which would refill twice)."""
        self.sustained_per_second = sustained_per_second
        self._rate_units_per_ms = sustained_per_second * _UNITS_PER_MS_PER_TOKEN_PER_S
        self._anchor_ms = self.refilled_at_ms
        self._refilled_units = 0

    @property
    def level(self) -> float:
        """The level in service tokens (the state is ``level_units``)."""
        return tokens_of(self.level_units)

    @level.setter
    def level(self, tokens: int | float) -> None:
        self.level_units = _units(tokens)

    def refill(self, now_ms: float) -> float:
        """Bring the level up to ``now_ms`` (a time before the last refill is a no-op); the
        level, in tokens."""
        if now_ms > self.refilled_at_ms:
            cap = self.burst_units
            if self.level_units >= cap:  # full: nothing to add, a new refill run starts now
                self.level_units = cap
                self._anchor_ms = self.refilled_at_ms = now_ms
                self._refilled_units = 0
                return tokens_of(self.level_units)
            total = round((now_ms - self._anchor_ms) * self._rate_units_per_ms)
            level = self.level_units + total - self._refilled_units
            if level < cap:
                self.level_units = level
                self._refilled_units = total
            else:  # capped: a new refill run starts now
                self.level_units = cap
                self._anchor_ms = now_ms
                self._refilled_units = 0
            self.refilled_at_ms = now_ms
        return tokens_of(self.level_units)

    def debit(self, tokens: int, now_ms: float) -> None:
        """Refill to ``now_ms``, then take ``tokens`` (a charge at dispatch)."""
        if now_ms > self.refilled_at_ms:
            self.refill(now_ms)
        self.level_units -= units_of(tokens)

    def covers(self, tokens: int, now_ms: float) -> bool:
        """The level at ``now_ms`` covers ``tokens`` (``ms_until`` is 0). A level that covers
        them already is not refilled first: a refill only adds, and the refills telescope, so
        the level at any later time is the same whichever times it was refilled at."""
        need = units_of(tokens)
        if self.level_units >= need:
            return True
        self.refill(now_ms)
        return self.level_units >= need

    def ms_until(self, tokens: int | float, now_ms: float) -> float:
        """Milliseconds from ``now_ms`` until the level reaches ``tokens`` (0 if it has)."""
        if now_ms > self.refilled_at_ms:
            self.refill(now_ms)
        missing = _units(tokens) - self.level_units
        return 0.0 if missing <= 0 else missing / self._rate_units_per_ms

    def settle(self, refund_tokens: int | float) -> None:
        """Return (positive) or take (negative) the difference between estimate and actual."""
        level = self.level_units + _units(refund_tokens)
        cap = self.burst_units
        self.level_units = level if level < cap else cap

    def retune(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """Adopt new limits (hot reload) without forgiving or inventing spent tokens."""
        self.refill(now_ms)
        self.burst = burst
        self.burst_units = units_of(int(burst))
        self._set_rate(sustained_per_second)
        if self.level_units > self.burst_units:
            self.level_units = self.burst_units


Bucket: TypeAlias = "TokenBucket | ExactTokenBucket"
"""A tenant's budget: the lesson's float bucket or the exact one (a :class:`LeasedBucket` is an
exact one)."""


class HasBucket:
    """What holds a tenant's bucket (the scheduler's ``TenantState`` derives from it). A class,
    not a protocol: the compiled :func:`refill_all` then reads ``bucket`` as a field of a known
    layout instead of looking the name up on each tenant at every event."""

    __slots__ = ("bucket",)

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket


def refill_all(tenants: Iterable[HasBucket], now_ms: float) -> None:
    """``tenant.bucket.refill(now_ms)`` for each of ``tenants``: the lesson's policies refill
    every bucket at every event."""
    for tenant in tenants:
        bucket = tenant.bucket
        if type(bucket) is TokenBucket:
            # The same call, on the known class: compiled, a direct call (on the union type,
            # a lookup of the method by name for each bucket at every event).
            bucket.refill(now_ms)
        else:
            bucket.refill(now_ms)


class LeasedBucket(ExactTokenBucket):
    """A tenant's bucket backed by leases from a pool-wide bucket (no I/O here: the sidecar's
    lease client, :mod:`tokenfair.server.pool`, grants and takes back tokens).

    **Shared** (the store answers): ``burst`` and ``sustained_per_second`` are the pool's and
    ``level`` is the local lease balance — service tokens leased from the shared bucket and not
    yet spent. It does not refill with time; :meth:`grant` adds a lease and :meth:`surrender`
    takes back what is returned. Debits and settlement work as on any bucket (a debt below zero
    is paid by the next lease). ``ms_until(tokens)`` is ``(tokens - level) * 1000 / sustained``:
    the wait if this sidecar were the pool's only consumer (the balance is in integer units, as
    in any :class:`ExactTokenBucket`; leases and surrenders are whole tokens). Every shortfall
    it sees is kept in
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
        self.level_units = 0  # nothing leased yet
        self.shared = True
        self.shortfall_tokens = 0.0
        self.on_short = on_short

    def refill(self, now_ms: float) -> float:
        if self.shared:
            return tokens_of(self.level_units)
        return ExactTokenBucket.refill(self, now_ms)

    def covers(self, tokens: int, now_ms: float) -> bool:
        return self.ms_until(tokens, now_ms) == 0.0  # a shortfall is reported (`ms_until`)

    def ms_until(self, tokens: int | float, now_ms: float) -> float:
        if not self.shared:
            return ExactTokenBucket.ms_until(self, tokens, now_ms)
        missing = _units(tokens) - self.level_units
        if missing <= 0:
            return 0.0
        if tokens > self.shortfall_tokens:
            self.shortfall_tokens = min(tokens, float(self.burst))
        if self.on_short is not None:
            self.on_short()
        return missing / self._rate_units_per_ms

    def grant(self, tokens: int) -> None:
        """A lease arrived: add it to the balance (shared only; ignored when fallen back)."""
        if self.shared:
            self.level_units += units_of(tokens)
            if self.level_units >= _units(self.shortfall_tokens):
                self.shortfall_tokens = 0.0

    def surrender(self, keep_tokens: float) -> int:
        """Take the whole tokens of the balance above ``keep_tokens`` out, to be returned to the
        pool: ``floor(level - keep)`` if positive, else 0 (always 0 when fallen back)."""
        if not self.shared:
            return 0
        keep = _units(keep_tokens)
        give = whole_tokens(self.level_units - (keep if keep > 0 else 0))
        if give <= 0:
            return 0
        self.level_units -= units_of(give)
        return give

    def fall_back(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """The store is unreachable: enforce these (local) limits, refilled with time."""
        self.shared = False
        self.shortfall_tokens = 0.0
        self.burst = burst
        self.burst_units = units_of(int(burst))
        self.refilled_at_ms = now_ms
        self._set_rate(sustained_per_second)
        if self.level_units > self.burst_units:
            self.level_units = self.burst_units

    def rejoin(self, burst: int, sustained_per_second: float, now_ms: float) -> None:
        """The store is back: the pool's limits, a balance of ``min(level, 0)``."""
        ExactTokenBucket.refill(self, now_ms)
        self.shared = True
        self.burst = burst
        self.burst_units = units_of(int(burst))
        self.refilled_at_ms = now_ms
        self._set_rate(sustained_per_second)
        if self.level_units > 0:
            self.level_units = 0
