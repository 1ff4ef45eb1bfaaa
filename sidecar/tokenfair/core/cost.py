"""The deterministic service-cost model of the reference lesson: one object, built from the policy.

For a request of ``p`` prefill (prompt) tokens and ``d`` decode (output) tokens, with the
policy's coefficients ``w`` (``decode_weight``), ``R`` (``service_tokens_per_ms``), ``F``
(``prefill_floor_ms``), ``P`` (``prefill_tokens_per_ms``), ``B`` (``kv_block_tokens``) and ``K``
(``kv_residency_factor``)::

    service_tokens = p + ceil(w * d)           (integer; the unit of all accounting)
    prefill_ms     = max(F, p / P)             (time to first token once running)
    execution_ms   = service_tokens / R        (serial, non-preemptive execution)
    kv_blocks      = ceil((p + d) / B)         (exact, in integers)
    kv_hold_ms     = K * execution_ms          (KV stays resident that long after dispatch)

That is the lesson's serial server (``maxBatchRequests`` 1, the default). The model also carries
the policy's batching engine, ``S`` (``max_batch_requests``) and ``G``
(``batch_throughput_gain``): with ``S > 1`` the engine runs up to ``S`` requests at once at the
speeds of :class:`tokenfair.core.batching.BatchingCurve` (``BatchingCurve.from_cost``), so a
request's run is no longer ``execution_ms`` but what the processor-sharing fluid of
:class:`~tokenfair.core.batching.RunningWork` makes of it, and its KV is freed when it ends.

:class:`CostModel` is these formulas, compiled once from a
:class:`~tokenfair.config.PolicyConfig` (:meth:`CostModel.from_policy`; the scheduler holds its
policy's as ``Scheduler.cost``): the scheduler prices each request with it, the simulator runs
its virtual clock on it (:meth:`CostModel.run_ms`), the sidecar's ``costmodel`` engine answers in
real time by it, and the sidecar settles reported usage with it. The coefficients' defaults are
the policy's (the config contract holds them; this module repeats none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from tokenfair.config import PolicyConfig

MAX_REQUEST_TOKENS: Final = 2**31 - 1
"""The most prompt or completion tokens one request may count (no model comes near): the bound
of a backend's reported usage and of a trace record's token fields, so that recorded usage
always replays, and a replay never meets a count the core refuses (``prefill + w * decode``
stays under the core's settlement bound of 2**40 for decode weights up to 511)."""


_DEFAULT_POLICY: Final = PolicyConfig()
"""The coefficients' defaults are this policy's (the config contract's)."""


def service_tokens(prefill_tokens: int, decode_tokens: int, decode_weight: float) -> int:
    """``prefill + ceil(decode_weight * decode)``: the integer unit of all accounting (the
    formula of :meth:`CostModel.service_tokens`, for a caller holding a weight, not a model)."""
    # Round first so float noise (4.2 * 10 = 42.00000000000001) does not ceil up a whole token.
    return prefill_tokens + math.ceil(round(float(decode_weight) * decode_tokens, 9))


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """The cost model's coefficients and formulas (the module docstring states them).

    Build it with :meth:`from_policy`. A coefficient given by keyword alone (a tool or a test
    varying one) leaves the others at the default policy's: read from :class:`PolicyConfig`,
    which holds the defaults, not restated here."""

    decode_weight: float = _DEFAULT_POLICY.decode_weight
    service_tokens_per_ms: float = _DEFAULT_POLICY.service_tokens_per_ms
    prefill_floor_ms: float = _DEFAULT_POLICY.prefill_floor_ms
    prefill_tokens_per_ms: float = _DEFAULT_POLICY.prefill_tokens_per_ms
    kv_block_tokens: int = _DEFAULT_POLICY.kv_block_tokens
    kv_residency_factor: float = _DEFAULT_POLICY.kv_residency_factor
    max_batch_requests: int = _DEFAULT_POLICY.max_batch_requests
    """``S``: the most requests the engine runs at once (1: the serial server)."""
    batch_throughput_gain: float = _DEFAULT_POLICY.batch_throughput_gain
    """``G = X(S) / X(1)``: the batching engine's throughput gain (``S`` > 1 only)."""
    integral_decode_weight: int | None = field(init=False, repr=False, compare=False)
    """``decode_weight`` as an ``int`` when it is a whole number (the usual case): service
    tokens are then computed in integers, exactly; ``None`` otherwise."""

    def __post_init__(self) -> None:
        weight = self.decode_weight
        integral = int(weight) if float(weight).is_integer() else None
        object.__setattr__(self, "integral_decode_weight", integral)

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> CostModel:
        """The cost model of ``policy`` (its cost-model coefficients)."""
        return cls(
            decode_weight=policy.decode_weight,
            service_tokens_per_ms=policy.service_tokens_per_ms,
            prefill_floor_ms=policy.prefill_floor_ms,
            prefill_tokens_per_ms=policy.prefill_tokens_per_ms,
            kv_block_tokens=policy.kv_block_tokens,
            kv_residency_factor=policy.kv_residency_factor,
            max_batch_requests=policy.max_batch_requests,
            batch_throughput_gain=policy.batch_throughput_gain,
        )

    def service_tokens(self, prefill_tokens: int, decode_tokens: int) -> int:
        """``p + ceil(w * d)``: exact in integers for a whole ``w``."""
        weight = self.integral_decode_weight
        if weight is not None:
            return prefill_tokens + weight * decode_tokens
        return service_tokens(prefill_tokens, decode_tokens, self.decode_weight)

    def kv_blocks(self, prefill_tokens: int, decode_tokens: int) -> int:
        """``ceil((p + d) / B)``, exact in integers."""
        return -(-(prefill_tokens + decode_tokens) // self.kv_block_tokens)

    def prefill_ms(self, prefill_tokens: int) -> float:
        """``max(F, p / P)``: the time to the first token once the request runs."""
        prefill_ms = prefill_tokens / self.prefill_tokens_per_ms
        floor_ms = self.prefill_floor_ms
        return floor_ms if floor_ms > prefill_ms else prefill_ms

    def execution_ms(self, service_tokens: int) -> float:
        """``service_tokens / R``: how long the request runs (also the queue-wait unit)."""
        return service_tokens / self.service_tokens_per_ms

    def kv_hold_ms(self, execution_ms: float) -> float:
        """``K * execution_ms``: how long its KV stays resident after dispatch."""
        return execution_ms * self.kv_residency_factor

    def run_ms(self, prefill_tokens: int, service_tokens: int) -> tuple[float, float, float]:
        """``(prefill_ms(p), execution_ms(s), kv_hold_ms(execution_ms(s)))`` in one call (the
        simulator's loop makes it once per dispatch): the same values as the three methods."""
        prefill_ms = prefill_tokens / self.prefill_tokens_per_ms
        floor_ms = self.prefill_floor_ms
        execution_ms = service_tokens / self.service_tokens_per_ms
        return (
            floor_ms if floor_ms > prefill_ms else prefill_ms,
            execution_ms,
            execution_ms * self.kv_residency_factor,
        )
