"""Feed the core's inputs to the lesson oracle (``lesson_reference``), which imports nothing of
the project on purpose; used by the parity tests and by ``bench/bench_core.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from lesson_reference import (
    OracleKnobs,
    OracleOutcome,
    OracleRequest,
    OracleTenant,
    run_request_count,
    run_service_token_drr,
)

from tokenfair.config import Config
from tokenfair.core import Request

NAIVE: Final = "request_count_no_admission"
DRR: Final = "service_token_drr_with_admission"
Oracle = Callable[
    [Sequence[OracleTenant], Sequence[OracleRequest], OracleKnobs], list[OracleOutcome]
]
ORACLES: Final[dict[str, Oracle]] = {NAIVE: run_request_count, DRR: run_service_token_drr}


def oracle_inputs(
    config: Config, requests: Sequence[Request]
) -> tuple[list[OracleTenant], list[OracleRequest], OracleKnobs]:
    """The oracle's tenants, trace and knobs for a config and trace of the core."""
    policy = config.policy
    tenants = [
        OracleTenant(
            t.tenant_id, t.weight, t.burst_service_tokens, t.sustained_service_tokens_per_second
        )
        for t in config.tenants
    ]
    trace = [
        OracleRequest(
            r.request_id,
            r.tenant_id,
            int(r.arrival_ms),
            r.prefill_tokens,
            r.decode_tokens,
            r.priority_class,
        )
        for r in requests
    ]
    knobs = OracleKnobs(
        total_kv_blocks=policy.total_kv_blocks,
        interactive_kv_watermark=policy.interactive_kv_watermark,
        batch_kv_watermark=policy.batch_kv_watermark,
        max_interactive_wait_ms=policy.max_interactive_wait_ms,
        max_batch_wait_ms=policy.max_batch_wait_ms,
        decode_weight=int(policy.decode_weight),
        base_quantum_tokens=policy.base_quantum_tokens,
        service_tokens_per_ms=policy.service_tokens_per_ms,
    )
    return tenants, trace, knobs


def run_oracle(policy: str, config: Config, requests: Sequence[Request]) -> list[OracleOutcome]:
    """The lesson lab's outcomes (by the oracle) for ``policy`` on ``requests``."""
    tenants, trace, knobs = oracle_inputs(config, requests)
    return ORACLES[policy](tenants, trace, knobs)
