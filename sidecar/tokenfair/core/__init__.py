"""The scheduling core: pure, synchronous, deterministic; time is injected (milliseconds)."""

from __future__ import annotations

from typing import Final

from tokenfair.config import Config
from tokenfair.core.baselines import LessonDrrScheduler, RequestCountScheduler
from tokenfair.core.errors import DuplicateRequestError, SimulationStuckError, UnknownTenantError
from tokenfair.core.jobs import Decision, Lane, Request
from tokenfair.core.scheduler import Books, Scheduler, Settled, TenantView
from tokenfair.core.tokenfair import TokenfairScheduler

POLICIES: Final[dict[str, type[Scheduler]]] = {
    cls.name: cls for cls in (RequestCountScheduler, LessonDrrScheduler, TokenfairScheduler)
}
"""Every policy by name; ``tokenfair`` is the default."""
DEFAULT_POLICY: Final = TokenfairScheduler.name
LESSON_POLICIES: Final = (RequestCountScheduler.name, LessonDrrScheduler.name)


def make_scheduler(policy: str, config: Config, now_ms: float = 0.0) -> Scheduler:
    """Build the named policy's scheduler; an unknown name raises ``ValueError``."""
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})") from None
    return cls(config, now_ms)


__all__ = [
    "DEFAULT_POLICY",
    "LESSON_POLICIES",
    "POLICIES",
    "Books",
    "Decision",
    "DuplicateRequestError",
    "Lane",
    "Request",
    "Scheduler",
    "Settled",
    "SimulationStuckError",
    "TenantView",
    "UnknownTenantError",
    "make_scheduler",
]
