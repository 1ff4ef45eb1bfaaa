"""The deterministic service-cost model of the reference lesson, as one reusable component.

For a request of ``p`` prefill (prompt) tokens and ``d`` decode (output) tokens::

    service_tokens = p + ceil(decode_weight * d)              (integer; the unit of all accounting)
    prefill_ms     = max(prefill_floor_ms, p / prefill_tokens_per_ms)   (time to first token)
    execution_ms   = service_tokens / service_tokens_per_ms   (serial, non-preemptive execution)
    kv_blocks      = ceil((p + d) / kv_block_tokens)
    kv_hold_ms     = kv_residency_factor * execution_ms       (KV stays resident after dispatch)

Defaults (the lesson's): decode_weight 4, prefill floor 8 ms at 48 tokens/ms, 45 service
tokens/ms, 16-token blocks held for 5.5x the execution time. The simulator runs it on a virtual
clock; the ``costmodel`` backend runs it in real time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from tokenfair.config import PolicyConfig

MAX_REQUEST_TOKENS: Final = 2**31 - 1
"""The most prompt or completion tokens one request may count (no model comes near): the bound
of a backend's reported usage and of a trace record's token fields, so that recorded usage
always replays, and a replay never meets a count the core refuses (``prefill + w * decode``
stays under the core's settlement bound of 2**40 for decode weights up to 511)."""


def service_tokens(prefill_tokens: int, decode_tokens: int, decode_weight: float) -> int:
    """``prefill + ceil(decode_weight * decode)``: the integer unit of all accounting."""
    # Round first so float noise (4.2 * 10 = 42.00000000000001) does not ceil up a whole token.
    return prefill_tokens + math.ceil(round(float(decode_weight) * decode_tokens, 9))


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients of the cost model; see the module docstring for the formulas."""

    decode_weight: float = 4.0
    service_tokens_per_ms: float = 45.0
    prefill_floor_ms: float = 8.0
    prefill_tokens_per_ms: float = 48.0
    kv_block_tokens: int = 16
    kv_residency_factor: float = 5.5

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> CostModel:
        return cls(
            decode_weight=policy.decode_weight,
            service_tokens_per_ms=policy.service_tokens_per_ms,
            prefill_floor_ms=policy.prefill_floor_ms,
            prefill_tokens_per_ms=policy.prefill_tokens_per_ms,
            kv_block_tokens=policy.kv_block_tokens,
            kv_residency_factor=policy.kv_residency_factor,
        )

    def service_tokens(self, prefill_tokens: int, decode_tokens: int) -> int:
        return service_tokens(prefill_tokens, decode_tokens, self.decode_weight)

    def prefill_ms(self, prefill_tokens: int) -> float:
        return max(self.prefill_floor_ms, prefill_tokens / self.prefill_tokens_per_ms)

    def execution_ms(self, service_tokens: int) -> float:
        return service_tokens / self.service_tokens_per_ms

    def kv_blocks(self, prefill_tokens: int, decode_tokens: int) -> int:
        return math.ceil((prefill_tokens + decode_tokens) / self.kv_block_tokens)

    def kv_hold_ms(self, execution_ms: float) -> float:
        return execution_ms * self.kv_residency_factor
