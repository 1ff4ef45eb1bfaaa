"""A request as the core receives it, in a module of its own: trace readers decode lines
straight into it (``tokenfair.sim.records``, msgspec), which needs a plain dataclass, so this
module stays interpreted when the core is compiled (``tokenfair.native``)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfair.config import PriorityClass


@dataclass(frozen=True, slots=True)
class Request:
    """One request record of a trace (see docs/records.md). Times in ms, sizes in tokens."""

    request_id: str
    tenant_id: str
    arrival_ms: float
    prefill_tokens: int
    decode_tokens: int
    priority_class: PriorityClass
