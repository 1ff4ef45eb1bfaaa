"""Built-in workloads: the lesson's fixture and the scenarios that test what it cannot show.

``noisy-neighbor`` (the lesson's fixture): ``tenant_batch_rag`` floods the server with 18
document-extraction requests (3200 prompt + 350 output tokens, one every 10 ms from t=0) while
``tenant_chat_pro`` (24 chats of 280+90, every 15 ms from t=5) and ``tenant_ide_assist``
(18 completions of 420+60, every 20 ms from t=8) send short interactive work.

``load-step``: interactive work at 0.5, 2 and 0.5 times one server's capacity (60 s, 20 s,
60 s): the trace of the scaling signal and ``tokenfair simulate --autoscale``.

``starvation``: the interactive tenants keep the server over-full for 20 s (about 1.3x its
capacity) while batch work queues; with strict priority batch would wait forever, with
``batchMinShare`` it gets that share of service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request

LESSON_TENANTS: Final = (
    TenantConfig("tenant_chat_pro", 2.0, 48_000, 180_000, "interactive"),
    TenantConfig("tenant_ide_assist", 1.5, 36_000, 140_000, "interactive"),
    TenantConfig("tenant_batch_rag", 1.0, 28_000, 60_000, "batch"),
)


def lesson_config() -> Config:
    """The lesson's three tenants at the lesson's default policy."""
    return build_config(PolicyConfig(), LESSON_TENANTS)


def noisy_neighbor() -> tuple[Config, list[Request]]:
    # Arrival times are floats, as a trace decodes them: records write them alike ("0.0").
    requests = [
        Request(f"batch-{i:02d}", "tenant_batch_rag", i * 10.0, 3200, 350, "batch")
        for i in range(18)
    ]
    requests += [
        Request(f"chat-{i:02d}", "tenant_chat_pro", 5.0 + i * 15, 280, 90, "interactive")
        for i in range(24)
    ]
    requests += [
        Request(f"ide-{i:02d}", "tenant_ide_assist", 8.0 + i * 20, 420, 60, "interactive")
        for i in range(18)
    ]
    return lesson_config(), requests


def starvation(duration_ms: int = 20_000) -> tuple[Config, list[Request]]:
    """Interactive demand ~1.3x capacity for ``duration_ms``; batch backlogged from t=0."""
    # 640 + 660 service tokens every 22 ms = 59 tokens/ms against 45 tokens/ms of capacity.
    requests = [
        Request(f"chat-{i:05d}", "tenant_chat_pro", i * 22.0, 280, 90, "interactive")
        for i in range(duration_ms // 22)
    ]
    requests += [
        Request(f"ide-{i:05d}", "tenant_ide_assist", 11.0 + i * 22, 420, 60, "interactive")
        for i in range(duration_ms // 22)
    ]
    requests += [
        Request(f"batch-{i:04d}", "tenant_batch_rag", i * 250.0, 3200, 350, "batch")
        for i in range(duration_ms // 250)
    ]
    config = build_config(
        PolicyConfig(max_batch_wait_ms=float(duration_ms)),
        LESSON_TENANTS,
    )
    return config, requests


LOAD_STEP_PHASES: Final = ((0.5, 60_000.0), (2.0, 20_000.0), (0.5, 60_000.0))
"""``load-step``'s offered load, as ``(times one server's capacity, duration ms)``."""


def load_step() -> tuple[Config, list[Request]]:
    """The lesson's tenants offered interactive work at 0.5, then 2, then 0.5 times one
    server's capacity (``LOAD_STEP_PHASES``): the scaling signal's and the autoscaler's trace
    (docs/observability.md)."""
    from tokenfair.sim.autoscale import step_trace

    config = lesson_config()
    return config, step_trace(config.policy.service_tokens_per_ms, LOAD_STEP_PHASES)


SCENARIOS: Final[dict[str, Callable[[], tuple[Config, list[Request]]]]] = {
    "noisy-neighbor": noisy_neighbor,
    "starvation": starvation,
    "load-step": load_step,
}
