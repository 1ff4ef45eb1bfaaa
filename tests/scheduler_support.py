"""Helpers for tests that drive the scheduling core by hand on a virtual clock."""

from __future__ import annotations

from tokenfair.core.tokenfair import TokenfairScheduler


def fill(fair: TokenfairScheduler, now_ms: float) -> list[str]:
    """Dispatch while the engine has a slot (the sidecar's and the simulator's loop); the ids
    started, in order."""
    started = []
    while fair.running < fair.policy.max_batch_requests:
        decision = fair.next_dispatch(now_ms)
        if decision is None:
            break
        started.append(decision.request_id)
    return started
